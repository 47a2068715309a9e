"""Tiny random-weight llama GGUF files for tests, written with the ``gguf`` PyPI package.

Tensor names and metadata keys are llama.cpp's. Weights are random (seeded) and scaled so that
activations stay O(1): 2-D matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2).

q/k weights are not permuted: with random weights there is nothing to permute, and the
reference (``llama_numpy``) defines rope consistently with llama.cpp's NORMAL mode, which
rotates adjacent pairs (2i, 2i+1) of each head by ``pos * base^(-2i/n_rot)``.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = ["write_tiny_llama", "write_llama_gguf", "byte_level_chars", "WTYPES"]

# wtype -> (GGML type, general.file_type value (llama_ftype))
WTYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, 0),
    "f16": (gguf.GGMLQuantizationType.F16, 1),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, 2),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, 3),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, 7),
}

_BLOCK = {"f32": 1, "f16": 1, "q4_0": 32, "q4_1": 32, "q8_0": 32}


def byte_level_chars() -> list[str]:
    """The GPT-2 byte-level alphabet: entry b is the printable character standing for byte b.

    Bytes that are already visible Latin-1 characters stand for themselves; the rest (control
    bytes, space, 0x7f-0xa0, 0xad) are shifted to code points 256, 257, ... in byte order.
    """
    visible = (set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1))
               | set(range(0xAE, 0xFF + 1)))
    out, shift = [], 0
    for b in range(256):
        if b in visible:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


_MERGES = ["Ġ t", "h e", "Ġ a", "i n"]


def _vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary that fits in ``n_vocab`` ids.

    ids 0, 1 = ``<s>``, ``</s>`` (control); then one token per byte, most useful first (space,
    a-z, newline, digits, some punctuation, A-Z, the rest); the last 4 ids are the results of a
    few merges (``Ġt``, ``he``, ``Ġa``, ``in``) when n_vocab >= 40 so that BPE has something to
    merge; ids past 2 + 256 + 4 are unused placeholders. Returns (tokens, token_types, merges).
    """
    chars = byte_level_chars()
    first = [ord(" ")] + list(range(ord("a"), ord("z") + 1)) + [ord("\n")]
    first += list(range(ord("0"), ord("9") + 1)) + [ord(c) for c in ".,!?'-:"]
    first += list(range(ord("A"), ord("Z") + 1))
    byte_order = first + [b for b in range(256) if b not in set(first)]
    merges = _MERGES if n_vocab >= 40 else []
    merged = [m.replace(" ", "") for m in merges]
    n_bytes = min(256, n_vocab - 2 - len(merged))
    tokens = ["<s>", "</s>"] + [chars[b] for b in byte_order[:n_bytes]] + merged
    types = ([int(gguf.TokenType.CONTROL)] * 2
             + [int(gguf.TokenType.NORMAL)] * (n_bytes + len(merged)))
    extra = n_vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(extra)]
    types += [int(gguf.TokenType.UNUSED)] * extra
    return tokens, types, merges


def write_tiny_llama(
    path: str | Path,
    *,
    n_vocab: int = 64,
    n_embd: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 48,
    n_ctx: int = 128,
    rope_base: float = 10000.0,
    eps: float = 1e-5,
    wtype: str = "f32",
    tied: bool = False,
    seed: int = 0,
    n_rot: int | None = None,
) -> dict:
    """Write a random-weight llama GGUF to ``path`` and describe it.

    ``wtype`` (f32, f16, q8_0, q4_0, q4_1) is used for every 2-D matrix, token_embd and output
    included; norms are always F32. Quantized types need every matrix's inner dimension
    (n_embd, n_ff) to be a multiple of 32. ``n_rot`` (default head_dim) sets
    ``llama.rope.dimension_count``.

    Returns a dict with the config (same names as the arguments plus ``head_dim``, ``n_rot``,
    ``path``, ``tokens``, ``merges``, ``bos_token_id``, ``eos_token_id``) and ``weights``: every
    tensor as float32, outermost-first, holding exactly the values stored in the file
    (dequantized).
    """
    if wtype not in WTYPES:
        raise ValueError(f"wtype must be one of {sorted(WTYPES)}, got {wtype!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    head_dim = n_embd // n_head
    n_rot = head_dim if n_rot is None else n_rot
    if head_dim % 2 or n_rot % 2 or not 0 < n_rot <= head_dim:
        raise ValueError(f"need even head_dim and even 0 < n_rot <= head_dim "
                         f"(head_dim={head_dim}, n_rot={n_rot})")
    if n_vocab < 3:
        raise ValueError("n_vocab must be >= 3")
    block = _BLOCK[wtype]
    for name, dim in (("n_embd", n_embd), ("n_ff", n_ff)):
        if dim % block:
            raise ValueError(f"wtype={wtype} needs {name} to be a multiple of {block}, got {dim}")

    path = Path(path)
    rng = np.random.default_rng(seed)
    n_embd_kv = head_dim * n_head_kv

    def mat(n_out: int, n_in: int) -> np.ndarray:  # [n_out, n_in]
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {}
    tensors["token_embd.weight"] = mat(n_vocab, n_embd)
    tensors["output_norm.weight"] = norm(n_embd)
    if not tied:
        tensors["output.weight"] = mat(n_vocab, n_embd)
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors[b + "attn_norm.weight"] = norm(n_embd)
        tensors[b + "attn_q.weight"] = mat(n_embd, n_embd)
        tensors[b + "attn_k.weight"] = mat(n_embd_kv, n_embd)
        tensors[b + "attn_v.weight"] = mat(n_embd_kv, n_embd)
        tensors[b + "attn_output.weight"] = mat(n_embd, n_embd)
        tensors[b + "ffn_norm.weight"] = norm(n_embd)
        tensors[b + "ffn_gate.weight"] = mat(n_ff, n_embd)
        tensors[b + "ffn_up.weight"] = mat(n_ff, n_embd)
        tensors[b + "ffn_down.weight"] = mat(n_embd, n_ff)

    stored = write_llama_gguf(path, tensors, n_head=n_head, n_head_kv=n_head_kv, n_ctx=n_ctx,
                              rope_base=rope_base, eps=eps, wtype=wtype, n_rot=n_rot)
    tokens, _, merges = _vocab(n_vocab)
    return dict(
        path=path, arch="llama", n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=n_head_kv, n_ff=n_ff, n_ctx=n_ctx, rope_base=float(rope_base), eps=float(eps),
        wtype=wtype, tied=tied, seed=seed, head_dim=head_dim, n_rot=n_rot, tokens=tokens,
        bos_token_id=0, eos_token_id=1, merges=merges, weights=stored,
    )


def write_llama_gguf(
    path: str | Path,
    tensors: dict[str, np.ndarray],
    *,
    n_head: int,
    n_head_kv: int,
    n_ctx: int = 128,
    rope_base: float = 10000.0,
    eps: float = 1e-5,
    wtype: str = "f32",
    n_rot: int | None = None,
) -> dict[str, np.ndarray]:
    """Write given float weights (llama.cpp names, outermost-first shapes) as a llama GGUF.

    Sizes (n_vocab, n_embd, n_ff, n_layer) are read from the tensors; 2-D tensors are stored as
    ``wtype``, 1-D ones as F32. Returns the values as stored (float32, dequantized).
    """
    if wtype not in WTYPES:
        raise ValueError(f"wtype must be one of {sorted(WTYPES)}, got {wtype!r}")
    qtype, ftype = WTYPES[wtype]
    n_vocab, n_embd = tensors["token_embd.weight"].shape
    n_ff = tensors["blk.0.ffn_gate.weight"].shape[0]
    n_layer = len({k.split(".")[1] for k in tensors if k.startswith("blk.")})
    head_dim = n_embd // n_head
    n_rot = head_dim if n_rot is None else n_rot
    tokens, token_types, merges = _vocab(n_vocab)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny-llama")
    w.add_uint32("general.file_type", ftype)
    w.add_uint32("llama.vocab_size", n_vocab)
    w.add_uint32("llama.context_length", n_ctx)
    w.add_uint32("llama.embedding_length", n_embd)
    w.add_uint32("llama.block_count", n_layer)
    w.add_uint32("llama.feed_forward_length", n_ff)
    w.add_uint32("llama.attention.head_count", n_head)
    w.add_uint32("llama.attention.head_count_kv", n_head_kv)
    w.add_float32("llama.rope.freq_base", float(rope_base))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", float(eps))
    w.add_uint32("llama.rope.dimension_count", n_rot)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    if merges:  # GGUFWriter.add_array skips empty arrays
        w.add_token_merges(merges)

    stored: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(q, qtype).reshape(arr.shape).astype(np.float32)
        else:
            w.add_tensor(name, arr)
            stored[name] = arr

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
