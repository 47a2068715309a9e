"""DeepSeek Sparse Attention (DSA): the lightning indexer over MLA (``algorithms.md`` §6), shared by
``deepseek32`` (DeepSeek-V3.2) and ``glm-dsa`` (GLM-5.x).

Per query t and cache cell s of a layer that computes its own indexer ("full" layer):

* ``Qi = W_qi · qr`` ([Hi, D]; qr the normed q latent), ``Ki = LayerNorm(W_ki · x)`` (weight and
  bias, one head of width D), RoPE on the first ``rope.dimension_count`` dims of each (half-split
  pairs for DeepSeek-V3.2, adjacent pairs for GLM-5.x: ``attention.indexer.rope_interleave``);
  optionally both rotated by the normalised Walsh-Hadamard matrix (score-preserving);
* ``I[t, s] = sum_h w[t, h] relu(Qi[t, h] · Ki[s]) + mask[t, s]`` with ``w = W_w · x / sqrt(D Hi)``
  and the batch's causal, same-sequence mask (and, with the sink on, a large boost at the cell of
  the first position present of t's own sequence);
* the k = min(top_k, n_kv) best cells (``topk_mask``: the executor's exact top-k, ties to the lower
  cell) stay, the others get -inf added to the attention mask; with k >= n_kv nothing is removed
  and the layer equals dense MLA bit for bit.

Layers marked "shared" (IndexShare, GLM-5.2) reuse the selection of the most recent full layer.

The indexer key is stored in the main cache row after ``[c | k_pe]`` (the cache's
``cache_extra`` columns; queries carry zeros there), so it follows truncation, copies,
save / restore and rollback exactly as the KV rows do. The MTP block attends densely.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from pyfast._loader import native
from pyfast.models import deepseek2 as ds
from pyfast.models.base import GraphBuilder, TensorSpec

ROPE_NORMAL, ROPE_NEOX = 0, 2
SINK_BOOST = 1e30  # added to the sink cell's index score: finite, above any real score


def index_share_default(n_layer: int) -> tuple[bool, ...]:
    """GLM-5.2's IndexShare pattern: layer il is full iff il <= 1 or il % 4 == 2."""
    return tuple(il <= 1 or il % 4 == 2 for il in range(n_layer))


def hadamard(n: int) -> np.ndarray:
    """The normalised Walsh-Hadamard matrix H_n (n a power of two): orthogonal and symmetric."""
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two indexer head dim, got {n}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


def from_gguf(md: dict, weights, path: str, types, arch: str, full_default) -> "ds.Args":
    """deepseek2's Args plus the indexer settings (kept in args.extra)."""
    from pyfast.models import meta as M

    a = ds.Args.from_gguf(md, weights, path=path, types=types, arch=arch)
    m = M.Meta(md, path, types)
    key = f"{arch}.attention.indexer."
    Hi = m.int(key + "head_count", lo=1, hi=M.MAX_HEADS)
    D = m.int(key + "key_length", lo=a.qk_rope, hi=M.MAX_HEAD_DIM)
    top_k = m.int(key + "top_k", lo=1, hi=M.MAX_CTX)
    if not a.q_lora:
        raise ValueError(f"{path}: the DSA indexer needs a q latent ({arch}.attention.q_lora_rank)")
    if m.has(key + "full_layers"):
        full = m.bool_list(key + "full_layers")
        if len(full) < a.n_layer:
            raise m.fail(key + "full_layers", full, f"at least {a.n_layer} entries (one per layer)")
        full = tuple(full[:a.n_layer])
    else:
        full = full_default(a.n_layer)
    if a.n_layer and not full[0]:
        raise ValueError(f"{path}: DSA layer 0 must compute its own indexer (it has no earlier layer to share)")
    interleave = m.bool(key + "rope_interleave", arch == "glm-dsa")
    a.extra.update(dsa=True, dsa_on=True, idx_heads=Hi, idx_dim=D, idx_top_k=top_k, idx_full=full,
                   idx_rope_mode=ROPE_NORMAL if interleave else ROPE_NEOX, hadamard=False, sink=False,
                   cache_extra=D)
    return a


def tensors(args: "ds.Args") -> list[TensorSpec]:
    x = args.extra
    d, Hi, D = args.n_embd, x["idx_heads"], x["idx_dim"]
    specs = ds.tensors(args)
    for il in range(args.n_layer):
        if x["idx_full"][il]:
            p = f"blk.{il}.indexer"
            specs += [TensorSpec(f"{p}.attn_q_b.weight", (Hi * D, args.q_lora)),
                      TensorSpec(f"{p}.attn_k.weight", (D, d)),
                      TensorSpec(f"{p}.k_norm.weight", (D,)),
                      TensorSpec(f"{p}.k_norm.bias", (D,)),
                      TensorSpec(f"{p}.proj.weight", (Hi, d))]
    return specs


def needs_sink(args: "ds.Args") -> bool:
    return bool(args.extra.get("dsa_on") and args.extra.get("sink"))


def layer_norm(b: GraphBuilder, x, w: str, bias: str, eps: float = 1e-6):
    """LayerNorm over the last dim with weight and bias: rms_norm(x - mean(x)) * w + b."""
    g = b.g
    T, D = x.shape
    mean = g.reshape(g.scale(g.sum(x, -1), -1.0 / D), [T, 1])
    return g.add(g.mul(g.rms_norm(g.add(x, mean), eps), ds.weight_f32(b, w)), ds.weight_f32(b, bias))


def indexer_k(b: GraphBuilder, args, p: str, h):
    """The indexer key of each token: [T, 1, D] (normed, roped, optionally rotated)."""
    g, x = b.g, args.extra
    T, D = h.shape[0], x["idx_dim"]
    k = layer_norm(b, b.linear(h, f"{p}.indexer.attn_k.weight"), f"{p}.indexer.k_norm.weight",
                   f"{p}.indexer.k_norm.bias")
    k = index_rope(args).apply(b, g.reshape(k, [T, 1, D]))
    return rotate(b, k, D)


def index_rope(args):
    """The indexer's rope: the model's frequencies (and YaRN) with the indexer's pairing."""
    return dataclasses.replace(args.rope, mode=args.extra["idx_rope_mode"])


def rotate(b: GraphBuilder, t, D: int):
    """t [..., D] times the normalised Hadamard matrix when the rotation is on."""
    if not getattr(b, "_dsa_hadamard", False):
        return t
    key = f"#hadamard.{D}"
    hm = b._wcache.get(key)
    if hm is None:
        hm = b._wcache[key] = b.g.external(key, native.DType.F32, [D, D], b.w.derived(key, lambda: hadamard(D)))
    return b.g.matmul(t, hm)


def sparse_mask(b: GraphBuilder, args, p: str, h, qr, k_vis, il: int = 0):
    """The additive [T, n_kv] mask of this layer: the batch mask plus -inf off the top-k cells."""
    g, x = b.g, args.extra
    T, n_kv = b.shape.n_tokens, b.shape.n_kv
    Hi, D = x["idx_heads"], x["idx_dim"]
    q = g.reshape(b.linear(qr, f"{p}.indexer.attn_q_b.weight"), [T, Hi, D])
    q = rotate(b, index_rope(args).apply(b, q), D)
    # the cells' indexer keys: the cache rows' last D columns, as f32 [n_kv, D]
    dt = b.kv.dtype
    off = native.dtype_row_size(dt, args.kv_lora + args.qk_rope)
    keys = g.cpy(g.view(k_vis, [n_kv, D], [k_vis.strides[0], k_vis.strides[2]], offset=off))
    s = g.relu(g.matmul(g.reshape(q, [T * Hi, D]), keys))                     # [T Hi, n_kv]
    w = g.scale(b.linear(h, f"{p}.indexer.proj.weight"), 1.0 / math.sqrt(D * Hi))  # [T, Hi]
    score = g.sum(g.mul(g.reshape(s, [T, Hi, n_kv]), g.reshape(w, [T, Hi, 1])), 1)  # [T, n_kv]
    score = g.add(score, b.mask)
    if needs_sink(args):
        score = g.add(score, b.dsa_sink)
    keep = g.topk_mask(score, min(int(x["idx_top_k"]), n_kv))
    if x.get("debug_outputs"):  # tests read each layer's selection
        g.output(keep, f"dsa_keep.{il}")
        g.output(score, f"dsa_score.{il}")
    return g.add(b.mask, keep)


def attn_layer(b: GraphBuilder, args, p: str, h, il: int):
    """MLA attention with the DSA sparse mask (dense when DSA is off). h: [T, d] -> [T, d]."""
    g, x = b.g, args.extra
    T = h.shape[0]
    q, k, c, qr = ds.mla_inputs(b, args, p, h)
    full = x["idx_full"][il]
    if full:
        k = g.concat(k, indexer_k(b, args, p, h), -1)                          # [T, 1, r + p + D]
    else:  # a shared layer stores no indexer key of its own
        k = ds.pad_row(b, args, k)
    k_vis, v_vis = b.kv_store(il, k, g.reshape(c, [T, 1, args.kv_lora]))
    mask = None
    if x["dsa_on"]:
        if full:
            b._dsa_mask = sparse_mask(b, args, p, h, qr, k_vis, il)
        mask = b._dsa_mask
    o = b.attend(ds.pad_row(b, args, q), k_vis, v_vis, args.kq_scale, mask)
    return ds.mla_output(b, args, p, o)


def build(b: GraphBuilder, args):
    """deepseek2's graph with DSA attention layers (see ``deepseek2.build``)."""
    b._dsa_hadamard = bool(args.extra.get("hadamard"))
    if needs_sink(args):
        b.dsa_sink = b.g.input("kv_sink", native.DType.F32, [b.shape.n_tokens, b.shape.n_kv])
    return ds.build(b, args, attn=attn_layer)


def sink_boost(mask: np.ndarray, order: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[T, n_kv] f32: SINK_BOOST at the cell holding the first position present of each row's own
    sequence (the first cell in position order the row may attend to), 0 elsewhere. Keyed by the
    row's mask, hence per sequence, whatever else shares the batch or the cache."""
    T, n_kv = mask.shape
    ok = mask[:, order[:n_kv]] == 0.0
    first = order[np.argmax(ok, axis=1)]
    out = np.zeros((T, n_kv), dtype=np.float32) if out is None or out.shape != (T, n_kv) else out
    out.fill(0.0)
    rows = np.flatnonzero(ok.any(axis=1))
    out[rows, first[rows]] = SINK_BOOST
    return out
