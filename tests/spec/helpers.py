"""Helpers for the speculation tests: tiny draft models and test proposers."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from pyfast.spec.base import Draft, DraftRequest, Proposer

_TOKENIZER_INT_KEYS = {
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
}


def write_tiny_draft(path: str | Path, target_metadata: dict, *, n_embd: int = 64, n_layer: int = 2,
                     n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, context_length: int = 8192,
                     seed: int = 0, vocab_from_target: bool = True, n_vocab: int | None = None) -> Path:
    """A random-weight llama GGUF (tied embeddings, F16 matrices) that uses the target's tokenizer.

    With vocab_from_target=False it gets placeholder tokens instead (an incompatible vocabulary of
    the same size, or of ``n_vocab`` tokens).
    """
    path = Path(path)
    md = target_metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    if not vocab_from_target:
        tokens = [f"<tok{i}>" for i in range(n_vocab or len(tokens))]
    V = len(tokens)
    rng = np.random.default_rng(seed)

    def mat(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny-draft")
    w.add_uint32("general.file_type", 1)
    w.add_uint32("llama.vocab_size", V)
    w.add_uint32("llama.context_length", context_length)
    w.add_uint32("llama.embedding_length", n_embd)
    w.add_uint32("llama.block_count", n_layer)
    w.add_uint32("llama.feed_forward_length", n_ff)
    w.add_uint32("llama.attention.head_count", n_head)
    w.add_uint32("llama.attention.head_count_kv", n_head_kv)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.rope.dimension_count", head_dim)
    w.add_tokenizer_model(md.get("tokenizer.ggml.model", "gpt2"))
    if vocab_from_target:
        w.add_tokenizer_pre(md.get("tokenizer.ggml.pre", "default"))
        w.add_token_list(tokens)
        w.add_token_types(list(md["tokenizer.ggml.token_type"]))
        w.add_token_merges(list(md["tokenizer.ggml.merges"]))
        for key, fn in _TOKENIZER_INT_KEYS.items():
            if key in md:
                getattr(w, fn)(int(md[key]))
        w.add_add_bos_token(bool(md.get("tokenizer.ggml.add_bos_token", False)))
        if "tokenizer.chat_template" in md:
            w.add_chat_template(md["tokenizer.chat_template"])
    else:
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([int(gguf.TokenType.NORMAL)] * V)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", mat(V, n_embd))
    w.add_tensor("output_norm.weight", norm(n_embd))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm(n_embd))
        w.add_tensor(b + "attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(b + "attn_k.weight", mat(head_dim * n_head_kv, n_embd))
        w.add_tensor(b + "attn_v.weight", mat(head_dim * n_head_kv, n_embd))
        w.add_tensor(b + "attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(b + "ffn_norm.weight", norm(n_embd))
        w.add_tensor(b + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(b + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(b + "ffn_down.weight", mat(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class OracleProposer(Proposer):
    """Drafts the target's own (precomputed) greedy continuation of each sequence.

    ``truth[seq]`` is the full token sequence (prompt + greedy output); the draft is what follows
    the current length in it.
    """

    name = "oracle"

    def __init__(self):
        self.truth: dict[int, list[int]] = {}

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out = []
        for r in requests:
            t = self.truth.get(r.seq, [])
            L = r.tokens.size
            cont = t[L: L + r.n_max]
            out.append(Draft(np.asarray(cont, dtype=np.int32)) if cont else None)
        return out


class RandomProposer(Proposer):
    """Drafts uniformly random tokens."""

    name = "random"

    def __init__(self, n_vocab: int, seed: int = 0, n: int = 4):
        self.n_vocab = n_vocab
        self.n = n
        self.rng = np.random.default_rng(seed)

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        return [Draft(self.rng.integers(0, self.n_vocab, size=min(self.n, r.n_max)).astype(np.int32))
                for r in requests]
