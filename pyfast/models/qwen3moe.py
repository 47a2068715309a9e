"""Qwen3 MoE: Qwen3's attention (q / k norms, NEOX rope) with routed experts in every layer
(softmax router, top ``expert_used_count``, renormalised unless ``expert_weights_norm`` is
false; split or pre-merged gate / up expert stacks). Layers come from ``decoder.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import decoder
from pyfast.models.rope import ROPE_NEOX

ARCH = "qwen3moe"
EXPORTS_HIDDEN = True


@dataclass
class Args(decoder.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, rope_mode=ROPE_NEOX, qk_norm=True, moe=True, path=path,
                                 types=types)


tensors = decoder.tensors
build = decoder.build
