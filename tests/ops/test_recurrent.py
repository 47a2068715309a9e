"""The recurrent-state ops of hybrid models against a float64 numpy oracle (harness.gdn_ref /
ssm_conv_ref), including what the op harness does not see: the state planes they write.

gated_delta_net (algorithms.md §2): the token-serial form (chunk_min = 0) and the chunked form
(chunk_min > 0) both within 1e-4 (max abs) of numpy for S in {16, 64, 128}, Hv/Hk in {1, 2, 4},
T in {1, 7, 64, 65, 300}, the scalar and per-key gates, both head broadcasts and batches of 1 and
3 segments; snapshot plane s equals the state after T - s tokens; a segment's outputs and states
are bit-identical alone or in a batch and on 1 or 3 threads; decoding token by token equals one
serial call bit for bit. ssm_conv: numpy, segments shorter than the window, snapshot windows.
Bad seqs values raise RuntimeError naming the op and leave the state untouched.
"""
from __future__ import annotations

import numpy as np
import pytest

from .harness import (
    F32, I32, ISAS, N, gdn_default_scale, gdn_ref, gdn_ref_seq, pool, ssm_conv_ref, using_isa,
)

TOL = 1e-4  # max abs difference from float64 (outputs and states)


def _best():
    return ISAS[-1]


# --------------------------------------------------------------------------------------------
# running the ops
# --------------------------------------------------------------------------------------------


def run_gdn(q, k, v, g, beta, state, seqs, *, chunk_min=0, broadcast=0, scale=0.0, isa=None, threads=1):
    """gated_delta_net on these inputs; `state` (f32 [P, n_slot, Hv, S*S]) is updated in place.
    Returns o [T, Hv, S]."""
    gr = N.Graph()
    arrs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    ts = [gr.input(n, F32, list(a.shape)) for n, a in arrs.items()]
    st = gr.external("state", F32, list(state.shape), state)
    sq = gr.input("seqs", I32, list(np.shape(seqs)))
    gr.output(gr.gated_delta_net(*ts, st, sq, scale=scale, broadcast=broadcast, chunk_min=chunk_min), "o")
    p = N.Plan(gr, pool(threads))
    for n, a in arrs.items():
        p.set_input(n, np.ascontiguousarray(a, np.float32))
    p.set_input("seqs", np.ascontiguousarray(seqs, np.int32))
    with using_isa(isa or _best()):
        p.run()
    return p.output("o")


def run_conv(x, w, state, seqs, *, isa=None, threads=1, w_by_tap=False):
    """ssm_conv; w_by_tap: w is given as a permuted view of a [Kc, C] buffer (channels
    contiguous, the kernel's fast path) instead of a contiguous [C, Kc] one."""
    gr = N.Graph()
    xt = gr.input("x", F32, list(x.shape))
    if w_by_tap:
        wt = gr.permute(gr.input("w", F32, [w.shape[1], w.shape[0]]), [1, 0])
        w = w.T
    else:
        wt = gr.input("w", F32, list(w.shape))
    st = gr.external("state", F32, list(state.shape), state)
    gr.output(gr.ssm_conv(xt, wt, st, gr.input("seqs", I32, list(np.shape(seqs)))), "y")
    p = N.Plan(gr, pool(threads))
    p.set_input("x", np.ascontiguousarray(x, np.float32))
    p.set_input("w", np.ascontiguousarray(w, np.float32))
    p.set_input("seqs", np.ascontiguousarray(seqs, np.int32))
    with using_isa(isa or _best()):
        p.run()
    return p.output("y")


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def gdn_data(seed, T, Hk, Hv, S, kda, P=4, n_slot=3, decay=(0.01, 0.5)):
    rng = np.random.default_rng(seed)
    f = np.float32
    q = _unit(rng.standard_normal((T, Hk, S))).astype(f)
    k = _unit(rng.standard_normal((T, Hk, S))).astype(f)
    v = rng.standard_normal((T, Hv, S)).astype(f)
    g = (-rng.uniform(*decay, size=(T, Hv, S) if kda else (T, Hv))).astype(f)
    beta = rng.uniform(0.05, 0.95, (T, Hv)).astype(f)
    state = (rng.standard_normal((P, n_slot, Hv, S * S)) * 0.3).astype(f)
    return q, k, v, g, beta, state


def _maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))) if np.size(a) else 0.0


def _same(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape, what
    bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} values differ (first flat index {bad[0]})"


def check_gdn(inputs, state0, state, o, seqs, broadcast=0, scale=0.0, what=""):
    """o and every state plane within TOL of numpy; planes and slots the op must not write are
    untouched (bit for bit)."""
    q, k, v, g, beta = inputs
    o_ref, st_ref = gdn_ref(q, k, v, g, beta, state0, seqs, scale=scale, broadcast=broadcast)
    assert np.all(np.isfinite(o)), what
    e_o = _maxdiff(o, o_ref)
    assert e_o < TOL, f"{what}: output max abs diff {e_o:.3g}"
    P = state.shape[0]
    written = np.zeros(state.shape[:2], bool)
    for t0, n, slot, src in seqs:
        written[:min(n, P), slot] = True
    e_s = _maxdiff(state[written], st_ref[written])
    assert e_s < TOL, f"{what}: state max abs diff {e_s:.3g}"
    _same(state[~written], state0[~written], f"{what}: planes the op must not write")
    return e_o, e_s


# --------------------------------------------------------------------------------------------
# gated_delta_net vs numpy
# --------------------------------------------------------------------------------------------

# The full (S, gate, T, Hv/Hk) grid with one segment; the head broadcast alternates over it
# (test_gdn_head_broadcast crosses it with every ratio and gate on small shapes).
GRID = [(S, kda, T, r) for S in (16, 64, 128) for kda in (False, True) for T in (1, 7, 64, 65, 300) for r in (1, 2, 4)]


def _gdn_heads(S, ratio):
    Hk = 2 if S < 128 else 1
    return Hk, Hk * ratio


@pytest.mark.parametrize("S,kda,T,ratio", GRID,
                         ids=[f"S{S}-{'kda' if kda else 'gda'}-T{T}-r{r}" for S, kda, T, r in GRID])
def test_gdn_serial_and_chunked_vs_numpy(S, kda, T, ratio):
    i = GRID.index((S, kda, T, ratio))
    broadcast = i % 2
    Hk, Hv = _gdn_heads(S, ratio)
    data = gdn_data(i, T, Hk, Hv, S, kda)
    inputs, state0 = data[:5], data[5]
    seqs = np.array([[0, T, 1, 2]], np.int32)
    outs = {}
    for form, cm in (("serial", 0), ("chunked", 1)):
        state = state0.copy()
        o = run_gdn(*inputs, state, seqs, chunk_min=cm, broadcast=broadcast)
        check_gdn(inputs, state0, state, o, seqs, broadcast, what=f"{form} S={S} T={T}")
        outs[form] = (o, state)
    assert _maxdiff(outs["serial"][0], outs["chunked"][0]) < TOL
    assert _maxdiff(outs["serial"][1], outs["chunked"][1]) < TOL


GRID3 = [(S, kda, T) for S in (16, 64, 128) for kda in (False, True) for T in (1, 7, 64, 65, 300)]


@pytest.mark.parametrize("S,kda,T", GRID3, ids=[f"S{S}-{'kda' if kda else 'gda'}-T{T}" for S, kda, T in GRID3])
def test_gdn_three_segments_vs_numpy(S, kda, T):
    """Three segments (lengths T, T//3 + 1 and 1; different slots and source planes) in one batch,
    both forms: numpy; bit-identical on 3 threads; the first segment bit-identical alone."""
    i = GRID3.index((S, kda, T))
    Hk, Hv = _gdn_heads(S, (1, 2, 4)[i % 3])
    broadcast = (i // 3) % 2
    lens = [T, T // 3 + 1, 1]
    t0 = np.cumsum([0] + lens[:-1])
    seqs = np.array([[t0[0], lens[0], 2, 3], [t0[1], lens[1], 0, 0], [t0[2], lens[2], 1, 2]], np.int32)
    data = gdn_data(1000 + i, sum(lens), Hk, Hv, S, kda)
    inputs, state0 = data[:5], data[5]
    for cm in (0, 1):
        state = state0.copy()
        o = run_gdn(*inputs, state, seqs, chunk_min=cm, broadcast=broadcast)
        check_gdn(inputs, state0, state, o, seqs, broadcast, what=f"chunk_min={cm}")
        state3 = state0.copy()
        _same(run_gdn(*inputs, state3, seqs, chunk_min=cm, broadcast=broadcast, threads=3), o, "o, 3 threads")
        _same(state3, state, "state, 3 threads")
        alone = state0.copy()
        o1 = run_gdn(*[a[:T] for a in inputs], alone, np.array([[0, T, 2, 3]], np.int32), chunk_min=cm,
                     broadcast=broadcast)
        _same(o1, o[:T], "o, first segment alone")
        _same(alone[:, 2], state[:, 2], "state, first segment alone")


HEADS = [(ratio, bc, kda) for ratio in (1, 2, 4) for bc in (0, 1) for kda in (False, True)]


@pytest.mark.parametrize("ratio,broadcast,kda", HEADS,
                         ids=[f"r{r}-{'interleaved' if b else 'tiled'}-{'kda' if k else 'gda'}" for r, b, k in HEADS])
def test_gdn_head_broadcast(ratio, broadcast, kda):
    """Value head j uses key head j % Hk (tiled) or j // (Hv / Hk) (interleaved)."""
    Hk, S, T = 3, 16, 20
    data = gdn_data(7 + ratio, T, Hk, Hk * ratio, S, kda)
    seqs = np.array([[0, T, 0, 0]], np.int32)
    for cm in (0, 4):
        state = data[5].copy()
        o = run_gdn(*data[:5], state, seqs, chunk_min=cm, broadcast=broadcast, scale=0.7)
        check_gdn(data[:5], data[5], state, o, seqs, broadcast, scale=0.7, what=f"chunk_min={cm}")


# Three segments in one batch: different lengths, slots and source planes, not in slot order,
# with two tokens that belong to no segment (their output rows are 0).
SEGS = np.array([[0, 7, 2, 1], [8, 65, 0, 3], [73, 1, 1, 0]], np.int32)
T3 = 76


@pytest.mark.parametrize("kda", (False, True), ids=("gda", "kda"))
@pytest.mark.parametrize("chunk_min", (0, 8), ids=("serial", "chunked"))
def test_gdn_three_segments_alone_in_batch_and_threads(kda, chunk_min):
    S, Hk, Hv, P = 64, 2, 4, 4
    data = gdn_data(11, T3, Hk, Hv, S, kda, P=P)
    inputs, state0 = data[:5], data[5]
    state = state0.copy()
    o = run_gdn(*inputs, state, SEGS, chunk_min=chunk_min, broadcast=1)
    check_gdn(inputs, state0, state, o, SEGS, broadcast=1, what="batch")
    assert not np.any(o[[7, 74, 75]]), "tokens outside every segment must give 0"
    # 3 threads: bit-identical
    state3 = state0.copy()
    _same(run_gdn(*inputs, state3, SEGS, chunk_min=chunk_min, broadcast=1, threads=3), o, "o, 3 threads vs 1")
    _same(state3, state, "state, 3 threads vs 1")
    # each segment alone (its own tokens only, a state holding only its slot's data)
    for t0, n, slot, src in SEGS:
        alone_state = state0.copy()
        one = np.array([[0, n, slot, src]], np.int32)
        o1 = run_gdn(*[a[t0:t0 + n] for a in inputs], alone_state, one, chunk_min=chunk_min, broadcast=1)
        _same(o1, o[t0:t0 + n], f"o of segment at {t0} alone vs in the batch")
        _same(alone_state[:, slot], state[:, slot], f"state slot {slot} alone vs in the batch")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kda", (False, True), ids=("gda", "kda"))
def test_gdn_every_isa_vs_numpy_and_scalar(isa, kda):
    """Every SIMD path (and the scalar reference) against numpy, and SIMD against scalar."""
    S, T = 128, 65
    data = gdn_data(21, T, 1, 2, S, kda)
    seqs = np.array([[0, 40, 0, 1], [40, 25, 2, 0]], np.int32)
    for cm in (0, 16):
        st, st_ref = data[5].copy(), data[5].copy()
        o = run_gdn(*data[:5], st, seqs, chunk_min=cm, isa=isa)
        check_gdn(data[:5], data[5], st, o, seqs, what=f"{isa} chunk_min={cm}")
        o_ref = run_gdn(*data[:5], st_ref, seqs, chunk_min=cm, isa="scalar")
        assert _maxdiff(o, o_ref) < TOL and _maxdiff(st, st_ref) < TOL


@pytest.mark.parametrize("isa", sorted({ISAS[0], ISAS[-1]}))
@pytest.mark.parametrize("kda", (False, True), ids=("gda", "kda"))
def test_gdn_decode_token_by_token_equals_one_serial_call(isa, kda):
    """The token-serial arithmetic of a token does not depend on T: decoding one token per call
    (reading and writing plane 0) gives bit for bit the outputs and state of one call over all of
    them, alone or beside other sequences, on any thread count."""
    S, Hv, T = 128, 4, 9
    data = gdn_data(31, T, 2, Hv, S, kda, P=1, n_slot=2)
    inputs, state0 = data[:5], data[5]
    whole = state0.copy()
    o_all = run_gdn(*inputs, whole, np.array([[0, T, 1, 0]], np.int32), isa=isa)
    step = state0.copy()
    for t in range(T):
        # another sequence (slot 0) decodes beside it from token 1 on, in front of it in the batch
        other = [a[:1] * 0.5 for a in inputs]
        if t == 0:
            batch, seqs = [a[t:t + 1] for a in inputs], [[0, 1, 1, 0]]
        else:
            batch, seqs = [np.concatenate([x, a[t:t + 1]]) for x, a in zip(other, inputs)], [[0, 1, 0, 0], [1, 1, 1, 0]]
        o = run_gdn(*batch, step, np.array(seqs, np.int32), isa=isa, threads=1 + 2 * (t % 2))
        _same(o[-1], o_all[t], f"token {t}: one per call vs one call")
    _same(step[:, 1], whole[:, 1], "final state")


@pytest.mark.parametrize("chunk_min", (0, 2), ids=("serial", "chunked"))
@pytest.mark.parametrize("T", (2, 3, 6))
def test_gdn_snapshot_planes_are_the_states_after_t_minus_s_tokens(T, chunk_min):
    """Plane s = the state after T - s tokens (numpy run for T - s tokens); for s >= T the plane is
    untouched; with the serial form it is bit for bit the state a call over T - s tokens leaves."""
    S, Hv, P = 32, 2, 4
    data = gdn_data(41 + T, T, 1, Hv, S, kda=False, P=P, n_slot=2)
    inputs, state0 = data[:5], data[5]
    state = state0.copy()
    run_gdn(*inputs, state, np.array([[0, T, 1, 3]], np.int32), chunk_min=chunk_min)
    sc = gdn_default_scale(S)
    for s in range(P):
        if s >= T:
            _same(state[s, 1], state0[s, 1], f"plane {s} (T={T}) must be untouched")
            continue
        m = T - s
        _, ref = gdn_ref_seq(*[a[:m] for a in inputs], state0[3, 1], sc, record=(m,))
        assert _maxdiff(state[s, 1], ref[m].reshape(Hv, S * S)) < TOL, f"plane {s}"
        if chunk_min == 0:
            part = state0.copy()
            run_gdn(*[a[:m] for a in inputs], part, np.array([[0, m, 1, 3]], np.int32))
            _same(state[s, 1], part[0, 1], f"plane {s} vs a call over {m} tokens")


def test_gdn_rollback_then_redecode():
    """The rollback use: decode R+1 tokens, re-read plane r as the source and decode the last r
    tokens again; outputs and final state equal the first decode's bit for bit (serial form)."""
    S, Hv, P, T = 64, 2, 4, 4
    data = gdn_data(51, T, 1, Hv, S, kda=True, P=P, n_slot=1)
    inputs, state0 = data[:5], data[5]
    state = state0.copy()
    o = run_gdn(*inputs, state, np.array([[0, T, 0, 0]], np.int32))
    final = state[0, 0].copy()
    for r in (1, 2, 3):
        st = state.copy()
        o2 = run_gdn(*[a[T - r:] for a in inputs], st, np.array([[0, r, 0, r]], np.int32))
        _same(o2, o[T - r:], f"outputs after rolling back {r}")
        _same(st[0, 0], final, f"state after rolling back {r}")


@pytest.mark.parametrize("kda", (False, True), ids=("gda", "kda"))
def test_gdn_strong_decay_stays_finite(kda):
    """Decays down to exp(-30) per token (exp of chunk-cumulative gates underflows to 0)."""
    S, T = 64, 130
    data = gdn_data(61, T, 1, 2, S, kda, decay=(0.01, 30.0))
    seqs = np.array([[0, T, 0, 0]], np.int32)
    for cm in (0, 1):
        state = data[5].copy()
        o = run_gdn(*data[:5], state, seqs, chunk_min=cm)
        check_gdn(data[:5], data[5], state, o, seqs, what=f"chunk_min={cm}")


@pytest.mark.parametrize("P", (1, 2, 9))
@pytest.mark.parametrize("kda", (False, True), ids=("gda", "kda"))
def test_gdn_plane_counts_and_odd_key_dim(P, kda):
    """One plane (the chunked form then covers the whole segment), two, and more planes than a
    segment has tokens; S = 20 (vector tails)."""
    S, T = 20, 70
    data = gdn_data(P, T, 1, 3, S, kda, P=P, n_slot=2)
    seqs = np.array([[0, 5, 0, P - 1], [5, 65, 1, 0]], np.int32)
    for cm in (0, 3):
        state = data[5].copy()
        o = run_gdn(*data[:5], state, seqs, chunk_min=cm)
        check_gdn(data[:5], data[5], state, o, seqs, what=f"P={P} chunk_min={cm}")


def test_gdn_chunk_min_threshold_and_empty_segment():
    """Segments shorter than chunk_min run serially (bit-identical to chunk_min = 0); an empty
    segment writes nothing."""
    S, T = 32, 20
    data = gdn_data(71, T, 1, 2, S, kda=False)
    seqs = np.array([[0, 12, 0, 1], [12, 8, 2, 0], [20, 0, 1, 2]], np.int32)
    a, b = data[5].copy(), data[5].copy()
    o_a = run_gdn(*data[:5], a, seqs, chunk_min=13)
    o_b = run_gdn(*data[:5], b, seqs, chunk_min=0)
    _same(o_a, o_b, "segments under chunk_min")
    _same(a, b, "states")
    check_gdn(data[:5], data[5], a, o_a, seqs)
    _same(a[:, 1], data[5][:, 1], "the empty segment's slot")


# --------------------------------------------------------------------------------------------
# ssm_conv
# --------------------------------------------------------------------------------------------

# (C, Kc, segments): windows longer than a segment (n < Kc - 1), empty segments, tokens in no
# segment, more planes than tokens, channel counts around the 64-channel work items.
CONV = [
    (33, 4, [[0, 1, 2, 1], [1, 2, 0, 3], [3, 6, 1, 0]]),
    (130, 4, [[5, 3, 0, 2], [0, 1, 1, 0], [8, 0, 2, 1], [1, 4, 2, 3]]),
    (1, 2, [[0, 9, 0, 1]]),
    (64, 5, [[2, 7, 1, 1], [0, 2, 0, 2]]),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("C,Kc,segs", CONV, ids=[f"C{c}-K{k}-{len(s)}seg" for c, k, s in CONV])
def test_ssm_conv_vs_numpy(C, Kc, segs, isa):
    rng = np.random.default_rng(C + Kc)
    T, P, n_slot = 10, 4, 3
    seqs = np.array(segs, np.int32)
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    state0 = rng.standard_normal((P, n_slot, Kc - 1, C)).astype(np.float32)
    y_ref, st_ref = ssm_conv_ref(x.astype(np.float64), w.astype(np.float64), state0, seqs)
    ys = []
    for nt, by_tap in ((1, False), (3, False), (1, True)):
        state = state0.copy()
        y = run_conv(x, w, state, seqs, isa=isa, threads=nt, w_by_tap=by_tap)
        assert _maxdiff(y, y_ref) < 1e-5
        # snapshot windows are copies: exact (and every plane/slot not written is untouched)
        _same(state, st_ref.astype(np.float32), "state")
        ys.append(y)
    _same(ys[1], ys[0], "y, 3 threads vs 1")
    _same(ys[2], ys[0], "y, taps read in place vs transposed")
    covered = np.zeros(T, bool)
    for t0, n, _, _ in segs:
        covered[t0:t0 + n] = True
    assert not np.any(ys[0][~covered])


def test_ssm_conv_segment_alone_equals_in_batch():
    rng = np.random.default_rng(5)
    C, Kc, P = 96, 4, 3
    segs = np.array([[0, 5, 1, 2], [5, 2, 0, 0], [7, 1, 2, 1]], np.int32)
    x = rng.standard_normal((8, C)).astype(np.float32)
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    state0 = rng.standard_normal((P, 3, Kc - 1, C)).astype(np.float32)
    state = state0.copy()
    y = run_conv(x, w, state, segs, threads=3)
    for t0, n, slot, src in segs:
        st = state0.copy()
        y1 = run_conv(x[t0:t0 + n], w, st, np.array([[0, n, slot, src]], np.int32))
        _same(y1, y[t0:t0 + n], "y alone vs in batch")
        _same(st[:, slot], state[:, slot], "state alone vs in batch")


def test_ssm_conv_decode_step_by_step_equals_one_call():
    """Feeding tokens one per call through plane 0 gives the outputs and window of one call."""
    rng = np.random.default_rng(6)
    C, Kc, T = 40, 4, 6
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, Kc)).astype(np.float32)
    state0 = rng.standard_normal((1, 1, Kc - 1, C)).astype(np.float32)
    whole = state0.copy()
    y = run_conv(x, w, whole, np.array([[0, T, 0, 0]], np.int32))
    step = state0.copy()
    for t in range(T):
        _same(run_conv(x[t:t + 1], w, step, np.array([[0, 1, 0, 0]], np.int32))[0], y[t], f"token {t}")
    _same(step, whole, "window")


# --------------------------------------------------------------------------------------------
# bad seqs values (found at run time)
# --------------------------------------------------------------------------------------------

BAD_SEQS = {
    "past the batch": [[0, 3, 0, 0], [3, 6, 1, 0]],
    "t0 < 0": [[-1, 2, 0, 0]],
    "n < 0": [[0, -2, 0, 0]],
    "slot out of range": [[0, 2, 3, 0]],
    "slot < 0": [[0, 2, -1, 0]],
    "src_plane out of range": [[0, 2, 0, 2]],
    "src_plane < 0": [[0, 2, 0, -3]],
    "overlapping tokens": [[0, 5, 0, 0], [4, 2, 1, 0]],
    "slot used twice": [[0, 2, 1, 0], [2, 3, 1, 1]],
}


@pytest.mark.parametrize("threads", (1, 3))
@pytest.mark.parametrize("bad", list(BAD_SEQS), ids=[b.replace(" ", "_") for b in BAD_SEQS])
def test_bad_seqs_values_raise_and_leave_the_state(bad, threads):
    seqs = np.array(BAD_SEQS[bad], np.int32)
    T, P, n_slot, S, C = 8, 2, 3, 16, 20
    q, k, v, g, beta, state = gdn_data(81, T, 1, 2, S, False, P=P, n_slot=n_slot)
    state0 = state.copy()
    with pytest.raises(RuntimeError, match=r"^\[gated_delta_net\] seqs row \d+: "):
        run_gdn(q, k, v, g, beta, state, seqs, chunk_min=2, threads=threads)
    _same(state, state0, "state after a failed gated_delta_net")
    rng = np.random.default_rng(0)
    cstate = rng.standard_normal((P, n_slot, 3, C)).astype(np.float32)
    cstate0 = cstate.copy()
    with pytest.raises(RuntimeError, match=r"^\[ssm_conv\] seqs row \d+: "):
        run_conv(rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((C, 4)).astype(np.float32),
                 cstate, seqs, threads=threads)
    _same(cstate, cstate0, "state after a failed ssm_conv")


def test_plan_still_runs_after_a_bad_seqs_error():
    """The thread pool survives the error: the same plan runs again with good values."""
    T, S = 4, 16
    q, k, v, g, beta, state = gdn_data(91, T, 1, 1, S, False, P=1, n_slot=1)
    gr = N.Graph()
    arrs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    ts = [gr.input(n, F32, list(a.shape)) for n, a in arrs.items()]
    st = gr.external("state", F32, list(state.shape), state)
    gr.output(gr.gated_delta_net(*ts, st, gr.input("seqs", I32, [1, 4])), "o")
    p = N.Plan(gr, pool(3))
    for n, a in arrs.items():
        p.set_input(n, a)
    p.set_input("seqs", np.array([[0, T, 1, 0]], np.int32))
    with pytest.raises(RuntimeError, match="slot 1 is outside"):
        p.run()
    state0 = state.copy()
    p.set_input("seqs", np.array([[0, T, 0, 0]], np.int32))
    p.run()
    o_ref, _ = gdn_ref(q, k, v, g, beta, state0, np.array([[0, T, 0, 0]]))
    assert _maxdiff(p.output("o"), o_ref) < TOL
