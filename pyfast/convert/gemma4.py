"""Gemma 4 text checkpoints (``gemma4_text``, dense and MoE) -> GGUF arch ``gemma4``.

Conventions of the written file (what ``pyfast/models/gemma4.py`` reads):

* norms stored as they are (Gemma 4's RMS norms scale by ``w``); ``layer_scalar`` ->
  ``layer_output_scale.weight``; per-layer embeddings -> ``per_layer_token_embd``,
  ``per_layer_model_proj``, ``per_layer_proj_norm`` and per layer ``inp_gate`` / ``proj`` /
  ``post_norm``;
* per-type geometry: ``attention.key_length`` (global layers; ``global_head_dim`` or the
  per-layer config) and ``attention.key_length_swa``; ``attention.head_count_kv`` per layer;
* proportional rope of the global layers -> ``rope_freqs.weight`` [head_dim / 2]: 1 for the
  ``partial_rotary_factor`` share of pairs that rotate, 1e30 (no rotation) for the rest;
* MoE block: ``router.proj`` -> ``ffn_gate_inp``, ``router.scale`` -> ``ffn_gate_inp.scale``,
  ``router.per_expert_scale`` -> ``ffn_down_exps.scale``, ``experts.gate_up_proj`` -> split
  ``ffn_{gate,up}_exps``, ``pre_feedforward_layernorm_2`` / ``post_feedforward_layernorm_1 / _2`` ->
  ``pre_ffw_norm_2`` / ``post_ffw_norm_1 / _2`` (llama.cpp's names);
* the sliding layers' rope turns ``partial_rotary_factor`` of their head (``rope.dimension_count_swa``);
  ``attention.sliding_window`` and ``attention.sliding_window_pattern`` are always written (llama.cpp
  requires both for gemma4);
* shared KV layers (``num_kv_shared_layers``) get no K / V tensors; a global layer whose values
  are its keys (``attention_k_eq_v``) gets no ``attn_v``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pyfast.convert.common import check_unused, dense_ffn, experts, tensor_adder
from pyfast.convert.decoder import _keep_f32, output_head
from pyfast.convert.qwen35 import Plan, _int, _Source
from pyfast.convert.safetensors import SafetensorsDir

ARCH_BY_MODEL_TYPE = {"gemma4_text": "gemma4"}
ARCH_BY_HF_ARCH = {"Gemma4ForCausalLM": "gemma4"}
DEFAULT_PRE = {"gemma4": "default"}
NO_ROTATION = 1e30


@dataclass
class HParams:
    arch: str
    cfg: dict[str, Any]
    n_embd: int
    n_layer: int
    n_vocab: int
    n_head: int
    head_dims: list[int]
    n_head_kv: list[int]
    n_ff: list[int]
    sliding: list[bool]
    window: int
    n_shared: int
    k_eq_v: bool
    n_per_layer: int
    eps: float
    n_ctx: int | None
    theta: float
    theta_swa: float
    partial: float
    final_softcap: float | None
    tied: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    partial_swa: float = 1.0  # share of a sliding layer's head that rotates


def hparams(arch: str, config: dict[str, Any]) -> HParams:
    cfg = dict(config)
    d = _int(cfg, "hidden_size")
    L = _int(cfg, "num_hidden_layers")
    n_head = _int(cfg, "num_attention_heads")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention is not supported (causal models only)")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    types = cfg.get("layer_types") or []
    if len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: layer_types must hold {L} of full_attention / sliding_attention")
    sliding = [t == "sliding_attention" for t in types]
    hd = _int(cfg, "head_dim")
    hkv = _int(cfg, "num_key_value_heads", n_head)
    plc = cfg.get("per_layer_config") or {}
    head_dims, kv_heads = [], []
    for i in range(L):
        o = plc.get(str(i)) or plc.get(i) or {}
        if sliding[i]:
            head_dims.append(int(o.get("head_dim", hd)))
            kv_heads.append(int(o.get("num_key_value_heads", hkv)))
        else:
            head_dims.append(int(o.get("head_dim", cfg.get("global_head_dim") or hd)))
            kv_heads.append(int(o.get("num_key_value_heads", cfg.get("num_global_key_value_heads") or hkv)))
    for kind in (True, False):
        dims = {head_dims[i] for i in range(L) if sliding[i] == kind}
        if len(dims) > 1:
            raise ValueError(f"config.json: layers of one type have different head sizes {sorted(dims)}")
    n_shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
    ff = _int(cfg, "intermediate_size")
    wide = bool(cfg.get("use_double_wide_mlp"))
    rp = cfg.get("rope_parameters") or {}
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if full.get("rope_type", "proportional") not in ("proportional", "default") or full.get("factor", 1.0) != 1.0:
        raise ValueError(f"config.json: global-layer rope {full} is not supported (proportional, factor 1)")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: sliding-layer rope {local} is not supported (default)")
    return HParams(
        arch=arch, cfg=cfg, n_embd=d, n_layer=L, n_vocab=_int(cfg, "vocab_size"), n_head=n_head,
        head_dims=head_dims, n_head_kv=kv_heads,
        n_ff=[ff * 2 if wide and i >= L - n_shared else ff for i in range(L)], sliding=sliding,
        window=int(cfg.get("sliding_window") or 0), n_shared=n_shared, k_eq_v=bool(cfg.get("attention_k_eq_v")),
        n_per_layer=int(cfg.get("hidden_size_per_layer_input") or 0), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        n_ctx=cfg.get("max_position_embeddings"), theta=float(full.get("rope_theta", 1e6)),
        theta_swa=float(local.get("rope_theta", 10000.0)), partial_swa=float(local.get("partial_rotary_factor", 1.0)),
        partial=float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type", "proportional") ==
        "proportional" else 1.0,
        final_softcap=cfg.get("final_logit_softcapping"), tied=bool(cfg.get("tie_word_embeddings", True)),
        **(dict(n_expert=_int(cfg, "num_experts"), n_expert_used=_int(cfg, "top_k_experts"),
                n_ff_exp=_int(cfg, "moe_intermediate_size")) if cfg.get("enable_moe_block") else {}),
    )


def _dim(hp: HParams, sliding: bool) -> int:
    return next(hp.head_dims[i] for i in range(hp.n_layer) if hp.sliding[i] == sliding) \
        if any(s == sliding for s in hp.sliding) else hp.head_dims[0]


def rope_freqs(hp: HParams) -> np.ndarray:
    D = _dim(hp, False)
    n = int(hp.partial * D // 2)
    return np.concatenate([np.ones(n), np.full(D // 2 - n, NO_ROTATION)]).astype(np.float32)


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    src = _Source(st)
    d, V, H, L, P = hp.n_embd, hp.n_vocab, hp.n_head, hp.n_layer, hp.n_per_layer
    out = Plan(hp, 0)

    add = tensor_adder(out.tensors, _keep_f32)

    add("token_embd.weight", (V, d), src.get("model.embed_tokens.weight", (V, d)))
    if P:
        add("per_layer_token_embd.weight", (V, L * P), src.get("model.embed_tokens_per_layer.weight", (V, L * P)))
        add("per_layer_model_proj.weight", (L * P, d), src.get("model.per_layer_model_projection.weight", (L * P, d)))
        add("per_layer_proj_norm.weight", (P,), src.get("model.per_layer_projection_norm.weight", (P,)))
    if not all(hp.sliding):
        rf = rope_freqs(hp)
        add("rope_freqs.weight", rf.shape, lambda: rf)
    for i in range(L):
        b, p = f"blk.{i}", f"model.layers.{i}"
        D, Hkv, ff = hp.head_dims[i], hp.n_head_kv[i], hp.n_ff[i]
        add(f"{b}.attn_norm.weight", (d,), src.get(f"{p}.input_layernorm.weight", (d,)))
        add(f"{b}.attn_q.weight", (H * D, d), src.get(f"{p}.self_attn.q_proj.weight", (H * D, d)))
        add(f"{b}.attn_q_norm.weight", (D,), src.get(f"{p}.self_attn.q_norm.weight", (D,)))
        if i < L - hp.n_shared:
            add(f"{b}.attn_k.weight", (Hkv * D, d), src.get(f"{p}.self_attn.k_proj.weight", (Hkv * D, d)))
            add(f"{b}.attn_k_norm.weight", (D,), src.get(f"{p}.self_attn.k_norm.weight", (D,)))
            if not (hp.k_eq_v and not hp.sliding[i]):
                add(f"{b}.attn_v.weight", (Hkv * D, d), src.get(f"{p}.self_attn.v_proj.weight", (Hkv * D, d)))
        else:  # shared layers' K / V tensors (if a checkpoint keeps them) are unused, as in transformers
            for n in ("k_proj", "v_proj", "k_norm"):
                src.used.add(f"{p}.self_attn.{n}.weight")
        add(f"{b}.attn_output.weight", (d, H * D), src.get(f"{p}.self_attn.o_proj.weight", (d, H * D)))
        add(f"{b}.post_attention_norm.weight", (d,), src.get(f"{p}.post_attention_layernorm.weight", (d,)))
        add(f"{b}.ffn_norm.weight", (d,), src.get(f"{p}.pre_feedforward_layernorm.weight", (d,)))
        add(f"{b}.post_ffw_norm.weight", (d,), src.get(f"{p}.post_feedforward_layernorm.weight", (d,)))
        dense_ffn(add, src.get, b, p, ff, d)
        add(f"{b}.layer_output_scale.weight", (1,), src.get(f"{p}.layer_scalar", (1,)))
        if hp.n_expert:
            E, F = hp.n_expert, hp.n_ff_exp
            gate, up, down = experts(src, p, E, F, d)
            add(f"{b}.ffn_gate_inp.weight", (E, d), src.get(f"{p}.router.proj.weight", (E, d)))
            add(f"{b}.ffn_gate_inp.scale", (d,), src.get(f"{p}.router.scale", (d,)))
            add(f"{b}.ffn_down_exps.scale", (E,), src.get(f"{p}.router.per_expert_scale", (E,)))
            add(f"{b}.ffn_gate_exps.weight", (E, F, d), gate)
            add(f"{b}.ffn_up_exps.weight", (E, F, d), up)
            add(f"{b}.ffn_down_exps.weight", (E, d, F), down)
            add(f"{b}.pre_ffw_norm_2.weight", (d,), src.get(f"{p}.pre_feedforward_layernorm_2.weight", (d,)))
            add(f"{b}.post_ffw_norm_1.weight", (d,), src.get(f"{p}.post_feedforward_layernorm_1.weight", (d,)))
            add(f"{b}.post_ffw_norm_2.weight", (d,), src.get(f"{p}.post_feedforward_layernorm_2.weight", (d,)))
        if P:
            add(f"{b}.inp_gate.weight", (P, d), src.get(f"{p}.per_layer_input_gate.weight", (P, d)))
            add(f"{b}.proj.weight", (d, P), src.get(f"{p}.per_layer_projection.weight", (d, P)))
            add(f"{b}.post_norm.weight", (d,), src.get(f"{p}.post_per_layer_input_norm.weight", (d,)))
    add("output_norm.weight", (d,), src.get("model.norm.weight", (d,)))
    output_head(src, st, hp, add)
    check_unused(src, st)
    return out


def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    u32("block_count", hp.n_layer)
    if hp.n_ctx is not None:
        u32("context_length", hp.n_ctx)
    u32("embedding_length", hp.n_embd)
    m.append((f"{a}.feed_forward_length", [int(x) for x in hp.n_ff], "array[uint32]"))
    u32("attention.head_count", hp.n_head)
    m.append((f"{a}.attention.head_count_kv", [int(x) for x in hp.n_head_kv], "array[uint32]"))
    D, Ds = _dim(hp, False), _dim(hp, True)
    u32("attention.key_length", D)
    u32("attention.value_length", D)
    u32("attention.key_length_swa", Ds)
    u32("attention.value_length_swa", Ds)
    u32("rope.dimension_count", D)
    u32("rope.dimension_count_swa", int(Ds * hp.partial_swa))
    m.append((f"{a}.rope.freq_base", hp.theta, "float32"))
    m.append((f"{a}.rope.freq_base_swa", hp.theta_swa, "float32"))
    m.append((f"{a}.attention.layer_norm_rms_epsilon", hp.eps, "float32"))
    u32("attention.sliding_window", hp.window)
    m.append((f"{a}.attention.sliding_window_pattern", list(hp.sliding), "array[bool]"))
    u32("attention.shared_kv_layers", hp.n_shared)
    u32("embedding_length_per_layer_input", hp.n_per_layer)
    if hp.n_expert:
        u32("expert_count", hp.n_expert)
        u32("expert_used_count", hp.n_expert_used)
        u32("expert_feed_forward_length", hp.n_ff_exp)
    if hp.final_softcap:
        m.append((f"{a}.final_logit_softcapping", float(hp.final_softcap), "float32"))
    return m
