"""Shared graph builders for architecture files.

An architecture file declares its hyper-parameters (``Args``), the tensors it expects and a
``build(b, args)`` that wires layers from the helpers below. Shapes in comments are
outermost-first: ``[n_tokens, n_embd]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native

DType = native.DType


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    optional: bool = False


class Weights:
    """Model tensors mapped from the GGUF file (no copies)."""

    def __init__(self, reader):
        self.reader = reader
        self.info = reader.tensors  # name -> info(name, type, shape, offset, nbytes)
        self._bytes: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def dtype(self, name: str) -> "native.DType":
        return DType(self.info[name].type)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.info[name].shape)

    def data(self, name: str) -> np.ndarray:
        arr = self._bytes.get(name)
        if arr is None:
            arr = self._bytes[name] = self.reader.tensor_bytes(name)
        return arr

    def check(self, specs: list[TensorSpec], path: str) -> None:
        """Verify every expected tensor is present with the right shape before allocating."""
        for s in specs:
            if s.name not in self.info:
                if s.optional:
                    continue
                raise ValueError(f"{path}: missing tensor '{s.name}' (expected shape {list(s.shape)})")
            got = self.shape(s.name)
            if tuple(got) != tuple(s.shape):
                raise ValueError(f"{path}: tensor '{s.name}' has shape {list(got)}, expected {list(s.shape)}")


@dataclass
class BatchShape:
    n_tokens: int  # rows in this micro-batch
    n_kv: int      # visible cache cells
    n_out: int     # rows whose logits are returned


class GraphBuilder:
    """Wraps a native Graph with the inputs of one batch shape and layer helpers."""

    def __init__(self, weights: Weights, shape: BatchShape, kv=None):
        self.g = native.Graph()
        self.w = weights
        self.shape = shape
        self.kv = kv
        T, n_kv = shape.n_tokens, shape.n_kv
        g = self.g
        self.tokens = g.input("tokens", DType.I32, [T])       # [T]
        self.pos = g.input("pos", DType.I32, [T])             # [T]
        self.out_ids = g.input("out_ids", DType.I32, [shape.n_out])
        if kv is not None:
            self.kv_idx = g.input("kv_idx", DType.I32, [T])   # cell written by each token
            self.mask = g.input("mask", DType.F32, [T, n_kv])  # 0 / -inf
            self.kv_order = g.input("kv_order", DType.I32, [n_kv])
        self._wcache: dict[str, object] = {}

    # --- weights ---------------------------------------------------------------------------
    def weight(self, name: str):
        t = self._wcache.get(name)
        if t is None:
            t = self.g.external(name, self.w.dtype(name), list(self.w.shape(name)), self.w.data(name))
            self._wcache[name] = t
        return t

    def has(self, name: str) -> bool:
        return name in self.w

    # --- layers ----------------------------------------------------------------------------
    def embed(self, name: str):
        return self.g.get_rows(self.weight(name), self.tokens)  # [T, n_embd]

    def norm(self, x, name: str, eps: float):
        return self.g.mul(self.g.rms_norm(x, eps), self.weight(name))

    def linear(self, x, name: str, bias: str | None = None):
        y = self.g.matmul(x, self.weight(name))
        if bias is not None and self.has(bias):
            y = self.g.add(y, self.weight(bias))
        return y

    def ffn_swiglu(self, x, prefix: str):
        g = self.g
        gate = self.linear(x, f"{prefix}.ffn_gate.weight")
        up = self.linear(x, f"{prefix}.ffn_up.weight")
        return self.linear(g.swiglu(gate, up), f"{prefix}.ffn_down.weight")

    def kv_attention(self, il: int, q, k, v, scale: float):
        """Write k/v of this batch into layer il's cache and attend over the visible cells.

        q: [T, n_head, head_dim], k: [T, n_head_kv, head_dim], v: [T, n_head_kv, head_dim_v]
        returns [T, n_head * head_dim_v]
        """
        g, kv, T, n_kv = self.g, self.kv, self.shape.n_tokens, self.shape.n_kv
        k_cache = g.external(f"cache_k.{il}", kv.dtype, [kv.n_ctx, kv.n_head_kv, kv.head_dim], kv.k,
                             offset=il * kv.k_layer_bytes)
        v_cache = g.external(f"cache_v.{il}", kv.dtype, [kv.n_ctx, kv.n_head_kv, kv.head_dim_v], kv.v,
                             offset=il * kv.v_layer_bytes)
        k_all = g.set_rows(k_cache, k, self.kv_idx)
        v_all = g.set_rows(v_cache, v, self.kv_idx)
        k_vis = g.view(k_all, [n_kv, kv.n_head_kv, kv.head_dim])
        v_vis = g.view(v_all, [n_kv, kv.n_head_kv, kv.head_dim_v])
        o = g.attention(q, k_vis, v_vis, self.mask, self.kv_order, scale)
        n_head = q.shape[1]
        return g.reshape(o, [T, n_head * kv.head_dim_v])

    def select_outputs(self, x):
        """Keep only the rows whose logits are wanted: [T, d] -> [n_out, d]."""
        return self.g.get_rows(x, self.out_ids)


def attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
