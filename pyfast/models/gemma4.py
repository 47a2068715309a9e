"""Gemma 4 (``gemma4``, text, dense): Gemma 3's layer shape with per-layer embeddings, per-type
attention geometry, shared KV layers and a per-layer output scale.

* Layer types: ``attention.sliding_window_pattern`` (true = sliding, window
  ``attention.sliding_window``). Sliding layers have ``attention.key_length_swa``-wide heads and
  rope base ``rope.freq_base_swa``; global layers ``attention.key_length``-wide heads, rope base
  ``rope.freq_base`` and proportional rope: ``rope_freqs.weight`` holds 1 for the rotated pairs and
  a huge divisor for the pairs left unrotated. ``attention.head_count_kv`` may be per layer.
* Attention: q / k RMS norms (weights as stored: these norms scale by w), v RMS-normed without a
  weight, scale 1; a global layer without ``attn_v`` uses its k projection (before the k norm) as
  v. The last ``attention.shared_kv_layers`` layers compute no K / V: each attends over the cache
  of the last earlier layer of its type.
* Per-layer embeddings (``embedding_length_per_layer_input`` P > 0): ``e = per_layer_token_embd[tok]
  * sqrt(P)`` and ``p = rms(x0 @ per_layer_model_proj * d^-1/2) * per_layer_proj_norm``, combined as
  ``(p + e) / sqrt(2)``, [T, L, P]; layer i adds ``post_norm(proj(gelu(inp_gate(x)) * pe_i))``.
* Each layer's output is multiplied by ``layer_output_scale`` (a [1] tensor); logits are
  soft-capped with ``final_logit_softcapping``.
* MoE (``expert_count`` > 0, 26B-A4B): beside the dense FFN, a router on
  ``rms(x) * ffn_gate_inp.scale / sqrt(d)`` (softmax, top ``expert_used_count``, renormalised, times
  the chosen experts' ``ffn_down_exps.scale``) weights GeGLU experts run on ``pre_ffw_norm_2(x)``;
  the FFN output is ``post_ffw_norm_1(dense) + post_ffw_norm_2(experts)`` before ``post_ffw_norm``
  (llama.cpp's names; files from older pyfast converters call them ``ffn_pre_norm_2`` /
  ``ffn_post_norm_1`` / ``ffn_post_norm_2``, also read).

Tensor names are llama.cpp's (``per_layer_token_embd``, ``blk.N.inp_gate`` / ``proj`` /
``post_norm``, ``layer_output_scale``, a shared ``rope_freqs``); the per-type metadata keys
(``key_length_swa``, ``shared_kv_layers``, ``embedding_length_per_layer_input``, per-layer
``head_count_kv``) follow llama.cpp's naming but are checked only against pyfast's own converter.

The KV cache has one geometry for all layers, so the two layer types share the larger one: K / V
rows are zero-padded to the widest head and kv heads repeated up to the most kv heads (q is
padded alike; the padding adds nothing to any score or output). Not supported: bidirectional
attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native
from pyfast.models import base
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec
from pyfast.models.gemma3 import kv_slot, softcap, swa_mask
from pyfast.models.rope import ROPE_NEOX, Rope

ARCH = "gemma4"
MOE_NORMS = ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2")  # llama.cpp (src/llama-arch.cpp)
MOE_NORMS_OLD = ("ffn_pre_norm_2", "ffn_post_norm_1", "ffn_post_norm_2")
EXPORTS_HIDDEN = True
F32 = native.DType.F32


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: tuple[int, ...]     # per layer
    head_dim: int                  # global layers
    head_dim_swa: int              # sliding layers
    n_ff: tuple[int, ...]          # per layer
    rope: Rope
    rope_swa: Rope
    eps: float
    n_ctx_train: int
    tied: bool
    swa_window: int
    swa_layers: tuple[bool, ...]
    n_kv_shared: int
    n_embd_per_layer: int
    final_softcap: float = 0.0
    n_expert: int = 0       # the MoE block beside the dense FFN (26B-A4B)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    merged_gate_up: bool = False  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    # the MoE block's norms: llama.cpp's names (pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2), or
    # the ffn_pre_norm_2 / ffn_post_norm_1 / ffn_post_norm_2 of files from older pyfast converters
    moe_norms: tuple[str, str, str] = MOE_NORMS

    @property
    def kv_source(self) -> tuple[int, ...]:
        """Per layer: the layer whose K / V it attends over (itself unless shared)."""
        first = self.n_layer - self.n_kv_shared
        src = []
        for i in range(self.n_layer):
            if i < first:
                src.append(i)
            else:
                src.append(max(j for j in range(first) if self.swa_layers[j] == self.swa_layers[i]))
        return tuple(src)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layer - self.n_kv_shared))

    def dim(self, i: int) -> int:
        return self.head_dim_swa if self.swa_layers[i] else self.head_dim

    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)
        a = ARCH

        def per_layer(key, n, lo, hi, default=M._MISSING):
            if m.has(key) and isinstance(md.get(key), list):
                v = m.int_list(key, lo=lo, hi=hi)
                if len(v) != n:
                    raise m.fail(key, v, f"{n} entries (one per layer) or one integer")
                return tuple(v)
            return (m.int(key, default, lo=lo, hi=hi),) * n

        n_expert = m.int(f"{a}.expert_count", 0, lo=0, hi=M.MAX_EXPERTS)
        moe = dict(n_expert=n_expert, n_expert_used=m.int(f"{a}.expert_used_count", lo=1, hi=n_expert),
                   n_ff_exp=m.int(f"{a}.expert_feed_forward_length", lo=1, hi=M.MAX_FF),
                   merged_gate_up="blk.0.ffn_gate_up_exps.weight" in weights,
                   moe_norms=MOE_NORMS_OLD if f"blk.0.{MOE_NORMS_OLD[0]}.weight" in weights else MOE_NORMS
                   ) if n_expert else {}
        n_embd = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        n_layer = m.int(f"{a}.block_count", lo=1, hi=M.MAX_LAYERS)
        M.check_blocks(path, f"{a}.block_count", n_layer, weights)
        n_head = m.int(f"{a}.attention.head_count", lo=1, hi=M.MAX_HEADS)
        n_head_kv = per_layer(f"{a}.attention.head_count_kv", n_layer, 1, n_head)
        for h in n_head_kv:
            if n_head % h:
                raise m.fail(f"{a}.attention.head_count_kv", h, f"a divisor of attention.head_count ({n_head})")
        hd = m.int(f"{a}.attention.key_length", lo=2, hi=M.MAX_HEAD_DIM)
        hd_swa = m.int(f"{a}.attention.key_length_swa", hd, lo=2, hi=M.MAX_HEAD_DIM)
        for k, want in ((f"{a}.attention.value_length", hd), (f"{a}.attention.value_length_swa", hd_swa)):
            if m.int(k, want, lo=1, hi=M.MAX_HEAD_DIM) != want:
                raise m.fail(k, md.get(k), f"{want}, the key length")
        pat = m.bool_list(f"{a}.attention.sliding_window_pattern", [False] * n_layer)
        if len(pat) != n_layer:
            raise m.fail(f"{a}.attention.sliding_window_pattern", pat, f"{n_layer} entries (one per layer)")
        window = m.int(f"{a}.attention.sliding_window", 0, lo=0, hi=M.MAX_CTX)
        if not window:
            pat = [False] * n_layer
        n_shared = m.int(f"{a}.attention.shared_kv_layers", 0, lo=0, hi=n_layer - 1)
        for i in range(n_layer - n_shared, n_layer):
            if not any(pat[j] == pat[i] for j in range(n_layer - n_shared)):
                raise m.fail(f"{a}.attention.shared_kv_layers", n_shared,
                             f"a count that leaves a layer of each shared layer's type to share (layer {i})")
        rot, rot_swa = (m.int(f"{a}.rope.dimension_count", hd, lo=2, hi=hd),
                        m.int(f"{a}.rope.dimension_count_swa", hd_swa, lo=2, hi=hd_swa))
        ff = "rope_freqs.weight" if "rope_freqs.weight" in weights else None
        if ff is not None and tuple(weights.shape(ff)) != (rot // 2,):
            raise ValueError(f"{path}: tensor '{ff}' has shape {list(weights.shape(ff))}, expected [{rot // 2}]")
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, a)
        n_ff = tuple(int(weights.shape(f"blk.{i}.ffn_gate.weight")[0]) if f"blk.{i}.ffn_gate.weight" in weights
                     else m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF) for i in range(n_layer))
        return cls(
            arch=a, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=hd, head_dim_swa=hd_swa, n_ff=n_ff,
            rope=Rope(rot, ROPE_NEOX, m.float(f"{a}.rope.freq_base", 1e6, positive=True), freq_factors=ff),
            rope_swa=Rope(rot_swa, ROPE_NEOX, m.float(f"{a}.rope.freq_base_swa", 10000.0, positive=True)),
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            n_ctx_train=m.int(f"{a}.context_length", 8192, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights, swa_window=window if any(pat) else 0, swa_layers=tuple(pat),
            n_kv_shared=n_shared, n_embd_per_layer=m.int(f"{a}.embedding_length_per_layer_input", 0, lo=0,
                                                         hi=M.MAX_EMBD),
            final_softcap=m.float(f"{a}.final_logit_softcapping", 0.0, lo=0.0), **moe,
        )


def memory(args: Args) -> MemorySpec:
    """One KV layer per layer that computes K / V, at the widest geometry of the two types; the
    sliding ones may get a cache of their own bounded to the window (Context(..., swa_full=False))."""
    kv = args.kv_layers
    swa = tuple(i for i in kv if args.swa_layers[i]) if args.swa_window else ()
    return MemorySpec(attn_layers=kv, n_head_kv=max(args.n_head_kv[i] for i in kv),
                      head_dim=max(args.dim(i) for i in kv), swa_layers=swa, swa_window=args.swa_window,
                      swa_n_head_kv=max((args.n_head_kv[i] for i in swa), default=0),
                      swa_head_dim=max((args.dim(i) for i in swa), default=0))


def tensors(args: Args) -> list[TensorSpec]:
    d, P, L = args.n_embd, args.n_embd_per_layer, args.n_layer
    specs = base.outer_tensors(args)
    if P:
        specs += [TensorSpec("per_layer_token_embd.weight", (args.n_vocab, L * P)),
                  TensorSpec("per_layer_model_proj.weight", (L * P, d)),
                  TensorSpec("per_layer_proj_norm.weight", (P,))]
    shared_from = L - args.n_kv_shared
    for i in range(L):
        p, hd, hkv, ff = f"blk.{i}", args.dim(i), args.n_head_kv[i], args.n_ff[i]
        specs += [TensorSpec(f"{p}.{n}.weight", (d,)) for n in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                                "post_ffw_norm")]
        specs += [TensorSpec(f"{p}.attn_q.weight", (args.n_head * hd, d)), TensorSpec(f"{p}.attn_q_norm.weight", (hd,)),
                  TensorSpec(f"{p}.attn_output.weight", (d, args.n_head * hd)),
                  TensorSpec(f"{p}.layer_output_scale.weight", (1,), optional=True),
                  TensorSpec(f"{p}.ffn_gate.weight", (ff, d)), TensorSpec(f"{p}.ffn_up.weight", (ff, d)),
                  TensorSpec(f"{p}.ffn_down.weight", (d, ff))]
        if i < shared_from:
            specs += [TensorSpec(f"{p}.attn_k.weight", (hkv * hd, d)), TensorSpec(f"{p}.attn_k_norm.weight", (hd,)),
                      TensorSpec(f"{p}.attn_v.weight", (hkv * hd, d), optional=True)]
        if P:
            specs += [TensorSpec(f"{p}.inp_gate.weight", (P, d)), TensorSpec(f"{p}.proj.weight", (d, P)),
                      TensorSpec(f"{p}.post_norm.weight", (d,))]
        if args.n_expert:
            E, F = args.n_expert, args.n_ff_exp
            specs += [TensorSpec(f"{p}.ffn_gate_inp.weight", (E, d)), TensorSpec(f"{p}.ffn_gate_inp.scale", (d,)),
                      TensorSpec(f"{p}.ffn_down_exps.scale", (E,)), TensorSpec(f"{p}.ffn_down_exps.weight", (E, d, F))]
            specs += [TensorSpec(f"{p}.{n}.weight", (d,)) for n in args.moe_norms]
            if args.merged_gate_up:
                specs.append(TensorSpec(f"{p}.ffn_gate_up_exps.weight", (E, 2 * F, d)))
            else:
                specs += [TensorSpec(f"{p}.ffn_gate_exps.weight", (E, F, d)),
                          TensorSpec(f"{p}.ffn_up_exps.weight", (E, F, d))]
    return specs


# --- layers ------------------------------------------------------------------------------------
def _zeros(b: GraphBuilder, shape: list[int]):
    """A zero tensor of this shape (one per shape and graph)."""
    key = "#zeros" + "x".join(map(str, shape))
    t = b._wcache.get(key)
    if t is None:
        buf = b.w.derived(key, lambda: np.zeros(int(np.prod(shape)), dtype=np.float32))
        t = b._wcache[key] = b.g.external(key, F32, shape, buf)
    return t


def _pad(b: GraphBuilder, x, H: int, D: int):
    """x [T, h, d] -> [T, H, D]: each head repeated H / h times, zeros after d."""
    g = b.g
    T, h, d = x.shape
    if d < D:
        x = g.concat(x, _zeros(b, [T, h, D - d]), -1)
    if h < H:
        r = H // h
        x4 = g.reshape(x, [T, h, 1, D])
        y = x4
        for _ in range(r - 1):
            y = g.concat(y, x4, 2)
        x = g.reshape(y, [T, H, D])
    return x


def attention(b: GraphBuilder, args: Args, i: int, h, kv_views: dict):
    g = b.g
    p, T, H, hd, hkv = f"blk.{i}", h.shape[0], args.n_head, args.dim(i), args.n_head_kv[i]
    swa = args.swa_layers[i]
    rope = args.rope_swa if swa else args.rope
    q = rope.apply(b, b.norm(g.reshape(b.linear(h, f"{p}.attn_q.weight"), [T, H, hd]), f"{p}.attn_q_norm.weight",
                             args.eps))
    src = args.kv_source[i]
    j, own = kv_slot(b, args, src, args.kv_layers)
    cache = b.kv_swa if own else b.kv
    Hc, Dc = cache.n_head_kv, cache.head_dim
    if src == i:
        kraw = g.reshape(b.linear(h, f"{p}.attn_k.weight"), [T, hkv, hd])
        vraw = g.reshape(b.linear(h, f"{p}.attn_v.weight"), [T, hkv, hd]) if b.has(f"{p}.attn_v.weight") else kraw
        k = rope.apply(b, b.norm(kraw, f"{p}.attn_k_norm.weight", args.eps))
        v = g.rms_norm(vraw, args.eps)
        kv_views[i] = b.kv_store(j, _pad(b, k, Hc, Dc), _pad(b, v, Hc, Dc), swa=own)
    k_vis, v_vis = kv_views[src]
    if hd < Dc:
        q = g.concat(q, _zeros(b, [T, H, Dc - hd]), -1)
    mask = None if own or not swa else swa_mask(b)
    o = g.reshape(b.attend(q, k_vis, v_vis, 1.0, mask=mask, swa=own), [T, H, Dc])          # [T, H, Dc]
    if hd < Dc:
        o = g.cpy(g.view(o, [T, H, hd], list(o.strides)))
    return b.linear(g.reshape(o, [T, H * hd]), f"{p}.attn_output.weight")


def moe(b: GraphBuilder, args: Args, p: str, x):
    """The MoE block beside the dense FFN, on the layer's input x [T, d]: router on
    rms(x) * ffn_gate_inp.scale / sqrt(d) (softmax, top k, renormalised, times the chosen experts'
    ffn_down_exps.scale), GeGLU experts on pre_ffw_norm_2(x). Returns [T, d] (before its post norm)."""
    g = b.g
    T, d, k, E = x.shape[0], args.n_embd, args.n_expert_used, args.n_expert
    r = g.scale(g.mul(g.rms_norm(x, args.eps), b.weight(f"{p}.ffn_gate_inp.scale")), d ** -0.5)
    logits = b.linear(r, f"{p}.ffn_gate_inp.weight")                                     # [T, E]
    ids = g.topk(logits, k)                                                              # [T, k]
    w = g.softmax(g.gather(logits, ids))
    pes = g.get_rows(g.reshape(b.weight(f"{p}.ffn_down_exps.scale"), [E, 1]), g.reshape(ids, [T * k]))
    w = g.mul(w, g.reshape(pes, [T, k]))
    h = b.norm(x, f"{p}.{args.moe_norms[0]}.weight", args.eps)
    if b.has(f"{p}.ffn_gate_up_exps.weight"):
        gu = g.matmul_id(h, b.mat_weight(f"{p}.ffn_gate_up_exps.weight"), ids)             # [T, k, 2F]
        F = gu.shape[2] // 2
        st = list(gu.strides)
        gate, up = g.view(gu, [T, k, F], st), g.view(gu, [T, k, F], st, offset=F * 4)
    else:
        gate = g.matmul_id(h, b.mat_weight(f"{p}.ffn_gate_exps.weight"), ids)              # [T, k, F]
        up = g.matmul_id(h, b.mat_weight(f"{p}.ffn_up_exps.weight"), ids)
    down = g.matmul_id(g.mul(g.gelu(gate), up), b.mat_weight(f"{p}.ffn_down_exps.weight"), ids)   # [T, k, d]
    return g.sum(g.mul(down, g.reshape(w, [T, k, 1])), 1)


def per_layer_inputs(b: GraphBuilder, args: Args, x0):
    """[T, L, P]: token-identity and context parts of the per-layer embeddings, combined."""
    g = b.g
    T, L, P = x0.shape[0], args.n_layer, args.n_embd_per_layer
    e = g.scale(b.embed("per_layer_token_embd.weight"), math.sqrt(P))                   # [T, L * P]
    proj = g.scale(b.linear(x0, "per_layer_model_proj.weight"), args.n_embd ** -0.5)
    proj = b.norm(g.reshape(proj, [T, L, P]), "per_layer_proj_norm.weight", args.eps)
    return g.scale(g.add(proj, g.reshape(e, [T, L, P])), 2.0 ** -0.5)


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for b.out_ids (and outputs "hidden" when b.export_hidden)."""
    g = b.g
    d, P, L = args.n_embd, args.n_embd_per_layer, args.n_layer
    x = g.scale(b.embed("token_embd.weight"), math.sqrt(d))                           # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    T = x.shape[0]
    ple = per_layer_inputs(b, args, x) if P else None
    kv_views: dict = {}
    for i in range(L):
        p = f"blk.{i}"
        h = attention(b, args, i, b.norm(x, f"{p}.attn_norm.weight", args.eps), kv_views)
        x = g.add(x, b.norm(h, f"{p}.post_attention_norm.weight", args.eps))
        hf = b.norm(x, f"{p}.ffn_norm.weight", args.eps)
        hf = b.linear(g.mul(g.gelu(b.linear(hf, f"{p}.ffn_gate.weight")), b.linear(hf, f"{p}.ffn_up.weight")),
                      f"{p}.ffn_down.weight")
        if args.n_expert:
            hf = g.add(b.norm(hf, f"{p}.{args.moe_norms[1]}.weight", args.eps),
                       b.norm(moe(b, args, p, x), f"{p}.{args.moe_norms[2]}.weight", args.eps))
        x = g.add(x, b.norm(hf, f"{p}.post_ffw_norm.weight", args.eps))
        if P:
            pe = g.view(ple, [T, P], [L * P * 4, 4], offset=i * P * 4)
            hp = g.mul(g.gelu(b.linear(x, f"{p}.inp_gate.weight")), pe)
            x = g.add(x, b.norm(b.linear(hp, f"{p}.proj.weight"), f"{p}.post_norm.weight", args.eps))
        if b.has(f"{p}.layer_output_scale.weight"):
            x = g.mul(x, b.weight(f"{p}.layer_output_scale.weight"))
        x = b.control(x, i)
    x = b.norm(x, "output_norm.weight", args.eps)
    if b.export_hidden:
        g.output(x, "hidden")
    x = b.select_outputs(x)
    logits = b.linear(x, "token_embd.weight" if args.tied else "output.weight")
    return softcap(b, logits, args.final_softcap) if args.final_softcap else logits
