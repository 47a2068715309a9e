"""A sliding-window KV cache bounded to the window, beside the main cache (Gemma's sliding layers).

A sliding layer's query at position p sees only positions ``p - W < q <= p``, so its cache needs a
sequence's last ``W - 1`` positions plus the batch being decoded: ``n_seq_max * (W - 1) + n_ubatch``
cells instead of ``n_ctx``. Before each batch, every sequence in it drops its cells more than
``W - 1`` positions before the batch's first position of that sequence (``prepare``).

What this costs: a sequence can be truncated back only as far as its dropped cells allow (the
positions after ``floor + W - 1``, ``floor`` being the first position still held): always within
the last batch (speculative verification), not to an arbitrary earlier point. ``truncate`` raises
``RollbackError`` past that, and removing the whole sequence always works. Saving a sequence's
state is not offered (``Context(..., swa_full=True)``, the default, keeps the full cache).
"""
from __future__ import annotations

import numpy as np

from pyfast.memory.kv_cache import BatchSlots, KVCache
from pyfast.memory.recurrent import RollbackError


class SWAMemory:
    """The main KV cache (global layers) plus the bounded sliding-window cache."""

    def __init__(self, kv: KVCache, kv_swa: KVCache, window: int):
        self.kv, self.kv_swa, self.window = kv, kv_swa, int(window)
        self.floor: dict[int, int] = {}  # seq -> first position still in kv_swa (0: none dropped)

    # --- per batch -----------------------------------------------------------------------------
    def prepare(self, seqs: np.ndarray, pos: np.ndarray) -> BatchSlots:
        """Drop what the batch's queries can no longer see, allocate the batch's cells in the
        sliding-window cache and return its slots with the window applied to the mask."""
        kv, W = self.kv_swa, self.window
        seqs = np.asarray(seqs, dtype=np.int32)
        pos = np.asarray(pos, dtype=np.int32)
        for s in np.unique(seqs).tolist():
            lo = int(pos[seqs == s].min()) - (W - 1)
            if lo > self.floor.get(s, 0):
                kv.drop_before(s, lo)
                self.floor[s] = lo
        slots = kv.prepare(seqs, pos)
        cp = kv.cell_pos[: slots.n_kv]
        mask = slots.mask
        mask[(pos.astype(np.int64)[:, None] - cp[None, :]) >= W] = -np.inf
        return slots

    # --- memory ops ----------------------------------------------------------------------------
    def can_rollback(self, seq: int) -> int:
        n = self.kv.seq_len(seq)
        floor = self.floor.get(seq, 0)
        return n if floor <= 0 else max(0, n - (floor + self.window - 1))

    def truncate(self, seq: int, p: int) -> None:
        n = self.kv.seq_len(seq)
        if 0 < p < n and p < self.floor.get(seq, 0) + self.window - 1:
            raise RollbackError(
                f"sequence {seq}: cannot truncate to position {p}: the sliding-window cache holds positions "
                f"from {self.floor[seq]} only (window {self.window}); the full cache (swa_full=True) can")
        self.kv.truncate(seq, p)
        self.kv_swa.truncate(seq, p)
        if p <= 0:
            self.floor.pop(seq, None)

    def remove_seq(self, seq: int) -> None:
        self.truncate(seq, 0)

    def clear(self) -> None:
        self.kv.clear()
        self.kv_swa.clear()
        self.floor.clear()

    def seq_len(self, seq: int) -> int:
        return self.kv.seq_len(seq)
