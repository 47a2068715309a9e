"""Tensor parallelism: split plans (``split.py``), communicators (``comm.py``) and the
leader / follower protocol that runs one model over several processes (``tp.py``).
See docs/tensor-parallel.md."""
from pyfast.parallel.comm import Group, launched_by_mpi, local_group, mpi_available, mpi_group
from pyfast.parallel.split import SplitError, SplitPlan, plan, shares

__all__ = ["Group", "SplitError", "SplitPlan", "launched_by_mpi", "local_group", "mpi_available", "mpi_group", "plan",
           "shares"]
