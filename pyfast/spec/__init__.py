"""Speculative decoding: proposers draft, the target verifies a whole draft in one decode.

    from pyfast import LLM
    from pyfast.spec import SpecConfig

    llm = LLM("target.gguf", speculative=SpecConfig(types=["ngram-simple", "draft-model"],
                                                    draft_model="draft.gguf", adaptive=True))
    res = llm.generate("...", max_tokens=256, temperature=0)
    print(res.spec.summary())          # this request; llm.spec_stats: cumulative

Pieces: ``Proposer`` (base.py) and its implementations (ngram.py, draft_model.py), the lossless
verifier (verify.py), ``SpecDecoder`` (decoder.py) which advances any number of sequences one
round per target decode, adaptive draft lengths (adaptive.py) and statistics (stats.py).
"""
from __future__ import annotations

from pyfast.spec.base import DecodeBatch, Draft, DraftRequest, Proposer
from pyfast.spec.config import SPEC_TYPES, SpecConfig, make_proposers
from pyfast.spec.stats import ProposerStats, SpecStats
from pyfast.spec.verify import VerifyResult

__all__ = [
    "SPEC_TYPES", "SpecConfig", "make_proposers", "Proposer", "Draft", "DraftRequest", "DecodeBatch",
    "SpecStats", "ProposerStats", "VerifyResult", "SpecDecoder", "Slot",
    "NgramSimple", "NgramMapK", "NgramMod", "DraftModelProposer", "check_vocab_compatible",
]

_LAZY = {
    "SpecDecoder": "pyfast.spec.decoder",
    "Slot": "pyfast.spec.decoder",
    "NgramSimple": "pyfast.spec.ngram",
    "NgramMapK": "pyfast.spec.ngram",
    "NgramMod": "pyfast.spec.ngram",
    "DraftModelProposer": "pyfast.spec.draft_model",
    "check_vocab_compatible": "pyfast.spec.draft_model",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyfast.spec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
