"""Control vectors: per-layer directions added to the residual stream (llama.cpp's
``--control-vector``, ``--control-vector-scaled`` and ``--control-vector-layer-range``).

File format (the one llama.cpp's control-vector generator writes): a GGUF whose tensors are
``direction.N``, each a 1-D F32 vector of the model's embedding size. ``direction.N`` is added to
the hidden state after layer N (0-based), so layer 0 never gets one. Several ``direction.N`` of
one file, and several files, are summed, each scaled by its file's strength.

Applied to a model, the directions of layers ``start`` .. ``end`` (inclusive; default 1 and the
layer count) become one extra ``add`` per layer in every graph (``GraphBuilder.control``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from pyfast.gguf import GGUFError, GGUFReader


@dataclass
class ControlVector:
    """Summed, scaled directions by layer (the N of ``direction.N``)."""

    n_embd: int
    directions: dict[int, np.ndarray] = field(default_factory=dict)  # N -> [n_embd] float32

    @classmethod
    def load(cls, path: str | os.PathLike, strength: float = 1.0) -> "ControlVector":
        """One control-vector file, every direction scaled by ``strength``."""
        path = str(path)
        if not os.path.isfile(path):
            raise ValueError(f"control vector file not found: {path}")
        if not np.isfinite(strength):
            raise ValueError(f"control vector {path}: strength must be a finite number, got {strength}")
        try:
            reader = GGUFReader(path)
        except (GGUFError, ValueError, OSError) as e:
            raise ValueError(f"control vector {path}: {e}") from None
        with reader:
            if not reader.tensors:
                raise ValueError(f"control vector {path}: no direction tensors")
            cv: ControlVector | None = None
            for name, info in reader.tensors.items():
                prefix, _, idx = name.partition(".")
                if prefix != "direction" or not idx.isdigit():
                    raise ValueError(f"control vector {path}: tensor '{name}' is not named direction.<layer>")
                layer = int(idx)
                if layer == 0:
                    raise ValueError(f"control vector {path}: direction.0 is invalid (layer 0 has no direction; "
                                     f"direction.N follows layer N)")
                if info.type_name != "F32":
                    raise ValueError(f"control vector {path}: tensor '{name}' has type {info.type_name}, "
                                     f"expected F32")
                if len(info.shape) != 1:
                    raise ValueError(f"control vector {path}: tensor '{name}' has shape {list(info.shape)}, "
                                     f"expected one dimension")
                vec = np.asarray(reader.tensor_array(name), dtype=np.float32).reshape(-1)
                if cv is None:
                    cv = cls(n_embd=vec.size)
                elif vec.size != cv.n_embd:
                    raise ValueError(f"control vector {path}: tensor '{name}' has {vec.size} elements, "
                                     f"the file's other directions {cv.n_embd}")
                cv._add(layer, vec * np.float32(strength))
        assert cv is not None
        return cv

    @classmethod
    def combine(cls, items: list[tuple[str | os.PathLike, float]]) -> "ControlVector":
        """The sum of several files, each (path, strength)."""
        if not items:
            raise ValueError("no control vector files given")
        out: ControlVector | None = None
        for path, strength in items:
            cv = cls.load(path, strength)
            if out is None:
                out = cv
                continue
            if cv.n_embd != out.n_embd:
                raise ValueError(f"control vector {path}: {cv.n_embd} elements per direction, "
                                 f"the earlier files {out.n_embd}")
            for layer, vec in cv.directions.items():
                out._add(layer, vec)
        assert out is not None
        return out

    def save(self, path: str | os.PathLike, model_hint: str | None = None) -> None:
        """Write the directions as a control-vector GGUF (``direction.N``, F32)."""
        from pyfast.gguf.writer import GGUFWriter

        w = GGUFWriter(path)
        w.add("general.architecture", "controlvector")
        if model_hint:
            w.add("controlvector.model_hint", model_hint)
        w.add("controlvector.layer_count", len(self.directions), "uint32")
        for layer, vec in sorted(self.directions.items()):
            w.add_tensor(f"direction.{layer}", 0, [self.n_embd], np.ascontiguousarray(vec, dtype=np.float32))
        w.write()

    def _add(self, layer: int, vec: np.ndarray) -> None:
        cur = self.directions.get(layer)
        self.directions[layer] = vec.astype(np.float32) if cur is None else cur + vec

    def layers(self, n_layer: int, n_embd: int, start: int | None = None,
               end: int | None = None) -> dict[int, np.ndarray]:
        """The vectors a model with ``n_layer`` layers of width ``n_embd`` adds, by 0-based layer
        (the output of that layer): directions 1 .. n_layer - 1 within [start, end]."""
        if self.n_embd != n_embd:
            raise ValueError(f"control vector has {self.n_embd} elements per direction, the model's embedding "
                             f"length is {n_embd}")
        lo = 1 if start is None or start <= 0 else int(start)
        hi = n_layer if end is None or end <= 0 else int(end)
        if lo > hi:
            raise ValueError(f"control vector layer range {lo}..{hi} is empty")
        return {il: np.ascontiguousarray(v, dtype=np.float32) for il, v in sorted(self.directions.items())
                if lo <= il <= hi and il < n_layer}


def parse_scaled(spec: str) -> list[tuple[str, float]]:
    """``--control-vector-scaled`` values: ``FNAME:SCALE`` items, comma-separated."""
    out = []
    for item in (s for s in spec.split(",") if s):
        path, sep, scale = item.rpartition(":")
        try:
            if not sep or not path:
                raise ValueError
            out.append((path, float(scale)))
        except ValueError:
            raise ValueError(f"--control-vector-scaled: expected FNAME:SCALE, got {item!r}") from None
    return out


__all__ = ["ControlVector", "parse_scaled"]
