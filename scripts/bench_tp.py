"""Tensor-parallel decode scaling: tokens/s of one process vs N MPI ranks, and the share of the
time the ranks spend inside allreduce (docs/tensor-parallel.md).

    python scripts/bench_tp.py -m MODEL -t 1            # 1 rank x 1 thread
    python scripts/bench_tp.py -m MODEL -t 2            # 1 rank x 2 threads
    mpirun -np 2 python scripts/bench_tp.py -m MODEL -t 1   # 2 ranks x 1 thread each

Each run: a prompt of -p tokens, then -n greedy decode steps (one token per step), repeated -r
times on a fresh sequence; the best repetition's decode tokens/s is reported (the machine is
shared), with the allreduce time and calls of every rank during that repetition.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-p", "--prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=48)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    ap.add_argument("--shard", default=None, metavar="R/N",
                    help="one process running rank R's slice of an N-way split with a one-rank communicator "
                         "(the reduces copy): the compute one rank does per token, with no waiting for others")
    ap.add_argument("--comm-only", type=int, default=0, metavar="N",
                    help="only time N allreduces of one decode step's payload (n_embd floats), no model")
    a = ap.parse_args()
    if a.comm_only:
        return comm_only(a)

    from pyfast.context import Context
    from pyfast.hub import resolve_model
    from pyfast.models import Model
    from pyfast.parallel import launched_by_mpi, mpi_group, tp

    path = str(resolve_model(a.model, quiet=True))
    group = mpi_group() if launched_by_mpi() else None
    n = group.size if group is not None else 1
    kw = dict(n_ctx=a.prompt + a.n_gen + 8, n_threads=a.threads)
    if a.shard:
        from pyfast._loader import native
        from pyfast.parallel import Group

        r, n_sh = (int(v) for v in a.shard.split("/"))
        model = Model(path, mmap=True)
        model.enable_tp(Group(r, n_sh, native.Communicator.local()))
        ctx = Context(model, **kw)
    elif n > 1:
        if group.rank != 0:
            tp.follow(group, lambda p, **o: tp.load_sharded(p, group, **o))
            return 0
        tp._register_stop(group)
        ctx = tp.TPContext(tp.leader(path, group), group, **kw)
    else:
        ctx = Context(Model(path), **kw)
    V = ctx.model.n_vocab
    prompt = [(7 * i + 11) % V for i in range(a.prompt)]
    best = None
    for _ in range(a.reps):
        ctx.remove_seq(0)
        ctx.decode(prompt, positions=range(a.prompt), seq_ids=0)
        tok = int(ctx.last_argmax()[0])
        if n > 1:
            s0 = ctx.comm_stats()
        t0 = time.perf_counter()
        for i in range(a.n_gen):
            ctx.decode_step(tok, a.prompt + i, 0)
            tok = int(ctx.last_argmax()[0])
        dt = time.perf_counter() - t0
        rec = {"tps": a.n_gen / dt, "s_per_tok": dt / a.n_gen}
        if n > 1:
            s1 = ctx.comm_stats()
            rec["comm_s_per_tok_rank0"] = (s1["seconds"] - s0["seconds"]) / a.n_gen
            rec["reduces_per_tok"] = (s1["calls"] - s0["calls"]) / a.n_gen
            rec["comm_share_rank0"] = (s1["seconds"] - s0["seconds"]) / dt
            rec["bytes_per_tok"] = (s1["bytes"] - s0["bytes"]) / a.n_gen
        if best is None or rec["tps"] > best["tps"]:
            best = rec
    out = {"model": path.rsplit("/", 1)[-1], "ranks": n, "threads": a.threads, **best}
    if a.shard:
        out["shard"] = a.shard
    print(json.dumps(out))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


def comm_only(a) -> int:
    """The transport alone: the latency of an allreduce of d floats (d = the model's n_embd)
    with both ranks doing nothing else, as in a decode step's reduces."""
    from pyfast.gguf import GGUFReader
    from pyfast.hub import resolve_model
    from pyfast.parallel import mpi_group

    md = GGUFReader(str(resolve_model(a.model, quiet=True))).metadata
    arch = md["general.architecture"]
    d = int(md[f"{arch}.embedding_length"])
    group = mpi_group()
    x = np.ones(d, np.float32)
    for _ in range(50):
        group.comm.allreduce(x)
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(a.comm_only):
        group.comm.allreduce(x)
    dt = time.perf_counter() - t0
    if group.rank == 0:
        print(json.dumps({"ranks": group.size, "floats": d, "us_per_allreduce": dt / a.comm_only * 1e6}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
