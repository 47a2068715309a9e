"""A small read-only safetensors reader (numpy only, lazy, BF16 aware).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), and the raw little-endian tensor bytes. Files are memory-mapped, so a tensor is only
read when :meth:`SafetensorsDir.load` asks for it.

``SafetensorsDir`` opens every ``*.safetensors`` file of a Hugging Face model directory (the
shards named by ``model.safetensors.index.json`` when that exists) and presents one name space.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["SafetensorsDir", "TensorRef", "read_header"]

# safetensors dtype -> (numpy dtype of the stored element, is floating point)
_DTYPES = {
    "F64": (np.dtype("<f8"), True),
    "F32": (np.dtype("<f4"), True),
    "F16": (np.dtype("<f2"), True),
    "BF16": (np.dtype("<u2"), True),     # widened by hand below
    "I64": (np.dtype("<i8"), False),
    "I32": (np.dtype("<i4"), False),
    "I16": (np.dtype("<i2"), False),
    "I8": (np.dtype("i1"), False),
    "U8": (np.dtype("u1"), False),
    "BOOL": (np.dtype("?"), False),
}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its file, dtype name, shape and absolute byte range."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse one file's header: ({name: TensorRef}, the ``__metadata__`` dict)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n} does not fit)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: bad safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: bad safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, TensorRef] = {}
    for name, info in header.items():
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(s) for s in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad header entry for tensor {name!r}") from None
        if not (0 <= b <= e and base + e <= size):
            raise ValueError(f"{path}: tensor {name!r} data range {b}..{e} lies outside the file")
        if dtype in _DTYPES:
            want = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][0].itemsize
            if want != e - b:
                raise ValueError(f"{path}: tensor {name!r} ({dtype}{list(shape)}) has {e - b} bytes, "
                                 f"expected {want}")
        out[name] = TensorRef(path, dtype, shape, base + b, base + e)
    return out, meta


class SafetensorsDir:
    """All tensors of a model directory's ``*.safetensors`` files, by name."""

    def __init__(self, hf_dir: str):
        self.dir = os.fspath(hf_dir)
        files = self._files()
        if not files:
            raise ValueError(f"{self.dir}: no *.safetensors files")
        self.refs: dict[str, TensorRef] = {}
        for path in files:
            refs, _ = read_header(path)
            for name, ref in refs.items():
                if name in self.refs:
                    raise ValueError(f"{self.dir}: tensor {name!r} is in both "
                                     f"{os.path.basename(self.refs[name].path)} and {os.path.basename(path)}")
                self.refs[name] = ref
        self._maps: dict[str, np.memmap] = {}

    def _files(self) -> list[str]:
        index = os.path.join(self.dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: unreadable index: {e}") from None
            paths = [os.path.join(self.dir, n) for n in names]
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise ValueError(f"{index}: names missing shard(s) {', '.join(os.path.basename(p) for p in missing)}")
            return paths
        return sorted(os.path.join(self.dir, n) for n in os.listdir(self.dir) if n.endswith(".safetensors"))

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored elements as a read-only numpy view (BF16 as uint16 bits)."""
        ref = self.refs[name]
        if ref.dtype not in _DTYPES:
            raise ValueError(f"{self.dir}: tensor {name!r} has unsupported dtype {ref.dtype}")
        mm = self._maps.get(ref.path)
        if mm is None:
            mm = self._maps[ref.path] = np.memmap(ref.path, dtype=np.uint8, mode="r")
        return mm[ref.begin:ref.end].view(_DTYPES[ref.dtype][0]).reshape(ref.shape)

    def load(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array (F64 / F32 / F16 / BF16 sources)."""
        ref = self.refs[name]
        if ref.dtype not in _DTYPES or not _DTYPES[ref.dtype][1]:
            raise ValueError(f"{self.dir}: tensor {name!r} has dtype {ref.dtype}, expected a float type "
                             "(F32, F16, BF16 or F64)")
        a = self.raw(name)
        if ref.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)
