"""Batch invariance at op level (DESIGN §3): a row's result never depends on what else is in the
batch, how the work is split over threads, or (for attention) which other cells share the KV
buffer, given the same order of the row's own cells. Every check here is bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from .harness import (
    F16, F32, I32, Q4_1, Q4_K, Q8_0, ISAS, K_QUANTS, QUANT_ISAS, THREADS, WEIGHT_TYPES, N, QUANT, dname, encode, pool,
    run_matmul, using_isa,
)

# --------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------


def _mm_data(dt, M=65, N_=33):
    K = 512 if dt in K_QUANTS else 160 if dt in QUANT else 77
    rng = np.random.default_rng(100 + int(dt.value))
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x, encode(rng.standard_normal((N_, K)) * 0.2, dt)


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} elements differ (first flat index {diff[0]})"


def _isas(dt):
    return QUANT_ISAS if dt in QUANT else ISAS


@pytest.mark.parametrize("dt,isa", [(d, i) for d in WEIGHT_TYPES for i in _isas(d)],
                         ids=[f"{dname(d)}-{i}" for d in WEIGHT_TYPES for i in _isas(d)])
def test_matmul_row_alone_equals_row_in_batch(dt, isa):
    x, w = _mm_data(dt, M=73)
    # 9 and 17 rows: a last single row joins the pass before it (AVX-512, 32-block types)
    full = {M: run_matmul(x[:M], w, dt, isa, 1) for M in (5, 9, 17, 64, 65, 73)}
    for m in (0, 3, 4, 8, 16, 37, 63, 64, 72):
        alone = run_matmul(x[m:m + 1], w, dt, isa, 1)[0]
        for M, y in full.items():
            if m < M:
                _same(alone, y[m], f"{dname(dt)} {isa}: row {m} alone vs in M={M}")


@pytest.mark.parametrize("dt,isa", [(d, i) for d in WEIGHT_TYPES for i in _isas(d)],
                         ids=[f"{dname(d)}-{i}" for d in WEIGHT_TYPES for i in _isas(d)])
def test_matmul_threads_do_not_change_results(dt, isa):
    x, w = _mm_data(dt)
    ref = run_matmul(x, w, dt, isa, 1)
    for nt in THREADS[1:] + (2,):
        _same(run_matmul(x, w, dt, isa, nt), ref, f"{dname(dt)} {isa}: {nt} threads vs 1")
    _same(run_matmul(x[:1], w, dt, isa, 3)[0], ref[0], f"{dname(dt)} {isa}: M=1 with 3 threads")


@pytest.mark.parametrize("isa", QUANT_ISAS)
def test_fused_matmuls_equal_separate_ones(isa):
    """Consecutive matmuls of one activation tensor run as one kernel (the plan fuses them: q / k /
    v, gate / up); every output equals its own matmul's bit for bit, for short and long batches,
    mixed quantized types and thread counts, with a matmul of another tensor and a float weight
    in between breaking the runs, and the fused outputs feeding later ops."""
    rng = np.random.default_rng(5)
    K = 256
    specs = [(Q8_0, 48), (Q4_1, 16), (Q4_K, 33), (Q4_1, 7)]   # one run of four
    ws = [encode(rng.standard_normal((n, K)) * 0.2, dt) for dt, n in specs]
    wf = rng.standard_normal((9, K)).astype(np.float32)
    for M in (1, 4, 5, 17, 70):
        x = rng.standard_normal((M, K)).astype(np.float32)
        x2 = rng.standard_normal((M, K)).astype(np.float32)
        for nt in (1, 2, 3):
            g = N.Graph()
            xt, x2t = g.input("x", F32, [M, K]), g.input("x2", F32, [M, K])
            outs = [g.matmul(xt, g.external(f"w{i}", dt, [n, K], w)) for i, ((dt, n), w) in enumerate(zip(specs, ws))]
            other = g.matmul(x2t, g.external("w0b", specs[0][0], [specs[0][1], K], ws[0]))   # another x
            outs2 = [g.matmul(xt, g.external(f"v{i}", dt, [n, K], w)) for i, ((dt, n), w) in enumerate(zip(specs[:2], ws[:2]))]
            flt = g.matmul(xt, g.external("wf", F32, [9, K], wf))                           # float weight
            tail = g.matmul(xt, g.external("w3b", specs[3][0], [specs[3][1], K], ws[3]))
            for i, o in enumerate(outs + [other] + outs2 + [flt, tail]):
                g.output(o, f"o{i}")
            g.output(g.add(outs[1], outs2[1]), "sum")  # consumers of fused outputs
            p = N.Plan(g, pool(nt))
            p.set_input("x", x)
            p.set_input("x2", x2)
            with using_isa(isa):
                p.run()
            assert p.stats["n_kernels"] == 6, "the matmuls of x were not fused as expected"
            want = [run_matmul(x, w, dt, isa, 1) for (dt, _), w in zip(specs, ws)]
            want += [run_matmul(x2, ws[0], specs[0][0], isa, 1)]
            want += [run_matmul(x, w, dt, isa, 1) for (dt, _), w in zip(specs[:2], ws[:2])]
            want += [run_matmul(x, wf, F32, isa, 1), run_matmul(x, ws[3], specs[3][0], isa, 1)]
            for i, w_ in enumerate(want):
                _same(p.output(f"o{i}"), w_, f"{isa} M={M} threads={nt} output {i}")
            _same(p.output("sum"), (want[1] + want[6]).astype(np.float32), f"{isa} M={M} threads={nt} sum")


@pytest.mark.parametrize("dt", WEIGHT_TYPES, ids=dname)
def test_matmul_strided_and_batched_rows(dt):
    """Rows read through a strided view or a 3-D batch equal the same rows read contiguously."""
    x, w = _mm_data(dt, M=12)
    isa = ISAS[-1]
    ref = run_matmul(x, w, dt, isa, 3)
    K = x.shape[1]
    big = np.full((12, 2 * K), np.nan, np.float32)
    big[:, 5:5 + K] = x
    g = N.Graph()
    we = g.external("w", dt, [w.shape[0], K], w)
    xv = g.view(g.input("big", F32, [12, 2 * K]), [12, K], [2 * K * 4, 4], 5 * 4)
    g.output(g.matmul(xv, we), "strided")
    g.output(g.matmul(g.permute(g.input("xt", F32, [4, 3, K]), [1, 0, 2]), we), "batched")
    p = N.Plan(g, pool(3))
    p.set_input("big", big)
    p.set_input("xt", np.ascontiguousarray(x.reshape(3, 4, K).transpose(1, 0, 2)))
    with using_isa(isa):
        p.run()
    _same(p.output("strided"), ref, "strided view")
    _same(p.output("batched").reshape(12, -1), ref, "3-D permuted batch")


@pytest.mark.parametrize("dt", tuple(QUANT), ids=dname)
def test_quant_matmul_identical_across_isas(dt):
    """quant.h: quantized results are bit-identical across scalar / avx2 (with and without
    AVX-VNNI) / avx512."""
    x, w = _mm_data(dt)
    ref = run_matmul(x, w, dt, "scalar", 1)
    for isa in QUANT_ISAS[1:]:
        _same(run_matmul(x, w, dt, isa, 3), ref, f"{dname(dt)}: {isa} vs scalar")


@pytest.mark.parametrize("dt", (F32, F16, N.DType.BF16), ids=dname)
def test_float_matmul_avx512_equals_scalar(dt):
    """quant.h: float weights use 16 lanes in both scalar and avx512 (bit-identical)."""
    if "avx512" not in ISAS:
        pytest.skip("no avx512 on this CPU")
    x, w = _mm_data(dt)
    _same(run_matmul(x, w, dt, "avx512", 3), run_matmul(x, w, dt, "scalar", 1), f"{dname(dt)}: avx512 vs scalar")


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

HQ, HKV, D = 4, 2, 64
N_OWN = 13   # cells of "our" sequence
T_OWN = 5    # our tokens: positions N_OWN - T_OWN .. N_OWN - 1 (causal)


def _attend(q, k, v, mask, order, kv_dt, isa, n_threads):
    g = N.Graph()
    T, n_kv = mask.shape
    qt = g.input("q", F32, [T, HQ, D])
    kt = g.input("k", kv_dt, [n_kv, HKV, D])
    vt = g.input("v", kv_dt, [n_kv, HKV, D])
    mt = g.input("mask", F32, [T, n_kv])
    ot = g.input("order", I32, [n_kv]) if order is not None else None
    g.output(g.attention(qt, kt, vt, mt, ot, 0.125), "o")
    p = N.Plan(g, pool(n_threads))
    p.set_input("q", np.ascontiguousarray(q, np.float32))
    p.set_input("k", encode(k, kv_dt))
    p.set_input("v", encode(v, kv_dt))
    p.set_input("mask", np.ascontiguousarray(mask, np.float32))
    if order is not None:
        p.set_input("order", np.asarray(order, np.int32))
    with using_isa(isa):
        p.run()
    return p.output("o")


def _own_sequence(rng):
    q = rng.standard_normal((T_OWN, HQ, D)).astype(np.float32)
    k = rng.standard_normal((N_OWN, HKV, D)).astype(np.float32)
    v = rng.standard_normal((N_OWN, HKV, D)).astype(np.float32)
    pos = np.arange(N_OWN - T_OWN, N_OWN)
    mask = np.where(np.arange(N_OWN)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)
    mask[:, ::3] += np.float32(-0.75)  # a finite bias on some visible cells (ALiBi-like)
    return q, k, v, mask


def _interleave(rng, q, k, v, mask, own_order):
    """A 40-cell KV buffer holding our cells at scattered positions, another sequence's cells
    (visible only to its own 3 tokens) and never-visible padding cells filled with NaN; a
    batch of 8 tokens mixing both sequences. Returns inputs, the rows of our tokens and the
    buffer order (our cells keep their relative order own_order; the others are interleaved)."""
    n_kv, n_other, T = 40, 15, T_OWN + 3
    slots = rng.permutation(n_kv)
    own_slots, other_slots = np.sort(slots[:N_OWN]), slots[N_OWN:N_OWN + n_other]
    K = np.full((n_kv, HKV, D), np.nan, np.float32)
    V = np.full((n_kv, HKV, D), np.nan, np.float32)
    K[own_slots], V[own_slots] = k, v
    K[other_slots] = rng.standard_normal((n_other, HKV, D))
    V[other_slots] = rng.standard_normal((n_other, HKV, D))
    rows = np.sort(rng.choice(T, T_OWN, replace=False))
    other_rows = np.setdiff1d(np.arange(T), rows)
    Q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    Q[rows] = q
    M = np.full((T, n_kv), -np.inf, np.float32)
    M[np.ix_(rows, own_slots)] = mask
    M[np.ix_(other_rows, other_slots)] = 0.0
    # order: our cells in own_order (mapped to slots) with every other cell spliced in at random
    ours = list(own_slots[own_order])
    rest = [s for s in rng.permutation(n_kv) if s not in set(ours)]
    order = []
    for s in rest:
        if ours and rng.random() < 0.5:
            order.append(ours.pop(0))
        order.append(s)
    order += ours
    return Q, K, V, M, rows, np.array(order, np.int32)


@pytest.mark.parametrize("kv_dt", (F32, F16), ids=dname)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("use_order", (False, True), ids=("cell_order", "explicit_order"))
def test_attention_rows_do_not_depend_on_the_batch(kv_dt, isa, use_order):
    rng = np.random.default_rng(21)
    q, k, v, mask = _own_sequence(rng)
    own_order = rng.permutation(N_OWN) if use_order else np.arange(N_OWN)
    order = own_order if use_order else None

    batch = _attend(q, k, v, mask, order, kv_dt, isa, 1)
    assert np.all(np.isfinite(batch))
    # each token alone (T = 1)
    for t in range(T_OWN):
        alone = _attend(q[t:t + 1], k, v, mask[t:t + 1], order, kv_dt, isa, 1)
        _same(alone[0], batch[t], f"token {t} alone vs in a batch of {T_OWN}")
    # more threads
    for nt in THREADS[1:]:
        _same(_attend(q, k, v, mask, order, kv_dt, isa, nt), batch, f"{nt} threads vs 1")
    # interleaved with another sequence's cells and tokens, plus NaN padding cells
    Q, K, V, M, rows, big_order = _interleave(rng, q, k, v, mask, own_order)
    if not use_order:
        # without an explicit order the buffer's cell order is used: our cells are ascending
        big_order = None
    for nt in THREADS:
        mixed = _attend(Q, K, V, M, big_order, kv_dt, isa, nt)
        _same(mixed[rows], batch, f"interleaved buffer + mixed batch ({nt} threads)")


def _attend_heads(q, k, v, mask, kv_dt, isa, n_threads):
    g = N.Graph()
    T, hq, d = q.shape
    n_kv, hkv, dv = v.shape
    qt = g.input("q", F32, [T, hq, d])
    kt = g.input("k", kv_dt, [n_kv, hkv, d])
    vt = g.input("v", kv_dt, [n_kv, hkv, dv])
    mt = g.input("mask", F32, [T, n_kv])
    g.output(g.attention(qt, kt, vt, mt, None, d ** -0.5), "o")
    p = N.Plan(g, pool(n_threads))
    p.set_input("q", np.ascontiguousarray(q, np.float32))
    p.set_input("k", encode(k, kv_dt))
    p.set_input("v", encode(v, kv_dt))
    p.set_input("mask", np.ascontiguousarray(mask, np.float32))
    with using_isa(isa):
        p.run()
    return np.array(p.output("o"))


@pytest.mark.parametrize("d,dv", ((64, 64), (32, 64), (128, 128), (48, 32)), ids=lambda x: str(x))
@pytest.mark.parametrize("kv_dt", (F32, F16), ids=dname)
@pytest.mark.parametrize("isa", ISAS)
def test_attention_wide_tiles_equal_rows_alone(d, dv, kv_dt, isa):
    """A speculative verify batch: 17 tokens x 3 query heads per KV head give tiles of 12-16 rows,
    which the AVX-512 path computes with the rows in vector lanes. Each token's result equals the
    token decoded alone (a tile of 3 rows, the row-by-row form) bit for bit, and numpy's softmax
    attention within float tolerance. The tokens see different numbers of cells (causal, after a
    5-cell prefix and with a hole of cells no row sees), so rows leave the tile at different
    16-cell blocks."""
    rng = np.random.default_rng(31 + d)
    T, hq, hkv, n_kv, prefix = 17, 9, 3, 40, 5
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    k = rng.standard_normal((n_kv, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n_kv, hkv, dv)).astype(np.float32)
    cells = np.r_[0:3, 6:n_kv]  # cells 3-5: a hole (another sequence's cells)
    pos = prefix + np.arange(T)
    mask = np.full((T, n_kv), -np.inf, np.float32)
    for t in range(T):
        mask[t, cells[: pos[t] + 1]] = 0.0
    batch = _attend_heads(q, k, v, mask, kv_dt, isa, 1).reshape(T, hq, dv)
    kf = k.astype(np.float16).astype(np.float32) if kv_dt == F16 else k
    vf = v.astype(np.float16).astype(np.float32) if kv_dt == F16 else v
    for t in range(T):
        alone = _attend_heads(q[t:t + 1], k, v, mask[t:t + 1], kv_dt, isa, 1).reshape(hq, dv)
        _same(alone, batch[t], f"token {t} alone vs in a batch of {T}")
        vis = mask[t] == 0
        for h in range(hq):
            s = kf[vis, h // 3] @ q[t, h].astype(np.float64) * d ** -0.5
            w = np.exp(s - s.max())
            np.testing.assert_allclose(batch[t, h], (w / w.sum()) @ vf[vis, h // 3], rtol=2e-4, atol=2e-5)
    _same(_attend_heads(q, k, v, mask, kv_dt, isa, 3).reshape(T, hq, dv), batch, "3 threads vs 1")


@pytest.mark.parametrize("kv_dt", (F32, F16), ids=dname)
@pytest.mark.parametrize("isa", ISAS)
def test_attention_order_is_the_walk_order(kv_dt, isa):
    """Walking the cells in `order` is the same computation as storing them in that order: bit
    for bit (and, for a non-trivial order, not what the plain cell order gives)."""
    rng = np.random.default_rng(13)
    q, k, v, mask = _own_sequence(rng)
    perm = rng.permutation(N_OWN)
    with_order = _attend(q, k, v, mask, perm, kv_dt, isa, 3)
    stored = _attend(q, k[perm], v[perm], mask[:, perm], None, kv_dt, isa, 1)
    _same(with_order, stored, "order vs physically permuted cells")
    plain = _attend(q, k, v, mask, None, kv_dt, isa, 1)
    np.testing.assert_allclose(with_order, plain, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(with_order, plain), "order had no effect on the summation order"


@pytest.mark.parametrize("isa", ISAS)
def test_attention_padding_cells_are_never_read(isa):
    """Cells masked for every row may hold anything (NaN): the result equals the unpadded one."""
    rng = np.random.default_rng(5)
    q, k, v, mask = _own_sequence(rng)
    ref = _attend(q, k, v, mask, None, F32, isa, 1)
    pad = 19
    Kp = np.concatenate([k, np.full((pad, HKV, D), np.nan, np.float32)])
    Vp = np.concatenate([v, np.full((pad, HKV, D), np.nan, np.float32)])
    Mp = np.concatenate([mask, np.full((T_OWN, pad), -np.inf, np.float32)], axis=1)
    _same(_attend(q, Kp, Vp, Mp, None, F32, isa, 3), ref, "padded n_kv")


# --------------------------------------------------------------------------------------------
# row reductions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ("rms_norm", "softmax"))
@pytest.mark.parametrize("isa", ISAS)
def test_row_reductions_do_not_depend_on_the_batch(op, isa):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((37, 129)).astype(np.float32)

    def run(a, nt):
        g = N.Graph()
        t = g.input("x", F32, list(a.shape))
        g.output(g.rms_norm(t, 1e-6) if op == "rms_norm" else g.softmax(t, None, 0.7), "y")
        p = N.Plan(g, pool(nt))
        p.set_input("x", a)
        with using_isa(isa):
            p.run()
        return p.output("y")

    full = run(x, 3)
    for r in (0, 17, 36):
        _same(run(x[r:r + 1], 1)[0], full[r], f"{op} row {r} alone vs in batch")


@pytest.mark.parametrize("isa", ISAS)
def test_attention_layers_sharing_a_mask_equal_separate_ops(isa):
    """Layers of one plan share the mask and order inputs, and the AVX-512 path reuses a tile's
    walk list across heads and layers within a run. Two masks, four attention ops (two per mask,
    different q / k / v), the plan run twice with new masks: every output equals the op run alone."""
    rng = np.random.default_rng(21)
    T, n_kv = 9, 40
    order = rng.permutation(n_kv).astype(np.int32)

    def masks():
        out = []
        for _ in range(2):
            m = np.full((T, n_kv), -np.inf, np.float32)
            vis = rng.permutation(n_kv)[: int(rng.integers(12, 30))]
            for t in range(T):  # token t sees a growing prefix of its visible cells in walk order
                cells = [c for c in order if c in set(vis)][: 5 + 2 * t]
                m[t, cells] = 0.0
            out.append(m)
        return out

    qkv = [(rng.standard_normal((T, HQ, D)).astype(np.float32), rng.standard_normal((n_kv, HKV, D)).astype(np.float32),
            rng.standard_normal((n_kv, HKV, D)).astype(np.float32)) for _ in range(4)]
    g = N.Graph()
    mts = [g.input(f"mask{i}", F32, [T, n_kv]) for i in range(2)]
    ot = g.input("order", I32, [n_kv])
    for i in range(4):
        qt = g.input(f"q{i}", F32, [T, HQ, D])
        kt, vt = g.input(f"k{i}", F32, [n_kv, HKV, D]), g.input(f"v{i}", F32, [n_kv, HKV, D])
        g.output(g.attention(qt, kt, vt, mts[i % 2], ot, 0.125), f"o{i}")
    p = N.Plan(g, pool(2))
    p.set_input("order", order)
    for i, (q, k, v) in enumerate(qkv):
        p.set_input(f"q{i}", q)
        p.set_input(f"k{i}", k)
        p.set_input(f"v{i}", v)
    for run in range(2):
        ms = masks()
        for i in range(2):
            p.set_input(f"mask{i}", ms[i])
        with using_isa(isa):
            p.run()
        for i, (q, k, v) in enumerate(qkv):
            _same(p.output(f"o{i}"), _attend(q, k, v, ms[i % 2], order, F32, isa, 2), f"{isa} run {run} op {i}")
