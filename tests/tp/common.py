"""Launching the tensor-parallel worker (tests/tp/worker.py) under mpirun from pytest."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


def have_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


needs_mpi = pytest.mark.skipif(
    MPIRUN is None or not have_mpi4py(),
    reason="tensor-parallel tests need mpirun and mpi4py (apt-get install openmpi-bin libopenmpi-dev; "
           "pip install mpi4py)")


def mpi_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # Open MPI refuses root unless told (CI containers run as root); other MPIs ignore these
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # more ranks than cores (CI has 2)
    return env


def run_worker(n: int, checks: list[str], out: Path, timeout: int = 300, prefix: list[str] | None = None) -> list[dict]:
    """Run ``mpirun -np n python -m tests.tp.worker out checks...``; the parsed results."""
    cmd = [MPIRUN, "--oversubscribe", "-np", str(n)] + (prefix or []) + \
          [sys.executable, "-m", "tests.tp.worker", str(out)] + checks
    r = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not out.exists():
        raise AssertionError(f"mpirun -np {n} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)
