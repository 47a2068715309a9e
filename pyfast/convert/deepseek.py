"""DeepSeek-V3-family checkpoints -> GGUF with llama.cpp's names and metadata: ``deepseek_v3``
(GGUF arch ``deepseek2``), ``deepseek_v32`` (``deepseek32``) and ``glm_moe_dsa`` (``glm-dsa``).

Conventions of the written file (what ``pyfast/models/deepseek2.py`` reads):

* MLA: ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b`` (or ``attn_q`` without a q latent),
  ``attn_kv_a_mqa`` ([kv_lora + rope, d]), ``attn_kv_a_norm``; the checkpoint's ``kv_b_proj``
  ([H (nope + v), kv_lora]) is split per head into ``attn_k_b`` = k part transposed
  ([H, kv_lora, nope]) and ``attn_v_b`` = v part ([H, v, kv_lora]), as llama.cpp's converter does;
  ``attention.key_length`` = kv_lora + rope and ``value_length`` = kv_lora describe the cache
  row, ``key_length_mla`` / ``value_length_mla`` the per-head dims, ``head_count_kv`` = 1.
* RoPE on the rope dims uses adjacent pairs (transformers' ``rope_interleave = true``, llama.cpp's
  normal mode). A checkpoint with ``rope_interleave = false`` (half-split pairs) has the rope rows
  of q_b / q and kv_a permuted into pair order, which gives the same scores.
* RMSNorm weights are used as stored (``x * w``).
* MoE: ``ffn_gate_inp`` (router, F32), ``exp_probs_b.bias`` (``e_score_correction_bias``),
  stacked ``ffn_{gate,up}_exps`` [E, ff, d] / ``ffn_down_exps`` [E, d, ff], shared experts
  ``ffn_{gate,up,down}_shexp``; sigmoid gating (``expert_gating_func`` = 2) with groups.
* MTP layers (``model.layers.{n_layer + j}``) become ``blk.{n_layer + j}`` with ``nextn.eh_proj``,
  ``nextn.enorm``, ``nextn.hnorm``, ``nextn.shared_head_norm``, ``nextn.shared_head_head`` and
  ``nextn.embed_tokens``; ``block_count`` includes them, ``nextn_predict_layers`` counts them.
* DSA indexer (deepseek32, glm-dsa): ``indexer.attn_q_b`` (wq_b), ``indexer.attn_k`` (wk),
  ``indexer.k_norm`` (LayerNorm weight and bias), ``indexer.proj`` (weights_proj), in the layers
  that compute their own indexer; ``attention.indexer.{head_count,key_length,top_k}``, and
  pyfast's ``attention.indexer.full_layers`` (per layer: own indexer, or reuse of the last full
  layer's selection; from ``indexer_types``) and ``attention.indexer.rope_interleave``
  (``indexer_rope_interleave``; default true for glm_moe_dsa, false for deepseek_v32).
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pyfast.convert.common import (
    PlannedTensor, dense_ffn, nextn_tensors, reject_unused, routed_moe_ffn, tensor_adder,
)
from pyfast.convert.safetensors import SafetensorsDir

ARCH_BY_MODEL_TYPE = {"deepseek_v3": "deepseek2", "deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa"}
ARCH_BY_HF_ARCH = {"DeepseekV3ForCausalLM": "deepseek2", "DeepseekV32ForCausalLM": "deepseek32",
                   "GlmMoeDsaForCausalLM": "glm-dsa"}
DEFAULT_PRE = {"deepseek2": "deepseek-v3", "deepseek32": "deepseek-v3", "glm-dsa": "glm4"}


def _int(cfg: dict, key: str, default: Any = ..., lo: int = 1) -> int:
    v = cfg.get(key, default)
    if v is ...:
        raise ValueError(f"config.json is missing {key!r}")
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"config.json: {key!r} must be an integer >= {lo}, got {v!r}")
    return v


@dataclass
class HParams:
    arch: str
    cfg: dict
    n_embd: int
    n_layer: int
    n_vocab: int
    n_head: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    n_ff: int
    n_dense: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_shared: int
    n_group: int
    n_group_used: int
    norm_topk: bool
    routed_scale: float
    eps: float
    n_ctx: int | None
    rope_theta: float
    rope_params: dict
    rope_interleave: bool
    tied: bool
    n_mtp_config: int
    dsa: bool = False
    idx_heads: int = 0
    idx_dim: int = 0
    idx_top_k: int = 0
    idx_rope_interleave: bool = False
    idx_full: list = field(default_factory=list)  # per trunk layer: computes its own indexer top-k


def hparams(arch: str, cfg: dict) -> HParams:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("attention_bias"):
        raise ValueError("config.json: attention_bias = true is not supported")
    n_layer = _int(cfg, "num_hidden_layers")
    rope_params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    q_lora = cfg.get("q_lora_rank") or 0
    mlp_types = cfg.get("mlp_layer_types")
    n_dense = _int(cfg, "first_k_dense_replace", 0, lo=0)
    if isinstance(mlp_types, list) and mlp_types:
        dense = [t == "dense" for t in mlp_types[:n_layer]]
        n_dense = dense.index(False) if False in dense else n_layer
        if any(dense[n_dense:]):
            raise ValueError("config.json: dense MLP layers after the first sparse one are not supported")
    hp = HParams(
        arch=arch, cfg=cfg, n_embd=_int(cfg, "hidden_size"), n_layer=n_layer, n_vocab=_int(cfg, "vocab_size"),
        n_head=_int(cfg, "num_attention_heads"), q_lora=int(q_lora), kv_lora=_int(cfg, "kv_lora_rank"),
        qk_nope=_int(cfg, "qk_nope_head_dim"), qk_rope=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
        n_ff=_int(cfg, "intermediate_size"), n_dense=n_dense, n_expert=_int(cfg, "n_routed_experts"),
        n_expert_used=_int(cfg, "num_experts_per_tok"), n_ff_exp=_int(cfg, "moe_intermediate_size"),
        n_shared=_int(cfg, "n_shared_experts", 0, lo=0), n_group=_int(cfg, "n_group", 1),
        n_group_used=_int(cfg, "topk_group", 1), norm_topk=bool(cfg.get("norm_topk_prob", True)),
        routed_scale=float(cfg.get("routed_scaling_factor", 1.0)), eps=float(cfg.get("rms_norm_eps", 1e-6)),
        n_ctx=cfg.get("max_position_embeddings"), rope_theta=float(theta), rope_params=rope_params,
        rope_interleave=bool(cfg.get("rope_interleave", True)), tied=bool(cfg.get("tie_word_embeddings", False)),
        n_mtp_config=int(cfg.get("num_nextn_predict_layers") or 0),
    )
    if hp.qk_rope % 2:
        raise ValueError(f"config.json: qk_rope_head_dim {hp.qk_rope} must be even")
    if hp.n_expert % hp.n_group:
        raise ValueError(f"config.json: n_routed_experts {hp.n_expert} is not a multiple of n_group {hp.n_group}")
    if arch in ("deepseek32", "glm-dsa"):
        if not hp.q_lora:
            raise ValueError("config.json: the DSA indexer needs q_lora_rank (its query comes from the q latent)")
        hp.dsa = True
        hp.idx_heads = _int(cfg, "index_n_heads")
        hp.idx_dim = _int(cfg, "index_head_dim")
        hp.idx_top_k = _int(cfg, "index_topk")
        hp.idx_rope_interleave = bool(cfg.get("indexer_rope_interleave", arch == "glm-dsa"))
        if hp.idx_dim < hp.qk_rope:
            raise ValueError(f"config.json: index_head_dim {hp.idx_dim} < qk_rope_head_dim {hp.qk_rope}")
        types = cfg.get("indexer_types")
        if types is None:
            hp.idx_full = [True] * n_layer
        else:
            if not isinstance(types, list) or len(types) < n_layer or any(t not in ("full", "shared") for t in types):
                raise ValueError(f"config.json: indexer_types must list 'full' / 'shared' for each of the "
                                 f"{n_layer} layers, got {types!r}")
            hp.idx_full = [t == "full" for t in types[:n_layer]]
            if not hp.idx_full[0]:
                raise ValueError("config.json: indexer_types[0] must be 'full'")
    return hp


@dataclass
class Plan:
    hp: HParams
    n_mtp: int
    tensors: list[PlannedTensor] = field(default_factory=list)


def _keep_f32(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp" in name


def rope_pairs(n: int) -> np.ndarray:
    """Row order taking half-split rope dims (pairs i, i + n/2) to adjacent pairs (2i, 2i + 1)."""
    h = n // 2
    return np.stack([np.arange(h), np.arange(h) + h], axis=1).reshape(-1)


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    """Check the checkpoint against the config and list the GGUF tensors to write."""
    names = {k for k in st if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()
    d, V, H = hp.n_embd, hp.n_vocab, hp.n_head
    n, rp, r, v = hp.qk_nope, hp.qk_rope, hp.kv_lora, hp.v_head_dim

    def get(name: str, shape) -> Callable[[], np.ndarray]:
        if name not in names:
            raise ValueError(f"{st.dir}: missing tensor {name!r}")
        got = tuple(st.shape(name))
        if got != tuple(shape):
            raise ValueError(f"{st.dir}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        dtype = st.refs[name].dtype
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(f"{st.dir}: tensor {name!r} has dtype {dtype}; only F32, F16, BF16 and F64 checkpoints "
                             "are supported (dequantize FP8 checkpoints to BF16 first)")
        used.add(name)
        return lambda: np.asarray(st.load(name), dtype=np.float32)

    mtp_layers = sorted({int(m.group(1)) for k in names for m in [re.match(r"model\.layers\.(\d+)\.", k)]
                         if m and int(m.group(1)) >= hp.n_layer})
    n_mtp = 0
    if mtp_layers:
        if mtp_layers != list(range(hp.n_layer, hp.n_layer + len(mtp_layers))):
            raise ValueError(f"{st.dir}: MTP layer indices {mtp_layers} do not follow the {hp.n_layer} trunk layers")
        if mtp:
            n_mtp = len(mtp_layers)
        else:
            used.update(k for k in names if re.match(r"model\.layers\.(\d+)\.", k)
                        and int(k.split(".")[2]) >= hp.n_layer)
    elif mtp and hp.n_mtp_config:
        warnings.warn(f"{st.dir}: config.json declares {hp.n_mtp_config} MTP layer(s) but the checkpoint has "
                      "none; writing the model without MTP", stacklevel=3)
    out = Plan(hp, n_mtp)

    add = tensor_adder(out.tensors, _keep_f32)

    perm_q = np.arange(n + rp)
    perm_kv = np.arange(r + rp)
    if not hp.rope_interleave:
        perm_q[n:] = n + rope_pairs(rp)
        perm_kv[r:] = r + rope_pairs(rp)

    def per_head_rows(f, rows_per_head, perm):
        if np.array_equal(perm, np.arange(len(perm))):
            return f

        def permuted():
            w = f()
            return np.ascontiguousarray(w.reshape(-1, rows_per_head, w.shape[-1])[:, perm].reshape(w.shape))
        return permuted

    def attention(b: str, p: str, il: int) -> None:
        a = f"{p}.self_attn"
        qk = n + rp
        if hp.q_lora:
            add(f"{b}.attn_q_a.weight", (hp.q_lora, d), get(f"{a}.q_a_proj.weight", (hp.q_lora, d)))
            add(f"{b}.attn_q_a_norm.weight", (hp.q_lora,), get(f"{a}.q_a_layernorm.weight", (hp.q_lora,)))
            add(f"{b}.attn_q_b.weight", (H * qk, hp.q_lora),
                per_head_rows(get(f"{a}.q_b_proj.weight", (H * qk, hp.q_lora)), qk, perm_q))
        else:
            add(f"{b}.attn_q.weight", (H * qk, d), per_head_rows(get(f"{a}.q_proj.weight", (H * qk, d)), qk, perm_q))
        kva = get(f"{a}.kv_a_proj_with_mqa.weight", (r + rp, d))
        add(f"{b}.attn_kv_a_mqa.weight", (r + rp, d), per_head_rows(kva, r + rp, perm_kv))
        add(f"{b}.attn_kv_a_norm.weight", (r,), get(f"{a}.kv_a_layernorm.weight", (r,)))
        kvb = get(f"{a}.kv_b_proj.weight", (H * (n + v), r))
        add(f"{b}.attn_k_b.weight", (H, r, n),
            lambda: np.ascontiguousarray(kvb().reshape(H, n + v, r)[:, :n, :].transpose(0, 2, 1)))
        add(f"{b}.attn_v_b.weight", (H, v, r), lambda: np.ascontiguousarray(kvb().reshape(H, n + v, r)[:, n:, :]))
        add(f"{b}.attn_output.weight", (d, H * v), get(f"{a}.o_proj.weight", (d, H * v)))
        if hp.dsa and il < hp.n_layer and hp.idx_full[il]:
            ix, Hi, Di = f"{a}.indexer", hp.idx_heads, hp.idx_dim
            add(f"{b}.indexer.attn_q_b.weight", (Hi * Di, hp.q_lora), get(f"{ix}.wq_b.weight", (Hi * Di, hp.q_lora)))
            add(f"{b}.indexer.attn_k.weight", (Di, d), get(f"{ix}.wk.weight", (Di, d)))
            add(f"{b}.indexer.k_norm.weight", (Di,), get(f"{ix}.k_norm.weight", (Di,)))
            add(f"{b}.indexer.k_norm.bias", (Di,), get(f"{ix}.k_norm.bias", (Di,)))
            add(f"{b}.indexer.proj.weight", (Hi, d), get(f"{ix}.weights_proj.weight", (Hi, d)))
        elif hp.dsa:  # an MTP layer (dense attention) or a shared layer: its indexer weights are unused
            used.update(k for k in names if k.startswith(f"{a}.indexer."))

    def experts(p: str):
        E, ff = hp.n_expert, hp.n_ff_exp
        fused = f"{p}.mlp.experts.gate_up_proj"
        if fused in names:
            gu = get(fused, (E, 2 * ff, d))
            return (lambda: gu()[:, :ff], lambda: gu()[:, ff:], get(f"{p}.mlp.experts.down_proj", (E, d, ff)))
        parts = []
        for w, shape in (("gate_proj", (ff, d)), ("up_proj", (ff, d)), ("down_proj", (d, ff))):
            fs = [get(f"{p}.mlp.experts.{e}.{w}.weight", shape) for e in range(E)]
            parts.append(lambda fs=fs: np.stack([f() for f in fs]))
        return parts

    def ffn(b: str, p: str, il: int) -> None:
        if il < hp.n_dense:
            ff = hp.n_ff
            dense_ffn(add, get, b, p, ff, d)
            return
        routed_moe_ffn(add, get, b, p, hp.n_expert, hp.n_ff_exp, d, hp.n_shared, experts(p))

    add("token_embd.weight", (V, d), get("model.embed_tokens.weight", (V, d)))
    for i in range(hp.n_layer + n_mtp):
        b, p = f"blk.{i}", f"model.layers.{i}"
        add(f"{b}.attn_norm.weight", (d,), get(f"{p}.input_layernorm.weight", (d,)))
        attention(b, p, i)
        add(f"{b}.ffn_norm.weight", (d,), get(f"{p}.post_attention_layernorm.weight", (d,)))
        ffn(b, p, i)
        if i >= hp.n_layer:
            nextn_tensors(add, get, names.__contains__, b, p, d, V)
    add("output_norm.weight", (d,), get("model.norm.weight", (d,)))
    if "lm_head.weight" in names:
        add("output.weight", (V, d), get("lm_head.weight", (V, d)))
    elif not hp.tied:
        raise ValueError(f"{st.dir}: missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
    reject_unused(st.dir, sorted(names - used))
    return out


def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    """The architecture's GGUF metadata entries (key, value, GGUF type), llama.cpp's keys."""
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, val: int) -> None:
        m.append((f"{a}.{key}", int(val), "uint32"))

    def f32(key: str, val: float) -> None:
        m.append((f"{a}.{key}", float(val), "float32"))

    u32("block_count", hp.n_layer + n_mtp)
    if hp.n_ctx:
        u32("context_length", hp.n_ctx)
    u32("embedding_length", hp.n_embd)
    u32("feed_forward_length", hp.n_ff)
    u32("attention.head_count", hp.n_head)
    u32("attention.head_count_kv", 1)
    f32("rope.freq_base", hp.rope_theta)
    f32("attention.layer_norm_rms_epsilon", hp.eps)
    u32("vocab_size", hp.n_vocab)
    if hp.q_lora:
        u32("attention.q_lora_rank", hp.q_lora)
    u32("attention.kv_lora_rank", hp.kv_lora)
    u32("attention.key_length", hp.kv_lora + hp.qk_rope)
    u32("attention.value_length", hp.kv_lora)
    u32("attention.key_length_mla", hp.qk_nope + hp.qk_rope)
    u32("attention.value_length_mla", hp.v_head_dim)
    u32("rope.dimension_count", hp.qk_rope)
    u32("leading_dense_block_count", hp.n_dense)
    u32("expert_count", hp.n_expert)
    u32("expert_used_count", hp.n_expert_used)
    u32("expert_feed_forward_length", hp.n_ff_exp)
    u32("expert_shared_count", hp.n_shared)
    f32("expert_weights_scale", hp.routed_scale)
    m.append((f"{a}.expert_weights_norm", bool(hp.norm_topk), "bool"))
    u32("expert_gating_func", 2)  # sigmoid
    u32("expert_group_count", hp.n_group)
    u32("expert_group_used_count", hp.n_group_used)
    rp = hp.rope_params
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype == "yarn":
        factor = float(rp.get("factor") or 1.0)
        n_orig = rp.get("original_max_position_embeddings")
        if not n_orig:
            raise ValueError("config.json: yarn rope_parameters need original_max_position_embeddings")
        m.append((f"{a}.rope.scaling.type", "yarn", "string"))
        f32("rope.scaling.factor", factor)
        u32("rope.scaling.original_context_length", n_orig)
        # scores scaled by mscale(mscale_all_dim)^2 (transformers' yarn_apply_mscale); cos / sin by
        # transformers' attention_factor
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        f32("rope.scaling.yarn_log_multiplier", 0.1 * float(mscale_all or 0.0))

        def get_mscale(s, ms=1.0):
            return 1.0 if s <= 1 else 0.1 * ms * math.log(s) + 1.0

        af = rp.get("attention_factor")
        if af is None:
            af = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        if af != 1.0:
            f32("rope.scaling.attn_factor", af)
        for k_hf, k_gguf in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rp.get(k_hf):
                f32(f"rope.scaling.{k_gguf}", rp[k_hf])
    elif rtype not in (None, "default"):
        warnings.warn(f"rope type {rtype!r} is not converted; writing plain RoPE", stacklevel=3)
    if n_mtp:
        u32("nextn_predict_layers", n_mtp)
    if hp.dsa:
        u32("attention.indexer.head_count", hp.idx_heads)
        u32("attention.indexer.key_length", hp.idx_dim)
        u32("attention.indexer.top_k", hp.idx_top_k)
        # pyfast's keys (llama.cpp has none for these): which layers compute their own indexer
        # (IndexShare) and the indexer's RoPE pairing
        m.append((f"{a}.attention.indexer.full_layers", [bool(f) for f in hp.idx_full], "array[bool]"))
        m.append((f"{a}.attention.indexer.rope_interleave", bool(hp.idx_rope_interleave), "bool"))
    return m
