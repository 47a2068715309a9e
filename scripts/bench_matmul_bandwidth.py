#!/usr/bin/env python3
"""Weight bytes per second of one-row (decode) quantized matmuls, against the read-bandwidth probe.

Each run multiplies one activation row by `--weights` distinct [N, K] weights of each type (random
values, packed x16 where the type allows it, as the model loader does), so the weights stream from
memory rather than from cache; the best of `--reps` runs is reported as GB/s of weight bytes and as
a fraction of `pyfast._native.read_bandwidth` measured in the same process and thread count.

    python scripts/bench_matmul_bandwidth.py -t 2
    python scripts/bench_matmul_bandwidth.py -t 1 --types Q4_K,Q6_K --rows 4
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from pyfast._loader import native as N


def bench(dtype: str, threads: int, rows: int, n: int, k: int, n_weights: int, reps: int, seed: int = 0) -> float:
    dt = getattr(N.DType, dtype)
    rng = np.random.default_rng(seed)
    pool_rows = 256
    x = (rng.standard_normal((pool_rows, k)) / np.sqrt(k)).astype(np.float32)
    q = np.asarray(N.quantize_tensor(dt, x, 0)).view(np.uint8).reshape(pool_rows, -1)
    g = N.Graph()
    xi = g.input("x", N.DType.F32, [rows, k])
    keep = []
    for i in range(n_weights):
        w = np.ascontiguousarray(q[rng.integers(0, pool_rows, n)])
        packed = bool(N.packable(dt)) and n % 16 == 0
        if packed:
            N.pack_x16(dt, w, n, k)
        keep.append(w)
        g.output(g.matmul(xi, g.external(f"w{i}", dt, [n, k], w, packed=packed)), f"y{i}")
    plan = N.Plan(g, N.ThreadPool(threads))
    plan.set_input("x", rng.standard_normal((rows, k)).astype(np.float32))
    plan.run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        plan.run()
        best = min(best, time.perf_counter() - t0)
    return sum(w.nbytes for w in keep) / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1: decode)")
    ap.add_argument("-N", type=int, default=8192, help="weight rows")
    ap.add_argument("-K", type=int, default=2048, help="weight columns")
    ap.add_argument("--weights", type=int, default=12, help="distinct weights per run")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    bw = N.read_bandwidth(256 << 20, a.threads, 3) / 1e9
    print(f"threads {a.threads}: read-bandwidth probe {bw:.1f} GB/s")
    print("| type | rows | GB/s of weights | of the probe |\n| --- | ---: | ---: | ---: |")
    for t in a.types.split(","):
        gbs = bench(t.strip(), a.threads, a.rows, a.N, a.K, a.weights, a.reps)
        print(f"| {t} | {a.rows} | {gbs:.1f} | {100 * gbs / bw:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
