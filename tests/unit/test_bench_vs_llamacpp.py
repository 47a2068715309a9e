"""scripts/bench_vs_llamacpp.py against a stand-in llama-bench: the per-round ratios and their
median, the other engine's extra arguments and name, and leaving the start-up table out."""
import json
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A llama-bench that logs its arguments and answers from a table: the 2-thread pp512 run of round
# i (counted in a file) reports PP[i], its tg128 run TG[i]; a 1-thread run reports TG1.
FAKE = r'''#!{python}
import json, sys
from pathlib import Path
here = Path(sys.argv[0]).resolve().parent
with open(here / "calls.log", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
a = sys.argv[1:]
p, n, t = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1]), int(a[a.index("-t") + 1])
rows = []
if t == 1:
    rows.append({{"n_prompt": 0, "n_gen": n, "avg_ts": {tg1}}})
else:
    c = here / ("round_pp" if p else "round_tg")
    i = int(c.read_text()) if c.exists() else 0
    c.write_text(str(i + 1))
    rows.append({{"n_prompt": p, "n_gen": 0, "avg_ts": {pp}[i]}} if p else {{"n_prompt": 0, "n_gen": n, "avg_ts": {tg}[i]}})
print(json.dumps(rows))
'''


@pytest.fixture
def script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_vs_llamacpp as mod
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return mod


def run(script, monkeypatch, tmp_path, args):
    import pyfast.bench
    import pyfast.models

    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "llama-bench"
    exe.write_text(FAKE.format(python=sys.executable, pp=[100.0, 200.0], tg=[20.0, 40.0], tg1=10.0))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    calls = {"pp": 0, "tg": 0}

    def fake_pyfast(model, threads, pp, tg, reps):
        assert (pp == 0) != (tg == 0)  # prompt and generation are separate runs
        if threads == 1:
            return {"tg128": 15.0}
        k = "pp" if pp else "tg"
        i = calls[k]
        calls[k] += 1
        return {"pp512": [250.0, 300.0][i]} if pp else {"tg128": [30.0, 48.0][i]}

    # probes in call order; round 0 runs llama.cpp first, round 1 pyfast (2 threads, then 1)
    probes = iter([30.0, 40.0, 30.0, 30.0, 40.0, 30.0, 30.0, 30.0])
    monkeypatch.setattr(script, "pyfast_bench", fake_pyfast)
    monkeypatch.setattr(pyfast.bench, "decode_read_bytes", lambda m: 1e9)
    monkeypatch.setattr(pyfast.bench, "read_bandwidth_gbs", lambda nth: next(probes))
    monkeypatch.setattr(pyfast.models, "Model", lambda *a, **k: None)
    out = tmp_path / "out.md"
    monkeypatch.setattr(sys, "argv", ["bench_vs_llamacpp.py", "--llama-bin", str(bindir), "-m", str(tmp_path / "x.gguf"),
                                      "--rounds", "2", "-r", "1", "-o", str(out)] + args)
    assert script.main() == 0
    logged = [json.loads(line) for line in (bindir / "calls.log").read_text().splitlines()]
    return out.read_text(), logged


def test_ratios_engine_name_and_extra_args(script, monkeypatch, tmp_path):
    text, logged = run(script, monkeypatch, tmp_path,
                       ["--engine", "ik_llama.cpp", "--llama-args=-rtr 1", "--startup-runs", "0"])
    # every llama-bench call carries the extra arguments, 2 rounds x (pp512, tg128, 1-thread tg128)
    assert len(logged) == 6 and all(c[-2:] == ["-rtr", "1"] for c in logged)
    assert "| ik_llama.cpp t/s |" in text and "reached (ik_llama.cpp)" in text
    # pp512: rounds 250/100 and 300/200 -> 2.50, 1.50; the median of the rounds' ratios is 2.00
    # (the ratio of the medians would be 275 / 150 = 1.83)
    assert "| x.gguf | pp512 | 2 | 150.0 | 275.0 | 2.00x | 2.50, 1.50 |" in text
    assert "| x.gguf | tg128 | 2 | 30.0 | 39.0 | 1.35x | 1.50, 1.20 |" in text
    # shares of the bound, each at its own probe: llama.cpp 20/30 and 40/30 (median 100%), pyfast
    # 30/40 and 48/40 (median 97.5%); the 2-thread probes' median is 35 GB/s
    assert "| x.gguf | tg128 bound, 2 threads | | 35.0 GB/s, 35 t/s | reached: ik_llama.cpp 100%, pyfast 98% " \
           "| 0.97x at equal bandwidth | |" in text
    # 1 thread: 15 / 10 each round; bound 30 GB/s / 1 GB per token = 30 t/s
    assert "| x.gguf | pyfast 15.0 / ik_llama.cpp 10.0 t/s | 1.50x (1.50, 1.50) | 30.0 GB/s | 30 t/s | 50% | 33% |" in text
    assert "load -> first token" not in text


def test_default_names_llama_cpp_and_rejects_negative_startup_runs(script, monkeypatch, tmp_path):
    monkeypatch.setattr(script, "startup_pair", lambda *a: (1.0, 0.8, 700.0, 650.0))
    text, logged = run(script, monkeypatch, tmp_path, [])
    assert all("-rtr" not in c for c in logged)
    assert "| llama.cpp t/s |" in text
    assert "| x.gguf | 1.000 s | 0.800 s | 0.80x | 700 MiB | 650 MiB | -50 MiB |" in text
    monkeypatch.setattr(sys, "argv", ["bench_vs_llamacpp.py", "--llama-bin", str(tmp_path), "--startup-runs", "-1"])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 2


def test_llama_bench_failure_and_bad_args_are_clear_errors(script, monkeypatch, tmp_path):
    exe = tmp_path / "llama-bench"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('error: unknown argument: -rtr', file=sys.stderr)\nsys.exit(1)\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SystemExit) as e:
        script.llama_bench(str(tmp_path), "x.gguf", 2, 512, 128, 1, ["-rtr", "1"])
    assert "llama-bench failed (exit 1)" in str(e.value.code) and "unknown argument: -rtr" in str(e.value.code)
    monkeypatch.setattr(sys, "argv", ["bench_vs_llamacpp.py", "--llama-bin", str(tmp_path), "--llama-args", "-x 'open"])
    with pytest.raises(SystemExit) as e:
        script.main()
    assert e.value.code == 2


def test_startup_memory_state_precedes_every_start(script, monkeypatch, tmp_path):
    """--startup-memory: each start (either engine) comes after the file is read into the page
    cache and then the memory state is set (cold: idle COLD_WAIT_S; warm: memory filled and freed)."""
    events = []
    model = tmp_path / "x.gguf"
    model.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(script, "cache_file", lambda m: events.append("cache"))
    monkeypatch.setattr(script.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(script, "llama_startup", lambda *a: events.append("ll") or (2.0, 700.0))
    monkeypatch.setattr(script, "pyfast_startup", lambda *a: events.append("pf") or (1.0, 500.0))
    assert script.startup_pair("bin", str(model), 2, 2, "cold") == (2.0, 1.0, 700.0, 500.0)
    cold = ["cache", ("sleep", script.COLD_WAIT_S)]
    # one pyfast start compiles the bytecode first; then llama.cpp and pyfast alternate
    assert events == ["cache", "pf"] + (cold + ["ll"] + cold + ["pf"]) * 2
    events.clear()
    import numpy as np
    real_ones = np.ones
    monkeypatch.setattr(np, "ones", lambda n, dtype: events.append(("fill", n)) or real_ones(n, dtype))
    script.startup_pair("bin", str(model), 2, 1, "warm")
    fill = ("fill", 2 * 4096)  # twice the file, written before each start; never idle
    assert events == ["cache", "pf", "cache", fill, "ll", "cache", fill, "pf"]
    events.clear()
    script.startup_pair("bin", str(model), 2, 1)
    assert events == ["cache", "pf", "cache", "ll", "cache", "pf"]


def test_llama_startup_is_its_load_time(script, tmp_path):
    """llama.cpp's "load time" ends at the first evaluation (the prompt's), so load -> first token
    is that figure alone; adding the "prompt eval time" printed beside it would count the prompt
    twice."""
    exe = tmp_path / "llama-simple"
    exe.write_text(f"#!{sys.executable}\nimport sys\n"
                   "print('llama_perf_context_print:        load time =    2570.30 ms', file=sys.stderr)\n"
                   "print('llama_perf_context_print: prompt eval time =    1460.41 ms /     8 tokens', file=sys.stderr)\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    t, rss = script.llama_startup(str(tmp_path), "x.gguf", 2)
    assert t == pytest.approx(2.5703) and rss > 0
