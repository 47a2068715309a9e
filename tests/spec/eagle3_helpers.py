"""Tiny random EAGLE-3 head checkpoints as Hugging Face directories (config.json +
model.safetensors, numpy only, the EAGLE-3 ``midlayer.`` or SpecForge ``layers.0.`` names) for
``pyfast convert --draft`` and the numpy reference (tests/reference/eagle3_numpy.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.spec.hf_checkpoint import write_safetensors  # noqa: F401 (re-exported)


def make_eagle3(out_dir, *, n_vocab: int, target_n_embd: int, layers: list[int] | None, d: int | None = None,
                n_head: int = 4, n_head_kv: int = 2, n_ff: int = 96, n_vocab_draft: int | None = None,
                own_embd: bool = False, own_head: bool = True, norm_before_residual: bool = False,
                norm_before_fc: bool = False, names: str = "eagle3", seed: int = 0, scale: float = 1.0,
                rope_theta: float = 10000.0, d2t_offsets: np.ndarray | None = None) -> dict:
    """Write a random head to ``out_dir``; returns {"config": ..., "weights": {hf name: array},
    "d2t": absolute ids or None}. names: "eagle3" (``midlayer.``) or "specforge" (``layers.0.``).
    scale multiplies the random matrices (larger: more confident drafts). d2t_offsets overrides
    the stored offset table (for bad-table tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    d = d or target_n_embd
    hd = d // n_head
    Vd = n_vocab_draft or n_vocab
    L = len(layers) if layers else 3

    def mat(o, i):
        return (scale * rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    p = "midlayer" if names == "eagle3" else "layers.0"
    w = {"fc.weight": mat(d, L * target_n_embd),
         f"{p}.input_layernorm.weight": norm(d), f"{p}.hidden_norm.weight": norm(d),
         f"{p}.self_attn.q_proj.weight": mat(n_head * hd, 2 * d),
         f"{p}.self_attn.k_proj.weight": mat(n_head_kv * hd, 2 * d),
         f"{p}.self_attn.v_proj.weight": mat(n_head_kv * hd, 2 * d),
         f"{p}.self_attn.o_proj.weight": mat(d, n_head * hd),
         f"{p}.post_attention_layernorm.weight": norm(d),
         f"{p}.mlp.gate_proj.weight": mat(n_ff, d), f"{p}.mlp.up_proj.weight": mat(n_ff, d),
         f"{p}.mlp.down_proj.weight": mat(d, n_ff),
         "norm.weight": norm(d)}
    if norm_before_fc:
        w["input_norm.weight"] = norm(L * target_n_embd)
    if own_embd:
        w["embed_tokens.weight"] = mat(n_vocab, d) * np.float32(np.sqrt(d) / scale)
    if own_head:
        w["lm_head.weight"] = mat(Vd, d)
    absolute = None
    if own_head and Vd < n_vocab or d2t_offsets is not None:
        absolute = np.sort(rng.choice(n_vocab, Vd, replace=False)).astype(np.int64)
        off = absolute - np.arange(Vd) if d2t_offsets is None else np.asarray(d2t_offsets, dtype=np.int64)
        w["d2t"] = off.astype(np.int64)
        t2d = np.zeros(n_vocab, dtype=bool)
        t2d[absolute] = True
        w["t2d"] = t2d
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
           "intermediate_size": n_ff, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 2048,
           "vocab_size": n_vocab, "draft_vocab_size": Vd, "hidden_act": "silu",
           "norm_before_residual": norm_before_residual, "target_hidden_size": target_n_embd}
    if layers:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers), "use_aux_hidden_state": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_safetensors(out / "model.safetensors", w)
    return {"config": cfg, "weights": w, "d2t": absolute, "prefix": p}


def convert(hf_dir, out_path) -> Path:
    from pyfast.convert.eagle3 import convert_eagle3

    convert_eagle3(hf_dir, out_path)
    return Path(out_path)
