"""Human-readable summary of a GGUF file (what ``pyfast info`` prints)."""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, List, Union

import numpy as np

from pyfast.gguf import GGUFReader

_MAX_STR = 60       # characters of a string value shown
_MAX_ITEMS = 6      # array items shown


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def _scalar(v: Any, typ: str) -> str:
    if isinstance(v, str):
        if len(v) > _MAX_STR:
            return repr(v[:_MAX_STR]) + f"... ({len(v)} chars)"
        return repr(v)
    if isinstance(v, float) and typ.endswith("float32"):
        return str(np.float32(v))  # shortest repr of the stored float32
    return repr(v)


def _value(v: Any, typ: str) -> str:
    if not isinstance(v, list):
        return _scalar(v, typ)
    elem = typ[len("array["):-1] if typ.startswith("array[") else typ
    items = [_value(x, elem) if isinstance(x, list) else _scalar(x, elem) for x in v[:_MAX_ITEMS]]
    if len(v) <= _MAX_ITEMS:
        return "[" + ", ".join(items) + "]"
    return f"[{len(v)} items: " + ", ".join(items) + ", ...]"


def _table(rows: List[List[str]], right: set = frozenset()) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def describe(path_or_reader: Union[str, "os.PathLike[str]", GGUFReader]) -> str:
    """A multi-line summary of a GGUF file: header, metadata (long strings and arrays
    abbreviated to their length and first items) and a table of tensors."""
    r = path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(path_or_reader)
    lines = [
        f"GGUF file: {r.path}",
        f"  version {r.version}, {_size(r.file_size)}, alignment {r.alignment}, "
        f"tensor data at offset {r.data_offset}",
        f"  architecture: {r.architecture or '(none)'}",
        "",
        f"Metadata ({len(r.metadata)} keys):",
    ]
    if r.metadata:
        rows = [[k, r.metadata_types[k], _value(v, r.metadata_types[k])] for k, v in r.metadata.items()]
        lines += _table(rows)

    total = sum(t.nbytes for t in r.tensors.values())
    n_params = sum(t.n_elements for t in r.tensors.values())
    lines += ["", f"Tensors ({len(r.tensors)}, {n_params:,} elements, {_size(total)}):"]
    if r.tensors:
        by_type = Counter(t.type_name for t in r.tensors.values())
        lines.append("  types: " + ", ".join(f"{name} x{n}" for name, n in by_type.most_common()))
        rows = [["name", "type", "shape", "size"]]
        rows += [
            [t.name, t.type_name, " x ".join(str(d) for d in t.shape) or "()", _size(t.nbytes)]
            for t in r.tensors.values()
        ]
        lines += _table(rows, right={3})
    return "\n".join(lines)
