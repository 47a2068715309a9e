"""Qwen3.5 MoE: the Qwen3.5 hybrid (Gated-DeltaNet + gated attention) with routed experts and a
sigmoid-gated shared expert in every layer. Layers come from ``qwen35.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import qwen35

ARCH = "qwen35moe"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)


@dataclass
class Args(qwen35.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, moe=True, broadcast=0, path=path, types=types)


# Memory, tensors and graph are Qwen3.5's; only the GGUF layout read by Args differs.
memory = qwen35.memory
tensors = qwen35.tensors
build = qwen35.build
