"""Hostile GGUFs: seeded mutations of small fixtures through ``LLM()`` and every CLI command that
reads a model, in a subprocess with a capped address space. Each case must end in a clean
one-line error or a working load, within bounded time and memory.

The specific edits seen in the wild (issue 21) are pinned in ``test_gguf_metadata.py``.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from tests.reference.tiny_gguf import write_tiny_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HYBRID = os.path.join(ROOT, "tests", "fixtures", "hybrid", "qwen35.gguf")
SEED = 21
N_CASES = 320
CASE_LIMIT_S = 10.0  # typical cases take milliseconds; the slowest (bench, serve) about 1-2 s
RSS_LIMIT_MB = 1500  # the worker's peak RSS over all cases (a runaway allocation would be GBs)


@pytest.fixture(scope="module")
def fuzz_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_fuzz")
    tiny = d / "tiny.gguf"
    write_tiny_llama(tiny, n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, n_ff=32)
    fixtures = [str(tiny), HYBRID] if os.path.exists(HYBRID) else [str(tiny)]
    env = dict(os.environ, FUZZ_AS_LIMIT=str(6 << 30))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gguf_fuzz_worker.py"), str(d), str(SEED),
                           str(N_CASES), *fixtures], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in open(d / "results.jsonl")]
    assert lines and lines[-1].get("done"), "the worker did not finish"
    return lines[:-1], lines[-1]


def test_every_case_ends_cleanly(fuzz_results):
    cases, _ = fuzz_results
    assert len(cases) == N_CASES
    crashes = [c for c in cases if c["outcome"] == "crash"]
    assert not crashes, "\n\n".join(f"case {c['case']} {c['cmd']} ({c.get('desc')}): {c['type']}: {c['message']}\n"
                                    f"{c['traceback']}" for c in crashes[:5])
    for c in cases:
        if c["outcome"] == "error":  # LLM(): a ValueError with a one-line message
            assert c["type"] in ("ValueError", "GGUFError"), c
            assert c["message"] and "\n" not in c["message"], c
        elif c["outcome"] == "cli":
            err = c["stderr"]
            assert "Traceback" not in err, c
            if c["rc"] != 0:
                assert c["rc"] in (1, 2), c
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), c
        else:
            assert c["outcome"] == "loaded", c
            assert all(0 <= t < c["n_vocab"] for t in c["tokens"]), c


def test_cases_are_bounded_in_time_and_memory(fuzz_results):
    cases, done = fuzz_results
    slow = [(c["case"], c.get("desc"), round(c["seconds"], 2)) for c in cases if c["seconds"] > CASE_LIMIT_S]
    assert not slow, slow
    peak_mb = max(c["maxrss_kb"] for c in cases) / 1024
    assert peak_mb < RSS_LIMIT_MB, peak_mb


def test_the_mutations_reach_both_outcomes_on_every_command(fuzz_results):
    """The suite is only worth something if mutations both load and fail, on every command."""
    cases, _ = fuzz_results
    by_cmd = collections.defaultdict(collections.Counter)
    for c in cases:
        ok = c["outcome"] == "loaded" or (c["outcome"] == "cli" and c["rc"] == 0)
        by_cmd[c["cmd"]]["ok" if ok else "error"] += 1
    for cmd, n in by_cmd.items():
        assert n["error"] >= 5, (cmd, n)
        if cmd != "quantize":  # quantize reads tensors only: few metadata edits stop it
            assert n["ok"] >= 1, (cmd, n)
    descs = " ".join(c.get("desc", "") for c in cases)
    for kind in ("truncated", "flipped", "block_count", "token_embd.weight", "without tensor", "not valid UTF-8"):
        assert kind in descs, kind
