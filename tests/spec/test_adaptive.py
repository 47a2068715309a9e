"""The adaptive draft-length controller: cost model and per-position acceptance (no model)."""
from __future__ import annotations

import types

import numpy as np

from pyfast.spec.adaptive import AdaptiveController, CostModel


def fixed_cost(t_max: int, c1: float, per_row: float) -> CostModel:
    cm = CostModel(ctx=None, t_max=t_max)
    T = np.arange(t_max + 1)
    cm.cost = c1 + per_row * np.maximum(T - 1, 0)
    return cm


def test_expensive_rows_and_poor_acceptance_mean_no_draft():
    ad = AdaptiveController(fixed_cost(20, 1.0, 1.0), n_max=16)  # every row costs a full decode
    st: dict = {}
    assert ad.choose(st, "p", 16) == 0
    cheap = AdaptiveController(fixed_cost(20, 1.0, 0.3), n_max=16)
    st = {}
    assert cheap.choose(st, "p", 16) > 0        # optimistic before any data
    for _ in range(10):
        cheap.update(st, "p", 4, 0)
    assert cheap.choose(st, "p", 16) == 0


def test_high_acceptance_grows_the_draft_and_unseen_positions_inherit():
    ad = AdaptiveController(fixed_cost(20, 1.0, 0.1), n_max=16)
    st: dict = {}
    first = ad.choose(st, "p", 16)
    assert 1 <= first < 16
    for _ in range(8):
        n = ad.choose(st, "p", 16)
        ad.update(st, "p", n, n)  # everything accepted
    a = ad.estimate(st, "p")
    assert a[12] > 0.9            # never drafted that far, inherits the acceptance before it
    assert ad.choose(st, "p", 16) == 16


def test_rejections_at_a_position_cap_the_length():
    ad = AdaptiveController(fixed_cost(20, 1.0, 0.15), n_max=16)
    st: dict = {}
    for _ in range(30):
        ad.update(st, "p", 8, 3)  # always 3 accepted, the 4th rejected
    a = ad.estimate(st, "p")
    assert a[:3].min() > 0.9 and a[3] < 0.2
    assert ad.choose(st, "p", 16) == 3


def test_held_back_proposer_is_probed_again_later():
    cm = CostModel(ctx=None, t_max=20)                        # 2 rows cost 2.2 x 1 row
    cm.cost = np.array([1.0, 1.0] + [2.2 + 0.4 * (t - 2) for t in range(2, 21)])
    ad = AdaptiveController(cm, n_max=8)
    others: dict = {}
    for _ in range(50):
        ad.update(others, "p", 8, 8)  # other sequences: this proposer does well
    st: dict = {}
    for _ in range(4):
        ad.update(st, "p", 8, 0)      # this one: it failed lately
    assert ad.choose(st, "p", 8) == 0
    n_rounds = 0
    while ad.choose(st, "p", 8) == 0:
        n_rounds += 1
        assert n_rounds < 500
    assert n_rounds > 5
    # a proposer that never worked anywhere stays held back
    bad = AdaptiveController(cm, n_max=8)
    st = {}
    for _ in range(4):
        bad.update(st, "p", 4, 0)
    assert all(bad.choose(st, "p", 8) == 0 for _ in range(300))


def test_batch_rows_of_other_sequences_make_drafts_relatively_cheaper():
    cm = CostModel(ctx=None, t_max=20)
    cm.cost = np.array([1.0, 1.0] + [2.0 + 0.1 * t for t in range(2, 21)])  # a jump from 1 to 2 rows
    ad = AdaptiveController(cm, n_max=8)
    st: dict = {}
    for _ in range(5):
        ad.update(st, "p", 2, 1)
    st = {k: v.copy() for k, v in st.items()}
    assert ad.choose({k: v.copy() for k, v in st.items()}, "p", 8, n_rows=1) == 0  # alone: the jump to 2 rows does not pay
    assert ad.choose({k: v.copy() for k, v in st.items()}, "p", 8, n_rows=3) >= 1  # batch paid for


def test_calibration_is_monotone_and_bounded():
    calls = []

    def decode(toks, positions, seq_ids, logits):
        calls.append(len(toks))
        return np.zeros((len(toks), 4), dtype=np.float32)

    ctx = types.SimpleNamespace(n_ctx=64, kv=types.SimpleNamespace(n_used=0),
                                model=types.SimpleNamespace(n_vocab=100), decode=decode,
                                truncate=lambda seq, p: None)
    cm = CostModel(ctx, t_max=10)
    c = cm.calibrate(reps=2)
    assert c.shape == (11,) and np.all(np.diff(c[1:]) >= 0)
    assert np.all(c[1:] <= np.arange(1, 11) * c[1] + 1e-12)
    assert max(calls) == 10
    assert float(cm(15)) >= float(cm(10))


def test_choose_is_the_argmax_of_expected_tokens_per_second():
    """choose() against the definition computed from estimate() with numpy: E(N) = 1 + sum of the
    cumulative products of the per-position acceptance, divided by c(n_rows + N), first maximum."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        cm = CostModel(ctx=None, t_max=24)
        c = np.cumsum(rng.uniform(0.05, 1.0, 25))
        cm.cost = np.maximum.accumulate(np.concatenate([[c[1]], c[1:]]))
        ad = AdaptiveController(cm, n_max=16, priors={"p:x": float(rng.uniform(0.1, 0.95))})
        st: dict = {}
        for _ in range(int(rng.integers(0, 12))):
            d = int(rng.integers(1, 17))
            ad.update(st, "p:x", d, int(rng.integers(0, d + 1)))
        cap, n_rows = int(rng.integers(1, 17)), int(rng.integers(1, 4))
        hit, seen = st["p:x"] if "p:x" in st else np.zeros((2, 16))
        g = ad._global("p:x")
        prev, a = (g[0, 0] + 2.0 * ad.priors["p:x"]) / (g[1, 0] + 2.0), np.empty(16)
        for i in range(16):  # the recurrence, written out independently of the controller
            prev = a[i] = (hit[i] + ad.pseudo * prev) / (seen[i] + ad.pseudo)
        assert np.array_equal(ad.estimate(st, "p:x"), a)
        a = a[:cap]
        gain = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(a))])
        want = int(np.argmax((gain + (n_rows - 1)) / cm(n_rows + np.arange(cap + 1))))
        assert ad.choose(st, "p:x", cap, n_rows) == want, trial
