"""``SpecConfig``: which proposers to combine and how long their drafts may be.

Every check runs before any decoding: unknown types, a draft model that is missing, has another
vocabulary or a shorter context, and draft lengths that cannot work all raise ValueError with the
setting named as the CLI spells it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from pyfast.spec.base import Proposer

if TYPE_CHECKING:
    from pyfast.models import Model

SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "draft-model", "draft-mtp", "draft-eagle3", "draft-dflash",
              "draft-dspark")
# drafters that run a model per draft token or block (default draft-max 3)
MODEL_TYPES = ("draft-model", "draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark")
# the types whose drafter is the file given as draft_model (-md)
FILE_TYPES = ("draft-model", "draft-eagle3", "draft-dflash", "draft-dspark")
ALIASES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "dspark": "draft-dspark", "mtp": "draft-mtp"}


@dataclass
class SpecConfig:
    """Speculative decoding settings.

    types:        proposers in the order they are asked each round (cheap n-gram ones first); a
                  comma-separated string or a list of names from ``SPEC_TYPES`` and/or Proposer
                  instances. A draft_model adds "draft-model" when it is not listed. None: just
                  "draft-model" when a draft_model is given, else "ngram-simple".
    draft_model:  GGUF path (or Model) of the drafter for "draft-model", or of the head / block
                  drafter for "draft-eagle3" (``pyfast convert --draft`` of an EAGLE-3 checkpoint),
                  "draft-dflash" and "draft-dspark" (aliases "eagle3", "dflash", "dspark").
                  "draft-mtp" needs no file: it drafts with the target's own MTP (nextn) layers.
    draft_max:    longest draft (CLI --draft-max); None = each proposer's default (16 for n-gram,
                  3 for the draft model). With adaptive=True the upper bound of the chosen length.
    draft_min:    discard shorter drafts (--draft-min); None = each proposer's default.
    draft_p_min:  a model drafter stops when its top-1 probability falls below this (--draft-p-min).
    adaptive:     choose each round's draft length from measured verify costs and acceptance
                  (--spec-adaptive).
    ngram_n:      key length of ngram-simple and ngram-map-k; ngram_mod_n: of ngram-mod.
    draft_threads: threads of the draft model (default: the target's).
    """

    types: Sequence[str | Proposer] | str | None = None
    draft_model: "str | os.PathLike | Model | None" = None
    draft_max: int | None = None
    draft_min: int | None = None
    draft_p_min: float = 0.0
    adaptive: bool = False
    ngram_n: int = 4
    ngram_mod_n: int = 8
    draft_threads: int | None = None

    def normalized_types(self) -> list[str | Proposer]:
        t = self.types
        if t is None:
            t = [] if self.draft_model is not None else ["ngram-simple"]
        if isinstance(t, str):
            t = [x.strip() for x in t.split(",") if x.strip()]
        t = [ALIASES.get(x, x) if isinstance(x, str) else x for x in (t or [])]
        if self.draft_model is not None and not any(x in FILE_TYPES for x in t):
            t.append("draft-model")
        return t

    def validate(self, n_ctx: int | None = None) -> "SpecConfig":
        """Check the settings (not the draft model file); raise ValueError naming the bad one."""
        types = self.normalized_types()
        if not types:
            raise ValueError("speculative decoding needs at least one --spec-type "
                             f"(one of {', '.join(SPEC_TYPES)}) or a draft model (-md)")
        seen = set()
        for t in types:
            if isinstance(t, Proposer):
                continue
            if not isinstance(t, str) or t not in SPEC_TYPES:
                raise ValueError(f"unknown speculative type {t!r} (--spec-type); known types: "
                                 f"{', '.join(SPEC_TYPES)}")
            if t in seen:
                raise ValueError(f"speculative type {t!r} is listed twice (--spec-type)")
            seen.add(t)
        for t in FILE_TYPES:
            if t in seen and self.draft_model is None:
                what = "a draft model" if t == "draft-model" else "its drafter GGUF"
                raise ValueError(f"speculative type {t!r} needs {what} (-md/--model-draft)")
        if len(seen & set(FILE_TYPES)) > 1:
            raise ValueError(f"speculative types {sorted(seen & set(FILE_TYPES))} would all read the one drafter "
                             "file (-md); list only one of them")
        for name in ("draft_max", "draft_min", "ngram_n", "ngram_mod_n", "draft_threads"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"SpecConfig.{name} must be an integer, got {v!r}")
        if self.draft_max is not None and self.draft_max < 1:
            model = [t for t in MODEL_TYPES if t in seen]
            what = (f"a model drafter ({', '.join(model)}) needs" if model
                    else "speculative decoding needs")
            raise ValueError(f"--draft-max must be >= 1, got {self.draft_max}: {what} drafts of at least "
                             "one token (turn speculation off by not giving --spec-type / -md)")
        if self.draft_min is not None and self.draft_min < 0:
            raise ValueError(f"--draft-min must be >= 0, got {self.draft_min}")
        if self.draft_min is not None and self.draft_max is not None and self.draft_min > self.draft_max:
            raise ValueError(f"--draft-min ({self.draft_min}) is larger than --draft-max ({self.draft_max})")
        p = self.draft_p_min
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0.0 <= p <= 1.0:
            raise ValueError(f"--draft-p-min must be in [0, 1], got {p!r}")
        if self.ngram_n < 1 or self.ngram_mod_n < 1:
            raise ValueError("n-gram key lengths (ngram_n, ngram_mod_n) must be >= 1")
        if self.draft_threads is not None and self.draft_threads < 1:
            raise ValueError(f"draft_threads must be >= 1, got {self.draft_threads}")
        if n_ctx is not None:
            longest = self.draft_max if self.draft_max is not None else max(
                [3 if t in MODEL_TYPES else 16 for t in types if isinstance(t, str)]
                + [t.default_n_max for t in types if isinstance(t, Proposer)])
            if longest + 1 >= n_ctx:
                raise ValueError(f"--draft-max {longest} does not fit the context size {n_ctx}: a verify "
                                 f"batch holds draft-max + 1 tokens after at least one prompt token; "
                                 f"lower --draft-max or raise -c")
        return self

    def n_max_for(self, p: Proposer) -> int:
        return self.draft_max if self.draft_max is not None else p.default_n_max

    def n_min_for(self, p: Proposer) -> int:
        return self.draft_min if self.draft_min is not None else p.default_n_min


def make_proposers(cfg: SpecConfig, target: "Model", n_ctx: int, n_threads: int | None = None) -> list[Proposer]:
    """Instantiate the configured proposers in order (loads and checks the draft model; draft-mtp
    checks the target's MTP layers). Create the target Context with
    ``export_hidden=needs_hidden(proposers)``."""
    from pyfast.spec.ngram import NgramMapK, NgramMod, NgramSimple

    cfg.validate(n_ctx)
    out: list[Proposer] = []
    for t in cfg.normalized_types():
        if isinstance(t, Proposer):
            out.append(t)
        elif t == "ngram-simple":
            # fallback drafts are cheap bets only an adaptive controller can switch off; with the
            # controller trimming every draft, re-sync drafts may also run longer (8, not 4)
            out.append(NgramSimple(n=cfg.ngram_n, n_fallback=2 if cfg.adaptive else 0,
                                   n_max_local=8 if cfg.adaptive else 4))
        elif t == "ngram-map-k":
            out.append(NgramMapK(n=cfg.ngram_n))
        elif t == "ngram-mod":
            out.append(NgramMod(n=cfg.ngram_mod_n))
        elif t == "draft-model":
            from pyfast.hub import resolve_model
            from pyfast.models import Model
            from pyfast.spec.draft_model import DraftModelProposer

            dm = cfg.draft_model
            if not isinstance(dm, Model):
                dm = Model(resolve_model(str(dm), quiet=True))
            out.append(DraftModelProposer(dm, target, n_ctx=n_ctx, n_threads=cfg.draft_threads or n_threads))
        elif t == "draft-mtp":
            from pyfast.spec.mtp import MTPProposer

            out.append(MTPProposer(target, n_ctx=n_ctx, n_threads=n_threads))
        elif t == "draft-eagle3":
            from pyfast.spec.eagle3 import make_eagle3

            out.append(make_eagle3(cfg, target, n_ctx, n_threads))
        elif t in ("draft-dflash", "draft-dspark"):
            from pyfast.spec.dflash import make_block_drafter

            out.append(make_block_drafter(t, cfg, target, n_ctx, n_threads))
    return out


def needs_hidden(proposers) -> bool:
    """Whether any proposer consumes the target's hidden rows (draft-mtp): the target Context
    must then be created with export_hidden=True (and only then: the export costs a copy)."""
    return any(getattr(p, "needs_hidden", False) for p in proposers or ())


def capture_layers(proposers) -> tuple[int, ...]:
    """The target layers whose rows the proposers read (EAGLE-3, DFlash: ``Proposer.capture_layers``),
    in first-seen order: create the target Context with ``capture_layers=`` this (empty: nothing
    is captured, the graphs are the plain ones)."""
    out: list[int] = []
    for p in proposers or ():
        for l in getattr(p, "capture_layers", ()) or ():
            if int(l) not in out:
                out.append(int(l))
    return tuple(out)
