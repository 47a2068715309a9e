"""A decoding context: the KV cache, the compiled plans and ``decode(batch) -> logits``.

Plans are cached by batch shape (n_tokens, visible cache cells, returned rows), so decoding
replays a compiled plan each step instead of rebuilding a graph.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Sequence

import numpy as np

from pyfast._loader import native
from pyfast.memory.kv_cache import KVCache
from pyfast.models import BatchShape, Model


def default_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        n = os.cpu_count() or 1
    return max(1, n)


class Context:
    """Owns the memory of one or more sequences and runs batches through the model."""

    def __init__(self, model: Model, n_ctx: int = 4096, n_threads: int | None = None,
                 n_ubatch: int = 512, kv_dtype: "native.DType" = native.DType.F16, max_plans: int = 12):
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {n_ubatch}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.model = model
        self.n_ctx = n_ctx
        self.n_threads = n_threads or default_threads()
        self.n_ubatch = n_ubatch
        self.pool = native.ThreadPool(self.n_threads)
        n_layer, n_head_kv, head_dim = model.kv_geometry()
        self.kv = KVCache(n_layer, n_ctx, n_head_kv, head_dim, kv_dtype)
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self.max_plans = max_plans
        self.n_plan_builds = 0
        self.t_compute = 0.0

    # --- plans -----------------------------------------------------------------------------
    def _plan(self, shape: BatchShape):
        key = (shape.n_tokens, shape.n_kv, shape.n_out)
        plan = self._plans.get(key)
        if plan is None:
            b = self.model.build(shape, self.kv)
            plan = native.Plan(b.g, self.pool)
            self.n_plan_builds += 1
            self._plans[key] = plan
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    # --- decoding --------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int] | None = None,
               seq_ids: Sequence[int] | int = 0, logits: str | Sequence[int] | np.ndarray = "last") -> np.ndarray:
        """Run a batch of tokens and return the logits of the selected rows.

        tokens: token ids; positions: each token's position in its sequence (default: append
        after the sequence's last stored position); seq_ids: a sequence id per token (or one for
        all); logits: "last", "all", "none", or the row indices to return.
        Returns float32 [n_selected, n_vocab], rows in the order requested.
        """
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = toks.size
        if T == 0:
            raise ValueError("decode: empty batch")
        n_vocab = self.model.n_vocab
        if toks.min() < 0 or toks.max() >= n_vocab:
            bad = int(toks[(toks < 0) | (toks >= n_vocab)][0])
            raise ValueError(f"decode: token id {bad} is outside the vocabulary [0, {n_vocab})")
        seqs = np.broadcast_to(np.asarray(seq_ids, dtype=np.int32), (T,)).copy()
        if positions is None:
            pos = np.empty(T, dtype=np.int32)
            nxt: dict[int, int] = {}
            for t, s in enumerate(seqs.tolist()):
                p = nxt.get(s)
                if p is None:
                    p = self.kv.seq_pos_max(s) + 1
                pos[t] = p
                nxt[s] = p + 1
        else:
            pos = np.asarray(positions, dtype=np.int32).reshape(-1)
            if pos.size != T:
                raise ValueError(f"decode: {T} tokens but {pos.size} positions")
            if pos.min() < 0:
                raise ValueError("decode: positions must be >= 0")
        if isinstance(logits, str):
            if logits == "last":
                rows = np.array([T - 1])
            elif logits == "all":
                rows = np.arange(T)
            elif logits == "none":
                rows = np.array([], dtype=np.int64)
            else:
                raise ValueError(f"decode: logits must be 'last', 'all', 'none' or row indices, got {logits!r}")
        else:
            rows = np.asarray(logits, dtype=np.int64).reshape(-1)
            if rows.size and (rows.min() < 0 or rows.max() >= T):
                raise ValueError("decode: logits row index out of range")

        out = np.empty((rows.size, n_vocab), dtype=np.float32)
        toks32 = toks.astype(np.int32)
        for u0 in range(0, T, self.n_ubatch):
            u1 = min(T, u0 + self.n_ubatch)
            sel = np.flatnonzero((rows >= u0) & (rows < u1))
            n_out = max(1, sel.size)  # a graph always returns at least one row
            out_ids = (rows[sel] - u0).astype(np.int32) if sel.size else np.zeros(1, dtype=np.int32)
            slots = self.kv.prepare(seqs[u0:u1], pos[u0:u1])
            plan = self._plan(BatchShape(u1 - u0, slots.n_kv, n_out))
            plan.set_input("tokens", toks32[u0:u1])
            plan.set_input("pos", pos[u0:u1])
            plan.set_input("out_ids", out_ids)
            plan.set_input("kv_idx", slots.idx)
            plan.set_input("mask", slots.mask)
            plan.set_input("kv_order", slots.order)
            t0 = time.perf_counter()
            plan.run()
            self.t_compute += time.perf_counter() - t0
            if sel.size:
                out[sel] = plan.output("logits", copy=False)
        return out

    # --- memory ----------------------------------------------------------------------------
    def truncate(self, seq: int, p: int) -> None:
        """Remove positions >= p of sequence `seq`."""
        self.kv.truncate(seq, p)

    def remove_seq(self, seq: int) -> None:
        self.kv.remove_seq(seq)

    def clear(self) -> None:
        self.kv.clear()

    def seq_len(self, seq: int = 0) -> int:
        return self.kv.seq_len(seq)
