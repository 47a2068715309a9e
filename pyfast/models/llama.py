"""Llama architecture (Llama 2/3.x, Mistral, SmolLM2; Mixtral-style experts where the file has
``llama.expert_count``): pre-norm decoder, GQA attention with rotary embeddings (NORMAL pairs:
llama.cpp's converter permutes the q / k rows), SwiGLU feed-forward. Llama 3.x rope scaling
comes as ``rope_freqs.weight``, YaRN and linear scaling from ``llama.rope.scaling.*``
(``pyfast/models/rope.py``). Layers come from ``decoder.py``."""
from __future__ import annotations

from dataclasses import dataclass

from pyfast.models import decoder
from pyfast.models.rope import ROPE_NORMAL

ARCH = "llama"
EXPORTS_HIDDEN = True  # build() outputs "hidden" when the builder asks (embeddings, drafters)


@dataclass
class Args(decoder.Args):
    @classmethod
    def from_gguf(cls, md: dict, weights, path: str = "", types: dict | None = None) -> "Args":
        return super().from_gguf(md, weights, arch=ARCH, rope_mode=ROPE_NORMAL, default_eps=1e-5, default_ctx=2048,
                                 path=path, types=types)


tensors = decoder.tensors
build = decoder.build
