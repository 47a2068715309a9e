"""pyfast: a Python-first LLM inference engine over a native graph executor.

Public API (imported lazily so that pure-Python pieces such as the tokenizer load without the
native extension):

    LLM, SamplingParams, GenerationResult, load, devices
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pyfast.llm",
    "GenerationResult": "pyfast.llm",
    "load": "pyfast.llm",
    "SamplingParams": "pyfast.sampling",
    "GGUFError": "pyfast.gguf",
    "Tokenizer": "pyfast.tokenizer",
    "ChatTemplate": "pyfast.chat",
    "Context": "pyfast.context",
    "SpecConfig": "pyfast.spec.config",
    "devices": "pyfast.device",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyfast' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
