"""NEON (aarch64) matmul kernels: bit-identical to the scalar reference mode (quant.h).

* On an aarch64 machine the NEON path runs in-process: quantized and float-weight matmuls on the
  neon ISA (with and without the dotprod extension) equal scalar bit for bit. Elsewhere these
  tests are skipped ("not available on this CPU").
* On any machine with an aarch64 cross compiler and qemu-user (aarch64-linux-gnu-g++,
  qemu-aarch64), native/bench/cross_aarch64.sh cross-compiles the standalone kernel test and runs
  its SIMD-vs-scalar sweep under qemu on a CPU model with dotprod (max) and one without
  (cortex-a57). Skipped when the tools are missing (CI does not install them).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .harness import F16, F32, K_QUANTS, QUANT, N, dname, encode, run_matmul

ROOT = Path(__file__).resolve().parents[2]
CROSS = ROOT / "native" / "bench" / "cross_aarch64.sh"


def _neon_available() -> bool:
    prev = N.cpu_isa()
    try:
        N.set_cpu_isa("neon")
        return True
    except (ValueError, RuntimeError):
        return False
    finally:
        N.set_cpu_isa(prev)


needs_neon = pytest.mark.skipif(not _neon_available(), reason="neon: not available on this CPU")


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{what}: {diff.size} elements differ (first flat index {diff[0]})"


def _data(dt, M, N_, seed):
    K = 512 if dt in K_QUANTS else 160 if dt in QUANT else 77
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    return x, encode(rng.standard_normal((N_, K)) * 0.2, dt)


@needs_neon
@pytest.mark.parametrize("dt", tuple(QUANT) + (F32, F16, N.DType.BF16), ids=dname)
def test_neon_matmul_equals_scalar(dt):
    """quant.h: neon results are bit-identical to scalar (quantized: every ISA; float: 16 lanes)."""
    for M, N_ in ((1, 19), (5, 33), (17, 7), (65, 40)):
        x, w = _data(dt, M, N_, seed=M * 100 + N_)
        ref = run_matmul(x, w, dt, "scalar", 1)
        _same(run_matmul(x, w, dt, "neon", 3), ref, f"{dname(dt)} M={M} N={N_}: neon vs scalar")


@needs_neon
def test_neon_reports_dotprod():
    feats = N.cpu_features()
    assert feats["neon"] and isinstance(feats["dotprod"], bool)


def _cross_tools_missing() -> str | None:
    for tool in (os.environ.get("CXX_AARCH64", "aarch64-linux-gnu-g++"), os.environ.get("QEMU", "qemu-aarch64")):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install g++-aarch64-linux-gnu qemu-user)"
    return None


@pytest.mark.skipif(_cross_tools_missing() is not None, reason=str(_cross_tools_missing()))
def test_neon_kernels_under_qemu(tmp_path_factory):
    """Cross-compiled kernel test, SIMD-vs-scalar sweep, under qemu with and without dotprod."""
    out = os.environ.get("PYFAST_CROSS_OUT") or str(Path(os.environ.get("TMPDIR", "/tmp")) / "pyfast_aarch64")
    env = dict(os.environ, OUT=out, JOBS=os.environ.get("JOBS", "2"), QEMU_CPUS="max cortex-a57")
    r = subprocess.run(["bash", str(CROSS), "sweep"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    runs = log.split("=== qemu-aarch64 -cpu ")
    assert len(runs) == 3, log[-2000:]
    max_run, a57_run = runs[1], runs[2]
    assert "dotprod=1" in max_run and "sweep neon+dotprod" in max_run and "sweep neon " in max_run, max_run[-2000:]
    assert "dotprod=0" in a57_run and "sweep neon " in a57_run and "neon+dotprod" not in a57_run, a57_run[-2000:]
    for run in (max_run, a57_run):
        assert ", 0 failures" in run, run[-2000:]
