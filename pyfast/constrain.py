"""Constrained decoding: JSON mode, JSON Schema, GBNF / Lark grammars and regular expressions.

A :class:`Constraint` names what the output must match; :func:`compile_constraint` checks it and
turns it into a :class:`Grammar` for one vocabulary; ``SamplingParams(constraint=grammar)`` makes
every :class:`~pyfast.sampling.Sampler` built from those parameters start its own
:class:`Matcher`. The sampler masks the logits (tokens the grammar cannot take next get
``-inf``) before the rest of its chain and advances the matcher with each token it returns, so
``LLM.generate``, ``LLM.chat``, the server and speculative verification (which samples the
target row by row when a constraint is set) all go through the same stage. When the grammar is
complete only end-of-generation tokens are allowed.

The engine is `llguidance <https://github.com/guidance-ai/llguidance>`_: its mask is computed
lazily over a token trie (tens of microseconds per token for a 49k vocabulary, measured by
``scripts/bench_constrain.py``), it compiles JSON Schema, Lark and regexes itself, converts
GBNF, and it needs no torch (xgrammar's Python package pulls torch and transformers in).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Constraint", "ConstraintError", "Grammar", "Matcher", "compile_constraint", "available"]

KINDS = ("json", "json_schema", "gbnf", "lark", "regex")
MAX_SOURCE_CHARS = 1 << 20  # a schema or grammar text


class ConstraintError(ValueError):
    """A schema, grammar or regex that cannot be used; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def available() -> bool:
    """True when the constraint engine (llguidance) is installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Constraint:
    """What the output must match.

    kind: ``json`` (any JSON object; ``source`` unused), ``json_schema`` (``source``: the schema,
    a dict, a bool or its JSON text), ``gbnf`` (llama.cpp's grammar format, root rule ``root``),
    ``lark`` (llguidance's Lark dialect) or ``regex``.
    """

    kind: str
    source: Any = None
    param: str | None = None  # the request field it came from (for error messages)

    @staticmethod
    def json_object() -> "Constraint":
        return Constraint("json", None, "response_format")

    @staticmethod
    def json_schema(schema: Any, param: str = "json_schema") -> "Constraint":
        return Constraint("json_schema", schema, param)

    @staticmethod
    def gbnf(text: str, param: str = "grammar") -> "Constraint":
        return Constraint("gbnf", text, param)

    @staticmethod
    def regex(pattern: str, param: str = "regex") -> "Constraint":
        return Constraint("regex", pattern, param)

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) for this constraint; ConstraintError when the
        source is malformed before the engine even sees it."""
        from llguidance import LLMatcher

        k, src, param = self.kind, self.source, self.param
        if k not in KINDS:
            raise ConstraintError(f"unknown constraint kind {k!r} (expected one of {', '.join(KINDS)})", param)
        opts = {"whitespace_flexible": False}
        if k == "json":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=opts)
        if k == "json_schema":
            if isinstance(src, (bytes, str)):
                if len(src) > MAX_SOURCE_CHARS:
                    raise ConstraintError(f"the schema is too large ({len(src)} characters; at most "
                                          f"{MAX_SOURCE_CHARS})", param)
                try:
                    src = json.loads(src)
                except ValueError as e:
                    raise ConstraintError(f"the schema is not valid JSON: {e}", param) from None
            if isinstance(src, bool):
                src = {} if src else {"not": {}}
            if not isinstance(src, dict):
                raise ConstraintError(f"a JSON schema must be an object or a boolean, got {type(src).__name__}",
                                      param)
            _check_schema(src, param)
            try:
                return LLMatcher.grammar_from_json_schema(src, defaults=opts)
            except (ValueError, TypeError) as e:
                raise ConstraintError(f"invalid JSON schema: {e}", param) from None
        if not isinstance(src, str):
            raise ConstraintError(f"a {k} must be a string, got {type(src).__name__}", param)
        if not src.strip():
            raise ConstraintError(f"the {k} is empty", param)
        if len(src) > MAX_SOURCE_CHARS:
            raise ConstraintError(f"the {k} is too large ({len(src)} characters; at most {MAX_SOURCE_CHARS})", param)
        if k == "regex":
            return LLMatcher.grammar_from_regex(src)
        if k == "lark":
            return LLMatcher.grammar_from_lark(src)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(src)
        except Exception as e:  # the converter raises plain exceptions on syntax errors
            raise ConstraintError(f"invalid GBNF grammar: {' '.join(str(e).split())[:400]}", param) from None
        return LLMatcher.grammar_from_lark(lark)


def _check_schema(schema: dict, param: str | None) -> None:
    """Refuse a schema that is not valid under its own metaschema (jsonschema, when installed),
    so the error names the schema's fault rather than the grammar compiler's."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ConstraintError(f"invalid JSON schema at {where}: {e.message}", param) from None


class _Vocab:
    """llguidance's view of a pyfast tokenizer: every token's bytes (control tokens marked with a
    leading 0xff, as llguidance expects) and the tokenizer itself for its text preprocessing."""

    def __init__(self, tok, n_vocab: int):
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else 0
        self.bos_token_id = tok.bos_id
        toks = []
        special = []
        for i in range(tok.n_vocab):
            b = tok.token_piece(i)
            if tok.is_special(i):
                b = b"\xff" + b
                special.append(i)
            toks.append(b)
        toks += [b""] * (n_vocab - len(toks))
        self.tokens = toks
        self.special_token_ids = special
        self.is_tokenizer_wrapper = True
        self._tok = tok

    def __call__(self, s) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s, add_bos=False, special=False)


_LLTOK: dict[tuple, tuple[Any, Any]] = {}
_LLTOK_LOCK = threading.Lock()


def _lltokenizer(tok, n_vocab: int, json_slices: bool = False):
    """The llguidance tokenizer of ``tok`` (built once per tokenizer object and slice set).
    JSON grammars use llguidance's JSON slices: the mask inside a free string then costs a
    fraction (measured on SmolLM2: mean 80 us instead of 310 us per token over a schema's
    output; medians ~20 us either way)."""
    key = (id(tok), n_vocab, json_slices)
    with _LLTOK_LOCK:
        hit = _LLTOK.get(key)
        if hit is not None and hit[0] is tok:
            return hit[1]
    from llguidance import LLTokenizer

    eog = sorted(tok.eog_ids) or [tok.eos_id or 0]
    slices = LLTokenizer.json_slices() if json_slices else None
    llt = LLTokenizer(_Vocab(tok, n_vocab), n_vocab=n_vocab, eos_token=eog, slices=slices)
    with _LLTOK_LOCK:
        _LLTOK[key] = (tok, llt)
    return llt


class Grammar:
    """A checked constraint compiled for one vocabulary; :meth:`matcher` starts a sequence."""

    def __init__(self, constraint: Constraint, text: str, lltok, n_vocab: int, eog: list[int]):
        self.constraint = constraint
        self.text = text
        self.lltok = lltok
        self.n_vocab = n_vocab
        self.eog = eog

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def __repr__(self) -> str:
        return f"<Grammar {self.constraint.kind}>"


class Matcher:
    """One sequence's position in a grammar: the mask of tokens allowed next, and consume."""

    def __init__(self, grammar: Grammar):
        from llguidance import LLMatcher

        self.grammar = grammar
        self.m = LLMatcher(grammar.lltok, grammar.text, log_level=0)
        if self.m.is_error():
            raise ConstraintError(f"invalid {grammar.constraint.kind}: {self.m.get_error()}",
                                  grammar.constraint.param)
        n = grammar.n_vocab
        self._words = np.zeros((n + 31) // 32, dtype=np.int32)
        self._bits = self._words.view(np.uint8)
        self.n_vocab = n

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar takes next (end-of-generation once complete)."""
        if self.m.is_error():
            raise ValueError(f"constraint: the matcher is in an error state: {self.m.get_error()}")
        if self.m.is_stopped():  # complete (e.g. generation goes on with ignore_eos): only EOG
            ok = np.zeros(self.n_vocab, dtype=np.bool_)
            ok[self.grammar.eog] = True
            return ok
        self.m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return np.unpackbits(self._bits, bitorder="little", count=self.n_vocab).view(np.bool_)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (float32 [n_vocab]) with disallowed tokens at -inf."""
        ok = self.allowed()
        return np.where(ok, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def consume(self, token: int) -> None:
        """Advance past ``token``; an end-of-generation token ends the grammar."""
        if self.m.is_stopped() and int(token) in self.grammar.eog:
            return
        if not self.m.consume_token(int(token)):
            raise ValueError(f"constraint: token {token} is not allowed here ({self.m.get_error()})")

    @property
    def done(self) -> bool:
        """The grammar has matched a complete output and nothing more may follow."""
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()


def compile_constraint(constraint: Constraint, tokenizer, n_vocab: int | None = None) -> Grammar:
    """Check ``constraint`` and compile it for ``tokenizer`` (a :class:`pyfast.tokenizer.Tokenizer`).
    Raises :class:`ConstraintError` (a ValueError) naming the problem and the request field."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ConstraintError("constrained decoding needs llguidance: pip install 'pyfast[server]' "
                              "(or pip install llguidance)", constraint.param) from None
    n_vocab = int(n_vocab or tokenizer.n_vocab)
    text = constraint.grammar_text()
    lltok = _lltokenizer(tokenizer, n_vocab, json_slices=constraint.kind in ("json", "json_schema", "lark"))
    is_err, msgs = LLMatcher.validate_grammar_with_warnings(text, lltok)
    if is_err:
        msg = " ".join((msgs[0] if msgs else "unknown error").split())
        what = {"json": "JSON mode", "json_schema": "JSON schema", "gbnf": "GBNF grammar", "lark": "Lark grammar",
                "regex": "regex"}[constraint.kind]
        raise ConstraintError(f"invalid {what}: {msg[:600]}", constraint.param)
    g = Grammar(constraint, text, lltok, n_vocab, sorted(tokenizer.eog_ids))
    # construction errors (e.g. resource limits) surface here, not mid-generation; the first mask
    # of a tokenizer also builds llguidance's token tables (~0.1 s, once), not during a reply
    g.matcher().allowed()
    return g
