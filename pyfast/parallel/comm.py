"""Communicators: the group of processes a tensor-parallel model is split over.

``Group`` wraps one communication engine for two jobs: the graph's ``allreduce`` op (a native
``Communicator`` registered by id, so compiled plans replay without Python) and the leader's
commands to the followers (``bcast``).

* ``mpi_group()``: MPI through mpi4py (Open MPI over shared memory on one host, TCP between
  hosts). The native communicator calls ``MPI_Allreduce`` of the MPI library mpi4py loaded,
  through its address and handle values: pyfast links no MPI library itself.
* ``local_group()``: one process (the single-rank path and tests).
* NCCL between GPUs: ``native/cuda/comm_nccl.cpp`` (compiled with the CUDA backend when the NCCL
  headers are found); see docs/tensor-parallel.md for its state.
"""
from __future__ import annotations

import ctypes
import os
import threading

from pyfast._loader import native


class Group:
    """rank / size, ``comm`` (the native Communicator for Graph.allreduce) and ``bcast``."""

    def __init__(self, rank: int, size: int, comm, bcast=None, barrier=None, kind: str = "local", gather=None):
        self.rank, self.size, self.comm, self.kind = rank, size, comm, kind
        self._bcast = bcast
        self._gather = gather
        # one collective sequence at a time: a leader's call (its broadcast and the allreduces
        # of its plans) must not interleave with another thread's (the server's embeddings)
        self.lock = threading.RLock()
        self._barrier = barrier

    @property
    def comm_id(self) -> int:
        return self.comm.id

    def bcast(self, obj=None):
        """obj from rank 0 on every rank (picklable)."""
        return obj if self._bcast is None else self._bcast(obj)

    def gather(self, obj):
        """Every rank's obj as a list on rank 0 (None elsewhere)."""
        return [obj] if self._gather is None else self._gather(obj)

    def barrier(self) -> None:
        if self._barrier is not None:
            self._barrier()

    def comm_stats(self) -> dict:
        return self.comm.stats()


def local_group() -> Group:
    return Group(0, 1, native.Communicator.local())


def _libmpi_path() -> str:
    """The MPI library mpi4py loaded into this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libmpi.so" in path:
                    return path
    except OSError:
        pass
    import ctypes.util

    name = ctypes.util.find_library("mpi")
    if not name:
        raise RuntimeError("tensor parallelism: cannot find the MPI library mpi4py uses (libmpi.so)")
    return name


_MPI_GROUP: Group | None = None


def mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def launched_by_mpi() -> bool:
    """Whether this process was started by mpirun / mpiexec (Open MPI, MPICH, Slurm's PMI)."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


def mpi_group() -> Group:
    """The MPI world as a Group (mpi4py initialises MPI on first use; one per process)."""
    global _MPI_GROUP
    if _MPI_GROUP is not None:
        return _MPI_GROUP
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("tensor parallelism over processes needs mpi4py (pip install mpi4py) and an MPI "
                           "library (apt-get install openmpi-bin libopenmpi-dev)") from e
    world = MPI.COMM_WORLD
    lib = ctypes.CDLL(_libmpi_path(), mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
    fn = ctypes.cast(lib.MPI_Allreduce, ctypes.c_void_p).value
    reduce_fn = ctypes.cast(lib.MPI_Reduce, ctypes.c_void_p).value
    comm = native.Communicator.mpi(fn, MPI._handleof(world), MPI._handleof(MPI.FLOAT), MPI._handleof(MPI.SUM),
                                   world.Get_rank(), world.Get_size(), reduce_fn=reduce_fn)
    _MPI_GROUP = Group(world.Get_rank(), world.Get_size(), comm, bcast=lambda o: world.bcast(o, root=0),
                       barrier=world.Barrier, kind="mpi", gather=lambda o: world.gather(o, root=0))
    return _MPI_GROUP


def nccl_library() -> str:
    """libnccl.so.2 to open: $PYFAST_NCCL_LIB, else the nvidia-nccl-cu13 wheel's, else the
    system's (the loader's search path)."""
    env = os.environ.get("PYFAST_NCCL_LIB")
    if env:
        return env
    try:
        import nvidia.nccl as wheel

        for d in wheel.__path__:
            cand = os.path.join(d, "lib", "libnccl.so.2")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return "libnccl.so.2"


def nccl_group(device: int | None = None) -> Group:
    """The MPI world with an NCCL communicator for the graphs' allreduce (GPU memory): rank r
    uses CUDA device ``device`` (default: r modulo the node's ranks, from Open MPI's
    OMPI_COMM_WORLD_LOCAL_RANK); MPI still carries the leader's commands. Needs pyfast built with
    the CUDA backend and NCCL (``native.has_nccl``) and a GPU per rank."""
    if not getattr(native, "has_nccl", False):
        raise RuntimeError("this pyfast was built without the NCCL communicator (CUDA backend + nccl.h at build time; "
                           "pip install nvidia-nccl-cu13 before building)")
    mpi = mpi_group()
    from mpi4py import MPI

    lib = nccl_library()
    uid = native.nccl_unique_id(lib) if mpi.rank == 0 else None
    uid = MPI.COMM_WORLD.bcast(uid, root=0)
    if device is None:
        device = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", mpi.rank))
    comm = native.Communicator.nccl(lib, uid, mpi.rank, mpi.size, device)
    return Group(mpi.rank, mpi.size, comm, bcast=mpi._bcast, barrier=mpi._barrier, kind="nccl", gather=mpi._gather)
