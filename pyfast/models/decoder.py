"""The standard pre-norm decoder shared by ``llama``, ``qwen2``, ``qwen3`` and ``qwen3moe``.

Each layer: ``x += attn_output(attention(rope(q), rope(k), v))`` on ``rms_norm(x) * attn_norm``,
then ``x += ffn(rms_norm(x) * ffn_norm)``. Variants, all read from the GGUF (llama.cpp's names):

* q / k / v biases (``attn_{q,k,v}.bias``, Qwen2) where the file has them;
* per-head q / k RMS norms (``attn_q_norm`` / ``attn_k_norm`` [head_dim], Qwen3) before rope;
* rope: NORMAL pairs for ``llama`` (its converter permutes the q / k rows), NEOX for the Qwen
  family; linear / YaRN scaling and Llama 3's ``rope_freqs.weight`` (``pyfast/models/rope.py``);
* FFN: SwiGLU, or routed experts (``{arch}.expert_count``): softmax router, top
  ``expert_used_count``, weights renormalised unless ``expert_weights_norm`` is false, experts as
  ``ffn_{gate,up}_exps`` or pre-merged ``ffn_gate_up_exps`` [E, 2 ff, d] (gate rows first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyfast.models import base
from pyfast.models.base import GraphBuilder, TensorSpec
from pyfast.models.rope import Rope, read_rope


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int              # dense FFN width (0 for MoE models)
    rope: Rope
    eps: float
    n_ctx_train: int
    tied: bool
    qk_norm: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    norm_topk: bool = True
    weights_scale: float = 1.0
    merged_gate_up: bool = False  # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    # the rope's settings under the names older code used
    @property
    def n_rot(self) -> int:
        return self.rope.n_rot

    @property
    def rope_base(self) -> float:
        return self.rope.base

    @property
    def rope_scale(self) -> float:
        return self.rope.freq_scale

    @classmethod
    def from_gguf(cls, md: dict, weights, arch: str, rope_mode: int, qk_norm: bool = False, moe: bool | None = None,
                  default_eps: float = 1e-6, default_ctx: int = 4096, path: str = "",
                  types: dict | None = None) -> "Args":
        """Read and check the hyper-parameters against each other and the tensors (before
        anything is allocated); a bad value is a ValueError naming the key. moe: None = MoE when
        ``{arch}.expert_count`` is present."""
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)
        a = arch
        n_embd = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        n_layer = m.int(f"{a}.block_count", lo=1, hi=M.MAX_LAYERS)
        M.check_blocks(path, f"{a}.block_count", n_layer, weights)
        n_head, n_head_kv, head_dim = attention_dims(m, a, n_embd, path)
        n_rot = m.int(f"{a}.rope.dimension_count", head_dim, lo=2, hi=head_dim)
        if n_rot % 2:
            raise m.fail(f"{a}.rope.dimension_count", n_rot, "an even number")
        if moe is None:
            moe = m.has(f"{a}.expert_count") and m.int(f"{a}.expert_count", lo=0, hi=M.MAX_EXPERTS) > 0
        kw: dict = {}
        if moe:
            kw.update(moe_args(m, a, weights, n_embd))
            n_ff = m.int(f"{a}.feed_forward_length", 0, lo=0, hi=M.MAX_FF)
        else:
            n_ff = m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF)
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, a)
        return cls(
            arch=a, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
            head_dim=head_dim, n_ff=n_ff, rope=read_rope(m, a, weights, n_rot, rope_mode),
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", default_eps, positive=True),
            n_ctx_train=m.int(f"{a}.context_length", default_ctx, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights, qk_norm=qk_norm, **kw,
        )


def attention_dims(m, a: str, n_embd: int, path: str = "") -> tuple[int, int, int]:
    """(n_head, n_head_kv, head_dim) from ``{a}.attention.*``, checked."""
    from pyfast.models import meta as M

    n_head = m.int(f"{a}.attention.head_count", lo=1, hi=M.MAX_HEADS)
    n_head_kv = m.int(f"{a}.attention.head_count_kv", n_head, lo=1, hi=n_head)
    if n_head % n_head_kv:
        raise m.fail(f"{a}.attention.head_count_kv", n_head_kv, f"a divisor of attention.head_count ({n_head})")
    if m.has(f"{a}.attention.key_length"):
        head_dim = m.int(f"{a}.attention.key_length", lo=2, hi=M.MAX_HEAD_DIM)
    else:
        if n_embd % n_head:
            raise m.fail(f"{a}.attention.head_count", n_head,
                         f"a divisor of embedding_length ({n_embd}) when attention.key_length is absent")
        head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"{path}: head dimension {head_dim} (embedding_length / head_count or "
                         f"attention.key_length) must be even for rotary embeddings")
    vl = m.int(f"{a}.attention.value_length", head_dim, lo=1, hi=M.MAX_HEAD_DIM)
    if vl != head_dim:
        raise m.fail(f"{a}.attention.value_length", vl, f"{head_dim}, the key length")
    return n_head, n_head_kv, head_dim


def moe_args(m, a: str, weights, n_embd: int, first_moe: int = 0) -> dict:
    """The routed-expert settings (``expert_count`` ...) and the file's expert layout."""
    from pyfast.models import meta as M

    n_expert = m.int(f"{a}.expert_count", lo=1, hi=M.MAX_EXPERTS)
    return dict(
        n_expert=n_expert,
        n_expert_used=m.int(f"{a}.expert_used_count", lo=1, hi=n_expert),
        n_ff_exp=m.int(f"{a}.expert_feed_forward_length", lo=1, hi=M.MAX_FF),
        norm_topk=m.bool(f"{a}.expert_weights_norm", True),
        weights_scale=m.float(f"{a}.expert_weights_scale", 1.0, positive=True),
        merged_gate_up=f"blk.{first_moe}.ffn_gate_up_exps.weight" in weights,
    )


# --- tensors -----------------------------------------------------------------------------------
def attn_tensors(args, p: str, bias: bool = False) -> list[TensorSpec]:
    d, hd = args.n_embd, args.head_dim
    qd, kd = args.n_head * hd, args.n_head_kv * hd
    specs = [
        TensorSpec(f"{p}.attn_q.weight", (qd, d)),
        TensorSpec(f"{p}.attn_k.weight", (kd, d)),
        TensorSpec(f"{p}.attn_v.weight", (kd, d)),
        TensorSpec(f"{p}.attn_output.weight", (d, qd)),
        TensorSpec(f"{p}.attn_q.bias", (qd,), optional=not bias),
        TensorSpec(f"{p}.attn_k.bias", (kd,), optional=not bias),
        TensorSpec(f"{p}.attn_v.bias", (kd,), optional=not bias),
    ]
    if getattr(args, "qk_norm", False):
        specs += [TensorSpec(f"{p}.attn_q_norm.weight", (hd,)), TensorSpec(f"{p}.attn_k_norm.weight", (hd,))]
    return specs


def expert_tensors(args, p: str) -> list[TensorSpec]:
    d, E, F = args.n_embd, args.n_expert, args.n_ff_exp
    specs = [TensorSpec(f"{p}.ffn_gate_inp.weight", (E, d))]
    if args.merged_gate_up:
        specs.append(TensorSpec(f"{p}.ffn_gate_up_exps.weight", (E, 2 * F, d)))
    else:
        specs += [TensorSpec(f"{p}.ffn_gate_exps.weight", (E, F, d)), TensorSpec(f"{p}.ffn_up_exps.weight", (E, F, d))]
    specs.append(TensorSpec(f"{p}.ffn_down_exps.weight", (E, d, F)))
    return specs


def dense_ffn_tensors(d: int, ff: int, p: str, suffix: str = "") -> list[TensorSpec]:
    """A SwiGLU FFN's ffn_{gate,up,down}{suffix} (suffix "_shexp": the shared experts)."""
    return [TensorSpec(f"{p}.ffn_gate{suffix}.weight", (ff, d)), TensorSpec(f"{p}.ffn_up{suffix}.weight", (ff, d)),
            TensorSpec(f"{p}.ffn_down{suffix}.weight", (d, ff))]


def tensors(args: Args) -> list[TensorSpec]:
    d = args.n_embd
    specs = base.outer_tensors(args)
    for i in range(args.n_layer):
        p = f"blk.{i}"
        specs += [TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.ffn_norm.weight", (d,))]
        specs += attn_tensors(args, p)
        specs += expert_tensors(args, p) if args.is_moe else dense_ffn_tensors(d, args.n_ff, p)
    return specs


# --- layers ------------------------------------------------------------------------------------
def attention(b: GraphBuilder, args, p: str, h, il: int, rope: Rope | None = None, scale: float | None = None):
    """Self-attention of layer p over KV layer il. h: [T, d] (normed) -> [T, d]."""
    g = b.g
    if b.tp_empty(f"{p}.attn_q.weight"):  # tensor parallelism: no heads of this layer on this rank
        return b.zeros_like(h)
    T, hd = h.shape[0], args.head_dim
    q = g.reshape(b.linear(h, f"{p}.attn_q.weight", f"{p}.attn_q.bias"), [T, args.n_head, hd])
    k = g.reshape(b.linear(h, f"{p}.attn_k.weight", f"{p}.attn_k.bias"), [T, args.n_head_kv, hd])
    v = g.reshape(b.linear(h, f"{p}.attn_v.weight", f"{p}.attn_v.bias"), [T, args.n_head_kv, hd])
    if getattr(args, "qk_norm", False):
        q = b.norm(q, f"{p}.attn_q_norm.weight", args.eps)
        k = b.norm(k, f"{p}.attn_k_norm.weight", args.eps)
    rope = rope or args.rope
    q, k = rope.apply(b, q), rope.apply(b, k)
    o = b.kv_attention(il, q, k, v, 1.0 / math.sqrt(hd) if scale is None else scale)   # [T, H * hd]
    return b.linear(o, f"{p}.attn_output.weight")


f32_weight = base.f32_weight     # a small weight (norm, bias) as f32 for elementwise ops


def ffn(b: GraphBuilder, args, p: str, h):
    if args.is_moe:
        return b.moe_ffn(h, p, args.n_expert_used, args.norm_topk, args.weights_scale)
    return b.ffn_swiglu(h, p)


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for the rows in b.out_ids (and outputs "hidden" [T, d],
    the post-final-norm hidden state of every row, when b.export_hidden)."""
    g = b.g
    x = b.embed("token_embd.weight")                                   # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    for i in range(args.n_layer):
        p = f"blk.{i}"
        x = g.add(x, b.reduce(attention(b, args, p, b.norm(x, f"{p}.attn_norm.weight", args.eps), i)))
        if i == args.n_layer - 1 and not b.all_rows:
            x = b.select_outputs(x)                                    # [n_out, d]
        x = b.control(g.add(x, b.reduce(ffn(b, args, p, b.norm(x, f"{p}.ffn_norm.weight", args.eps)))), i)
    return base.output_logits(b, args, x)                              # [n_out, n_vocab]
