"""Qwen3.5 MoE: the Qwen3.5 hybrid (Gated-DeltaNet + gated attention) with routed experts and a
sigmoid-gated shared expert in every layer. Layers come from ``qwen35.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import qwen35
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec

ARCH = "qwen35moe"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)


@dataclass
class Args(qwen35.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, moe=True, broadcast=0)


def memory(args: Args) -> MemorySpec:
    return qwen35.memory(args)


def tensors(args: Args) -> list[TensorSpec]:
    return qwen35.tensors(args)


def build(b: GraphBuilder, args: Args):
    return qwen35.build(b, args)
