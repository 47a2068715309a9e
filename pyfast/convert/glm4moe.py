"""GLM-4.5 / 4.6 MoE checkpoints (``glm4_moe``) -> GGUF arch ``glm4moe`` with llama.cpp's names.

Conventions of the written file (what ``pyfast/models/glm4moe.py`` reads):

* norms stored as they are (``x * w``); ``post_attention_layernorm`` -> ``post_attention_norm``;
* layers below ``first_k_dense_replace`` -> dense ``ffn_{gate,up,down}``; the others -> router
  ``ffn_gate_inp``, selection bias ``exp_probs_b.bias`` (``e_score_correction_bias``), expert
  stacks ``ffn_{gate,up,down}_exps`` and the shared experts ``ffn_{gate,up,down}_shexp``;
* the MTP layers (``model.layers.{n_layer + j}``, ``num_nextn_predict_layers``) become blocks
  ``blk.{n_layer + j}``: their decoder layer under the usual names plus ``nextn.eh_proj``,
  ``nextn.enorm``, ``nextn.hnorm``, ``nextn.shared_head_norm``, ``nextn.shared_head_head`` and
  ``nextn.embed_tokens``; ``--no-mtp`` leaves them out;
* rope: NEOX over ``head_dim * partial_rotary_factor`` dims (``rope.dimension_count``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyfast.convert.common import (
    attention_metadata, check_unused, dense_ffn, experts, nextn_tensors, routed_moe_ffn, tensor_adder,
)
from pyfast.convert.decoder import _keep_f32, output_head, rope_hparams, rope_metadata
from pyfast.convert.qwen35 import Plan, _int, _Source
from pyfast.convert.safetensors import SafetensorsDir

ARCH_BY_MODEL_TYPE = {"glm4_moe": "glm4moe"}
ARCH_BY_HF_ARCH = {"Glm4MoeForCausalLM": "glm4moe"}
DEFAULT_PRE = {"glm4moe": "glm4"}


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
    n_rot: int
    eps: float
    n_ctx: int | None
    rope_theta: float | None
    rope_params: dict[str, Any]
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_shared: int
    n_dense_lead: int
    scale: float
    norm_topk: bool
    qk_norm: bool
    bias: bool
    n_mtp_config: int
    tied: bool


def hparams(arch: str, config: dict[str, Any]) -> HParams:
    cfg = dict(config)
    d = _int(cfg, "hidden_size")
    n_head = _int(cfg, "num_attention_heads")
    head_dim = int(cfg.get("head_dim") or d // n_head)
    rp, theta = rope_hparams(cfg)
    partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if int(cfg.get("n_group", 1)) > 1 and int(cfg.get("topk_group", 1)) < int(cfg.get("n_group", 1)):
        raise ValueError("config.json: grouped expert routing (n_group > topk_group) is not supported for glm4_moe")
    hp = HParams(
        arch=arch, cfg=cfg, n_embd=d, n_layer=_int(cfg, "num_hidden_layers"), n_vocab=_int(cfg, "vocab_size"),
        n_head=n_head, n_head_kv=_int(cfg, "num_key_value_heads", n_head), head_dim=head_dim,
        n_rot=int(head_dim * partial), eps=float(cfg.get("rms_norm_eps", 1e-5)),
        n_ctx=cfg.get("max_position_embeddings"), rope_theta=theta, rope_params=rp,
        n_ff=_int(cfg, "intermediate_size"), n_expert=_int(cfg, "n_routed_experts" if "n_routed_experts" in cfg else "num_local_experts"),
        n_expert_used=_int(cfg, "num_experts_per_tok"), n_ff_exp=_int(cfg, "moe_intermediate_size"),
        n_shared=int(cfg.get("n_shared_experts", 0) or 0), n_dense_lead=int(cfg.get("first_k_dense_replace", 0)),
        scale=float(cfg.get("routed_scaling_factor", 1.0)), norm_topk=bool(cfg.get("norm_topk_prob", True)),
        qk_norm=bool(cfg.get("use_qk_norm", False)), bias=bool(cfg.get("attention_bias", False)),
        n_mtp_config=int(cfg.get("num_nextn_predict_layers", 0) or 0), tied=bool(cfg.get("tie_word_embeddings", False)),
    )
    if hp.n_head % hp.n_head_kv:
        raise ValueError(f"config.json: num_attention_heads {hp.n_head} is not a multiple of "
                         f"num_key_value_heads {hp.n_head_kv}")
    if hp.n_rot % 2:
        raise ValueError(f"config.json: head_dim * partial_rotary_factor = {hp.n_rot} is odd")
    return hp


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    """Check the checkpoint against the config and list the GGUF tensors to write."""
    src = _Source(st)
    d, V, H, Hkv, D = hp.n_embd, hp.n_vocab, hp.n_head, hp.n_head_kv, hp.head_dim
    n_mtp = 0
    if hp.n_mtp_config:
        have = src.has(f"model.layers.{hp.n_layer}.eh_proj.weight")
        if mtp and have:
            n_mtp = hp.n_mtp_config
        elif not have:
            import warnings

            warnings.warn(f"{st.dir}: config.json declares {hp.n_mtp_config} MTP layer(s) but the checkpoint has "
                          "none; writing the model without MTP", stacklevel=3)
    for n in src.names:  # MTP layers left out (--no-mtp): their tensors are expected, not converted
        idx = n.split(".")[2] if n.startswith("model.layers.") else None
        if idx is not None and idx.isdigit() and int(idx) >= hp.n_layer + n_mtp:
            src.used.add(n)
    out = Plan(hp, n_mtp)

    add = tensor_adder(out.tensors, _keep_f32)

    def layer(i: int) -> None:
        b, p = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_norm.weight", (d,), src.get(f"{p}.input_layernorm.weight", (d,)))
        for name, hf, rows in (("attn_q", "q_proj", H * D), ("attn_k", "k_proj", Hkv * D), ("attn_v", "v_proj", Hkv * D)):
            add(f"{b}.{name}.weight", (rows, d), src.get(f"{p}.self_attn.{hf}.weight", (rows, d)))
            if hp.bias:
                add(f"{b}.{name}.bias", (rows,), src.get(f"{p}.self_attn.{hf}.bias", (rows,)))
        add(f"{b}.attn_output.weight", (d, H * D), src.get(f"{p}.self_attn.o_proj.weight", (d, H * D)))
        if hp.qk_norm:
            add(f"{b}.attn_q_norm.weight", (D,), src.get(f"{p}.self_attn.q_norm.weight", (D,)))
            add(f"{b}.attn_k_norm.weight", (D,), src.get(f"{p}.self_attn.k_norm.weight", (D,)))
        add(f"{b}.post_attention_norm.weight", (d,), src.get(f"{p}.post_attention_layernorm.weight", (d,)))
        if i < hp.n_dense_lead:
            ff = hp.n_ff
            dense_ffn(add, src.get, b, p, ff, d)
            return
        E, ff = hp.n_expert, hp.n_ff_exp
        routed_moe_ffn(add, src.get, b, p, E, ff, d, hp.n_shared, experts(src, f"{p}.mlp", E, ff, d))

    add("token_embd.weight", (V, d), src.get("model.embed_tokens.weight", (V, d)))
    for i in range(hp.n_layer + n_mtp):
        layer(i)
    for i in range(hp.n_layer, hp.n_layer + n_mtp):
        nextn_tensors(add, src.get, src.has, f"blk.{i}", f"model.layers.{i}", d, V)
    add("output_norm.weight", (d,), src.get("model.norm.weight", (d,)))
    output_head(src, st, hp, add)
    check_unused(src, st)
    return out


def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    m += attention_metadata(a, hp.n_layer + n_mtp, hp.n_ctx, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv,
                            hp.head_dim)
    u32("rope.dimension_count", hp.n_rot)
    if hp.rope_theta is not None:
        m.append((f"{a}.rope.freq_base", float(hp.rope_theta), "float32"))
    m += rope_metadata(a, hp.rope_params)
    m.append((f"{a}.attention.layer_norm_rms_epsilon", float(hp.eps), "float32"))
    u32("expert_count", hp.n_expert)
    u32("expert_used_count", hp.n_expert_used)
    u32("expert_shared_count", hp.n_shared)
    u32("expert_feed_forward_length", hp.n_ff_exp)
    u32("leading_dense_block_count", hp.n_dense_lead)
    m.append((f"{a}.expert_weights_scale", float(hp.scale), "float32"))
    m.append((f"{a}.expert_weights_norm", bool(hp.norm_topk), "bool"))
    u32("expert_gating_func", 2)
    if n_mtp:
        u32("nextn_predict_layers", n_mtp)
    return m
