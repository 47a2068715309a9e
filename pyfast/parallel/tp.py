"""Tensor parallelism over processes: one rank's shard of a model, and the leader / follower
protocol that keeps the ranks' contexts in step.

Every rank builds the same graphs from its slice of the weights (``split.py``), with an
``allreduce`` after each layer's attention / GDN mixer and after its FFN; the plans are compiled
once and replayed, the reduces run inside them (no Python per reduce).

Rank 0 (the *leader*) owns everything else: tokenization, sampling, speculation (its drafters
run unsplit on rank 0 alone), the server. The other ranks (*followers*) only mirror its
contexts: each call that changes a context's memory or runs its model (``decode*``,
``truncate``, ``remove_seq``, ``clear``, ``save_state`` / ``restore_state``) is broadcast to the
followers before the leader makes it, and they make the same call on their own context, so their
memory bookkeeping (cells, masks, recurrent slots and planes) is identical and every rank runs
the same plans with the same inputs in the same order. A follower's saved states stay on the
follower, keyed by an id the leader's ``SeqState`` carries.
"""
from __future__ import annotations

import atexit
import itertools
import threading
import weakref

import numpy as np

from pyfast._loader import native
from pyfast.context import Context
from pyfast.parallel import split
from pyfast.parallel.comm import Group


class Shard:
    """One rank's part of a model: the split plan and the local slices of the split weights."""

    def __init__(self, model, group: Group):
        self.group = group
        self.weights = model.weights
        self.plan = split.plan(model.arch.ARCH, model.args, model.weights, group.rank, group.size)
        self.args = self.plan.args
        self._local: dict[str, tuple] = {}
        self._derived: dict[str, np.ndarray] = {}

    @property
    def comm_id(self) -> int:
        return self.group.comm_id

    def splits(self, name: str) -> bool:
        return name in self.plan.rules

    def empty(self, name: str) -> bool:
        """Whether this rank holds nothing of the block that weight ``name`` starts."""
        return name in self.plan.empty

    def local(self, name: str, mat: bool = False) -> tuple:
        """(dtype, shape, bytes, packed) of this rank's slice of a split weight (computed once;
        mat: a matmul weight, packed x16 for the kernels where the layout allows)."""
        key = name + ("#mat" if mat else "")
        got = self._local.get(key)
        if got is not None:
            return got
        src = name[5:] if name.startswith("head:") else name
        w = self.weights
        dt = w.dtype(src)
        data, shape = split.slice_bytes(dt, w.shape(src), w._file_bytes(src), self.plan.rules[name])
        if mat and data.nbytes >= (1 << 20):
            # a matmul weight in a buffer of its own in transparent huge pages, as the unsplit model
            # reads its weights (decode streams every weight once per token)
            buf = native.Buffer(data.nbytes, huge_pages=True)
            arr = np.frombuffer(buf, dtype=np.uint8)  # keeps buf alive
            arr[:] = data
            data = arr
        packed = False
        if mat and len(shape) == 2 and shape[0] % 16 == 0 and native.packable(dt):
            from pyfast.models.base import packing_enabled

            if packing_enabled():
                if not data.flags.writeable:  # a view of the mapped file: pack a copy
                    data = data.copy()
                native.pack_x16(dt, data, int(shape[0]), int(shape[1]))
                packed = True
        got = self._local[key] = (dt, shape, data, packed)
        return got

    def f32(self, name: str) -> np.ndarray:
        """This rank's slice of a split weight as float32 (a copy)."""
        dt, shape, data, _ = self.local(name)
        n_cols = shape[-1]
        out = native.dequantize_tensor(dt, data, int(np.prod(shape)) // n_cols, n_cols)
        return np.asarray(out, dtype=np.float32).reshape(shape)

    def derived(self, key: str, make) -> np.ndarray:
        arr = self._derived.get(key)
        if arr is None:
            arr = self._derived[key] = np.ascontiguousarray(make())
        return arr

    def head_range(self) -> tuple[str, int, int, int]:
        """(weight name, first vocab row, rows, n_vocab) of this rank's slice of the output head."""
        return self.plan.info["head"]


# --- leader / follower ---------------------------------------------------------------------------
# The context calls that change memory or run the model; the followers repeat them.
MIRRORED = ("decode", "decode_step", "decode_run", "truncate", "remove_seq", "clear", "save_state",
            "restore_state")

_ctx_ids = itertools.count(1)
_state_ids = itertools.count(1)
# contexts the leader no longer holds: the followers drop theirs (told with the next message;
# garbage collection must not broadcast in the middle of another collective)
_dropped_contexts: list[int] = []


def _take_dropped() -> list[int]:
    out = _dropped_contexts[:]
    del _dropped_contexts[:len(out)]
    return out


class TPContext(Context):
    """A Context on the leader of a tensor-parallel group: each mirrored call is broadcast to
    the followers before it runs here. Takes Context's arguments."""

    def __init__(self, model, group: Group | None = None, **kw):
        self.group = group
        self._tp_id = next(_ctx_ids)
        self._depth = 0
        self._owner = 0
        self._dropped: list[int] = []
        with group.lock:
            group.bcast(("context", self._tp_id, kw, _take_dropped()))
            super().__init__(model, **kw)
        weakref.finalize(self, _dropped_contexts.append, self._tp_id)

    def _send(self, name: str, args: tuple, kw: dict, extra=None) -> None:
        dropped, self._dropped = self._dropped, []
        self.group.bcast(("call", self._tp_id, name, args, kw, extra, dropped, _take_dropped()))

    def comm_stats(self) -> dict:
        return self.group.comm_stats()


def _mirrored(name: str):
    base = getattr(Context, name)

    def call(self, *args, **kw):
        if self._depth and self._owner == threading.get_ident():  # a call made by a mirrored call
            return base(self, *args, **kw)
        extra = None
        if name == "save_state":
            extra = next(_state_ids)
        elif name == "restore_state":
            st = args[1] if len(args) > 1 else kw.get("state")
            extra = getattr(st, "tp_key", None)
            if extra is None:
                raise ValueError("restore_state: under tensor parallelism a state must come from save_state of a "
                                 "context of the same group")
        args_out, kw_out = args, kw
        if name == "restore_state":  # the followers use their own part of the state
            args_out = (args[0],) if args else ()
            kw_out = {k: v for k, v in kw.items() if k != "state"}
        with self.group.lock:
            self._send(name, args_out, kw_out, extra)
            self._owner = threading.get_ident()
            self._depth += 1
            try:
                out = base(self, *args, **kw)
            finally:
                self._depth -= 1
        if name == "save_state":
            out.tp_key = extra
            weakref.finalize(out, self._dropped.append, extra)
        return out

    call.__name__ = name
    call.__doc__ = base.__doc__
    return call


for _n in MIRRORED:
    setattr(TPContext, _n, _mirrored(_n))


def stop_followers(group: Group) -> None:
    """Tell the followers to return from follow() (the leader calls it at exit)."""
    with group.lock:
        group.bcast(("stop",))


def follow(group: Group, model_loader) -> None:
    """A follower's main loop: load the model the leader names, make the contexts it makes and
    repeat its calls, until it stops. model_loader(path, **options) -> a Model with tp enabled."""
    model = None
    contexts: dict[int, Context] = {}
    states: dict[int, object] = {}
    while True:
        msg = group.bcast(None)
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "model":  # contexts made before keep the model they were made with
            _, path, opts = msg
            model = model_loader(path, **opts)
        elif kind == "context":
            _, cid, kw, gone = msg
            for c in gone:
                contexts.pop(c, None)
            contexts[cid] = Context(model, **kw)
        elif kind == "call":
            _, cid, name, args, kw, extra, dropped, gone = msg
            for k in dropped:
                states.pop(k, None)
            for c in gone:
                contexts.pop(c, None)
            ctx = contexts[cid]
            try:
                if name == "restore_state":
                    getattr(Context, name)(ctx, *args, state=states[extra], **kw)
                else:
                    out = getattr(Context, name)(ctx, *args, **kw)
                    if name == "save_state":
                        states[extra] = out
            except Exception:  # the leader makes the same call and reports the same error
                pass


def load_sharded(path: str, group: Group, **opts):
    """A Model of ``path`` with this rank's shard enabled (weights mapped, slices copied)."""
    from pyfast.models import Model

    model = Model(path, mmap=True)
    model.enable_tp(group)
    return model


def leader_group(n: int) -> Group:
    """The MPI group of a leader that wants ``n`` ranks: this process must be rank 0 of an
    ``mpirun -np n`` world."""
    from pyfast.parallel.comm import launched_by_mpi, mpi_group

    if not launched_by_mpi():
        raise ValueError(f"tp {n}: start the program with mpirun -np {n} (e.g. mpirun -np {n} pyfast generate "
                         f"--tp {n} ...)")
    group = mpi_group()
    if group.size != n:
        raise ValueError(f"tp {n}: this MPI world has {group.size} processes (mpirun -np {n})")
    if group.rank != 0:
        raise ValueError("tp: only rank 0 builds an LLM; the other ranks run pyfast.parallel.tp.follow")
    return group


def leader(path: str, group: Group, **opts):
    """On rank 0: tell the followers to load ``path`` and return the leader's sharded Model."""
    _register_stop(group)
    with group.lock:
        group.bcast(("model", str(path), opts))
        return load_sharded(path, group, **opts)


def _register_stop(group: Group) -> None:
    if not getattr(group, "_stop_registered", False):
        atexit.register(stop_followers, group)
        group._stop_registered = True


def follower_main(n: int) -> bool:
    """The CLI's entry under ``--tp n``: on ranks 1..n-1 follow rank 0 until it stops and return
    True; on rank 0 return False (it goes on to run the command as the leader)."""
    from pyfast.parallel.comm import launched_by_mpi, mpi_group

    if n < 1:
        raise ValueError(f"--tp must be >= 1, got {n}")
    if not launched_by_mpi():
        raise ValueError(f"--tp {n}: start pyfast with mpirun -np {n} (e.g. mpirun -np {n} pyfast generate --tp {n} ...)")
    group = mpi_group()
    if group.size != n:
        raise ValueError(f"--tp {n}: this MPI world has {group.size} processes (mpirun -np {n})")
    if group.rank == 0:
        _register_stop(group)
        return False
    follow(group, lambda path, **opts: load_sharded(path, group, **opts))
    return True
