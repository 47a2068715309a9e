"""Standard decoder checkpoints -> GGUF: Llama 2 / 3.x and Mistral (``llama``), Qwen2 / 2.5
(``qwen2``), Qwen3 (``qwen3``) and Qwen3-MoE (``qwen3moe``), with llama.cpp's tensor names and
metadata.

Conventions of the written file (what ``pyfast/models/decoder.py`` reads):

* norms are stored as they are (these models scale by ``w``, not ``1 + w``);
* ``llama``: the q / k rows of every head are permuted from the checkpoint's rotate-half layout
  (pairs ``(i, i + D/2)``) to adjacent pairs ``(2i, 2i + 1)``, so NORMAL rope applies (llama.cpp's
  converter does the same); the Qwen family keeps the layout and uses NEOX rope;
* rope scaling: ``linear`` and ``yarn`` become ``rope.scaling.*``; Llama 3's ``llama3`` type
  becomes ``rope_freqs.weight``, the per-pair divisors of the angles (``pyfast/models/rope.py``);
* experts: ``ffn_{gate,up}_exps [E, ff, d]`` and ``ffn_down_exps [E, d, ff]`` from per-expert
  tensors or from fused ``experts.gate_up_proj`` (gate rows first) / ``experts.down_proj``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyfast.convert.common import attention_metadata, check_unused, dense_ffn, experts, tensor_adder
from pyfast.convert.qwen35 import Plan, _int, _map, _Source
from pyfast.convert.safetensors import SafetensorsDir

ARCH_BY_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3_moe": "qwen3moe"}
ARCH_BY_HF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
DEFAULT_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2"}


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
    eps: float
    n_ctx: int | None
    rope_theta: float | None
    rope_params: dict[str, Any]
    n_ff: int | None
    tied: bool
    bias: bool = False
    qk_norm: bool = False
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    norm_topk: bool = True

    @property
    def moe(self) -> bool:
        return self.n_expert > 0


def rope_hparams(cfg: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """(rope parameters, theta) from a config: transformers 5's ``rope_parameters`` or the older
    ``rope_scaling`` + ``rope_theta``."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    return rp, rp.get("rope_theta", cfg.get("rope_theta"))


def hparams(arch: str, config: dict[str, Any]) -> HParams:
    cfg = dict(config)
    if isinstance(config.get("text_config"), dict):
        cfg.update(config["text_config"])
    d = _int(cfg, "hidden_size")
    n_head = _int(cfg, "num_attention_heads")
    rp, theta = rope_hparams(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) and arch == "llama":
        raise ValueError("config.json: sliding_window attention is not supported for this model type")
    hp = HParams(
        arch=arch, cfg=cfg, n_embd=d, n_layer=_int(cfg, "num_hidden_layers"), n_vocab=_int(cfg, "vocab_size"),
        n_head=n_head, n_head_kv=_int(cfg, "num_key_value_heads", n_head),
        head_dim=int(cfg.get("head_dim") or d // n_head), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        n_ctx=cfg.get("max_position_embeddings"), rope_theta=theta, rope_params=rp,
        n_ff=cfg.get("intermediate_size"), tied=bool(cfg.get("tie_word_embeddings", False)),
        bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3moe"),
    )
    if hp.n_head % hp.n_head_kv:
        raise ValueError(f"config.json: num_attention_heads {hp.n_head} is not a multiple of "
                         f"num_key_value_heads {hp.n_head_kv}")
    if arch == "qwen3moe":
        hp.n_expert = _int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
        hp.n_expert_used = _int(cfg, "num_experts_per_tok")
        hp.n_ff_exp = _int(cfg, "moe_intermediate_size")
        hp.norm_topk = bool(cfg.get("norm_topk_prob", True))
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ValueError("config.json: dense layers in a Qwen3-MoE model (mlp_only_layers / "
                             "decoder_sparse_step) are not supported")
    else:
        hp.n_ff = _int(cfg, "intermediate_size")
    return hp


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from rotate-half order (pairs i, i + D/2) to adjacent pairs (2i, 2i+1)."""
    shape = w.shape
    return np.ascontiguousarray(
        w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape))


def _keep_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp" in name


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    """Check the checkpoint against the config and list the GGUF tensors to write."""
    src = _Source(st)
    d, V, H, Hkv, D = hp.n_embd, hp.n_vocab, hp.n_head, hp.n_head_kv, hp.head_dim
    out = Plan(hp, 0)

    add = tensor_adder(out.tensors, _keep_f32)

    perm = hp.arch == "llama"
    add("token_embd.weight", (V, d), src.get("model.embed_tokens.weight", (V, d)))
    rf = rope_freqs(hp)
    if rf is not None:
        add("rope_freqs.weight", rf.shape, lambda: rf)
    for i in range(hp.n_layer):
        b, p = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_norm.weight", (d,), src.get(f"{p}.input_layernorm.weight", (d,)))
        for name, hf, rows, heads in (("attn_q", "q_proj", H * D, H), ("attn_k", "k_proj", Hkv * D, Hkv),
                                      ("attn_v", "v_proj", Hkv * D, 0)):
            w = src.get(f"{p}.self_attn.{hf}.weight", (rows, d))
            add(f"{b}.{name}.weight", (rows, d), _map(w, lambda a, n=heads: permute_rows(a, n)) if perm and heads else w)
            if hp.bias:
                bb = src.get(f"{p}.self_attn.{hf}.bias", (rows,))
                add(f"{b}.{name}.bias", (rows,), _map(bb, lambda a, n=heads: permute_rows(a, n)) if perm and heads else bb)
        add(f"{b}.attn_output.weight", (d, H * D), src.get(f"{p}.self_attn.o_proj.weight", (d, H * D)))
        if hp.qk_norm:
            add(f"{b}.attn_q_norm.weight", (D,), src.get(f"{p}.self_attn.q_norm.weight", (D,)))
            add(f"{b}.attn_k_norm.weight", (D,), src.get(f"{p}.self_attn.k_norm.weight", (D,)))
        add(f"{b}.ffn_norm.weight", (d,), src.get(f"{p}.post_attention_layernorm.weight", (d,)))
        if hp.moe:
            E, ff = hp.n_expert, hp.n_ff_exp
            gate, up, down = experts(src, f"{p}.mlp", E, ff, d)
            add(f"{b}.ffn_gate_inp.weight", (E, d), src.get(f"{p}.mlp.gate.weight", (E, d)))
            add(f"{b}.ffn_gate_exps.weight", (E, ff, d), gate)
            add(f"{b}.ffn_up_exps.weight", (E, ff, d), up)
            add(f"{b}.ffn_down_exps.weight", (E, d, ff), down)
        else:
            ff = hp.n_ff
            dense_ffn(add, src.get, b, p, ff, d)
    add("output_norm.weight", (d,), src.get("model.norm.weight", (d,)))
    output_head(src, st, hp, add)
    check_unused(src, st)
    return out


def output_head(src: _Source, st: SafetensorsDir, hp, add) -> None:
    V, d = hp.n_vocab, hp.n_embd
    if src.has("lm_head.weight"):
        if hp.tied:  # a tied checkpoint may still store the copy
            src.used.add("lm_head.weight")
        else:
            add("output.weight", (V, d), src.get("lm_head.weight", (V, d)))
    elif not hp.tied:
        raise ValueError(f"{st.dir}: missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")


def rope_freqs(hp) -> np.ndarray | None:
    """Llama 3's per-pair angle divisors when the config's rope type is ``llama3``."""
    from pyfast.models.rope import llama3_freq_factors

    rp = hp.rope_params
    if rp.get("rope_type", rp.get("type")) != "llama3":
        return None
    n_rot = int(hp.head_dim * float(rp.get("partial_rotary_factor", 1.0)))
    return llama3_freq_factors(n_rot, float(hp.rope_theta or 10000.0), float(rp["factor"]),
                               float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0)),
                               int(rp["original_max_position_embeddings"]))


def rope_metadata(a: str, rp: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """``rope.scaling.*`` entries for linear and YaRN scaling (llama3 goes in rope_freqs.weight)."""
    import math

    m: list[tuple[str, Any, str]] = []
    rope_type, factor = rp.get("rope_type", rp.get("type")), rp.get("factor")
    if rope_type == "linear" and factor is not None:
        m.append((f"{a}.rope.scaling.type", "linear", "string"))
        m.append((f"{a}.rope.scaling.factor", float(factor), "float32"))
    elif rope_type == "yarn" and factor is not None:
        if rp.get("mscale") or rp.get("mscale_all_dim") or rp.get("truncate") is False:
            raise ValueError("config.json: YaRN with mscale / mscale_all_dim / truncate = false is not supported")
        m.append((f"{a}.rope.scaling.type", "yarn", "string"))
        m.append((f"{a}.rope.scaling.factor", float(factor), "float32"))
        m.append((f"{a}.rope.scaling.original_context_length", int(rp["original_max_position_embeddings"]), "uint32"))
        if rp.get("beta_fast") is not None:
            m.append((f"{a}.rope.scaling.yarn_beta_fast", float(rp["beta_fast"]), "float32"))
        if rp.get("beta_slow") is not None:
            m.append((f"{a}.rope.scaling.yarn_beta_slow", float(rp["beta_slow"]), "float32"))
        if rp.get("attention_factor") is not None:  # the rope op multiplies in 1 + 0.1 ln(factor) itself
            m.append((f"{a}.rope.scaling.attn_factor",
                      float(rp["attention_factor"]) / (1.0 + 0.1 * math.log(float(factor))), "float32"))
    elif rope_type not in (None, "default", "llama3"):
        warnings.warn(f"rope type {rope_type!r} is not converted; writing plain RoPE", stacklevel=3)
    return m


def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    """The architecture's GGUF metadata entries (key, value, GGUF type), llama.cpp's keys."""
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    m += attention_metadata(a, hp.n_layer, hp.n_ctx, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim)
    u32("rope.dimension_count", hp.head_dim)
    if hp.rope_theta is not None:
        m.append((f"{a}.rope.freq_base", float(hp.rope_theta), "float32"))
    m += rope_metadata(a, hp.rope_params)
    m.append((f"{a}.attention.layer_norm_rms_epsilon", float(hp.eps), "float32"))
    if hp.moe:
        u32("expert_count", hp.n_expert)
        u32("expert_used_count", hp.n_expert_used)
        u32("expert_feed_forward_length", hp.n_ff_exp)
        m.append((f"{a}.expert_weights_norm", bool(hp.norm_topk), "bool"))
    return m
