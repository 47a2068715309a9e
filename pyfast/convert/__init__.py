"""Converting Hugging Face checkpoints to GGUF: ``pyfast convert HF_DIR OUT.gguf``.

    >>> from pyfast.convert import convert
    >>> res = convert("Qwen3.5-0.8B/", "qwen35.gguf", outtype="bf16")
    >>> res.arch, res.n_mtp
    ('qwen35', 1)

Reads ``config.json`` and the ``*.safetensors`` weights (numpy only, no torch) and writes a GGUF
file with llama.cpp's tensor names and metadata, so llama.cpp loads it too. Supported
``model_type`` values: ``qwen3_5`` / ``qwen3_5_text`` (Qwen3.5, GGUF arch ``qwen35``),
``qwen3_5_moe`` / ``qwen3_5_moe_text`` (``qwen35moe``) and ``qwen3_next`` (``qwen3next``), see
:mod:`pyfast.convert.qwen35`; ``llama`` / ``mistral`` (``llama``), ``qwen2``, ``qwen3`` and
``qwen3_moe`` (``qwen3moe``), see :mod:`pyfast.convert.decoder`; ``glm4_moe`` (``glm4moe``, MTP
layers as ``nextn`` blocks), see :mod:`pyfast.convert.glm4moe`; ``deepseek_v3`` (``deepseek2``),
``deepseek_v32`` (``deepseek32``) and ``glm_moe_dsa`` (``glm-dsa``), MTP layers as ``nextn`` blocks,
see :mod:`pyfast.convert.deepseek`. ``tokenizer.json`` (when present)
becomes the ``tokenizer.*`` metadata; without it the file has no tokenizer and a warning says so.

Output types: ``f32``, ``f16``, ``bf16``. Like llama.cpp's converter, 1-D tensors, norms, the MoE
routers, the conv kernels and the non-``.weight`` tensors (``ssm_a``, ``ssm_dt.bias``) stay F32.
Bad input (no config.json, an unknown model type, a missing or misshapen tensor) raises
``ValueError`` naming the problem.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["OUTTYPES", "SUPPORTED_MODEL_TYPES", "ConvertResult", "convert", "convert_draft", "to_bf16_bits"]

# output type -> (ggml type id, general.file_type)
OUTTYPES: dict[str, tuple] = {"f32": (0, 0), "f16": (1, 1), "bf16": (30, 32)}
QUANTIZATION_VERSION = 2
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next",
                         "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe",
                         "gemma3_text", "gemma3", "gemma4_text", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")


@dataclass
class ConvertResult:
    path: str
    arch: str
    n_tensors: int
    n_mtp: int
    out_bytes: int
    seconds: float
    has_tokenizer: bool


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even; NaNs stay (quiet) NaNs."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    out = np.where(nan, (bits >> 16) | 0x40, rounded)
    return out.astype(np.uint16)


def parse_outtype(outtype: str) -> tuple[str, int, int]:
    """(name, GGML type of the weight matrices, general.file_type) for an --outtype value."""
    ot = str(outtype).lower()
    if ot not in OUTTYPES:
        raise ValueError(f"unknown output type {outtype!r}; use one of {', '.join(OUTTYPES)}")
    return (ot,) + tuple(OUTTYPES[ot])


def encode_tensor(a: np.ndarray, tid: int, shape: tuple, name: str) -> np.ndarray:
    """A produced tensor as GGML type tid stores it (0 F32, 1 F16, 30 BF16, 26 I32), after
    checking its shape."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: produced shape {a.shape}, expected {tuple(shape)}")
    if tid == 26:
        return np.ascontiguousarray(a, dtype=np.int32)
    if tid == 0:
        return np.ascontiguousarray(a, dtype=np.float32)
    if tid == 1:
        return np.ascontiguousarray(a, dtype=np.float16)
    return to_bf16_bits(a)


def _read_config(hf_dir: str) -> dict:
    if not os.path.isdir(hf_dir):
        raise ValueError(f"{hf_dir}: not a directory (give a Hugging Face model directory)")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{hf_dir}: no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    return cfg


def _families() -> list:
    """The converter modules, each with ARCH_BY_MODEL_TYPE, ARCH_BY_HF_ARCH, hparams, plan, metadata."""
    from pyfast.convert import decoder, deepseek, gemma, gemma4, glm4moe, qwen35

    return [qwen35, decoder, glm4moe, gemma, gemma4, deepseek]


def _arch_of(cfg: dict, path: str) -> tuple[str, object]:
    """(GGUF architecture, converter module) of a config."""
    mt = cfg.get("model_type")
    for fam in _families():
        if mt in fam.ARCH_BY_MODEL_TYPE:
            return fam.ARCH_BY_MODEL_TYPE[mt], fam
    archs = cfg.get("architectures") or []
    if mt is None:
        for a in archs:
            for fam in _families():
                if a in fam.ARCH_BY_HF_ARCH:
                    return fam.ARCH_BY_HF_ARCH[a], fam
    what = f"model_type {mt!r}" if mt is not None else f"architectures {archs!r}"
    raise ValueError(f"{path}: unsupported {what}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")


def convert(hf_dir, out_path, mtp: bool = True, outtype: str = "f32",
            log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert the Hugging Face model in ``hf_dir`` to the GGUF file ``out_path``.

    Args:
        hf_dir: directory with config.json, *.safetensors and optionally tokenizer files.
        out_path: the GGUF file to write (replaced atomically).
        mtp: keep the multi-token-prediction layers (``mtp.*``) as extra ``nextn`` blocks.
        outtype: ``f32``, ``f16`` or ``bf16`` for the weight matrices.
        log: called with one line per tensor when given.
    """
    from pyfast.convert.hf_tokenizer import tokenizer_metadata
    from pyfast.convert.safetensors import SafetensorsDir
    from pyfast.gguf.writer import GGUFWriter

    t0 = time.perf_counter()
    hf_dir, out_path = os.fspath(hf_dir), os.fspath(out_path)
    ot, mat_type, file_type = parse_outtype(outtype)
    cfg = _read_config(hf_dir)
    arch, fam = _arch_of(cfg, os.path.join(hf_dir, "config.json"))
    hp = fam.hparams(arch, cfg)
    p = fam.plan(hp, SafetensorsDir(hf_dir), mtp=mtp)

    w = GGUFWriter(out_path)
    w.add("general.architecture", arch, "string")
    w.add("general.type", "model", "string")
    w.add("general.name", os.path.basename(os.path.normpath(hf_dir)), "string")
    for key, value, typ in fam.metadata(hp, p.n_mtp):
        w.add(key, value, typ)
    w.add("general.file_type", file_type, "uint32")
    w.add("general.quantization_version", QUANTIZATION_VERSION, "uint32")
    default_pre = getattr(fam, "DEFAULT_PRE", {}).get(arch) or ("qwen2" if arch == "qwen3next" else "qwen35")
    tok = tokenizer_metadata(hf_dir, cfg, hp.n_vocab, default_pre, arch=arch)
    if tok is None:
        warnings.warn(f"{hf_dir}: no tokenizer.json or tokenizer.model; the GGUF file gets no tokenizer metadata",
                      stacklevel=2)
    else:
        for key, value, typ in tok:
            w.add(key, value, typ)

    for t in p.tensors:
        tid = 0 if t.keep_f32 else mat_type

        def produce(t=t, tid=tid):
            return encode_tensor(t.produce(), tid, t.shape, t.name)

        w.add_tensor(t.name, tid, t.shape, produce)
        if log is not None:
            log(f"{t.name:<40} {'F32' if tid == 0 else ot.upper():<5} {list(t.shape)}")
    w.write()
    return ConvertResult(out_path, arch, len(p.tensors), p.n_mtp, os.path.getsize(out_path),
                         time.perf_counter() - t0, tok is not None)


def convert_draft(hf_dir, out_path, outtype: str = "f32",
                  log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert a speculative drafter checkpoint (``pyfast convert --draft``): DFlash / DSpark (z-lab,
    DeepSpec, speculators / SpecForge; :mod:`pyfast.convert.dflash`) or EAGLE-3
    (``pyfast.convert.eagle3`` when present), chosen from config.json."""
    import importlib

    from pyfast.convert import dflash

    hf_dir = os.fspath(hf_dir)
    cfg = _read_config(hf_dir)
    if dflash.detect(cfg) is not None:
        return dflash.convert_draft(hf_dir, out_path, outtype=outtype, log=log)
    try:
        eagle3 = importlib.import_module("pyfast.convert.eagle3")
    except ImportError:
        eagle3 = None
    if eagle3 is not None and eagle3.detect(cfg):
        return eagle3.convert_draft(hf_dir, out_path, outtype=outtype, log=log)
    raise ValueError(f"{os.path.join(hf_dir, 'config.json')}: not a drafter checkpoint this version converts "
                     "(DFlash / DSpark: dflash_config, speculators_model_type dflash / dspark, DeepSpec DSpark; "
                     "EAGLE-3); convert a full model without --draft")
