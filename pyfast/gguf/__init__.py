"""Reading GGUF files.

The file is memory-mapped and parsed by the native reader (``_native.GGUFFile``); this module
gives it a Python face. Tensor shapes are numpy order (outermost dimension first) everywhere
above the native reader, and tensor data is a zero-copy, read-only view of the mapping.

    >>> r = GGUFReader("model.gguf")
    >>> r.architecture, r.get("llama.block_count")
    ('llama', 30)
    >>> r.tensors["token_embd.weight"].shape
    (49152, 576)
    >>> w = r.tensor_array("blk.0.attn_norm.weight")   # float32 view, shape (576,)

Malformed files raise :class:`GGUFError` (a ``ValueError``) whose message starts with the path.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Union

import numpy as np

from pyfast._loader import native

GGUFError = native.GGUFError
GGUFTensorInfo = native.GGUFTensorInfo

__all__ = ["GGUFError", "GGUFReader", "GGUFTensorInfo", "describe", "NUMPY_DTYPES"]

# ggml type id -> numpy dtype of one element, for the non-quantized types. BF16 has no numpy
# dtype; it is exposed as its raw uint16 bits.
NUMPY_DTYPES: Dict[int, np.dtype] = {
    0: np.dtype(np.float32),   # F32
    1: np.dtype(np.float16),   # F16
    24: np.dtype(np.int8),     # I8
    25: np.dtype(np.int16),    # I16
    26: np.dtype(np.int32),    # I32
    27: np.dtype(np.int64),    # I64
    28: np.dtype(np.float64),  # F64
    30: np.dtype(np.uint16),   # BF16 (raw bits)
}


class GGUFReader:
    """A GGUF file opened for reading.

    Attributes:
        path: the file's path.
        version, alignment, data_offset, file_size: header facts.
        metadata: dict key -> int | float | bool | str | list, in file order.
        tensors: dict name -> GGUFTensorInfo (``name``, ``type``, ``type_name``, ``shape``,
            ``n_elements``, ``offset``, ``nbytes``), in file order.

    Arrays returned by :meth:`tensor_bytes` / :meth:`tensor_array` keep the mapping alive on their
    own, so they stay valid after :meth:`close`.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"]):
        self._file = native.GGUFFile(path)
        self.path: str = self._file.path
        self.version: int = self._file.version
        self.alignment: int = self._file.alignment
        self.data_offset: int = self._file.data_offset
        self.file_size: int = self._file.file_size
        self.metadata: Dict[str, Any] = self._file.metadata
        self.metadata_types: Dict[str, str] = self._file.metadata_types
        self.tensors: Dict[str, GGUFTensorInfo] = {t.name: t for t in self._file.tensors}

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (e.g. ``'llama'``), or None when the file lacks it."""
        return self.metadata.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value for ``key``, or ``default`` when absent."""
        return self.metadata.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes: a read-only, zero-copy uint8 array of ``nbytes`` elements."""
        self._info(name)
        return self._file.tensor_data(name)

    def tensor_array(self, name: str) -> np.ndarray:
        """The tensor as a typed, shaped, read-only numpy view (no copy).

        Works for F32, F16, BF16 (returned as its raw uint16 bits), I8, I16, I32, I64 and F64;
        raises ValueError for quantized types (use :meth:`tensor_bytes`).
        """
        info = self._info(name)
        dt = NUMPY_DTYPES.get(info.type)
        if dt is None:
            raise ValueError(
                f"{self.path}: tensor {name!r} has quantized type {info.type_name}; "
                "use tensor_bytes() for its raw blocks"
            )
        return self._file.tensor_data(name).view(dt).reshape(info.shape)

    def prefetch(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """Start paging the tensor data in on a background native thread (returns at once; the
        first call per file counts). ``ranges``: only these (absolute file offset, bytes)."""
        if ranges is not None and not ranges:
            return
        fn = getattr(self._file, "prefetch", None)  # absent in native modules built before it
        if fn is not None:
            fn(list(ranges or []))

    def close(self) -> None:
        """Release this reader's reference to the mapping (arrays already taken stay valid)."""
        self._file.close()

    def __enter__(self) -> "GGUFReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFReader({self.path!r}: v{self.version}, arch={self.architecture!r}, "
            f"{len(self.metadata)} metadata keys, {len(self.tensors)} tensors)"
        )


from pyfast.gguf.info import describe  # noqa: E402  (info imports GGUFReader from here)
