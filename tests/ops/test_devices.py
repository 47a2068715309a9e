"""Every declared op case (cases.py) on every non-CPU device this build and machine have, against
the same float64 numpy reference the CPU is checked with (which the CPU reference mode passes).

A case whose op the device has no kernel for runs on the CPU inside the device plan; it is
reported as a skip naming the device and op, and the number of such skips per device is printed
at the end of the run (tests/conftest.py).

Device tolerances (DEVICE_TOL, per output dtype): float kernels on a GPU use the device's exp /
pow / sin / cos, whose precision Vulkan leaves to the driver (a few ULP, more for large
arguments), and reduce in a different order than the CPU; so a float result may differ from the
reference by up to ~1e-4 of the output's scale. Exact cases (data movement, integer results)
stay exact. Quantized-weight matmul keeps its own tolerance.
"""
from __future__ import annotations

import pytest

from .cases import CASES
from .harness import EXACT, N, TOL_QMM, Tol, check, run_case

DEVICE_TOL_F32 = Tol(1e-8, 2e-4)
# Rope angles are computed in float32 on the device (the CPU uses float64): for positions in the
# thousands the angle carries ~1e-4 relative error.
DEVICE_TOL_ROPE = Tol(1e-7, 2e-3)

SKIPPED: dict[str, int] = {}


def device_names() -> list[str]:
    """Every non-CPU device, or those named in PYFAST_TEST_DEVICES (comma-separated)."""
    import os

    names = [d["name"] for d in N.devices() if d["kind"] != "cpu"]
    only = os.environ.get("PYFAST_TEST_DEVICES")
    return [n for n in names if n in only.split(",")] if only is not None else names


_opened: dict[str, object] = {}


def open_dev(name: str):
    if name not in _opened:
        _opened[name] = N.open_device(name)
    return _opened[name]


def device_tol(case) -> Tol:
    t = case.tol
    if t.exact or t == EXACT:
        return t
    if t == TOL_QMM:
        return t
    floor = DEVICE_TOL_ROPE if case.op == "rope" else DEVICE_TOL_F32
    return Tol(max(t.nmse, floor.nmse), max(t.max_err, floor.max_err))


def _params():
    devs = device_names()
    for dev in devs:
        for case in CASES:
            if case.xfail:
                continue
            yield pytest.param(case, dev, id=f"{case.id}-{dev}")


PARAMS = list(_params())


@pytest.mark.skipif(not PARAMS, reason="no non-CPU device: " + "; ".join(
    f"{b['kind']}: {b['unavailable'] or 'no device found'}" for b in N.backends()))
@pytest.mark.parametrize("case,dev", PARAMS or [pytest.param(None, None, id="none")])
def test_op_on_device(case, dev):
    r = run_case(case, N.cpu_best_isa(), 1, device=open_dev(dev))
    if case.op not in ("reshape", "view", "permute") and not r.on_device:
        SKIPPED[dev] = SKIPPED.get(dev, 0) + 1
        pytest.skip(f"{dev} has no {case.op} kernel for this case (ran on the CPU)")
    check(r.out, r.ref, device_tol(case), f"{case.id} [{dev}]")


QUANT_MATMUL = [c for c in CASES if c.op == "matmul" and N.dtype_block_size(c.args[1].dtype) > 1 and not c.xfail]


@pytest.mark.skipif(not PARAMS, reason="no non-CPU device")
@pytest.mark.parametrize("dev", device_names() or ["none"])
def test_quantized_matmul_uses_int8_products(dev):
    """A quantized-weight matmul runs as activation quantization + an integer-product kernel, with
    the device's packed dot product instruction when it has one (CUDA: __dp4a)."""
    d = open_dev(dev)
    if d.info["kind"] == "cuda":
        want = "matmul_q8_dp4a"
    else:
        want = "matmul_q8_dot" if d.info["integer_dot"] else "matmul_q8"
    for case in QUANT_MATMUL[:6]:
        from .harness import build_case, make_leaf, seed_of
        import numpy as np

        rng = np.random.default_rng(seed_of(case.id))
        leaves = [make_leaf(a, f"in{i}", rng) for i, a in enumerate(case.args)]
        g = N.Graph()
        g.output(build_case(g, case, leaves), "out")
        steps = N.Plan(g, N.ThreadPool(1), d).device_steps["steps"]
        assert "[quantize_q8]" in steps and f"[{want}]" in steps, steps


MATMUL_VARIANTS = {"vulkan": ["PYFAST_VULKAN_INT_DOT=0", "PYFAST_VULKAN_Q8=0"], "cuda": ["PYFAST_CUDA_Q8=0"]}
KINDS = sorted({n.split(":")[0] for n in device_names()})


@pytest.mark.skipif(not PARAMS, reason="no non-CPU device")
@pytest.mark.parametrize("env", [e for k in KINDS for e in MATMUL_VARIANTS.get(k, [])] or ["none"])
def test_matmul_variants(env):
    """The other matmul kernels (Vulkan: unpacked integer products, weights decoded to float;
    CUDA: weights decoded to float) pass every matmul case too (run in a subprocess: the switches
    are read when the device opens or the first plan compiles)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    k, v = env.split("=")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_op_on_device and matmul",
                        str(Path(__file__))], cwd=root, env={**os.environ, k: v}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
