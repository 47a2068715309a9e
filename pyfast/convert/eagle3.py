"""EAGLE-3 head checkpoints -> GGUF (``general.architecture = "eagle3"``, read by ``pyfast/spec/eagle3.py``).

Input: a directory with ``config.json`` and the weights as the public EAGLE-3 / SpecForge heads
ship them (``*.safetensors``, or ``pytorch_model.bin`` when torch is installed). Tensor names:
``fc.weight`` [d, 3 d_t]; the decoder layer under ``midlayer.`` (EAGLE-3) or ``layers.0.``
(SpecForge), optionally behind a ``model.`` prefix: ``input_layernorm``, ``hidden_norm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``;
``norm.weight``; optional ``lm_head.weight`` [V_d, d], ``embed_tokens.weight`` [V, d] and
``input_norm.weight`` [3 d_t] (norm before fc); ``d2t`` [V_d] and ``t2d`` [V].

``d2t`` is stored in checkpoints as offsets (draft row i is target id ``i + d2t[i]``); the GGUF
keeps absolute ids (I32), checked in range and unique (a bad table is a one-line ValueError).
``t2d`` (a mask over the target vocabulary) is only checked against d2t and not written.

Config keys read: ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` / ``rope_scaling``,
``max_position_embeddings``, ``vocab_size``, ``draft_vocab_size``, ``target_hidden_size``,
``norm_before_residual``, ``norm_before_fc``, and the feature layers from
``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``; vLLM's convention: the
input of those target layers, pyfast's too); a nested ``transformer_layer_config`` (the
``speculators`` format) provides the layer hyper-parameters.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["convert_eagle3", "convert_draft", "detect", "is_eagle3"]

ARCH = "eagle3"


def is_eagle3(cfg: dict, names) -> bool:
    """Whether a checkpoint (config + tensor names) is an EAGLE-3 head."""
    archs = " ".join(str(a) for a in (cfg.get("architectures") or []))
    if "eagle3" in archs.lower() or cfg.get("speculators_model_type") == "eagle3":
        return True
    names = set(names)
    return "fc.weight" in names and any(n.startswith(("midlayer.", "layers.0.", "model.layers.0.")) for n in names) \
        and "draft_vocab_size" in cfg


class _Weights:
    """Tensors of a checkpoint directory by name: safetensors files, or pytorch_model.bin via torch."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        self._st = None
        self._pt: dict[str, np.ndarray] | None = None
        if any(n.endswith(".safetensors") for n in os.listdir(hf_dir)):
            from pyfast.convert.safetensors import SafetensorsDir

            self._st = SafetensorsDir(hf_dir)
            self.names = list(self._st)
        else:
            bins = sorted(n for n in os.listdir(hf_dir) if n.endswith(".bin") or n.endswith(".pt"))
            if not bins:
                raise ValueError(f"{hf_dir}: no *.safetensors or pytorch_model.bin weights")
            try:
                import torch
            except ImportError:
                raise ValueError(f"{hf_dir}: the weights are a PyTorch pickle ({bins[0]}); install torch to read "
                                 "them, or convert them to safetensors") from None
            self._pt = {}
            for b in bins:
                sd = torch.load(os.path.join(hf_dir, b), map_location="cpu", weights_only=True)
                for k, v in sd.items():
                    self._pt[k] = v.float().numpy() if v.is_floating_point() else v.numpy()
            self.names = list(self._pt)

    def load(self, name: str) -> np.ndarray:
        """Floating tensors as float32; integer / bool ones (d2t, t2d) as stored."""
        if self._st is not None:
            if self._st.refs[name].dtype in ("I64", "I32", "I16", "I8", "U8", "BOOL"):
                return np.array(self._st.raw(name))
            return self._st.load(name)
        return self._pt[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if self._st is not None:
            return tuple(self._st.shape(name))
        return tuple(self._pt[name].shape)


@dataclass
class _Plan:
    metadata: list[tuple[str, Any, str]]
    tensors: list[tuple[str, tuple[int, ...], bool, Callable[[], np.ndarray]]]  # name, shape, keep_f32, produce


def _int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {v!r}")
    return int(v)


def plan(cfg: dict, src: _Weights) -> _Plan:
    from pyfast.convert.decoder import rope_freqs, rope_hparams, rope_metadata
    from pyfast.spec.eagle3 import check_d2t

    lc = dict(cfg)
    if isinstance(cfg.get("transformer_layer_config"), dict):  # the speculators format
        lc.update(cfg["transformer_layer_config"])
    d = _int(lc, "hidden_size")
    n_head = _int(lc, "num_attention_heads")
    n_head_kv = _int(lc, "num_key_value_heads", n_head)
    hd = int(lc.get("head_dim") or d // n_head)
    ff = _int(lc, "intermediate_size")
    V = _int(lc, "vocab_size")
    eps = float(lc.get("rms_norm_eps", 1e-6))
    if lc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {lc.get('hidden_act')!r} is not supported (silu only)")
    dt = int(cfg.get("target_hidden_size") or lc.get("target_hidden_size") or d)
    names = set(src.names)
    strip = "model." if not any(n.startswith(("fc.", "midlayer.", "layers.")) for n in names) else ""
    pre = next((p for p in (f"{strip}midlayer.", f"{strip}layers.0.") if any(n.startswith(p) for n in names)), None)
    if pre is None:
        raise ValueError(f"{src.dir}: no EAGLE-3 decoder layer (tensors under 'midlayer.' or 'layers.0.')")
    if any(n.startswith(f"{strip}layers.1.") for n in names):
        raise ValueError(f"{src.dir}: the head has more than one decoder layer; EAGLE-3 heads have one")
    used: set[str] = set()
    tensors: list = []

    def get(name: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
        if name not in names:
            raise ValueError(f"{src.dir}: missing tensor {name!r} (expected shape {list(shape)})")
        got = src.shape(name)
        if tuple(got) != tuple(shape):
            raise ValueError(f"{src.dir}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        used.add(name)
        return lambda: np.asarray(src.load(name), dtype=np.float32)

    def add(name: str, shape: tuple[int, ...], produce, keep_f32: bool | None = None) -> None:
        tensors.append((name, tuple(shape), len(shape) == 1 if keep_f32 is None else keep_f32, produce))

    layers = cfg.get("eagle_aux_hidden_state_layer_ids")
    if layers is None and isinstance(cfg.get("eagle_config"), dict):
        layers = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    fc_in = src.shape(strip + "fc.weight")[1] if strip + "fc.weight" in names else 3 * dt
    n_feat = len(layers) if layers else fc_in // dt
    if layers is not None and (not isinstance(layers, list) or not all(isinstance(x, int) and x >= 1 for x in layers)):
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids must be a list of layer ids >= 1, "
                         f"got {layers!r}")
    add("fc.weight", (d, n_feat * dt), get(strip + "fc.weight", (d, n_feat * dt)))
    norm_fc = strip + "input_norm.weight" in names
    if norm_fc:
        add("fc_norm.weight", (n_feat * dt,), get(strip + "input_norm.weight", (n_feat * dt,)))
    elif cfg.get("norm_before_fc"):
        raise ValueError(f"{src.dir}: config says norm_before_fc but there is no input_norm.weight")
    b, p = "blk.0", pre.rstrip(".")
    add(f"{b}.attn_norm.weight", (d,), get(f"{p}.input_layernorm.weight", (d,)))
    add(f"{b}.hidden_norm.weight", (d,), get(f"{p}.hidden_norm.weight", (d,)))
    add(f"{b}.attn_q.weight", (n_head * hd, 2 * d), get(f"{p}.self_attn.q_proj.weight", (n_head * hd, 2 * d)))
    add(f"{b}.attn_k.weight", (n_head_kv * hd, 2 * d), get(f"{p}.self_attn.k_proj.weight", (n_head_kv * hd, 2 * d)))
    add(f"{b}.attn_v.weight", (n_head_kv * hd, 2 * d), get(f"{p}.self_attn.v_proj.weight", (n_head_kv * hd, 2 * d)))
    add(f"{b}.attn_output.weight", (d, n_head * hd), get(f"{p}.self_attn.o_proj.weight", (d, n_head * hd)))
    add(f"{b}.ffn_norm.weight", (d,), get(f"{p}.post_attention_layernorm.weight", (d,)))
    add(f"{b}.ffn_gate.weight", (ff, d), get(f"{p}.mlp.gate_proj.weight", (ff, d)))
    add(f"{b}.ffn_up.weight", (ff, d), get(f"{p}.mlp.up_proj.weight", (ff, d)))
    add(f"{b}.ffn_down.weight", (d, ff), get(f"{p}.mlp.down_proj.weight", (d, ff)))
    add("output_norm.weight", (d,), get(strip + "norm.weight", (d,)))
    if strip + "embed_tokens.weight" in names:
        add("token_embd.weight", (V, d), get(strip + "embed_tokens.weight", (V, d)))
    Vd = int(cfg.get("draft_vocab_size") or lc.get("draft_vocab_size") or V)
    if not 1 <= Vd <= V:
        raise ValueError(f"config.json: draft_vocab_size {Vd} must be in [1, vocab_size = {V}]")
    head = strip + "lm_head.weight"
    if head in names:
        Vd = src.shape(head)[0] if cfg.get("draft_vocab_size") is None else Vd
        add("output.weight", (Vd, d), get(head, (Vd, d)))
    elif Vd != V:
        raise ValueError(f"{src.dir}: no lm_head.weight, so the head uses the target's; draft_vocab_size {Vd} "
                         f"must then equal vocab_size {V}")
    d2t_name = strip + "d2t"
    if d2t_name in names:
        off = np.asarray(src.load(d2t_name)).reshape(-1)
        used.add(d2t_name)
        if off.size != Vd:
            raise ValueError(f"{src.dir}: d2t has {off.size} entries but the draft vocabulary has {Vd} rows")
        if off.dtype.kind not in "iu":
            raise ValueError(f"{src.dir}: d2t must hold integer offsets, got {off.dtype}")
        absolute = check_d2t(np.arange(Vd, dtype=np.int64) + off.astype(np.int64), V, f"{src.dir}: d2t")
        t2d_name = strip + "t2d"
        if t2d_name in names:
            used.add(t2d_name)
            t2d = np.asarray(src.load(t2d_name)).reshape(-1).astype(bool)
            if t2d.size != V or int(t2d.sum()) != Vd or not bool(t2d[absolute].all()):
                raise ValueError(f"{src.dir}: t2d does not mark exactly the {Vd} target ids d2t maps to")
        ids = absolute.astype(np.int32)
        add("d2t", (Vd,), lambda: ids, keep_f32=False)
    elif Vd < V:
        raise ValueError(f"{src.dir}: a reduced draft vocabulary ({Vd} of {V}) needs a d2t tensor")
    elif strip + "t2d" in names:
        used.add(strip + "t2d")
    unused = sorted(n for n in names if n not in used)
    if unused:
        more = f" (and {len(unused) - 8} more)" if len(unused) > 8 else ""
        raise ValueError(f"{src.dir}: unexpected tensor(s) in the checkpoint: {', '.join(unused[:8])}{more}")

    rp, theta = rope_hparams(lc)

    class _HP:  # what rope_freqs reads
        pass

    hp = _HP()
    hp.rope_params, hp.rope_theta, hp.head_dim = rp, theta, hd
    rf = rope_freqs(hp)
    if rf is not None:
        add("rope_freqs.weight", rf.shape, lambda: np.asarray(rf, dtype=np.float32), keep_f32=True)
    a = ARCH
    md: list[tuple[str, Any, str]] = [
        (f"{a}.embedding_length", d, "uint32"), (f"{a}.target_embedding_length", dt, "uint32"),
        (f"{a}.feed_forward_length", ff, "uint32"), (f"{a}.attention.head_count", n_head, "uint32"),
        (f"{a}.attention.head_count_kv", n_head_kv, "uint32"), (f"{a}.attention.key_length", hd, "uint32"),
        (f"{a}.attention.value_length", hd, "uint32"),
        (f"{a}.attention.layer_norm_rms_epsilon", eps, "float32"),
        (f"{a}.rope.freq_base", float(theta or 10000.0), "float32"),
        (f"{a}.context_length", int(lc.get("max_position_embeddings") or 4096), "uint32"),
        (f"{a}.vocab_size", V, "uint32"), (f"{a}.draft_vocab_size", Vd, "uint32"),
        (f"{a}.norm_before_residual", bool(cfg.get("norm_before_residual", lc.get("norm_before_residual", False))),
         "bool"),
        (f"{a}.norm_before_fc", norm_fc, "bool"),
    ]
    if layers:
        md.append((f"{a}.target_layers", [int(x) for x in layers], "array[int32]"))
    md += rope_metadata(a, rp)
    return _Plan(md, tensors)


def convert_eagle3(hf_dir, out_path, outtype: str = "f32", log: Callable[[str], None] | None = None):
    """Convert the EAGLE-3 head checkpoint in ``hf_dir`` to the GGUF ``out_path``; returns a
    ``pyfast.convert.ConvertResult`` (n_mtp = 0)."""
    from pyfast.convert import QUANTIZATION_VERSION, ConvertResult, _read_config, encode_tensor, parse_outtype
    from pyfast.gguf.writer import GGUFWriter

    t0 = time.perf_counter()
    hf_dir, out_path = os.fspath(hf_dir), os.fspath(out_path)
    ot, mat_type, file_type = parse_outtype(outtype)
    cfg = _read_config(hf_dir)
    p = plan(cfg, _Weights(hf_dir))
    w = GGUFWriter(out_path)
    w.add("general.architecture", ARCH, "string")
    w.add("general.type", "draft", "string")
    w.add("general.name", os.path.basename(os.path.normpath(hf_dir)), "string")
    for key, value, typ in p.metadata:
        w.add(key, value, typ)
    w.add("general.file_type", file_type, "uint32")
    w.add("general.quantization_version", QUANTIZATION_VERSION, "uint32")
    for name, shape, keep_f32, produce in p.tensors:
        tid = 26 if name == "d2t" else (0 if keep_f32 else mat_type)   # 26: GGML I32

        def make(produce=produce, tid=tid, shape=shape, name=name):
            return encode_tensor(produce(), tid, shape, name)

        w.add_tensor(name, tid, shape, make)
        if log is not None:
            tn = {26: "I32", 0: "F32"}.get(tid, ot.upper())
            log(f"{name:<40} {tn:<5} {list(shape)}")
    w.write()
    return ConvertResult(out_path, ARCH, len(p.tensors), 0, os.path.getsize(out_path), time.perf_counter() - t0, False)


def detect(cfg: dict) -> bool:
    """Whether a config.json describes an EAGLE-3 head (``pyfast convert --draft`` dispatch)."""
    archs = " ".join(str(a) for a in (cfg.get("architectures") or []))
    return "eagle3" in archs.lower() or cfg.get("speculators_model_type") == "eagle3" or (
        "draft_vocab_size" in cfg and "dflash" not in archs.lower() and "block_size" not in cfg)


convert_draft = convert_eagle3  # the name the --draft dispatcher calls
