#!/usr/bin/env python3
"""Random-weight GGUF files of real model shapes, for speed measurements at size.

Speed on SmolLM2-135M flatters decode (its weights fit in the L3 cache); these files have the
shapes of the models people run, the default model's tokenizer (so prompts, chat and perplexity
work on them) and random weights (so their output is noise). Both pyfast and llama.cpp load them.

    python scripts/make_bench_model.py llama-1b Q4_K_M            # -> bench-models/llama-1b.Q4_K_M.gguf
    python scripts/make_bench_model.py llama-8b Q4_K_M -o /data/  # 4.6 GB
    python scripts/make_bench_model.py --list

Each tensor gets the type llama-quantize would give it for the file type (`pyfast.quantize`'s
rules: Q6_K output, more bits for some attn_v / ffn_down in the _M mixes, fallbacks for short
rows). To make an 8B file in minutes rather than an hour on a small machine, each (type, row
length) pair quantizes a pool of random rows once and every tensor of that pair is filled with
rows drawn from the pool in a random order: every byte of every tensor is still read by a
forward pass, which is all a speed measurement needs.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import numpy as np

POOL_ROWS = 1024


@dataclass
class Shape:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int = 0
    tied: bool = False
    # qwen35 / qwen35moe: one full-attention layer every `full_every`, the rest Gated DeltaNet.
    full_every: int = 4
    ssm_heads_k: int = 0        # ssm.group_count
    ssm_heads_v: int = 0        # ssm.time_step_rank
    ssm_state: int = 0          # ssm.state_size (= head dim of the linear attention)
    ssm_conv: int = 4
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)


SHAPES = {
    # Llama 3.2 1B's body (2048 wide, 16 layers, 8192 FFN, 32/8 heads) with SmolLM2's vocabulary.
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 64, n_ff=8192, tied=True, note="Llama-3.2-1B body"),
    # Llama 3.1 8B's body (4096 wide, 32 layers, 14336 FFN, 32/8 heads).
    "llama-8b": Shape("llama", 4096, 32, 32, 8, 128, n_ff=14336, note="Llama-3.1-8B body"),
    # A dense Qwen3.5-style hybrid: 3 Gated DeltaNet layers per full-attention layer.
    "qwen35-2b": Shape("qwen35", 2048, 24, 8, 2, 256, n_ff=6144, ssm_heads_k=16, ssm_heads_v=16,
                       ssm_state=128, note="Qwen3.5-style hybrid, dense FFN"),
    # A Qwen3-Next-style sparse hybrid: 32 experts (8 used) plus a shared expert.
    "qwen35moe-3b": Shape("qwen35moe", 2048, 24, 16, 2, 256, ssm_heads_k=16, ssm_heads_v=32,
                          ssm_state=128, n_expert=32, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                          note="Qwen3-Next-style hybrid MoE"),
}


def tensor_shapes(s: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy-order shape) for every tensor, in GGUF naming."""
    E = s.n_embd
    out = [("token_embd.weight", (n_vocab, E))]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        t = [(p + "attn_norm.weight", (E,))]
        recurrent = s.arch != "llama" and (il + 1) % s.full_every != 0
        if s.arch == "llama":
            t += [(p + "attn_q.weight", (s.n_head * s.head_dim, E)),
                  (p + "attn_k.weight", (s.n_head_kv * s.head_dim, E)),
                  (p + "attn_v.weight", (s.n_head_kv * s.head_dim, E)),
                  (p + "attn_output.weight", (E, s.n_head * s.head_dim)),
                  (p + "ffn_norm.weight", (E,))]
        elif recurrent:
            d_inner = s.ssm_heads_v * s.ssm_state
            conv_dim = 2 * s.ssm_heads_k * s.ssm_state + d_inner
            t += [(p + "attn_qkv.weight", (conv_dim, E)), (p + "attn_gate.weight", (d_inner, E)),
                  (p + "ssm_beta.weight", (s.ssm_heads_v, E)), (p + "ssm_alpha.weight", (s.ssm_heads_v, E)),
                  (p + "ssm_conv1d.weight", (conv_dim, s.ssm_conv)), (p + "ssm_dt.bias", (s.ssm_heads_v,)),
                  (p + "ssm_a", (s.ssm_heads_v,)), (p + "ssm_norm.weight", (s.ssm_state,)),
                  (p + "ssm_out.weight", (E, d_inner)), (p + "post_attention_norm.weight", (E,))]
        else:
            t += [(p + "attn_q.weight", (2 * s.n_head * s.head_dim, E)),   # query and its gate
                  (p + "attn_k.weight", (s.n_head_kv * s.head_dim, E)),
                  (p + "attn_v.weight", (s.n_head_kv * s.head_dim, E)),
                  (p + "attn_output.weight", (E, s.n_head * s.head_dim)),
                  (p + "attn_q_norm.weight", (s.head_dim,)), (p + "attn_k_norm.weight", (s.head_dim,)),
                  (p + "post_attention_norm.weight", (E,))]
        if s.n_expert:
            X, F, FS = s.n_expert, s.n_ff_exp, s.n_ff_shexp
            t += [(p + "ffn_gate_inp.weight", (X, E)), (p + "ffn_gate_exps.weight", (X, F, E)),
                  (p + "ffn_up_exps.weight", (X, F, E)), (p + "ffn_down_exps.weight", (X, E, F)),
                  (p + "ffn_gate_inp_shexp.weight", (1, E)), (p + "ffn_gate_shexp.weight", (FS, E)),
                  (p + "ffn_up_shexp.weight", (FS, E)), (p + "ffn_down_shexp.weight", (E, FS))]
        else:
            t += [(p + "ffn_gate.weight", (s.n_ff, E)), (p + "ffn_up.weight", (s.n_ff, E)),
                  (p + "ffn_down.weight", (E, s.n_ff))]
        out += t
    out.append(("output_norm.weight", (E,)))
    if not s.tied:
        out.append(("output.weight", (n_vocab, E)))
    return out


def metadata(s: Shape, name: str) -> dict[str, tuple[object, str]]:
    a = s.arch
    kv: dict[str, tuple[object, str]] = {
        "general.architecture": (a, "string"), "general.name": (f"random {name}", "string"),
        f"{a}.block_count": (s.n_layer, "uint32"), f"{a}.context_length": (8192, "uint32"),
        f"{a}.embedding_length": (s.n_embd, "uint32"),
        f"{a}.attention.head_count": (s.n_head, "uint32"),
        f"{a}.attention.head_count_kv": (s.n_head_kv, "uint32"),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-6, "float32"),
        f"{a}.rope.freq_base": (10000.0 if a == "llama" else 1e7, "float32"),
    }
    if s.n_ff:
        kv[f"{a}.feed_forward_length"] = (s.n_ff, "uint32")
    if a == "llama":
        kv[f"{a}.rope.dimension_count"] = (s.head_dim, "uint32")
        return kv
    kv.update({
        f"{a}.attention.key_length": (s.head_dim, "uint32"), f"{a}.attention.value_length": (s.head_dim, "uint32"),
        f"{a}.rope.dimension_count": (s.head_dim // 4, "uint32"),
        f"{a}.rope.dimension_sections": ([11, 11, 10, 0], "array[int32]"),
        f"{a}.ssm.conv_kernel": (s.ssm_conv, "uint32"), f"{a}.ssm.state_size": (s.ssm_state, "uint32"),
        f"{a}.ssm.group_count": (s.ssm_heads_k, "uint32"), f"{a}.ssm.time_step_rank": (s.ssm_heads_v, "uint32"),
        f"{a}.ssm.inner_size": (s.ssm_heads_v * s.ssm_state, "uint32"),
        f"{a}.full_attention_interval": (s.full_every, "uint32"),
    })
    if s.n_expert:
        kv.update({f"{a}.expert_count": (s.n_expert, "uint32"), f"{a}.expert_used_count": (s.n_expert_used, "uint32"),
                   f"{a}.expert_feed_forward_length": (s.n_ff_exp, "uint32"),
                   f"{a}.expert_shared_feed_forward_length": (s.n_ff_shexp, "uint32")})
    return kv


class _Info:
    def __init__(self, shape):
        self.shape = shape
        self.type_name = "F32"


class _PlanReader:
    """The part of GGUFReader that pyfast.quantize.tensor_types reads."""

    def __init__(self, arch: str, n_layer: int, shapes):
        self.architecture = arch
        self.tensors = {n: _Info(sh) for n, sh in shapes}
        self._n_layer = n_layer

    def get(self, key, default=None):
        return self._n_layer if key.endswith(".block_count") else default


def make(name: str, ftype: str, out_dir: str, seed: int = 0, log=print) -> str:
    from pyfast._loader import native as N
    from pyfast.gguf import GGUFReader
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.hub import resolve_model
    from pyfast.quantize import FTYPES, QUANTIZATION_VERSION, tensor_types

    s = SHAPES[name]
    ftype = ftype.upper()
    if ftype not in FTYPES:
        raise SystemExit(f"unknown file type {ftype!r} (known: {', '.join(FTYPES)})")
    tok = GGUFReader(str(resolve_model(None)))
    n_vocab = len(tok.get("tokenizer.ggml.tokens"))
    shapes = tensor_shapes(s, n_vocab)
    plans = {p.name: p for p in tensor_types(_PlanReader(s.arch, s.n_layer, shapes), ftype)}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.{ftype}.gguf")
    w = GGUFWriter(path)
    for k, (v, t) in metadata(s, name).items():
        w.add(k, v, t)
    for k, v in tok.metadata.items():
        if k.startswith("tokenizer."):
            w.add(k, v, tok.metadata_types.get(k))
    w.add("general.quantization_version", QUANTIZATION_VERSION, "uint32")
    w.add("general.file_type", FTYPES[ftype][0], "uint32")
    rng = np.random.default_rng(seed)
    pools: dict[tuple[str, int], np.ndarray] = {}

    def pool(dtype: str, ncols: int) -> np.ndarray:
        key = (dtype, ncols)
        if key not in pools:
            x = (rng.standard_normal((POOL_ROWS, ncols), dtype=np.float32) / np.sqrt(ncols)).astype(np.float32)
            if dtype == "F32":
                raw = x
            else:
                raw = np.asarray(N.quantize_tensor(getattr(N.DType, dtype), x, 0))
            pools[key] = raw.view(np.uint8).reshape(POOL_ROWS, -1)
        return pools[key]

    def producer(tname: str, shape: tuple[int, ...], dtype: str):
        def data():
            if len(shape) == 1:   # norms, biases: near 1 for norms, small otherwise
                base = 1.0 if tname.endswith("norm.weight") else 0.0
                v = base + 0.02 * rng.standard_normal(shape[0]).astype(np.float32)
                if tname.endswith("ssm_a"):
                    v = -np.abs(v) - 0.5
                return v.astype(np.float32)
            nrows = int(np.prod(shape[:-1]))
            p = pool(dtype, shape[-1])
            return p[rng.integers(0, POOL_ROWS, size=nrows)]
        return data

    total = 0
    for tname, shape in shapes:
        dt = plans[tname].dst_type if len(shape) > 1 else "F32"
        w.add_tensor(tname, int(getattr(N.DType, dt)), shape, producer(tname, shape, dt))
        total += int(np.prod(shape))
    w.write()
    log(f"{path}: {s.note}, {total / 1e9:.2f} B parameters, {os.path.getsize(path) / 2**20:.0f} MiB")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("ftype", nargs="*", default=["Q4_K_M"], help="file types (default Q4_K_M)")
    ap.add_argument("-o", "--out-dir", default="bench-models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list the shapes")
    a = ap.parse_args()
    if a.list or not a.shape:
        for k, s in SHAPES.items():
            print(f"{k:14s} {s.arch:10s} {s.note}")
        return 0
    for ft in a.ftype:
        make(a.shape, ft, a.out_dir, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
