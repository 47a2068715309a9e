"""Architectures and the model loader.

Each architecture lives in one file (``llama.py``, ...) that exposes ``ARCH``, ``Args`` (read
from GGUF metadata), ``tensors(args)`` and ``build(builder, args)``; ``ARCHITECTURES`` maps
``general.architecture`` to it.
"""
from __future__ import annotations

import os
from types import ModuleType

from pyfast.gguf import GGUFReader
from pyfast.models import gemma3, gemma4, glm4moe, llama, qwen2, qwen3, qwen3moe, qwen3next, qwen35, qwen35moe
from pyfast.models.base import BatchShape, GraphBuilder, MemorySpec, Weights

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen2, qwen3, qwen3moe, qwen35, qwen35moe, qwen3next,
                                                             glm4moe, gemma3, gemma4)}

# MLA + MoE family (DeepSeek-V3; the DSA variants add the lightning indexer)
from pyfast.models import deepseek2, deepseek32, glm_dsa  # noqa: E402

ARCHITECTURES.update({m.ARCH: m for m in (deepseek2, deepseek32, glm_dsa)})

_MATMUL_DTYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Model:
    """A GGUF model: metadata, mapped weights and its architecture's graph builder."""

    def __init__(self, path: str | os.PathLike, mmap: bool | None = None):
        """mmap: keep the weights mapped from the file (shared with other processes, paged in
        lazily) instead of reading them into huge-page memory, which decodes faster. Default:
        PYFAST_MMAP=1 in the environment maps; otherwise the weights are read into memory when
        they take at most half of the memory available now, and mapped when they do not."""
        self.path = str(path)
        self.reader = GGUFReader(self.path)
        if mmap is None:
            env = os.environ.get("PYFAST_MMAP", "")
            if env:
                mmap = env != "0"
            else:
                avail = _mem_available()
                mmap = avail is not None and 2 * (self.reader.file_size - self.reader.data_offset) > avail
        self.mmap = bool(mmap)
        if self.mmap:
            self.reader.prefetch()  # page the weights in while the rest of start-up runs
        self.metadata = self.reader.metadata
        arch = self.metadata.get("general.architecture")
        mod = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if mod is None:
            raise ValueError(f"{self.path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        self.arch = mod
        # metadata and tensor table are checked against each other before anything is allocated
        # (an absurd block_count must fail here, not size a list or read the file)
        index = Weights(self.reader, in_memory=False)  # shapes only, no data read
        self.args = mod.Args.from_gguf(self.metadata, index, path=self.path, types=self.reader.metadata_types)
        index.check(mod.tensors(self.args), self.path)
        self.control: dict = {}  # 0-based layer -> control vector added to its output (set_control_vector)
        self._built = False      # a graph was built (plans hold the control vectors they were built with)
        for name, info in index.info.items():
            if len(info.shape) == 2 and info.type_name not in _MATMUL_DTYPES:
                raise ValueError(f"{self.path}: tensor '{name}' has type {info.type_name}, "
                                 f"which this version of pyfast cannot compute with")
        self.weights = Weights(self.reader, in_memory=not self.mmap)
        self.tp = None  # this rank's shard under tensor parallelism (enable_tp)

    def enable_tp(self, group) -> None:
        """Build every graph from this rank's slices of the weights (``pyfast/parallel``), with
        an allreduce over ``group`` (a pyfast.parallel.Group) after each layer's mixer and FFN.
        Memory (KV cache, recurrent state) then holds this rank's heads only."""
        from pyfast.parallel.tp import Shard

        if self._built:
            raise ValueError("enable_tp: graphs of this model were already built; enable it before the first decode")
        self.tp = Shard(self, group) if group.size > 1 else None

    @property
    def build_args(self):
        """The hyper-parameters graphs are built with: this rank's head counts under tensor
        parallelism, the model's otherwise."""
        return self.args if self.tp is None else self.tp.args

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or os.path.basename(self.path))

    def build(self, shape: BatchShape, kv, rec=None, export_hidden: bool = False, kv_swa=None,
              capture: tuple[int, ...] = ()):
        """A graph for one batch shape; returns the builder (its .g has outputs 'logits', 'argmax'
        (int32, each logits row's first maximum), 'hidden' [n_tokens, n_embd] with export_hidden,
        and 'features' [n_tokens, len(capture) * n_embd] with capture: the input rows of those
        layers, id n_layer = the last layer's output before the output norm; see
        ``check_capture``)."""
        if export_hidden and not self.supports_hidden:
            raise ValueError(f"{self.path}: architecture {self.arch.ARCH!r} cannot export hidden rows")
        capture = self.check_capture(capture)
        b = GraphBuilder(self.weights, shape, kv, rec=rec, export_hidden=export_hidden, control=self.control,
                         kv_swa=kv_swa, capture=capture, n_layer=self.args.n_layer, tp=self.tp)
        self._built = True
        logits = self.arch.build(b, self.build_args)
        b.output_features()
        b.g.output(logits, "logits")
        b.g.output(b.g.argmax(logits), "argmax")  # greedy decoding reads this instead of the rows
        return b

    def set_control_vector(self, cv, start: int | None = None, end: int | None = None) -> None:
        """Add ``cv`` (a ``pyfast.control_vector.ControlVector``; None removes it) to the outputs of
        layers start .. end (llama.cpp's --control-vector-layer-range; default 1 .. n_layer). Call
        it before any graph is built: contexts keep the plans they built."""
        if self._built:
            raise ValueError("set_control_vector: graphs of this model were already built and keep their "
                             "control vectors; set it before the first decode (or load the model again)")
        self.control = {} if cv is None else cv.layers(self.args.n_layer, self.args.n_embd, start, end)

    @property
    def is_dsa(self) -> bool:
        """Whether the architecture has DeepSeek Sparse Attention (deepseek32, glm-dsa)."""
        return bool(getattr(self.args, "extra", {}).get("dsa"))

    def set_dsa(self, on: bool | None = None, top_k: int | None = None, sink: bool | None = None,
                hadamard: bool | None = None) -> None:
        """DeepSeek Sparse Attention settings (llama.cpp's --dsa on|off, --dsa-top-k N): on /
        off, the number of cells each query keeps (None or -1: the model's), the per-sequence sink
        and the Hadamard rotation of the indexer's q / k. Call it before the first decode (contexts
        keep the plans they built); a model without DSA accepts only on=None / False."""
        if not self.is_dsa:
            if on:
                raise ValueError(f"{self.path}: architecture {self.arch.ARCH!r} has no sparse attention (--dsa on)")
            return
        if self._built:
            raise ValueError("set_dsa: graphs of this model were already built; set DSA options before the "
                             "first decode (or load the model again)")
        x = self.args.extra
        if on is not None:
            x["dsa_on"] = bool(on)
        if top_k is not None and top_k != -1:
            if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
                raise ValueError(f"dsa top-k must be a positive integer or -1 (the model's), got {top_k!r}")
            x["idx_top_k"] = top_k
        if sink is not None:
            x["sink"] = bool(sink)
        if hadamard is not None:
            x["hadamard"] = bool(hadamard)

    @property
    def needs_sink(self) -> bool:
        """Whether graphs take the "kv_sink" input (DSA with the per-sequence sink on)."""
        f = getattr(self.arch, "needs_sink", None)
        return bool(f(self.args)) if f is not None else False

    def check_capture(self, layers) -> tuple[int, ...]:
        """Validate feature-capture layer ids (drafters that read the target's intermediate rows:
        EAGLE-3, DFlash): id l is the input of layer l (the output of layer l - 1), 0 <= l <=
        n_layer: id 0 the (scaled) token embedding, id n_layer the last layer's output before the
        output norm. Returns the tuple."""
        out = tuple(int(l) for l in (layers or ()))
        n = self.args.n_layer
        for l in out:
            if not 0 <= l <= n:
                raise ValueError(f"feature capture: layer id {l} is outside [0, {n}] for {self.path} ({n} layers; "
                                 f"id l is the input of layer l, {n} the final hidden state before the output norm)")
        if len(set(out)) != len(out):
            raise ValueError(f"feature capture: layer ids {list(out)} repeat an id")
        return out

    @property
    def supports_hidden(self) -> bool:
        """Whether build(export_hidden=True) outputs the post-final-norm hidden rows."""
        return bool(getattr(self.arch, "EXPORTS_HIDDEN", False))

    def kv_geometry(self) -> tuple[int, int, int]:
        """(KV layers, kv heads, head dim) of the model's KV cache."""
        if hasattr(self.arch, "memory"):
            s = self.arch.memory(self.build_args)
            return len(s.attn_layers), s.n_head_kv, s.head_dim
        a = self.build_args
        return a.n_layer, a.n_head_kv, a.head_dim

    def memory_spec(self) -> MemorySpec:
        """The memory this model needs: attention layers (KV cache) and recurrent layers."""
        if hasattr(self.arch, "memory"):
            return self.arch.memory(self.build_args)
        n_layer, n_head_kv, head_dim = self.kv_geometry()
        return MemorySpec(attn_layers=tuple(range(n_layer)), n_head_kv=n_head_kv, head_dim=head_dim)

    @property
    def is_recurrent(self) -> bool:
        return self.memory_spec().is_recurrent


__all__ = ["ARCHITECTURES", "Model", "BatchShape", "GraphBuilder", "MemorySpec", "Weights"]
