"""Shared graph builders for architecture files.

An architecture file declares its hyper-parameters (``Args``), the tensors it expects and a
``build(b, args)`` that wires layers from the helpers below. Shapes in comments are
outermost-first: ``[n_tokens, n_embd]``.
"""
from __future__ import annotations

import atexit
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from pyfast._loader import native

DType = native.DType


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    optional: bool = False


def _file_key(path: str) -> tuple | None:
    """Identity of a file's current contents: a rewritten file gets a new key."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_IN_MEMORY: dict[tuple, list] = {}  # file key -> weak references to the Weights holding it in memory

# Loader threads still running at interpreter exit are told to stop after their current slab and
# joined: a daemon thread that comes back from a native call (read_pack) while the interpreter
# finalizes is ended inside C++ and aborts the process.
_STOP_LOADERS = threading.Event()
_STOP_FLAG = np.zeros(1, np.uint8)  # the same, for native.read_pack (which holds no GIL to ask)
_LOADERS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


@atexit.register
def _stop_loaders() -> None:
    _STOP_LOADERS.set()
    _STOP_FLAG[0] = 1
    for t in list(_LOADERS):
        t.join()


# weights that graphs read only through matmul / get_rows (GraphBuilder.mat_weight), by the name
# between the block prefix and ".weight": packed by the loader as they are read
_MATMUL_NAMES = frozenset((
    "token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_gate",
    "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps",
    "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps", "ffn_gate_shexp", "ffn_up_shexp",
    "ffn_down_shexp", "ssm_in", "ssm_out"))


class _Packing:
    """Which tensors of one in-memory copy are packed (x16) and which were handed out row-major
    (never packed afterwards: a graph may read them). Shared by the Weights sharing the copy."""

    def __init__(self):
        self.packed: set[str] = set()
        self.row_major: set[str] = set()
        self.lock = threading.Lock()
        # tensors left in the file's mapping instead of the copy (Weights._keep_mapped), and the
        # copy's layout: (start, end, copy offset) of each run of copied bytes, data-section relative
        self.mapped: frozenset[str] = frozenset()
        self.segments: list[tuple[int, int, int]] = []
        self.collapser: threading.Thread | None = None  # collapsing the copy into huge pages
        # set after a graph first ran on these weights (Weights.computed): the collapse starts then
        self.computed = threading.Event()


def packing_enabled() -> bool:
    """Whether matmul weights are packed at load: on where the avx512 kernels read the packed layout
    (elsewhere it costs an unpack per use); PYFAST_PACK=0 / 1 forces it off / on."""
    env = os.environ.get("PYFAST_PACK")
    if env is not None and env != "":
        return env != "0"
    return native.cpu_isa() == "avx512"


_LOAD_THREADS = 8  # threads reading a file into memory (_read_all)


# Q6_K matmul weights stay mapped when they take at least _MAPPED_Q6K_MIN_BYTES and at most
# _MAPPED_Q6K_SHARE of a file's tensor bytes (Weights._keep_mapped)
_MAPPED_Q6K_MIN_BYTES = 512 << 20
_MAPPED_Q6K_SHARE = 1 / 3


def _keep_mapped_policy() -> str:
    """PYFAST_KEEP_MAPPED: "auto" (default; see ``Weights._keep_mapped``) or "none" (copy every
    tensor)."""
    v = os.environ.get("PYFAST_KEEP_MAPPED", "") or "auto"
    if v not in ("auto", "none"):
        raise ValueError(f"PYFAST_KEEP_MAPPED={v!r}: expected auto or none")
    return v


def _segments(total: int, holes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The runs of [0, total) outside ``holes`` ([start, end) pairs, any order, may touch), as
    (start, end, offset in a buffer holding only the runs, back to back)."""
    segs, pos, at = [], 0, 0
    for a, b in sorted(holes):
        if a > pos:
            segs.append((pos, a, at))
            at += a - pos
        pos = max(pos, b)
    if total > pos:
        segs.append((pos, total, at))
    return segs


def _read_cuts(total: int, packs: list[tuple], part_bytes: int = 64 << 20) -> list[int]:
    """Where the threads of ``Weights._read_all`` split a tensor-data section of ``total`` bytes:
    one part per ``part_bytes``, at most _LOAD_THREADS, in whole 2 MiB pages, each boundary moved forward
    to a 16-row chunk boundary of the packed tensor it falls in (``packs``: (start, end, chunk
    bytes, ...) as ``_eager_pack`` gives them), so that every chunk is read and packed by one
    thread. Returns the ascending offsets [0, ..., total]; parts may be empty."""
    parts = max(1, min(_LOAD_THREADS, total // part_bytes))
    step = -(-total // parts)
    step = -(-step // (2 << 20)) * (2 << 20)
    cuts = [0]
    for i in range(1, parts):
        c = min(i * step, total)
        for s, e, cb, *_ in packs:
            if s < c < e:
                c = min(e, s + -(-(c - s) // cb) * cb)
                break
        cuts.append(max(c, cuts[-1]))
    cuts.append(total)
    return cuts


def _weight_pages() -> str:
    """How weights read into memory get their pages (PYFAST_WEIGHT_PAGES): "collapse" (default):
    read into 4 KiB pages, then moved into transparent huge pages by a background thread at the
    lowest priority (``Buffer.collapse``); "fault": advised huge before the read, so that the read
    faults in huge pages; "small": 4 KiB pages only. On a VM whose host takes back free guest
    memory, a fresh huge page can stall its first touch for a long time (0.64 GB: 0.17-11 s in
    huge pages against a steady 0.4-0.7 s in 4 KiB pages): "collapse" keeps that off the way to
    the first token, and decode runs on the 4 KiB pages until the huge ones are ready."""
    v = os.environ.get("PYFAST_WEIGHT_PAGES", "") or "collapse"
    if v not in ("collapse", "fault", "small"):
        raise ValueError(f"PYFAST_WEIGHT_PAGES={v!r}: expected collapse, fault or small")
    return v


# the longest the collapse waits for a first graph run before it starts anyway (_collapse)
_COLLAPSE_WAIT_S = 10.0


def _collapse(ref, lock: threading.Lock, go: threading.Event) -> None:
    """Move a weights buffer (a weak reference: dropping the weights ends this) into huge pages,
    16 MiB at a time (a prompt stop at exit), at the lowest priority: decode threads take the
    cores first. ``lock`` is the one lazy packing writes under (``Weights.matmul_data``): a write
    between the copy and the page move would be lost, so collapse holds it for those two steps.
    It starts once ``go`` is set (the first graph run: the prompt of the first request), or after
    _COLLAPSE_WAIT_S: its fresh huge pages slowed the first prompt of an 8B-class file on a VM
    whose host had taken the memory back (0.45-0.74 s against 0.27-0.36 s without a collapse)."""
    t_end = time.monotonic() + _COLLAPSE_WAIT_S
    while not go.is_set() and time.monotonic() < t_end:
        if _STOP_LOADERS.wait(0.05):
            return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
    except (OSError, AttributeError):
        pass
    off = 0
    while not _STOP_LOADERS.is_set():
        buf = ref()
        if buf is None or off >= buf.nbytes:
            return
        n = min(16 << 20, buf.nbytes - off)
        if not buf.collapse(off, n, lock) and off == 0 and buf.nbytes > n:
            return  # no transparent huge pages here (or refused): the pages stay 4 KiB
        off += n
        del buf


class Weights:
    """Model tensors: read into one host buffer in huge pages (``in_memory``; a few kinds of tensor
    stay mapped, ``_keep_mapped``), or mapped from the GGUF file (no copies)."""

    def __init__(self, reader, in_memory: bool = False):
        self.reader = reader
        self.info = reader.tensors  # name -> info(name, type, shape, offset, nbytes)
        self._bytes: dict[str, np.ndarray] = {}
        self._derived: dict[str, np.ndarray] = {}
        self._host: np.ndarray | None = None  # the file's tensor-data section, when in memory
        self._loader: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._share: Weights | None = None  # another live Weights of the same file to take it from
        self._pack: _Packing | None = None    # in memory only: packed-layout bookkeeping
        if in_memory:
            # one copy per file and process, as a mapping would be (a target and a draft model
            # of one file, several LLM objects)
            key = _file_key(reader.path)
            refs = _IN_MEMORY.setdefault(key, []) if key is not None else []
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                self._share = refs[0]()
                self._pack = self._share._pack
            else:
                self._pack = _Packing()
                pages = _weight_pages()  # a bad PYFAST_WEIGHT_PAGES fails here, not at first use
                self._pack.mapped = self._keep_mapped(_keep_mapped_policy())
                base = int(reader.data_offset)
                holes = [(int(self.info[n].offset) - base, int(self.info[n].offset) - base + int(self.info[n].nbytes))
                         for n in self._pack.mapped]
                self._pack.segments = _segments(max(int(reader.file_size) - base, 0), holes)
                # the mapped tensors' pages are mapped in meanwhile (the first decode reads them)
                reader.prefetch([(int(self.info[n].offset), int(self.info[n].nbytes)) for n in self._pack.mapped])
                # read on a background thread (file reads release the GIL) while the caller
                # builds the tokenizer; data() waits for it
                self._loader = threading.Thread(target=self._read_all, args=(pages,), name="pyfast-weights",
                                                daemon=True)
                _LOADERS.add(self._loader)
                self._loader.start()
            refs.append(weakref.ref(self))

    def _keep_mapped(self, policy: str) -> frozenset[str]:
        """Tensors an in-memory copy leaves in the file's mapping: they cost no fresh memory and no
        copy at start-up (a mapped file's pages are the page cache's). "auto": the token embedding
        when the file has a separate output matrix (only the prompt's rows are read), and the 2-D
        Q6_K matmul weights of a large K-quant mix: at least _MAPPED_Q6K_MIN_BYTES of them, at most
        _MAPPED_Q6K_SHARE of the tensor bytes (an 8B Q4_K_M: 0.99 GB, a fifth, the part
        llama.cpp's CPU backend leaves mapped too). The row-major one-row kernel
        (``xt_q6k_row_rm``) reads them 0.75-0.9x as fast as the packed copy at 1 thread (8B Q4_K_M
        decode: 0.86-0.95x at 1 thread, unchanged at 2), while not copying them took an 8B
        file's first token from 1.2-1.7x llama.cpp's time to 0.4-0.6x on this VM, whose fresh
        memory is slow; on a 1B Q4_K_M file (117 MB of Q6_K) decode lost up to 9% for a start-up
        saving of tens of milliseconds, so small files and files mostly of Q6_K are copied and
        packed. Nothing is left mapped where weights are not packed (other ISAs read every weight
        row-major from the copy)."""
        if policy == "none" or not packing_enabled():
            return frozenset()
        out, q6k, total = set(), [], 0
        for name, info in self.info.items():
            total += int(info.nbytes)
            stem = name.rsplit(".", 1)[0] if name.endswith(".weight") else ""
            if stem.split(".")[-1] not in _MATMUL_NAMES:
                continue
            if stem == "token_embd":
                if "output.weight" in self.info:
                    out.add(name)
            elif self.dtype(name) == DType.Q6_K and len(self.shape(name)) == 2:
                q6k.append(name)
        q6k_bytes = sum(int(self.info[n].nbytes) for n in q6k)
        if _MAPPED_Q6K_MIN_BYTES <= q6k_bytes <= _MAPPED_Q6K_SHARE * total:
            out.update(q6k)
        return frozenset(out)

    def _copy_offset(self, rel: int) -> int:
        """Where data-section offset ``rel`` of a copied tensor lies in the copy."""
        for s, e, at in self._pack.segments:
            if s <= rel < e:
                return at + rel - s
        raise KeyError(f"offset {rel} is not in the in-memory copy")

    def _read_all(self, pages: str) -> None:
        """Read the tensor-data section into a native buffer that ends up in transparent huge
        pages (``_weight_pages``): every decode streams all the weights, and mapped file pages are
        4 KiB. Files over 64 MiB are read in up to eight parts by as many threads, whatever the
        core count (``_read_cuts``): reads release the GIL, the kernel's page copies run in
        parallel (a cached 1.1 GB file took 0.15 s with two threads against 0.27 s with one), and
        the first touch of fresh memory, which on a VM can wait on the host, overlaps with the
        other threads' work (2 cores, a 4 GiB fill of memory the host had taken back: 6.8 s with
        2 threads, 5.8 with 4, 4.2-4.5 with 8). The matmul weights (``_eager_pack``) are packed
        slab by slab right after each slab is read, while the bytes are still in cache and off
        the start-up path (``native.read_pack``; the caller builds the tokenizer meanwhile).
        Tensors left mapped (``_keep_mapped``) are not read: the buffer holds the other runs of
        the section back to back (``_Packing.segments``)."""
        try:
            lo = int(self.reader.data_offset)
            segs = self._pack.segments
            copied = sum(e - s for s, e, _ in segs)
            total = max(copied, 1)
            if not hasattr(native.Buffer, "collapse"):  # an extension older than collapse()
                pages = "fault" if pages == "collapse" else pages
                buf = native.Buffer(total, huge_pages=pages == "fault")
            else:
                buf = native.Buffer(total, huge_pages=pages != "small", advise=pages == "fault")
            host = np.frombuffer(buf, dtype=np.uint8)
            packs, eager = self._eager_pack()  # [(start, end, chunk bytes, dtype, n_cols)] by start, names
            # in copy offsets (a packed tensor lies inside one run of copied bytes)
            packs = [(self._copy_offset(s), self._copy_offset(s) + e - s, *rest) for s, e, *rest in packs]
            cuts = _read_cuts(copied, packs)
            # each run of copied bytes with its packed tensors, in offsets within the run
            runs = [(s, e, at, [(ps - at, pe - at, *rest) for ps, pe, *rest in packs if at <= ps and pe <= at + e - s])
                    for s, e, at in segs]
            errors: list[BaseException] = []
            fd = os.open(self.reader.path, os.O_RDONLY)
            try:
                def part(a: int, b: int) -> None:
                    # one native call per part and run of copied bytes, without the GIL: a Python
                    # loop over the slabs took the GIL back between them from the main thread
                    # building the tokenizer (a 95 MB file loaded in 0.12-0.25 s alone, 2.3-2.7 s
                    # beside a busy Python thread)
                    try:
                        for s, e, at, run_packs in runs:
                            end = at + e - s
                            x, y = max(a, at), min(b, end)
                            if x < y:
                                native.read_pack(fd, host[at:end], x - at, y - at, lo + s, run_packs, _STOP_FLAG)
                    except ValueError as e:
                        errors.append(ValueError(f"{self.reader.path}: {e}"))
                    except BaseException as e:
                        errors.append(e)

                helpers = [threading.Thread(target=part, args=(cuts[i], cuts[i + 1]), name="pyfast-weights",
                                            daemon=True) for i in range(1, len(cuts) - 1) if cuts[i] < cuts[i + 1]]
                for t in helpers:
                    t.start()
                part(cuts[0], cuts[1])
                for t in helpers:
                    t.join()
            finally:
                os.close(fd)
            if errors:
                raise errors[0]
            pk = self._pack  # always set here: only Weights read into memory run _read_all
            with pk.lock:
                pk.packed.update(eager)
            self._host = host  # keeps buf alive
            if pages == "collapse":
                t = threading.Thread(target=_collapse, args=(weakref.ref(buf), pk.lock, pk.computed),
                                     name="pyfast-thp", daemon=True)
                _LOADERS.add(t)
                pk.collapser = t
                t.start()
        except BaseException as e:  # re-raised by the first data() call
            self._load_error = e

    def _packable(self, name: str) -> bool:
        """Whether matmul_data packs this tensor (x16 layout, see cpu/quant/quant.h)."""
        shape = self.shape(name)
        return len(shape) in (2, 3) and shape[-2] % 16 == 0 and native.packable(self.dtype(name)) \
            and packing_enabled()

    def _eager_pack(self) -> tuple[list[tuple], list[str]]:
        """The tensors packed while they are read: the usual matmul weights (by name; any other
        is packed the first time a graph reads it as one, as before), as (start, end, chunk bytes,
        dtype, n_cols) in file order, and their names. Correctness never depends on this list: a
        packed tensor read row-major gets an unpacked copy."""
        out, names = [], []
        if self._pack is None:  # mapped: nothing is packed
            return out, names
        base = int(self.reader.data_offset)
        for name, info in self.info.items():
            stem = name.rsplit(".", 1)[0] if name.endswith(".weight") else ""
            if stem.split(".")[-1] not in _MATMUL_NAMES or name in self._pack.mapped or not self._packable(name):
                continue
            shape = self.shape(name)
            rows = int(np.prod(shape[:-1]))
            s = int(info.offset) - base
            e = s + int(info.nbytes)
            out.append((s, e, (e - s) // (rows // 16), self.dtype(name), int(shape[-1])))
            names.append(name)
        return sorted(out, key=lambda x: x[0]), names

    def _wait_loaded(self) -> None:
        if self._share is not None:
            self._share._wait_loaded()
            self._host, self._share = self._share._host, None  # the array keeps the buffer alive
        if self._loader is not None:
            self._loader.join()
            self._loader = None
        if self._load_error is not None:
            raise self._load_error

    def settle(self) -> None:
        """Wait for the in-memory copy to be read and in huge pages (the background collapse of
        ``_weight_pages``): a benchmark measures decode on the pages it will keep."""
        if self._pack is None:
            return
        self._wait_loaded()
        t = self._pack.collapser
        if t is not None:
            self._pack.computed.set()
            t.join()

    def computed(self) -> None:
        """A graph ran on these weights: the background move into huge pages may start."""
        if self._pack is not None:
            self._pack.computed.set()

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def dtype(self, name: str) -> "native.DType":
        return DType(self.info[name].type)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.info[name].shape)

    def data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as in the file (read-only uint8)."""
        pk = self._pack
        if pk is not None:
            self._wait_loaded()  # the loader packs tensors as it reads them
        if pk is not None and name not in pk.row_major:
            with pk.lock:
                if name in pk.packed:  # a row-major copy (kept: graphs may reference it)
                    return self.derived(name + "#row-major", lambda: self._unpacked(name))
                pk.row_major.add(name)
        return self._raw(name)

    def _unpacked(self, name: str) -> np.ndarray:
        shape = self.shape(name)
        rows = int(np.prod(shape[:-1]))  # 3-D experts: each expert's rows were packed on their own
        out = native.unpack_x16(self.dtype(name), self._raw(name), rows, int(shape[-1])).reshape(-1)
        out.flags.writeable = False
        return out

    def _file_bytes(self, name: str) -> np.ndarray:
        """The bytes as in the file without handing the tensor out (a copy when it is packed)."""
        pk = self._pack
        if pk is not None:
            self._wait_loaded()
        if pk is not None and name in pk.packed:
            return self._unpacked(name)
        return self._raw(name)

    def matmul_data(self, name: str) -> tuple[np.ndarray, bool]:
        """The bytes of a weight read only by matmul / get_rows, and whether they are packed (x16,
        see cpu/quant/quant.h): an in-memory Q4_0 / Q4_1 / Q8_0 2-D tensor whose rows are a multiple
        of 16 is packed in place the first time, unless it was handed out row-major before. A 3-D
        [E, N, K] expert tensor with N a multiple of 16 is packed as its [E * N, K] matrix, which
        keeps every 16-row chunk inside one expert."""
        pk = self._pack
        if pk is None:
            return self.data(name), False
        self._wait_loaded()
        with pk.lock:
            if name in pk.packed:
                return self._raw(name), True
            shape = self.shape(name)
            dt = self.dtype(name)
            if name not in pk.row_major and name not in pk.mapped and self._packable(name):
                arr = self._raw(name)
                o = self._copy_offset(int(self.info[name].offset) - int(self.reader.data_offset))
                native.pack_x16(dt, self._host[o: o + arr.size], int(np.prod(shape[:-1])), int(shape[-1]))
                pk.packed.add(name)
                return arr, True
            pk.row_major.add(name)
        return self._raw(name), False

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's bytes in this copy, whatever their layout (read-only uint8)."""
        arr = self._bytes.get(name)
        if arr is None:
            self._wait_loaded()
            if self._host is not None and name not in self._pack.mapped:
                info = self.info[name]
                o = self._copy_offset(int(info.offset) - int(self.reader.data_offset))
                arr = self._host[o: o + int(info.nbytes)]
                arr.flags.writeable = False
            else:
                arr = self.reader.tensor_bytes(name)
            self._bytes[name] = arr
        return arr

    def f32(self, name: str) -> np.ndarray:
        """The tensor as a float32 numpy array (a copy; quantized types are dequantized)."""
        info = self.info[name]
        shape = tuple(info.shape)
        n_cols = shape[-1] if shape else 1
        out = native.dequantize_tensor(self.dtype(name), self._file_bytes(name), int(np.prod(shape)) // n_cols, n_cols)
        return np.asarray(out, dtype=np.float32).reshape(shape)

    def derived(self, key: str, make) -> np.ndarray:
        """An array computed once from the file's tensors (a load-time repack for a kernel's
        preferred layout), kept alive as long as the weights so graphs may reference it."""
        arr = self._derived.get(key)
        if arr is None:
            arr = self._derived[key] = np.ascontiguousarray(make())
        return arr

    def check(self, specs: list[TensorSpec], path: str) -> None:
        """Verify every expected tensor is present with the right shape before allocating."""
        for s in specs:
            if s.name not in self.info:
                if s.optional:
                    continue
                raise ValueError(f"{path}: missing tensor '{s.name}' (expected shape {list(s.shape)})")
            got = self.shape(s.name)
            if tuple(got) != tuple(s.shape):
                raise ValueError(f"{path}: tensor '{s.name}' has shape {list(got)}, expected {list(s.shape)}")


@dataclass
class BatchShape:
    n_tokens: int  # rows in this micro-batch
    n_kv: int      # visible cache cells
    n_out: int     # rows whose logits are returned
    n_seg: int = 0  # recurrent segments (one per sequence run) in this micro-batch; 0 = no recurrent memory
    n_kv_swa: int = 0  # visible cells of the sliding-window layers' own cache (0: they share the main one)


@dataclass(frozen=True)
class MemorySpec:
    """What memory a model needs: which layers attend over a KV cache (and its geometry) and which
    carry recurrent state (and its geometry). Layer indices are the model's own (``blk.{i}``); the
    caches number their layers in this order (attention layer ``attn_layers[j]`` is KV layer j)."""

    attn_layers: tuple[int, ...]
    n_head_kv: int
    head_dim: int
    head_dim_v: int | None = None
    v_in_k: bool = False   # values are the leading head_dim_v columns of the K rows (MLA)
    recurrent_layers: tuple[int, ...] = ()
    recurrent: "object | None" = None  # pyfast.memory.recurrent.RecurrentGeometry
    # sliding-window layers with a cache of their own, bounded to the window (Gemma; Context(...,
    # swa_full=False)); empty: they share the main cache and attend through a window mask
    swa_layers: tuple[int, ...] = ()
    swa_window: int = 0
    swa_n_head_kv: int = 0
    swa_head_dim: int = 0

    @property
    def is_recurrent(self) -> bool:
        return bool(self.recurrent_layers)


def _elem_stride(dt) -> int:
    """The innermost stride of a view in bytes (0 for block-quantized types)."""
    return 0 if native.dtype_block_size(dt) > 1 else native.dtype_type_size(dt)


class JointWeights:
    """Two models' tensors for one GraphBuilder: a drafter's own, and another model's (the
    target's) under names starting with ``prefix``."""

    def __init__(self, own, other, prefix: str):
        self.own, self.other, self.prefix = own, other, prefix

    def _src(self, name: str):
        return (self.other, name[len(self.prefix):]) if name.startswith(self.prefix) else (self.own, name)

    def __contains__(self, name: str) -> bool:
        w, n = self._src(name)
        return n in w

    def dtype(self, name):
        w, n = self._src(name)
        return w.dtype(n)

    def shape(self, name):
        w, n = self._src(name)
        return w.shape(n)

    def data(self, name):
        w, n = self._src(name)
        return w.data(n)

    def matmul_data(self, name):
        w, n = self._src(name)
        return w.matmul_data(n)


class GraphBuilder:
    """Wraps a native Graph with the inputs of one batch shape and layer helpers."""

    def __init__(self, weights: Weights, shape: BatchShape, kv=None, rec=None, export_hidden: bool = False,
                 control: dict[int, np.ndarray] | None = None, kv_swa=None, capture: tuple[int, ...] = (),
                 n_layer: int = 0, tp=None):
        self.g = native.Graph()
        self.tp = tp  # pyfast.parallel.tp.Shard: this rank's slices and its communicator (None: no split)
        self.control_vectors = control or {}  # 0-based layer -> vector added to its output
        self.w = weights
        self.shape = shape
        self.kv = kv
        self.rec = rec                      # RecurrentMemory or None
        self.export_hidden = export_hidden  # the arch outputs "hidden" (post-final-norm, every row)
        # feature capture (EAGLE-3 / DFlash drafters): the input rows of these layers (id n_layer:
        # the last layer's output before the output norm), every row, collected by control()
        self.capture_layers = tuple(capture)
        self.captured: dict[int, object] = {}
        # every row reaches the end of the trunk (the archs skip the head rows' selection)
        self.all_rows = export_hidden or (n_layer > 0 and n_layer in self.capture_layers)
        T, n_kv = shape.n_tokens, shape.n_kv
        g = self.g
        self.tokens = g.input("tokens", DType.I32, [T])       # [T]
        self.pos = g.input("pos", DType.I32, [T])             # [T]
        self.out_ids = g.input("out_ids", DType.I32, [shape.n_out])
        if kv is not None:
            self.kv_idx = g.input("kv_idx", DType.I32, [T * kv.n_head_kv])  # cache row of each (token, KV head)
            self.mask = g.input("mask", DType.F32, [T, n_kv])  # 0 / -inf
            self.kv_order = g.input("kv_order", DType.I32, [n_kv])
        if rec is not None:
            self.seqs = g.input("seqs", DType.I32, [shape.n_seg, 4])  # (t0, n, slot, src_plane)
        self.kv_swa = kv_swa  # the sliding-window layers' own (bounded) cache, or None
        if kv_swa is not None:
            n_swa = shape.n_kv_swa
            self.kv_idx_swa = g.input("kv_idx_swa", DType.I32, [T * kv_swa.n_head_kv])
            self.mask_swa = g.input("mask_swa", DType.F32, [T, n_swa])
            self.kv_order_swa = g.input("kv_order_swa", DType.I32, [n_swa])
        self._wcache: dict[str, object] = {}

    # --- weights ---------------------------------------------------------------------------
    def weight(self, name: str):
        t = self._wcache.get(name)
        if t is None:
            if self.tp is not None and self.tp.splits(name):
                dt, shape, data, _ = self.tp.local(name)
                t = self.g.external(name, dt, list(shape), data)
            else:
                t = self.g.external(name, self.w.dtype(name), list(self.w.shape(name)), self.w.data(name))
            self._wcache[name] = t
        return t

    def mat_weight(self, name: str):
        """A weight read only by matmul / get_rows: packed for the kernels where possible."""
        key = name + "#mat"
        t = self._wcache.get(key)
        if t is None:
            if self.tp is not None and self.tp.splits(name):
                dt, shape, data, packed = self.tp.local(name, mat=True)
                t = self.g.external(name, dt, list(shape), data, packed=packed)
            else:
                data, packed = self.w.matmul_data(name)
                t = self.g.external(name, self.w.dtype(name), list(self.w.shape(name)), data, packed=packed)
            self._wcache[key] = t
        return t

    # --- tensor parallelism (pyfast/parallel) -----------------------------------------------
    def reduce(self, x):
        """The sum over the ranks of a partial result (a row-parallel product): x itself
        without tensor parallelism. One after each mixer and one after each FFN."""
        return x if self.tp is None else self.g.allreduce(x, self.tp.comm_id)

    def tp_empty(self, name: str) -> bool:
        """Whether this rank holds no slice of the block that weight `name` starts (it then
        contributes zeros to the reduce instead of computing the block)."""
        return self.tp is not None and self.tp.empty(name)

    def zeros_like(self, x):
        return self.g.scale(x, 0.0)

    def head(self, x, name: str):
        """The output head x @ W.T -> [n, n_vocab]; under tensor parallelism each rank computes
        its rows of the vocabulary and the full rows are summed, zero-padded, on rank 0 (the
        other ranks' logits are zeros: only the leader reads them)."""
        if self.tp is None:
            return self.linear(x, name)
        g = self.g
        key = "head:" + name
        t = self._wcache.get(key)
        if t is None:
            dt, shape, data, packed = self.tp.local(key, mat=True)
            t = self._wcache[key] = g.external(key, dt, list(shape), data, packed=packed)
        _, v0, n, V = self.tp.head_range()
        n_rows = x.shape[0]
        y = g.matmul(x, t) if n else None                                # [n_rows, n]
        for lo, width in ((0, v0), (v0 + n, V - v0 - n)):
            if width <= 0:
                continue
            zeros = g.external(f"head_pad.{n_rows}x{width}", DType.F32, [n_rows, width],
                               np.zeros((n_rows, width), np.float32))
            if y is None:
                y = zeros
            else:
                y = g.concat(zeros, y, 1) if lo == 0 else g.concat(y, zeros, 1)
        # only rank 0 samples: the sum goes to it alone (the others' logits are zeros)
        return g.allreduce(y, self.tp.comm_id, root_only=True)           # [n_rows, n_vocab]

    def has(self, name: str) -> bool:
        return name in self.w

    # --- layers ----------------------------------------------------------------------------
    def embed(self, name: str):
        return self.g.get_rows(self.mat_weight(name), self.tokens)  # [T, n_embd]

    def norm(self, x, name: str, eps: float):
        return self.g.mul(self.g.rms_norm(x, eps), self.weight(name))

    def linear(self, x, name: str, bias: str | None = None):
        y = self.g.matmul(x, self.mat_weight(name))
        if bias is not None and self.has(bias):
            y = self.g.add(y, self.weight(bias))
        return y

    def ffn_swiglu(self, x, prefix: str, suffix: str = ""):
        """SwiGLU FFN of ffn_{gate,up,down}{suffix} (suffix "_shexp": the shared experts)."""
        g = self.g
        if self.tp_empty(f"{prefix}.ffn_gate{suffix}.weight"):
            return self.zeros_like(x)
        gate = self.linear(x, f"{prefix}.ffn_gate{suffix}.weight")
        up = self.linear(x, f"{prefix}.ffn_up{suffix}.weight")
        return self.linear(g.swiglu(gate, up), f"{prefix}.ffn_down{suffix}.weight")

    def kv_attention(self, il: int, q, k, v, scale: float, mask=None):
        """Write k/v of this batch into layer il's cache and attend over the visible cells.

        q: [T, n_head, head_dim], k: [T, n_head_kv, head_dim], v: [T, n_head_kv, head_dim_v]
        mask: [T, n_kv] additive mask in place of the batch's causal one (which it must include)
        returns [T, n_head * head_dim_v]
        """
        k_vis, v_vis = self.kv_store(il, k, v)
        return self.attend(q, k_vis, v_vis, scale, mask)

    def attend(self, q, k_vis, v_vis, scale: float, mask=None, swa: bool = False):
        """Attention of q over kv_store's visible cells -> [T, n_head * head_dim_v] (swa: over the
        sliding-window cache's cells, with its window mask unless another is given)."""
        g = self.g
        if swa:
            mask, order = self.mask_swa if mask is None else mask, self.kv_order_swa
        else:
            mask, order = self.mask if mask is None else mask, self.kv_order
        o = g.attention(q, k_vis, v_vis, mask, order, scale)
        return g.reshape(o, [self.shape.n_tokens, q.shape[1] * v_vis.shape[2]])

    def kv_store(self, il: int, k, v, swa: bool = False):
        """Write k/v of this batch into layer il's cache (swa: layer il of the sliding-window
        layers' own cache); returns the visible cells' views (k_vis [n_kv, n_head_kv, head_dim],
        v_vis [n_kv, n_head_kv, head_dim_v], in cache dtypes)."""
        g, T = self.g, self.shape.n_tokens
        if swa:
            kv, n_kv, kv_idx, tag = self.kv_swa, self.shape.n_kv_swa, self.kv_idx_swa, "swa_"
        else:
            kv, n_kv, kv_idx, tag = self.kv, self.shape.n_kv, self.kv_idx, ""
        H, n_ctx = kv.n_head_kv, kv.n_ctx
        # the cache is head-major ([H, n_ctx, D] per layer, see kv_cache.py): the batch's K/V go
        # in as T * H rows (kv_idx: BatchSlots.rows), attention sees them as [n_kv, H, D]
        k_cache = g.external(f"{tag}cache_k.{il}", kv.dtype, [H * n_ctx, kv.head_dim], kv.k,
                             offset=il * kv.k_layer_bytes)
        k_all = g.set_rows(k_cache, g.reshape(k, [T * H, kv.head_dim]), kv_idx)
        kb = kv.k_row_bytes
        k_vis = g.view(k_all, [n_kv, H, kv.head_dim], [kb, n_ctx * kb, _elem_stride(kv.dtype)])
        if getattr(kv, "v_in_k", False):  # the values are the K rows' leading columns (MLA's latent)
            return k_vis, g.view(k_all, [n_kv, H, kv.head_dim_v], [kb, n_ctx * kb, _elem_stride(kv.dtype)])
        v_cache = g.external(f"{tag}cache_v.{il}", kv.dtype_v, [H * n_ctx, kv.head_dim_v], kv.v,
                             offset=il * kv.v_layer_bytes)
        v_all = g.set_rows(v_cache, g.reshape(v, [T * H, kv.head_dim_v]), kv_idx)
        vb = kv.v_row_bytes
        v_vis = g.view(v_all, [n_kv, H, kv.head_dim_v], [vb, n_ctx * vb, _elem_stride(kv.dtype_v)])
        return k_vis, v_vis

    def ssm_conv(self, ir: int, x, w):
        """Causal depthwise conv of recurrent layer ir over the batch, through its state planes.

        x: [T, C], w: the f32 weight [C, Kc]. Returns [T, C] (no activation)."""
        rec = self.rec
        state = self.g.external(f"conv_state.{ir}", DType.F32, list(rec.conv_shape), rec.conv_buf,
                                offset=ir * rec.conv_layer_bytes)
        return self.g.ssm_conv(x, w, state, self.seqs)

    def gated_delta_net(self, ir: int, q, k, v, g, beta, broadcast: int, chunk_min: int = 0, scale: float = 0.0):
        """The gated delta rule of recurrent layer ir through its state planes.

        q, k: [T, Hk, S] (L2-normalised), v: [T, Hv, S], g (log-decay), beta: [T, Hv].
        Returns [T, Hv, S]."""
        rec = self.rec
        state = self.g.external(f"ssm_state.{ir}", DType.F32, list(rec.ssm_shape), rec.ssm_buf,
                                offset=ir * rec.ssm_layer_bytes)
        return self.g.gated_delta_net(q, k, v, g, beta, state, self.seqs, scale, broadcast, chunk_min)

    def moe_ffn(self, x, prefix: str, n_expert_used: int, norm_topk: bool, weights_scale: float = 1.0):
        """Routed experts: softmax router -> top-k -> (renormalized) weights -> SwiGLU experts
        (``ffn_{gate,up,down}_exps`` or a merged ``ffn_gate_up_exps``) -> weighted sum.

        x: [T, d] -> [T, d]."""
        g = self.g
        logits = self.linear(x, f"{prefix}.ffn_gate_inp.weight")            # [T, E]
        ids = g.topk(logits, n_expert_used)                                  # [T, k]; same order as on probs
        if norm_topk:  # p_i / sum_sel p_j == softmax over the selected logits
            w = g.softmax(g.gather(logits, ids))                             # [T, k]
        else:
            w = g.gather(g.softmax(logits), ids)
        if weights_scale != 1.0:
            w = g.scale(w, weights_scale)
        from pyfast.models.moe import routed_experts  # moe.py imports this module

        return routed_experts(self, x, prefix, ids, w)                       # [T, d]

    def control(self, x, il: int):
        """x (the output of layer il, [T, n_embd]) plus that layer's control vector, if one is set
        (pyfast/control_vector.py); x itself otherwise. Every architecture calls it once per
        layer (and with il = -1 on the embedding), so it is also where layer il + 1's input is
        captured (``capture_layers``)."""
        v = self.control_vectors.get(il)
        if v is not None:
            x = self.g.add(x, self.g.external(f"control.{il}", DType.F32, [v.size], v))
        if il + 1 in self.capture_layers:
            self.captured[il + 1] = x
        return x

    def output_features(self) -> None:
        """The graph output "features" [T, L * n_embd]: the captured rows, layer-major in
        capture_layers order (called by Model.build after the architecture's build)."""
        if not self.capture_layers:
            return
        missing = [l for l in self.capture_layers if l not in self.captured]
        if missing:
            raise ValueError(f"feature capture: the graph never produced the input of layer(s) {missing}")
        T = self.shape.n_tokens
        parts = [self.captured[l] for l in self.capture_layers]
        for l, t in zip(self.capture_layers, parts):
            if t.shape[0] != T:
                raise ValueError(f"feature capture: layer {l}'s input has {t.shape[0]} rows, expected {T}")
        f = parts[0] if parts[0].dtype == DType.F32 else self.g.cpy(parts[0], DType.F32)
        for t in parts[1:]:
            f = self.g.concat(f, t if t.dtype == DType.F32 else self.g.cpy(t, DType.F32), -1)
        self.g.output(f, "features")

    def select_outputs(self, x):
        """Keep only the rows whose logits are wanted: [T, d] -> [n_out, d]."""
        return self.g.get_rows(x, self.out_ids)


def attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# --- pieces the architecture files share -------------------------------------------------------
def f32_weight(b: GraphBuilder, name: str):
    """A small weight (norm, bias) as f32 for elementwise ops."""
    w = b.weight(name)
    return w if w.dtype == DType.F32 else b.g.cpy(w, DType.F32)


def norm_f32(b: GraphBuilder, x, name: str, eps: float):
    """rms_norm(x) * weight, the weight made f32 first (``f32_weight``)."""
    return b.g.mul(b.g.rms_norm(x, eps), f32_weight(b, name))


def head_name(args) -> str:
    """The output projection: ``output.weight``, or the token embedding when the file ties them."""
    return "token_embd.weight" if args.tied else "output.weight"


def outer_tensors(args) -> list[TensorSpec]:
    """The tensors outside the layers: token embedding, final norm, output head (optional: tied)."""
    d = args.n_embd
    return [TensorSpec("token_embd.weight", (args.n_vocab, d)),
            TensorSpec("output_norm.weight", (d,)),
            TensorSpec("output.weight", (args.n_vocab, d), optional=True)]


def output_logits(b: GraphBuilder, args, x, norm=None):
    """The final norm (norm(x, name, eps); b.norm by default) of the last layer's output x, the
    graph output "hidden" [T, d] of every row when b.export_hidden, then the head on the rows in
    b.out_ids: logits [n_out, n_vocab]. x is [T, d] when b.all_rows, else already [n_out, d]."""
    x = (norm or b.norm)(x, "output_norm.weight", args.eps)
    if b.all_rows:
        if b.export_hidden:
            b.g.output(x, "hidden")                                        # [T, d]
        x = b.select_outputs(x)
    return b.head(x, head_name(args))


def read_blocks(m, arch: str, weights, path: str = "") -> tuple[int, int, int]:
    """(n_all, n_layer, n_nextn) from ``{arch}.block_count`` and ``{arch}.nextn_predict_layers``
    (m: a meta.Meta): the last n_nextn of the n_all blocks are MTP blocks, the first n_layer the
    trunk. The trunk's layers must all be in the file; MTP blocks past them may be left out."""
    from pyfast.models import meta as M

    n_all = m.int(f"{arch}.block_count", lo=1, hi=M.MAX_LAYERS)
    n_nextn = m.int(f"{arch}.nextn_predict_layers", 0, lo=0, hi=n_all - 1)
    n_layer = n_all - n_nextn
    M.check_blocks(path, f"{arch}.block_count", n_all, weights, lo=n_layer)
    return n_all, n_layer, n_nextn


def nextn_tensors(args, j: int, layer_tensors) -> list[TensorSpec]:
    """The tensors of MTP (nextn) block j, block index n_layer + j: layer_tensors(il) (its decoder
    layer) plus the nextn projection and norms (own embedding, head norm and head are optional)."""
    d, il = args.n_embd, args.n_layer + j
    p = f"blk.{il}"
    return layer_tensors(il) + [
        TensorSpec(f"{p}.nextn.eh_proj.weight", (d, 2 * d)),
        TensorSpec(f"{p}.nextn.enorm.weight", (d,)),
        TensorSpec(f"{p}.nextn.hnorm.weight", (d,)),
        TensorSpec(f"{p}.nextn.shared_head_norm.weight", (d,), optional=True),
        TensorSpec(f"{p}.nextn.embed_tokens.weight", (args.n_vocab, d), optional=True),
        TensorSpec(f"{p}.nextn.shared_head_head.weight", (args.n_vocab, d), optional=True),
    ]


def build_nextn(b: GraphBuilder, args, j: int, layer, norm=None):
    """MTP (nextn) block j as a graph (``algorithms.md`` §1.1): row t takes (token_t, h_t) with h_t
    from the graph input "h" [T, d]; x = eh_proj([enorm(embed(token)) ; hnorm(h)]), then
    layer(x, p, il) (the block's decoder layer, prefix p = blk.{il}, il = n_layer + j; its
    attention uses KV layer 0 of b.kv, the block's own one-layer cache). Outputs "hidden" [T, d],
    the block's post-norm output (the next carry), and returns logits [n_out, n_vocab] for
    b.out_ids. norm(x, name, eps) is b.norm by default."""
    g, norm = b.g, norm or b.norm
    d, il = args.n_embd, args.n_layer + j
    p = f"blk.{il}"
    h = g.input("h", DType.F32, [b.shape.n_tokens, d])
    emb = f"{p}.nextn.embed_tokens.weight" if b.has(f"{p}.nextn.embed_tokens.weight") else "token_embd.weight"
    eh = g.concat(norm(b.embed(emb), f"{p}.nextn.enorm.weight", args.eps),
                  norm(h, f"{p}.nextn.hnorm.weight", args.eps), -1)
    x = layer(b.linear(eh, f"{p}.nextn.eh_proj.weight"), p, il)          # [embedding ; hidden] -> d
    hn = f"{p}.nextn.shared_head_norm.weight"
    y = norm(x, hn if b.has(hn) else "output_norm.weight", args.eps)
    g.output(y, "hidden")
    head = f"{p}.nextn.shared_head_head.weight"
    return b.linear(b.select_outputs(y), head if b.has(head) else head_name(args))
