"""The NCCL communicator (native/cuda/comm_nccl.cpp): compiled with the CUDA backend when nccl.h is
found at build time (the nvidia-nccl-cu13 wheel), libnccl opened at run time. Without a GPU only
the build is checked; with one, a one-rank NCCL group reduces host and device memory, and a graph's
allreduce runs on the GPU with it (tensor parallelism over several GPUs needs one GPU per rank)."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native


def _cuda_devices() -> list:
    return [d for d in native.devices() if d["kind"] == "cuda"]


def test_build_reports_nccl():
    assert isinstance(native.has_nccl, bool)
    cuda_built = any(b["kind"] == "cuda" for b in native.backends())
    if not cuda_built:
        assert native.has_nccl is False, "the NCCL communicator needs the CUDA backend"


needs_gpu = pytest.mark.skipif(not getattr(native, "has_nccl", False) or not _cuda_devices(),
                               reason="needs pyfast built with CUDA + NCCL and a CUDA device")


@needs_gpu
def test_one_rank_nccl_allreduce_on_the_gpu():
    from pyfast.parallel.comm import nccl_library

    lib = nccl_library()
    comm = native.Communicator.nccl(lib, native.nccl_unique_id(lib), 0, 1, 0)
    assert comm.kind == "nccl" and comm.on_device and comm.size == 1
    x = np.arange(1000, dtype=np.float32)
    assert np.array_equal(comm.allreduce(x), x)
    g = native.Graph()
    a = g.input("a", native.DType.F32, [7, 33])
    y = g.allreduce(g.scale(a, 2.0), comm.id)
    g.output(y, "y")
    dev = native.open_device("cuda:0") if hasattr(native, "open_device") else None
    from pyfast.device import open_device

    plan = native.Plan(g, native.ThreadPool(1), dev or open_device("cuda:0"), None)
    v = np.random.default_rng(0).standard_normal((7, 33)).astype(np.float32)
    plan.set_input("a", v)
    plan.run()
    assert np.array_equal(plan.output("y"), 2 * v)
    assert "allreduce" in str(plan.device_steps()), "the allreduce did not run on the GPU"
