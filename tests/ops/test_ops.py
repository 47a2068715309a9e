"""Every declared op case (cases.py) x every ISA this CPU has x 1 and 3 threads, against the
float64 numpy reference, with sentinels around the output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .cases import ACCEPTS, CASES
from .harness import (
    F16, F32, I32, ISAS, OPS, THREADS, TOL_F32, Arg, Case, N, Tol, attention_ref, check, decode, dname,
    encode, make_leaf, op_names, pool, rope_ref, roundtrip, run_case,
)


def _params():
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        for isa in ISAS:
            for nt in THREADS:
                yield pytest.param(case, isa, nt, id=f"{case.id}-{isa}-t{nt}", marks=marks)


@pytest.mark.parametrize("case,isa,n_threads", list(_params()))
def test_op(case: Case, isa: str, n_threads: int):
    r = run_case(case, isa, n_threads)
    check(r.out, r.ref, case.tol, f"{case.id} [{isa}, {n_threads} threads]")


def test_case_ids_unique():
    ids = [c.id for c in CASES]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    assert not dup, f"duplicate case ids: {dup}"


def test_every_op_has_a_spec_and_cases():
    declared = op_names()
    assert declared, "could not parse ops.def"
    assert set(OPS) == set(declared), f"harness OPS {sorted(OPS)} vs ops.def {declared}"
    assert set(ACCEPTS) == set(declared)
    have = {c.op for c in CASES}
    assert set(declared) <= have, f"ops without cases: {sorted(set(declared) - have)}"


def test_dtype_coverage():
    """Each dtype each op accepts (per argument, and cpy's target) is exercised by a case."""
    missing = []
    for op, roles in ACCEPTS.items():
        for role, dts in roles.items():
            seen = set()
            for c in CASES:
                if c.op != op:
                    continue
                if role == "out":
                    seen.add(c.params["dtype"])
                elif role < len(c.args):
                    seen.add(c.args[role].dtype)
            for dt in dts - seen:
                missing.append(f"{op} arg {role}: {dname(dt)}")
    assert not missing, "untested dtypes: " + ", ".join(missing)


def test_odd_and_strided_shapes_covered():
    """Per op with a kernel: an odd size (1, 7, 33 or 65) and, where the op takes strided input,
    a permuted or padded view."""
    odd = {1, 7, 33, 65}
    no_views = {"reshape", "view", "permute"}
    for op in op_names():
        cs = [c for c in CASES if c.op == op]
        assert any(odd & set(a.shape) for c in cs for a in c.args), f"{op}: no odd-sized case"
        if op not in no_views:
            assert any(a.layout.tag for c in cs for a in c.args), f"{op}: no strided-view case"


def test_sentinels_are_armed():
    """The arena layout run_case relies on puts the op output between the two sentinels; if the
    planner changes, this says the out-of-bounds checks lost their teeth."""
    case = Case("scale", (Arg((7, 33)),), {"s": 2.0})
    r = run_case(case, ISAS[0], 1)
    assert r.sentinels_armed


def test_isas_include_scalar_and_best():
    assert ISAS[0] == "scalar"
    best = N.cpu_best_isa()
    assert best in ISAS or best == "scalar"


def test_plan_replay_with_new_inputs():
    """A plan is compiled once and replayed: the second run sees the new input data."""
    g = N.Graph()
    x = g.input("x", F32, [3, 33])
    g.output(g.rms_norm(x, 1e-6), "y")
    p = N.Plan(g, N.ThreadPool(1))
    rng = np.random.default_rng(0)
    for _ in range(2):
        a = rng.standard_normal((3, 33)).astype(np.float32)
        p.set_input("x", a)
        p.run()
        ref = a / np.sqrt(np.mean(a.astype(np.float64) ** 2, -1, keepdims=True) + np.float32(1e-6))
        check(p.output("y").astype(np.float64), ref, TOL_F32, "replay")


def _layout_args():
    seen = {}
    for c in CASES:
        for a in c.args:
            if a.layout.tag:
                seen.setdefault(a.tag, a)
    return [pytest.param(a, id=t) for t, a in sorted(seen.items())]


@pytest.mark.parametrize("arg", _layout_args())
def test_harness_layouts_match_graph_views(arg):
    """Harness self-check: the graph's view/permute of each strided input shows exactly the values
    the numpy reference is given."""
    lf = make_leaf(arg, "x", np.random.default_rng(1))
    g = N.Graph()
    g.output(lf.tensor(g), "v")
    p = N.Plan(g, pool(1))
    p.set_input("x", lf.base_raw)
    p.run()
    got = decode(p.output("v"), arg.dtype)
    assert got.shape == lf.vals.shape
    assert np.array_equal(got, lf.vals, equal_nan=False)


def test_chained_block_matches_numpy():
    """Ops composed as a model uses them (views of computed tensors, set_rows into an external
    F16 KV cache read back through a view, intermediates sharing the arena) against numpy."""
    T, E, H, HKV, Dh, n_past, n_ctx = 5, 64, 4, 2, 16, 6, 16
    n_kv = n_past + T
    rng = np.random.default_rng(42)
    x = rng.standard_normal((T, E)).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(E)).astype(np.float32)
    wq, wk, wv, wo = (encode(rng.standard_normal((n, E)) * 0.2, F16) for n in (H * Dh, HKV * Dh, HKV * Dh, E))
    kc = encode(rng.standard_normal((n_ctx, HKV, Dh)), F16)  # earlier tokens in rows 0..n_past-1
    vc = encode(rng.standard_normal((n_ctx, HKV, Dh)), F16)
    kc0, vc0 = decode(kc, F16), decode(vc, F16)
    pos = np.arange(n_past, n_kv, dtype=np.int32)
    mask = np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)

    g = N.Graph()
    xt = g.input("x", F32, [T, E])
    pt = g.input("pos", I32, [T])
    W = {n: g.external(n, F16, [w.shape[0], E], w) for n, w in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo))}
    h = g.mul(g.rms_norm(xt, 1e-5), g.input("gamma", F32, [E]))
    q = g.rope(g.reshape(g.matmul(h, W["wq"]), [T, H, Dh]), pt, Dh, mode=2)
    k = g.rope(g.reshape(g.matmul(h, W["wk"]), [T, HKV, Dh]), pt, Dh, mode=2)
    v = g.reshape(g.matmul(h, W["wv"]), [T, HKV * Dh])
    cache_k = g.external("kc", F16, [n_ctx, HKV, Dh], kc)
    cache_v = g.external("vc", F16, [n_ctx, HKV * Dh], vc)
    kw = g.set_rows(cache_k, k, pt)
    vw = g.set_rows(cache_v, v, pt)
    row = HKV * Dh * 2
    kview = g.view(kw, [n_kv, HKV, Dh], [row, Dh * 2, 2], 0)
    vview = g.view(vw, [n_kv, HKV, Dh], [row, Dh * 2, 2], 0)
    att = g.attention(q, kview, vview, g.input("mask", F32, [T, n_kv]), None, Dh ** -0.5)
    out = g.add(g.matmul(g.reshape(att, [T, H * Dh]), W["wo"]), xt)
    g.output(out, "out")
    g.output(g.argmax(out), "best")
    p = N.Plan(g, pool(3))
    for name, arr in (("x", x), ("pos", pos), ("gamma", gamma), ("mask", mask)):
        p.set_input(name, arr)
    p.run()

    f = lambda w: decode(w, F16)  # noqa: E731
    xd = x.astype(np.float64)
    hd = xd / np.sqrt(np.mean(xd ** 2, -1, keepdims=True) + np.float32(1e-5)) * gamma
    qd = rope_ref((hd @ f(wq).T).reshape(T, H, Dh), pos, Dh, mode=2)
    kd = rope_ref((hd @ f(wk).T).reshape(T, HKV, Dh), pos, Dh, mode=2)
    vd = (hd @ f(wv).T).reshape(T, HKV, Dh)
    K, V = kc0.copy(), vc0.reshape(n_ctx, HKV, Dh).copy()
    K[pos], V[pos] = roundtrip(kd, F16), roundtrip(vd, F16)
    ad = attention_ref(qd, K[:n_kv], V[:n_kv], mask, scale=Dh ** -0.5)
    want = ad.reshape(T, H * Dh) @ f(wo).T + xd
    tol = Tol(1e-6, 2e-3)  # K/V are rounded to f16 from f32 (kernel) vs f64 (reference) values
    check(p.output("out").astype(np.float64), want, tol, "block")
    assert np.array_equal(p.output("best"), np.argmax(p.output("out"), -1))
    # the cache rows written equal the f16 rounding of what was computed; the others are untouched
    kc_after = decode(kc, F16)
    assert np.array_equal(np.delete(kc_after, pos, 0), np.delete(kc0, pos, 0))
    check(kc_after[pos], K[pos], Tol(1e-6, 2e-3), "k cache rows")


_GUARD_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from ops.cases import CASES
from ops.harness import ISAS, check, run_case
bad = 0
for case in CASES:
    for isa in sorted({ISAS[0], ISAS[-1]}):
        for guard in ("after", "before"):
            print(f"{case.id} {isa} guard={guard}", flush=True)
            r = run_case(case, isa, 3, guard=guard)
            if case.xfail:
                continue
            try:
                check(r.out, r.ref, case.tol, case.id)
            except AssertionError as e:
                bad += 1
                print("FAIL", e, flush=True)
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs mmap + mprotect guard pages")
def test_no_reads_past_inputs():
    """Every case again, each leaf in memory flush against an inaccessible page (before or after
    it), so an over-read in a SIMD tail or a wrong stride crashes. Runs in a subprocess so that a
    crash is reported with the case that caused it."""
    tests_dir = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT, tests_dir], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    lines = proc.stdout.strip().splitlines()
    if proc.returncode < 0:
        pytest.fail(f"crashed (signal {-proc.returncode}) while running: {lines[-1] if lines else '?'}")
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    assert proc.returncode == 0, "\n".join(fails) or proc.stderr[-3000:]
