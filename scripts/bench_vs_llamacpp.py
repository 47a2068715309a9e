#!/usr/bin/env python3
"""Side-by-side CPU benchmark of pyfast and llama.cpp on the same GGUF files, in one run.

Needs a llama.cpp build you made yourself (pass its bin/ directory with --llama-bin; pyfast does
not ship or build llama.cpp). For each model file the two engines alternate, round after round,
so both see the same machine load; the table reports medians, and the pyfast / llama.cpp ratio as
the median of the rounds' ratios (each round's two figures measured back to back).

    python scripts/bench_vs_llamacpp.py --llama-bin ~/llama.cpp/build/bin --threads 2 --rounds 3

A fork with the same llama-bench works too: --engine names it in the tables and --llama-args
passes its own options, e.g. for ik_llama.cpp's run-time repacking:

    python scripts/bench_vs_llamacpp.py --llama-bin ~/ik_llama.cpp/build/bin --engine ik_llama.cpp \
        --llama-args="-rtr 1" --startup-runs 0 -m bench-models/llama-1b.Q4_K_M.gguf

Measured per file: pp512 and tg128 (llama-bench vs `pyfast bench`'s functions) and generation
with 1 thread, each engine's generation set against the read bandwidth probed right before it
(its share of the bound; the ratio of the two shares is the speedup at equal bandwidth), peak RSS while generating 64 tokens and the time
from loading the model to the first generated token (llama-simple vs pyfast.LLM; medians of
--startup-runs alternating starts, the file read into the page cache before each, pyfast's
bytecode compiled once as pip installs it; --startup-memory sets the memory state each start
begins in, which matters on VMs; --startup-only measures just that).
By default the files are the default model (SmolLM2-135M-Instruct Q4_1) and the same model
requantized with `pyfast quantize` to Q4_K_M and Q8_0 (made on first use next to the default
model).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Write a haiku about the sea."


def llama_bench(bin_dir: str, model: str, threads: int, pp: int, tg: int, reps: int,
                extra: list[str] | None = None) -> dict[str, float]:
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json"]
    cmd += ["-p", str(pp), "-n", str(tg)] + (extra or [])
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if p.returncode != 0:  # e.g. an option this build of llama-bench does not know
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"llama-bench failed (exit {p.returncode}): {' '.join(cmd)}\n{tail}")
    out = p.stdout
    res = {}
    for row in json.loads(out):
        key = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        res[key] = float(row["avg_ts"])
    return res


def pyfast_bench(model: str, threads: int, pp: int, tg: int, reps: int) -> dict[str, float]:
    from pyfast.bench import run_bench

    res = run_bench(model, [pp] if pp else [], [tg] if tg else [], [threads], reps=reps, bandwidth=False)
    return {r.test: r.tps_median for r in res}


def llama_startup(bin_dir: str, model: str, threads: int) -> tuple[float, float]:
    """(seconds from the model load's start to the first generated token, peak RSS MiB) for
    llama-simple: its "load time", which llama.cpp ends at the first evaluation (the prompt's;
    llama_context::synchronize), so it already holds the "prompt eval time" printed beside it."""
    exe = os.path.join(bin_dir, "llama-simple")
    if not os.path.exists(exe):
        return float("nan"), float("nan")
    cmd = ["/usr/bin/time", "-f", "maxrss_kb=%M", exe, "-m", model, "-n", "64", PROMPT]
    # errors="replace": a random-weight model prints arbitrary bytes
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    err = p.stderr
    rss = float(re.search(r"maxrss_kb=(\d+)", err).group(1)) / 1024
    load = float(re.search(r"load time =\s+([\d.]+) ms", err).group(1))
    return load / 1000, rss


_PYFAST_STARTUP = r"""
import sys, time
import pyfast
t0 = time.perf_counter()
llm = pyfast.LLM(sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]))
first = None
for chunk in llm.generate(sys.argv[3], max_tokens=64, temperature=0, stream=True, ignore_eos=True):
    if first is None:
        first = time.perf_counter() - t0
# VmHWM, not ru_maxrss: Linux carries the parent's peak across fork+exec into ru_maxrss.
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(first, int(hwm) / 1024)
"""


# pyfast as pip installs it, with its modules' bytecode compiled once: a checkout run under
# PYTHONDONTWRITEBYTECODE=1 would compile every module from source at each start (0.2-0.6 s here)
_PYC_DIR = tempfile.mkdtemp(prefix="pyfast-bench-pyc-")


def pyfast_startup(model: str, threads: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPYCACHEPREFIX=_PYC_DIR)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run([sys.executable, "-c", _PYFAST_STARTUP, model, str(threads), PROMPT], check=True,
                         capture_output=True, text=True, env=env).stdout.split()
    return float(out[0]), float(out[1])


def cache_file(model: str) -> None:
    """Read the file through the page cache, so that a start does not wait on the disk (on the
    2-core VM the cache lost parts of the files between runs, `fincore`, and the disk read 40 MB/s)."""
    with open(model, "rb") as f:
        while f.read(64 << 20):
            pass


# --startup-memory cold: seconds idle before a start. Linux's free page reporting (virtio-balloon
# on Firecracker / QEMU VMs) hands memory freed by the previous process back to the host about
# 2 s after the free; this VM's fresh-memory fills ran at cold speed after 15 s.
COLD_WAIT_S = 15.0


def prepare_memory(model: str, mode: str) -> None:
    """The memory state a start begins in (--startup-memory). On a VM that reports free memory to
    its host, the first touch of memory the host took back waits on the host (0.4-1 GB/s on the
    2-core VM, against several GB/s for memory it still backs), and how much of it is still backed
    depends on what the process before freed and how long ago: alternating starts then favour the
    engine that follows the one that frees more. "cold": idle COLD_WAIT_S, every start fills memory
    the host took back; "warm": fill and free twice the file's size (at most half the available
    memory) right before, the case of a machine without a balloon; "as-is": neither."""
    if mode == "cold":
        time.sleep(COLD_WAIT_S)
    elif mode == "warm":
        from pyfast.models import _mem_available

        n = 2 * os.path.getsize(model)
        avail = _mem_available()
        if avail is not None:
            n = min(n, avail // 2)
        import numpy as np

        buf = np.ones(n, dtype=np.uint8)  # every page written
        del buf


def startup_pair(bin_dir: str, model: str, threads: int, runs: int,
                 memory: str = "as-is") -> tuple[float, float, float, float]:
    """Medians of `runs` alternating starts (after one pyfast start that compiles its bytecode; the
    file read into the page cache before every start, then memory prepared as `memory` says):
    llama.cpp seconds, pyfast seconds, llama.cpp MiB, pyfast MiB."""
    cache_file(model)
    pyfast_startup(model, threads)
    ll, pf = [], []
    for _ in range(runs):
        cache_file(model)
        prepare_memory(model, memory)
        ll.append(llama_startup(bin_dir, model, threads))
        cache_file(model)
        prepare_memory(model, memory)
        pf.append(pyfast_startup(model, threads))
        print(f"start: {os.path.basename(model)} ({memory}) llama.cpp {ll[-1][0]:.3f} s, pyfast {pf[-1][0]:.3f} s",
              file=sys.stderr)
    med = statistics.median
    return med(x[0] for x in ll), med(x[0] for x in pf), med(x[1] for x in ll), med(x[1] for x in pf)


def default_models() -> list[str]:
    from pyfast.hub import resolve_model

    base = str(resolve_model(None))
    out = [base]
    for t in ("Q4_K_M", "Q8_0"):
        dst = base.replace(".Q4_1.gguf", f".{t}.gguf")
        if not os.path.exists(dst):
            subprocess.run([sys.executable, "-m", "pyfast.cli", "quantize", base, dst, t], check=True,
                           capture_output=True)
        out.append(dst)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", required=True, help="directory holding llama-bench (and llama-simple)")
    ap.add_argument("-m", "--model", action="append", help="GGUF file (repeatable; default: see above)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per file")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions inside each round")
    ap.add_argument("--startup-runs", type=int, default=3,
                    help="alternating start-up runs per file (median); 0 leaves the start-up table out")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up table")
    ap.add_argument("--startup-memory", choices=("as-is", "cold", "warm"), default="as-is",
                    help="memory state before each start (see prepare_memory): as-is (default), cold "
                         f"(idle {COLD_WAIT_S:.0f} s: a VM's host has taken freed memory back) or warm")
    ap.add_argument("-o", "--output", default=None, help="also write the markdown table here")
    ap.add_argument("--engine", default="llama.cpp", help="the other engine's name in the tables")
    ap.add_argument("--llama-args", default="", help="extra llama-bench arguments (one string, shell-split)")
    a = ap.parse_args()
    if a.startup_runs < 0 or (a.startup_only and a.startup_runs == 0):
        ap.error("--startup-runs must be >= 0 (>= 1 with --startup-only)")
    try:
        extra_args = shlex.split(a.llama_args)
    except ValueError as e:
        ap.error(f"--llama-args: {e}")
    eng = a.engine
    from pyfast.bench import decode_read_bytes, read_bandwidth_gbs
    from pyfast.models import Model

    models = a.model or default_models()
    lines = [f"Machine: {os.cpu_count()} CPUs; {a.rounds} alternating rounds x {a.reps} repetitions; "
             f"{time.strftime('%Y-%m-%d %H:%M')}; load average before: {os.getloadavg()[0]:.2f}", ""]
    lines += [f"| model | test | threads | {eng} t/s | pyfast t/s | ratio (median of rounds) | each round |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    extra = ["", "| model | 1-thread tg128 | ratio (each round) | read bandwidth | bandwidth bound | reached (pyfast) "
             f"| reached ({eng}) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    start = ["", f"| model | load -> first token, {eng} | pyfast | ratio | peak RSS {eng} | pyfast | difference |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"] if a.startup_runs else []
    for m in models:
        name = os.path.basename(m)
        if a.startup_only:
            lt, pt, lr, pr = startup_pair(a.llama_bin, m, a.threads, a.startup_runs, a.startup_memory)
            start.append(f"| {name} | {lt:.3f} s | {pt:.3f} s | {pt / lt:.2f}x | {lr:.0f} MiB | {pr:.0f} MiB "
                         f"| {pr - lr:+.0f} MiB |")
            print(f"done {name}", file=sys.stderr)
            continue
        # bytes one token reads (used experts only, no embedding table unless it is the output)
        size = decode_read_bytes(Model(m, mmap=True))
        ll: dict[str, list[float]] = {}
        pf: dict[str, list[float]] = {}
        # generation, per thread count: each engine's t/s and the read bandwidth probed right
        # before it (the host's bandwidth moves by tens of percent within a minute)
        gen: dict[int, dict[str, list[tuple[float, float]]]] = {nt: {"ll": [], "pf": []} for nt in (a.threads, 1)}

        def tg(engine: str, nt: int) -> None:
            bw = read_bandwidth_gbs(nt)
            if engine == "ll":
                t = llama_bench(a.llama_bin, m, nt, 0, 128, a.reps, extra_args)["tg128"]
            else:
                t = pyfast_bench(m, nt, 0, 128, a.reps)["tg128"]
            gen[nt][engine].append((t, bw))

        for rnd in range(a.rounds):
            # the engine that goes first alternates from round to round
            order = ("ll", "pf") if rnd % 2 == 0 else ("pf", "ll")
            for e in order:
                src = llama_bench(a.llama_bin, m, a.threads, 512, 0, a.reps, extra_args) if e == "ll" else \
                    pyfast_bench(m, a.threads, 512, 0, a.reps)
                (ll if e == "ll" else pf).setdefault("pp512", []).append(src["pp512"])
            for nt in (a.threads, 1):
                for e in order:
                    tg(e, nt)
        med = statistics.median
        rr = [y / x for x, y in zip(ll["pp512"], pf["pp512"])]
        lines.append(f"| {name} | pp512 | {a.threads} | {med(ll['pp512']):.1f} | {med(pf['pp512']):.1f} "
                     f"| {med(rr):.2f}x | {', '.join(f'{r:.2f}' for r in rr)} |")
        for nt in (a.threads, 1):
            g = gen[nt]
            lt, pt = [t for t, _ in g["ll"]], [t for t, _ in g["pf"]]
            # each round's ratio (the two engines back to back), then their median
            rr = [y / x for x, y in zip(lt, pt)]
            # each engine's share of the bound at the bandwidth probed just before it
            fl = [t * size / (bw * 1e9) for t, bw in g["ll"]]
            fp = [t * size / (bw * 1e9) for t, bw in g["pf"]]
            bw = med([b for _, b in g["ll"] + g["pf"]])
            if nt == a.threads:
                lines.append(f"| {name} | tg128 | {nt} | {med(lt):.1f} | {med(pt):.1f} | {med(rr):.2f}x "
                             f"| {', '.join(f'{r:.2f}' for r in rr)} |")
                # when llama.cpp itself reaches most of the bound, no engine can be much faster
                lines.append(f"| {name} | tg128 bound, {nt} threads | | {bw:.1f} GB/s, {bw * 1e9 / size:.0f} t/s "
                             f"| reached: {eng} {100 * med(fl):.0f}%, pyfast {100 * med(fp):.0f}% "
                             f"| {med(fp) / med(fl):.2f}x at equal bandwidth | |")
            else:
                extra.append(f"| {name} | pyfast {med(pt):.1f} / {eng} {med(lt):.1f} t/s | {med(rr):.2f}x "
                             f"({', '.join(f'{r:.2f}' for r in rr)}) | {bw:.1f} GB/s | {bw * 1e9 / size:.0f} t/s "
                             f"| {100 * med(fp):.0f}% | {100 * med(fl):.0f}% |")
        if a.startup_runs:
            lt, pt, lr, pr = startup_pair(a.llama_bin, m, a.threads, a.startup_runs, a.startup_memory)
            start.append(f"| {name} | {lt:.3f} s | {pt:.3f} s | {pt / lt:.2f}x | {lr:.0f} MiB | {pr:.0f} MiB "
                         f"| {pr - lr:+.0f} MiB |")
        print(f"done {name}", file=sys.stderr)
    if a.startup_only:
        lines = [f"Machine: {os.cpu_count()} CPUs; {a.startup_runs} alternating starts per file, memory "
                 f"{a.startup_memory}; "
                 f"{time.strftime('%Y-%m-%d %H:%M')}; load average before: {os.getloadavg()[0]:.2f}", ""]
    text = "\n".join((lines if a.startup_only else lines + extra) + start)
    print(text)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
