"""Tokenizer built from a GGUF vocabulary.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``). This module turns that
metadata into a fast tokenizer (HuggingFace ``tokenizers``, Rust) whose token ids agree with
llama.cpp's on the same file:

* ``gpt2`` vocabularies: byte-level BPE with the pre-tokenizer split regexes selected by
  ``tokenizer.ggml.pre`` (applied one after another, each splitting the pieces of the previous
  one, keeping matched and unmatched text as separate pieces).
* ``llama`` vocabularies (SentencePiece BPE): merges derived from the token scores (the pair
  whose concatenation has the highest score merges first), ``<0xXX>`` byte fallback, spaces
  escaped to U+2581 and a space prefixed to each text fragment when ``add_space_prefix``.
* ``gemma4`` vocabularies (SentencePiece-style BPE, as llama.cpp writes Gemma 4's): the file's
  merges in their order over raw UTF-8 (no byte-level alphabet), spaces escaped to U+2581, no space
  prefix, text split into runs of newlines and runs of other characters (a run of newlines that is
  itself a token stays whole), ``<0xXX>`` byte fallback, BOS always added.
* Control and user-defined tokens are matched in raw text before the model sees it. Control
  (and unknown) tokens only when ``special=True``; user-defined tokens always, as llama.cpp and
  HF do.

Decoding does not go through ``tokenizers``: each token's raw bytes are precomputed once
(``token_piece``) so that decoding and streaming are plain byte concatenation, with no
per-token surprises from decoder pipelines.
"""
from __future__ import annotations

import codecs
import operator
import threading
from itertools import compress, repeat
import warnings
from enum import IntEnum
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Tokenizer", "StreamDecoder", "TokenType", "PRE_TOKENIZER_REGEXES"]


class TokenType(IntEnum):
    """GGUF ``tokenizer.ggml.token_type`` values."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ---------------------------------------------------------------------------------------------
# pre-tokenizer regexes (Oniguruma syntax, as used by `tokenizers`)
# ---------------------------------------------------------------------------------------------

# GPT-2's word split: contractions, letters, numbers, other symbols, each optionally led by one
# space; trailing whitespace runs stay separate from the following word.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS_CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# Llama 3 / tiktoken cl100k style: numbers in groups of up to three digits.
_LLAMA3 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: like Llama 3 but every digit is its own piece.
_QWEN2 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS_CI + "?"
    r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS_CI + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+"
    r"|[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: canonical pre-tokenizer name -> list of split regexes, applied in order.
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    # llama.cpp's default for BPE vocabularies without a known pre-tokenizer: punctuation runs
    # first, then the GPT-2 split, then digit runs, then groups of three ASCII digits.
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    # starcoder family (SmolLM, refact, command-r, ...): every digit alone, then GPT-2.
    "starcoder": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "gpt4o": [_GPT4O],
    "tekken": [_TEKKEN],
    "deepseek-coder": [
        r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "deepseek-v3": [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
}

# `tokenizer.ggml.pre` value -> (canonical regex set, ignore_merges, default add_bos)
_PRE_ALIASES: dict[str, tuple[str, bool, bool]] = {}


def _alias(names: Iterable[str], canon: str, ignore_merges: bool = False, add_bos: bool = False):
    for n in names:
        _PRE_ALIASES[n] = (canon, ignore_merges, add_bos)


_alias(["default"], "default")
_alias(["gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
        "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion", "granite-docling"], "gpt2")
_alias(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
        "mellum2"], "starcoder")
_alias(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
        "lfm2"], "llama3", ignore_merges=True, add_bos=True)
_alias(["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], "llama3")
_alias(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo"], "qwen2")
_alias(["qwen35"], "qwen35")
_alias(["falcon"], "falcon")
_alias(["gpt-4o", "llama4", "minimax-m2"], "gpt4o")
_alias(["tekken"], "tekken", ignore_merges=True, add_bos=True)
_alias(["deepseek-coder"], "deepseek-coder")
_alias(["deepseek-v3", "hunyuan-dense"], "deepseek-v3")

# Token texts that end generation (llama.cpp's list; matched by exact text).
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
# Fallback EOT detection by text, in priority order, when the file names no eot id.
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
# Fill-in-the-middle pad / repo / file-separator tokens also end generation in llama.cpp.
_FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# gpt-oss: these structural tokens are always rendered, like user-defined ones.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_SPM_SPACE = "\u2581"

# plain ints for hot loops (IntEnum comparisons are slow)
_T_NORMAL, _T_UNKNOWN, _T_CONTROL, _T_USER, _T_UNUSED, _T_BYTE = 1, 2, 3, 4, 5, 6


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(
        range(0xAE, 0xFF + 1))
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = _byte_level_alphabet()
# str.translate table mapping each byte-level character back to chr(byte), so that
# `text.translate(_CHAR_TO_LATIN1).encode("latin-1")` recovers a token's raw bytes.
_CHAR_TO_LATIN1 = {ord(c): b for b, c in _BYTE_TO_CHAR.items()}


def _as_list(md: Mapping, key: str, required: bool = True) -> list | None:
    v = md.get(key)
    if v is None:
        if required:
            raise ValueError(f"GGUF metadata is missing {key!r}")
        return None
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise ValueError(f"GGUF metadata {key!r} must be an array, got {type(v).__name__}")
    return list(v)


def _check_utf8(tokens: list) -> None:
    """Token texts must be valid UTF-8 (the reader keeps invalid bytes as lone surrogates)."""
    try:
        "".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        for i, t in enumerate(tokens):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                try:
                    raw = t.encode("utf-8", "surrogateescape")  # the file's bytes
                except UnicodeEncodeError:
                    raw = t
                raise ValueError(f"GGUF metadata 'tokenizer.ggml.tokens'[{i}] = {raw!r}: expected valid UTF-8 "
                                 f"text (invalid byte at offset {e.start})") from None
    except TypeError:
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise ValueError(f"GGUF metadata 'tokenizer.ggml.tokens'[{i}] = {t!r}: expected a string") from None


def _as_str(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


def _opt_bool(md: Mapping, key: str) -> bool | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ValueError(f"GGUF metadata {key!r} = {v!r}: expected a bool")


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    Build with :meth:`from_gguf_metadata`. Thread-safe: encoding and decoding keep no mutable
    state (a :class:`StreamDecoder` holds the state of one stream).
    """

    def __init__(self) -> None:  # use from_gguf_metadata
        raise TypeError("use Tokenizer.from_gguf_metadata(metadata)")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build a tokenizer from GGUF metadata (key -> value, arrays as sequences).

        Raises ``ValueError`` naming the field when the vocabulary is missing, inconsistent
        or of an unsupported kind.
        """
        self = cls.__new__(cls)
        self._init(md)
        return self

    def _init(self, md: Mapping[str, Any]) -> None:
        if not isinstance(md, Mapping):
            raise ValueError(f"GGUF metadata must be a mapping, got {type(md).__name__}")
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF metadata is missing 'tokenizer.ggml.model'")
        model = _as_str(model)
        if model == "gpt2":
            self.kind = "bpe"
        elif model == "llama":
            self.kind = "spm"
        elif model == "gemma4":
            self.kind = "spm-bpe"
        else:
            raise ValueError(
                f"unsupported tokenizer model {model!r} in 'tokenizer.ggml.model' "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece, 'gemma4' SentencePiece-style BPE)")
        self.model = model

        tokens = _as_list(md, "tokenizer.ggml.tokens")
        if set(map(type, tokens)) - {str}:  # (the reader gives str; a test's mapping may not)
            tokens = [_as_str(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise ValueError("GGUF metadata 'tokenizer.ggml.tokens' is empty")
        _check_utf8(tokens)
        for i, t in enumerate(tokens):
            if not t:  # as llama.cpp: an empty token can never match; give it a unique name
                tokens[i] = f"[EMPTY_{i}]"
        vocab = dict(zip(tokens, range(n)))
        if len(vocab) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise ValueError(
                        f"duplicate token in 'tokenizer.ggml.tokens': {t!r} has ids "
                        f"{seen[t]} and {i}")
                seen[t] = i

        types = _as_list(md, "tokenizer.ggml.token_type", required=False)
        if types is None:
            types = [_T_NORMAL] * n
        else:
            if len(types) < n:
                raise ValueError(
                    f"'tokenizer.ggml.token_type' has {len(types)} entries for {n} tokens")
            types = types[:n]
            if not all(type(t) is int for t in types):
                bad = next(i for i, t in enumerate(types) if type(t) is not int)
                raise ValueError(f"GGUF metadata 'tokenizer.ggml.token_type'[{bad}] = {types[bad]!r}: expected an "
                                 "integer token type")

        scores = _as_list(md, "tokenizer.ggml.scores", required=False)
        if scores is not None:
            if len(scores) < n:
                raise ValueError(
                    f"'tokenizer.ggml.scores' has {len(scores)} entries for {n} tokens")
            scores = scores[:n]
            if not all(type(x) is float or type(x) is int for x in scores):
                bad = next(i for i, x in enumerate(scores) if not (type(x) is float or type(x) is int))
                raise ValueError(f"GGUF metadata 'tokenizer.ggml.scores'[{bad}] = {scores[bad]!r}: expected a number")
            scores = list(map(float, scores))

        self._tokens = tokens
        self._vocab = vocab
        self._types = types

        # ---- special token ids (defaults follow llama.cpp for SPM; none for BPE)
        def tid(key: str, default: int | None = None) -> int | None:
            full = f"tokenizer.ggml.{key}"
            v = md.get(full)
            if v is None:
                return default if (default is not None and default < n) else None
            try:
                v = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"GGUF metadata {full!r} must be an integer, got {v!r}") from None
            if not 0 <= v < n:
                raise ValueError(
                    f"GGUF metadata {full!r} = {v} is outside the vocabulary (n_vocab={n})")
            return v

        spm = self.kind == "spm"
        self._bos = tid("bos_token_id", 1 if spm else None)
        self._eos = tid("eos_token_id", 2 if spm else None)
        self._unk = tid("unknown_token_id", 0 if spm else None)
        self._pad = tid("padding_token_id")
        self._eot = tid("eot_token_id")
        self._eom = tid("eom_token_id")
        fim = {k: tid(f"{k}_token_id") for k in _FIM_TEXTS}

        # ---- pre-tokenizer (BPE)
        pre_name = md.get("tokenizer.ggml.pre")
        pre_name = _as_str(pre_name) if pre_name is not None else None
        ignore_merges, add_bos_default = False, spm
        self.pre = None
        if self.kind == "spm-bpe":
            # as llama.cpp: the pre-tokenizer is Gemma 4's whatever the file says
            pre_name = "gemma4"
        elif not spm:
            if pre_name is None:
                warnings.warn("GGUF has no 'tokenizer.ggml.pre'; using the 'default' BPE "
                              "pre-tokenizer (token ids may differ from the model's training)",
                              stacklevel=3)
                canon = "default"
            elif pre_name in _PRE_ALIASES:
                canon, ignore_merges, add_bos_default = _PRE_ALIASES[pre_name]
            else:
                warnings.warn(f"unknown pre-tokenizer type {pre_name!r} "
                              "('tokenizer.ggml.pre'); falling back to 'default'", stacklevel=3)
                canon = "default"
            self.pre = canon
        self.pre_name = pre_name

        add_bos = _opt_bool(md, "tokenizer.ggml.add_bos_token")
        add_eos = _opt_bool(md, "tokenizer.ggml.add_eos_token")
        self.add_bos = add_bos_default if add_bos is None else add_bos
        if self.kind == "spm-bpe" and not self.add_bos:
            self.add_bos = True  # llama.cpp overrides a false add_bos_token for Gemma 4
        self.add_eos = False if add_eos is None else add_eos
        if self.add_bos and self._bos is None:
            raise ValueError("'tokenizer.ggml.add_bos_token' is true but the GGUF names no "
                             "'tokenizer.ggml.bos_token_id'")
        if self.add_eos and self._eos is None:
            raise ValueError("'tokenizer.ggml.add_eos_token' is true but the GGUF names no "
                             "'tokenizer.ggml.eos_token_id'")
        asp = _opt_bool(md, "tokenizer.ggml.add_space_prefix")
        # llama.cpp only applies the space prefix to SPM vocabularies when encoding, but honours
        # the flag when decoding any vocabulary.
        self.add_space_prefix = spm if asp is None else asp
        if self.kind == "spm-bpe":
            self.add_space_prefix = False  # never for BPE vocabularies (llama.cpp)

        # ---- end-of-generation set and control-looking tokens (llama.cpp's text heuristics)
        forced_control: set[int] = set()

        def by_text(cands: Sequence[str]) -> int | None:
            for c in cands:
                i = vocab.get(c)
                if i is not None:
                    return i
            return None

        if self._eot is None:
            self._eot = by_text(_EOT_TEXTS)
            if self._eot is not None:
                forced_control.add(self._eot)
        if self._eom is None:
            self._eom = by_text(("<|eom_id|>",))
            if self._eom is not None:
                forced_control.add(self._eom)
        for k, cands in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = by_text(cands)
                if fim[k] is not None:
                    forced_control.add(fim[k])
        eog = {i for i in fim.values() if i is not None}
        for t in _EOG_TEXTS:
            i = vocab.get(t)
            if i is not None:
                eog.add(i)
                forced_control.add(i)
        for i in (self._eos, self._eot, self._eom):
            if i is not None:
                eog.add(i)
        # gpt-oss: '<|end|>' separates messages there; it ends generation only elsewhere.
        texts = {tokens[i] for i in eog}
        end_id = vocab.get("<|end|>")
        if end_id in eog and (({"<|return|>", "<|call|>"} <= texts)
                              or ({"<|calls|>", "<|flush|>"} <= texts)):
            eog.discard(end_id)
            forced_control.discard(end_id)
            types[end_id] = _T_USER
        s_id = vocab.get("</s>")
        if s_id in eog and "<|tool_response>" in texts:
            eog.discard(s_id)
            forced_control.discard(s_id)
            types[s_id] = _T_NORMAL
        for i in forced_control:  # llama.cpp adds the control attribute to these
            types[i] = _T_CONTROL
        for t in _ALWAYS_RENDERED:
            i = vocab.get(t)
            if i is not None:
                types[i] = _T_USER
        self._eog = frozenset(eog)

        # ---- raw bytes of every token (what llama.cpp's token_to_piece gives with special=true)
        # ids whose type is not NORMAL (a few dozen in most vocabularies), found without a Python
        # step per token
        self._non_normal = list(compress(range(n), map(_T_NORMAL.__ne__, types)))
        self._pieces = self._build_pieces()
        self._special_ids = frozenset(
            i for i in self._non_normal if types[i] == _T_CONTROL or types[i] == _T_UNKNOWN)

        # ---- the fast encoder
        if spm:
            self._hf = self._build_spm(scores)
        else:
            merges = _as_list(md, "tokenizer.ggml.merges", required=False)
            if merges is None:
                raise ValueError("GGUF metadata is missing 'tokenizer.ggml.merges' "
                                 f"(required for a {model!r} BPE vocabulary)")
            if self.kind == "spm-bpe":
                self._hf = self._build_spm_bpe(merges)
            else:
                self._hf = self._build_bpe(merges, ignore_merges)
        self._hf_plain = None  # built on first encode(special=False)
        self._control_re = None  # control-token texts (encode_rendered)
        self._lock = threading.Lock()

    def _build_pieces(self) -> list[bytes]:
        spm = self.kind in ("spm", "spm-bpe")  # U+2581 stands for a space
        pieces: list[bytes] = []
        append = pieces.append
        for text, t in zip(self._tokens, self._types):
            if t == _T_NORMAL:
                if spm:
                    append(text.replace(_SPM_SPACE, " ").encode("utf-8"))
                else:
                    s = text.translate(_CHAR_TO_LATIN1)
                    try:
                        append(s.encode("latin-1"))
                    except UnicodeEncodeError:  # not a byte-level string: keep its own UTF-8
                        append(b"".join(
                            bytes([ord(c)]) if ord(c) < 256 else c.encode("utf-8") for c in s))
            elif t == _T_CONTROL or t == _T_USER or t == _T_UNKNOWN:
                append(text.encode("utf-8"))
            elif t == _T_BYTE:
                b = _parse_byte_token(text)
                append(bytes([b]) if b is not None else text.encode("utf-8"))
            else:  # unused / undefined tokens render as nothing (as in llama.cpp)
                append(b"")
        return pieces

    def _added_tokens(self):
        from tokenizers import AddedToken

        special, user = [], []
        for i in self._non_normal:
            text, t = self._tokens[i], self._types[i]
            if t == _T_CONTROL or t == _T_UNKNOWN:
                special.append(AddedToken(text, single_word=False, lstrip=False, rstrip=False,
                                          normalized=False, special=True))
            elif t == _T_USER:
                user.append(AddedToken(text, single_word=False, lstrip=False, rstrip=False,
                                       normalized=False, special=False))
        return special, user

    def _finish_hf(self, tok, extra_added=(), *, plain: bool = False):
        """Adds the vocabulary's user-defined and control tokens to a `tokenizers` tokenizer whose
        model, normalizer and pre-tokenizer are set (after ``extra_added``, a builder's own added
        tokens); the parts are kept for the special=False twin (``_plain``)."""
        if not plain:
            self._hf_parts = (tok.model, tok.normalizer, tok.pre_tokenizer, list(extra_added))
        if extra_added:
            tok.add_tokens(list(extra_added))
        special, user = self._added_tokens()
        if user:
            tok.add_tokens(user)
        if special:
            tok.add_special_tokens(special)
        if tok.get_vocab_size(with_added_tokens=True) != self.n_vocab:
            raise ValueError("special tokens in 'tokenizer.ggml.tokens' could not be mapped onto "
                             "the vocabulary (duplicate or unmatchable token text)")
        return tok

    def _bpe_model(self, merges: list, what: str, **kw):
        """tokenizers' BPE model over the vocabulary and the file's merges. When every merge is a
        str that does not start with a space, the merges are split in bulk (SmolLM2's 49k: 29-44
        ms against the checked split's 87-119) and tokenizers checks them; if it rejects any, the
        checked split drops the bad ones with a warning, as llama.cpp does."""
        from tokenizers import models

        if not (set(map(type, merges)) - {str}):
            joined = "\n".join(merges)
            if not (joined.startswith(" ") or "\n " in joined):
                try:  # no space at 0, so the first space is the separator, as in _merge_pairs
                    return models.BPE(self._vocab, list(map(tuple, map(str.split, merges, repeat(" "), repeat(1)))),
                                      **kw)
                except Exception:
                    pass
        try:
            return models.BPE(self._vocab, self._merge_pairs(merges), **kw)
        except Exception as e:  # pragma: no cover - tokenizers rejected the vocabulary
            raise ValueError(f"invalid {what}: {e}") from e

    def _merge_pairs(self, merges: list) -> list[tuple[str, str]]:
        vocab = self._vocab
        pairs = []
        bad = 0
        for m in merges:
            m = _as_str(m)
            # as llama.cpp: the separator is the first space after the first character
            pos = m.find(" ", 1)
            if pos < 0:
                bad += 1
                continue
            a, b = m[:pos], m[pos + 1:]
            if a in vocab and b in vocab and (a + b) in vocab:
                pairs.append((a, b))
            else:
                bad += 1
        if bad:
            warnings.warn(f"ignored {bad} malformed or out-of-vocabulary entries of "
                          "'tokenizer.ggml.merges'", stacklevel=6)
        return pairs

    def _build_bpe(self, merges: list, ignore_merges: bool):
        from tokenizers import Regex, Tokenizer as HFTokenizer, pre_tokenizers

        tok = HFTokenizer(self._bpe_model(merges, "BPE vocabulary/merges", ignore_merges=ignore_merges))
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated")
                 for r in PRE_TOKENIZER_REGEXES[self.pre]]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return self._finish_hf(tok)

    def _build_spm(self, scores: list[float] | None):
        """SentencePiece BPE as a `tokenizers` BPE: every way of writing a token as the
        concatenation of two tokens becomes a merge, ranked by the merged token's score (higher
        first), which is the order llama.cpp's SPM tokenizer merges in."""
        from tokenizers import Tokenizer as HFTokenizer, models, normalizers

        vocab = self._vocab
        tokens, types = self._tokens, self._types
        if scores is None:
            scores = [0.0] * len(tokens)
        # tokens in merge priority order: higher score first; the sort is stable, so ties
        # keep ascending ids
        order = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)
        skip = (_T_BYTE, _T_UNUSED, 0)
        pairs = [(t[:k], t[k:])
                 for i in order if types[i] not in skip
                 for t in (tokens[i],)
                 for k in range(1, len(t))
                 if t[:k] in vocab and t[k:] in vocab]
        unk = tokens[self._unk] if self._unk is not None else None
        try:
            model = models.BPE(vocab, pairs, unk_token=unk, byte_fallback=True, fuse_unk=False)
        except Exception as e:  # pragma: no cover
            raise ValueError(f"invalid SentencePiece vocabulary: {e}") from e
        tok = HFTokenizer(model)
        steps = []
        if self.add_space_prefix:
            # applied to each raw-text fragment between special tokens, as llama.cpp does
            steps.append(normalizers.Prepend(" "))
        steps.append(normalizers.Replace(" ", _SPM_SPACE))
        tok.normalizer = normalizers.Sequence(steps)
        return self._finish_hf(tok)

    def _build_spm_bpe(self, merges: list):
        """Gemma 4's SentencePiece-style BPE (llama.cpp's ``gemma4`` tokenizer model): spaces become
        U+2581, the text is split into runs of newlines and runs of anything else, and each run is
        merged over its UTF-8 characters in the order of the file's merges; a character no token
        covers becomes its ``<0xXX>`` byte tokens. A run of newlines that is a token is taken whole
        (llama.cpp's rule; matched here as an added token, longest first)."""
        from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, normalizers, pre_tokenizers

        vocab = self._vocab
        unk = self._tokens[self._unk] if self._unk is not None else None
        tok = HFTokenizer(self._bpe_model(merges, "SentencePiece-style BPE vocabulary", unk_token=unk,
                                          byte_fallback=True, fuse_unk=unk is not None))
        tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
        newline_runs = [t for t, i in vocab.items()
                        if t and t.strip("\n") == "" and self._types[i] == _T_NORMAL and len(t) > 1]
        return self._finish_hf(tok, [AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False,
                                                special=False) for t in sorted(newline_runs, key=len, reverse=True)])

    # ------------------------------------------------------------------ properties

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eot_id(self) -> int | None:
        """End-of-turn token (from the file, else found by its text as llama.cpp does)."""
        return self._eot

    @property
    def eom_id(self) -> int | None:
        return self._eom

    @property
    def unk_id(self) -> int | None:
        return self._unk

    @property
    def pad_id(self) -> int | None:
        return self._pad

    @property
    def eog_ids(self) -> frozenset[int]:
        """All tokens that end generation."""
        return self._eog

    def is_eog(self, token_id: int) -> bool:
        """True when generating ``token_id`` ends generation (eos, eot, eom, ``<|im_end|>``...)."""
        return token_id in self._eog

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (those ``decode(skip_special=True)`` drops)."""
        return token_id in self._special_ids

    def token_type(self, token_id: int) -> TokenType:
        self._check_id(token_id)
        try:
            return TokenType(self._types[token_id])
        except ValueError:  # a type value GGUF does not define
            return TokenType.UNDEFINED

    def id_to_piece(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. ``'Ġhello'``, ``'▁hello'``)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        """Inverse of :meth:`id_to_piece`; ``None`` when the text is not a token."""
        return self._vocab.get(piece)

    def token_piece(self, token_id: int) -> bytes:
        """Raw bytes the token stands for (special tokens give their text). May be part of a
        UTF-8 character; use :class:`StreamDecoder` to turn a stream of ids into text."""
        self._check_id(token_id)
        return self._pieces[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(
                f"token id {token_id} is outside the vocabulary (n_vocab={self.n_vocab})")

    # ------------------------------------------------------------------ encode / decode

    def _plain(self):
        tok = self._hf_plain
        if tok is None:
            with self._lock:
                tok = self._hf_plain
                if tok is None:
                    # the same (shared, immutable) model, normalizer and pre-tokenizer objects, and
                    # the same added tokens: no second vocabulary to build or parse
                    from tokenizers import Tokenizer as HFTokenizer

                    model, normalizer, pre, extra = self._hf_parts
                    tok = HFTokenizer(model)
                    if normalizer is not None:
                        tok.normalizer = normalizer
                    if pre is not None:
                        tok.pre_tokenizer = pre
                    tok = self._finish_hf(tok, extra, plain=True)
                    tok.encode_special_tokens = True  # control tokens are plain text
                    self._hf_plain = tok
        return tok

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True,
               *, add_eos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        add_bos / add_eos: prepend BOS / append EOS; ``None`` follows the file
        (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``).
        special: parse control tokens written in the text (``<|im_start|>``) as those tokens;
        when False they are tokenized as plain text. User-defined tokens are always parsed.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        hf = self._hf if special else self._plain()
        try:
            ids = hf.encode(text, add_special_tokens=False).ids if text else []
        except TypeError:
            _check_text(text)
            raise
        return self._wrap(ids, add_bos, add_eos)

    def control_texts(self) -> list[str]:
        """Texts of the tokens ``encode(special=True)`` parses and ``special=False`` does not
        (control and unknown tokens), longest first."""
        texts = {self._tokens[i] for i in self._special_ids}
        return sorted((t for t in texts if t), key=len, reverse=True)

    def encode_rendered(self, text: str, add_bos: bool | None = None, marker: str = "\ufdd0") -> list[int]:
        """Token ids of a chat template's output in which message content was protected by
        ``ChatTemplate.render(protect=...)``: the control tokens the template wrote are parsed,
        special-token text inside content (broken up by ``marker``) is tokenized as plain text,
        and the markers are dropped. Without markers this is ``encode(text, special=True)``."""
        if marker not in text:
            return self.encode(text, add_bos=add_bos, special=True)
        import re

        pat = self._control_re
        if pat is None:
            texts = self.control_texts()
            pat = self._control_re = re.compile("|".join(re.escape(t) for t in texts)) if texts else re.compile("(?!)")
        ids: list[int] = []
        pos = 0
        for m in pat.finditer(text):
            if m.start() > pos:
                ids += self.encode(text[pos:m.start()].replace(marker, ""), add_bos=False, special=False)
            ids.append(self._control_id(m.group(0)))
            pos = m.end()
        if pos < len(text):
            ids += self.encode(text[pos:].replace(marker, ""), add_bos=False, special=False)
        return self._wrap(ids, add_bos, None)

    def _control_id(self, text: str) -> int:
        tid = self.piece_to_id(text)
        if tid is None or tid not in self._special_ids:  # a duplicate text: the first control token
            tid = min(i for i in self._special_ids if self._tokens[i] == text)
        return tid

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None,
                     special: bool = True, *, add_eos: bool | None = None) -> list[list[int]]:
        """:meth:`encode` for several texts at once (parallel in Rust)."""
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch() expects str items, got {type(t).__name__}")
        hf = self._hf if special else self._plain()
        try:
            encs = hf.encode_batch(texts, add_special_tokens=False)
        except TypeError:
            for t in texts:
                _check_text(t)
            raise
        return [self._wrap(e.ids if t else [], add_bos, add_eos) for e, t in zip(encs, texts)]

    def _wrap(self, ids: list[int], add_bos: bool | None, add_eos: bool | None) -> list[int]:
        if self.add_bos if add_bos is None else add_bos:
            if self._bos is None:
                raise ValueError("add_bos requested but the vocabulary has no BOS token")
            ids.insert(0, self._bos)
        if self.add_eos if add_eos is None else add_eos:
            if self._eos is None:
                raise ValueError("add_eos requested but the vocabulary has no EOS token")
            ids.append(self._eos)
        return ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated raw bytes of ``ids`` (no space stripping)."""
        pieces = self._pieces
        n = len(pieces)
        skip = self._special_ids if skip_special else ()
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (n_vocab={n})")
            if i not in skip:
                out.append(pieces[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False, *,
               strip_space_prefix: bool = True) -> str:
        """Text of ``ids``. Invalid UTF-8 (e.g. a character cut at the end) becomes U+FFFD.

        skip_special: drop control/unknown tokens (BOS, ``<|im_end|>``...).
        strip_space_prefix: for vocabularies with ``add_space_prefix`` (SentencePiece), remove
        the one space the encoder put in front of the text when the first rendered token starts
        with it, so ``decode(encode(s), skip_special=True) == s`` (HF's rule; llama.cpp keeps
        that space when it skips a leading BOS). Pass False to decode a continuation.
        """
        ids = list(ids)
        data = self.decode_bytes(ids, skip_special)
        if strip_space_prefix and self.add_space_prefix and data.startswith(b" "):
            skip = self._special_ids if skip_special else ()
            first = next((int(i) for i in ids if int(i) not in skip), None)
            if first is not None and self._pieces[first].startswith(b" "):
                data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        pre = f", pre={self.pre_name!r}" if self.kind == "bpe" else ""
        return (f"<Tokenizer {self.model}{pre} n_vocab={self.n_vocab} bos={self._bos} "
                f"eos={self._eos}>")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (lone surrogate at index {e.start})") from None


def _parse_byte_token(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


class StreamDecoder:
    """Incremental detokenizer: feed token ids as they are generated and get back only text
    that is complete UTF-8, so a character whose bytes span several tokens is emitted whole,
    once its last byte arrives. Invalid byte sequences become U+FFFD.

    >>> sd = tok.stream_decoder()
    >>> for t in generated: print(sd.feed(t), end="")
    >>> print(sd.flush())
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; returns the newly completed text (possibly '')."""
        try:
            ids = (operator.index(ids),)  # one id (int, numpy integer)
        except TypeError:
            pass  # an iterable of ids
        return self._dec.decode(self.tokenizer.decode_bytes(ids, self.skip_special))

    def flush(self) -> str:
        """End of stream: returns what is left (an incomplete character becomes U+FFFD)."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending(self) -> bytes:
        """Bytes held back because they do not yet form a complete character."""
        return self._dec.getstate()[0]

    def reset(self) -> None:
        self._dec.reset()
