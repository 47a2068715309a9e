"""The verifier on hand-made logits: greedy rule, sampling rule, rejection sampling bookkeeping,
statistics invariants. No model needed."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.sampling import Sampler, SamplingParams
from pyfast.spec.stats import SpecStats
from pyfast.spec.verify import BONUS, RECOVERED, verify

V = 32


def onehot_rows(ids, v=V, hi=10.0):
    rows = np.zeros((len(ids), v), dtype=np.float32)
    rows[np.arange(len(ids)), ids] = hi
    return rows


def greedy(**kw):
    return Sampler(SamplingParams(temperature=0.0, **kw), V)


def test_greedy_accepts_prefix_then_recovers():
    rows = onehot_rows([5, 6, 7, 8])              # target argmax after id_last, d1, d2, d3
    res = verify(rows, np.array([5, 6, 9]), greedy(), np.array([1, 2]))
    assert (res.tokens, res.n_accepted, res.kind) == ([5, 6, 7], 2, RECOVERED)
    res = verify(rows, np.array([4, 6, 7]), greedy(), np.array([1, 2]))
    assert (res.tokens, res.n_accepted, res.kind) == ([5], 0, RECOVERED)


def test_greedy_all_accepted_gets_bonus_and_empty_draft_is_plain():
    rows = onehot_rows([5, 6, 7])
    res = verify(rows, np.array([5, 6]), greedy(), np.array([1]))
    assert (res.tokens, res.n_accepted, res.kind) == ([5, 6, 7], 2, BONUS)
    res = verify(rows[:1], np.zeros(0, dtype=np.int32), greedy(), np.array([1]))
    assert (res.tokens, res.n_accepted) == ([5], 0)


def test_greedy_ties_take_lowest_id_like_sampler():
    rows = np.zeros((2, V), dtype=np.float32)
    rows[:, [3, 9]] = 1.0
    res = verify(rows, np.array([9]), greedy(), np.array([0]))
    assert res.tokens == [3] and res.n_accepted == 0


def test_greedy_with_penalty_uses_history_extended_by_draft():
    # row 1's best token (4) is the draft token d1 itself; the repeat penalty sees d1 in its
    # history and makes 2 win, exactly as plain decoding would after emitting d1
    rows = np.zeros((2, V), dtype=np.float32)
    rows[0, 4] = 5.0
    rows[1, 4], rows[1, 2] = 5.0, 4.0
    s = greedy(repeat_penalty=2.0, repeat_last_n=64)
    res = verify(rows, np.array([4]), s, np.array([1]))
    assert res.tokens == [4, 2] and res.n_accepted == 1
    plain1 = s.sample(rows[0], [1])
    plain2 = s.sample(rows[1], [1, plain1])
    assert res.tokens == [plain1, plain2]


def test_wrong_row_count_is_an_error():
    with pytest.raises(ValueError, match="logit rows"):
        verify(onehot_rows([1, 2]), np.array([1, 2]), greedy(), np.array([0]))


def test_sampling_without_q_stops_at_first_mismatch():
    # a deterministic "sampler": one token holds all the mass after top-k=1
    s = Sampler(SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, seed=1), V)
    rows = onehot_rows([5, 6, 7, 8])
    res = verify(rows, np.array([5, 6, 0]), s, np.array([1]))
    assert (res.tokens, res.n_accepted, res.kind) == ([5, 6, 7], 2, RECOVERED)
    res = verify(rows, np.array([5, 6, 7]), s, np.array([1]))
    assert (res.tokens, res.kind) == ([5, 6, 7, 8], BONUS)


def test_rejection_sampling_accepts_when_p_ge_q_and_never_recovers_the_rejected_token():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3), 4)
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32))
    p = s.probs(logits[0])
    q_low = np.array([[0.1, 0.3, 0.3, 0.3]])     # q(0) < p(0): always accepted
    for _ in range(50):
        res = verify(logits, np.array([0]), s, np.array([1]), q_low)
        assert res.n_accepted == 1 and res.kind == BONUS
    q_high = np.array([[0.0, 0.9, 0.05, 0.05]])  # q(1) = 0.9 > p(1) = 0.3: accepted 1/3 of the time
    n_acc, rec = 0, []
    for _ in range(3000):
        res = verify(logits, np.array([1]), s, np.array([1]), q_high)
        if res.n_accepted:
            n_acc += 1
        else:
            rec.append(res.tokens[0])
    assert abs(n_acc / 3000 - p[1] / 0.9) < 0.04
    # residual max(0, p - q) = [0.5, 0, 0.05, 0.05]: never token 1
    assert 1 not in rec and set(rec) <= {0, 2, 3}


def test_bad_draft_probability_shape_is_an_error():
    s = Sampler(SamplingParams(temperature=1.0, seed=0), V)
    with pytest.raises(ValueError, match="draft probabilities"):
        verify(onehot_rows([1, 2]), np.array([1]), s, np.array([0]), np.ones((1, V + 1)))


def test_stats_invariants_and_merge():
    st = SpecStats()
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 8))
        k = int(rng.integers(0, n + 1))
        st.record_round("x" if n else None, n, k)
    assert st.accepted <= st.drafted
    h = st.pos_accepted
    assert all(a >= b for a, b in zip(h, h[1:]))
    assert all(a <= d for a, d in zip(st.pos_accepted, st.pos_drafted))
    assert st.recovered + st.bonus == st.draft_rounds
    assert st.n_tokens == st.accepted + st.steps
    total = SpecStats().merge(st).merge(st)
    assert total.drafted == 2 * st.drafted and total.pos_accepted == [2 * a for a in st.pos_accepted]
    d = st.to_dict()
    assert d["acceptance"] == pytest.approx(st.accepted / st.drafted)
    assert "accepted per position" in st.summary()


def test_greedy_with_the_plans_argmax_equals_scanning_the_rows():
    """verify(..., argmax=) (the plan's argmax of every row) gives what scanning the rows gives,
    for drafts that match up to every position, with or without penalties (which must ignore it)."""
    rng = np.random.default_rng(4)
    for trial in range(200):
        n = int(rng.integers(0, 8))
        rows = rng.standard_normal((n + 1, V)).astype(np.float32)
        am = rows.argmax(axis=1).astype(np.int32)
        k = int(rng.integers(0, n + 1))
        draft = np.concatenate([am[:k], (am[k:n] + 1) % V]).astype(np.int32)
        hist = rng.integers(0, V, size=5)
        for kw in ({}, {"repeat_penalty": 1.3}):
            a = verify(rows, draft, greedy(**kw), hist)
            b = verify(rows, draft, greedy(**kw), hist, None, am)
            assert (a.tokens, a.n_accepted, a.kind) == (b.tokens, b.n_accepted, b.kind), (trial, kw)
    # it is what greedy verification reads: a wrong argmax shows
    rows = onehot_rows([5, 6, 7])
    assert verify(rows, np.array([5, 6]), greedy(), np.array([1]), None, np.array([5, 9, 7], np.int32)).tokens == [5, 9]
