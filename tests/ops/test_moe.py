"""MoE ops beyond the value cases: matmul_id is batch invariant and bit-identical to per-expert
matmul, topk / gather / sum rows do not depend on the batch, and a bad id at run time is an error
that leaves the plan usable."""
from __future__ import annotations

import numpy as np
import pytest

from .harness import (
    F32, I32, ISAS, K_QUANTS, Q8_0, QUANT, QUANT_ISAS, WEIGHT_TYPES, N, dname, encode, pool, run_matmul, using_isa,
)


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} elements differ (first flat index {diff[0]})"


def run_matmul_id(x, wraw, ids, dt, isa, n_threads):
    """y[t, j] = x[t(, j)] @ w[ids[t, j]].T with w an external [E, N, K] buffer of dt rows."""
    E, Nw = wraw.shape[0], wraw.shape[1]
    g = N.Graph()
    w = g.external("w", dt, [E, Nw, x.shape[-1]], wraw)
    g.output(g.matmul_id(g.input("x", F32, list(x.shape)), w, g.input("ids", I32, list(ids.shape))), "y")
    p = N.Plan(g, pool(n_threads))
    p.set_input("x", np.ascontiguousarray(x, np.float32))
    p.set_input("ids", np.ascontiguousarray(ids, np.int32))
    with using_isa(isa):
        p.run()
    return p.output("y")


def _data(dt, T=37, k=3, E=6, N_=33, seed=0):
    K = 512 if dt in K_QUANTS else 160 if dt in QUANT else 77
    rng = np.random.default_rng(200 + int(dt.value) + seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = encode(rng.standard_normal((E, N_, K)) * 0.2, dt)
    # Skewed routing: expert 0 gets > 64 rows (two row tiles), expert E-1 none, repeats within rows.
    ids = rng.integers(1, E - 1, (T, k)).astype(np.int32)
    ids[: 2 * T // 3, 0] = 0
    ids[::5, 1] = ids[::5, 0]
    return x, w, ids


def _isas(dt):
    return QUANT_ISAS if dt in QUANT else ISAS


PARAMS = [(d, i) for d in WEIGHT_TYPES for i in _isas(d)]
IDS = [f"{dname(d)}-{i}" for d, i in PARAMS]


@pytest.mark.parametrize("dt,isa", PARAMS, ids=IDS)
def test_matmul_id_equals_per_expert_matmul(dt, isa):
    """Every output row is bit-identical to the dense matmul of its activation row with its
    expert's weight (x 2-D and 3-D), on 1 and 3 threads."""
    x, w, ids = _data(dt)
    T, k = ids.shape
    E = w.shape[0]
    dense = {e: run_matmul(x, w[e], dt, isa, 1) for e in range(E)}
    for nt in (1, 3):
        y = run_matmul_id(x, w, ids, dt, isa, nt)
        for t in range(T):
            for j in range(k):
                _same(y[t, j], dense[ids[t, j]][t], f"{dname(dt)} {isa} t{nt}: row ({t}, {j})")
    # one row alone, as the single-row matmul sees it
    t = 5
    _same(run_matmul(x[t:t + 1], w[ids[t, 0]], dt, isa, 1)[0], y[t, 0], f"{dname(dt)} {isa}: alone")
    # 3-D x: one activation row per (token, slot)
    x3 = np.random.default_rng(7).standard_normal((T, k, x.shape[1])).astype(np.float32)
    y3 = run_matmul_id(x3, w, ids, dt, isa, 3)
    flat = x3.reshape(T * k, -1)
    dense3 = {e: run_matmul(flat, w[e], dt, isa, 1) for e in np.unique(ids)}
    for t in range(T):
        for j in range(k):
            _same(y3[t, j], dense3[ids[t, j]][t * k + j], f"{dname(dt)} {isa}: 3-D row ({t}, {j})")


@pytest.mark.parametrize("dt", WEIGHT_TYPES, ids=dname)
def test_matmul_id_rows_independent_of_batch(dt):
    """A token's rows do not depend on the other tokens, their routing, the batch size or order,
    or the thread count."""
    isa = ISAS[-1]
    x, w, ids = _data(dt)
    T = ids.shape[0]
    ref = run_matmul_id(x, w, ids, dt, isa, 1)
    for nt in (2, 3):
        _same(run_matmul_id(x, w, ids, dt, isa, nt), ref, f"{dname(dt)}: {nt} threads vs 1")
    for t in (0, 17, T - 1):
        _same(run_matmul_id(x[t:t + 1], w, ids[t:t + 1], dt, isa, 3)[0], ref[t], f"{dname(dt)}: token {t} alone")
    # other tokens replaced (new values, all routed to one expert) and the batch reversed
    rng = np.random.default_rng(9)
    x2, ids2 = x.copy(), ids.copy()
    keep = np.arange(T) % 4 == 1
    x2[~keep] = rng.standard_normal(x2[~keep].shape).astype(np.float32) * 3
    ids2[~keep] = w.shape[0] - 1
    y2 = run_matmul_id(x2[::-1], w, ids2[::-1], dt, isa, 3)[::-1]
    _same(y2[keep], ref[keep], f"{dname(dt)}: rows with other tokens changed")


def test_matmul_id_bad_id_then_good_run():
    """A bad id raises naming the op; the same plan (and its thread pool) then runs normally."""
    dt = Q8_0
    x, w, ids = _data(dt, T=9)
    g = N.Graph()
    we = g.external("w", dt, [w.shape[0], w.shape[1], x.shape[1]], w)
    g.output(g.matmul_id(g.input("x", F32, list(x.shape)), we, g.input("ids", I32, list(ids.shape))), "y")
    g.output(g.scale(g.input("z", F32, [4]), 2.0), "z2")
    p = N.Plan(g, pool(3))
    p.set_input("x", x)
    p.set_input("z", np.ones(4, np.float32))
    for bad in (w.shape[0], -1, 2**31 - 1):
        b = ids.copy()
        b[4, 1] = bad
        p.set_input("ids", b)
        with pytest.raises(ValueError, match=r"^\[matmul_id\] ids\[4, 1\]"):
            p.run()
    p.set_input("ids", ids)
    with using_isa(ISAS[-1]):
        p.run()
    _same(p.output("y"), run_matmul_id(x, w, ids, dt, ISAS[-1], 3), "after the error")
    assert np.array_equal(p.output("z2"), np.full(4, 2.0, np.float32))


def test_routing_ops_rows_independent_of_batch():
    """topk, gather and the k-sum of a token do not depend on the other tokens."""
    rng = np.random.default_rng(3)
    T, E, k, H = 33, 64, 8, 40
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top

    def run(lg, nt):
        g = N.Graph()
        a = g.input("a", F32, list(lg.shape))
        ids = g.topk(a, k)
        wts = g.gather(g.sigmoid(a), ids)
        h = g.input("h", F32, [lg.shape[0], k, H])
        comb = g.sum(g.mul(h, g.reshape(wts, [lg.shape[0], k, 1])), 1)
        g.output(ids, "ids")
        g.output(wts, "w")
        g.output(comb, "y")
        p = N.Plan(g, pool(nt))
        p.set_input("a", lg)
        p.set_input("h", np.tile(np.arange(k * H, dtype=np.float32).reshape(1, k, H) / 7, (lg.shape[0], 1, 1)))
        p.run()
        return p.output("ids"), p.output("w"), p.output("y")

    full = run(logits, 3)
    assert list(full[0][3][:2]) == [10, 20]
    for t in (0, 3, T - 1):
        alone = run(logits[t:t + 1], 1)
        for a, b, what in zip(alone, full, ("ids", "weights", "combined")):
            _same(a[0], b[t], f"{what} of token {t}")


@pytest.mark.parametrize("dt", [Q8_0, N.DType.Q4_K], ids=dname)
def test_matmul_id_small_batch_repeated_runs_on_three_threads(dt):
    """Decode-sized batches take their (expert, 16 weight rows) items from per-thread ranges that
    the other threads steal from, so which thread computes an item changes from run to run: each
    of many runs equals the one-thread result bit for bit (x 2-D and 3-D; the input alternates
    between two activations, so an item skipped or left half-done in a run shows)."""
    K = 512
    rng = np.random.default_rng(31)
    E, N_ = 9, 160  # 10 items of 16 rows per selected expert
    w = encode(rng.standard_normal((E, N_, K)) * 0.2, dt)
    for T, k, three_d in ((1, 4, False), (2, 3, True)):
        ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        xs = [rng.standard_normal((T, k, K) if three_d else (T, K)).astype(np.float32) for _ in range(2)]
        refs = [run_matmul_id(x, w, ids, dt, ISAS[-1], 1) for x in xs]
        g = N.Graph()
        we = g.external("w", dt, [E, N_, K], w)
        g.output(g.matmul_id(g.input("x", F32, list(xs[0].shape)), we, g.input("ids", I32, list(ids.shape))), "y")
        p = N.Plan(g, pool(3))
        p.set_input("ids", ids)
        with using_isa(ISAS[-1]):
            for r in range(60):
                p.set_input("x", xs[r % 2])
                p.run()
                _same(p.output("y"), refs[r % 2], f"{dname(dt)} T={T} run {r}")
