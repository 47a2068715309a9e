"""Re-quantizing GGUF models: ``pyfast quantize IN.gguf OUT.gguf TYPE``.

TYPE is a llama.cpp file type (``Q4_K_M``, ``Q5_K_M``, ``Q4_K_S``, ``Q5_K_S``, ``Q6_K``, ``Q8_0``,
``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``F16``, ``BF16``, ``F32``). Each tensor's type follows
llama-quantize's rules for that file type:

* only matrices are quantized (2-D+ tensors whose name ends in ``weight``, minus norms, MoE
  router and position / token-type embeddings); everything else is copied as it is;
* the output matrix (and ``token_embd`` when the embeddings are tied) becomes Q6_K, or Q8_0 when
  its rows are not a multiple of the file type's block size;
* the mixes (``*_M``, ``*_S``) give more bits to ``attn_v`` and ``ffn_down`` in the first and last
  eighth of the layers and every third layer in between (``use_more_bits``): Q6_K for Q4_K_M /
  Q5_K_M; Q5_K in the first layers for Q4_K_S;
* tensors are visited (and written) in llama-quantize's order, by layer number then name, which
  is what the layer counters of the rules above count;
* a tensor whose rows are not a multiple of 256 falls back to a 32-block type (Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0), and to F16 when not even a multiple of 32.

Re-quantizing an already quantized file (llama-quantize's --allow-requantize case) differs in one
way: where a rule above moves a tensor away from the file type's base type (the "more bits"
upgrades, the output rule, the 256-column fallbacks) to a type with at least as many bits per
weight as the tensor's quantized source type, the source is kept as it is. Re-encoding already
quantized values into a type that is not smaller only adds error (Q5_0, for one, cannot even
represent Q4_1's asymmetric blocks); copying is exact and no larger. ``keep_quantized=False``
(``--requantize-all``) gives llama-quantize's exact choice. Conversions to the base type itself
always happen.

Source tensors of any type pyfast reads are widened to float32 and quantized natively on all
cores; a tensor whose chosen type equals its source type is copied unchanged. Q4_0 / Q4_1 / Q5_0 /
Q5_1 blocks get a least-squares scale search (lower round-trip error than ggml's reference
quantizers, which derive the scale from the block's extremes); the K-quants always search. The output gets
``general.file_type`` and ``general.quantization_version`` = 2 like llama-quantize writes.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from pyfast._loader import native as N
from pyfast.gguf import GGUFReader
from pyfast.gguf.writer import GGUFWriter

__all__ = ["FTYPES", "quantize", "tensor_types", "TensorPlan", "QuantizeResult"]

# llama.cpp's llama_ftype values and each file type's base tensor type.
FTYPES: Dict[str, tuple] = {
    "F32": (0, "F32"), "F16": (1, "F16"), "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q8_0": (7, "Q8_0"),
    "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"), "Q4_K_S": (14, "Q4_K"), "Q4_K_M": (15, "Q4_K"),
    "Q5_K_S": (16, "Q5_K"), "Q5_K_M": (17, "Q5_K"), "Q6_K": (18, "Q6_K"), "BF16": (32, "BF16"),
}
QUANTIZATION_VERSION = 2
# Source types a tensor can be converted from.
READABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_NO_QUANT = ("_norm.weight", "ffn_gate_inp.weight", "position_embd.weight", "token_types.weight",
             "ssm_conv1d", "altup", "laurel", "per_layer_model_proj")


def _block(t: str) -> int:
    return int(N.dtype_block_size(getattr(N.DType, t)))


def _is_quantized(t: str) -> bool:
    return _block(t) > 1


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layer pattern for the mixes: the first and last eighth, and every third layer."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _quantizable(name: str, shape) -> bool:
    if len(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(s in name for s in _NO_QUANT)


@dataclass
class TensorPlan:
    name: str
    shape: tuple            # numpy order
    src_type: str
    dst_type: str
    note: str = ""          # why the type differs from the file type's base type

    @property
    def requantize(self) -> bool:
        return self.src_type != self.dst_type


def _bpw(t: str) -> float:
    dt = getattr(N.DType, t)
    return 8.0 * int(N.dtype_type_size(dt)) / int(N.dtype_block_size(dt))


def tensor_types(reader: GGUFReader, ftype: str, keep_quantized: bool = True) -> List[TensorPlan]:
    """Each tensor's output type under ``ftype`` (llama-quantize's rules; see the module doc).
    ``keep_quantized``: when a rule moves an already-quantized source tensor away from the file
    type's base type to a type with at least as many bits per weight as its source type, keep the
    source (see the module doc)."""
    ftype = ftype.upper()
    if ftype not in FTYPES:
        raise ValueError(f"unknown quantization type {ftype!r} (known: {', '.join(FTYPES)})")
    base = FTYPES[ftype][1]
    tensors = reader.tensors
    tied = "output.weight" not in tensors
    n_attn_v = sum(1 for n in tensors if _attn_v_like(n))
    n_layer = int(reader.get(f"{reader.architecture}.block_count", 0) or 0)
    if not n_layer:
        n_layer = 1 + max((int(m.group(1)) for m in (re.match(r"blk\.(\d+)\.", n) for n in tensors) if m), default=-1)
    i_attn_v = i_ffn_down = 0
    plans = []
    for name in sorted(tensors, key=_order):
        info = tensors[name]
        shape = tuple(info.shape)
        src = info.type_name
        if not _quantizable(name, shape):
            plans.append(TensorPlan(name, shape, src, src, "kept"))
            continue
        if not _is_quantized(base):
            plans.append(TensorPlan(name, shape, src, base))
            continue
        t, note = base, ""
        ncols = shape[-1]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            if ncols % _block(base):
                t, note = "Q8_0", "output"
            elif base != "Q8_0":
                t, note = "Q6_K", "output"
        elif name == "token_embd.weight":
            pass
        elif _attn_v_like(name):
            if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_attn_v, n_attn_v):
                t, note = "Q6_K", "more bits"
            elif ftype == "Q4_K_S" and i_attn_v < 4:
                t, note = "Q5_K", "more bits"
            i_attn_v += 1
        elif "ffn_down" in name:
            if ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_ffn_down, n_layer):
                t, note = "Q6_K", "more bits"
            elif ftype == "Q4_K_S" and i_ffn_down < n_layer // 8:
                t, note = "Q5_K", "more bits"
            i_ffn_down += 1
        if ncols % _block(t):
            fb = _FALLBACK.get(t, t)
            if ncols % _block(fb):
                fb = "F16"
            note = (note + ", " if note else "") + f"{ncols} cols: {t} -> {fb}"
            t = fb
        if (keep_quantized and t != base and t != src and src in READABLE and _is_quantized(src)
                and _bpw(t) >= _bpw(src)):
            note = (note + ", " if note else "") + f"kept: {t} would not be smaller than the {src} source"
            t = src
        plans.append(TensorPlan(name, shape, src, t, note))
    return plans


def _order(name: str):
    """llama-quantize's tensor order (the layer counters depend on it): by layer number (tensors
    outside blk.N first), then by name."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _attn_v_like(name: str) -> bool:
    return any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))


@dataclass
class QuantizeResult:
    plans: List[TensorPlan]
    seconds: float
    in_bytes: int
    out_bytes: int
    rmse: Dict[str, float] = field(default_factory=dict)   # per requantized tensor (when asked)

    def type_counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for p in self.plans:
            out[p.dst_type] = out.get(p.dst_type, 0) + 1
        return out


def _to_f32(reader: GGUFReader, name: str, src_type: str, shape) -> np.ndarray:
    ncols = shape[-1]
    nrows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = reader.tensor_bytes(name)
    return N.dequantize_tensor(getattr(N.DType, src_type), raw, nrows, ncols)


def quantize(src: str, dst: str, ftype: str, n_threads: int = 0, *, keep_quantized: bool = True,
             with_rmse: bool = False, log: Optional[Callable[[str], None]] = None) -> QuantizeResult:
    """Re-quantize GGUF file ``src`` into ``dst`` as ``ftype`` (see the module doc).

    Args:
        n_threads: quantization threads (0: all cores).
        keep_quantized: see :func:`tensor_types` (False: llama-quantize's exact type choice).
        with_rmse: also measure each re-quantized tensor's round-trip RMSE against its float32
            source values (costs one extra dequantization per tensor).
        log: called with one line per tensor (e.g. ``print``).
    """
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("the output file must differ from the input file")
    t0 = time.time()
    reader = GGUFReader(src)
    plans = tensor_types(reader, ftype, keep_quantized)
    for p in plans:
        if p.requantize and p.src_type not in READABLE:
            raise ValueError(f"{src}: tensor {p.name!r} has type {p.src_type}, which pyfast cannot convert")
    w = GGUFWriter(dst, alignment=reader.alignment)
    w.copy_metadata(reader, skip=("split.no", "split.count", "split.tensors.count"))
    w.add("general.quantization_version", QUANTIZATION_VERSION, "uint32")
    w.add("general.file_type", FTYPES[ftype.upper()][0], "uint32")
    rmse: Dict[str, float] = {}

    def producer(p: TensorPlan, idx: int):
        def make():
            t1 = time.time()
            if not p.requantize:
                data = reader.tensor_bytes(p.name)
            else:
                x = _to_f32(reader, p.name, p.src_type, p.shape)
                dt = getattr(N.DType, p.dst_type)
                data = N.quantize_tensor(dt, x, n_threads)
                if with_rmse:
                    y = N.dequantize_tensor(dt, data, x.shape[0], x.shape[1])
                    rmse[p.name] = float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2)))
            if log:
                extra = f"  rmse {rmse[p.name]:.3g}" if p.name in rmse else ""
                how = f"{p.src_type} -> {p.dst_type}" if p.requantize else f"{p.dst_type} (copied)"
                log(f"[{idx + 1:4d}/{len(plans)}] {p.name:40s} {str(list(p.shape)):16s} {how:16s}"
                    f" {time.time() - t1:6.2f}s{extra}" + (f"  ({p.note})" if p.note and p.note != "kept" else ""))
            return data
        return make

    for i, p in enumerate(plans):
        w.add_tensor(p.name, int(getattr(N.DType, p.dst_type)), p.shape, producer(p, i))
    w.write()
    in_bytes = os.path.getsize(src)
    reader.close()
    return QuantizeResult(plans, time.time() - t0, in_bytes, os.path.getsize(dst), rmse)
