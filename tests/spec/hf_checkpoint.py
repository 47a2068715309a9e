"""Hugging Face checkpoint files for the drafter tests: a safetensors writer (numpy only)."""
from __future__ import annotations

import json
import struct

import numpy as np

_ST = {np.dtype("<f4"): "F32", np.dtype("<i8"): "I64", np.dtype("bool"): "BOOL"}


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file of F32 / I64 / BOOL arrays (numpy only)."""
    head, blobs, off = {}, [], 0
    for k, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype == np.float64:
            a = a.astype("<f4")
        b = a.tobytes()
        head[k] = {"dtype": _ST[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(head).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
