"""SentencePiece-style vocabularies for GGUF: from a ``tokenizer.json`` BPE over SentencePiece pieces
(U+2581 for spaces, ``<0xXX>`` byte fallback tokens; Gemma's, Llama 2's) or from a SentencePiece
``tokenizer.model``.

What llama.cpp's loader reads (src/llama-vocab.cpp) and its converter writes (conversion/gemma.py,
gguf-py/gguf/vocab.py):

* Gemma 4 (``gemma4`` architecture): ``tokenizer.ggml.model = "gemma4"``, the tokens, scores and
  types, the BPE merges (``"left right"``), ``add_space_prefix = false``, ``add_bos_token = true``;
  the chat-parser tokens ``<|channel>``, ``<channel|>``, ``<|tool_call>``, ``<tool_call|>``,
  ``<|tool_response>``, ``<tool_response|>``, ``<|"|>`` are USER_DEFINED (always rendered).
* anything else: ``tokenizer.ggml.model = "llama"`` (SentencePiece BPE: the pair whose concatenation
  has the highest score merges first). From ``tokenizer.model`` the pieces' own scores and types;
  from ``tokenizer.json`` a score per token that reproduces the merge order (the token the merge of
  rank r makes scores -r). ``add_space_prefix`` is the tokenizer's own (a ``Prepend`` normalizer or a
  Metaspace that prepends; ``add_dummy_prefix`` of ``tokenizer.model``), except for Gemma 3, which
  llama.cpp writes with ``add_space_prefix = false``.

Token types: ``<0xXX>`` tokens are BYTE, added tokens CONTROL when special and USER_DEFINED
otherwise, ids the tokenizer does not use UNUSED, the rest NORMAL.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

__all__ = ["is_spm_style", "spm_vocab_from_json", "read_sentencepiece_model", "spm_vocab_from_model",
           "GEMMA4_VISIBLE"]

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
#: Gemma 4's chat-parser tokens, written USER_DEFINED by llama.cpp (conversion/gemma.py, Gemma4Model)
GEMMA4_VISIBLE = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", "<|\"|>")
#: the score of a token no merge makes (single characters, added tokens): last in merge priority
NO_MERGE_SCORE = -1e9


def _types(node) -> set:
    out = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for v in node.values():
            out |= _types(v)
    elif isinstance(node, list):
        for v in node:
            out |= _types(v)
    return out


def _replaces_space(node) -> bool:
    """A Replace normalizer (anywhere in ``node``) writing U+2581 for a space."""
    if isinstance(node, dict):
        if node.get("type") == "Replace" and node.get("content") == SPACE:
            return True
        return any(_replaces_space(v) for v in node.values())
    if isinstance(node, list):
        return any(_replaces_space(v) for v in node)
    return False


def is_spm_style(tj: dict[str, Any]) -> bool:
    """True for a BPE over SentencePiece pieces: no ByteLevel step, and byte fallback, a Metaspace
    step or a normalizer that replaces spaces with U+2581."""
    model = tj.get("model") or {}
    steps = _types(tj.get("pre_tokenizer")) | _types(tj.get("decoder")) | _types(tj.get("normalizer"))
    if "ByteLevel" in steps:
        return False
    return bool(model.get("byte_fallback")) or "Metaspace" in steps or _replaces_space(tj.get("normalizer"))


def _adds_space_prefix(tj: dict[str, Any]) -> bool:
    """Whether the tokenizer puts U+2581 in front of the text: a Prepend normalizer, or a Metaspace
    pre-tokenizer whose prepend_scheme is not "never" (older files: add_prefix_space)."""
    def walk(node) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "Prepend" and node.get("prepend") in (SPACE, " "):
                return True
            if node.get("type") == "Metaspace":
                scheme = node.get("prepend_scheme")
                if scheme is not None:
                    return scheme != "never"
                return bool(node.get("add_prefix_space", True))
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False
    return walk(tj.get("normalizer")) or walk(tj.get("pre_tokenizer"))


def _merge_parts(m: Any, path: str) -> tuple[str, str]:
    if isinstance(m, str):
        pos = m.find(" ", 1)
        if pos < 0:
            raise ValueError(f"{path}: merges entry {m!r} has no separating space")
        return m[:pos], m[pos + 1:]
    if isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(p, str) for p in m):
        return m[0], m[1]
    raise ValueError(f"{path}: unknown merges entry {m!r} in tokenizer.json")


def spm_vocab_from_json(tj: dict[str, Any], path: str, n_vocab: int, arch: str | None,
                        looks_special) -> dict[str, Any]:
    """Tokens, types, scores, merges and flags of a SentencePiece-style BPE ``tokenizer.json``.

    Returns a dict with ``model`` ("gemma4" or "llama"), ``tokens``, ``types``, ``scores``,
    ``merges`` (list of "left right" strings; only for gemma4) and ``add_space_prefix``.
    """
    model = tj["model"]
    id_to_tok: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added: dict[int, dict[str, Any]] = {}
    for a in tj.get("added_tokens") or []:
        added[int(a["id"])] = a
        id_to_tok[int(a["id"])] = a["content"]
    if id_to_tok and max(id_to_tok) >= n_vocab:
        raise ValueError(f"{path}: token id {max(id_to_tok)} does not fit the model's vocabulary of {n_vocab}")

    pairs = [_merge_parts(m, path) for m in model.get("merges") or []]
    rank_of: dict[str, int] = {}
    for r, (a, b) in enumerate(pairs):
        rank_of.setdefault(a + b, r)

    gemma4 = arch == "gemma4"
    tokens: list[str] = []
    types: list[int] = []
    scores: list[float] = []
    for i in range(n_vocab):
        tok = id_to_tok.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            scores.append(NO_MERGE_SCORE)
            continue
        tokens.append(tok)
        if gemma4 and tok in GEMMA4_VISIBLE:
            types.append(USER_DEFINED)
        elif i in added:
            types.append(CONTROL if added[i].get("special") or looks_special(tok) else USER_DEFINED)
        elif _BYTE_TOKEN.fullmatch(tok):
            types.append(BYTE)
        else:
            types.append(NORMAL)
        r = rank_of.get(tok)
        scores.append(float(-r) if r is not None and i not in added else NO_MERGE_SCORE)

    out: dict[str, Any] = {"tokens": tokens, "types": types, "scores": scores}
    if gemma4:
        # joined with a space as llama.cpp's converter writes them; a part holding a space (never in a
        # U+2581 vocabulary) is then read back split at the first space after its first character,
        # by llama.cpp and by pyfast alike
        out.update(model="gemma4", merges=[f"{a} {b}" for a, b in pairs], add_space_prefix=False)
    else:
        out.update(model="llama", merges=None, add_space_prefix=_adds_space_prefix(tj) and arch != "gemma3")
    return out


# ---------------------------------------------------------------------------------------------
# tokenizer.model (a serialized sentencepiece ModelProto), read without the sentencepiece package
# ---------------------------------------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes for
    length-delimited fields, raw bytes for fixed 32/64-bit fields."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = _varint(buf, pos)
        elif wt == 1:
            v, pos = buf[pos:pos + 8], pos + 8
        elif wt == 2:
            n, pos = _varint(buf, pos)
            v, pos = buf[pos:pos + n], pos + n
        elif wt == 5:
            v, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        if pos > len(buf):
            raise ValueError("truncated field")
        yield num, wt, v


def read_sentencepiece_model(path: str) -> dict[str, Any]:
    """The pieces (text, score, type), model type and normalizer flags of a sentencepiece
    ``tokenizer.model`` (field numbers of sentencepiece_model.proto: ModelProto.pieces = 1,
    trainer_spec = 2, normalizer_spec = 3; SentencePiece.piece = 1, score = 2, type = 3;
    TrainerSpec.model_type = 3, byte_fallback = 35, unk / bos / eos / pad_id = 40..43;
    NormalizerSpec.add_dummy_prefix = 3)."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
    pieces: list[tuple[str, float, int]] = []
    # proto2 defaults when a field is absent
    trainer: dict[str, Any] = {"model_type": 1, "byte_fallback": False, "unk_id": 0, "bos_id": 1, "eos_id": 2,
                               "pad_id": -1}
    add_dummy_prefix = True
    try:
        for num, wt, v in _fields(buf):
            if num == 1 and wt == 2:
                text, score, typ = "", 0.0, NORMAL
                for n2, w2, v2 in _fields(v):
                    if n2 == 1 and w2 == 2:
                        text = v2.decode("utf-8")
                    elif n2 == 2 and w2 == 5:
                        score = struct.unpack("<f", v2)[0]
                    elif n2 == 3 and w2 == 0:
                        typ = int(v2)
                pieces.append((text, score, typ))
            elif num == 2 and wt == 2:
                names = {3: "model_type", 35: "byte_fallback", 40: "unk_id", 41: "bos_id", 42: "eos_id",
                         43: "pad_id"}
                for n2, w2, v2 in _fields(v):
                    if n2 in names and w2 == 0:
                        trainer[names[n2]] = v2 - (1 << 64) if v2 >= 1 << 63 else v2
            elif num == 3 and wt == 2:
                for n2, w2, v2 in _fields(v):
                    if n2 == 3 and w2 == 0:
                        add_dummy_prefix = bool(v2)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"{path}: not a sentencepiece model ({e})") from None
    if not pieces:
        raise ValueError(f"{path}: not a sentencepiece model (no pieces)")
    return {"pieces": pieces, "add_dummy_prefix": add_dummy_prefix, **trainer}


def spm_vocab_from_model(path: str, n_vocab: int, arch: str | None, looks_special=None) -> dict[str, Any]:
    """``spm_vocab_from_json``'s result for a sentencepiece ``tokenizer.model`` (BPE models only):
    model "llama" with the pieces' scores and types, ids past the pieces UNUSED; as llama.cpp, the
    tokens of ``added_tokens.json`` (USER_DEFINED) and ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (CONTROL when special, else USER_DEFINED) beside it replace those ids."""
    sp = read_sentencepiece_model(path)
    if sp["model_type"] != 2:
        kind = {1: "Unigram", 3: "word", 4: "char"}.get(sp["model_type"], str(sp["model_type"]))
        raise ValueError(f"{path}: a {kind} sentencepiece model; only BPE sentencepiece models are supported")
    pieces = sp["pieces"]
    if len(pieces) > n_vocab:
        raise ValueError(f"{path}: {len(pieces)} pieces do not fit the model's vocabulary of {n_vocab}")
    tokens = [p[0] for p in pieces] + [f"[PAD{i}]" for i in range(len(pieces), n_vocab)]
    scores = [float(p[1]) for p in pieces] + [-10000.0] * (n_vocab - len(pieces))
    types = [p[2] if 1 <= p[2] <= 6 else NORMAL for p in pieces] + [UNUSED] * (n_vocab - len(pieces))
    _apply_added_tokens(os.path.dirname(path), tokens, types, scores, looks_special)
    special = {k: sp[k] for k in ("unk_id", "bos_id", "eos_id", "pad_id") if 0 <= sp.get(k, -1) < len(pieces)}
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "merges": None,
            "add_space_prefix": sp["add_dummy_prefix"] and arch != "gemma3", "special": special}


def _apply_added_tokens(hf_dir: str, tokens: list[str], types: list[int], scores: list[float], looks_special) -> None:
    def load(name):
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                v = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable JSON: {e}") from None
        return v if isinstance(v, dict) else {}

    n = len(tokens)
    for text, tid in load("added_tokens.json").items():
        if isinstance(tid, int) and 0 <= tid < n and isinstance(text, str):
            tokens[tid], types[tid], scores[tid] = text, USER_DEFINED, -1000.0
    for tid, data in (load("tokenizer_config.json").get("added_tokens_decoder") or {}).items():
        try:
            tid = int(tid)
        except ValueError:
            continue
        text = data.get("content") if isinstance(data, dict) else None
        if not (0 <= tid < n and isinstance(text, str)):
            continue
        if data.get("special") or (looks_special is not None and looks_special(text)):
            types[tid] = CONTROL
        else:
            text = text.replace(SPACE, " ")
            types[tid] = USER_DEFINED
        tokens[tid], scores[tid] = text, -1000.0
