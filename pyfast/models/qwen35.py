"""Qwen3.5 (dense): a hybrid of Gated-DeltaNet layers and gated full-attention layers.

Every ``full_attention_interval``-th layer is full attention (q carries a per-head sigmoid gate,
q/k RMS norm, partial NEOX rope); the others are Gated-DeltaNet (GDN) layers with a causal conv
and recurrent state (``pyfast/memory/recurrent.py``). Each layer is pre-norm with a post-attention
norm before the FFN. The helpers here (``attn_layer``, ``gdn_layer``, ``ffn``) are shared by
``qwen35moe.py`` and ``qwen3next.py``.

Rope: Qwen3.5 uses M-RoPE with sections over the rotary dims, but for text every position
component is the same token position, and then each rotary pair's angle is ``pos * base^(-2i/n_rot)``
whichever section it belongs to: plain NEOX rope over the first ``n_rot`` dims.

GGUF conventions (the converter's, same as llama.cpp's): RMS norm weights hold ``1 + w`` (the
gated GDN norm holds w itself), ``ssm_a = -exp(A_log)``, ``attn_q`` rows are per head
``[q (head_dim), gate (head_dim)]``, ``ssm_conv1d`` is ``[C, kernel]``. V heads are ordered so that
value head j uses key head ``j % Hk`` (tiled, ``GDN_BROADCAST = 0``) for Qwen3.5; Qwen3-Next keeps
the grouped order (``j // (Hv/Hk)``, broadcast 1).

The MTP (nextn) blocks stored after the trunk (``nextn_predict_layers`` of ``block_count``) are
not part of the trunk graph; ``build_nextn`` builds one of them as its own graph (for a drafter
with its own one-layer KV cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

from pyfast._loader import native
from pyfast.models import base, decoder
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec

ARCH = "qwen35"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)
MTP_CARRY = "post_norm"  # MTP recursion carry (and trunk export): after the head / final norm (§1.1)
GDN_BROADCAST = 0  # tiled V-head order
ROPE_NEOX = 2
# GDN segments of at least chunk_min tokens use the chunked form (algorithms.md §2.4), shorter
# ones (and 0 = all) the token-serial form. On CPU the chunked form is no faster (same flops;
# measured equal at T=512, Hv=32, S=128) and changes the rounding, so the default keeps every
# segment token-serial: a prompt's logits are then bit-identical however it is split, and greedy
# speculation equals plain decoding for any verify length. Set args.chunk_min (e.g. 64) where the
# chunked form pays off (GPU backends).
CHUNK_MIN = 0


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int           # trunk layers (block_count minus the nextn blocks)
    n_nextn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_scale: float
    rope_sections: tuple[int, ...]
    eps: float
    n_ctx_train: int
    tied: bool
    recurrent: tuple[bool, ...]  # per trunk layer: GDN (True) or full attention (False)
    conv_kernel: int
    n_k_heads: int         # GDN key heads (ssm.group_count)
    n_v_heads: int         # GDN value heads (ssm.time_step_rank)
    state_size: int        # GDN head dim S (ssm.state_size); key and value dims are both S
    gdn_broadcast: int = GDN_BROADCAST
    chunk_min: int = CHUNK_MIN
    n_ff: int = 0          # dense FFN width (0 for MoE models)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    norm_topk: bool = True
    weights_scale: float = 1.0
    # tensor layout variants found in the file
    fused_ba: bool = False       # ssm_ba [2 Hv, d] (grouped per key head) instead of ssm_beta + ssm_alpha
    merged_gate_up: bool = False  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    shexp_gate_2d: bool = False   # ffn_gate_inp_shexp stored as [1, d] rather than [d]
    extra: dict = field(default_factory=dict)

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.state_size + self.n_v_heads * self.state_size

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @classmethod
    def from_gguf(cls, md: dict, weights, arch: str = ARCH, moe: bool = False,
                  broadcast: int = GDN_BROADCAST, path: str = "", types: dict | None = None) -> "Args":
        """Read and check the hyper-parameters against each other and the tensors (before
        anything is allocated); a bad value is a ValueError naming the key."""
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)

        def key(k):
            return f"{arch}.{k}"

        n_embd = m.int(key("embedding_length"), lo=1, hi=M.MAX_EMBD)
        n_head = m.int(key("attention.head_count"), lo=1, hi=M.MAX_HEADS)
        if m.has(key("attention.key_length")):
            head_dim = m.int(key("attention.key_length"), lo=2, hi=M.MAX_HEAD_DIM)
        else:
            if n_embd % n_head:
                raise m.fail(key("attention.head_count"), n_head,
                             f"a divisor of embedding_length ({n_embd}) when attention.key_length is absent")
            head_dim = n_embd // n_head
        vl = m.int(key("attention.value_length"), head_dim, lo=1, hi=M.MAX_HEAD_DIM)
        if vl != head_dim:
            raise m.fail(key("attention.value_length"), vl, f"{head_dim}, the key length")
        n_head_kv = m.int(key("attention.head_count_kv"), n_head, lo=1, hi=n_head)
        if n_head % n_head_kv:
            raise m.fail(key("attention.head_count_kv"), n_head_kv, f"a divisor of attention.head_count ({n_head})")
        _, n_layer, n_nextn = base.read_blocks(m, arch, weights, path)
        if m.has(key("attention.recurrent_layers")):
            rl = m.bool_list(key("attention.recurrent_layers"))
            if len(rl) < n_layer:
                raise m.fail(key("attention.recurrent_layers"), rl, f"at least {n_layer} entries (one per layer)")
            recurrent = tuple(rl[:n_layer])
        else:
            interval = m.int(key("full_attention_interval"), 4, lo=1, hi=M.MAX_LAYERS)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        n_v = m.int(key("ssm.time_step_rank"), lo=1, hi=M.MAX_HEADS)
        n_k = m.int(key("ssm.group_count"), lo=1, hi=M.MAX_HEADS)
        S = m.int(key("ssm.state_size"), lo=1, hi=M.MAX_HEAD_DIM)
        d_inner = m.int(key("ssm.inner_size"), lo=1, hi=M.MAX_FF)
        if n_v % n_k:
            raise m.fail(key("ssm.time_step_rank"), n_v, f"a multiple of ssm.group_count ({n_k})")
        if d_inner != n_v * S:
            raise m.fail(key("ssm.inner_size"), d_inner, f"time_step_rank * state_size = {n_v * S}")
        scaling = m.str(key("rope.scaling.type"), "none")
        rope_scale = 1.0 / m.float(key("rope.scaling.factor"), 1.0, positive=True) if scaling == "linear" else 1.0
        n_rot = m.int(key("rope.dimension_count"), head_dim, lo=2, hi=head_dim)
        if n_rot % 2:
            raise m.fail(key("rope.dimension_count"), n_rot, "an even number")
        first_r = next((i for i, r in enumerate(recurrent) if r), None)
        kw = {}
        if moe:
            n_expert = m.int(key("expert_count"), lo=1, hi=M.MAX_EXPERTS)
            n_used = m.int(key("expert_used_count"), lo=1, hi=n_expert)
            kw = dict(
                n_expert=n_expert, n_expert_used=n_used,
                n_ff_exp=m.int(key("expert_feed_forward_length"), lo=1, hi=M.MAX_FF),
                n_ff_shexp=m.int(key("expert_shared_feed_forward_length"), 0, lo=0, hi=M.MAX_FF),
                norm_topk=m.bool(key("expert_weights_norm"), True),
                weights_scale=m.float(key("expert_weights_scale"), 1.0) or 1.0,
                merged_gate_up="blk.0.ffn_gate_up_exps.weight" in weights,
                shexp_gate_2d=("blk.0.ffn_gate_inp_shexp.weight" in weights
                               and weights.shape("blk.0.ffn_gate_inp_shexp.weight") == (1, n_embd)),
            )
        else:
            kw = dict(n_ff=m.int(key("feed_forward_length"), lo=1, hi=M.MAX_FF))
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, arch)
        sections = m.int_list(key("rope.dimension_sections"), [], lo=0, hi=M.MAX_HEAD_DIM, max_len=16)
        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd, n_layer=n_layer, n_nextn=n_nextn,
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            n_rot=n_rot,
            rope_base=m.float(key("rope.freq_base"), 10000.0, positive=True), rope_scale=rope_scale,
            rope_sections=tuple(sections),
            eps=m.float(key("attention.layer_norm_rms_epsilon"), 1e-6, positive=True),
            n_ctx_train=m.int(key("context_length"), 4096, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights,
            recurrent=recurrent, conv_kernel=m.int(key("ssm.conv_kernel"), lo=1, hi=64),
            n_k_heads=n_k, n_v_heads=n_v, state_size=S, gdn_broadcast=broadcast,
            fused_ba=first_r is not None and f"blk.{first_r}.ssm_ba.weight" in weights,
            **kw,
        )


# --- memory and tensors ------------------------------------------------------------------------
def memory(args: Args) -> MemorySpec:
    from pyfast.memory.recurrent import RecurrentGeometry

    attn = tuple(i for i, r in enumerate(args.recurrent) if not r)
    rec = tuple(i for i, r in enumerate(args.recurrent) if r)
    geom = RecurrentGeometry(conv_kernel=args.conv_kernel, conv_channels=args.conv_channels,
                             n_v_heads=args.n_v_heads, state_size=args.state_size)
    return MemorySpec(attn_layers=attn, n_head_kv=args.n_head_kv, head_dim=args.head_dim,
                      recurrent_layers=rec, recurrent=geom)


def layer_tensors(args: Args, i: int, recurrent: bool) -> list[TensorSpec]:
    """The tensors of trunk layer i (attention or GDN mixer, norms and FFN)."""
    d, hd, p = args.n_embd, args.head_dim, f"blk.{i}"
    specs = [TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.post_attention_norm.weight", (d,))]
    if recurrent:
        S, Hv, C = args.state_size, args.n_v_heads, args.conv_channels
        specs += [
            TensorSpec(f"{p}.attn_qkv.weight", (C, d)),
            TensorSpec(f"{p}.attn_gate.weight", (Hv * S, d)),
            TensorSpec(f"{p}.ssm_conv1d.weight", (C, args.conv_kernel)),
            TensorSpec(f"{p}.ssm_dt.bias", (Hv,)),
            TensorSpec(f"{p}.ssm_a", (Hv,)),
            TensorSpec(f"{p}.ssm_norm.weight", (S,)),
            TensorSpec(f"{p}.ssm_out.weight", (d, Hv * S)),
        ]
        if args.fused_ba:
            specs.append(TensorSpec(f"{p}.ssm_ba.weight", (2 * Hv, d)))
        else:
            specs += [TensorSpec(f"{p}.ssm_beta.weight", (Hv, d)), TensorSpec(f"{p}.ssm_alpha.weight", (Hv, d))]
    else:
        specs += [
            TensorSpec(f"{p}.attn_q.weight", (args.n_head * hd * 2, d)),
            TensorSpec(f"{p}.attn_k.weight", (args.n_head_kv * hd, d)),
            TensorSpec(f"{p}.attn_v.weight", (args.n_head_kv * hd, d)),
            TensorSpec(f"{p}.attn_output.weight", (d, args.n_head * hd)),
            TensorSpec(f"{p}.attn_q_norm.weight", (hd,)),
            TensorSpec(f"{p}.attn_k_norm.weight", (hd,)),
        ]
    if args.is_moe:
        E, F = args.n_expert, args.n_ff_exp
        specs.append(TensorSpec(f"{p}.ffn_gate_inp.weight", (E, d)))
        if args.merged_gate_up:
            specs.append(TensorSpec(f"{p}.ffn_gate_up_exps.weight", (E, 2 * F, d)))
        else:
            specs += [TensorSpec(f"{p}.ffn_gate_exps.weight", (E, F, d)),
                      TensorSpec(f"{p}.ffn_up_exps.weight", (E, F, d))]
        specs.append(TensorSpec(f"{p}.ffn_down_exps.weight", (E, d, F)))
        if args.n_ff_shexp:
            specs.append(TensorSpec(f"{p}.ffn_gate_inp_shexp.weight", (1, d) if args.shexp_gate_2d else (d,)))
            specs += decoder.dense_ffn_tensors(d, args.n_ff_shexp, p, "_shexp")
    else:
        specs += decoder.dense_ffn_tensors(d, args.n_ff, p)
    return specs


def tensors(args: Args) -> list[TensorSpec]:
    specs = base.outer_tensors(args)
    for i in range(args.n_layer):
        specs += layer_tensors(args, i, args.recurrent[i])
    return specs


# --- layers ------------------------------------------------------------------------------------
weight_f32 = base.f32_weight     # a small weight (norms, biases, ssm_a, conv) as f32 for elementwise ops
norm = base.norm_f32             # rms_norm(x) * f32 weight


def conv_taps(b: GraphBuilder, name: str):
    """The conv weight [C, Kc] as a view of a tap-major f32 copy [Kc, C] made once at load: the
    conv kernel reads channels contiguously that way (several times faster decode conv)."""
    key = name + "#taps"
    t = b._wcache.get(key)
    if t is None:
        src = b.tp if b.tp is not None and b.tp.splits(name) else b.w      # this rank's rows under TP
        taps = src.derived(key, lambda: src.f32(name).T)                   # [Kc, C]
        Kc, C = taps.shape
        t = b._wcache[key] = b.g.permute(b.g.external(key, native.DType.F32, [Kc, C], taps), [1, 0])
    return t


def attn_layer(b: GraphBuilder, args: Args, p: str, h, il_kv: int):
    """Gated full attention. h: [T, d] (normed) -> [T, d]. il_kv: this layer's KV-cache layer."""
    g = b.g
    if b.tp_empty(f"{p}.attn_q.weight"):  # tensor parallelism: no heads of this layer on this rank
        return b.zeros_like(h)
    T, H, hd = h.shape[0], args.n_head, args.head_dim
    qg = g.reshape(b.linear(h, f"{p}.attn_q.weight"), [T, H, 2 * hd])   # per head: [q | gate]
    st = list(qg.strides)
    q = g.view(qg, [T, H, hd], st)
    gate = g.view(qg, [T, H, hd], st, offset=hd * 4)
    q = norm(b, q, f"{p}.attn_q_norm.weight", args.eps)
    k = norm(b, g.reshape(b.linear(h, f"{p}.attn_k.weight"), [T, args.n_head_kv, hd]), f"{p}.attn_k_norm.weight",
             args.eps)
    v = g.reshape(b.linear(h, f"{p}.attn_v.weight"), [T, args.n_head_kv, hd])
    q = g.rope(q, b.pos, args.n_rot, ROPE_NEOX, args.rope_base, args.rope_scale)
    k = g.rope(k, b.pos, args.n_rot, ROPE_NEOX, args.rope_base, args.rope_scale)
    o = b.kv_attention(il_kv, q, k, v, 1.0 / math.sqrt(hd))                 # [T, H * hd]
    o = g.mul(o, g.reshape(g.sigmoid(gate), [T, H * hd]))
    return b.linear(o, f"{p}.attn_output.weight")


def gdn_layer(b: GraphBuilder, args: Args, p: str, h, ir: int):
    """Gated-DeltaNet mixer. h: [T, d] (normed) -> [T, d]. ir: this layer's recurrent index."""
    g = b.g
    if b.tp_empty(f"{p}.attn_qkv.weight"):  # tensor parallelism: no heads of this layer on this rank
        return b.zeros_like(h)
    T, Hk, Hv, S = h.shape[0], args.n_k_heads, args.n_v_heads, args.state_size
    kd, vd = Hk * S, Hv * S
    qkv = b.linear(h, f"{p}.attn_qkv.weight")                              # [T, 2 kd + vd]
    z = b.linear(h, f"{p}.attn_gate.weight")                               # [T, vd]
    if args.fused_ba:  # per key head: [beta (Hv/Hk) | alpha (Hv/Hk)]
        r = Hv // Hk
        ba = g.reshape(b.linear(h, f"{p}.ssm_ba.weight"), [T, Hk, 2 * r])
        st = list(ba.strides)
        beta_in = g.reshape(g.cpy(g.view(ba, [T, Hk, r], st)), [T, Hv])
        alpha = g.reshape(g.cpy(g.view(ba, [T, Hk, r], st, offset=r * 4)), [T, Hv])
    else:
        beta_in = b.linear(h, f"{p}.ssm_beta.weight")                      # [T, Hv]
        alpha = b.linear(h, f"{p}.ssm_alpha.weight")
    beta = g.sigmoid(beta_in)
    decay = g.mul(g.softplus(g.add(alpha, weight_f32(b, f"{p}.ssm_dt.bias"))), weight_f32(b, f"{p}.ssm_a"))
    conv = g.silu(b.ssm_conv(ir, qkv, conv_taps(b, f"{p}.ssm_conv1d.weight")))  # [T, C]
    C = 2 * kd + vd
    st = [C * 4, S * 4, 4]
    # q and k heads are adjacent in conv: one l2_norm over both ([T, 2 Hk, S]), then views
    qk = g.l2_norm(g.view(conv, [T, 2 * Hk, S], st), args.eps)
    qkst = [2 * kd * 4, S * 4, 4]
    q = g.view(qk, [T, Hk, S], qkst)
    k = g.view(qk, [T, Hk, S], qkst, offset=kd * 4)
    v = g.view(conv, [T, Hv, S], st, offset=2 * kd * 4)
    o = b.gated_delta_net(ir, q, k, v, decay, beta, args.gdn_broadcast, args.chunk_min)  # [T, Hv, S]
    # RMSNorm(o) * SiLU(z) as one swiglu(z, normed o) (silu(gate) * up: the same products)
    o = g.swiglu(g.reshape(z, [T, Hv, S]), norm(b, o, f"{p}.ssm_norm.weight", args.eps))
    return b.linear(g.reshape(o, [T, vd]), f"{p}.ssm_out.weight")


def ffn(b: GraphBuilder, args: Args, p: str, h):
    """Dense SwiGLU FFN, or routed experts plus a sigmoid-gated shared expert. [T, d] -> [T, d]."""
    g = b.g
    if not args.is_moe:
        return b.ffn_swiglu(h, p)
    out = b.moe_ffn(h, p, args.n_expert_used, args.norm_topk, args.weights_scale)
    if args.n_ff_shexp:
        sh = b.ffn_swiglu(h, p, "_shexp")
        gw = g.reshape(weight_f32(b, f"{p}.ffn_gate_inp_shexp.weight"), [1, args.n_embd])
        out = g.add(out, g.mul(sh, g.sigmoid(g.matmul(h, gw))))            # gate: [T, 1]
    return out


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for the rows in b.out_ids (and outputs "hidden" [T, d],
    the post-final-norm hidden state of every row, when b.export_hidden)."""
    g = b.g
    x = b.embed("token_embd.weight")                                       # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    ia = ir = 0
    for i in range(args.n_layer):
        p = f"blk.{i}"
        h = norm(b, x, f"{p}.attn_norm.weight", args.eps)
        if args.recurrent[i]:
            h = gdn_layer(b, args, p, h, ir)
            ir += 1
        else:
            h = attn_layer(b, args, p, h, ia)
            ia += 1
        x = g.add(x, b.reduce(h))
        if i == args.n_layer - 1 and not b.all_rows:
            x = b.select_outputs(x)                                        # [n_out, d]
        h = norm(b, x, f"{p}.post_attention_norm.weight", args.eps)
        x = b.control(g.add(x, b.reduce(ffn(b, args, p, h))), i)
    return base.output_logits(b, args, x, partial(norm, b))


# --- MTP (nextn) block -------------------------------------------------------------------------
def nextn_tensors(args: Args, j: int = 0) -> list[TensorSpec]:
    """The tensors of MTP block j (block index n_layer + j): a full-attention layer plus the
    nextn projections and norms (own embedding / head / head norm are optional)."""
    return base.nextn_tensors(args, j, lambda il: layer_tensors(args, il, recurrent=False))


def build_nextn(b: GraphBuilder, args: Args, j: int = 0):
    """MTP block j as a graph: row t takes (token_t, h_t) with h_t from the graph input "h"
    [T, d] (the trunk's post-norm hidden of the previous position, or the previous draft step's
    carry) and returns logits [n_out, n_vocab] for b.out_ids; it also outputs "hidden" [T, d],
    the block's post-norm output (the next carry). Its attention uses KV layer 0 of b.kv (give
    the block its own one-layer KVCache). ``algorithms.md`` §1.1."""
    def layer(x, p, il):
        x = b.g.add(x, attn_layer(b, args, p, norm(b, x, f"{p}.attn_norm.weight", args.eps), 0))
        return b.g.add(x, ffn(b, args, p, norm(b, x, f"{p}.post_attention_norm.weight", args.eps)))
    return base.build_nextn(b, args, j, layer, partial(norm, b))
