"""Gemma 3 checkpoints (``gemma3_text``, and the text part of ``gemma3``) -> GGUF arch ``gemma3`` with
llama.cpp's names.

Conventions of the written file (what ``pyfast/models/gemma3.py`` reads):

* every RMS norm weight is stored as ``1 + w`` (Gemma's norms scale by ``1 + w``), including the
  q / k norms; ``pre_feedforward_layernorm`` -> ``ffn_norm``, ``post_feedforward_layernorm`` ->
  ``post_ffw_norm``, ``post_attention_layernorm`` -> ``post_attention_norm``;
* ``layer_types`` -> ``attention.sliding_window_pattern`` (true = sliding) with
  ``attention.sliding_window``; the sliding layers' rope theta -> ``rope.freq_base_swa``, the
  global layers' theta and linear scaling -> ``rope.freq_base`` / ``rope.scaling.*``;
* ``query_pre_attn_scalar`` -> ``attention.scale`` = ``query_pre_attn_scalar ** -0.5``;
  ``final_logit_softcapping`` as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyfast.convert.common import attention_metadata, check_unused, dense_ffn, tensor_adder
from pyfast.convert.decoder import _keep_f32, output_head, rope_metadata
from pyfast.convert.qwen35 import Plan, _int, _plus_one, _Source
from pyfast.convert.safetensors import SafetensorsDir

ARCH_BY_MODEL_TYPE = {"gemma3_text": "gemma3", "gemma3": "gemma3"}
ARCH_BY_HF_ARCH = {"Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3"}
DEFAULT_PRE = {"gemma3": "default"}


@dataclass
class HParams:
    arch: str
    cfg: dict[str, Any]
    n_embd: int
    n_layer: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    eps: float
    n_ctx: int | None
    rope_global: dict[str, Any]
    rope_local: dict[str, Any]
    window: int
    sliding: list[bool]
    attn_scale: float
    final_softcap: float | None
    tied: bool


def _layer_rope(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """The rope parameters of one layer type (transformers 5 nests them per layer type)."""
    rp = cfg.get("rope_parameters") or {}
    if kind in rp and isinstance(rp[kind], dict):
        return dict(rp[kind])
    if kind == "sliding_attention":
        return {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    out = dict(cfg.get("rope_scaling") or {})
    out.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    return out


def hparams(arch: str, config: dict[str, Any]) -> HParams:
    cfg = dict(config)
    if isinstance(config.get("text_config"), dict):
        cfg.update(config["text_config"])
    d = _int(cfg, "hidden_size")
    n_layer = _int(cfg, "num_hidden_layers")
    n_head = _int(cfg, "num_attention_heads")
    head_dim = int(cfg.get("head_dim") or d // n_head)
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("config.json: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention is not supported (causal models only)")
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
                                       else "sliding_attention" for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: layer_types must hold {n_layer} of full_attention / sliding_attention")
    hp = HParams(
        arch=arch, cfg=cfg, n_embd=d, n_layer=n_layer, n_vocab=_int(cfg, "vocab_size"), n_head=n_head,
        n_head_kv=_int(cfg, "num_key_value_heads", n_head), head_dim=head_dim, n_ff=_int(cfg, "intermediate_size"),
        eps=float(cfg.get("rms_norm_eps", 1e-6)), n_ctx=cfg.get("max_position_embeddings"),
        rope_global=_layer_rope(cfg, "full_attention"), rope_local=_layer_rope(cfg, "sliding_attention"),
        window=int(cfg.get("sliding_window") or 0), sliding=[t == "sliding_attention" for t in types],
        attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        final_softcap=cfg.get("final_logit_softcapping"), tied=bool(cfg.get("tie_word_embeddings", True)),
    )
    if hp.n_head % hp.n_head_kv:
        raise ValueError(f"config.json: num_attention_heads {hp.n_head} is not a multiple of "
                         f"num_key_value_heads {hp.n_head_kv}")
    if hp.rope_local.get("rope_type", "default") != "default":
        raise ValueError("config.json: scaled rope on the sliding layers is not supported")
    return hp


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    src = _Source(st)
    d, V, H, Hkv, D = hp.n_embd, hp.n_vocab, hp.n_head, hp.n_head_kv, hp.head_dim
    out = Plan(hp, 0)

    add = tensor_adder(out.tensors, _keep_f32)

    def norm(name: str, hf: str, n: int) -> None:
        add(name, (n,), _plus_one(src.get(hf, (n,))))

    add("token_embd.weight", (V, d), src.get("model.embed_tokens.weight", (V, d)))
    for i in range(hp.n_layer):
        b, p = f"blk.{i}", f"model.layers.{i}"
        norm(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", d)
        for name, hf, rows in (("attn_q", "q_proj", H * D), ("attn_k", "k_proj", Hkv * D), ("attn_v", "v_proj", Hkv * D)):
            add(f"{b}.{name}.weight", (rows, d), src.get(f"{p}.self_attn.{hf}.weight", (rows, d)))
        add(f"{b}.attn_output.weight", (d, H * D), src.get(f"{p}.self_attn.o_proj.weight", (d, H * D)))
        norm(f"{b}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", D)
        norm(f"{b}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", D)
        norm(f"{b}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", d)
        norm(f"{b}.ffn_norm.weight", f"{p}.pre_feedforward_layernorm.weight", d)
        norm(f"{b}.post_ffw_norm.weight", f"{p}.post_feedforward_layernorm.weight", d)
        ff = hp.n_ff
        dense_ffn(add, src.get, b, p, ff, d)
    norm("output_norm.weight", "model.norm.weight", d)
    output_head(src, st, hp, add)
    check_unused(src, st)
    return out


def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    m += attention_metadata(a, hp.n_layer, hp.n_ctx, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim)
    m.append((f"{a}.attention.layer_norm_rms_epsilon", float(hp.eps), "float32"))
    m.append((f"{a}.attention.scale", float(hp.attn_scale), "float32"))
    m.append((f"{a}.rope.freq_base", float(hp.rope_global.get("rope_theta", 1e6)), "float32"))
    m.append((f"{a}.rope.freq_base_swa", float(hp.rope_local.get("rope_theta", 10000.0)), "float32"))
    m += rope_metadata(a, hp.rope_global)
    if hp.window:
        u32("attention.sliding_window", hp.window)
        m.append((f"{a}.attention.sliding_window_pattern", list(hp.sliding), "array[bool]"))
    if hp.final_softcap:
        m.append((f"{a}.final_logit_softcapping", float(hp.final_softcap), "float32"))
    return m
