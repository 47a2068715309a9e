"""KVCache.prepare_one (the native one-token bookkeeping of the generation step) must agree
exactly with the general numpy prepare(): same cell, mask, cell order and bookkeeping, including
overwrites of a stored position, truncation holes, several sequences and a full cache."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.memory.kv_cache import KVCache, KVCacheFull


def assert_same(a: KVCache, x, b: KVCache, y) -> None:
    """Batch slots x (from a) and y (from b) and the two caches' bookkeeping are identical."""
    assert x.n_kv == y.n_kv
    np.testing.assert_array_equal(x.idx, y.idx)
    np.testing.assert_array_equal(x.mask, y.mask)
    np.testing.assert_array_equal(x.order, y.order)
    np.testing.assert_array_equal(a.cell_pos, b.cell_pos)
    np.testing.assert_array_equal(a.cell_seq, b.cell_seq)
    assert a._used_top == b._used_top


def test_prepare_one_matches_prepare():
    rng = np.random.default_rng(0)
    n_full = 0
    for trial in range(300):
        n_ctx = int(rng.integers(1, 700))
        a = KVCache(1, n_ctx, 1, 8, native.DType.F32)
        b = KVCache(1, n_ctx, 1, 8, native.DType.F32)
        for step in range(int(rng.integers(1, 40))):
            if step and rng.random() < 0.2:
                s, p = int(rng.integers(0, 3)), int(rng.integers(0, 20))
                a.truncate(s, p)
                b.truncate(s, p)
                continue
            s, p = int(rng.integers(0, 3)), int(rng.integers(0, 30))
            try:
                x = a.prepare(np.array([s], np.int32), np.array([p], np.int32))
            except KVCacheFull:
                with pytest.raises(KVCacheFull):
                    b.prepare_one(s, p)
                n_full += 1
                continue
            assert_same(a, x, b, b.prepare_one(s, p))
    assert n_full > 0  # the full-cache branch was exercised


def test_prepare_run_matches_prepare():
    """prepare_run (a verify batch: n consecutive positions of one sequence, native) equals
    prepare() on the same batch, including runs that overlap stored positions and a full cache."""
    rng = np.random.default_rng(1)
    n_full = n_overlap = 0
    for trial in range(300):
        n_ctx = int(rng.integers(1, 700))
        a = KVCache(1, n_ctx, 1, 8, native.DType.F32)
        b = KVCache(1, n_ctx, 1, 8, native.DType.F32)
        for step in range(int(rng.integers(1, 30))):
            if step and rng.random() < 0.2:
                s, p = int(rng.integers(0, 3)), int(rng.integers(0, 40))
                a.truncate(s, p)
                b.truncate(s, p)
                continue
            s, p0, n = int(rng.integers(0, 3)), int(rng.integers(0, 40)), int(rng.integers(1, 18))
            seqs, pos = np.full(n, s, np.int32), np.arange(p0, p0 + n, dtype=np.int32)
            n_overlap += int(np.isin(pos, a.cell_pos[a.cell_seq == s]).any())
            try:
                x = a.prepare(seqs, pos)
            except KVCacheFull:
                with pytest.raises(KVCacheFull):
                    b.prepare_run(s, p0, n)
                np.testing.assert_array_equal(a.cell_pos, b.cell_pos)  # nothing written
                n_full += 1
                continue
            assert_same(a, x, b, b.prepare_run(s, p0, n))
    assert n_full > 0 and n_overlap > 0


def test_used_top_is_one_past_the_last_used_cell():
    """Every bookkeeping change (prepare, truncate, save / restore, remove) keeps _used_top equal
    to one past the highest used cell; truncate and _shrink only look below it."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        n_ctx = int(rng.integers(4, 300))
        c = KVCache(2, n_ctx, 1, 8, native.DType.F32)
        saved = {}
        for step in range(int(rng.integers(1, 30))):
            r = rng.random()
            s = int(rng.integers(0, 3))
            try:
                if r < 0.45:
                    p0 = c.seq_len(s)
                    n = int(rng.integers(1, 9))
                    c.prepare(np.full(n, s, np.int32), np.arange(p0, p0 + n, dtype=np.int32))
                elif r < 0.65:
                    c.truncate(s, int(rng.integers(0, 20)))
                elif r < 0.8:
                    saved[s] = c.save_seq(s)
                elif r < 0.95 and saved:
                    k = list(saved)[int(rng.integers(0, len(saved)))]
                    c.restore_seq(int(rng.integers(0, 3)), saved[k])
                else:
                    c.remove_seq(s)
            except KVCacheFull:
                pass
            used = np.flatnonzero(c.cell_pos >= 0)
            assert c._used_top == (int(used[-1]) + 1 if used.size else 0), (trial, step)
            assert np.all(c.cell_seq[c._used_top:] == -1)


def test_batch_rows_are_head_major():
    # The cache is head-major ([n_head_kv, n_ctx, head_dim] per layer): a token written to cell c
    # fills row h * n_ctx + c of every head h, token-major, whichever prepare path made the batch
    # (BatchSlots.rows is what every plan's "kv_idx" input gets).
    H, n_ctx = 3, 50
    c = KVCache(2, n_ctx, H, 8, native.DType.F32)
    c.prepare(np.array([0, 0, 1], np.int32), np.array([0, 1, 0], np.int32))
    c.truncate(0, 1)  # a hole at cell 1
    batches = [c.prepare(np.array([1, 0], np.int32), np.array([1, 1], np.int32)),
               c.prepare_one(2, 0), c.prepare_run(0, 2, 4)]
    for s in batches:
        want = [h * n_ctx + int(cell) for cell in s.idx for h in range(H)]
        assert s.rows.dtype == np.int32 and s.rows.tolist() == want
    assert batches[0].idx.tolist() == [1, 3]  # the hole is reused first
