"""Llama architecture (Llama 2/3, Mistral, SmolLM2): pre-norm decoder, GQA attention with
rotary embeddings, SwiGLU feed-forward."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models.base import GraphBuilder, TensorSpec, attn_scale

ARCH = "llama"


@dataclass
class Args:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_base: float
    rope_scale: float
    eps: float
    n_ctx_train: int
    tied: bool

    @classmethod
    def from_gguf(cls, md: dict, weights) -> "Args":
        a = ARCH

        def need(key):
            if f"{a}.{key}" not in md:
                raise ValueError(f"GGUF metadata lacks '{a}.{key}'")
            return md[f"{a}.{key}"]

        n_embd = int(need("embedding_length"))
        n_head = int(need("attention.head_count"))
        head_dim = int(md.get(f"{a}.attention.key_length", n_embd // n_head))
        n_vocab = weights.shape("token_embd.weight")[0]
        scaling = md.get(f"{a}.rope.scaling.type", "none")
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = 1.0 / float(md.get(f"{a}.rope.scaling.factor", 1.0))
        return cls(
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=int(need("block_count")),
            n_head=n_head,
            n_head_kv=int(md.get(f"{a}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(need("feed_forward_length")),
            n_rot=int(md.get(f"{a}.rope.dimension_count", head_dim)),
            rope_base=float(md.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scale=rope_scale,
            eps=float(md.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(md.get(f"{a}.context_length", 2048)),
            tied="output.weight" not in weights,
        )


def tensors(args: Args) -> list[TensorSpec]:
    d, hd = args.n_embd, args.head_dim
    specs = [
        TensorSpec("token_embd.weight", (args.n_vocab, d)),
        TensorSpec("output_norm.weight", (d,)),
        TensorSpec("output.weight", (args.n_vocab, d), optional=True),
    ]
    for i in range(args.n_layer):
        p = f"blk.{i}"
        specs += [
            TensorSpec(f"{p}.attn_norm.weight", (d,)),
            TensorSpec(f"{p}.attn_q.weight", (args.n_head * hd, d)),
            TensorSpec(f"{p}.attn_k.weight", (args.n_head_kv * hd, d)),
            TensorSpec(f"{p}.attn_v.weight", (args.n_head_kv * hd, d)),
            TensorSpec(f"{p}.attn_output.weight", (d, args.n_head * hd)),
            TensorSpec(f"{p}.ffn_norm.weight", (d,)),
            TensorSpec(f"{p}.ffn_gate.weight", (args.n_ff, d)),
            TensorSpec(f"{p}.ffn_up.weight", (args.n_ff, d)),
            TensorSpec(f"{p}.ffn_down.weight", (d, args.n_ff)),
        ]
    return specs


def build(b: GraphBuilder, args: Args):
    """Returns logits [n_out, n_vocab] for the rows in b.out_ids."""
    g = b.g
    T, hd = b.shape.n_tokens, args.head_dim
    x = b.embed("token_embd.weight")                                   # [T, n_embd]
    for i in range(args.n_layer):
        p = f"blk.{i}"
        h = b.norm(x, f"{p}.attn_norm.weight", args.eps)
        q = g.reshape(b.linear(h, f"{p}.attn_q.weight"), [T, args.n_head, hd])
        k = g.reshape(b.linear(h, f"{p}.attn_k.weight"), [T, args.n_head_kv, hd])
        v = g.reshape(b.linear(h, f"{p}.attn_v.weight"), [T, args.n_head_kv, hd])
        q = g.rope(q, b.pos, args.n_rot, 0, args.rope_base, args.rope_scale)
        k = g.rope(k, b.pos, args.n_rot, 0, args.rope_base, args.rope_scale)
        attn = b.kv_attention(i, q, k, v, attn_scale(hd))             # [T, n_head * hd]
        x = g.add(x, b.linear(attn, f"{p}.attn_output.weight"))
        if i == args.n_layer - 1:
            x = b.select_outputs(x)                                    # [n_out, n_embd]
        h = b.norm(x, f"{p}.ffn_norm.weight", args.eps)
        x = b.control(g.add(x, b.ffn_swiglu(h, p)), i)
    x = b.norm(x, "output_norm.weight", args.eps)
    out_w = "token_embd.weight" if args.tied else "output.weight"
    return b.linear(x, out_w)                                          # [n_out, n_vocab]
