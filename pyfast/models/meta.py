"""Typed, range-checked reads of GGUF metadata, and checks of metadata against the tensors.

A GGUF is untrusted input: one edited number (``block_count`` = 2**32 - 1, ``head_count`` = 0)
must not make the loader allocate without bound or divide by zero. Architectures read their
hyper-parameters through :class:`Meta`, which checks each key's type and range and raises a
``ValueError`` naming the file, the key, the value and what was expected. :func:`check_blocks`
and :func:`check_vocab` compare the metadata with the tensors the file holds before the
expected-tensor list (one entry per layer) is built or anything is allocated.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

_MISSING = object()
_DEFAULT = object()

# Generous upper bounds: far above any released model, far below what would exhaust memory when
# a list or a cache is sized by them.
MAX_LAYERS = 4096
MAX_EMBD = 1 << 20
MAX_HEADS = 1 << 14
MAX_HEAD_DIM = 1 << 14
MAX_FF = 1 << 24
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 14
MAX_CTX = 1 << 31

_BLK = re.compile(r"blk\.(\d+)\.")


class Meta:
    """Metadata reads for one file: ``m.int("llama.block_count", lo=1, hi=MAX_LAYERS)``."""

    def __init__(self, md: Mapping[str, Any], path: str = "", types: Mapping[str, str] | None = None):
        self.md = md
        self.path = path
        self.types = types or {}

    def fail(self, key: str, value: Any, expected: str) -> ValueError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        where = f"{self.path}: " if self.path else ""
        typ = self.types.get(key)
        of_type = f" ({typ})" if typ else ""
        return ValueError(f"{where}GGUF metadata '{key}' = {shown}{of_type}: expected {expected}")

    def _get(self, key: str, default: Any, expected: str) -> Any:
        """The value, or _DEFAULT when the key is absent and a default was given."""
        v = self.md.get(key, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                where = f"{self.path}: " if self.path else ""
                raise ValueError(f"{where}GGUF metadata lacks '{key}' ({expected})")
            return _DEFAULT
        return v

    def has(self, key: str) -> bool:
        return key in self.md

    def int(self, key: str, default: Any = _MISSING, lo: int | None = None, hi: int | None = None) -> int:
        """An integer key (not a bool, float or string) in [lo, hi]."""
        expected = _range_text("an integer", lo, hi)
        v = self._get(key, default, expected)
        if v is _DEFAULT:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, v, expected)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.fail(key, v, expected)
        return v

    def float(self, key: str, default: Any = _MISSING, lo: float | None = None, hi: float | None = None,
              positive: bool = False) -> float:
        """A finite number (integer keys accepted) in [lo, hi]; positive: > 0."""
        expected = _range_text("a finite number", lo, hi) if not positive else "a finite number > 0"
        v = self._get(key, default, expected)
        if v is _DEFAULT:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, v, expected)
        f = float(v)
        if not math.isfinite(f) or (positive and f <= 0) or (lo is not None and f < lo) \
                or (hi is not None and f > hi):
            raise self.fail(key, v, expected)
        return f

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self._get(key, default, "a bool")
        if v is _DEFAULT:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, v, "a bool")
        return v

    def str(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] | None = None) -> str:
        expected = "a string" if not choices else "one of " + ", ".join(repr(c) for c in choices)
        v = self._get(key, default, expected)
        if v is _DEFAULT:
            return default
        if not isinstance(v, str) or (choices and v not in choices):
            raise self.fail(key, v, expected)
        return v

    def int_list(self, key: str, default: Any = _MISSING, lo: int | None = None, hi: int | None = None,
                 max_len: int = MAX_LAYERS) -> list[int]:
        expected = f"an array of at most {max_len} " + _range_text("integers", lo, hi)
        v = self._get(key, default, expected)
        if v is _DEFAULT:
            return default
        if not isinstance(v, list) or len(v) > max_len:
            raise self.fail(key, v, expected)
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int) or (lo is not None and x < lo) \
                    or (hi is not None and x > hi):
                raise self.fail(key, v, expected)
        return v

    def bool_list(self, key: str, default: Any = _MISSING, max_len: int = MAX_LAYERS) -> list[bool]:
        """An array of bools (0 / 1 integers accepted, as some converters write them)."""
        expected = f"an array of at most {max_len} bools"
        v = self._get(key, default, expected)
        if v is _DEFAULT:
            return default
        if not isinstance(v, list) or len(v) > max_len:
            raise self.fail(key, v, expected)
        for x in v:
            if not (isinstance(x, bool) or (isinstance(x, int) and x in (0, 1))):
                raise self.fail(key, v, expected)
        return [bool(x) for x in v]


def _range_text(what: str, lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"{what} in [{lo}, {hi}]"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


def file_blocks(weights) -> int:
    """How many layers (``blk.N.*``) the file's tensors describe: the largest N plus one."""
    top = -1
    for name in weights.info:
        m = _BLK.match(name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def check_blocks(path: str, key: str, block_count: int, weights, lo: int | None = None) -> None:
    """``block_count`` must agree with the layers present: exactly, or (``lo`` given, for files
    whose last blocks are optional MTP layers) between ``lo`` and the layers present."""
    have = file_blocks(weights)
    where = f"{path}: " if path else ""
    if lo is None:
        if block_count != have:
            raise ValueError(f"{where}GGUF metadata '{key}' = {block_count}: expected {have}, the number of "
                             f"layers (blk.N) whose tensors the file holds")
        return
    if block_count < have or have < lo:
        raise ValueError(f"{where}GGUF metadata '{key}' = {block_count}: the file holds tensors for {have} "
                         f"layers (blk.N), expected between {lo} and {block_count}")


def embedding_rows(path: str, weights, n_embd: int, name: str = "token_embd.weight") -> int:
    """The vocabulary size from the token embedding, checked to be [n_vocab, n_embd]."""
    where = f"{path}: " if path else ""
    if name not in weights:
        raise ValueError(f"{where}missing tensor '{name}' (expected shape [n_vocab, {n_embd}])")
    shape = tuple(weights.shape(name))
    if len(shape) != 2 or shape[1] != n_embd or not 1 <= shape[0] <= MAX_VOCAB:
        raise ValueError(f"{where}tensor '{name}' has shape {list(shape)}, expected [n_vocab, {n_embd}] "
                         f"with 1 <= n_vocab <= {MAX_VOCAB} (n_embd from the metadata)")
    return int(shape[0])


def check_vocab(path: str, md: Mapping[str, Any], n_vocab: int, arch: str) -> None:
    """The token list, token types, scores and ``<arch>.vocab_size`` must all agree with the
    embedding's rows (llama.cpp requires the same)."""
    where = f"{path}: " if path else ""
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens, list):
            raise ValueError(f"{where}GGUF metadata 'tokenizer.ggml.tokens' is a {type(tokens).__name__}: "
                             "expected an array of strings")
        if len(tokens) != n_vocab:
            raise ValueError(f"{where}GGUF metadata 'tokenizer.ggml.tokens' has {len(tokens)} entries: expected "
                             f"{n_vocab}, the rows of 'token_embd.weight'")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = md.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n_vocab):
            got = f"{len(v)} entries" if isinstance(v, list) else f"a {type(v).__name__}"
            raise ValueError(f"{where}GGUF metadata '{key}' has {got}: expected an array of {n_vocab} "
                             "(one per token)")
    vs = md.get(f"{arch}.vocab_size")
    if vs is not None and (isinstance(vs, bool) or not isinstance(vs, int) or vs != n_vocab):
        raise ValueError(f"{where}GGUF metadata '{arch}.vocab_size' = {vs!r}: expected {n_vocab}, the rows of "
                         "'token_embd.weight'")
