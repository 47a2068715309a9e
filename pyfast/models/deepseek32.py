"""DeepSeek-V3.2 (``deepseek32``): DeepSeek-V3's MLA + MoE (``deepseek2.py``) with DeepSeek Sparse
Attention in every layer (the lightning indexer, ``dsa.py``; half-split indexer RoPE)."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import deepseek2, dsa

ARCH = "deepseek32"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)
MTP_CARRY = "post_norm"


@dataclass
class Args(deepseek2.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "deepseek2.Args":
        return dsa.from_gguf(md, weights, path, types, ARCH, lambda n: (True,) * n)


memory = deepseek2.memory
tensors = dsa.tensors
build = dsa.build
needs_sink = dsa.needs_sink
nextn_tensors = deepseek2.nextn_tensors
build_nextn = deepseek2.build_nextn
