"""Per-token cost of Context.decode's paths for one generated token: the general (grouped) path
(seq_ids as a list), the one-token path via decode(..., seq_ids=int) and decode_step, alternating
in one process. Prints per path the median wall ms per token and the part outside the plan
(wall - Context.t_compute: Python, inputs, logits copy).

    python scripts/bench_one_token_path.py MODEL.gguf   (env THREADS=1, NTOK=32, PAIRS=3)
"""
import os
import sys
import time

import numpy as np

from pyfast.context import Context
from pyfast.models import Model

m = Model(sys.argv[1])
ctx = Context(m, n_ctx=1024, n_threads=int(os.environ.get("THREADS", "1")))
N = int(os.environ.get("NTOK", "32"))
toks = np.random.default_rng(0).integers(0, m.n_vocab, N).tolist()
NAMES = ("general", "decode(seq_ids=int)", "decode_step")


def run(mode):
    ctx.clear()
    ctx.t_compute = 0.0
    t0 = time.perf_counter()
    for i, t in enumerate(toks):
        if mode == 0:
            ctx.decode([t], positions=[i], seq_ids=[0])
        elif mode == 1:
            ctx.decode([t], positions=[i], seq_ids=0)
        else:
            ctx.decode_step(t, i, 0)
    dt = time.perf_counter() - t0
    return dt / N * 1e3, (dt - ctx.t_compute) / N * 1e3


for g in range(3):
    run(g)
res = {g: [] for g in range(3)}
for _ in range(int(os.environ.get("PAIRS", "3"))):
    for g in range(3):
        res[g].append(run(g))
for g in range(3):
    wall, outside = np.median(np.array(res[g]), axis=0)
    print(f"{NAMES[g]:20s} {wall:8.3f} ms/token, outside the plan {outside:.3f} ms")
