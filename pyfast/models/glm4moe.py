"""GLM-4.5 / GLM-4.6 MoE (``glm4moe``): a pre-norm decoder whose first
``leading_dense_block_count`` layers have a dense SwiGLU FFN and the rest routed experts plus
shared experts, with a NextN (MTP) block after the trunk.

* Attention: GQA with q / k / v biases (where the file has them), optional per-head q / k RMS
  norms (``attn_q_norm`` / ``attn_k_norm``), NEOX rope over the first ``rope.dimension_count``
  dims of each head (partial rotary), scale ``1 / sqrt(head_dim)``.
* Router: ``s = sigmoid(x @ ffn_gate_inp)``; experts are chosen by ``s + exp_probs_b`` (the
  selection bias), weighted by the unbiased ``s`` renormalised over the chosen ones (unless
  ``expert_weights_norm`` is false) times ``expert_weights_scale``; grouped routing is not
  used by these models (``n_group = 1``). The shared experts are one SwiGLU
  ``ffn_{gate,up,down}_shexp`` of ``expert_shared_count * expert_feed_forward_length``.
* The ``nextn_predict_layers`` blocks after the trunk (``blk.{n_layer + j}``) are MTP blocks:
  ``x = eh_proj([enorm(embed(token_p)) ; hnorm(h_{p-1})])``, then one MoE decoder layer, then
  ``shared_head_norm`` and the head (``nextn.shared_head_head``, else the trunk's). ``build_nextn``
  builds one as its own graph for ``draft-mtp`` (``pyfast/spec/mtp.py``); the carry is the
  post-norm hidden, as for Qwen3.5.
"""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import base, decoder
from pyfast.models.base import GraphBuilder, TensorSpec
from pyfast.models.moe import routed_experts, select_experts
from pyfast.models.rope import ROPE_NEOX, Rope, read_rope

ARCH = "glm4moe"
EXPORTS_HIDDEN = True
MTP_CARRY = "post_norm"


@dataclass
class Args:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int            # trunk layers (block_count minus the nextn blocks)
    n_nextn: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int               # the leading dense layers' FFN width
    n_dense_lead: int
    rope: Rope
    eps: float
    n_ctx_train: int
    tied: bool
    qk_norm: bool
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    norm_topk: bool = True
    weights_scale: float = 1.0
    merged_gate_up: bool = False

    @property
    def is_moe(self) -> bool:
        return True

    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        from pyfast.models import meta as M

        m = M.Meta(md, path, types)
        a = ARCH
        n_embd = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        _, n_layer, n_nextn = base.read_blocks(m, a, weights, path)
        n_head, n_head_kv, head_dim = decoder.attention_dims(m, a, n_embd, path)
        n_rot = m.int(f"{a}.rope.dimension_count", head_dim, lo=2, hi=head_dim)
        if n_rot % 2:
            raise m.fail(f"{a}.rope.dimension_count", n_rot, "an even number")
        n_lead = m.int(f"{a}.leading_dense_block_count", 0, lo=0, hi=n_layer)
        gating = m.int(f"{a}.expert_gating_func", 2, lo=1, hi=2)
        if gating != 2:
            raise m.fail(f"{a}.expert_gating_func", gating, "2 (sigmoid), the gating of this architecture")
        moe = decoder.moe_args(m, a, weights, n_embd, first_moe=n_lead)
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, a)
        return cls(
            arch=a, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_nextn=n_nextn, n_head=n_head,
            n_head_kv=n_head_kv, head_dim=head_dim,
            n_ff=m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF) if n_lead else 0, n_dense_lead=n_lead,
            rope=read_rope(m, a, weights, n_rot, ROPE_NEOX),
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
            n_ctx_train=m.int(f"{a}.context_length", 4096, lo=1, hi=M.MAX_CTX),
            tied="output.weight" not in weights, qk_norm="blk.0.attn_q_norm.weight" in weights,
            n_expert_shared=m.int(f"{a}.expert_shared_count", 0, lo=0, hi=M.MAX_EXPERTS), **moe,
        )


# --- tensors -----------------------------------------------------------------------------------
def layer_tensors(args: Args, i: int) -> list[TensorSpec]:
    d, p = args.n_embd, f"blk.{i}"
    specs = [TensorSpec(f"{p}.attn_norm.weight", (d,)), TensorSpec(f"{p}.post_attention_norm.weight", (d,))]
    specs += decoder.attn_tensors(args, p)
    if i < args.n_dense_lead:
        return specs + decoder.dense_ffn_tensors(d, args.n_ff, p)
    specs += decoder.expert_tensors(args, p)
    specs.append(TensorSpec(f"{p}.exp_probs_b.bias", (args.n_expert,)))
    if args.n_expert_shared:
        specs += decoder.dense_ffn_tensors(d, args.n_expert_shared * args.n_ff_exp, p, "_shexp")
    return specs


def tensors(args: Args) -> list[TensorSpec]:
    specs = base.outer_tensors(args)
    for i in range(args.n_layer):
        specs += layer_tensors(args, i)
    return specs


# --- layers ------------------------------------------------------------------------------------
def moe(b: GraphBuilder, args: Args, p: str, h):
    """Sigmoid-routed experts with a selection bias, plus the shared experts. [T, d] -> [T, d]."""
    g = b.g
    logits = b.linear(h, f"{p}.ffn_gate_inp.weight")                      # [T, E]
    ids, w = select_experts(b, logits, args.n_expert_used, gating="sigmoid",
                            bias=decoder.f32_weight(b, f"{p}.exp_probs_b.bias"), norm=args.norm_topk,
                            scale=args.weights_scale)
    out = routed_experts(b, h, p, ids, w)
    if args.n_expert_shared:
        out = g.add(out, b.ffn_swiglu(h, p, "_shexp"))
    return out


def layer(b: GraphBuilder, args: Args, i: int, x, il_kv: int, last: bool = False):
    """Decoder layer i over KV layer il_kv. x: [T, d] -> [T, d] ([n_out, d] when last)."""
    g, p = b.g, f"blk.{i}"
    x = g.add(x, decoder.attention(b, args, p, b.norm(x, f"{p}.attn_norm.weight", args.eps), il_kv))
    if last:
        x = b.select_outputs(x)
    h = b.norm(x, f"{p}.post_attention_norm.weight", args.eps)
    return g.add(x, b.ffn_swiglu(h, p) if i < args.n_dense_lead else moe(b, args, p, h))


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for b.out_ids (and outputs "hidden" [T, d], the
    post-final-norm hidden of every row, when b.export_hidden)."""
    x = b.embed("token_embd.weight")                                     # [T, d]
    x = b.control(x, -1)  # (never a control vector here; captures layer 0's input when asked)
    for i in range(args.n_layer):
        x = b.control(layer(b, args, i, x, i, last=i == args.n_layer - 1 and not b.all_rows), i)
    return base.output_logits(b, args, x)


# --- MTP (nextn) block -------------------------------------------------------------------------
def nextn_tensors(args: Args, j: int = 0) -> list[TensorSpec]:
    return base.nextn_tensors(args, j, lambda il: layer_tensors(args, il))


def build_nextn(b: GraphBuilder, args: Args, j: int = 0):
    """MTP block j as a graph: row t takes (token_t, h_t) with h_t from the graph input "h" [T, d]
    and returns logits [n_out, n_vocab] for b.out_ids; it outputs "hidden" [T, d], the block's
    post-norm output (the next carry). Its attention uses KV layer 0 of b.kv."""
    return base.build_nextn(b, args, j, lambda x, p, il: layer(b, args, il, x, 0))
