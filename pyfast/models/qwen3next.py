"""Qwen3-Next: Gated-DeltaNet + gated attention hybrid with routed and shared experts. It differs
from Qwen3.5 MoE in the GGUF layout: V heads stay grouped (value head j uses key head
``j // (Hv/Hk)``, GDN broadcast 1), beta/alpha may come fused as ``ssm_ba`` (per key head
``[beta | alpha]``) and rope is plain (no M-RoPE sections). Layers come from ``qwen35.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import qwen35
from pyfast.models.base import GraphBuilder, MemorySpec, TensorSpec

ARCH = "qwen3next"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)


@dataclass
class Args(qwen35.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, moe=True, broadcast=1)


def memory(args: Args) -> MemorySpec:
    return qwen35.memory(args)


def tensors(args: Args) -> list[TensorSpec]:
    return qwen35.tensors(args)


def build(b: GraphBuilder, args: Args):
    return qwen35.build(b, args)
