"""Server throughput under the 64-client load, for several source trees in one run.

Each tree is a directory holding a ``pyfast/`` package (e.g. ``git archive <commit> pyfast | tar -x
-C /tmp/base``) and is served with ``python -m pyfast serve`` on the same model and flags; the
trees take turns (ABBA order over ``--reps`` repetitions) so that a change in the machine's load
hits them alike. Each turn runs the load of ``tests/server/test_load.py`` (64 streaming clients x
4 greedy chat requests, ``--parallel 8``) once and records completion tokens per second. Greedy
texts must be identical across trees (the check fails loudly otherwise).

    python scripts/bench_server_load.py --tree base=/tmp/base --tree new=. --reps 3
    python scripts/bench_server_load.py --tree base=/tmp/base --tree new=. --spec-type ngram-simple

Prints per-turn figures, each tree's median tokens/s and the ratio of every tree to the first.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.server.helpers import HOST, free_port  # noqa: E402
from tests.server.test_load import _requests, _run, _summary  # noqa: E402


def serve(tree: Path, model: str, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    proc = subprocess.Popen([sys.executable, "-m", "pyfast", "serve", "--host", HOST, "--port", str(port),
                             "--log-level", "warning", "-m", model, "--parallel", "8", "--ctx-size", "8192",
                             "--threads", str(threads), *extra],
                            cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server from {tree} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"server from {tree} did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR (a directory holding pyfast/)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="server compute threads (the load test uses 1)")
    ap.add_argument("--model", default=None, help="GGUF path (default: the default model)")
    ap.add_argument("--spec-type", default=None, help="serve with this --spec-type (e.g. ngram-simple)")
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args()
    from pyfast.hub import resolve_model

    model = str(a.model or resolve_model("smollm2", quiet=True))
    trees = [(n, Path(d).resolve()) for n, d in (t.split("=", 1) for t in a.tree)]
    extra = ["--spec-type", a.spec_type] if a.spec_type else []
    plan = _requests()
    warm = [[dict(plan[0][0], max_tokens=4)]]
    tps: dict[str, list[float]] = {n: [] for n, _ in trees}
    texts: dict[str, list[str]] = {}
    for rep in range(a.reps):
        order = trees if rep % 2 == 0 else trees[::-1]
        for name, tree in order:
            proc, url = serve(tree, model, a.threads, extra)
            try:
                asyncio.run(_run(url, warm, concurrent=False))
                res, wall = asyncio.run(_run(url, plan, concurrent=True))
            finally:
                proc.terminate()
                proc.wait(15)
            bad = [r for rs in res for r in rs if r["status"] != 200 or r["errors"]]
            if bad:
                raise RuntimeError(f"{name}: failed requests: {bad[:2]}")
            s = _summary(res, wall)
            tps[name].append(s["tokens_per_s"])
            got = [r["text"] for rs in res for r in rs]
            if texts and got != next(iter(texts.values())):
                raise RuntimeError(f"{name}: greedy texts differ from {next(iter(texts))}'s")
            texts.setdefault(name, got)
            print(f"rep {rep} {name}: {s['tokens_per_s']} tok/s, {s['wall_s']} s, ttft p50 {s['ttft_p50_ms']} ms",
                  flush=True)
    base = trees[0][0]
    med = {n: statistics.median(v) for n, v in tps.items()}
    report = {"spec_type": a.spec_type, "threads": a.threads, "tokens_per_s": tps, "median": med,
              "ratio_to_" + base: {n: round(med[n] / med[base], 3) for n in med},
              "ratio_per_rep": {n: [round(x / y, 3) for x, y in zip(tps[n], tps[base])] for n in med}}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
