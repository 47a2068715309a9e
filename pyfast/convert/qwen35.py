"""Hybrid Gated-DeltaNet Qwen models -> GGUF: Qwen3.5 (``qwen35``), Qwen3.5-MoE (``qwen35moe``)
and Qwen3-Next (``qwen3next``), with llama.cpp's tensor names and metadata.

Layers alternate between Gated DeltaNet ("linear_attention") and gated full attention; the
layout is ``layer_types`` (or every ``full_attention_interval``-th layer is full attention).
Conventions of the written file (what a graph builder must know):

* RMSNorm weights: the checkpoint's norms scale by ``(1 + w)``; the file stores ``1 + w`` so a
  plain ``x * w`` RMSNorm applies. This covers attn_norm, post_attention_norm, attn_q_norm,
  attn_k_norm, output_norm and the MTP enorm / hnorm / shared_head_norm. The gated norm of the
  DeltaNet output (``ssm_norm``, ``RMS(o) * w * silu(z)``) scales by ``w`` and is stored as is.
* ``ssm_a`` = ``-exp(A_log)`` (negative), so the log-decay is ``g = ssm_a * softplus(alpha +
  ssm_dt.bias)``; ``ssm_dt.bias`` is the checkpoint's ``dt_bias``.
* ``ssm_conv1d.weight``: numpy shape ``[conv_dim, kernel]`` (the checkpoint's ``[C, 1, K]``
  squeezed); channels are ``[q (Hk*S) | k (Hk*S) | v (Hv*S)]``.
* ``attn_qkv`` rows are ``[q | k | v]`` (the conv input); ``attn_gate`` is z (``Hv*S`` rows).
* V-head order: qwen35 / qwen35moe reorder every per-value-head quantity from the checkpoint's
  grouped order (the r = Hv/Hk value heads of key head g are adjacent) to tiled order (value head
  ``j`` uses key head ``j % Hk``); that is the v rows of attn_qkv, attn_gate rows, ssm_beta /
  ssm_alpha rows, ssm_a, ssm_dt.bias, the v channels of ssm_conv1d and the columns of ssm_out.
  qwen3next keeps grouped order (value head ``j`` uses key head ``j // r``); its
  ``in_proj_qkvz`` is split into attn_qkv + attn_gate and ``in_proj_ba`` is kept as ``ssm_ba``
  (rows per key head g: ``[beta (r) | alpha (r)]``).
* DeltaNet step (what the checkpoint computes): conv over the qkv rows (causal, depthwise), SiLU,
  split, L2-normalise q and k per head, ``beta = sigmoid(x @ ssm_beta)``, then the recurrence of
  docs/algorithms.md §2.1 with the output scaled by ``1/sqrt(S)``; then ``RMS(o) * ssm_norm *
  silu(z)`` per value head and ``ssm_out``.
* Full attention: ``attn_q`` has ``2*H*D`` rows, per head ``[q_h (D) | gate_h (D)]``; q and k get
  their RMS norms, then NEOX RoPE on the first ``rope.dimension_count`` dims of each head (for
  text, Qwen3.5's M-RoPE ``rope.dimension_sections`` reduces to it); the attention output is
  multiplied by ``sigmoid(gate)`` before ``attn_output``.
* MoE: ``softmax(x @ ffn_gate_inp)``, top ``expert_used_count``, weights renormalised to sum 1;
  plus the shared expert scaled by ``sigmoid(x @ ffn_gate_inp_shexp)`` (numpy shape ``[1, d]``).
  Expert stacks are ``ffn_{gate,up}_exps [E, ff, d]`` and ``ffn_down_exps [E, d, ff]``.
* MTP (``mtp.*``) becomes block ``n_layer + i``: its decoder layer under the usual names plus
  ``nextn.eh_proj`` (``mtp.fc``, input ``[enorm(emb) ; hnorm(h)]``), ``nextn.enorm``,
  ``nextn.hnorm`` and ``nextn.shared_head_norm`` (``mtp.norm``); ``block_count`` includes it and
  ``nextn_predict_layers`` counts it.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyfast.convert.common import PlannedTensor, check_unused, dense_ffn, experts, tensor_adder
from pyfast.convert.safetensors import SafetensorsDir

__all__ = ["ARCH_BY_HF_ARCH", "ARCH_BY_MODEL_TYPE", "HParams", "grouped_to_tiled", "plan"]

ARCH_BY_MODEL_TYPE = {
    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35",
    "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
}
ARCH_BY_HF_ARCH = {
    "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3_5MoeForConditionalGeneration": "qwen35moe",
    "Qwen3NextForCausalLM": "qwen3next",
}
_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]   # Qwen3.5's default when the config names none


def grouped_to_tiled(x: np.ndarray, axis: int, n_k_heads: int, n_v_per_k: int, head_dim: int) -> np.ndarray:
    """Reorder value heads along ``axis`` (of length ``n_k_heads * n_v_per_k * head_dim``) from
    grouped order (head ``g * r + i``) to tiled order (head ``i * Hk + g``)."""
    axis = axis % x.ndim
    shape = x.shape
    y = x.reshape(shape[:axis] + (n_k_heads, n_v_per_k, head_dim) + shape[axis + 1:])
    y = np.swapaxes(y, axis, axis + 1)
    return np.ascontiguousarray(y).reshape(shape)


# ---------------------------------------------------------------------------------------------
# hyperparameters
# ---------------------------------------------------------------------------------------------

@dataclass
class HParams:
    arch: str
    cfg: dict[str, Any]                 # config.json with text_config merged into the top level
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
    partial_rotary: float
    layer_types: list[str]
    full_attention_interval: int
    conv_kernel: int
    n_k_heads: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int
    n_ff: int | None
    moe: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    n_mtp_config: int | None = None
    tied: bool = False

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.n_v_heads // self.n_k_heads

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)


def _int(cfg: dict[str, Any], key: str, default: Any = ...) -> int:
    v = cfg.get(key, default)
    if v is ...:
        raise ValueError(f"config.json is missing {key!r}")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer, got {v!r}")
    return v


def hparams(arch: str, config: dict[str, Any]) -> HParams:
    cfg = dict(config)
    if isinstance(config.get("text_config"), dict):
        cfg.update(config["text_config"])
    d = _int(cfg, "hidden_size")
    n_layer = _int(cfg, "num_hidden_layers")
    n_head = _int(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or d // n_head
    rope_params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta"))
    interval = int(cfg.get("full_attention_interval", 4))
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)]
    if len(layer_types) != n_layer:
        raise ValueError(f"config.json: layer_types has {len(layer_types)} entries for {n_layer} layers")
    bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ValueError(f"config.json: unknown layer type(s) {bad} in layer_types")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    if cfg.get("attention_bias"):
        raise ValueError("config.json: attention_bias = true is not supported by this architecture")
    moe = arch in ("qwen35moe", "qwen3next")
    hp = HParams(
        arch=arch, cfg=cfg, n_embd=d, n_layer=n_layer, n_vocab=_int(cfg, "vocab_size"), n_head=n_head,
        n_head_kv=_int(cfg, "num_key_value_heads", n_head), head_dim=int(head_dim),
        eps=float(cfg.get("rms_norm_eps", 1e-6)), n_ctx=cfg.get("max_position_embeddings"),
        rope_theta=rope_theta, rope_params=rope_params, partial_rotary=float(partial),
        layer_types=list(layer_types), full_attention_interval=interval,
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4), n_k_heads=_int(cfg, "linear_num_key_heads"),
        n_v_heads=_int(cfg, "linear_num_value_heads"), head_k_dim=_int(cfg, "linear_key_head_dim"),
        head_v_dim=_int(cfg, "linear_value_head_dim"),
        n_ff=cfg.get("intermediate_size") if not moe or "intermediate_size" in cfg else None,
        moe=moe, n_mtp_config=cfg.get("mtp_num_hidden_layers"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
    )
    if hp.n_head % hp.n_head_kv:
        raise ValueError(f"config.json: num_attention_heads {hp.n_head} is not a multiple of "
                         f"num_key_value_heads {hp.n_head_kv}")
    if hp.n_v_heads % hp.n_k_heads:
        raise ValueError(f"config.json: linear_num_value_heads {hp.n_v_heads} is not a multiple of "
                         f"linear_num_key_heads {hp.n_k_heads}")
    if hp.head_k_dim != hp.head_v_dim:
        raise ValueError(f"config.json: linear_key_head_dim {hp.head_k_dim} != linear_value_head_dim "
                         f"{hp.head_v_dim} (llama.cpp's GDN layers need equal key and value head dims)")
    if moe:
        hp.n_expert = _int(cfg, "num_experts")
        hp.n_expert_used = _int(cfg, "num_experts_per_tok")
        hp.n_ff_exp = _int(cfg, "moe_intermediate_size")
        hp.n_ff_shexp = _int(cfg, "shared_expert_intermediate_size")
        if arch == "qwen3next" and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
            raise ValueError("config.json: dense layers in a Qwen3-Next model (mlp_only_layers / "
                             "decoder_sparse_step) are not supported")
        if cfg.get("norm_topk_prob", True) is False:
            warnings.warn("config.json: norm_topk_prob = false, but llama.cpp's graph for this architecture "
                          "always renormalizes the top-k expert weights", stacklevel=3)
    else:
        hp.n_ff = _int(cfg, "intermediate_size")
    return hp


# ---------------------------------------------------------------------------------------------
# tensor plan
# ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    hp: HParams
    n_mtp: int
    tensors: list[PlannedTensor] = field(default_factory=list)


class _Source:
    """The checkpoint's tensors under canonical names, with shape checks and use tracking."""

    def __init__(self, st: SafetensorsDir):
        self.st = st
        self.names: dict[str, str] = {}
        for k in st:
            if k.endswith("rotary_emb.inv_freq") or re.search(r"(^|\.)visual\.|^vision_|\.vision_tower\.", k):
                continue
            c = k.replace("language_model.", "")
            if c.startswith("model.mtp."):
                c = c[len("model."):]
            if c in self.names:
                raise ValueError(f"{st.dir}: tensors {self.names[c]!r} and {k!r} both map to {c!r}")
            self.names[c] = k
        self.used: set = set()

    def has(self, name: str) -> bool:
        return name in self.names

    def check(self, name: str, shape: Sequence[int]) -> str:
        key = self.names.get(name)
        if key is None:
            raise ValueError(f"{self.st.dir}: missing tensor {name!r}")
        got = self.st.shape(key)
        if tuple(got) != tuple(shape):
            raise ValueError(f"{self.st.dir}: tensor {key!r} has shape {list(got)}, expected {list(shape)}")
        dtype = self.st.refs[key].dtype
        if dtype not in ("F32", "F16", "BF16", "F64"):
            raise ValueError(f"{self.st.dir}: tensor {key!r} has dtype {dtype}; only F32, F16, BF16 and F64 "
                             "checkpoints are supported")
        self.used.add(name)
        return key

    def get(self, name: str, shape: Sequence[int]) -> Callable[[], np.ndarray]:
        key = self.check(name, shape)
        return lambda: self.st.load(key)


def _keep_f32(name: str, shape: tuple[int, ...]) -> bool:
    return (len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or ".ffn_gate_inp" in name or ".ssm_conv1d." in name)


def _plus_one(f: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: f() + np.float32(1.0)


def _map(f: Callable[[], np.ndarray], fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: np.ascontiguousarray(fn(f()), dtype=np.float32)


def plan(hp: HParams, st: SafetensorsDir, mtp: bool = True) -> Plan:
    """Check the checkpoint against the config and list the GGUF tensors to write."""
    src = _Source(st)
    d, V = hp.n_embd, hp.n_vocab
    tiled = hp.arch in ("qwen35", "qwen35moe") and hp.n_k_heads != hp.n_v_heads
    Hk, r, S = hp.n_k_heads, hp.v_per_k, hp.head_v_dim

    def vre(f, axis, head_dim):
        if not tiled:
            return f
        return _map(f, lambda a: grouped_to_tiled(a, axis, Hk, r, head_dim))

    # ---- MTP layers present in the checkpoint
    mtp_idx = sorted({int(m.group(1)) for n in src.names for m in [re.match(r"mtp\.layers\.(\d+)\.", n)] if m})
    if mtp_idx and mtp_idx != list(range(len(mtp_idx))):
        raise ValueError(f"{st.dir}: MTP layer indices {mtp_idx} are not 0..{len(mtp_idx) - 1}")
    n_mtp = 0
    if mtp:
        n_mtp = hp.n_mtp_config if hp.n_mtp_config else len(mtp_idx)
        if n_mtp and not mtp_idx:
            warnings.warn(f"{st.dir}: config.json declares {n_mtp} MTP layer(s) but the checkpoint has no "
                          "mtp.* tensors; writing the model without MTP", stacklevel=3)
            n_mtp = 0
        elif n_mtp != len(mtp_idx):
            raise ValueError(f"{st.dir}: config.json declares {n_mtp} MTP layer(s), the checkpoint has "
                             f"{len(mtp_idx)}")
    else:
        src.used.update(n for n in src.names if n.startswith("mtp."))

    out = Plan(hp, n_mtp)
    add = tensor_adder(out.tensors, _keep_f32)

    def norm(gname: str, hname: str, n: int) -> None:
        add(gname, (n,), _plus_one(src.get(hname, (n,))))

    def attention(b: str, p: str) -> None:
        H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
        add(f"{b}.attn_q.weight", (2 * H * D, d), src.get(f"{p}.self_attn.q_proj.weight", (2 * H * D, d)))
        add(f"{b}.attn_k.weight", (Hkv * D, d), src.get(f"{p}.self_attn.k_proj.weight", (Hkv * D, d)))
        add(f"{b}.attn_v.weight", (Hkv * D, d), src.get(f"{p}.self_attn.v_proj.weight", (Hkv * D, d)))
        add(f"{b}.attn_output.weight", (d, H * D), src.get(f"{p}.self_attn.o_proj.weight", (d, H * D)))
        norm(f"{b}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", D)
        norm(f"{b}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", D)

    def linear_attention(b: str, p: str) -> None:
        a = f"{p}.linear_attn"
        Hv, K, C = hp.n_v_heads, hp.conv_kernel, hp.conv_dim
        kd2 = 2 * hp.key_dim
        if hp.arch == "qwen3next":
            qkvz = src.get(f"{a}.in_proj_qkvz.weight", (C + hp.value_dim, d))
            per = 2 * hp.head_k_dim + 2 * r * S

            def split(part: str) -> Callable[[], np.ndarray]:
                def f() -> np.ndarray:
                    w = qkvz().reshape(Hk, per, d)
                    q, k, v, z = np.split(w, np.cumsum([hp.head_k_dim, hp.head_k_dim, r * S]), axis=1)
                    if part == "z":
                        return np.ascontiguousarray(z.reshape(-1, d))
                    return np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)], axis=0)
                return f

            add(f"{b}.attn_qkv.weight", (C, d), split("qkv"))
            add(f"{b}.attn_gate.weight", (hp.value_dim, d), split("z"))
            add(f"{b}.ssm_ba.weight", (2 * Hv, d), src.get(f"{a}.in_proj_ba.weight", (2 * Hv, d)))
        else:
            qkv = src.get(f"{a}.in_proj_qkv.weight", (C, d))
            add(f"{b}.attn_qkv.weight", (C, d),
                qkv if not tiled else _map(qkv, lambda w: np.concatenate(
                    [w[:kd2], grouped_to_tiled(w[kd2:], 0, Hk, r, S)], axis=0)))
            add(f"{b}.attn_gate.weight", (hp.value_dim, d),
                vre(src.get(f"{a}.in_proj_z.weight", (hp.value_dim, d)), 0, S))
            add(f"{b}.ssm_beta.weight", (Hv, d), vre(src.get(f"{a}.in_proj_b.weight", (Hv, d)), 0, 1))
            add(f"{b}.ssm_alpha.weight", (Hv, d), vre(src.get(f"{a}.in_proj_a.weight", (Hv, d)), 0, 1))
        conv = _map(src.get(f"{a}.conv1d.weight", (C, 1, K)), lambda w: w.reshape(C, K))
        if tiled:
            conv = _map(conv, lambda w: np.concatenate([w[:kd2], grouped_to_tiled(w[kd2:], 0, Hk, r, S)], axis=0))
        add(f"{b}.ssm_conv1d.weight", (C, K), conv)
        add(f"{b}.ssm_dt.bias", (Hv,), vre(src.get(f"{a}.dt_bias", (Hv,)), 0, 1))
        add(f"{b}.ssm_a", (Hv,), vre(_map(src.get(f"{a}.A_log", (Hv,)), lambda x: -np.exp(x)), 0, 1))
        add(f"{b}.ssm_norm.weight", (S,), src.get(f"{a}.norm.weight", (S,)))
        add(f"{b}.ssm_out.weight", (d, hp.value_dim), vre(src.get(f"{a}.out_proj.weight", (d, hp.value_dim)), 1, S))

    def ffn(b: str, p: str) -> None:
        if not hp.moe:
            ff = hp.n_ff
            dense_ffn(add, src.get, b, p, ff, d)
            return
        E, ff, fs = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
        gate, up, down = experts(src, f"{p}.mlp", E, ff, d)
        add(f"{b}.ffn_gate_inp.weight", (E, d), src.get(f"{p}.mlp.gate.weight", (E, d)))
        add(f"{b}.ffn_gate_exps.weight", (E, ff, d), gate)
        add(f"{b}.ffn_up_exps.weight", (E, ff, d), up)
        add(f"{b}.ffn_down_exps.weight", (E, d, ff), down)
        add(f"{b}.ffn_gate_inp_shexp.weight", (1, d), src.get(f"{p}.mlp.shared_expert_gate.weight", (1, d)))
        add(f"{b}.ffn_gate_shexp.weight", (fs, d), src.get(f"{p}.mlp.shared_expert.gate_proj.weight", (fs, d)))
        add(f"{b}.ffn_up_shexp.weight", (fs, d), src.get(f"{p}.mlp.shared_expert.up_proj.weight", (fs, d)))
        add(f"{b}.ffn_down_shexp.weight", (d, fs), src.get(f"{p}.mlp.shared_expert.down_proj.weight", (d, fs)))

    add("token_embd.weight", (V, d), src.get("model.embed_tokens.weight", (V, d)))
    for i in range(hp.n_layer):
        b, p = f"blk.{i}", f"model.layers.{i}"
        norm(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", d)
        if hp.layer_types[i] == "full_attention":
            attention(b, p)
        else:
            linear_attention(b, p)
        norm(f"{b}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", d)
        ffn(b, p)
    for j in range(n_mtp):
        b, p = f"blk.{hp.n_layer + j}", f"mtp.layers.{j}"
        norm(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", d)
        attention(b, p)
        norm(f"{b}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", d)
        ffn(b, p)
        if j == 0:
            add(f"{b}.nextn.eh_proj.weight", (d, 2 * d), src.get("mtp.fc.weight", (d, 2 * d)))
            norm(f"{b}.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight", d)
            norm(f"{b}.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", d)
            norm(f"{b}.nextn.shared_head_norm.weight", "mtp.norm.weight", d)
    norm("output_norm.weight", "model.norm.weight", d)
    if src.has("lm_head.weight"):
        add("output.weight", (V, d), src.get("lm_head.weight", (V, d)))
    elif not hp.tied:
        raise ValueError(f"{st.dir}: missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")

    check_unused(src, st)
    return out


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------

def metadata(hp: HParams, n_mtp: int) -> list[tuple[str, Any, str]]:
    """The architecture's GGUF metadata entries (key, value, GGUF type), llama.cpp's keys."""
    a = hp.arch
    m: list[tuple[str, Any, str]] = []

    def u32(key: str, v: int) -> None:
        m.append((f"{a}.{key}", int(v), "uint32"))

    u32("block_count", hp.n_layer + n_mtp)
    if hp.n_ctx is not None:
        u32("context_length", hp.n_ctx)
    u32("embedding_length", hp.n_embd)
    if hp.n_ff is not None:
        u32("feed_forward_length", hp.n_ff)
    u32("attention.head_count", hp.n_head)
    u32("attention.head_count_kv", hp.n_head_kv)
    rp = hp.rope_params
    rope_type, factor = rp.get("rope_type", rp.get("type")), rp.get("factor")
    if rope_type == "linear" and factor is not None:
        m.append((f"{a}.rope.scaling.type", "linear", "string"))
        m.append((f"{a}.rope.scaling.factor", float(factor), "float32"))
    elif rope_type == "yarn" and factor is not None:
        m.append((f"{a}.rope.scaling.type", "yarn", "string"))
        m.append((f"{a}.rope.scaling.factor", float(factor), "float32"))
        u32("rope.scaling.original_context_length", rp["original_max_position_embeddings"])
    elif rope_type not in (None, "default"):
        warnings.warn(f"rope type {rope_type!r} is not converted; writing plain RoPE", stacklevel=3)
    if a in ("qwen35", "qwen35moe"):
        sections = list(rp.get("mrope_section") or _DEFAULT_MROPE_SECTION)
        sections = (sections + [0, 0, 0, 0])[:4]
        m.append((f"{a}.rope.dimension_sections", [int(s) for s in sections], "array[int32]"))
    if hp.rope_theta is not None:
        m.append((f"{a}.rope.freq_base", float(hp.rope_theta), "float32"))
    m.append((f"{a}.attention.layer_norm_rms_epsilon", float(hp.eps), "float32"))
    if hp.moe:
        u32("expert_count", hp.n_expert)
        u32("expert_used_count", hp.n_expert_used)
    u32("attention.key_length", hp.head_dim)
    u32("attention.value_length", hp.head_dim)
    if hp.moe:
        u32("expert_feed_forward_length", hp.n_ff_exp)
        u32("expert_shared_feed_forward_length", hp.n_ff_shexp)
    if n_mtp:
        u32("nextn_predict_layers", n_mtp)
    u32("ssm.conv_kernel", hp.conv_kernel)
    u32("ssm.state_size", hp.head_k_dim)
    u32("ssm.group_count", hp.n_k_heads)
    u32("ssm.time_step_rank", hp.n_v_heads)
    u32("ssm.inner_size", hp.value_dim)
    recurrent = [t == "linear_attention" for t in hp.layer_types] + [False] * n_mtp
    m.append((f"{a}.attention.recurrent_layers", recurrent, "array[bool]"))
    u32("full_attention_interval", hp.full_attention_interval)
    u32("rope.dimension_count", hp.rope_dim)
    return m
