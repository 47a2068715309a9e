"""Qwen3 (dense): the standard decoder (``decoder.py``) with per-head q / k RMS norms before
NEOX rope and no biases."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import decoder
from pyfast.models.rope import ROPE_NEOX

ARCH = "qwen3"
EXPORTS_HIDDEN = True


@dataclass
class Args(decoder.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, rope_mode=ROPE_NEOX, qk_norm=True, moe=False, path=path,
                                 types=types)


tensors = decoder.tensors
build = decoder.build
