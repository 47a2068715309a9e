"""DFlash / DSpark drafter checkpoints -> the ``dflash`` GGUF of ``pyfast/spec/dflash.py``.

Three public formats are read (config.json decides):

* **z-lab DFlash** (``DFlashDraftModel``): a Qwen3-style config with ``block_size`` and
  ``dflash_config = {mask_token_id, target_layer_ids}``; tensors ``fc``, ``hidden_norm``, ``norm``,
  ``layers.N.*``; embedding and head are the target's. Layer ids are "output of layer l" (as the
  GGUF stores them); without ``target_layer_ids`` they are spread from layer 1 to n-3 of
  ``num_target_layers``. Bonus-anchor block layout (``sample_from_anchor`` false).
* **DeepSpec DSpark, dense** (``Qwen3DSparkModel``): a flat config with ``block_size``,
  ``mask_token_id``, ``target_layer_ids`` (-1 = the embedding output), ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``; its own
  ``embed_tokens`` / ``lm_head`` over the full vocabulary; ``markov_head.markov_w1`` [V, R],
  ``markov_head.markov_w2`` [V, R], ``confidence_head.proj``. Anchor-first layout.
* **speculators / SpecForge** (``speculators_model_type`` ``dflash`` or ``dspark``): the draft
  layers' config nested in ``transformer_layer_config``; ``draft_vocab_size``, ``block_size``,
  ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``target_hidden_size``, ``sample_from_anchor``
  (absent: true for dspark, false for dflash), ``markov_rank`` ...; a reduced vocabulary has
  ``lm_head`` [V_d, d] and ``d2t`` (offsets: target id = row + d2t[row]; written absolute and
  checked); ``t2d`` and the verifier copies are dropped. Its aux layer ids count hidden states
  with the embedding first (id i = input of layer i, vLLM's convention), so the GGUF gets i - 1.

Only the vanilla Markov head (``markov_head_type`` "vanilla") is supported; gated / rnn heads and
attention biases are refused by name. Norms, ``conf_proj`` and 1-D tensors stay F32.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from pyfast.convert.qwen35 import _int, _Source
from pyfast.convert.safetensors import SafetensorsDir

FORMATS = ("dflash", "deepspec", "speculators")


def detect(cfg: dict) -> str | None:
    """The drafter format of a config.json, or None when it is not a DFlash / DSpark drafter."""
    if not isinstance(cfg, dict):
        return None
    archs = cfg.get("architectures") or []
    if isinstance(cfg.get("transformer_layer_config"), dict):
        return "speculators" if cfg.get("speculators_model_type") in ("dflash", "dspark") else None
    if "dflash_config" in cfg or "DFlashDraftModel" in archs:
        return "dflash"
    if any(str(a).endswith("DSparkModel") for a in archs) or ("markov_rank" in cfg and "target_layer_ids" in cfg):
        return "deepspec"
    return None


def spread_layers(n_target: int, n: int) -> list[int]:
    """n target layer ids ("output of layer l") spread evenly from 1 to n_target - 3."""
    if n == 1:
        return [n_target // 2]
    lo, hi = 1, n_target - 3
    return [int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]


def _layers_cfg(cfg: dict, fmt: str) -> dict:
    if fmt == "speculators":
        return dict(cfg["transformer_layer_config"])
    return cfg


def _plan_meta(cfg: dict, fmt: str, path: str) -> dict[str, Any]:
    """Everything the GGUF metadata needs, checked."""
    tl = _layers_cfg(cfg, fmt)
    d = _int(tl, "hidden_size")
    n_head = _int(tl, "num_attention_heads")
    out: dict[str, Any] = dict(
        d=d, n_layer=_int(tl, "num_hidden_layers"), n_head=n_head,
        n_head_kv=_int(tl, "num_key_value_heads", n_head), head_dim=int(tl.get("head_dim") or d // n_head),
        n_ff=_int(tl, "intermediate_size"), eps=float(tl.get("rms_norm_eps", 1e-6)), V=_int(tl, "vocab_size"),
        n_ctx=tl.get("max_position_embeddings"))
    if tl.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias = true is not supported for DFlash / DSpark drafters")
    if tl.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {tl.get('hidden_act')!r} is not supported (silu only)")
    from pyfast.convert.decoder import rope_hparams

    out["rope_params"], theta = rope_hparams(tl)
    out["rope_theta"] = float(theta) if theta is not None else 10000.0
    if fmt == "dflash":
        dc = cfg.get("dflash_config") or {}
        out["block"] = int(cfg.get("block_size", dc.get("block_size", 16)))
        mask = dc.get("mask_token_id", cfg.get("mask_token_id"))
        layers = dc.get("target_layer_ids")
        if layers is None:
            n_t = cfg.get("num_target_layers")
            if n_t is None:
                raise ValueError(f"{path}: dflash_config has no target_layer_ids and there is no num_target_layers "
                                 "to spread them over")
            layers = spread_layers(int(n_t), out["n_layer"])
        anchor_first = bool(cfg.get("sample_from_anchor", False))
        out["markov_rank"] = 0
    elif fmt == "deepspec":
        out["block"] = _int(cfg, "block_size")
        mask = cfg.get("mask_token_id")
        layers = cfg.get("target_layer_ids")
        anchor_first = bool(cfg.get("sample_from_anchor", True))
        out["markov_rank"] = int(cfg.get("markov_rank", 0) or 0)
        out["conf"] = bool(cfg.get("enable_confidence_head", False))
        out["conf_markov"] = bool(cfg.get("confidence_head_with_markov", False))
    else:
        kind = cfg["speculators_model_type"]
        out["block"] = int(cfg.get("block_size", 8))
        mask = cfg.get("mask_token_id")
        aux = cfg.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise ValueError(f"{path}: aux_hidden_state_layer_ids is missing (the target layers the drafter reads)")
        layers = [int(i) - 1 for i in aux]   # hidden-state index (embedding = 0) -> "output of layer" id
        sfa = cfg.get("sample_from_anchor")
        anchor_first = (kind == "dspark") if sfa is None else bool(sfa)
        out["markov_rank"] = int(cfg.get("markov_rank", 0) or 0) if kind == "dspark" else 0
        out["conf"] = bool(cfg.get("enable_confidence_head", False)) if kind == "dspark" else False
        out["conf_markov"] = bool(cfg.get("confidence_head_with_markov", False))
        out["V_d"] = int(cfg.get("draft_vocab_size") or out["V"])
        if cfg.get("target_hidden_size"):
            out["d_t"] = int(cfg["target_hidden_size"])
    if out["markov_rank"] and str(cfg.get("markov_head_type", "vanilla")).lower() != "vanilla":
        raise ValueError(f"{path}: markov_head_type {cfg.get('markov_head_type')!r} is not supported "
                         "(vanilla only)")
    if mask is None:
        raise ValueError(f"{path}: mask_token_id is missing (the token the block's masked slots carry)")
    if not isinstance(layers, list) or not layers or any(isinstance(x, bool) or not isinstance(x, int) or x < -1
                                                         for x in layers):
        raise ValueError(f"{path}: target layer ids {layers!r}: expected a non-empty list of integers >= -1")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{path}: target layer ids {layers!r} repeat a layer")
    if not 2 <= out["block"] <= 256:
        raise ValueError(f"{path}: block_size {out['block']} is outside [2, 256]")
    out.update(mask=int(mask), layers=[int(x) for x in layers], anchor_first=anchor_first)
    lt = tl.get("layer_types")
    if tl.get("use_sliding_window", True) and tl.get("sliding_window") and isinstance(lt, list) and \
            "sliding_attention" in lt:
        out["swa"] = int(tl["sliding_window"])
        out["swa_pattern"] = [t == "sliding_attention" for t in lt[: out["n_layer"]]]
        # speculators: sliding layers are causal inside the block unless sliding_window_non_causal
        out["swa_causal"] = fmt == "speculators" and not bool(cfg.get("sliding_window_non_causal", False))
    return out


def convert_draft(hf_dir, out_path, outtype: str = "f32", log: Callable[[str], None] | None = None):
    """Convert a DFlash / DSpark drafter directory to a GGUF file; returns a ConvertResult
    (``n_mtp`` = 0). ValueError names what is wrong."""
    from pyfast.convert import QUANTIZATION_VERSION, ConvertResult, _read_config, encode_tensor, parse_outtype
    from pyfast.convert.decoder import rope_metadata
    from pyfast.gguf.writer import GGUFWriter
    from pyfast.spec.dflash import check_d2t

    t0 = time.perf_counter()
    hf_dir, out_path = os.fspath(hf_dir), os.fspath(out_path)
    _, mat_type, file_type = parse_outtype(outtype)
    cfg = _read_config(hf_dir)
    cpath = os.path.join(hf_dir, "config.json")
    fmt = detect(cfg)
    if fmt is None:
        raise ValueError(f"{cpath}: not a DFlash / DSpark drafter config (no dflash_config, "
                         "speculators_model_type dflash / dspark, or DeepSpec DSpark fields)")
    hp = _plan_meta(cfg, fmt, cpath)
    st = SafetensorsDir(hf_dir)
    src = _Source(st)
    d, D, H, Hkv, ff = hp["d"], hp["head_dim"], hp["n_head"], hp["n_head_kv"], hp["n_ff"]
    L = len(hp["layers"])
    fc_ref = src.names.get("fc.weight")
    if fc_ref is None:
        raise ValueError(f"{st.dir}: missing tensor 'fc.weight'")
    fc_shape = st.shape(fc_ref)
    d_t = hp.get("d_t") or (fc_shape[1] // L if len(fc_shape) == 2 else 0)
    tensors: list[tuple[str, int, tuple, Callable]] = []   # (name, ggml type, shape, produce)

    def add(name: str, hf: str, shape: tuple, keep_f32: bool = False) -> None:
        get = src.get(hf, shape)
        tensors.append((name, 0 if keep_f32 or len(shape) <= 1 else mat_type, tuple(shape), get))

    add("fc.weight", "fc.weight", (d, L * d_t))
    add("enc.output_norm.weight", "hidden_norm.weight", (d,))
    add("output_norm.weight", "norm.weight", (d,))
    for i in range(hp["n_layer"]):
        b, p = f"blk.{i}", f"layers.{i}"
        add(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", (d,))
        add(f"{b}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (H * D, d))
        add(f"{b}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (Hkv * D, d))
        add(f"{b}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (Hkv * D, d))
        add(f"{b}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (d, H * D))
        add(f"{b}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", (D,))
        add(f"{b}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", (D,))
        add(f"{b}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", (d,))
        add(f"{b}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", (ff, d))
        add(f"{b}.ffn_up.weight", f"{p}.mlp.up_proj.weight", (ff, d))
        add(f"{b}.ffn_down.weight", f"{p}.mlp.down_proj.weight", (d, ff))
    V = hp["V"]
    V_d = hp.get("V_d", V)
    if src.has("embed_tokens.weight"):
        add("token_embd.weight", "embed_tokens.weight", (V, d))
    d2t = None
    if src.has("lm_head.weight"):
        add("output.weight", "lm_head.weight", (V_d, d))
    elif V_d != V:
        raise ValueError(f"{st.dir}: draft_vocab_size {V_d} < vocab_size {V} but there is no 'lm_head.weight'")
    if V_d != V:
        if not src.has("d2t"):
            raise ValueError(f"{st.dir}: a reduced vocabulary ({V_d} of {V}) needs the 'd2t' table")
        key = src.names["d2t"]
        if tuple(st.shape(key)) != (V_d,) or st.refs[key].dtype not in ("I64", "I32"):
            raise ValueError(f"{st.dir}: tensor 'd2t' is {st.refs[key].dtype}{list(st.shape(key))}, expected an "
                             f"integer vector of {V_d} offsets (draft_vocab_size)")
        d2t = check_d2t(np.arange(V_d) + np.asarray(st.raw(key), dtype=np.int64), V_d, V, f"{st.dir}: d2t")
        tensors.append(("d2t", 26, (V_d,), lambda: d2t.astype(np.int32)))
    for extra in ("t2d", "d2t", "verifier_norm.weight", "verifier_lm_head.weight"):
        if src.has(extra):
            src.used.add(extra)   # the t2d mask and the verifier's copies are not needed at run time
    R = hp["markov_rank"]
    conf_markov = False
    if R:
        if not src.has("markov_head.markov_w1.weight"):
            raise ValueError(f"{st.dir}: markov_rank {R} but no 'markov_head.markov_w1.weight'")
        add("markov_w1.weight", "markov_head.markov_w1.weight", (V, R))
        add("markov_w2.weight", "markov_head.markov_w2.weight", (V_d, R))
        if src.has("confidence_head.proj.weight"):
            conf_markov = hp.get("conf_markov", False)
            width = d + (R if conf_markov else 0)
            add("conf_proj.weight", "confidence_head.proj.weight", (1, width), keep_f32=True)
            add("conf_proj.bias", "confidence_head.proj.bias", (1,))
    unused = sorted(st_name for n, st_name in src.names.items() if n not in src.used)
    if unused:
        from pyfast.convert.common import reject_unused

        reject_unused(st.dir, unused)

    a = "dflash"
    w = GGUFWriter(out_path)
    w.add("general.architecture", a, "string")
    w.add("general.type", "model", "string")
    w.add("general.name", os.path.basename(os.path.normpath(hf_dir)), "string")
    from pyfast.convert.common import attention_metadata

    for key, value, typ in attention_metadata(a, hp["n_layer"], hp["n_ctx"], d, ff, H, Hkv, D):
        w.add(key, value, typ)
    w.add(f"{a}.rope.dimension_count", D, "uint32")
    w.add(f"{a}.rope.freq_base", hp["rope_theta"], "float32")
    for key, value, typ in rope_metadata(a, hp["rope_params"]):
        w.add(key, value, typ)
    w.add(f"{a}.attention.layer_norm_rms_epsilon", hp["eps"], "float32")
    w.add(f"{a}.vocab_size", V, "uint32")
    w.add(f"{a}.block_size", hp["block"], "uint32")
    w.add(f"{a}.mask_token_id", hp["mask"], "uint32")
    w.add(f"{a}.target_layers", hp["layers"], "array[int32]")
    w.add(f"{a}.target_hidden_size", d_t, "uint32")
    w.add(f"{a}.sample_from_anchor", bool(hp["anchor_first"]), "bool")
    if hp.get("swa"):
        w.add(f"{a}.attention.sliding_window", hp["swa"], "uint32")
        w.add(f"{a}.attention.sliding_window_pattern", hp["swa_pattern"], "array[bool]")
        w.add(f"{a}.attention.sliding_window_causal", bool(hp["swa_causal"]), "bool")
    w.add("general.file_type", file_type, "uint32")
    w.add("general.quantization_version", QUANTIZATION_VERSION, "uint32")
    for name, tid, shape, produce in tensors:
        def make(produce=produce, tid=tid, shape=shape, name=name):
            return encode_tensor(produce(), tid, shape, name)

        w.add_tensor(name, tid, shape, make)
        if log is not None:
            tn = {0: "F32", 1: "F16", 30: "BF16", 26: "I32"}[tid]
            log(f"{name:<40} {tn:<5} {list(shape)}")
    w.write()
    return ConvertResult(out_path, a + ("/dspark" if R else ""), len(tensors), 0, os.path.getsize(out_path),
                         time.perf_counter() - t0, False)
