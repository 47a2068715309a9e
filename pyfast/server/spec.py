"""Speculation inside the server's batched steps.

The scheduler speaks the proposer protocol of algorithms.md §0.2 (the one ``pyfast.spec``
implements), with the slot index as the sequence id::

    begin(seq, prompt)                      a request starts in slot ``seq``
    draft([DraftRequest, ...]) -> drafts    once per step, batched over the generating slots;
                                            a draft is None, a token list, or an object with
                                            ``.tokens`` (e.g. ``pyfast.spec.Draft``)
    accept(seq, k, other)                   after verification (other=True: another proposer
                                            drafted, or none did)
    process(DecodeBatch)                    after every decode: "prompt" rows (prompt chunks)
                                            and "verify" rows (last token + draft per slot),
                                            with the target's hidden rows of exactly those
                                            tokens in ``.hidden`` when a proposer needs them
                                            (draft-mtp: the context then exports them)
    end(seq)                                the request left the slot

Per step, each generating slot's draft goes after its last sampled token in the same batched
decode as every other slot and every prompt chunk (logits on all its rows). The request's own
sampler then samples row by row and stops at the first token that differs from the draft
(algorithms.md §0.1): the output is exactly what plain decoding gives, greedy or seeded. The
slot's KV cache is truncated after the last accepted draft token. Hybrid (recurrent) models roll
back through snapshot planes (one per draft token, ``Context(n_rollback=...)``); a draft longer
than they reach has the state saved before the decode and restored, with the accepted tokens
decoded again, after it (``Engine._restore_for_replay``).

Several proposers are asked in order until one drafts (cheap n-gram ones first, §0.3).
``--spec-type`` names come from :func:`register_drafter` or, failing that, from
``pyfast.spec.make_proposers``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np


@dataclass
class DraftRequest:
    """What a proposer reads to draft for one sequence (same fields as pyfast.spec's)."""

    seq: int
    tokens: np.ndarray      # prompt + generated, ending with the token about to be decoded
    n_max: int
    n_min: int = 1
    p_min: float = 0.0
    sampler: Any = None

    @property
    def greedy(self) -> bool:
        return self.sampler is None or self.sampler.params.greedy


@dataclass
class DecodeBatch:
    """A target decode as proposers see it: "prompt" or "verify" rows."""

    kind: str
    seq_ids: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    n_accepted: dict[int, int] | None = None
    hidden: np.ndarray | None = None   # the target's hidden rows of these tokens (export_hidden)


@dataclass
class SpecConfig:
    """Server speculation settings (flags as in llama.cpp)."""

    spec_type: str = "none"          # comma-separated proposer names, or "none"
    n_max: int | None = None         # --draft-max (None: each proposer's default)
    n_min: int | None = None         # --draft-min
    p_min: float = 0.0               # --draft-p-min
    draft_model: str | None = None   # -md / --model-draft

    @property
    def enabled(self) -> bool:
        return bool(self.types())

    def types(self) -> list[str]:
        t = [x.strip() for x in (self.spec_type or "").split(",") if x.strip()]
        if self.draft_model and "draft-model" not in t:
            t.append("draft-model")
        return [x for x in t if x != "none"]

    def validate(self) -> "SpecConfig":
        if self.n_max is not None and self.n_max < 1:
            raise ValueError(f"--draft-max must be >= 1, got {self.n_max}")
        if self.n_min is not None and (self.n_min < 0 or (self.n_max is not None and self.n_min > self.n_max)):
            raise ValueError(f"--draft-min must be in [0, --draft-max], got {self.n_min}")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError(f"--draft-p-min must be in [0, 1), got {self.p_min}")
        return self


# name -> factory(model, spec_config) returning one proposer
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_drafter(name: str, factory: Callable[..., Any]) -> None:
    """Make ``--spec-type name`` use ``factory(model, spec_config)`` (a proposer object)."""
    _REGISTRY[name] = factory


def build_proposers(cfg: SpecConfig, model, n_ctx: int, n_threads: int | None = None) -> list:
    """The proposers for ``cfg`` in order (empty when speculation is off)."""
    cfg.validate()
    types = cfg.types()
    if not types:
        return []
    out, rest = [], []
    for t in types:
        if t in _REGISTRY:
            out.append(_REGISTRY[t](model, cfg))
        else:
            rest.append(t)
    if rest:
        try:
            from pyfast.spec import SpecConfig as _Cfg
            from pyfast.spec import make_proposers
        except ImportError:
            raise ValueError(f"--spec-type {','.join(rest)}: speculative decoding (pyfast.spec) is not "
                             f"available in this build; registered: {sorted(_REGISTRY) or 'none'}") from None
        scfg = _Cfg(types=rest, draft_model=cfg.draft_model if "draft-model" in rest else None,
                    draft_max=cfg.n_max, draft_min=cfg.n_min, draft_p_min=cfg.p_min)
        out.extend(make_proposers(scfg, model, n_ctx, n_threads))
    return out


def _draft_tokens(d) -> list[int]:
    if d is None:
        return []
    toks = getattr(d, "tokens", d)
    return [int(t) for t in np.asarray(toks).reshape(-1)]


class Speculator:
    """Drives the proposers for all slots: drafting, acceptance and decode notifications."""

    def __init__(self, proposers: Sequence, n_vocab: int, n_max: int | None = None, n_min: int | None = None,
                 p_min: float = 0.0):
        self.proposers = list(proposers)
        self.n_vocab = n_vocab
        self.n_max = n_max
        self.n_min = n_min
        self.p_min = p_min
        self._winner: dict[int, Any] = {}

    def _limits(self, p) -> tuple[int, int]:
        n_max = self.n_max if self.n_max is not None else int(getattr(p, "default_n_max", 16))
        n_min = self.n_min if self.n_min is not None else int(getattr(p, "default_n_min", 1))
        return n_max, max(1, n_min)

    @property
    def max_draft(self) -> int:
        return max((self._limits(p)[0] for p in self.proposers), default=0)

    def begin(self, seq: int, prompt: Sequence[int]) -> None:
        self._winner.pop(seq, None)
        arr = np.asarray(prompt, dtype=np.int32)
        for p in self.proposers:
            p.begin(seq, arr)

    def end(self, seq: int) -> None:
        self._winner.pop(seq, None)
        for p in self.proposers:
            if hasattr(p, "end"):
                p.end(seq)

    def draft(self, wants: list[tuple[int, np.ndarray, int, Any]]) -> dict[int, list[int]]:
        """wants: (seq, tokens, cap, sampler) per generating slot; returns seq -> draft tokens."""
        out: dict[int, list[int]] = {}
        pending = [w for w in wants if w[2] >= 1]
        for p in self.proposers:
            if not pending:
                break
            n_max, n_min = self._limits(p)
            reqs = [DraftRequest(seq, toks, min(cap, n_max), n_min, self.p_min, sampler)
                    for seq, toks, cap, sampler in pending if min(cap, n_max) >= n_min]
            if reqs:
                for r, d in zip(reqs, p.draft(reqs)):
                    toks = _draft_tokens(d)[: r.n_max]
                    if len(toks) < r.n_min:
                        continue
                    if min(toks) < 0 or max(toks) >= self.n_vocab:
                        raise ValueError(f"proposer {getattr(p, 'name', p)!r} drafted a token id outside "
                                         f"[0, {self.n_vocab})")
                    out[r.seq] = toks
                    self._winner[r.seq] = p
            pending = [w for w in pending if w[0] not in out]
        return out

    def accept(self, seq: int, n_accepted: int) -> None:
        w = self._winner.pop(seq, None)
        for p in self.proposers:
            p.accept(seq, n_accepted, other=p is not w)

    @property
    def needs_hidden(self) -> bool:
        """Whether a proposer (draft-mtp) reads the target's hidden rows: the target Context must
        then export them (``export_hidden=True``) and process() gets them."""
        return any(getattr(p, "needs_hidden", False) for p in self.proposers)

    def bind_target(self, ctx) -> None:
        """Give hidden-carry proposers the target context (as pyfast.spec's SpecDecoder does)."""
        for p in self.proposers:
            bind = getattr(p, "bind_target", None)
            if bind is not None:
                bind(ctx)

    def process(self, kind: str, seqs: Sequence[int], toks: Sequence[int], pos: Sequence[int],
                n_accepted: dict[int, int] | None = None, hidden: np.ndarray | None = None) -> None:
        if not self.proposers or not len(toks):
            return
        batch = DecodeBatch(kind, np.asarray(seqs, dtype=np.int32), np.asarray(toks, dtype=np.int32),
                            np.asarray(pos, dtype=np.int32), n_accepted, hidden)
        for p in self.proposers:
            p.process(batch)
