"""Qwen2 / Qwen2.5: the standard decoder (``decoder.py``) with q / k / v biases and NEOX rope
(YaRN where the metadata asks for it)."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import decoder
from pyfast.models.base import TensorSpec
from pyfast.models.rope import ROPE_NEOX

ARCH = "qwen2"
EXPORTS_HIDDEN = True


@dataclass
class Args(decoder.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, rope_mode=ROPE_NEOX, moe=False, path=path, types=types)


def tensors(args: Args) -> list[TensorSpec]:
    specs = decoder.tensors(args)
    # the biases are part of the architecture: required, not optional
    return [TensorSpec(s.name, s.shape) if s.name.endswith(".bias") else s for s in specs]


build = decoder.build
