"""Qwen3-Next: Gated-DeltaNet + gated attention hybrid with routed and shared experts. It differs
from Qwen3.5 MoE in the GGUF layout: V heads stay grouped (value head j uses key head
``j // (Hv/Hk)``, GDN broadcast 1), beta/alpha may come fused as ``ssm_ba`` (per key head
``[beta | alpha]``) and rope is plain (no M-RoPE sections). Layers come from ``qwen35.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import qwen35

ARCH = "qwen3next"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)


@dataclass
class Args(qwen35.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, moe=True, broadcast=1, path=path, types=types)


# Memory, tensors and graph are Qwen3.5's; only the GGUF layout read by Args differs.
memory = qwen35.memory
tensors = qwen35.tensors
build = qwen35.build
