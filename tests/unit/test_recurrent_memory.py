"""Recurrent snapshot-plane memory, the hybrid memory and the micro-batch splitter, without a
model: bookkeeping (slots, rs_idx, tails), the rollback rules, save/restore through rs_idx, and
the rule that a sequence's last R+1 tokens of a batch stay in one micro-batch."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.memory.hybrid import HybridMemory, plan_ubatches
from pyfast.memory.kv_cache import KVCache
from pyfast.memory.recurrent import NoFreeSlot, RecurrentGeometry, RecurrentMemory, RollbackError

GEOM = RecurrentGeometry(conv_kernel=4, conv_channels=6, n_v_heads=2, state_size=3)


def mem(n_slot=3, R=3, n_layer=2):
    return RecurrentMemory(n_layer, GEOM, n_slot=n_slot, n_rollback=R)


def test_shapes_and_zeroed_buffers():
    m = mem()
    assert m.conv_shape == (4, 3, 3, 6)
    assert m.ssm_shape == (4, 3, 2, 9)
    assert m.conv_buf.nbytes == 2 * 4 * 3 * 3 * 6 * 4
    assert m.ssm_buf.nbytes == 2 * 4 * 3 * 2 * 3 * 3 * 4
    assert not m._conv.any() and not m._ssm.any()


def test_prepare_rows_and_bookkeeping():
    m = mem()
    rows = m.prepare([(7, 0, 5, 0), (9, 5, 2, 0)])
    assert rows.dtype == np.int32 and rows.shape == (2, 4)
    s7, s9 = m.slot(7), m.slot(9)
    assert s7 != s9
    assert rows.tolist() == [[0, 5, s7, 0], [5, 2, s9, 0]]
    assert m.seq_tail(7) == 4 and m.seq_tail(9) == 1
    assert m.can_rollback(7) == 3        # min(R=3, 5-1)
    assert m.can_rollback(9) == 1        # min(3, 2-1)
    assert m.rollback(7, 3)              # remove positions 3, 4
    assert m.rs_idx[s7] == 2 and m.seq_tail(7) == 2
    rows = m.prepare([(7, 0, 1, 3)])
    assert rows.tolist() == [[0, 1, s7, 2]]   # reads the rolled-back plane ...
    assert m.rs_idx[s7] == 0                  # ... and the next write lands in plane 0 again
    assert m.seq_tail(7) == 3 and m.n_last[s7] == 1


def test_positions_must_continue_from_the_tail():
    m = mem()
    m.prepare([(1, 0, 3, 0)])
    with pytest.raises(ValueError, match=r"sequence 1: positions 4\.\.5 .*ends at position 2"):
        m.check([(1, 4, 2)])
    with pytest.raises(ValueError, match="sequence 1"):
        m.prepare([(1, 0, 1, 2)])         # overwriting a stored position
    with pytest.raises(ValueError, match="sequence 5: positions 3"):
        m.check([(5, 3, 1)])              # a new sequence starts at 0
    assert m.seq_tail(1) == 2             # nothing changed


@pytest.mark.parametrize("R", [0, 1, 3])
def test_rollback_rules(R):
    m = mem(R=R)
    m.prepare([(0, 0, 5, 0)])             # tail 4, last batch 5 tokens
    lim = min(R, 4)
    assert m.can_rollback(0) == lim
    assert m.rollback(0, 5)               # r = 0: nothing to remove
    assert m.rollback(0, 99)              # r < 0 as well
    assert not m.rollback(0, 4 - lim)     # r = lim + 1: too far
    assert m.seq_tail(0) == 4 and m.rs_idx[m.slot(0)] == 0
    for r in range(1, lim + 1):           # one step at a time: planes accumulate
        assert m.rollback(0, 5 - r)
        assert m.rs_idx[m.slot(0)] == r and m.seq_tail(0) == 4 - r
    assert m.can_rollback(0) == 0
    assert not m.rollback(0, 4 - lim)


def test_rollback_limited_by_last_batch():
    m = mem(R=3)
    m.prepare([(0, 0, 6, 0)])
    m.prepare([(0, 0, 2, 6)])             # last batch: 2 tokens -> only 1 can be rolled back
    assert m.can_rollback(0) == 1
    assert not m.rollback(0, 6)           # the whole last batch: plane 2 was never written
    assert m.rollback(0, 7)
    m.prepare([(0, 0, 1, 7)])
    assert m.can_rollback(0) == 0         # a 1-token batch leaves nothing to roll back


def test_save_reads_through_rs_idx_and_restore_resets():
    m = mem(R=3)
    m.prepare([(4, 0, 4, 0)])
    s = m.slot(4)
    for p in range(4):                    # mark every plane
        m._conv[:, p, s] = 10 + p
        m._ssm[:, p, s] = 20 + p
    assert m.rollback(4, 2)               # r = 2
    st = m.save(4)
    assert st.n_tokens == 2
    assert (st.conv == 12).all() and (st.ssm == 22).all()
    assert st.conv.shape == (2, 3, 6) and st.ssm.shape == (2, 2, 3, 3)
    m2 = mem(R=3)
    m2.prepare([(0, 0, 3, 0)])            # another sequence in the target memory
    m2.restore(4, st)
    s2 = m2.slot(4)
    assert m2.rs_idx[s2] == 0 and m2.seq_tail(4) == 1 and m2.can_rollback(4) == 0
    assert (m2._conv[:, 0, s2] == 12).all() and (m2._ssm[:, 0, s2] == 22).all()
    assert m2.prepare([(4, 0, 1, 2)]).tolist() == [[0, 1, s2, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        RecurrentMemory(3, GEOM, 2, 1).restore(4, st)


def test_slots_alloc_free_and_zeroing():
    m = mem(n_slot=2)
    m.prepare([(0, 0, 2, 0), (1, 2, 2, 0)])
    s0 = m.slot(0)
    m._conv[:, 0, s0] = 5.0
    m._ssm[:, 0, s0] = 5.0
    with pytest.raises(NoFreeSlot, match="n_seq_max"):
        m.check([(2, 0, 1)])
    with pytest.raises(NoFreeSlot):
        m.prepare([(2, 0, 1, 0)])
    m.free(0)
    assert not m.has(0) and m.n_free == 1
    m.prepare([(2, 0, 1, 0)])
    assert m.slot(2) == s0
    assert not m._conv[:, 0, s0].any() and not m._ssm[:, 0, s0].any()   # a new sequence starts at zero
    m.clear()
    assert m.n_free == 2 and m.seqs == []


def test_plan_ubatches_examples():
    assert plan_ubatches([10], 4, 1) == [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2)]]
    # the last 3 tokens of a run stay together: [4 | 3 + 1 of the next | ...]
    assert plan_ubatches([7, 2], 4, 3) == [[(0, 0, 4)], [(0, 4, 3)], [(1, 0, 2)]]
    assert plan_ubatches([3, 3], 4, 3) == [[(0, 0, 3)], [(1, 0, 3)]]
    assert plan_ubatches([1, 1, 1], 2, 1) == [[(0, 0, 1), (1, 0, 1)], [(2, 0, 1)]]
    with pytest.raises(ValueError, match="n_ubatch"):
        plan_ubatches([5], 3, 4)


@pytest.mark.parametrize("seed", range(40))
def test_plan_ubatches_never_splits_a_tail(seed):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(0, 6))
    n_ub = int(rng.integers(R + 1, R + 9))
    lengths = rng.integers(1, 25, size=int(rng.integers(1, 7))).tolist()
    ubs = plan_ubatches(lengths, n_ub, R + 1)
    covered = {i: 0 for i in range(len(lengths))}
    for ub in ubs:
        assert 0 < sum(n for _, _, n in ub) <= n_ub
        runs = [i for i, _, _ in ub]
        assert len(runs) == len(set(runs))                 # a run at most once per micro-batch
        for i, off, n in ub:
            assert off == covered[i]                       # in order, no gaps
            covered[i] += n
            end = off + n
            if end == lengths[i]:                          # the run's last piece holds its tail
                assert n >= min(lengths[i], R + 1)
    assert [covered[i] for i in range(len(lengths))] == lengths
    # runs come in order
    flat = [i for ub in ubs for i, _, _ in ub]
    assert flat == sorted(flat)


def _hybrid(R=2, n_ctx=32):
    kv = KVCache(1, n_ctx, 2, 4, native.DType.F32)
    return HybridMemory(kv, RecurrentMemory(2, GEOM, n_slot=3, n_rollback=R))


def _run(h, seq, p0, n):
    seqs = np.full(n, seq, dtype=np.int32)
    pos = np.arange(p0, p0 + n, dtype=np.int32)
    h.check([(seq, p0, n)])
    return h.prepare(seqs, pos, [(seq, 0, n, p0)])


def test_hybrid_truncate_is_all_or_nothing():
    h = _hybrid(R=2)
    _run(h, 0, 0, 6)
    _run(h, 1, 0, 3)
    assert h.seq_len(0) == 6 and h.n_used == 9
    assert h.can_rollback(0) == 2
    with pytest.raises(RollbackError, match="sequence 0"):
        h.truncate(0, 3)                                   # 3 tokens > R
    assert h.seq_len(0) == 6 and h.n_used == 9 and h.rec.rs_idx[h.rec.slot(0)] == 0
    h.truncate(0, 4)
    assert h.seq_len(0) == 4 and h.n_used == 7 and h.rec.rs_idx[h.rec.slot(0)] == 2
    assert isinstance(RollbackError("x"), ValueError)
    h.truncate(1, 0)                                       # removing everything always works
    assert not h.rec.has(1) and h.seq_len(1) == 0
    h.truncate(0, 50)                                      # nothing to remove
    assert h.seq_len(0) == 4


def test_hybrid_save_restore_roundtrip():
    h = _hybrid(R=2)
    _run(h, 0, 0, 5)
    kvk = np.frombuffer(h.kv.k, dtype=np.float32)
    kvk[:] = np.arange(kvk.size, dtype=np.float32)
    st = h.save_state(0)
    assert st.n_tokens == 5 and st.kv.pos.tolist() == [0, 1, 2, 3, 4]
    h2 = _hybrid(R=2)
    _run(h2, 3, 0, 7)                                      # another sequence already there
    h2.restore_state(0, st)
    assert h2.seq_len(0) == 5 and h2.seq_len(3) == 7
    st2 = h2.save_state(0)
    assert np.array_equal(st2.kv.k, st.kv.k) and np.array_equal(st2.kv.v, st.kv.v)
    assert np.array_equal(st2.rec.ssm, st.rec.ssm)
    # a recurrent-only state truncates the KV rows to its length on restore
    light = h.save_state(0, kv=False)
    _run(h, 0, 5, 2)
    h.restore_state(0, light)
    assert h.seq_len(0) == 5 and h.kv.seq_len(0) == 5
