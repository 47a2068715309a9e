"""A unified KV cache: cells with (sequence id, position), shared by all sequences.

K and V rows live in native host buffers that the graphs read and write through ops
(``set_rows`` and views); Python only tracks which cell holds which (sequence, position) and
builds the per-batch inputs: the write indices, the attention mask and the cell order.

Layout: per layer, head-major ``[n_head_kv, n_ctx, head_dim]``. Attention walks one KV head's
cells at a time, so each head's rows are contiguous: a 1-row SmolLM2 decode's attention ran
1.26x faster this way than with the cell-major ``[n_ctx, n_head_kv, head_dim]`` (2-core VM,
300 cells; docs/experiments.md, "Attention at 1 row waits on the K/V reads"). A token's K row
is written as n_head_kv rows, one per head (``head_rows``).

The cell order (cells sorted by position) makes attention reduce over a sequence's positions in
the same order wherever its cells happen to sit, which is what keeps decoding batch invariant
even after truncation frees cells in the middle of the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyfast._loader import native

KV_PAD = 256  # the visible cache length (n_kv) grows in steps of this many cells

# What a cache row may be stored as (llama.cpp's --cache-type-k / -v names). Q8_0 halves the bytes
# attention reads per cell (blocks of 32 along the head dim; a row is quantized when written).
CACHE_TYPES = {"f32": native.DType.F32, "f16": native.DType.F16, "q8_0": native.DType.Q8_0}


def cache_dtype(name: "str | native.DType", what: str = "cache type") -> "native.DType":
    """A cache type name (f32, f16, q8_0) or DType -> DType; a clear error for anything else."""
    if isinstance(name, native.DType):
        if name in CACHE_TYPES.values():
            return name
        raise ValueError(f"{what}: {name} is not supported (use one of {', '.join(CACHE_TYPES)})")
    dt = CACHE_TYPES.get(str(name).lower())
    if dt is None:
        raise ValueError(f"{what}: unknown type {name!r} (use one of {', '.join(CACHE_TYPES)})")
    return dt


class KVCacheFull(RuntimeError):
    """No free cells left for a batch."""


@dataclass
class BatchSlots:
    idx: np.ndarray    # [T] int32: the cell each token's K/V is written to
    mask: np.ndarray   # [T, n_kv] float32: 0 where the token may attend, -inf elsewhere
    order: np.ndarray  # [n_kv] int32: cells sorted by position (attention's reduction order)
    n_kv: int
    rows: np.ndarray   # [T * n_head_kv] int32: the cache rows written (the graphs' "kv_idx" input)


@dataclass
class KVRows:
    """A host copy of one sequence's K/V rows: positions and per-layer raw rows."""
    pos: np.ndarray  # [n] int32
    k: np.ndarray    # [n_layer, n, n_head_kv * k row bytes] uint8 (a cell's heads side by side)
    v: np.ndarray    # [n_layer, n, n_head_kv * v row bytes] uint8


class KVCache:
    """K/V storage for every attention layer plus the cell bookkeeping."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int,
                 dtype: "native.DType" = native.DType.F16, head_dim_v: int | None = None,
                 dtype_v: "native.DType | None" = None, device=None, v_in_k: bool = False):
        """device: an opened native Device; the rows then live in its memory (graphs on that device
        read and write them there) and save / restore copy them explicitly. v_in_k: a cell's value
        row is the first head_dim_v columns of its K row (MLA, whose value is the cached latent):
        no V storage is kept; it needs V stored as K (same type) and head_dim_v <= head_dim."""
        if n_ctx <= 0:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        self.n_layer = n_layer
        self.n_ctx = n_ctx
        self.n_head_kv = n_head_kv
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v or head_dim
        self.dtype = cache_dtype(dtype, "K cache type")        # K rows
        self.dtype_v = cache_dtype(dtype if dtype_v is None else dtype_v, "V cache type")
        # V inside K only where the stored values are the same (a different V type needs its own rows)
        self.v_in_k = bool(v_in_k) and self.dtype_v == self.dtype and self.head_dim_v <= head_dim
        for dt, d, what in ((self.dtype, head_dim, "K"), (self.dtype_v, self.head_dim_v, "V")):
            bs = native.dtype_block_size(dt)
            if d % bs:
                raise ValueError(f"{what} cache type {dt.name.lower()} needs a head dim that is a multiple of "
                                 f"{bs}; this model's is {d}")
        self.k_row_bytes = native.dtype_row_size(self.dtype, head_dim)  # one head of one cell
        self.v_row_bytes = 0 if self.v_in_k else native.dtype_row_size(self.dtype_v, self.head_dim_v)
        self.k_layer_bytes = n_head_kv * n_ctx * self.k_row_bytes
        self.v_layer_bytes = n_head_kv * n_ctx * self.v_row_bytes
        self.device = device
        self.k = native.Buffer(n_layer * self.k_layer_bytes, device=device)
        self.v = None if self.v_in_k else native.Buffer(n_layer * self.v_layer_bytes, device=device)
        self.cell_pos = np.full(n_ctx, -1, dtype=np.int32)
        self.cell_seq = np.full(n_ctx, -1, dtype=np.int32)
        self._used_top = 0  # one past the highest used cell
        # prepare_one's / prepare_run's reusable outputs (allocated on first use); the cell order
        # buffer is shared
        self._one_mask = self._order = self._run_mask = self._run_idx = None
        self._head_off = np.arange(n_head_kv, dtype=np.int32) * np.int32(n_ctx)  # row of cell 0, per head
        self._one_rows = np.empty(n_head_kv, dtype=np.int32)  # prepare_one's rows (reused)

    # --- bookkeeping -----------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.cell_pos[: self._used_top] >= 0))  # cells past it are free

    def free_cells(self, need: int) -> int:
        """min(need, free cells), counting the used ones only when the cells past the highest used
        one are not enough (the per-round check of the speculative loop)."""
        if self.n_ctx - self._used_top >= need:
            return need
        return min(need, self.n_ctx - self.n_used)

    def seq_pos_max(self, seq: int) -> int:
        """Largest position stored for `seq`, or -1 when it has none."""
        sel = self.cell_seq[: self._used_top] == seq
        return int(self.cell_pos[: self._used_top][sel].max()) if sel.any() else -1

    def seq_len(self, seq: int) -> int:
        return self.seq_pos_max(seq) + 1

    def truncate(self, seq: int, p: int) -> None:
        """Remove positions >= p of sequence `seq`."""
        self._used_top = native.kv_truncate(self.cell_pos, self.cell_seq, self._used_top, int(seq),
                                             min(max(int(p), 0), 2**31 - 1))

    def remove_seq(self, seq: int) -> None:
        self.truncate(seq, 0)

    def drop_before(self, seq: int, p: int) -> None:
        """Free the cells of `seq` at positions < p (a sliding-window cache's old cells)."""
        top = self._used_top
        sel = (self.cell_seq[:top] == seq) & (self.cell_pos[:top] >= 0) & (self.cell_pos[:top] < p)
        self.cell_pos[:top][sel] = -1
        self.cell_seq[:top][sel] = -1
        self._shrink()

    def clear(self) -> None:
        self.cell_pos[:] = -1
        self.cell_seq[:] = -1
        self._used_top = 0

    def can_rollback(self) -> float:
        """How many trailing tokens can be removed: any number for a KV cache."""
        return float("inf")

    def head_rows(self, idx: np.ndarray) -> np.ndarray:
        """The cache rows (layer-local, head-major) that a batch writing cells ``idx`` writes:
        int32 [T * n_head_kv], token-major (row h * n_ctx + idx[t] for token t, head h)."""
        return (idx.astype(np.int32, copy=False)[:, None] + self._head_off).reshape(-1)

    # --- per-sequence copies (state save / restore) ----------------------------------------
    def _rows(self, buf, row_bytes: int) -> np.ndarray:
        """[n_layer, n_head_kv, n_ctx, row_bytes] uint8 view of a cache buffer."""
        if buf is None:  # v_in_k: no V rows of their own
            return np.zeros((self.n_layer, self.n_head_kv, self.n_ctx, 0), dtype=np.uint8)
        return np.frombuffer(buf, dtype=np.uint8).reshape(self.n_layer, self.n_head_kv, self.n_ctx, row_bytes)

    def save_seq(self, seq: int) -> KVRows:
        """A host copy of every K/V row of `seq` (all layers), in position order."""
        cells = np.flatnonzero(self.cell_seq[: self._used_top] == seq)
        cells = cells[np.argsort(self.cell_pos[cells], kind="stable")]
        n = cells.size
        if self.device is not None:  # the device holds the rows
            self.k.to_host()
            if self.v is not None:
                self.v.to_host()
        # [n_layer, head, cell, bytes] -> [n_layer, cell, head * bytes]: a cell's heads side by side
        H = self.n_head_kv
        k = self._rows(self.k, self.k_row_bytes)[:, :, cells].transpose(0, 2, 1, 3).reshape(
            self.n_layer, n, H * self.k_row_bytes)
        v = self._rows(self.v, self.v_row_bytes)[:, :, cells].transpose(0, 2, 1, 3).reshape(
            self.n_layer, n, H * self.v_row_bytes)
        return KVRows(pos=self.cell_pos[cells].copy(), k=k, v=v)

    def restore_seq(self, seq: int, rows: KVRows) -> None:
        """Replace the rows of `seq` with a saved copy (into free cells; other sequences untouched)."""
        kr, vr = self._rows(self.k, self.k_row_bytes), self._rows(self.v, self.v_row_bytes)
        kb, vb = self.n_head_kv * self.k_row_bytes, self.n_head_kv * self.v_row_bytes
        if (rows.k.ndim != 3 or rows.v.ndim != 3 or rows.k.shape[0] != self.n_layer or rows.v.shape[0] != self.n_layer
                or rows.k.shape[2] != kb or rows.v.shape[2] != vb):
            raise ValueError(f"saved KV rows {rows.k.shape} / {rows.v.shape} do not fit this cache "
                             f"({self.n_layer} layers, rows of {kb} / {vb} bytes)")
        n = rows.pos.size
        mine = (self.cell_seq == seq) & (self.cell_pos >= 0)
        free = np.flatnonzero((self.cell_pos < 0) | mine)
        if free.size < n:
            raise KVCacheFull(f"KV cache is full: {self.n_ctx} cells, {self.n_used} used, "
                              f"{n} needed to restore sequence {seq}")
        self.cell_pos[mine] = -1
        self.cell_seq[mine] = -1
        idx = free[:n]
        H = self.n_head_kv
        if self.device is not None:  # bring the other rows up to date before writing them all back
            self.k.to_host()
            if self.v is not None:
                self.v.to_host()
        kr[:, :, idx] = rows.k.reshape(self.n_layer, n, H, self.k_row_bytes).transpose(0, 2, 1, 3)
        vr[:, :, idx] = rows.v.reshape(self.n_layer, n, H, self.v_row_bytes).transpose(0, 2, 1, 3)
        if self.device is not None:
            self.k.to_device()
            if self.v is not None:
                self.v.to_device()
        self.cell_pos[idx] = rows.pos
        self.cell_seq[idx] = seq
        if n:
            self._used_top = max(self._used_top, int(idx[-1]) + 1)
        self._shrink()

    def _shrink(self) -> None:
        """Lower _used_top past freed cells (every cell from it on is free)."""
        used = np.flatnonzero(self.cell_pos[: self._used_top] >= 0)
        self._used_top = int(used[-1]) + 1 if used.size else 0

    # --- per-batch inputs ------------------------------------------------------------------
    def prepare(self, seq_ids: np.ndarray, positions: np.ndarray) -> BatchSlots:
        """Allocate cells for a batch and build its write indices, mask and cell order.

        A (sequence, position) pair that is already stored is overwritten in place.
        """
        T = len(positions)
        keys = (seq_ids.astype(np.int64) << 32) | positions.astype(np.int64)
        if np.unique(keys).size != T:
            raise ValueError("a batch may not hold the same (sequence, position) twice")
        idx = np.full(T, -1, dtype=np.int32)
        top = self._used_top
        if top:
            live = np.flatnonzero(self.cell_pos[:top] >= 0)
            live_keys = (self.cell_seq[live].astype(np.int64) << 32) | self.cell_pos[live].astype(np.int64)
            hit = np.isin(keys, live_keys)
            if hit.any():  # overwrite pairs that are already stored, in their cells
                where = {int(k): int(c) for k, c in zip(live_keys, live)}
                for t in np.flatnonzero(hit).tolist():
                    idx[t] = where[int(keys[t])]
        need = np.flatnonzero(idx < 0)
        if need.size:
            free = np.flatnonzero(self.cell_pos < 0)
            if free.size < need.size:
                raise KVCacheFull(
                    f"KV cache is full: {self.n_ctx} cells, {self.n_used} used, {need.size} more needed")
            idx[need] = free[: need.size]
        self.cell_pos[idx] = positions
        self.cell_seq[idx] = seq_ids
        self._used_top = max(self._used_top, int(idx.max()) + 1) if T else self._used_top
        n_kv = min(self.n_ctx, -(-self._used_top // KV_PAD) * KV_PAD)
        cpos = self.cell_pos[:n_kv]
        cseq = self.cell_seq[:n_kv]
        allowed = (cseq[None, :] == seq_ids[:, None]) & (cpos[None, :] <= positions[:, None]) & (cpos[None, :] >= 0)
        mask = np.full(allowed.shape, -np.inf, dtype=np.float32)
        mask[allowed] = 0.0
        order = np.argsort(cpos, kind="stable").astype(np.int32)
        return BatchSlots(idx=idx, mask=mask, order=order, n_kv=n_kv, rows=self.head_rows(idx))

    def prepare_run(self, seq: int, pos0: int, n: int) -> BatchSlots:
        """prepare() for n consecutive positions pos0 .. pos0+n-1 of one sequence (a verify batch),
        done natively; like prepare_one, the result's arrays are reused by the next call."""
        if self._order is None:
            self._order = np.empty(self.n_ctx, dtype=np.int32)
        if self._run_mask is None or self._run_idx.size < n:
            m = max(n, 32)  # verify batches: a few dozen rows at most (Context.decode's run path)
            self._run_mask = np.empty(m * self.n_ctx, dtype=np.float32)
            self._run_idx = np.empty(m, dtype=np.int32)
        n_kv = native.kv_prepare_run(self.cell_pos, self.cell_seq, self._used_top, seq, pos0, n, KV_PAD,
                                     self._run_mask, self._order, self._run_idx)
        if n_kv < 0:
            raise KVCacheFull(f"KV cache is full: {self.n_ctx} cells, {self.n_used} used, {n} more needed")
        idx = self._run_idx[:n]
        self._used_top = max(self._used_top, int(idx.max()) + 1)
        return BatchSlots(idx=idx, mask=self._run_mask[: n * n_kv].reshape(n, n_kv),
                          order=self._order[:n_kv], n_kv=n_kv, rows=self.head_rows(idx))

    def prepare_one(self, seq: int, pos: int) -> BatchSlots:
        """prepare() for one token, done natively: the result's mask, order and rows are views into
        buffers reused by the next call, so use them before preparing another batch."""
        if self._one_mask is None:
            self._one_mask = np.empty(self.n_ctx, dtype=np.float32)
            if self._order is None:
                self._order = np.empty(self.n_ctx, dtype=np.int32)
        cell, n_kv = native.kv_prepare_one(self.cell_pos, self.cell_seq, self._used_top, seq, pos, KV_PAD,
                                           self._one_mask, self._order)
        if cell < 0:
            raise KVCacheFull(f"KV cache is full: {self.n_ctx} cells, {self.n_used} used, 1 more needed")
        self._used_top = max(self._used_top, cell + 1)
        return BatchSlots(idx=np.array([cell], dtype=np.int32), mask=self._one_mask[:n_kv].reshape(1, n_kv),
                          order=self._order[:n_kv], n_kv=n_kv,
                          rows=np.add(self._head_off, np.int32(cell), out=self._one_rows))
