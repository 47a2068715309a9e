"""Memory of hybrid models: a KV cache for the attention layers plus recurrent state planes for the
recurrent layers, behind one interface (prepare, truncate, can_rollback, save/restore, remove).

A truncation either succeeds in both parts or changes nothing: the recurrent part is asked first
(it can only go back as far as its snapshot planes reach) and a refusal raises ``RollbackError``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyfast.memory.kv_cache import BatchSlots, KVCache, KVRows
from pyfast.memory.recurrent import RecurrentMemory, RecurrentState, RollbackError

__all__ = ["HybridMemory", "SeqState", "RollbackError", "plan_ubatches"]


@dataclass
class SeqState:
    """A saved sequence: its length, its KV rows (None: not saved, the cache is truncated to
    n_tokens on restore instead) and its recurrent state."""

    seq: int
    n_tokens: int
    kv: KVRows | None
    rec: RecurrentState | None


class HybridMemory:
    def __init__(self, kv: KVCache, rec: RecurrentMemory):
        self.kv = kv
        self.rec = rec

    # --- bookkeeping -----------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return self.kv.n_used

    @property
    def n_rollback(self) -> int:
        return self.rec.n_rollback

    def seq_len(self, seq: int) -> int:
        return max(self.kv.seq_len(seq), self.rec.seq_tail(seq) + 1)

    def seq_pos_max(self, seq: int) -> int:
        return self.seq_len(seq) - 1

    def check(self, segments: list[tuple[int, int, int]]) -> None:
        """Validate a logical batch ((seq, first position, n_tokens) per sequence) up front."""
        self.rec.check(segments)

    def prepare(self, seq_ids: np.ndarray, positions: np.ndarray,
                segments: list[tuple[int, int, int, int]]) -> tuple[BatchSlots, np.ndarray]:
        """KV slots and the recurrent ``seqs`` rows of one micro-batch (rows grouped by sequence)."""
        seqs = self.rec.prepare(segments)
        return self.kv.prepare(seq_ids, positions), seqs

    # --- rollback --------------------------------------------------------------------------
    def can_rollback(self, seq: int) -> int:
        """How many trailing tokens of `seq` can be removed now (removing all of them, i.e.
        ``truncate(seq, 0)``, always works)."""
        if not self.rec.has(seq):
            return self.kv.seq_len(seq)
        return self.rec.can_rollback(seq)

    def truncate(self, seq: int, p: int) -> None:
        """Remove positions >= p of `seq`; RollbackError (nothing changed) when the recurrent
        state cannot go back that far."""
        if p <= 0:
            self.remove_seq(seq)
            return
        if not self.rec.rollback(seq, p):
            tail = self.rec.seq_tail(seq)
            raise RollbackError(
                f"sequence {seq}: cannot remove positions {p}..{tail} ({tail - p + 1} tokens) from recurrent "
                f"state: only {self.rec.can_rollback(seq)} can be rolled back now (n_rollback={self.rec.n_rollback}, "
                f"and only within the last batch); save the state before and restore it instead")
        self.kv.truncate(seq, p)

    def remove_seq(self, seq: int) -> None:
        self.kv.remove_seq(seq)
        self.rec.free(seq)

    def clear(self) -> None:
        self.kv.clear()
        self.rec.clear()

    # --- save / restore --------------------------------------------------------------------
    def save_state(self, seq: int, kv: bool = True) -> SeqState:
        """A host copy of sequence `seq`: its KV rows (unless kv=False) and its recurrent state as
        of its tail (through the rolled-back plane, if any)."""
        rec = self.rec.save(seq) if self.rec.has(seq) else None
        n = self.seq_len(seq)
        return SeqState(seq=seq, n_tokens=n, kv=self.kv.save_seq(seq) if kv else None, rec=rec)

    def restore_state(self, seq: int, state: SeqState) -> None:
        """Make `seq` hold a saved state (from this memory or another of the same model). Other
        sequences are untouched. A state saved with kv=False needs this memory's KV rows of `seq`
        to still cover its length (they are truncated to it)."""
        if state.kv is not None:
            self.kv.restore_seq(seq, state.kv)
        else:
            have = self.kv.seq_len(seq)
            if have < state.n_tokens:
                raise ValueError(f"sequence {seq}: the state holds {state.n_tokens} tokens but no KV rows, and "
                                 f"the cache has only {have} of them")
            self.kv.truncate(seq, state.n_tokens)
        if state.rec is None:
            self.rec.free(seq)
        else:
            self.rec.restore(seq, state.rec)


def plan_ubatches(lengths: list[int], n_ubatch: int, n_keep: int) -> list[list[tuple[int, int, int]]]:
    """Split a logical batch (sequence runs of the given lengths, in order) into micro-batches of at
    most n_ubatch tokens such that each run's last ``min(len, n_keep)`` tokens stay in one
    micro-batch (snapshot planes must come from one op call). Returns, per micro-batch, pieces
    (run index, offset in the run, count); a run appears at most once per micro-batch.
    """
    if n_keep > n_ubatch:
        raise ValueError(f"n_ubatch ({n_ubatch}) must be >= n_rollback + 1 ({n_keep})")
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = n_ubatch

    def put(i, off, n):
        nonlocal room
        if cur and cur[-1][0] == i:
            j, o, m = cur[-1]
            cur[-1] = (j, o, m + n)
        else:
            cur.append((i, off, n))
        room -= n

    for i, n in enumerate(lengths):
        tail = min(n, max(n_keep, 1))
        head = n - tail
        off = 0
        while head > 0:
            if room == 0:
                out.append(cur)
                cur, room = [], n_ubatch
            take = min(head, room)
            put(i, off, take)
            off += take
            head -= take
        if tail > room:
            out.append(cur)
            cur, room = [], n_ubatch
        put(i, off, tail)
    if cur:
        out.append(cur)
    return out
