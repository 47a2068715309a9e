"""Packed (x16) weights: the same bytes in 16-row chunks (cpu/quant/quant.h). matmul and get_rows
read them with results bit-identical to the row-major weight, on every ISA (avx512 reads the
layout directly, the others unpack each chunk first); packing round-trips exactly; everything else
refuses a packed tensor."""
from __future__ import annotations

import os

import numpy as np
import pytest

from .harness import F32, I32, Q4_0, Q4_1, Q8_0, QUANT_ISAS, N, dname, encode, pool, run_matmul, using_isa

Q4_K, Q5_K, Q6_K = N.DType.Q4_K, N.DType.Q5_K, N.DType.Q6_K
PACKABLE = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
KQ = (Q4_K, Q5_K, Q6_K)


def _cols(dt, n32):
    """A row length of n32 32-blocks, rounded up to whole 256-blocks for the K-quants."""
    return -(-n32 * 32 // 256) * 256 if dt in KQ else n32 * 32


def _weight(dt, n, k, seed):
    rng = np.random.default_rng(seed)
    return encode(rng.standard_normal((n, k)) * 0.2, dt)


def _packed(w, dt):
    p = np.array(w, dtype=np.uint8, copy=True)
    N.pack_x16(dt, p, p.shape[0], p.shape[1] * N.dtype_block_size(dt) // N.dtype_type_size(dt))
    return p


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} elements differ (first flat index {diff[0]})"


def test_packable_types():
    assert all(N.packable(dt) for dt in PACKABLE)
    assert not any(N.packable(dt) for dt in (N.DType.Q5_0, N.DType.Q5_1, N.DType.F16, F32))


@pytest.mark.parametrize("dt", PACKABLE, ids=dname)
def test_packing_moves_every_byte(dt):
    """Packing is a permutation of the bytes within each 16-row chunk: nothing is lost or
    duplicated, and chunks stay where their rows were."""
    w = _weight(dt, 48, _cols(dt, 3), 1)
    p = _packed(w, dt)
    assert p.shape == w.shape and not np.array_equal(p, w)
    for c in range(3):
        a, b = w[16 * c:16 * c + 16].ravel(), p[16 * c:16 * c + 16].ravel()
        np.testing.assert_array_equal(np.sort(a), np.sort(b))
    # the 16 rows' fp16 scales d of the chunk's first block, in row order (Q6_K: after its scales)
    at, off = (256, 208) if dt == Q6_K else (0, 0)
    np.testing.assert_array_equal(p[:16].ravel()[at:at + 32].view(np.uint16),
                                  w[:16, off:off + 2].copy().view(np.uint16).ravel())


@pytest.mark.parametrize("dt", KQ, ids=dname)
def test_packed_kquant_layout(dt):
    """K-quants: each 64-byte vector of a packed super-block holds one dword of every row, in
    row order, taken at the same offset of each row's super-block (codes, high bits, scales)."""
    w = _weight(dt, 16, 512, 7)
    p = _packed(w, dt).ravel()
    bs = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[dt]
    first_dword = {Q4_K: 16, Q5_K: 16, Q6_K: 192}[dt]    # row offset of the first dword field
    at = {Q4_K: 256, Q5_K: 256, Q6_K: 0}[dt]             # its place in the packed super-block
    for sb in range(2):
        rows = w[:, sb * bs:(sb + 1) * bs]
        vec = p[sb * 16 * bs + at: sb * 16 * bs + at + 64]
        np.testing.assert_array_equal(vec.reshape(16, 4), rows[:, first_dword:first_dword + 4])
        if dt == Q6_K:  # codes in reading order: per half h and dword g, ql[64h + 4g], ql[64h + 32 + 4g], qh[32h + 4g]
            for h in range(2):
                for g in range(8):
                    for k, off in enumerate((64 * h + 4 * g, 64 * h + 32 + 4 * g, 128 + 32 * h + 4 * g)):
                        o = sb * 16 * bs + 288 + 1536 * h + 192 * g + 64 * k
                        np.testing.assert_array_equal(p[o:o + 64].reshape(16, 4), rows[:, off:off + 4])
    np.testing.assert_array_equal(np.asarray(N.unpack_x16(dt, _packed(w, dt), 16, 512)).reshape(w.shape), w)


@pytest.mark.parametrize("dt,isa", [(d, i) for d in PACKABLE for i in QUANT_ISAS],
                         ids=[f"{dname(d)}-{i}" for d in PACKABLE for i in QUANT_ISAS])
def test_packed_matmul_equals_row_major(dt, isa):
    K, N_ = _cols(dt, 5), 48
    w = _weight(dt, N_, K, 2)
    p = _packed(w, dt)
    rng = np.random.default_rng(3)
    for M in (1, 2, 3, 5, 8, 9, 17, 70):
        x = rng.standard_normal((M, K)).astype(np.float32)
        ref = run_matmul(x, w, dt, isa, 1)
        for nt in (1, 3):
            g = N.Graph()
            we = g.external("w", dt, [N_, K], p, packed=True)
            g.output(g.matmul(g.input("x", F32, [M, K]), we), "y")
            pl = N.Plan(g, pool(nt))
            pl.set_input("x", x)
            with using_isa(isa):
                pl.run()
            _same(pl.output("y"), ref, f"{dname(dt)} {isa} M={M} threads={nt}")


@pytest.mark.parametrize("dt,isa", [(d, i) for d in PACKABLE for i in QUANT_ISAS],
                         ids=[f"{dname(d)}-{i}" for d in PACKABLE for i in QUANT_ISAS])
def test_packed_experts_in_matmul_id(dt, isa):
    """3-D experts [E, N, K] packed as their [E * N, K] matrix (N % 16 == 0): matmul_id gives the
    row-major experts' results bit for bit, for decode (one token) and prompt-sized batches."""
    E, N_, K, k = 5, 32, _cols(dt, 3), 2
    w = _weight(dt, E * N_, K, 8)
    p = _packed(w, dt)
    rng = np.random.default_rng(9)
    for T in (1, 3, 40):
        x = rng.standard_normal((T, K)).astype(np.float32)
        ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        out = {}
        for pk in (False, True):
            g = N.Graph()
            we = g.external("w", dt, [E, N_, K], p if pk else w, packed=pk)
            g.output(g.matmul_id(g.input("x", F32, [T, K]), we, g.input("ids", I32, [T, k])), "y")
            pl = N.Plan(g, pool(2))
            pl.set_input("x", x)
            pl.set_input("ids", ids)
            with using_isa(isa):
                pl.run()
            out[pk] = pl.output("y")
        _same(out[True], out[False], f"{dname(dt)} {isa} T={T}")
        # and each (token, slot) equals a plain matmul with that expert
        for t, j in ((0, 0), (T - 1, k - 1)):
            e = int(ids[t, j])
            _same(out[True][t, j], run_matmul(x[t:t + 1], w[e * N_:(e + 1) * N_], dt, isa, 1)[0],
                  f"{dname(dt)} {isa} T={T} ({t}, {j})")


FUSED = {128: [(Q4_1, 32, True), (Q8_0, 16, False), (Q4_0, 16, True)],
         256: [(Q4_K, 32, True), (Q6_K, 16, False), (Q5_K, 16, True), (Q6_K, 16, True), (Q4_0, 16, True)]}


@pytest.mark.parametrize("isa", QUANT_ISAS)
@pytest.mark.parametrize("K", sorted(FUSED))
def test_packed_weights_in_a_fused_run(isa, K):
    """Packed and row-major weights of one activation run as one fused kernel (q / k / v)."""
    specs = FUSED[K]
    ws = [_weight(dt, n, K, 10 + i) for i, (dt, n, _) in enumerate(specs)]
    rng = np.random.default_rng(4)
    for M in (1, 5, 17):
        x = rng.standard_normal((M, K)).astype(np.float32)
        g = N.Graph()
        xt = g.input("x", F32, [M, K])
        for i, ((dt, n, pk), w) in enumerate(zip(specs, ws)):
            g.output(g.matmul(xt, g.external(f"w{i}", dt, [n, K], _packed(w, dt) if pk else w, packed=pk)), f"o{i}")
        pl = N.Plan(g, pool(2))
        pl.set_input("x", x)
        with using_isa(isa):
            pl.run()
        for i, ((dt, _, _), w) in enumerate(zip(specs, ws)):
            _same(pl.output(f"o{i}"), run_matmul(x, w, dt, isa, 1), f"{isa} M={M} output {i}")


@pytest.mark.parametrize("dt", PACKABLE, ids=dname)
def test_packed_get_rows(dt):
    """An embedding table that is also the output matrix (tied weights) can stay packed."""
    K = _cols(dt, 3)
    w = _weight(dt, 64, K, 5)
    ids = np.array([0, 15, 16, 17, 63, 40, 40, 1], dtype=np.int32)
    out = {}
    for pk in (False, True):
        g = N.Graph()
        t = g.external("t", dt, [64, K], _packed(w, dt) if pk else w, packed=pk)
        g.output(g.get_rows(t, g.input("ids", I32, [ids.size])), "y")
        pl = N.Plan(g, pool(2))
        pl.set_input("ids", ids)
        pl.run()
        out[pk] = pl.output("y")
    _same(out[True], out[False], f"{dname(dt)} get_rows")
    np.testing.assert_array_equal(out[False], N.dequantize_tensor(dt, w, 64, K)[ids])


def test_packed_tensors_are_refused_elsewhere():
    w = _weight(Q4_1, 32, 64, 6)
    g = N.Graph()
    t = g.external("t", Q4_1, [32, 64], _packed(w, Q4_1), packed=True)
    with pytest.raises(ValueError, match="packed weight"):
        g.view(t, [16, 64], [w.shape[1], 1], 0)
    with pytest.raises(ValueError, match="packed weight"):
        g.cpy(t, F32)
    with pytest.raises(ValueError, match="packed"):
        g.external("q5_0", N.DType.Q5_0, [16, 256], np.zeros((16, 176), np.uint8), packed=True)
    with pytest.raises(ValueError, match="packed"):
        g.external("odd", Q4_1, [24, 64], np.zeros((24, 40), np.uint8), packed=True)
    with pytest.raises(ValueError, match="packed"):  # experts whose rows are not a multiple of 16
        g.external("odd_exps", Q4_1, [2, 24, 64], np.zeros((48, 40), np.uint8), packed=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        N.pack_x16(Q4_1, np.zeros((24, 40), np.uint8), 24, 64)


@pytest.mark.skipif(not hasattr(N, "read_pack"), reason="read_pack needs a POSIX pread")
def test_read_pack_reads_and_packs_like_pack_x16(tmp_path):
    """The loader's native read: the bytes of [a, b) come from the file at the given offset, and
    the packed tensors in it end up exactly as pack_x16 leaves them, however the range is cut
    into parts (at chunk boundaries) and whatever lies between the tensors."""
    w1, w2 = _weight(Q4_0, 48, 64, 1), _weight(Q6_K, 32, 256, 2)
    gap = np.arange(100, dtype=np.uint8)
    body = np.concatenate([gap, w1.reshape(-1), gap[:36], w2.reshape(-1), gap[:7]])
    head = 4096 + 13  # the tensor data does not start the file
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(head) + body.tobytes())
    s1, s2 = 100, 100 + w1.size + 36
    packs = [(s1, s1 + w1.size, w1.size // 3, Q4_0, 64), (s2, s2 + w2.size, w2.size // 2, Q6_K, 256)]
    want = body.copy()
    want[s1:s1 + w1.size] = _packed(w1, Q4_0).reshape(-1)
    want[s2:s2 + w2.size] = _packed(w2, Q6_K).reshape(-1)
    stop = np.zeros(1, np.uint8)
    for cuts in ([0, body.size], [0, s1 + w1.size // 3, s2 + w2.size // 2, body.size]):
        got = np.full(body.size, 0xAA, np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            for a, b in zip(cuts, cuts[1:]):
                N.read_pack(fd, got, a, b, head, [p for p in packs if p[1] > a and p[0] < b], stop)
        finally:
            os.close(fd)
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not hasattr(N, "read_pack"), reason="read_pack needs a POSIX pread")
def test_read_pack_errors(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(200)))
    buf = np.zeros(256, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="file ended at byte 200"):
            N.read_pack(fd, buf, 0, 256, 0, [], np.zeros(1, np.uint8))
        np.testing.assert_array_equal(buf[:200], np.arange(200))  # what was there is read
        with pytest.raises(RuntimeError, match="exiting"):  # the stop flag, set at interpreter exit
            N.read_pack(fd, np.zeros(16, np.uint8), 0, 16, 0, [], np.ones(1, np.uint8))
        with pytest.raises(ValueError, match="does not fit"):
            N.read_pack(fd, buf, 0, 300, 0, [], np.zeros(1, np.uint8))
        with pytest.raises(ValueError, match="bad packed tensor"):  # chunk size not 16 rows
            N.read_pack(fd, buf, 0, 64, 0, [(0, 40, 40, Q4_1, 64)], np.zeros(1, np.uint8))
        big = np.zeros(2 * 640, np.uint8)  # two 16-row Q4_1 chunks of 64 columns
        with pytest.raises(ValueError, match="bad packed tensor"):  # out of order: one would be skipped
            N.read_pack(fd, big, 0, 1280, 0, [(640, 1280, 640, Q4_1, 64), (0, 640, 640, Q4_1, 64)],
                        np.zeros(1, np.uint8))
        with pytest.raises(ValueError, match="cuts a 16-row chunk"):
            N.read_pack(fd, big, 0, 700, 0, [(0, 1280, 640, Q4_1, 64)], np.zeros(1, np.uint8))
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="reading the file failed"):
        N.read_pack(-1, buf, 0, 16, 0, [], np.zeros(1, np.uint8))


def test_read_cuts_split_on_chunk_boundaries():
    """The loader's part boundaries (models/base._read_cuts): ascending from 0 to the size, one part
    per 64 MiB up to the thread cap, and never inside a 16-row chunk of a packed tensor (a chunk
    split between two threads would be packed from half-read bytes)."""
    from pyfast.models.base import _LOAD_THREADS, _read_cuts

    M = 1 << 20
    assert _read_cuts(10 * M, []) == [0, 10 * M]  # under 64 MiB: one part
    total = 4466 * M
    # tensors of odd chunk sizes laid end to end, with gaps between some of them
    packs, s = [], 5 * M + 123
    rng = np.random.default_rng(0)
    while s < total - 300 * M:
        cb = int(rng.integers(1, 40)) * 16 * 210
        n = int(rng.integers(100, 4000))
        packs.append((s, s + n * cb, cb, Q4_1, 256))
        s += n * cb + int(rng.integers(0, 3)) * 4096
    cuts = _read_cuts(total, packs)
    assert len(cuts) == _LOAD_THREADS + 1 and cuts[0] == 0 and cuts[-1] == total
    assert all(a <= b for a, b in zip(cuts, cuts[1:]))
    for c in cuts:
        for st, en, cb, *_ in packs:
            if st < c < en:
                assert (c - st) % cb == 0, (c, st, cb)
    # the parts stay near-even (a part is at most one chunk past its 2 MiB-rounded share)
    share = -(-total // _LOAD_THREADS)
    step = -(-share // (2 * M)) * (2 * M)
    assert max(b - a for a, b in zip(cuts, cuts[1:])) <= step + max(p[2] for p in packs)
