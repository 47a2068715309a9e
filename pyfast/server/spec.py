"""Speculation in the server: its flags, its proposers, and how they plug into the shared round.

The scheduler runs every decode round through ``pyfast.spec.decoder.SpecDecoder`` (the round of
``LLM.generate`` and ``generate_batch``; see ``Engine._step``), with the slot index as the
sequence id. A round drafts for every generating slot, puts each slot's ``[last, d1..dN]`` into
the step's one batched decode next to the prompt chunks, verifies it with ``pyfast.spec.verify``
(rejection sampling for drafts that carry probabilities, such as ``draft-model`` and
``draft-mtp``, when the request samples; row-by-row sampling for drafts without them; the argmax
when greedy), rolls the cache back (snapshot planes, or save / restore / replay for hybrid models)
and tells the proposers. The proposer protocol is algorithms.md §0.2 (``pyfast.spec.Proposer``)::

    begin(seq, prompt)                      a request starts in slot ``seq``
    draft([DraftRequest, ...]) -> drafts    once per round, batched over the generating slots
    accept(seq, k, other)                   after verification (other=True: another proposer
                                            drafted, or none did)
    process(DecodeBatch)                    after every decode: "prompt" rows (prompt chunks)
                                            and "verify" rows (last token + draft per slot),
                                            with the target's hidden rows of exactly those
                                            tokens in ``.hidden`` when the context exports them
    end(seq)                                the request left the slot

Several proposers are asked in order until one drafts (cheap n-gram ones first, §0.3).
``--spec-type`` names come from :func:`register_drafter` or, failing that, from
``pyfast.spec.make_proposers``. A registered drafter need not subclass ``Proposer``: its drafts
may be None, token lists or arrays, or ``pyfast.spec.Draft`` objects (:func:`as_proposer`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pyfast.spec.base import Draft, DraftRequest, Proposer


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
        from pyfast.spec.config import ALIASES, FILE_TYPES

        t = [ALIASES.get(x, x) for x in (x.strip() for x in (self.spec_type or "").split(",")) if x]
        if self.draft_model and not any(x in FILE_TYPES for x in t):
            t.append("draft-model")
        return [x for x in t if x != "none"]

    def validate(self) -> "SpecConfig":
        if self.n_max is not None and self.n_max < 1:
            raise ValueError(f"--draft-max must be >= 1, got {self.n_max}")
        if self.n_min is not None and (self.n_min < 0 or (self.n_max is not None and self.n_min > self.n_max)):
            raise ValueError(f"--draft-min must be in [0, --draft-max], got {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"--draft-p-min must be in [0, 1], got {self.p_min}")
        return self

    def decoder_config(self):
        """The draft limits as the shared round's ``pyfast.spec.SpecConfig``."""
        from pyfast.spec.config import SpecConfig as RoundConfig

        return RoundConfig(draft_max=self.n_max, draft_min=self.n_min, draft_p_min=self.p_min)


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
        from pyfast.spec import make_proposers

        scfg = cfg.decoder_config()
        from pyfast.spec.config import FILE_TYPES

        scfg.types = rest
        scfg.draft_model = cfg.draft_model if any(x in FILE_TYPES for x in rest) else None
        out.extend(make_proposers(scfg, model, n_ctx, n_threads))
    return out


def as_proposer(p) -> Proposer:
    """``p`` itself when it is a ``pyfast.spec.Proposer``, else a Proposer that forwards to it
    (missing methods do nothing; drafts become ``Draft`` objects without probabilities)."""
    return p if isinstance(p, Proposer) else _Foreign(p)


class _Foreign(Proposer):
    """A duck-typed proposer seen through the ``Proposer`` interface (see ``as_proposer``)."""

    def __init__(self, p):
        self.inner = p
        self.name = str(getattr(p, "name", type(p).__name__))
        self.default_n_max = int(getattr(p, "default_n_max", Proposer.default_n_max))
        self.default_n_min = int(getattr(p, "default_n_min", Proposer.default_n_min))
        self.is_model = bool(getattr(p, "is_model", False))
        self.needs_hidden = bool(getattr(p, "needs_hidden", False))
        self.capture_layers = tuple(getattr(p, "capture_layers", ()) or ())
        if hasattr(p, "bind_target"):
            self.bind_target = p.bind_target

    def begin(self, seq, prompt) -> None:
        if hasattr(self.inner, "begin"):
            self.inner.begin(seq, prompt)

    def draft(self, requests: list[DraftRequest]) -> list[Draft | None]:
        out = []
        for d in self.inner.draft(requests):
            if d is not None and not isinstance(d, Draft):
                d = Draft(np.asarray(d, dtype=np.int32).reshape(-1))
            out.append(d if d is not None and len(d) else None)
        return out

    def accept(self, seq, n_accepted, other=False) -> None:
        if hasattr(self.inner, "accept"):
            self.inner.accept(seq, n_accepted, other=other)

    def process(self, batch) -> None:
        if hasattr(self.inner, "process"):
            self.inner.process(batch)

    def end(self, seq) -> None:
        if hasattr(self.inner, "end"):
            self.inner.end(seq)
