"""DeepSeek-V2/V3 (``deepseek2``): multi-head latent attention (MLA) over a compressed KV cache,
routed experts with shared experts and (sigmoid, biased, grouped) routing, NextN MTP blocks.

MLA, per token (``algorithms.md`` notation; H heads, latent width r = kv_lora_rank, rope width
p = rope.dimension_count, nope width n = key_length_mla - p, value width v = value_length_mla):

* ``q = W_qb · RMS(W_qa · x)`` (or ``W_q · x`` without a q latent), per head ``[q_nope (n) | q_pe (p)]``;
* ``[c (r) | k_pe (p)] = W_kva · x``, ``c = RMS_kva(c)``; q_pe and k_pe get RoPE at the token's
  position (pairs of adjacent dims, llama.cpp's "normal" mode; transformers' ``rope_interleave``);
* the cache keeps one row per token, ``[c | k_pe]`` (width r + p; one "KV head"); its value row
  is that row's first r columns (c itself; no separate V storage unless V is stored as another
  type, ``-ctv``);
* absorbed attention: ``q_abs[h] = W_kb[h] · q_nope[h]`` (``attn_k_b`` [H, r, n]), the query
  ``[q_abs | q_pe]`` attends over the cache rows as one multi-query head group, the output
  ``o[h]`` (width r) goes through ``W_vb[h]`` (``attn_v_b`` [H, v, r]) and ``attn_output``. This
  equals expanding ``k_nope = W_kb c``, ``v = W_vb c`` per head (transformers' form) up to rounding.
* scale ``1/sqrt(n + p)``; with YaRN rope scaling (``rope.scaling.type`` = yarn, DeepSeek-V3's
  released checkpoints) the scores are scaled by ``mscale²`` more, ``mscale = 1 +
  rope.scaling.yarn_log_multiplier · ln(factor)``, and cos / sin by ``rope.scaling.attn_factor``
  (default 1) alone, as transformers and llama.cpp do for this architecture.

Files whose layers hold ``attn_kv_b`` ([H (n + v), r], older conversions) instead of
``attn_k_b`` / ``attn_v_b`` are split once at load into the same two f32 tensors.

FFN: the first ``leading_dense_block_count`` layers are dense SwiGLU, the rest routed experts
(``pyfast/models/moe.py``: ``expert_gating_func`` 1 = softmax, 2 = sigmoid; ``exp_probs_b`` the
selection bias; ``expert_group_count`` / ``expert_group_used_count`` the grouped routing) plus
``expert_shared_count`` shared experts (one SwiGLU of width ``n_ff_exp * shared``).

``deepseek32`` and ``glm-dsa`` are this architecture plus the DSA lightning indexer
(``pyfast/models/dsa.py``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from pyfast._loader import native
from pyfast.models import base, decoder, moe
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec
from pyfast.models.rope import Rope, read_rope

ARCH = "deepseek2"
EXPORTS_HIDDEN = True   # build() outputs "hidden" when the builder asks (MTP drafting)
MTP_CARRY = "post_norm"  # algorithms.md §1.1: DeepSeek-V3 / GLM carry the post-norm hidden
ROPE_NORMAL = 0
GATING = {1: "softmax", 2: "sigmoid"}


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int             # trunk layers (block_count minus the nextn blocks)
    n_nextn: int
    n_head: int
    q_lora: int              # 0: no q latent (attn_q)
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    n_ff: int
    n_dense_lead: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    gating: str
    weights_norm: bool
    weights_scale: float
    n_group: int
    n_group_used: int
    rope: Rope              # the MLA rope (adjacent pairs over the rope dims; YaRN when the file says so)
    eps: float
    n_ctx_train: int
    tied: bool
    kq_scale: float
    kv_b: bool = False       # layers hold attn_kv_b (split at load) instead of attn_k_b / attn_v_b
    has_probs_b: bool = False
    extra: dict = field(default_factory=dict)  # architecture additions (the DSA indexer's settings)

    # the compressed cache: one "KV head" of [c | k_pe], values c
    @property
    def n_head_kv(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.kv_lora + self.qk_rope + self.cache_extra

    @property
    def head_dim_v(self) -> int:
        return self.kv_lora

    @property
    def v_in_k(self) -> bool:
        """The value row is the cache row's leading kv_lora columns (the latent c): no V storage."""
        return True

    @property
    def cache_extra(self) -> int:
        """Extra columns after [c | k_pe] in each cache row (the DSA indexer's key)."""
        return int(self.extra.get("cache_extra", 0))

    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None, arch: str = ARCH) -> "Args":
        """Read and check the hyper-parameters against each other and the tensors (before
        anything is allocated); a bad value is a ValueError naming the key."""
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)

        def key(k):
            return f"{arch}.{k}"

        n_embd = m.int(key("embedding_length"), lo=1, hi=M.MAX_EMBD)
        n_all, n_layer, n_nextn = base.read_blocks(m, arch, weights, path)
        n_head = m.int(key("attention.head_count"), lo=1, hi=M.MAX_HEADS)
        kv_lora = m.int(key("attention.kv_lora_rank"), lo=1, hi=M.MAX_HEAD_DIM)
        q_lora = m.int(key("attention.q_lora_rank"), 0, lo=0, hi=M.MAX_EMBD)
        qk_rope = m.int(key("rope.dimension_count"), lo=2, hi=M.MAX_HEAD_DIM)
        if qk_rope % 2:
            raise m.fail(key("rope.dimension_count"), qk_rope, "an even number")
        if m.has(key("attention.key_length_mla")):  # MLA layout: key_length is the cache row
            qk_head = m.int(key("attention.key_length_mla"), lo=qk_rope + 1, hi=M.MAX_HEAD_DIM)
            v_head = m.int(key("attention.value_length_mla"), lo=1, hi=M.MAX_HEAD_DIM)
            kl = m.int(key("attention.key_length"), kv_lora + qk_rope, lo=1, hi=M.MAX_HEAD_DIM)
            if kl != kv_lora + qk_rope:
                raise m.fail(key("attention.key_length"), kl,
                             f"kv_lora_rank + rope.dimension_count = {kv_lora + qk_rope} (with key_length_mla)")
        else:  # older conversions: key_length / value_length are the per-head dims
            qk_head = m.int(key("attention.key_length"), lo=qk_rope + 1, hi=M.MAX_HEAD_DIM)
            v_head = m.int(key("attention.value_length"), lo=1, hi=M.MAX_HEAD_DIM)
        n_dense = m.int(key("leading_dense_block_count"), 0, lo=0, hi=n_all)
        n_expert = m.int(key("expert_count"), 0, lo=0, hi=M.MAX_EXPERTS)
        kw = {}
        if n_expert and n_dense < n_all:
            n_used = m.int(key("expert_used_count"), lo=1, hi=n_expert)
            n_group = m.int(key("expert_group_count"), 1, lo=1, hi=n_expert)
            if n_expert % n_group:
                raise m.fail(key("expert_group_count"), n_group, f"a divisor of expert_count ({n_expert})")
            n_group_used = m.int(key("expert_group_used_count"), n_group, lo=1, hi=n_group)
            if n_group_used * (n_expert // n_group) < n_used:
                raise m.fail(key("expert_group_used_count"), n_group_used,
                             f"enough groups to hold expert_used_count ({n_used}) experts")
            gf = m.int(key("expert_gating_func"), 1, lo=1, hi=2)
            kw = dict(n_expert_used=n_used, n_group=n_group, n_group_used=n_group_used, gating=GATING[gf],
                      n_ff_exp=m.int(key("expert_feed_forward_length"), lo=1, hi=M.MAX_FF),
                      n_expert_shared=m.int(key("expert_shared_count"), 0, lo=0, hi=M.MAX_EXPERTS),
                      weights_norm=m.bool(key("expert_weights_norm"), False),
                      weights_scale=m.float(key("expert_weights_scale"), 1.0) or 1.0)
        else:
            n_expert, n_dense = 0, n_all
            kw = dict(n_expert_used=0, n_group=1, n_group_used=1, gating="softmax", n_ff_exp=0,
                      n_expert_shared=0, weights_norm=False, weights_scale=1.0)
        rope = read_rope(m, arch, weights, qk_rope, ROPE_NORMAL)
        mscale = 1.0
        if rope.ext_factor:
            # YaRN the DeepSeek way: cos / sin keep only rope.scaling.attn_factor (the op would scale
            # them by 1 + 0.1 ln(factor) more), the scores get mscale^2
            ln_f = math.log(1.0 / rope.freq_scale)
            rope = dataclasses.replace(rope, attn_factor=rope.attn_factor / (1.0 + 0.1 * ln_f))
            mscale = 1.0 + m.float(key("rope.scaling.yarn_log_multiplier"), 0.0, lo=0.0, hi=100.0) * ln_f
        first = f"blk.{n_layer - 1}" if n_layer else "blk.0"
        kv_b = f"{first}.attn_kv_b.weight" in weights and f"{first}.attn_k_b.weight" not in weights
        first_moe = f"blk.{n_dense}" if n_dense < n_layer else first
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, arch)
        return cls(
            arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_nextn=n_nextn, n_head=n_head,
            q_lora=q_lora, kv_lora=kv_lora, qk_nope=qk_head - qk_rope, qk_rope=qk_rope, v_head_dim=v_head,
            n_ff=m.int(key("feed_forward_length"), 0, lo=0, hi=M.MAX_FF), n_dense_lead=n_dense, n_expert=n_expert,
            rope=rope,
            eps=m.float(key("attention.layer_norm_rms_epsilon"), 1e-6, positive=True),
            n_ctx_train=m.int(key("context_length"), 4096, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights, kq_scale=mscale * mscale / math.sqrt(qk_head),
            kv_b=kv_b, has_probs_b=f"{first_moe}.exp_probs_b.bias" in weights, **kw,
        )


# --- memory and tensors ------------------------------------------------------------------------
def memory(args: Args) -> MemorySpec:
    return MemorySpec(attn_layers=tuple(range(args.n_layer)), n_head_kv=1, head_dim=args.head_dim,
                      head_dim_v=args.head_dim_v, v_in_k=True)


def layer_tensors(args: Args, il: int) -> list[TensorSpec]:
    """The tensors of layer il (trunk or nextn block): MLA attention, norms and FFN."""
    d, H, p = args.n_embd, args.n_head, f"blk.{il}"
    qk = args.qk_nope + args.qk_rope
    specs = [TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.ffn_norm.weight", (d,))]
    if args.q_lora:
        specs += [TensorSpec(f"{p}.attn_q_a.weight", (args.q_lora, d)),
                  TensorSpec(f"{p}.attn_q_a_norm.weight", (args.q_lora,)),
                  TensorSpec(f"{p}.attn_q_b.weight", (H * qk, args.q_lora))]
    else:
        specs.append(TensorSpec(f"{p}.attn_q.weight", (H * qk, d)))
    specs += [TensorSpec(f"{p}.attn_kv_a_mqa.weight", (args.kv_lora + args.qk_rope, d)),
              TensorSpec(f"{p}.attn_kv_a_norm.weight", (args.kv_lora,)),
              TensorSpec(f"{p}.attn_output.weight", (d, H * args.v_head_dim))]
    if args.kv_b:
        specs.append(TensorSpec(f"{p}.attn_kv_b.weight", (H * (args.qk_nope + args.v_head_dim), args.kv_lora)))
    else:
        specs += [TensorSpec(f"{p}.attn_k_b.weight", (H, args.kv_lora, args.qk_nope)),
                  TensorSpec(f"{p}.attn_v_b.weight", (H, args.v_head_dim, args.kv_lora))]
    if il < args.n_dense_lead or not args.n_expert:
        specs += decoder.dense_ffn_tensors(d, args.n_ff, p)
    else:
        E, F = args.n_expert, args.n_ff_exp
        specs += [TensorSpec(f"{p}.ffn_gate_inp.weight", (E, d)),
                  TensorSpec(f"{p}.exp_probs_b.bias", (E,), optional=not args.has_probs_b),
                  TensorSpec(f"{p}.ffn_gate_exps.weight", (E, F, d)),
                  TensorSpec(f"{p}.ffn_up_exps.weight", (E, F, d)),
                  TensorSpec(f"{p}.ffn_down_exps.weight", (E, d, F))]
        if args.n_expert_shared:
            specs += decoder.dense_ffn_tensors(d, F * args.n_expert_shared, p, "_shexp")
    return specs


def tensors(args: Args) -> list[TensorSpec]:
    specs = base.outer_tensors(args)
    for i in range(args.n_layer):
        specs += layer_tensors(args, i)
    return specs


# --- layers ------------------------------------------------------------------------------------
weight_f32 = base.f32_weight     # a small weight (norms, biases) as f32 for elementwise ops
norm = base.norm_f32             # rms_norm(x) * f32 weight


def head_ids(b: GraphBuilder, T: int, H: int):
    """The constant ids [T, H] = (0 .. H-1) per row: matmul_id with them is a per-head matmul."""
    key = f"#heads.{T}x{H}"
    t = b._wcache.get(key)
    if t is None:
        arr = b.w.derived(key, lambda: np.tile(np.arange(H, dtype=np.int32), (T, 1)))
        t = b._wcache[key] = b.g.external(key, native.DType.I32, [T, H], arr)
    return t


def kv_b_parts(b: GraphBuilder, args: Args, p: str):
    """attn_k_b [H, r, n] and attn_v_b [H, v, r]: the file's, or split once from attn_kv_b."""
    if not args.kv_b:
        return b.weight(f"{p}.attn_k_b.weight"), b.weight(f"{p}.attn_v_b.weight")
    H, n, v, r = args.n_head, args.qk_nope, args.v_head_dim, args.kv_lora
    name = f"{p}.attn_kv_b.weight"
    out = []
    for part, shape in (("k_b", [H, r, n]), ("v_b", [H, v, r])):
        key = f"{p}.attn_{part}.weight#from_kv_b"
        t = b._wcache.get(key)
        if t is None:
            def make(part=part):
                kvb = b.w.f32(name).reshape(H, n + v, r)
                return kvb[:, :n, :].transpose(0, 2, 1) if part == "k_b" else kvb[:, n:, :]
            t = b._wcache[key] = b.g.external(key, native.DType.F32, shape, b.w.derived(key, make))
        out.append(t)
    return out[0], out[1]


def mla_inputs(b: GraphBuilder, args: Args, p: str, h):
    """Projections of one MLA layer. h: [T, d] (normed). Returns (q [T, H, r + p] absorbed and
    roped, cache row [T, 1, r + p], latent c [T, r], q latent qr [T, q_lora] or None)."""
    g = b.g
    T, H = h.shape[0], args.n_head
    n, rp, r = args.qk_nope, args.qk_rope, args.kv_lora
    qr = None
    if args.q_lora:
        qr = norm(b, b.linear(h, f"{p}.attn_q_a.weight"), f"{p}.attn_q_a_norm.weight", args.eps)
        q = b.linear(qr, f"{p}.attn_q_b.weight")
    else:
        q = b.linear(h, f"{p}.attn_q.weight")
    q = g.reshape(q, [T, H, n + rp])
    st = list(q.strides)
    q_nope = g.view(q, [T, H, n], st)
    q_pe = args.rope.apply(b, g.view(q, [T, H, rp], st, offset=n * 4))
    ckv = b.linear(h, f"{p}.attn_kv_a_mqa.weight")                          # [T, r + p]
    row = (r + rp) * 4
    c = norm(b, g.view(ckv, [T, r], [row, 4]), f"{p}.attn_kv_a_norm.weight", args.eps)  # [T, r]
    k_pe = args.rope.apply(b, g.view(ckv, [T, 1, rp], [row, row, 4], offset=r * 4))  # [T, 1, p]
    k_b, _ = kv_b_parts(b, args, p)
    q_abs = g.matmul_id(q_nope, k_b, head_ids(b, T, H))                      # [T, H, r]
    q = g.concat(q_abs, q_pe, -1)                                            # [T, H, r + p]
    k = g.concat(g.reshape(c, [T, 1, r]), k_pe, -1)                          # [T, 1, r + p]
    return q, k, c, qr


def mla_output(b: GraphBuilder, args: Args, p: str, o):
    """o: [T, H * r] attention output over the latents -> [T, d] (per-head W_vb, attn_output)."""
    g = b.g
    T, H = o.shape[0], args.n_head
    _, v_b = kv_b_parts(b, args, p)
    o = g.matmul_id(g.reshape(o, [T, H, args.kv_lora]), v_b, head_ids(b, T, H))  # [T, H, v]
    return b.linear(g.reshape(o, [T, H * args.v_head_dim]), f"{p}.attn_output.weight")


def pad_row(b: GraphBuilder, args: Args, x):
    """x: [T, Hx, r + p] -> [T, Hx, head_dim]: zero columns for the cache's extra part (a query
    with zeros there scores exactly as without it)."""
    extra = args.cache_extra
    if not extra:
        return x
    T, Hx = x.shape[0], x.shape[1]
    key = f"#zeros.{T}x{Hx}x{extra}"
    z = b._wcache.get(key)
    if z is None:
        arr = b.w.derived(key, lambda: np.zeros((T, Hx, extra), dtype=np.float32))
        z = b._wcache[key] = b.g.external(key, native.DType.F32, [T, Hx, extra], arr)
    return b.g.concat(x, z, -1)


def attn_layer(b: GraphBuilder, args: Args, p: str, h, il_kv: int):
    """Dense MLA attention. h: [T, d] (normed) -> [T, d]. il_kv: this layer's KV-cache layer."""
    q, k, c, _ = mla_inputs(b, args, p, h)
    T = h.shape[0]
    o = b.kv_attention(il_kv, pad_row(b, args, q), pad_row(b, args, k), b.g.reshape(c, [T, 1, args.kv_lora]),
                       args.kq_scale)
    return mla_output(b, args, p, o)


def ffn(b: GraphBuilder, args: Args, il: int, p: str, h):
    """Dense SwiGLU (leading layers) or routed + shared experts. [T, d] -> [T, d]."""
    g = b.g
    if il < args.n_dense_lead or not args.n_expert:
        return b.ffn_swiglu(h, p)
    logits = b.linear(h, f"{p}.ffn_gate_inp.weight")                        # [T, E]
    bias = weight_f32(b, f"{p}.exp_probs_b.bias") if b.has(f"{p}.exp_probs_b.bias") else None
    ids, w = moe.select_experts(b, logits, args.n_expert_used, args.gating, bias, args.n_group,
                                args.n_group_used, args.weights_norm, args.weights_scale)
    out = moe.routed_experts(b, h, p, ids, w)
    if args.n_expert_shared:
        out = g.add(out, b.ffn_swiglu(h, p, "_shexp"))
    return out


def build(b: GraphBuilder, args: Args, attn=None):
    """Returns logits [n_out, n_vocab] for the rows in b.out_ids (and outputs "hidden" [T, d],
    the post-final-norm hidden state of every row, when b.export_hidden). attn(b, args, p, h, il)
    replaces the attention layer (the DSA architectures pass theirs)."""
    g = b.g
    attn = attn or (lambda b, args, p, h, il: attn_layer(b, args, p, h, il))
    x = b.embed("token_embd.weight")                                       # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    for i in range(args.n_layer):
        p = f"blk.{i}"
        x = g.add(x, attn(b, args, p, norm(b, x, f"{p}.attn_norm.weight", args.eps), i))
        if i == args.n_layer - 1 and not b.all_rows:
            x = b.select_outputs(x)                                        # [n_out, d]
        x = b.control(g.add(x, ffn(b, args, i, p, norm(b, x, f"{p}.ffn_norm.weight", args.eps))), i)
    return base.output_logits(b, args, x, partial(norm, b))


# --- MTP (nextn) block -------------------------------------------------------------------------
def nextn_tensors(args: Args, j: int = 0) -> list[TensorSpec]:
    """The tensors of MTP block j (block n_layer + j): one decoder layer plus the nextn parts."""
    return base.nextn_tensors(args, j, lambda il: layer_tensors(args, il))


def build_nextn(b: GraphBuilder, args: Args, j: int = 0):
    """MTP block j as a graph (``algorithms.md`` §1.1): row t takes (token_t, h_t) with h_t from
    the graph input "h" [T, d]; returns logits [n_out, n_vocab] and outputs "hidden" [T, d] (the
    block's post-norm output, the next carry). Its attention is dense MLA (never the DSA mask)
    over KV layer 0 of b.kv (the block's own one-layer cache)."""
    def layer(x, p, il):
        x = b.g.add(x, attn_layer(b, args, p, norm(b, x, f"{p}.attn_norm.weight", args.eps), 0))
        return b.g.add(x, ffn(b, args, il, p, norm(b, x, f"{p}.ffn_norm.weight", args.eps)))
    return base.build_nextn(b, args, j, layer, partial(norm, b))
