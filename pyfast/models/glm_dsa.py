"""GLM-5.x (``glm-dsa``): DeepSeek-V3-style MLA + MoE (``deepseek2.py``) with DeepSeek Sparse
Attention (``dsa.py``; interleaved indexer RoPE). Which layers compute their own indexer comes from
``glm-dsa.attention.indexer.full_layers`` when the file has it, else GLM-5.2's IndexShare pattern
(full iff il <= 1 or il % 4 == 2); the other layers reuse the last full layer's selection."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import deepseek2, dsa

ARCH = "glm-dsa"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (MTP drafting)
MTP_CARRY = "post_norm"


@dataclass
class Args(deepseek2.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "deepseek2.Args":
        return dsa.from_gguf(md, weights, path, types, ARCH, dsa.index_share_default)


memory = deepseek2.memory
tensors = dsa.tensors
build = dsa.build
needs_sink = dsa.needs_sink
nextn_tensors = deepseek2.nextn_tensors
build_nextn = deepseek2.build_nextn
