"""Quantized formats: the row codecs and cpy against gguf.quants (ggml's reference) bit for bit,
quantized matmul against dequantize-then-matmul, get_rows from quantized tables, and set_rows
into external buffers with sentinels around and between the target rows.

The matmul kernels document their exact per-pair arithmetic in native/cpu/quant/quant.h
(activations quantized per 32-block to int8, integer block dots, fma accumulation; L-lane fma
trees for float weights). `qmm_oracle` / `fmm_oracle` below re-derive it in numpy, so the CPU
reference mode is itself checked against an independent oracle.
"""
from __future__ import annotations

import numpy as np
import pytest

from .harness import (
    BF16, F16, F32, I32, ISAS, K_QUANTS, QUANT, QUANT_ISAS, THREADS, TOL_QMM, WEIGHT_TYPES, N, Tol,
    _gq, check, decode, dname, encode, is_quant, pool, row_bytes, run_matmul, using_isa,
)

QTYPES = tuple(QUANT)          # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
REF_QTYPES = tuple(t for t in QTYPES if t not in K_QUANTS)   # gguf.quants can quantize these
ISA_THREADS = [pytest.param(i, t, id=f"{i}-t{t}") for i in ISAS for t in THREADS]
QISA_THREADS = [pytest.param(i, t, id=f"{i}-t{t}") for i in QUANT_ISAS for t in THREADS]


def _n(dt, n32: int) -> int:
    """A row length valid for dt (K-quants: a multiple of 256)."""
    return -(-n32 // 256) * 256 if dt in K_QUANTS else n32


def _edge_rows(n_blocks: int = 16) -> np.ndarray:
    """Rows of 32-blocks that stress the quantizers: zeros, ties in |max|, one outlier, tiny and
    huge values, exact .5 rounding points, constant blocks, fp16-subnormal scales."""
    rng = np.random.default_rng(7)
    b = rng.standard_normal((n_blocks, 32)).astype(np.float32)
    b[0] = 0.0
    b[1, :] = rng.standard_normal(32)
    b[1, 3], b[1, 9] = -3.0, 3.0            # |max| tie: the first one (negative) wins for Q4_0
    b[2] = 0.01
    b[2, 17] = 100.0                         # one outlier
    b[3] *= 1e-6                             # scales below fp16's normal range
    b[4] *= 1e3
    b[5] = np.arange(32, dtype=np.float32) - 15.5
    b[6] = (np.arange(32) % 8 - 3.5).astype(np.float32) * 127 / 3.5 / 127  # values at .5 steps
    b[7] = 5.0                               # constant block (Q4_1: d = 0)
    b[8] = -np.abs(b[8])
    b[9] = np.linspace(-1, 1, 32, dtype=np.float32) * 63.5
    return b.reshape(-1)


# --------------------------------------------------------------------------------------------
# codecs
# --------------------------------------------------------------------------------------------


def _f16_edge_values() -> np.ndarray:
    """Every fp16 value and every midpoint between neighbours (ties round to even), values just
    either side of the midpoints, the subnormal range, overflow, infinities and NaNs."""
    h = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # finite >= 0
    mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    big = np.array([65504.0, 65519.99, 65520.0, 1e5, 3e38, np.inf], np.float32)
    tiny = np.array([2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -26, 1e-30, 0.0], np.float32)
    x = np.concatenate([h, mid, near, big, tiny])
    x = np.concatenate([x, -x, np.array([np.nan, -np.nan], np.float32)])
    return x.astype(np.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_f16_rows_round_like_numpy(isa):
    """KV-cache rows go to fp16 through row_from_f32 (F16C on x86, the scalar code elsewhere):
    round-to-nearest-even bit for bit, like numpy, for every ISA."""
    x = _f16_edge_values()
    with using_isa(isa):
        got = np.asarray(N.row_from_f32(F16, x)).view(np.uint16).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    with np.errstate(invalid="ignore"):
        assert np.all(np.isnan(got[nan].view(np.float16)))
    assert np.array_equal(got[nan] & 0x8000, want[nan] & 0x8000)


@pytest.mark.parametrize("dt", REF_QTYPES, ids=dname)
def test_row_codecs_match_gguf(dt):
    x = _edge_rows()
    want = encode(x, dt).reshape(-1)
    got = np.asarray(N.row_from_f32(dt, x))
    assert got.tobytes() == want.tobytes(), f"{dname(dt)}: first differing byte {np.argmax(got != want)}"
    dec = np.asarray(N.row_to_f32(dt, want, x.size))
    assert np.array_equal(dec.view(np.uint32), decode(want, dt).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("dt", (F16, BF16), ids=dname)
def test_float_codecs_round_to_nearest_even(dt):
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8,
                        2.98e-8, 1e-8, 3.0e-5, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8,
                        1.0 + 3 * 2 ** -8, np.inf, -np.inf], dtype=np.float32)
    x = np.concatenate([special, np.random.default_rng(1).standard_normal(64).astype(np.float32) * 100])
    got = np.asarray(N.row_from_f32(dt, x)).view(np.uint16)
    want = encode(x, dt).view(np.uint16)
    assert np.array_equal(got, want), f"{dname(dt)} differs at {x[got != want]}"
    back = np.asarray(N.row_to_f32(dt, want.view(np.uint8), x.size))
    assert np.array_equal(back.view(np.uint32), decode(want, dt).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("dt", K_QUANTS, ids=dname)
def test_kquant_codec_decodes_like_gguf(dt):
    """K-quants: our bytes decode exactly as gguf.quants decodes them (row_to_f32 and the
    whole-tensor decoder), also for arbitrary block bytes (every scale / bit pattern), and the
    round trip error is that of a least-squares fit."""
    x = _edge_rows(32)
    raw = np.asarray(N.row_from_f32(dt, x))
    want = _gq.dequantize(raw, QUANT[dt]).astype(np.float32)
    assert np.array_equal(np.asarray(N.row_to_f32(dt, raw, x.size)).view(np.uint32), want.view(np.uint32))
    # arbitrary bytes with finite fp16 scales
    rng = np.random.default_rng(5)
    nsb = 64
    bb = int(N.dtype_type_size(dt))
    blocks = rng.integers(0, 256, (nsb, bb), dtype=np.uint8)
    for off in ((208,) if dt == N.DType.Q6_K else (0, 2)):
        blocks[:, off:off + 2] = (rng.standard_normal(nsb) * 0.01).astype(np.float16).view(np.uint8).reshape(nsb, 2)
    want = _gq.dequantize(blocks.reshape(-1), QUANT[dt]).astype(np.float32)
    got = np.asarray(N.dequantize_tensor(dt, blocks, 1, nsb * 256)).reshape(-1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # gaussian data: the relative round-trip RMSE of a least-squares fit of that many bits
    g = rng.standard_normal(64 * 256).astype(np.float32)
    back = np.asarray(N.row_to_f32(dt, np.asarray(N.row_from_f32(dt, g)), g.size))
    rel = np.sqrt(np.mean((back - g) ** 2) / np.mean(g ** 2))
    assert rel < {N.DType.Q4_K: 0.075, N.DType.Q5_K: 0.038, N.DType.Q6_K: 0.019}[dt], rel


@pytest.mark.parametrize("dt", (F16, BF16) + QTYPES, ids=dname)
@pytest.mark.parametrize("isa,n_threads", ISA_THREADS)
def test_cpy_bytes_match_gguf(dt, isa, n_threads):
    """cpy f32 -> dt writes exactly the bytes ggml's reference quantizer writes (K-quants: the
    bytes of pyfast's own quantizer, row_from_f32, which gguf.quants decodes; see above)."""
    n = _n(dt, 64)
    x = _edge_rows().reshape(-1, n)
    g = N.Graph()
    g.output(g.cpy(g.input("x", F32, list(x.shape)), dt), "y")
    p = N.Plan(g, pool(n_threads))
    p.set_input("x", x)
    with using_isa(isa):
        p.run()
    got = np.ascontiguousarray(p.output("y")).view(np.uint8)
    want = encode(x, dt).view(np.uint8)
    assert got.tobytes() == want.tobytes()


# --------------------------------------------------------------------------------------------
# matmul
# --------------------------------------------------------------------------------------------


def _f16(b2: np.ndarray) -> np.ndarray:
    return b2.copy().view(np.float16)[..., 0].astype(np.float32)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit codes of 32-blocks from qh (4 bytes, little endian) and qs (16 bytes of nibbles)."""
    bits = (qh.copy().view(np.uint32).astype(np.int64) >> np.arange(32)) & 1
    nib = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    return nib | (bits << 4)


def _blocks(wraw: np.ndarray, dt):
    """Parse a quantized [N, row bytes] array into quant.h's per-32-block terms: scale dw [N, nb],
    min mw [N, nb] (None for the types without one) and integer codes c [N, nb, 32]."""
    n = wraw.shape[0]
    T = N.DType
    if dt in K_QUANTS:
        sbb = int(N.dtype_type_size(dt))
        sb = wraw.reshape(n, -1, sbb)
        nsb = sb.shape[1]
        if dt == T.Q6_K:
            ql, qh = sb[..., 0:128].astype(np.int64), sb[..., 128:192].astype(np.int64)
            sc = sb[..., 192:208].copy().view(np.int8).astype(np.int64)           # [n, nsb, 16]
            q = np.empty((n, nsb, 256), np.int64)
            for h in range(2):
                for l0 in range(0, 64, 32):                                       # element 128h + 64s + l
                    for s_ in range(2):
                        q[..., 128 * h + 64 * s_ + l0:128 * h + 64 * s_ + l0 + 32] = \
                            (ql[..., 64 * h + l0:64 * h + l0 + 32] >> (4 * s_)) & 15
                for t in range(4):                                                # element 128h + 32t + l
                    q[..., 128 * h + 32 * t:128 * h + 32 * t + 32] |= ((qh[..., 32 * h:32 * h + 32] >> (2 * t)) & 3) << 4
            c = (q - 32) * np.repeat(sc, 16, axis=-1)
            d = np.repeat(_f16(sb[..., 208:210]), 8, axis=-1)
            return d, None, c.reshape(n, nsb * 8, 32)
        d, dmin = _f16(sb[..., 0:2]), _f16(sb[..., 2:4])
        s12 = sb[..., 4:16].astype(np.int64)
        sc = np.concatenate([s12[..., 0:4] & 63, (s12[..., 8:12] & 15) | ((s12[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([s12[..., 4:8] & 63, (s12[..., 8:12] >> 4) | ((s12[..., 4:8] >> 6) << 4)], -1)
        qs = sb[..., 16:144] if dt == T.Q4_K else sb[..., 48:176]
        qs = qs.astype(np.int64).reshape(n, nsb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nsb, 8, 32)          # sub-block 2p, 2p + 1
        if dt == T.Q5_K:
            qh = sb[..., 16:48].astype(np.int64)
            q |= ((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4
        dw = (d[..., None] * sc.astype(np.float32)).astype(np.float32)
        mw = -(dmin[..., None] * mn.astype(np.float32)).astype(np.float32)
        return dw.reshape(n, -1), mw.reshape(n, -1), q.reshape(n, nsb * 8, 32)
    bb = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24}[dt]
    b = wraw.reshape(n, -1, bb)
    d = _f16(b[..., 0:2])
    m = None
    if dt == T.Q8_0:
        q = b[..., 2:].copy().view(np.int8).astype(np.int64)
    elif dt in (T.Q5_0, T.Q5_1):
        off = 2 if dt == T.Q5_0 else 4
        q = _q5_codes(b[..., off:off + 4], b[..., off + 4:])
        if dt == T.Q5_0:
            q = q - 16
        else:
            m = _f16(b[..., 2:4])
    else:
        off = 2 if dt == T.Q4_0 else 4
        qs = b[..., off:].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if dt == T.Q4_0:
            q = q - 8
        else:
            m = _f16(b[..., 2:4])
    return d, m, q


def _fma32(a, b, c):
    # a*b is exact in float64 for float32 inputs; the sum is then rounded once more to float32.
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def qmm_oracle(x: np.ndarray, wraw: np.ndarray, dt) -> np.ndarray:
    """quant.h's per-pair arithmetic for quantized weights, in numpy."""
    M, K = x.shape
    nb = K // 32
    xb = x.astype(np.float32).reshape(M, nb, 32)
    amax = np.abs(xb).max(-1)
    dx = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(dx != 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    qx = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    fx = (dx * qx.sum(-1).astype(np.float32)).astype(np.float32)
    dw, mw, qw = _blocks(wraw, dt)
    isum = np.einsum("mbk,nbk->mnb", qx, qw)
    acc = np.zeros((M, wraw.shape[0]), np.float32)
    for b in range(nb):
        s = (dx[:, b, None] * dw[None, :, b]).astype(np.float32)
        acc = _fma32(s, isum[:, :, b].astype(np.float32), acc)
        if mw is not None:
            acc = _fma32(np.broadcast_to(mw[None, :, b], acc.shape), np.broadcast_to(fx[:, b, None], acc.shape), acc)
    return acc


def fmm_oracle(x: np.ndarray, w: np.ndarray, lanes: int) -> np.ndarray:
    """quant.h's per-pair arithmetic for float weights: an L-lane fma accumulator then a fixed tree."""
    M, K = x.shape
    Kp = -(-K // lanes) * lanes
    xp = np.zeros((M, Kp), np.float32)
    wp = np.zeros((w.shape[0], Kp), np.float32)
    xp[:, :K], wp[:, :K] = x, w
    acc = np.zeros((M, w.shape[0], lanes), np.float32)
    for k0 in range(0, Kp, lanes):
        acc = _fma32(xp[:, None, k0:k0 + lanes], wp[None, :, k0:k0 + lanes], acc)
    a = [acc[..., i] for i in range(lanes)]
    g = [(a[4 * c] + a[4 * c + 2]) + (a[4 * c + 1] + a[4 * c + 3]) for c in range(lanes // 4)]
    return g[0] + g[1] if lanes == 8 else (g[0] + g[1]) + (g[2] + g[3])


LANES = {"scalar": 16, "avx2": 8, "avx512": 16}


def quantizes_activations() -> bool:
    """Whether the matmul kernel asks for scratch for quantized activations (quant.h's contract);
    false with a placeholder kernel that multiplies dequantized weights in float."""
    g = N.Graph()
    w = g.external("w", N.DType.Q8_0, [4, 64], np.zeros(4 * 68, np.uint8))
    g.output(g.matmul(g.input("x", F32, [2, 64]), w), "y")
    return N.Plan(g, pool(1)).stats["work_bytes"] > 0


needs_real_matmul = pytest.mark.skipif(not quantizes_activations(),
                                       reason="matmul kernel is a placeholder (no activation quantization)")

QMM_SHAPES = [(1, 1, 32), (7, 33, 64), (65, 17, 256), (3, 5, 1024), (18, 20, 160)]


def _qmm_data(M, N_, K, dt, seed=0):
    K = _n(dt, K)
    rng = np.random.default_rng(seed + K + 7 * M + N_)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, :32] *= 10.0  # blocks with very different scales
    if K >= 64:
        x[::2, 32:64] = 0.0  # all-zero activation blocks (scale 0)
    w = (rng.standard_normal((N_, K)) * 0.3).astype(np.float32)
    return x, encode(w, dt)


@pytest.mark.parametrize("dt", QTYPES, ids=dname)
@pytest.mark.parametrize("M,N_,K", QMM_SHAPES)
@pytest.mark.parametrize("isa,n_threads", QISA_THREADS)
def test_quant_matmul_vs_dequantized(dt, M, N_, K, isa, n_threads):
    x, wraw = _qmm_data(M, N_, K, dt)
    ref = x.astype(np.float64) @ decode(wraw, dt).T
    y = run_matmul(x, wraw, dt, isa, n_threads)
    check(y.astype(np.float64), ref, TOL_QMM, f"{dname(dt)} {M}x{N_}x{x.shape[1]}")


@pytest.mark.parametrize("dt", QTYPES, ids=dname)
@pytest.mark.parametrize("M,N_,K", QMM_SHAPES)
def test_quant_oracle_within_tolerance(dt, M, N_, K):
    """The tolerance used for quantized matmul covers the documented activation quantization."""
    x, wraw = _qmm_data(M, N_, K, dt)
    ref = x.astype(np.float64) @ decode(wraw, dt).T
    check(qmm_oracle(x, wraw, dt).astype(np.float64), ref, TOL_QMM, "oracle")


@needs_real_matmul
@pytest.mark.parametrize("dt", QTYPES, ids=dname)
@pytest.mark.parametrize("M,N_,K", QMM_SHAPES)
@pytest.mark.parametrize("isa", QUANT_ISAS)
def test_quant_matmul_matches_oracle_exactly(dt, M, N_, K, isa):
    """Every ISA computes quant.h's arithmetic exactly (bit-identical across ISAs)."""
    x, wraw = _qmm_data(M, N_, K, dt)
    y = run_matmul(x, wraw, dt, isa, 3)
    want = qmm_oracle(x, wraw, dt)
    check(y.astype(np.float64), want.astype(np.float64), Tol(exact=True), f"{dname(dt)} {isa}")


@needs_real_matmul
@pytest.mark.parametrize("dt", (F32, F16, BF16), ids=dname)
@pytest.mark.parametrize("M,N_,K", [(1, 1, 1), (7, 33, 65), (5, 17, 300)])
@pytest.mark.parametrize("isa", [i for i in ISAS if i in LANES])
def test_float_matmul_matches_oracle_exactly(dt, M, N_, K, isa):
    rng = np.random.default_rng(K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    wraw = encode(rng.standard_normal((N_, K)), dt)
    y = run_matmul(x, wraw, dt, isa, 1)
    want = fmm_oracle(x, decode(wraw, dt).astype(np.float32), LANES[isa])
    check(y.astype(np.float64), want.astype(np.float64), Tol(exact=True), f"{dname(dt)} {isa}")


# --------------------------------------------------------------------------------------------
# get_rows from quantized tables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dt", WEIGHT_TYPES, ids=dname)
@pytest.mark.parametrize("isa,n_threads", ISA_THREADS)
def test_get_rows_equals_dequantized_rows(dt, isa, n_threads):
    V, D = 37, _n(dt, 96)
    rng = np.random.default_rng(3)
    table = encode(rng.standard_normal((V, D)) * 2, dt)
    ids = np.array([0, V - 1, 5, 5, 17, 0, 36, 2, 9, 30, 11], np.int32)
    g = N.Graph()
    t = g.external("table", dt, [V, D], table)
    g.output(g.get_rows(t, g.input("ids", I32, [len(ids)])), "rows")
    p = N.Plan(g, pool(n_threads))
    p.set_input("ids", ids)
    with using_isa(isa):
        p.run()
    got = p.output("rows")
    want = decode(table, dt).astype(np.float32)[ids]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --------------------------------------------------------------------------------------------
# set_rows into external buffers: sentinels around and between rows
# --------------------------------------------------------------------------------------------

GUARD = 64   # sentinel bytes before the first row
GAP = 12     # sentinel bytes between rows (dst row stride = row bytes + GAP)


def _set_rows_plan(dt, R, row_shape, n_src, buf, n_threads, src_layout="contig"):
    D = int(np.prod(row_shape))
    rb = row_bytes(dt, row_shape[-1]) * int(np.prod(row_shape[:-1]))
    inner = [] if len(row_shape) == 1 else [row_bytes(dt, row_shape[-1])]
    elem = 0 if is_quant(dt) else int(N.dtype_type_size(dt))
    g = N.Graph()
    dst = g.external("cache", dt, [R, *row_shape], buf, offset=GUARD, strides=[rb + GAP, *inner, elem])
    if src_layout == "permuted":  # src rows strided: the input holds src.T
        src = g.permute(g.input("srcT", F32, [D, n_src]), [1, 0])
    else:
        src = g.input("src", F32, [n_src, D])
    out = g.set_rows(dst, src, g.input("idx", I32, [n_src]))
    g.output(out, "cache_out")
    return N.Plan(g, pool(n_threads)), rb


@pytest.mark.parametrize("dt", WEIGHT_TYPES, ids=dname)
@pytest.mark.parametrize("isa,n_threads", ISA_THREADS)
@pytest.mark.parametrize("row_shape,src_layout", [((64,), "contig"), ((2, 32), "contig"), ((96,), "permuted")],
                         ids=["row64", "row2x32", "row96-srcperm"])
def test_set_rows_sentinels(dt, isa, n_threads, row_shape, src_layout):
    row_shape = row_shape[:-1] + (_n(dt, row_shape[-1]),)
    R = 9
    D = int(np.prod(row_shape))
    rb = row_bytes(dt, row_shape[-1]) * int(np.prod(row_shape[:-1]))
    nbytes = GUARD + R * (rb + GAP) + GUARD
    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, nbytes, dtype=np.uint8)  # sentinel bytes everywhere
    plan, _ = _set_rows_plan(dt, R, row_shape, 4, buf, n_threads, src_layout)
    row_start = lambda r: GUARD + r * (rb + GAP)  # noqa: E731
    expect = buf.copy()
    for idx in ([8, 0, 3, 4], [2, 6, 5, 1]):  # replay: new rows, earlier ones stay
        src = (rng.standard_normal((4, D)) * 3).astype(np.float32)
        if src_layout == "permuted":
            plan.set_input("srcT", np.ascontiguousarray(src.T))
        else:
            plan.set_input("src", src)
        plan.set_input("idx", np.array(idx, np.int32))
        with using_isa(isa):
            plan.run()
        enc = encode(src.reshape((4, *row_shape)), dt).reshape(4, -1).view(np.uint8)
        for k, r in enumerate(idx):
            expect[row_start(r):row_start(r) + rb] = enc[k]
        diff = np.flatnonzero(buf != expect)
        assert diff.size == 0, (
            f"{dname(dt)} idx={idx}: {diff.size} bytes differ, first at byte {diff[0]} "
            f"(rows start at {GUARD}, stride {rb + GAP}, row bytes {rb})")


@pytest.mark.parametrize("dt", (F32, F16, N.DType.Q8_0), ids=dname)
@pytest.mark.parametrize("n_threads", THREADS)
def test_set_rows_out_of_range_index_writes_nothing(dt, n_threads):
    R, D = 5, 64
    rb = row_bytes(dt, D)
    buf = np.random.default_rng(5).integers(0, 256, GUARD + R * (rb + GAP) + GUARD, dtype=np.uint8)
    before = buf.copy()
    plan, _ = _set_rows_plan(dt, R, (D,), 3, buf, n_threads)
    plan.set_input("src", np.ones((3, D), np.float32))
    plan.set_input("idx", np.array([-1, R, 1 << 30], np.int32))
    plan.run()
    assert np.array_equal(buf, before)


@pytest.mark.parametrize("dt", (F16, N.DType.Q8_0), ids=dname)
def test_set_rows_into_host_buffer_then_read(dt):
    """A KV-cache style round trip: set_rows into an N.Buffer, then get_rows reads it back."""
    R, D = 8, 64
    buf = N.Buffer(R * row_bytes(dt, D))
    src = np.random.default_rng(2).standard_normal((3, D)).astype(np.float32)
    idx = np.array([6, 1, 3], np.int32)
    g = N.Graph()
    cache = g.external("cache", dt, [R, D], buf)
    g.output(g.set_rows(cache, g.input("src", F32, [3, D]), g.input("idx", I32, [3])), "w")
    p = N.Plan(g, pool(1))
    p.set_input("src", src)
    p.set_input("idx", idx)
    p.run()
    g2 = N.Graph()
    g2.output(g2.get_rows(g2.external("cache", dt, [R, D], buf), g2.input("ids", I32, [3])), "r")
    p2 = N.Plan(g2, pool(1))
    p2.set_input("ids", idx)
    p2.run()
    want = decode(encode(src, dt), dt)
    assert np.array_equal(p2.output("r").astype(np.float64), want)
    raw = np.frombuffer(buf, np.uint8).reshape(R, -1)
    untouched = [r for r in range(R) if r not in idx]
    assert not raw[untouched].any(), "rows that were not written must stay zero"
