"""Tiny random DFlash / DSpark drafter checkpoints in the three public formats (z-lab DFlash,
DeepSpec dense DSpark, speculators / SpecForge), written as Hugging Face directories (config.json
+ model.safetensors, numpy only) for ``pyfast convert --draft`` and the numpy reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.spec.hf_checkpoint import write_safetensors  # noqa: F401 (re-exported)


def make_hf_drafter(out_dir, fmt: str, *, n_vocab: int, target_n_embd: int, target_layers: list[int],
                    n_target_layers: int, d: int | None = None, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
                    n_ff: int = 96, block: int = 6, mask: int = 1, markov_rank: int = 0, conf: str = "hm",
                    n_vocab_draft: int | None = None, sample_from_anchor: bool | None = None, seed: int = 0,
                    scale: float = 1.0, bad_d2t: str | None = None, swa: tuple | None = None) -> Path:
    """A random drafter directory.

    fmt: "dflash" (z-lab), "deepspec" (dense DSpark: own embed_tokens / lm_head) or "speculators"
    (dflash, or dspark when markov_rank > 0; a reduced vocabulary with n_vocab_draft).
    target_layers: "output of layer l" ids; the speculators file stores them + 1 (aux ids).
    conf: "hm" (confidence head on [hidden ; E1[prev]]), "h" (hidden only) or "" (none).
    scale: weight scale of the layers (larger: sharper, more varied draft logits).
    bad_d2t: "dup" / "range" writes a broken table (load must refuse it).
    swa: (window, [layer is sliding, ...]) for sliding-window draft layers.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = d or target_n_embd
    rng = np.random.default_rng(seed)
    D = d // n_head
    L = len(target_layers)
    V, Vd = n_vocab, n_vocab_draft or n_vocab

    def mat(o, i):
        return (rng.standard_normal((o, i)) * scale / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(d, L * target_n_embd), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(n_layer):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "self_attn.q_proj.weight": mat(n_head * D, d),
                  p + "self_attn.k_proj.weight": mat(n_head_kv * D, d),
                  p + "self_attn.v_proj.weight": mat(n_head_kv * D, d),
                  p + "self_attn.o_proj.weight": mat(d, n_head * D),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
                  p + "mlp.gate_proj.weight": mat(n_ff, d), p + "mlp.up_proj.weight": mat(n_ff, d),
                  p + "mlp.down_proj.weight": mat(d, n_ff)})
    layer_cfg = {"model_type": "qwen3", "hidden_size": d, "num_hidden_layers": n_layer, "num_attention_heads": n_head,
                 "num_key_value_heads": n_head_kv, "head_dim": D, "intermediate_size": n_ff, "rms_norm_eps": 1e-6,
                 "rope_theta": 10000.0, "vocab_size": V, "max_position_embeddings": 4096, "hidden_act": "silu",
                 "attention_bias": False, "tie_word_embeddings": False}
    if swa:
        layer_cfg.update(sliding_window=int(swa[0]), use_sliding_window=True,
                         layer_types=["sliding_attention" if s else "full_attention" for s in swa[1]])
    if markov_rank:
        R = markov_rank
        w["markov_head.markov_w1.weight"] = (rng.standard_normal((V, R)) * 0.5).astype(np.float32)
        w["markov_head.markov_w2.weight"] = (rng.standard_normal((Vd, R)) * 0.5).astype(np.float32)
        if conf:
            w["confidence_head.proj.weight"] = mat(1, d + (R if conf == "hm" else 0))
            w["confidence_head.proj.bias"] = np.array([0.3], dtype=np.float32)
    if fmt == "dflash":
        cfg = dict(layer_cfg, architectures=["DFlashDraftModel"], block_size=block, num_target_layers=n_target_layers,
                   dflash_config={"mask_token_id": mask, "target_layer_ids": list(target_layers)})
    elif fmt == "deepspec":
        w["embed_tokens.weight"] = (rng.standard_normal((V, d))).astype(np.float32)
        w["lm_head.weight"] = mat(V, d)
        cfg = dict(layer_cfg, architectures=["Qwen3DSparkModel"], block_size=block, num_target_layers=n_target_layers,
                   target_layer_ids=list(target_layers), mask_token_id=mask, num_anchors=64,
                   enable_confidence_head=bool(markov_rank and conf), confidence_head_with_markov=conf == "hm",
                   markov_rank=markov_rank, markov_head_type="vanilla")
    elif fmt == "speculators":
        kind = "dspark" if markov_rank else "dflash"
        cfg = {"speculators_model_type": kind,
               "architectures": ["DSparkSpeculator" if markov_rank else "DFlashSpeculator"],
               "transformer_layer_config": layer_cfg, "draft_vocab_size": Vd, "block_size": block,
               "aux_hidden_state_layer_ids": [int(x) + 1 for x in target_layers], "mask_token_id": mask,
               "target_hidden_size": target_n_embd}
        if sample_from_anchor is not None:
            cfg["sample_from_anchor"] = sample_from_anchor
        if markov_rank:
            cfg.update(markov_rank=markov_rank, markov_head_type="vanilla", enable_confidence_head=bool(conf),
                       confidence_head_with_markov=conf == "hm")
        w["verifier_norm.weight"] = norm(d)
        if Vd != V:
            keep = np.sort(rng.choice(V, Vd, replace=False))
            if bad_d2t == "dup":
                keep[3] = keep[2]
            elif bad_d2t == "range":
                keep[-1] = V + 5
            w["d2t"] = (keep - np.arange(Vd)).astype(np.int64)          # offsets
            t2d = np.zeros(V, dtype=bool)
            t2d[keep[keep < V]] = True
            w["t2d"] = t2d
            w["lm_head.weight"] = mat(Vd, d)
    else:
        raise ValueError(fmt)
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f)
    write_safetensors(out / "model.safetensors", w)
    return out
