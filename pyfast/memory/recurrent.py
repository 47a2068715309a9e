"""Recurrent memory with snapshot planes: conv windows and Gated-DeltaNet states that roll back by
choosing a plane instead of copying (``algorithms.md`` §2.6).

Per recurrent layer two native buffers hold, for every sequence slot and every plane,

- the conv window ``[P, n_slot, Kc-1, C]`` (the last ``Kc-1`` conv inputs), and
- the GDN state ``[P, n_slot, Hv, S*S]`` (per head ``M[i][j]`` row-major, i over the key dim, j
  over the value dim; the op takes it 4-D since tensors have at most 4 dims),

with ``P = 1 + R`` planes. The graph ops (``ssm_conv``, ``gated_delta_net``) take a ``seqs`` input
of rows ``(t0, n_tokens, slot, src_plane)``: a segment reads its initial state from plane
``src_plane`` and writes plane ``i`` = the state ``i`` tokens before the segment's end, for
``i < min(n_tokens, P)``.

Python keeps per slot ``rs_idx`` (the plane the next batch reads), the tail position and the
number of tokens of the last batch. Rolling back ``r`` trailing tokens sets ``rs_idx += r``; the
next batch reads that plane and resets ``rs_idx`` to 0. Plane ``r`` holds a valid state only if
the last batch wrote it, i.e. ``rs_idx + r <= min(R, n_last - 1)`` (the op never writes plane
``n_last``: the state before the batch may already be overwritten).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyfast._loader import native


class RollbackError(ValueError):
    """The memory cannot remove the requested trailing tokens (snapshot planes exhausted):
    nothing was changed; restore a saved state (``save_state``) and replay instead."""


class NoFreeSlot(RuntimeError):
    """Every recurrent sequence slot is taken (raise ``n_seq_max``)."""


@dataclass(frozen=True)
class RecurrentGeometry:
    """Shapes of one recurrent (GDN) layer's state."""

    conv_kernel: int    # Kc: the conv window holds Kc-1 inputs
    conv_channels: int  # C: channels of the conv (q, k and v together)
    n_v_heads: int      # Hv
    state_size: int     # S: key and value head dim

    @property
    def conv_elems(self) -> int:
        return (self.conv_kernel - 1) * self.conv_channels

    @property
    def ssm_elems(self) -> int:
        return self.n_v_heads * self.state_size * self.state_size


@dataclass
class RecurrentState:
    """A host copy of one sequence's recurrent state (every recurrent layer), as of its tail."""

    n_tokens: int        # tail position + 1
    conv: np.ndarray     # [n_layer, Kc-1, C] float32
    ssm: np.ndarray      # [n_layer, Hv, S, S] float32


class RecurrentMemory:
    """Conv and GDN state planes for ``n_layer`` recurrent layers and ``n_slot`` sequences."""

    def __init__(self, n_layer: int, geom: RecurrentGeometry, n_slot: int = 4, n_rollback: int = 0, device=None):
        """device: an opened native Device; the planes then live in its memory, and the host
        views below are a mirror that save / restore / slot allocation sync explicitly."""
        if n_layer < 1:
            raise ValueError(f"RecurrentMemory needs at least one layer, got {n_layer}")
        if n_slot < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_slot}")
        if n_rollback < 0:
            raise ValueError(f"n_rollback must be >= 0, got {n_rollback}")
        if geom.conv_kernel < 2:
            raise ValueError(f"conv kernel must be >= 2, got {geom.conv_kernel}")
        self.n_layer = n_layer
        self.geom = geom
        self.n_slot = n_slot
        self.n_rollback = n_rollback
        self.n_planes = P = 1 + n_rollback
        g = geom
        self.conv_shape = (P, n_slot, g.conv_kernel - 1, g.conv_channels)
        self.ssm_shape = (P, n_slot, g.n_v_heads, g.state_size * g.state_size)  # the graph's view
        self.conv_layer_bytes = int(np.prod(self.conv_shape)) * 4
        self.ssm_layer_bytes = int(np.prod(self.ssm_shape)) * 4
        self.device = device
        self.conv_buf = native.Buffer(n_layer * self.conv_layer_bytes, device=device)
        self.ssm_buf = native.Buffer(n_layer * self.ssm_layer_bytes, device=device)
        # numpy views over the native buffers (save / restore / zeroing only; graphs use the buffers)
        self._conv = np.frombuffer(self.conv_buf, dtype=np.float32).reshape((n_layer,) + self.conv_shape)
        self._ssm = np.frombuffer(self.ssm_buf, dtype=np.float32).reshape(
            (n_layer, P, n_slot, g.n_v_heads, g.state_size, g.state_size))
        self._slot_of: dict[int, int] = {}
        self._free = list(range(n_slot - 1, -1, -1))  # pop() hands out the lowest slot first
        self.rs_idx = np.zeros(n_slot, dtype=np.int32)
        self.tail = np.full(n_slot, -1, dtype=np.int64)
        self.n_last = np.zeros(n_slot, dtype=np.int64)
        self._one_row = np.array([[0, 1, 0, 0]], dtype=np.int32)  # prepare_one's row (t0, n) = (0, 1), reused

    # --- slots -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.conv_buf.nbytes + self.ssm_buf.nbytes

    def has(self, seq: int) -> bool:
        return seq in self._slot_of

    def slot(self, seq: int) -> int:
        return self._slot_of[seq]

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def seqs(self) -> list[int]:
        return list(self._slot_of)

    def seq_tail(self, seq: int) -> int:
        """Last position stored for `seq`, -1 when it has none."""
        s = self._slot_of.get(seq)
        return -1 if s is None else int(self.tail[s])

    def _alloc(self, seq: int) -> int:
        if not self._free:
            raise NoFreeSlot(f"no free recurrent sequence slot for sequence {seq}: all {self.n_slot} are "
                             f"taken by sequences {sorted(self._slot_of)} (raise n_seq_max)")
        s = self._free.pop()
        self._slot_of[seq] = s
        self.rs_idx[s] = 0
        self.tail[s] = -1
        self.n_last[s] = 0
        self._conv[:, 0, s] = 0.0  # a new sequence starts from zero state (plane 0 is read first)
        self._ssm[:, 0, s] = 0.0
        self._sync(0, s, to_device=True)
        return s

    def _sync(self, plane: int, slot: int, to_device: bool) -> None:
        """On a device: copy one (plane, slot) block of every layer between the device and the
        host views (a no-op on the CPU, where the views are the state)."""
        if self.device is None:
            return
        P = self.n_planes
        for buf, view, layer_bytes in ((self.conv_buf, self._conv, self.conv_layer_bytes),
                                       (self.ssm_buf, self._ssm, self.ssm_layer_bytes)):
            blk = layer_bytes // (P * self.n_slot)
            for il in range(self.n_layer):
                off = il * layer_bytes + (plane * self.n_slot + slot) * blk
                (buf.to_device if to_device else buf.to_host)(off, blk)

    def free(self, seq: int) -> None:
        """Forget a sequence and release its slot (no-op when it has none)."""
        s = self._slot_of.pop(seq, None)
        if s is not None:
            self.rs_idx[s] = 0
            self.tail[s] = -1
            self.n_last[s] = 0
            self._free.append(s)
            self._free.sort(reverse=True)

    def clear(self) -> None:
        for seq in list(self._slot_of):
            self.free(seq)

    # --- per-batch input -------------------------------------------------------------------
    def check(self, segments: list[tuple[int, int, int]]) -> None:
        """Validate a logical batch before anything changes.

        segments: (seq, first position, n_tokens) per sequence of the batch (each sequence once,
        its positions consecutive). Raises ValueError when a sequence does not continue from its
        tail, NoFreeSlot when new sequences do not fit.
        """
        new = 0
        for seq, p0, n in segments:
            tail = self.seq_tail(seq)
            if p0 != tail + 1:
                raise ValueError(
                    f"sequence {seq}: positions {p0}..{p0 + n - 1} do not continue its recurrent state, "
                    f"which ends at position {tail} (the next position must be {tail + 1}; recurrent "
                    f"memory cannot skip or overwrite positions)")
            if seq not in self._slot_of:
                new += 1
        if new > len(self._free):
            raise NoFreeSlot(f"{new} new sequences but only {len(self._free)} free recurrent slots "
                             f"(n_seq_max={self.n_slot}; raise it)")

    def prepare(self, segments: list[tuple[int, int, int, int]]) -> np.ndarray:
        """Rows ``(t0, n_tokens, slot, src_plane)`` for one micro-batch and update the bookkeeping.

        segments: (seq, t0, n_tokens, first position) per contiguous run of a sequence's tokens in
        the micro-batch (a sequence at most once). Positions must continue from the tail.
        """
        out = np.empty((len(segments), 4), dtype=np.int32)
        for i, (seq, t0, n, p0) in enumerate(segments):
            s = self._slot_of.get(seq)
            tail = -1 if s is None else int(self.tail[s])
            if p0 != tail + 1:
                raise ValueError(
                    f"sequence {seq}: positions {p0}..{p0 + n - 1} do not continue its recurrent state, "
                    f"which ends at position {tail} (the next position must be {tail + 1})")
            if s is None:
                s = self._alloc(seq)
            out[i] = (t0, n, s, self.rs_idx[s])
            self.rs_idx[s] = 0
            self.tail[s] = tail + n
            self.n_last[s] = n
        return out

    def prepare_one(self, slot: int) -> np.ndarray:
        """prepare() of one token continuing the sequence that holds `slot` (the caller checked that
        its position is the slot's tail + 1): the row ``(0, 1, slot, src_plane)`` in a buffer reused
        by the next call, and the same bookkeeping."""
        row = self._one_row
        row[0, 2] = slot
        row[0, 3] = self.rs_idx[slot]
        self.rs_idx[slot] = 0
        self.tail[slot] += 1
        self.n_last[slot] = 1
        return row

    # --- rollback --------------------------------------------------------------------------
    def can_rollback(self, seq: int) -> int:
        """How many trailing tokens of `seq` can be removed by choosing a plane now."""
        s = self._slot_of.get(seq)
        if s is None:
            return 0
        return max(0, int(min(self.n_rollback, self.n_last[s] - 1)) - int(self.rs_idx[s]))

    def rollback(self, seq: int, p0: int) -> bool:
        """Remove positions >= p0 of `seq` by selecting a snapshot plane; False (nothing changed)
        when the planes do not reach that far back. r = 0 (nothing to remove) succeeds."""
        s = self._slot_of.get(seq)
        if s is None:
            return p0 >= 0
        r = int(self.tail[s]) - p0 + 1
        if r <= 0:
            return True
        if r > self.can_rollback(seq):
            return False
        self.rs_idx[s] += r
        self.tail[s] = p0 - 1
        return True

    # --- save / restore --------------------------------------------------------------------
    def save(self, seq: int) -> RecurrentState:
        """A host copy of the state at the sequence's tail (read through rs_idx)."""
        s = self._slot_of.get(seq)
        if s is None:
            raise KeyError(f"sequence {seq} has no recurrent state")
        p = int(self.rs_idx[s])
        self._sync(p, s, to_device=False)
        return RecurrentState(n_tokens=int(self.tail[s]) + 1, conv=self._conv[:, p, s].copy(),
                              ssm=self._ssm[:, p, s].copy())

    def restore(self, seq: int, state: RecurrentState) -> None:
        """Write a saved state into plane 0 of the sequence's slot (allocated when needed)."""
        want_c = (self.n_layer,) + self.conv_shape[2:]
        want_s = (self.n_layer,) + self._ssm.shape[3:]
        if tuple(state.conv.shape) != want_c or tuple(state.ssm.shape) != want_s:
            raise ValueError(f"recurrent state of shapes {tuple(state.conv.shape)} / {tuple(state.ssm.shape)} "
                             f"does not fit this memory ({want_c} / {want_s})")
        s = self._slot_of.get(seq)
        if s is None:
            s = self._alloc(seq)
        self._conv[:, 0, s] = state.conv
        self._ssm[:, 0, s] = state.ssm
        self._sync(0, s, to_device=True)
        self.rs_idx[s] = 0
        self.tail[s] = state.n_tokens - 1
        self.n_last[s] = 0  # the other planes are stale: no rollback until the next batch
