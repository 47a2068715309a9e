"""The kernels' exp (native/cpu/kernels/vexp.h): softmax in the fused attention, sigmoid, silu and
swiglu use it. Its scalar, AVX2 and AVX-512 forms must give the same bits (so those ops do not
depend on the ISA) and stay within 1.5 ulp of exp over the whole float range."""
from __future__ import annotations

import numpy as np

from tests.ops.harness import F32, ISAS, N, pool, using_isa


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(7)
    return np.concatenate([
        rng.standard_normal(4000) * 3, rng.uniform(-120, 100, 20000), np.linspace(-104.5, 89.0, 20001),
        [0.0, -0.0, 1e-30, -1e-30, 87.3, -87.3, -87.33654, -87.4, 88.72, 88.73, -103.9, -104.0, 200, -200,
         np.inf, -np.inf, np.nan],
    ]).astype(np.float32)


def _exp(x: np.ndarray, isa: str) -> np.ndarray:
    with using_isa(isa):
        return N.exp_f32(x)


def test_exp_identical_across_isas():
    x = _inputs()
    ref = _exp(x, "scalar")
    for isa in ISAS:
        np.testing.assert_array_equal(_exp(x, isa).view(np.uint32), ref.view(np.uint32), err_msg=isa)


def test_exp_accuracy_and_limits():
    x = _inputs()
    got = _exp(x, "scalar").astype(np.float64)
    want = np.exp(x.astype(np.float64))
    fin = np.isfinite(x)
    normal = fin & (want >= np.finfo(np.float32).tiny) & (want <= np.finfo(np.float32).max)
    ulp = np.abs(got[normal] - want[normal]) / (np.spacing(want[normal].astype(np.float32)).astype(np.float64))
    assert ulp.max() <= 1.5, ulp.max()
    # subnormal results: within one subnormal step of the float32-rounded value
    sub = fin & (want < np.finfo(np.float32).tiny)
    step = 2.0 ** -149
    assert np.all(np.abs(got[sub] - want[sub]) <= step), np.abs(got[sub] - want[sub]).max()
    # overflow, underflow, specials
    e = _exp(np.array([88.72, 88.73, 200.0, -104.0, -200.0, np.inf, -np.inf, np.nan, 0.0], np.float32), "scalar")
    assert np.isfinite(e[0]) and np.isinf(e[1]) and np.isinf(e[2])
    assert e[3] == 0.0 and e[4] == 0.0 and np.isinf(e[5]) and e[6] == 0.0 and np.isnan(e[7]) and e[8] == 1.0


def _run(op: str, x: np.ndarray, isa: str) -> np.ndarray:
    g = N.Graph()
    g.output(getattr(g, op)(g.input("x", F32, [1, x.size])), "y")
    p = N.Plan(g, pool(1))
    p.set_input("x", x.reshape(1, -1))
    with using_isa(isa):
        p.run()
    return p.output("y").reshape(-1)


def test_sigmoid_and_silu_identical_across_isas():
    x = _inputs()
    for op in ("sigmoid", "silu"):
        ref = _run(op, x, "scalar")
        for isa in ISAS:
            np.testing.assert_array_equal(_run(op, x, isa).view(np.uint32), ref.view(np.uint32), err_msg=f"{op} {isa}")
