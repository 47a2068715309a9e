"""Writing GGUF (version 3) files.

A small writer of our own (the ``gguf`` package is only a test dependency). Metadata values of
every GGUF type are supported, including nested arrays; tensors are declared with numpy-order
shapes (outermost first), flipped here to GGUF's innermost-first order, and their data is
written aligned to ``general.alignment`` (32 unless the metadata says otherwise).

    >>> w = GGUFWriter("out.gguf")
    >>> w.add("general.architecture", "llama")
    >>> w.add("llama.block_count", 30, "uint32")
    >>> w.add_tensor("blk.0.attn_norm.weight", 0, (576,), np.ones(576, np.float32))
    >>> w.add_tensor("token_embd.weight", 8, (49152, 576), lambda: quantize(...))  # lazy
    >>> w.write()

Tensor data may be given as an array / bytes or as a callable that returns it when the writer
reaches that tensor, so a whole model never has to sit in memory at once.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from pyfast._loader import native

__all__ = ["GGUFWriter", "VALUE_TYPES", "infer_type"]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: name -> (id, struct format or None for string / array).
VALUE_TYPES: Dict[str, Tuple[int, Optional[str]]] = {
    "uint8": (0, "<B"), "int8": (1, "<b"), "uint16": (2, "<H"), "int16": (3, "<h"),
    "uint32": (4, "<I"), "int32": (5, "<i"), "float32": (6, "<f"), "bool": (7, "<?"),
    "string": (8, None), "array": (9, None), "uint64": (10, "<Q"), "int64": (11, "<q"),
    "float64": (12, "<d"),
}
_NP = {"uint8": np.uint8, "int8": np.int8, "uint16": np.uint16, "int16": np.int16, "uint32": np.uint32,
       "int32": np.int32, "float32": np.float32, "bool": np.bool_, "uint64": np.uint64, "int64": np.int64,
       "float64": np.float64}

Data = Union[np.ndarray, bytes, bytearray, memoryview]


def infer_type(value: Any) -> str:
    """The GGUF type name a Python value is written as when no type is given: bool -> bool,
    int -> int32 (int64 / uint64 when out of range), float -> float32, str -> string,
    list / tuple / 1-D array -> array[<type of the elements>]."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if -2**31 <= v < 2**31:
            return "int32"
        return "int64" if -2**63 <= v < 2**63 else "uint64"
    if isinstance(value, (float, np.floating)):
        return "float32"
    if isinstance(value, str):
        return "string"
    if isinstance(value, np.ndarray):
        name = {np.dtype(t): n for n, t in _NP.items()}.get(value.dtype)
        if name is None:
            raise TypeError(f"no GGUF type for numpy dtype {value.dtype}")
        return f"array[{name}]"
    if isinstance(value, (list, tuple)):
        if not value:
            return "array[int32]"
        inner = {infer_type(v) for v in value}
        if inner <= {"int32", "int64", "uint64"} and len(inner) > 1:
            inner = {"int64"} if "uint64" not in inner else {"uint64"}
        if len(inner) != 1:
            raise TypeError(f"array elements have mixed types {sorted(inner)}")
        return f"array[{inner.pop()}]"
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def _split_array(typ: str) -> Optional[str]:
    """'array[x]' -> 'x'; None for a scalar type name."""
    if typ == "array":
        return "int32"
    if typ.startswith("array[") and typ.endswith("]"):
        return typ[6:-1]
    return None


def _enc_str(s: Union[str, bytes]) -> bytes:
    b = s if isinstance(s, (bytes, bytearray)) else s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + bytes(b)


def _enc_value(value: Any, typ: str) -> bytes:
    """The bytes of a value (without its leading type id)."""
    inner = _split_array(typ)
    if inner is not None:
        if isinstance(value, (str, bytes)):
            raise TypeError(f"a {typ} value must be a sequence, got {type(value).__name__}")
        items = list(value) if not isinstance(value, np.ndarray) else value
        inner_arr = _split_array(inner)
        head = struct.pack("<IQ", VALUE_TYPES["array" if inner_arr is not None else inner][0], len(items))
        if inner == "string":
            return head + b"".join(_enc_str(v) for v in items)
        if inner_arr is not None:
            return head + b"".join(_enc_value(v, inner) for v in items)
        if inner not in _NP:
            raise TypeError(f"unknown GGUF array element type {inner!r}")
        arr = np.asarray(items, dtype=_NP[inner]) if len(items) else np.zeros(0, _NP[inner])
        return head + arr.astype(np.dtype(_NP[inner]).newbyteorder("<"), copy=False).tobytes()
    if typ == "string":
        if not isinstance(value, (str, bytes, bytearray)):
            raise TypeError(f"a string value must be str, got {type(value).__name__}")
        return _enc_str(value)
    if typ not in VALUE_TYPES:
        raise TypeError(f"unknown GGUF value type {typ!r}")
    fmt = VALUE_TYPES[typ][1]
    if not isinstance(value, (bool, int, float, np.generic)):
        raise TypeError(f"a {typ} value must be a number, got {type(value).__name__}")
    try:
        return struct.pack(fmt, bool(value) if typ == "bool" else value)
    except struct.error as e:
        raise ValueError(f"value {value!r} does not fit GGUF type {typ}: {e}") from None


@dataclass
class _TensorEntry:
    name: str
    type: int
    shape: Tuple[int, ...]      # numpy order
    nbytes: int
    data: Union[Data, Callable[[], Data]]


class GGUFWriter:
    """Collects metadata and tensors, then :meth:`write` writes the file in one pass.

    Args:
        path: the output file.
        alignment: tensor data alignment; ``general.alignment`` in the metadata overrides it.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"], alignment: int = DEFAULT_ALIGNMENT):
        self.path = os.fspath(path)
        self.alignment = alignment
        self._kv: Dict[str, Tuple[Any, str]] = {}
        self._tensors: List[_TensorEntry] = []
        self._names: set = set()

    # -- metadata ------------------------------------------------------------------------------
    def add(self, key: str, value: Any, type: Optional[str] = None) -> None:
        """Set metadata ``key`` (replacing an earlier value, keeping its position). ``type`` is a
        GGUF type name ("uint32", "string", "array[int32]", "array[array[string]]", ...) or None
        to infer it (see :func:`infer_type`)."""
        typ = type or infer_type(value)
        _enc_value(value, typ)  # validate now, not halfway through writing
        if key == "general.alignment":
            a = int(value)
            if a <= 0 or a % 8:
                raise ValueError(f"general.alignment must be a positive multiple of 8, got {a}")
            self.alignment = a
        self._kv[key] = (value, typ)

    def remove(self, key: str) -> None:
        self._kv.pop(key, None)

    def copy_metadata(self, reader, skip: Sequence[str] = ()) -> None:
        """Copy every metadata key of a :class:`pyfast.gguf.GGUFReader` with its stored type."""
        for k, v in reader.metadata.items():
            if k not in skip:
                self.add(k, v, reader.metadata_types.get(k))

    # -- tensors -------------------------------------------------------------------------------
    def add_tensor(self, name: str, dtype: Union[int, Any], shape: Sequence[int],
                   data: Union[Data, Callable[[], Data]]) -> None:
        """Declare a tensor: ``dtype`` is a ggml type id (or a ``DType``), ``shape`` numpy order
        (outermost first), ``data`` its bytes (array / bytes) or a callable returning them."""
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        tid = int(dtype)
        shape = tuple(int(s) for s in shape)
        if not shape or len(shape) > 4 or any(s <= 0 for s in shape):
            raise ValueError(f"tensor {name!r}: bad shape {shape}")
        dt = native.DType(tid)
        bs = int(native.dtype_block_size(dt))
        if shape[-1] % bs:
            raise ValueError(f"tensor {name!r}: innermost dim {shape[-1]} is not a multiple of the "
                             f"{dt.name} block size {bs}")
        nbytes = int(native.dtype_row_size(dt, shape[-1])) * int(np.prod(shape[:-1], dtype=np.int64))
        if not callable(data):
            got = _nbytes(data)
            if got != nbytes:
                raise ValueError(f"tensor {name!r}: {got} bytes given, {dt.name}{list(shape)} takes {nbytes}")
        self._names.add(name)
        self._tensors.append(_TensorEntry(name, tid, shape, nbytes, data))

    # -- output --------------------------------------------------------------------------------
    def _pad(self, n: int) -> int:
        return (self.alignment - n % self.alignment) % self.alignment

    def write(self) -> None:
        """Write the file (header, metadata, tensor infos, aligned tensor data)."""
        head = bytearray()
        head += GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))
        for key, (value, typ) in self._kv.items():
            head += _enc_str(key)
            inner = _split_array(typ)
            head += struct.pack("<I", VALUE_TYPES["array" if inner is not None else typ][0])
            head += _enc_value(value, typ)
        offset = 0
        for t in self._tensors:
            head += _enc_str(t.name)
            head += struct.pack("<I", len(t.shape))
            head += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape))  # GGUF order: innermost first
            head += struct.pack("<IQ", t.type, offset)
            offset += t.nbytes + self._pad(t.nbytes)
        head += b"\0" * self._pad(len(head))
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                for t in self._tensors:
                    data = t.data() if callable(t.data) else t.data
                    got = _nbytes(data)
                    if got != t.nbytes:
                        raise ValueError(f"tensor {t.name!r}: {got} bytes produced, expected {t.nbytes}")
                    f.write(_as_bytes(data))
                    f.write(b"\0" * self._pad(t.nbytes))
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _nbytes(data: Data) -> int:
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    return len(memoryview(data).cast("B"))


def _as_bytes(data: Data):
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data)).cast("B")
    return data
