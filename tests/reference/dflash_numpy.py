"""An independent float64 numpy reference of the DFlash / DSpark block drafters, written from the
public papers' code (z-lab DFlash ``DFlashDraftModel``, DeepSpec ``Qwen3DSparkModel``,
speculators ``DSparkDraftModel``), reading the Hugging Face checkpoint names directly.

One block: the context features ``F`` of positions ``0 .. n_past-1``, the anchor token at
``n_past`` and ``block-1`` mask tokens after it. Per layer the keys / values are those of the
context rows (``c = hidden_norm(fc F)``, projected without the layer's input norm) followed by the
block's own; attention is non-causal. The read slots' logits go through the Markov chain (DSpark):
``prev`` starts at the anchor, ``logits'_i = logits_i + W2 W1[prev]`` (draft vocabulary),
``conf_i = sigmoid(proj([h_i ; W1[prev]]))`` and ``prev`` becomes the argmax (mapped to a target
id through d2t).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np


def load_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a directory's *.safetensors files (float64 / int64)."""
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(hf_dir, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = json.loads(f.read(n))
            data = f.read()
        for k, v in head.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            dt = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "BOOL": "|b1"}[v["dtype"]]
            a = np.frombuffer(data[b:e], dtype=dt).reshape(v["shape"])
            out[k] = a.astype(np.int64 if dt[1] in "ib" else np.float64)
    return out


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_neox(x, pos, theta):
    """x [T, H, D] rotated by pairs (i, i + D/2) at positions pos."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : D // 2], x[..., D // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class BlockRef:
    """A drafter from its Hugging Face directory.

    fmt: "dflash" (z-lab: ``config.dflash_config``), "deepspec" (flat config, own ``embed_tokens`` /
    ``lm_head``, ``markov_head.markov_w1`` / ``_w2`` [V, R] / [V, R]) or "speculators"
    (``transformer_layer_config``, optional ``lm_head`` [V_d, d] + ``d2t`` offsets).
    embed / head: the target's token embedding [V, d] and output head (when the drafter shares them).
    """

    def __init__(self, hf_dir: str, embed: np.ndarray | None = None, head: np.ndarray | None = None):
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
        self.w = load_safetensors(hf_dir)
        if "transformer_layer_config" in cfg:
            self.fmt = "speculators"
            tl = cfg["transformer_layer_config"]
            self.block = int(cfg.get("block_size", 8))
            self.mask = int(cfg["mask_token_id"])
            self.anchor_first = bool(cfg.get("sample_from_anchor", cfg.get("speculators_model_type") == "dspark"))
            self.markov_rank = int(cfg.get("markov_rank", 0) or 0)
        elif "dflash_config" in cfg:
            self.fmt = "dflash"
            tl = cfg
            dc = cfg["dflash_config"]
            self.block = int(cfg.get("block_size", dc.get("block_size", 16)))
            self.mask = int(dc["mask_token_id"])
            self.anchor_first = False
            self.markov_rank = 0
        else:
            self.fmt = "deepspec"
            tl = cfg
            self.block = int(cfg["block_size"])
            self.mask = int(cfg["mask_token_id"])
            self.anchor_first = True
            self.markov_rank = int(cfg.get("markov_rank", 0))
        self.cfg, self.tl = cfg, tl
        self.d = int(tl["hidden_size"])
        self.H = int(tl["num_attention_heads"])
        self.Hkv = int(tl.get("num_key_value_heads", self.H))
        self.D = int(tl.get("head_dim") or self.d // self.H)
        self.n_layer = int(tl["num_hidden_layers"])
        self.eps = float(tl.get("rms_norm_eps", 1e-6))
        lt = tl.get("layer_types") or []
        self.swa = int(tl["sliding_window"]) if tl.get("sliding_window") and "sliding_attention" in lt else 0
        self.sliding = [t == "sliding_attention" for t in lt]
        self.swa_causal = self.fmt == "speculators" and not cfg.get("sliding_window_non_causal", False)
        rp = tl.get("rope_parameters") or {}
        self.theta = float(rp.get("rope_theta", tl.get("rope_theta", 10000.0)))
        w = self.w
        self.embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else embed
        self.head = w["lm_head.weight"] if "lm_head.weight" in w else head
        self.d2t = None
        if "d2t" in w:  # offsets: target id = row + d2t[row]
            self.d2t = np.arange(w["d2t"].size) + w["d2t"]
        self.conf_w = self.conf_b = None
        mk = "markov_head." if "markov_head.markov_w1.weight" in w else None
        self.w1 = w[mk + "markov_w1.weight"] if mk else None
        self.w2 = w[mk + "markov_w2.weight"] if mk else None
        if "confidence_head.proj.weight" in w:
            self.conf_w = w["confidence_head.proj.weight"]
            self.conf_b = w["confidence_head.proj.bias"]

    @property
    def n_read(self) -> int:
        return self.block if self.anchor_first else self.block - 1

    def _ctx_kv(self, il, c, pos):
        p = f"layers.{il}.self_attn."
        k = (c @ self.w[p + "k_proj.weight"].T).reshape(-1, self.Hkv, self.D)
        k = rms(k, self.w[p + "k_norm.weight"], self.eps)
        v = (c @ self.w[p + "v_proj.weight"].T).reshape(-1, self.Hkv, self.D)
        return rope_neox(k, pos, self.theta), v

    def forward(self, feats: np.ndarray, anchor: int, n_past: int):
        """feats [n_past, L * d_t] -> dict(logits [n_read, V_d] before the Markov bias, biased
        [n_read, V_d] (after it), conf [n_read] or None, tokens [n_read] (target ids of the chain),
        hidden [n_read, d])."""
        w, eps = self.w, self.eps
        c = rms(feats.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        cpos = np.arange(n_past)
        toks = np.full(self.block, self.mask)
        toks[0] = anchor
        bpos = n_past + np.arange(self.block)
        x = self.embed[toks].astype(np.float64)
        g = self.H // self.Hkv
        for il in range(self.n_layer):
            p = f"layers.{il}."
            kc, vc = self._ctx_kv(il, c, cpos)
            h = rms(x, w[p + "input_layernorm.weight"], eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(-1, self.H, self.D)
            q = rope_neox(rms(q, w[p + "self_attn.q_norm.weight"], eps), bpos, self.theta)
            kb, vb = self._ctx_kv(il, h, bpos)
            K, V = np.concatenate([kc, kb]), np.concatenate([vc, vb])
            kpos = np.concatenate([cpos, bpos])
            bias = np.zeros((self.block, kpos.size))
            if self.swa and self.sliding[il]:  # a sliding layer sees keys at positions > p - W
                bias[kpos[None, :] <= bpos[:, None] - self.swa] = -np.inf
                if self.swa_causal:
                    bias[kpos[None, :] > bpos[:, None]] = -np.inf
            o = np.zeros((self.block, self.H, self.D))
            for hh in range(self.H):
                s = q[:, hh] @ K[:, hh // g].T / np.sqrt(self.D) + bias
                s = np.exp(s - s.max(-1, keepdims=True))
                o[:, hh] = (s / s.sum(-1, keepdims=True)) @ V[:, hh // g]
            x = x + o.reshape(self.block, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gt, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gt / (1 + np.exp(-gt)) * up) @ w[p + "mlp.down_proj.weight"].T
        y = rms(x, w["norm.weight"], eps)[self.block - self.n_read:]
        logits = y @ self.head.T
        out = dict(logits=logits, hidden=y, conf=None)
        to_t = (lambda r: int(self.d2t[r])) if self.d2t is not None else (lambda r: int(r))
        if self.w1 is None:
            out["biased"] = logits
            out["tokens"] = np.array([to_t(r) for r in logits.argmax(-1)])
            return out
        prev = anchor
        biased, conf, tokens = [], [], []
        for j in range(self.n_read):
            e = self.w1[prev]
            lj = logits[j] + self.w2 @ e
            biased.append(lj)
            if self.conf_w is not None:
                f = np.concatenate([y[j], e]) if self.conf_w.shape[1] == self.d + e.size else y[j]
                conf.append(1.0 / (1.0 + np.exp(-(float(self.conf_w[0] @ f) + float(self.conf_b[0])))))
            prev = to_t(int(np.argmax(lj)))
            tokens.append(prev)
        out.update(biased=np.stack(biased), tokens=np.array(tokens), conf=np.array(conf) if conf else None)
        return out
