#!/usr/bin/env python3
"""Rollback vs restore for speculative verify batches on a random Qwen3.5-like hybrid model.

Builds a random GGUF (numpy + pyfast's GGUF writer; default d=1024, 8 layers = 6 Gated-DeltaNet
+ 2 gated attention, Hv=16, S=128, one MTP block, F16 matrices) and times, for draft lengths
N = 1..4, what a rejected draft costs the target (``algorithms.md`` §0.1 step 6, §2.6):

  (a) rollback: decode the verify batch [id_last, d1..dN] in a context with N snapshot planes
      (n_rollback = 4), then ``truncate`` to the accepted prefix: choose a snapshot plane;
  (b) restore:  save the sequence's recurrent state (``save_state(kv=False)``), decode the verify
      batch in a context without snapshot planes, restore the state and replay the kept tokens
      [id_last, d1..dk] (one decode, no logits).

k = accepted draft tokens (< N). Each timing is the median over --reps repetitions after a
prefix of --prefix tokens; the sequence is put back to the prefix between repetitions (untimed).

    python scripts/bench_mtp_rollback.py                 # builds /tmp/pyfast_bench_qwen35_rand.gguf
    python scripts/bench_mtp_rollback.py -t 4 --reps 50 --model my.gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARCH = "qwen35"


def build_random_gguf(path: str, d: int = 1024, n_layer: int = 8, attn_every: int = 4, n_v: int = 16,
                      n_k: int = 8, S: int = 128, n_head: int = 8, n_head_kv: int = 2, head_dim: int = 128,
                      n_ff: int = 3072, n_vocab: int = 16384, seed: int = 0) -> str:
    """A random qwen35 GGUF: n_layer trunk layers (every attn_every-th is attention) + 1 MTP block."""
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.models import qwen35

    rng = np.random.default_rng(seed)
    recurrent = tuple((i + 1) % attn_every != 0 for i in range(n_layer))
    args = qwen35.Args(arch=ARCH, n_vocab=n_vocab, n_embd=d, n_layer=n_layer, n_nextn=1, n_head=n_head,
                       n_head_kv=n_head_kv, head_dim=head_dim, n_rot=head_dim // 4, rope_base=1e7,
                       rope_scale=1.0, rope_sections=(11, 11, 10, 0), eps=1e-6, n_ctx_train=32768, tied=True,
                       recurrent=recurrent, conv_kernel=4, n_k_heads=n_k, n_v_heads=n_v, state_size=S,
                       n_ff=n_ff)
    w = GGUFWriter(path)
    k = lambda s: f"{ARCH}.{s}"  # noqa: E731
    w.add("general.architecture", ARCH, "string")
    w.add("general.name", "qwen35-random-bench", "string")
    w.add(k("block_count"), n_layer + 1, "uint32")
    w.add(k("context_length"), 32768, "uint32")
    w.add(k("embedding_length"), d, "uint32")
    w.add(k("feed_forward_length"), n_ff, "uint32")
    w.add(k("attention.head_count"), n_head, "uint32")
    w.add(k("attention.head_count_kv"), n_head_kv, "uint32")
    w.add(k("attention.key_length"), head_dim, "uint32")
    w.add(k("attention.value_length"), head_dim, "uint32")
    w.add(k("attention.layer_norm_rms_epsilon"), 1e-6, "float32")
    w.add(k("rope.freq_base"), 1e7, "float32")
    w.add(k("rope.dimension_count"), head_dim // 4, "uint32")
    w.add(k("rope.dimension_sections"), [11, 11, 10, 0], "array[int32]")
    w.add(k("nextn_predict_layers"), 1, "uint32")
    w.add(k("ssm.conv_kernel"), 4, "uint32")
    w.add(k("ssm.state_size"), S, "uint32")
    w.add(k("ssm.group_count"), n_k, "uint32")
    w.add(k("ssm.time_step_rank"), n_v, "uint32")
    w.add(k("ssm.inner_size"), n_v * S, "uint32")
    w.add(k("attention.recurrent_layers"), list(recurrent) + [False], "array[bool]")
    w.add(k("full_attention_interval"), attn_every, "uint32")
    specs = qwen35.tensors(args) + qwen35.nextn_tensors(args, 0)
    for s in specs:
        if s.optional:
            continue
        name, shape = s.name, s.shape

        def make(name=name, shape=shape):
            if name.endswith("ssm_a"):
                return (-np.exp(rng.uniform(-1.0, 1.0, shape))).astype(np.float32)
            if name.endswith("ssm_dt.bias"):
                return rng.uniform(-1.0, 0.5, shape).astype(np.float32)
            if name.endswith("ssm_conv1d.weight"):
                return (rng.standard_normal(shape) * 0.3).astype(np.float32)
            if len(shape) == 1:   # norms hold 1 + w
                return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
            return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float16)

        one_d = len(shape) == 1 or name.endswith("ssm_conv1d.weight")
        w.add_tensor(name, 0 if one_d else 1, shape, make)
    w.write()
    return path


def median_ms(xs):
    return 1e3 * statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an existing qwen35 GGUF (default: build a random one)")
    ap.add_argument("--out", default="/tmp/pyfast_bench_qwen35_rand.gguf")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--max-draft", type=int, default=4)
    a = ap.parse_args()

    from pyfast.context import Context
    from pyfast.models import Model

    path = a.model
    if path is None:
        path = a.out
        if not os.path.exists(path):
            t0 = time.perf_counter()
            build_random_gguf(path)
            print(f"built {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr)
    model = Model(path)
    ar = model.args
    R = a.max_draft
    n_ctx = a.prefix + 64
    ctx_a = Context(model, n_ctx=n_ctx, n_threads=a.threads, n_rollback=R, n_seq_max=1)
    ctx_b = Context(model, n_ctx=n_ctx, n_threads=a.threads, n_rollback=0, n_seq_max=1)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, model.n_vocab, a.prefix).astype(np.int32)
    base = {}
    for name, ctx in (("a", ctx_a), ("b", ctx_b)):
        ctx.decode(prefix, seq_ids=0, logits="none")
        base[name] = ctx.save_state(0)          # the prefix, restored (untimed) between repetitions
    n_past = a.prefix
    recurrent_mib = sum(1 for r in ar.recurrent if r) * ar.n_v_heads * ar.state_size ** 2 * 4 / 2**20

    def verify_batch(N):
        toks = rng.integers(0, model.n_vocab, N + 1).astype(np.int32)
        return toks, np.arange(n_past, n_past + N + 1, dtype=np.int32)

    def run_a(N, k):
        toks, pos = verify_batch(N)
        ctx_a.restore_state(0, base["a"])
        t0 = time.perf_counter()
        ctx_a.decode(toks, positions=pos, seq_ids=0, logits="all")
        ctx_a.truncate(0, n_past + k + 1)        # keep id_last and d1..dk: select plane N-k
        return time.perf_counter() - t0

    def run_b(N, k):
        toks, pos = verify_batch(N)
        ctx_b.restore_state(0, base["b"])
        t0 = time.perf_counter()
        st = ctx_b.save_state(0, kv=False)
        ctx_b.decode(toks, positions=pos, seq_ids=0, logits="all")
        ctx_b.restore_state(0, st)
        ctx_b.decode(toks[: k + 1], positions=pos[: k + 1], seq_ids=0, logits="none")
        return time.perf_counter() - t0

    def run_v(N):
        toks, pos = verify_batch(N)
        ctx_b.restore_state(0, base["b"])
        t0 = time.perf_counter()
        ctx_b.decode(toks, positions=pos, seq_ids=0, logits="all")
        return time.perf_counter() - t0

    for N in range(1, R + 1):                    # warm up: build every plan once
        for k in range(N):
            run_a(N, k), run_b(N, k)
        run_v(N)

    print(f"model: {path}: d={ar.n_embd}, {ar.n_layer} layers ({sum(ar.recurrent)} GDN + "
          f"{ar.n_layer - sum(ar.recurrent)} attention), Hv={ar.n_v_heads}, S={ar.state_size}, "
          f"vocab {model.n_vocab}, {ar.n_nextn} MTP block; GDN state {recurrent_mib:.1f} MiB per sequence")
    print(f"threads {a.threads}, prefix {a.prefix} tokens, median of {a.reps} reps; times in ms; "
          f"k = accepted draft tokens\n")
    hdr = (f"{'N':>2} {'verify only':>11} | {'(a) rollback k=0':>16} {'(b) restore k=0':>15} {'b/a':>5} | "
           f"{'(a) k=N-1':>9} {'(b) k=N-1':>9} {'b/a':>5}")
    print(hdr)
    print("-" * len(hdr))
    all_faster = True
    for N in range(1, R + 1):
        ta = {0: [], N - 1: []}
        tb = {0: [], N - 1: []}
        tv = []
        for _ in range(a.reps):                  # interleaved, so drift hits both alike
            for k in ta:
                ta[k].append(run_a(N, k))
                tb[k].append(run_b(N, k))
            tv.append(run_v(N))
        a0, b0, a1, b1 = (median_ms(ta[0]), median_ms(tb[0]), median_ms(ta[N - 1]), median_ms(tb[N - 1]))
        all_faster &= a0 < b0 and a1 < b1
        print(f"{N:>2} {median_ms(tv):>11.2f} | {a0:>16.2f} {b0:>15.2f} {b0 / a0:>5.2f} | "
              f"{a1:>9.2f} {b1:>9.2f} {b1 / a1:>5.2f}")
    print(f"\nrollback by snapshot plane faster than restore + replay in every row: {all_faster}")
    return 0 if all_faster else 1


if __name__ == "__main__":
    raise SystemExit(main())
