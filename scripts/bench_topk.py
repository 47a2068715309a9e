#!/usr/bin/env python3
"""The executor's top-k (``topk`` / ``topk_mask``, the DSA indexer's selection) on rows past 1024
columns against a full sort of each row (numpy's stable argsort), CPU.

For each (rows, columns, k) the script checks that both pick the same indices (ties: the lower
index) and prints the median time of each over ``--reps`` runs and the ratio.

Usage: ``python scripts/bench_topk.py [--threads N] [--reps R] [--device vulkan:0]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pyfast._loader import native  # noqa: E402

SHAPES = [(1, 1023, 512), (1, 1025, 512), (4, 4096, 2048), (16, 8192, 2048), (1, 70000, 2048),
          (64, 16384, 2048)]


def plan_for(op: str, R: int, N: int, k: int, pool, device):
    g = native.Graph()
    x = g.input("x", native.DType.F32, [R, N])
    g.output(g.topk(x, k) if op == "topk" else g.topk_mask(x, k), "y")
    return native.Plan(g, pool, device) if device is not None else native.Plan(g, pool)


def timed(f, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    device = None
    if a.device:
        from pyfast.device import open_device

        device = open_device(a.device)
    pool = native.ThreadPool(a.threads)
    rng = np.random.default_rng(0)
    print(f"{'rows':>5} {'cols':>6} {'k':>5} {'topk ms':>9} {'mask ms':>9} {'sort ms':>9} {'sort/topk':>9}")
    for R, N, k in SHAPES:
        x = rng.standard_normal((R, N)).astype(np.float32)
        x[:, ::7] = x[:, :1]  # ties
        want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        p_top, p_mask = plan_for("topk", R, N, k, pool, device), plan_for("topk_mask", R, N, k, pool, device)
        for p in (p_top, p_mask):
            p.set_input("x", x)
        p_top.run()
        p_mask.run()
        assert np.array_equal(p_top.output("y"), want), (R, N, k)
        m = p_mask.output("y")
        assert all(set(np.flatnonzero(m[r] == 0)) == set(want[r]) for r in range(R)), (R, N, k)
        t_top = timed(p_top.run, a.reps)
        t_mask = timed(p_mask.run, a.reps)
        t_sort = timed(lambda: np.argsort(-x, axis=-1, kind="stable")[:, :k], a.reps)
        print(f"{R:>5} {N:>6} {k:>5} {t_top * 1e3:>9.3f} {t_mask * 1e3:>9.3f} {t_sort * 1e3:>9.3f} "
              f"{t_sort / t_top:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
