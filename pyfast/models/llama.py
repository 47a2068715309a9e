"""Llama architecture (Llama 2/3, Mistral, SmolLM2): pre-norm decoder, GQA attention with
rotary embeddings, SwiGLU feed-forward."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models.base import GraphBuilder, TensorSpec, attn_scale

ARCH = "llama"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (embeddings, drafters)


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
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        """Read and check the hyper-parameters against each other and the tensors (before
        anything is allocated); a bad value is a ValueError naming the key."""
        from pyfast.models import meta as M

        a = ARCH
        m = M.Meta(md, path, types)
        n_embd = m.int(f"{a}.embedding_length", lo=1, hi=M.MAX_EMBD)
        n_layer = m.int(f"{a}.block_count", lo=1, hi=M.MAX_LAYERS)
        M.check_blocks(path, f"{a}.block_count", n_layer, weights)
        n_head = m.int(f"{a}.attention.head_count", lo=1, hi=M.MAX_HEADS)
        n_head_kv = m.int(f"{a}.attention.head_count_kv", n_head, lo=1, hi=n_head)
        if n_head % n_head_kv:
            raise m.fail(f"{a}.attention.head_count_kv", n_head_kv,
                          f"a divisor of attention.head_count ({n_head})")
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
        n_rot = m.int(f"{a}.rope.dimension_count", head_dim, lo=2, hi=head_dim)
        if n_rot % 2:
            raise m.fail(f"{a}.rope.dimension_count", n_rot, "an even number")
        scaling = m.str(f"{a}.rope.scaling.type", "none")
        rope_scale = 1.0
        if scaling == "linear":
            rope_scale = 1.0 / m.float(f"{a}.rope.scaling.factor", 1.0, positive=True)
        n_vocab = M.embedding_rows(path, weights, n_embd)
        M.check_vocab(path, md, n_vocab, a)
        return cls(
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=m.int(f"{a}.feed_forward_length", lo=1, hi=M.MAX_FF),
            n_rot=n_rot,
            rope_base=m.float(f"{a}.rope.freq_base", 10000.0, positive=True),
            rope_scale=rope_scale,
            eps=m.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
            n_ctx_train=m.int(f"{a}.context_length", 2048, lo=1, hi=M.MAX_CTX),
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
    """Returns logits [n_out, n_vocab] for the rows in b.out_ids (and outputs "hidden" [T, n_embd],
    the post-final-norm hidden state of every row, when b.export_hidden)."""
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
        if i == args.n_layer - 1 and not b.export_hidden:
            x = b.select_outputs(x)                                    # [n_out, n_embd]
        h = b.norm(x, f"{p}.ffn_norm.weight", args.eps)
        x = b.control(g.add(x, b.ffn_swiglu(h, p)), i)
    x = b.norm(x, "output_norm.weight", args.eps)
    if b.export_hidden:
        g.output(x, "hidden")                                          # [T, n_embd]
        x = b.select_outputs(x)
    out_w = "token_embd.weight" if args.tied else "output.weight"
    return b.linear(x, out_w)                                          # [n_out, n_vocab]
