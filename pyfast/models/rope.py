"""Rotary embedding settings read from GGUF metadata, shared by the architecture files.

llama.cpp's conventions, which the converters write:

* ``{arch}.rope.freq_base`` (theta), ``{arch}.rope.dimension_count`` (rotated dims per head);
* ``{arch}.rope.scaling.type``: ``none``, ``linear`` (angles times 1 / ``rope.scaling.factor``) or
  ``yarn`` (YaRN: ``rope.scaling.factor``, ``rope.scaling.original_context_length``,
  ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` (32 / 1), ``yarn_ext_factor`` (1),
  ``rope.scaling.attn_factor`` (1));
* Llama 3.x's ``rope_type: llama3`` has no scaling type: the converter writes the per-pair
  divisors of the angles as the tensor ``rope_freqs.weight`` [n_rot / 2], which the rope op
  applies as ``freq_factors``.

The native ``rope`` op takes all of these (``pyfast/_native.pyi``); YaRN's correction range (the
pairs between full interpolation and full extrapolation) is computed here, as llama.cpp does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyfast._loader import native

ROPE_NORMAL = 0  # adjacent pairs (2i, 2i + 1): llama.cpp's converter permutes Llama's q / k rows for it
ROPE_NEOX = 2    # pairs (i, i + n_rot / 2): the checkpoint's rotate_half layout

FREQS_TENSOR = "rope_freqs.weight"
_F32 = native.DType.F32


@dataclass(frozen=True)
class Rope:
    n_rot: int
    mode: int
    base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    corr_low: float = 0.0
    corr_high: float = 0.0
    freq_factors: str | None = None  # tensor name of per-pair divisors (Llama 3)

    def apply(self, b, x, pos=None):
        """Rotate x [T, H, D] at the batch positions (or ``pos``)."""
        ff = None
        if self.freq_factors:
            ff = b.weight(self.freq_factors)
            if ff.dtype != _F32:
                ff = b.g.cpy(ff, _F32)
        return b.g.rope(x, b.pos if pos is None else pos, self.n_rot, self.mode, self.base, self.freq_scale,
                        freq_factors=ff, ext_factor=self.ext_factor, attn_factor=self.attn_factor,
                        corr_low=self.corr_low, corr_high=self.corr_high)

    def with_base(self, base: float, freq_scale: float | None = None) -> "Rope":
        """The same rope with another theta (Gemma's local layers)."""
        return Rope(self.n_rot, self.mode, base, self.freq_scale if freq_scale is None else freq_scale,
                    self.ext_factor, self.attn_factor, self.corr_low, self.corr_high, self.freq_factors)


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The pair range [low, high] over which YaRN ramps from extrapolation to interpolation."""
    def dim(n_turns: float) -> float:
        return n_rot * math.log(n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(dim(beta_fast)))
    hi = min(n_rot - 1.0, math.ceil(dim(beta_slow)))
    return float(lo), float(hi)


def llama3_freq_factors(n_rot: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        n_ctx_orig: int):
    """Llama 3's per-pair angle divisors (what a converter writes as ``rope_freqs.weight``):
    long wavelengths are divided by ``factor``, short ones kept, the band between blended."""
    import numpy as np

    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = n_ctx_orig / low_freq_factor, n_ctx_orig / high_freq_factor
    out = np.ones_like(inv)
    for i, wl in enumerate(wavelen):
        if wl < hi_wl:
            out[i] = 1.0
        elif wl > lo_wl:
            out[i] = factor
        else:
            smooth = (n_ctx_orig / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out[i] = 1.0 / ((1 - smooth) / factor + smooth)
    return out.astype(np.float32)


def read_rope(m, arch: str, weights, n_rot: int, mode: int, default_base: float = 10000.0,
              base_key: str = "rope.freq_base") -> Rope:
    """The rope of ``arch`` from metadata (m: ``pyfast.models.meta.Meta``) and the tensors
    (``rope_freqs.weight``); unknown scaling types are a ValueError naming the key."""
    key = f"{arch}.rope.scaling.type"
    scaling = m.str(key, "none", choices=("none", "linear", "yarn"))
    base = m.float(f"{arch}.{base_key}", default_base, positive=True)
    kw: dict = {}
    if scaling in ("linear", "yarn"):
        factor = m.float(f"{arch}.rope.scaling.factor", 1.0, positive=True)
        kw["freq_scale"] = 1.0 / factor
    if scaling == "yarn":
        n_orig = m.int(f"{arch}.rope.scaling.original_context_length", lo=1, hi=1 << 31)
        fast = m.float(f"{arch}.rope.scaling.yarn_beta_fast", 32.0, positive=True)
        slow = m.float(f"{arch}.rope.scaling.yarn_beta_slow", 1.0, positive=True)
        kw["ext_factor"] = m.float(f"{arch}.rope.scaling.yarn_ext_factor", 1.0, lo=0.0, hi=1.0)
        kw["corr_low"], kw["corr_high"] = yarn_corr_dims(n_rot, n_orig, base, fast, slow)
    kw["attn_factor"] = m.float(f"{arch}.rope.scaling.attn_factor", 1.0, positive=True)
    if FREQS_TENSOR in weights:
        shape = tuple(weights.shape(FREQS_TENSOR))
        if shape != (n_rot // 2,):
            where = f"{m.path}: " if m.path else ""
            raise ValueError(f"{where}tensor '{FREQS_TENSOR}' has shape {list(shape)}, expected [{n_rot // 2}] "
                             "(rope.dimension_count / 2)")
        kw["freq_factors"] = FREQS_TENSOR
    return Rope(n_rot=n_rot, mode=mode, base=base, **kw)
