#!/usr/bin/env python3
"""Build the tiny EAGLE-3 head fixtures under tests/fixtures/eagle3/ (needs torch; pyfast reads
the results without it).

For each variant a random head is written as a Hugging Face directory ``hf/<name>/`` (config.json
+ model.safetensors, every parameter from a seeded numpy generator) and its outputs are computed
by a float64 torch implementation of the EAGLE-3 draft layer written from the paper's structure
(Li et al., "EAGLE-3", 2025; the public SpecForge / EAGLE heads' layout):

    g   = fc(F)               F = [h_low ; h_mid ; h_high] (optionally RMS(F) first: norm_before_fc)
    a   = cat(RMS_in(emb(x)), RMS_h(g))                 [2d]
    q,k,v = a Wq^T, a Wk^T, a Wv^T; rotate_half RoPE at the row's position; causal GQA attention
    x1  = r + o Wo^T          r = g, or RMS_h(g) (norm_before_residual)
    z   = x1 + down(silu(gate(RMS_post(x1))) * up(RMS_post(x1)))
    logits = RMS_norm(z) lm_head^T   (V_d rows; scattered to the target vocabulary through d2t)

Variants: ``reduced`` (EAGLE-3 ``midlayer.`` names, own lm_head over 40 of 96 target tokens with
a d2t offset table, the target's embedding) and ``full`` (SpecForge ``layers.0.`` names, own
embedding, norm_before_fc and norm_before_residual, a full-vocabulary head, no d2t).

NPZ keys: ``tokens`` int32 [T] (row t's token), ``positions`` int32 [T], ``features`` [T, 3 d_t]
(random target features), ``logits_draft`` [T, V_d], ``logits`` [T, V] (scattered, -inf off
d2t), ``hidden`` [T, d] (z, the pre-norm output), then one chained step: ``step_token`` int32,
``step_pos`` int32, ``step_logits`` [V_d] of row (step_token @ step_pos, h = hidden[-1]) attending
over the T rows and itself. The target the heads belong to is
``tests.reference.tiny_gguf.write_tiny_llama(n_vocab=96, n_embd=64, n_layer=6, n_head=4,
n_head_kv=2, n_ff=96, seed=TARGET_SEED)`` (its token embedding is the ``reduced`` head's).

Usage: ``python scripts/make_eagle3_fixtures.py [--out DIR]``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = dict(n_vocab=96, n_embd=64, n_layer=6, n_head=4, n_head_kv=2, n_ff=96)
TARGET_SEED = 11
LAYERS = [1, 3, 6]
T = 7
VARIANTS = {
    "reduced": dict(names="eagle3", n_vocab_draft=40, own_embd=False, own_head=True, seed=21),
    "full": dict(names="specforge", own_embd=True, own_head=True, norm_before_fc=True,
                 norm_before_residual=True, seed=22),
}


def target_weights() -> dict[str, np.ndarray]:
    from tests.reference.tiny_gguf import write_tiny_llama

    with tempfile.TemporaryDirectory() as td:
        return write_tiny_llama(Path(td) / "t.gguf", wtype="f32", seed=TARGET_SEED, **TARGET)["weights"]


def reference(info: dict, embd: np.ndarray, tokens, positions, features, step_token, step_pos):
    """float64 torch forward of the head over the rows, then one chained step."""
    import torch

    cfg, W = info["config"], {k: torch.tensor(v, dtype=torch.float64) for k, v in info["weights"].items()
                             if v.dtype.kind == "f"}
    p = info["prefix"]
    d, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = d // H, cfg["rms_norm_eps"]
    E = W.get("embed_tokens.weight", torch.tensor(embd, dtype=torch.float64))

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [n, h, hd]; rotate_half layout
        inv = cfg["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, :], torch.cat([ang.sin()] * 2, -1)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    K, Vv, P = [], [], []

    def rows(toks, pos, g):
        n = len(toks)
        hn = rms(g, W[f"{p}.hidden_norm.weight"])
        a = torch.cat([rms(E[torch.tensor(toks)], W[f"{p}.input_layernorm.weight"]), hn], -1)
        q = rope((a @ W[f"{p}.self_attn.q_proj.weight"].T).view(n, H, hd), pos)
        k = rope((a @ W[f"{p}.self_attn.k_proj.weight"].T).view(n, Hkv, hd), pos)
        v = (a @ W[f"{p}.self_attn.v_proj.weight"].T).view(n, Hkv, hd)
        K.append(k)
        Vv.append(v)
        P.extend(pos)
        kk, vv = torch.cat(K), torch.cat(Vv)
        kp = torch.tensor(P)
        o = torch.empty(n, H, hd, dtype=torch.float64)
        for h in range(H):
            s = q[:, h] @ kk[:, h // (H // Hkv)].T / hd ** 0.5
            s = s.masked_fill(kp[None, :] > torch.tensor(pos)[:, None], float("-inf"))
            o[:, h] = torch.softmax(s, -1) @ vv[:, h // (H // Hkv)]
        x = (hn if cfg.get("norm_before_residual") else g) + o.reshape(n, H * hd) @ W[f"{p}.self_attn.o_proj.weight"].T
        y = rms(x, W[f"{p}.post_attention_layernorm.weight"])
        gate, up = y @ W[f"{p}.mlp.gate_proj.weight"].T, y @ W[f"{p}.mlp.up_proj.weight"].T
        z = x + (torch.nn.functional.silu(gate) * up) @ W[f"{p}.mlp.down_proj.weight"].T
        return rms(z, W["norm.weight"]) @ W["lm_head.weight"].T, z

    F = torch.tensor(features, dtype=torch.float64)
    if "input_norm.weight" in W:
        F = rms(F, W["input_norm.weight"])
    logits, z = rows(list(tokens), list(positions), F @ W["fc.weight"].T)
    step, _ = rows([int(step_token)], [int(step_pos)], z[-1:])
    return logits.numpy(), z.numpy(), step[0].numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "eagle3"))
    a = ap.parse_args(argv)
    from tests.spec.eagle3_helpers import make_eagle3

    out = Path(a.out)
    embd = target_weights()["token_embd.weight"]
    for name, kw in VARIANTS.items():
        info = make_eagle3(out / "hf" / name, n_vocab=TARGET["n_vocab"], target_n_embd=TARGET["n_embd"],
                           layers=LAYERS, n_head=4, n_head_kv=2, n_ff=96, **kw)
        rng = np.random.default_rng(kw["seed"] + 100)
        tokens = rng.integers(0, TARGET["n_vocab"], T).astype(np.int32)
        positions = np.arange(T, dtype=np.int32)
        features = rng.standard_normal((T, len(LAYERS) * TARGET["n_embd"])).astype(np.float32)
        step_token, step_pos = np.int32(rng.integers(0, TARGET["n_vocab"])), np.int32(T)
        ld, z, step = reference(info, embd, tokens, positions, features, step_token, step_pos)
        V = TARGET["n_vocab"]
        full = np.full((T, V), -np.inf)
        if info["d2t"] is not None:
            full[:, info["d2t"]] = ld
        else:
            full = ld
        np.savez(out / f"{name}.npz", tokens=tokens, positions=positions, features=features,
                 logits_draft=ld.astype(np.float32), logits=full.astype(np.float32), hidden=z.astype(np.float32),
                 step_token=step_token, step_pos=step_pos, step_logits=step.astype(np.float32))
        print(f"{name}: {out / 'hf' / name}, {out / (name + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
