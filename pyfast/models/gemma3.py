"""Gemma 3 (``gemma3``, text): sliding-window and global attention layers, GeGLU, sandwich norms.

Per layer: ``x += post_attention_norm(attn(attn_norm(x)))`` then
``x += post_ffw_norm(ffn_down(gelu(ffn_gate(h)) * ffn_up(h)))`` with ``h = ffn_norm(x)`` (GELU in
its tanh form). The embedding is scaled by ``sqrt(n_embd)``; q and k get per-head RMS norms before
NEOX rope; scores are scaled by ``attention.scale`` (``query_pre_attn_scalar ** -0.5``; default
``1 / sqrt(head_dim)``); logits are soft-capped ``c * tanh(logits / c)`` when
``final_logit_softcapping`` is set.

Layer types: ``attention.sliding_window_pattern`` (one bool per layer, true = sliding; default:
every 6th layer global) with ``attention.sliding_window`` W: a sliding layer's query at position p
sees positions ``p - W < q <= p`` (the context builds that mask, ``mask_swa``); global layers see
the whole causal past. Sliding layers use rope base ``rope.freq_base_swa`` (10000) without
scaling; global ones ``rope.freq_base`` with ``rope.scaling.*``.

GGUF conventions (llama.cpp's converter, and ours): RMS norm weights hold ``1 + w``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyfast._loader import native
from pyfast.models import base, decoder
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec
from pyfast.models.rope import ROPE_NEOX, Rope, read_rope

ARCH = "gemma3"
EXPORTS_HIDDEN = True
SWA_PATTERN = 6  # without sliding_window_pattern: layers 6k + 5 are global


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope: Rope             # global layers
    rope_swa: Rope         # sliding layers
    eps: float
    n_ctx_train: int
    tied: bool
    swa_window: int
    swa_layers: tuple[bool, ...]
    attn_scale: float
    final_softcap: float = 0.0
    qk_norm: bool = True

    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None, arch: str = ARCH) -> "Args":
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)
        a = arch
        n_embd = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        n_layer = m.int(f"{a}.block_count", lo=1, hi=M.MAX_LAYERS)
        M.check_blocks(path, f"{a}.block_count", n_layer, weights)
        n_head, n_head_kv, head_dim = decoder.attention_dims(m, a, n_embd, path)
        n_rot = m.int(f"{a}.rope.dimension_count", head_dim, lo=2, hi=head_dim)
        if n_rot % 2:
            raise m.fail(f"{a}.rope.dimension_count", n_rot, "an even number")
        window = m.int(f"{a}.attention.sliding_window", 0, lo=0, hi=M.MAX_CTX)
        if m.has(f"{a}.attention.sliding_window_pattern") and not isinstance(
                md.get(f"{a}.attention.sliding_window_pattern"), (list, tuple)):
            # an integer period n, as llama.cpp also reads it: layer i slides when i % n < n - 1
            n_pat = m.int(f"{a}.attention.sliding_window_pattern", lo=0, hi=M.MAX_LAYERS)
            swa = tuple(n_pat == 0 or i % n_pat < n_pat - 1 for i in range(n_layer))
        elif m.has(f"{a}.attention.sliding_window_pattern"):
            pat = m.bool_list(f"{a}.attention.sliding_window_pattern")
            if len(pat) != n_layer:
                raise m.fail(f"{a}.attention.sliding_window_pattern", pat, f"{n_layer} entries (one per layer)")
            swa = tuple(pat)
        else:
            swa = tuple((i + 1) % SWA_PATTERN != 0 for i in range(n_layer))
        if not window or not any(swa):
            window, swa = 0, (False,) * n_layer
        rope = read_rope(m, a, weights, n_rot, ROPE_NEOX, default_base=1e6)
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, a)
        return cls(
            arch=a, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=head_dim, n_ff=m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF), rope=rope,
            rope_swa=Rope(n_rot, ROPE_NEOX, m.float(f"{a}.rope.freq_base_swa", 10000.0, positive=True)),
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            n_ctx_train=m.int(f"{a}.context_length", 8192, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights, swa_window=window, swa_layers=swa,
            attn_scale=m.float(f"{a}.attention.scale", default_attn_scale(n_layer, n_embd, n_head, head_dim),
                               positive=True),
            final_softcap=m.float(f"{a}.final_logit_softcapping", 0.0, lo=0.0),
        )


def default_attn_scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """The score scale of a file without ``attention.scale`` (llama.cpp's converter writes none):
    ``query_pre_attn_scalar ** -0.5``, which is ``n_embd / n_head`` for Gemma 3 27B (62 layers) and
    the head size for the other sizes, as llama.cpp assumes."""
    return 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)


def memory(args: Args) -> MemorySpec:
    """Every layer has K / V; the sliding ones may get a cache bounded to the window
    (Context(..., swa_full=False))."""
    swa = tuple(i for i in range(args.n_layer) if args.swa_layers[i]) if args.swa_window else ()
    return MemorySpec(attn_layers=tuple(range(args.n_layer)), n_head_kv=args.n_head_kv, head_dim=args.head_dim,
                      swa_layers=swa, swa_window=args.swa_window, swa_n_head_kv=args.n_head_kv,
                      swa_head_dim=args.head_dim)


def kv_slot(b: GraphBuilder, args, i: int, layers: tuple[int, ...]) -> tuple[int, bool]:
    """(KV layer, in the sliding-window cache) of layer i among the KV layers ``layers``: with a
    bounded sliding-window cache (b.kv_swa) the sliding layers are numbered in it and the others
    in the main cache; otherwise all in the main cache."""
    if b.kv_swa is None:
        return layers.index(i), False
    swa = args.swa_layers[i]
    return [j for j in layers if args.swa_layers[j] == swa].index(i), swa


def tensors(args: Args) -> list[TensorSpec]:
    d = args.n_embd
    specs = base.outer_tensors(args)
    for i in range(args.n_layer):
        p = f"blk.{i}"
        specs += [TensorSpec(f"{p}.{n}.weight", (d,)) for n in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                                "post_ffw_norm")]
        specs += decoder.attn_tensors(args, p) + decoder.dense_ffn_tensors(d, args.n_ff, p)
    return specs


def swa_mask(b: GraphBuilder):
    """The sliding layers' mask [T, n_kv] (0 / -inf): the causal mask without the cells W or more
    positions back (the graph input ``mask_swa``, set by the context)."""
    m = b._wcache.get("#mask_swa")
    if m is None:
        m = b._wcache["#mask_swa"] = b.g.input("mask_swa", native.DType.F32, [b.shape.n_tokens, b.shape.n_kv])
    return m


def softcap(b: GraphBuilder, x, c: float):
    """c * tanh(x / c)."""
    return b.g.scale(b.g.tanh(b.g.scale(x, 1.0 / c)), c)


def attention(b: GraphBuilder, args: Args, p: str, h, il: int, rope: Rope, mask=None):
    """q / k normed and roped, attention over layer il's K / V (mask: None = causal). [T, d] -> [T, d]."""
    g = b.g
    T, hd = h.shape[0], args.head_dim
    q = b.norm(g.reshape(b.linear(h, f"{p}.attn_q.weight"), [T, args.n_head, hd]), f"{p}.attn_q_norm.weight", args.eps)
    k = b.norm(g.reshape(b.linear(h, f"{p}.attn_k.weight"), [T, args.n_head_kv, hd]), f"{p}.attn_k_norm.weight",
               args.eps)
    v = g.reshape(b.linear(h, f"{p}.attn_v.weight"), [T, args.n_head_kv, hd])
    q, k = rope.apply(b, q), rope.apply(b, k)
    j, own = kv_slot(b, args, il, tuple(range(args.n_layer)))
    k_vis, v_vis = b.kv_store(j, k, v, swa=own)
    o = b.attend(q, k_vis, v_vis, args.attn_scale, mask=None if own else mask, swa=own)
    return b.linear(o, f"{p}.attn_output.weight")


def geglu_ffn(b: GraphBuilder, p: str, h):
    g = b.g
    return b.linear(g.mul(g.gelu(b.linear(h, f"{p}.ffn_gate.weight")), b.linear(h, f"{p}.ffn_up.weight")),
                    f"{p}.ffn_down.weight")


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for b.out_ids (and outputs "hidden" [T, d], the
    post-final-norm hidden of every row, when b.export_hidden)."""
    g = b.g
    x = g.scale(b.embed("token_embd.weight"), math.sqrt(args.n_embd))   # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    for i in range(args.n_layer):
        p = f"blk.{i}"
        swa = args.swa_layers[i]
        h = attention(b, args, p, b.norm(x, f"{p}.attn_norm.weight", args.eps), i,
                      args.rope_swa if swa else args.rope, swa_mask(b) if swa and b.kv_swa is None else None)
        x = g.add(x, b.norm(h, f"{p}.post_attention_norm.weight", args.eps))
        if i == args.n_layer - 1 and not b.all_rows:
            x = b.select_outputs(x)
        h = geglu_ffn(b, p, b.norm(x, f"{p}.ffn_norm.weight", args.eps))
        x = b.control(g.add(x, b.norm(h, f"{p}.post_ffw_norm.weight", args.eps)), i)
    logits = base.output_logits(b, args, x)
    return softcap(b, logits, args.final_softcap) if args.final_softcap else logits
