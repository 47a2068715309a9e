"""The MPI program of the tensor-parallel tests: ``mpirun -np N python -m tests.tp.worker OUT.json
CHECK...``. Rank 0 runs each check twice, split over the N ranks (``pyfast.parallel``) and in one
process unsplit, and writes the measured differences to OUT.json; the other ranks follow it.

Checks (``name:path``):
  logits:PATH   prefill logits of every row, incremental decode, two sequences in one batch, a
                truncate (rollback) and re-decode, save_state / restore_state into a cleared
                sequence: max relative error (max|a - b| / max|b| per row) of each against the
                unsplit run, and the number of allreduce calls per decoded token.
  greedy:PATH   LLM.generate greedy tokens, split and unsplit.
  mtp:PATH      LLM.generate greedy tokens with draft-mtp speculation (rank 0 drafts unsplit,
                rejected drafts roll the split recurrent state back) against plain unsplit ones.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def rel(a, b) -> float:
    a = np.atleast_2d(np.asarray(a, np.float64))
    b = np.atleast_2d(np.asarray(b, np.float64))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


def check_logits(path: str, group) -> dict:
    from pyfast.context import Context
    from pyfast.models import Model
    from pyfast.parallel import tp

    model = tp.leader(path, group)
    kw = dict(n_ctx=96, n_threads=1, kv_dtype="f32", n_seq_max=3, n_rollback=3, n_ubatch=16)
    split, ref = tp.TPContext(model, group, **kw), Context(Model(path), **kw)
    out: dict = {"path": path, "size": group.size}
    V = ref.model.n_vocab
    toks = [(7 * i + 3) % V for i in range(21)]
    out["prefill"] = rel(split.decode(toks, logits="all"), ref.decode(toks, logits="all"))
    steps = []
    c0 = group.comm_stats()["calls"]
    for t in (5, 9, 2, 11):
        steps.append(rel(split.decode([t]), ref.decode([t])))
    out["steps"] = max(steps)
    out["reduces_per_token"] = (group.comm_stats()["calls"] - c0) / 4
    # rollback: a 4-token batch (a verify batch), its last 3 tokens dropped, others in their place
    out["verify"] = rel(split.decode([1, 2, 3, 4], logits="all"), ref.decode([1, 2, 3, 4], logits="all"))
    for c in (split, ref):
        c.truncate(0, len(toks) + 4 + 4 - 3)
    out["after_rollback"] = rel(split.decode([4, 8, 1], logits="all"), ref.decode([4, 8, 1], logits="all"))
    # two sequences in one batch (sequence 1 new, sequence 0 continuing)
    a, s = [3, 1, 4, 1, 5], [2, 6]
    out["two_seqs"] = rel(split.decode(a + s, seq_ids=[1] * 5 + [0] * 2, logits="all"),
                          ref.decode(a + s, seq_ids=[1] * 5 + [0] * 2, logits="all"))
    # save / restore (T3.4): save sequence 0, decode on, restore into sequence 2, decode the same
    st_s, st_r = split.save_state(0), ref.save_state(0)
    split.decode([9, 9]), ref.decode([9, 9])
    split.restore_state(2, st_s), ref.restore_state(2, st_r)
    out["restored"] = rel(split.decode([9, 9], seq_ids=2, logits="all"), ref.decode([9, 9], seq_ids=2, logits="all"))
    out["isa_noise"] = isa_noise(path, toks, kw)
    return out


def isa_noise(path: str, toks: list[int], kw: dict) -> float:
    """How far one process's own logits move between the scalar reference ISA and the best one
    (prefill + 4 steps): the size of a summation-order change on this model. Quantized matmuls
    quantize their activations to 8 bits, so a 1e-7 change can flip one rounding step and move
    the logits by ~1e-2; float weights stay near 1e-7. TP changes the summation order too."""
    from pyfast._loader import native
    from pyfast.context import Context
    from pyfast.models import Model

    outs = []
    old = native.cpu_isa()
    try:
        for isa in ("scalar", native.cpu_best_isa()):
            native.set_cpu_isa(isa)
            c = Context(Model(path), **kw)
            outs.append(np.concatenate([c.decode(toks, logits="all")] + [c.decode([t]) for t in (5, 9, 2, 11)]))
    finally:
        native.set_cpu_isa(old)
    return rel(outs[1], outs[0])


def check_greedy(path: str, group, n: int = 24, spec: bool = False) -> dict:
    from pyfast.llm import LLM
    from pyfast.spec.config import SpecConfig

    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    kw = dict(n_ctx=256, n_threads=1)
    sc = SpecConfig(types="draft-mtp", draft_max=3) if spec else None
    split = LLM(path, tp=group.size, speculative=sc, **kw)
    ref = LLM(path, **kw)
    out: dict = {"path": path, "size": group.size, "split": [], "ref": [], "drafted": 0, "accepted": 0,
                 "margins": []}
    for p in prompts:
        r = split.generate(p, max_tokens=n, temperature=0, ignore_eos=True)
        w = ref.generate(p, max_tokens=n, temperature=0, ignore_eos=True)
        out["split"].append(r.tokens)
        out["ref"].append(w.tokens)
        # where the two first differ: the unsplit model's top-2 margin there, relative to the
        # largest |logit| (a near tie that a different summation order may flip)
        i = next((j for j, (a, b) in enumerate(zip(r.tokens, w.tokens)) if a != b), None)
        if i is not None and "isa_noise" not in out:
            out["isa_noise"] = isa_noise(path, list(w.prompt_tokens), dict(n_ctx=256, n_threads=1))
        if i is not None:
            row = ref.logits(list(w.prompt_tokens) + list(w.tokens[:i]))[-1]
            top = np.sort(row)[-2:]
            out["margins"].append(float((top[1] - top[0]) / np.abs(row).max()))
        if r.spec is not None:
            out["drafted"] += r.spec.drafted
            out["accepted"] += r.spec.accepted
    return out


def main(argv: list[str]) -> int:
    from pyfast.parallel import mpi_group
    from pyfast.parallel import tp

    group = mpi_group()
    if group.rank != 0:
        if argv[1:2] == ["--where"]:
            import os
            import socket

            group.gather(os.readlink("/proc/self/ns/net"))
            group.gather(socket.gethostname())
        tp.follow(group, lambda p, **o: tp.load_sharded(p, group, **o))
        return 0
    tp._register_stop(group)
    out_path, checks = argv[0], argv[1:]
    results = []
    if checks and checks[0] == "--where":  # each rank's network namespace and host name
        import os
        import socket

        checks = checks[1:]
        results.append({"check": "where", "netns": group.gather(os.readlink("/proc/self/ns/net")),
                        "host": group.gather(socket.gethostname())})
    for c in checks:
        kind, path = c.split(":", 1)
        if kind == "logits":
            results.append({"check": c, **check_logits(path, group)})
        elif kind == "greedy":
            results.append({"check": c, **check_greedy(path, group)})
        elif kind == "mtp":
            results.append({"check": c, **check_greedy(path, group, n=20, spec=True)})
        else:
            raise SystemExit(f"unknown check {c!r}")
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
