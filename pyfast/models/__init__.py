"""Architectures and the model loader.

Each architecture lives in one file (``llama.py``, ...) that exposes ``ARCH``, ``Args`` (read
from GGUF metadata), ``tensors(args)`` and ``build(builder, args)``; ``ARCHITECTURES`` maps
``general.architecture`` to it.
"""
from __future__ import annotations

import os
from types import ModuleType

from pyfast.gguf import GGUFReader
from pyfast.models import llama
from pyfast.models.base import BatchShape, GraphBuilder, Weights

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (llama,)}

_MATMUL_DTYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


class Model:
    """A GGUF model: metadata, mapped weights and its architecture's graph builder."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.reader = GGUFReader(self.path)
        self.metadata = self.reader.metadata
        arch = self.metadata.get("general.architecture")
        mod = ARCHITECTURES.get(arch)
        if mod is None:
            raise ValueError(f"{self.path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        self.arch = mod
        self.weights = Weights(self.reader)
        self.args = mod.Args.from_gguf(self.metadata, self.weights)
        self.weights.check(mod.tensors(self.args), self.path)
        for name, info in self.weights.info.items():
            if len(info.shape) == 2 and info.type_name not in _MATMUL_DTYPES:
                raise ValueError(f"{self.path}: tensor '{name}' has type {info.type_name}, "
                                 f"which this version of pyfast cannot compute with")

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or os.path.basename(self.path))

    def build(self, shape: BatchShape, kv):
        """A graph for one batch shape; returns the builder (its .g has output 'logits')."""
        b = GraphBuilder(self.weights, shape, kv)
        logits = self.arch.build(b, self.args)
        b.g.output(logits, "logits")
        return b

    def kv_geometry(self) -> tuple[int, int, int]:
        a = self.args
        return a.n_layer, a.n_head_kv, a.head_dim


__all__ = ["ARCHITECTURES", "Model", "BatchShape", "GraphBuilder", "Weights"]
