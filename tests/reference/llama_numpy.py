"""An independent float64 numpy implementation of the llama architecture, used as a test oracle.

It reads a GGUF with the ``gguf`` PyPI package (not pyfast's reader), dequantizes weights with
``gguf.quants.dequantize`` and computes logits in float64:

    x = token_embd[tokens]
    per layer:
        h = rmsnorm(x) * attn_norm
        q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T        -> [T, n_head(_kv), head_dim]
        q, k = rope_normal(q, pos), rope_normal(k, pos)  (pairs (2i, 2i+1), first n_rot dims)
        causal GQA attention (kv head = q head // (n_head / n_head_kv)), scale 1/sqrt(head_dim)
        x += attn @ Wo.T
        h = rmsnorm(x) * ffn_norm
        x += (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T
        x += layer_add[il]                             (only for the layers in ``layer_add``)
    logits = (rmsnorm(x) * output_norm) @ Wout.T     (Wout = token_embd when tied)

rmsnorm(x) = x / sqrt(mean(x^2) + eps). Shapes are outermost-first; gguf-py reports tensor
shapes innermost-first (ggml ``ne``), which ``LlamaRef.weight`` flips.

Attention masks by position (a key is visible when its position <= the query's), so a prefill
and a token-by-token decode over the same positions give the same logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import gguf
import numpy as np

__all__ = ["LlamaRef", "KVState", "rms_norm", "rope_normal", "log_softmax"]


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_normal(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """llama.cpp NORMAL-mode rope. x: [T, H, D], pos: [T].

    Pair (2i, 2i+1) for i < n_rot/2 is rotated by theta = pos * base^(-2i/n_rot);
    dims >= n_rot pass through unchanged.
    """
    out = np.array(x, dtype=np.float64, copy=True)
    i = np.arange(n_rot // 2, dtype=np.float64)
    theta = np.asarray(pos, np.float64)[:, None] * base ** (-2.0 * i / n_rot)  # [T, n_rot/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [T, 1, n_rot/2]
    x0 = out[..., 0:n_rot:2].copy()
    x1 = out[..., 1:n_rot:2].copy()
    out[..., 0:n_rot:2] = x0 * cos - x1 * sin
    out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis (float64)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class KVState:
    """Past keys (after rope) and values per layer for one sequence, plus their positions."""

    k: list[np.ndarray] = field(default_factory=list)  # per layer [n_past, n_head_kv, head_dim]
    v: list[np.ndarray] = field(default_factory=list)  # per layer [n_past, n_head_kv, head_dim]
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n_past]

    @property
    def n_past(self) -> int:
        return int(self.pos.size)

    def next_pos(self) -> int:
        return int(self.pos.max()) + 1 if self.pos.size else 0


def _field_value(f):
    """Value of a GGUFReader field (strings decoded, arrays as lists); version tolerant."""
    if hasattr(f, "contents"):
        return f.contents()
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if t == gguf.GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8")
    return f.parts[-1].tolist()[0]


class LlamaRef:
    """float64 reference forward pass of a llama-architecture GGUF.

    ``cache_weights=False`` dequantizes each weight when it is used instead of keeping all of
    them (use it for real models: SmolLM2-135M would need ~0.5 GB of float32).
    """

    def __init__(self, path: str | Path, cache_weights: bool = True):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(self.path))
        self.meta = {name: f for name, f in self.reader.fields.items()}
        arch = self.get_meta("general.architecture")
        if arch != "llama":
            raise ValueError(
                f"{self.path}: LlamaRef handles general.architecture=llama, got {arch!r}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.n_embd = int(self.get_meta("llama.embedding_length"))
        self.n_layer = int(self.get_meta("llama.block_count"))
        self.n_ff = int(self.get_meta("llama.feed_forward_length"))
        self.n_head = int(self.get_meta("llama.attention.head_count"))
        self.n_head_kv = int(self.get_meta("llama.attention.head_count_kv", self.n_head))
        self.n_ctx = int(self.get_meta("llama.context_length"))
        self.eps = float(self.get_meta("llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(self.get_meta("llama.rope.freq_base", 10000.0))
        self.head_dim = int(self.get_meta("llama.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(self.get_meta("llama.rope.dimension_count", self.head_dim))
        self.tied = "output.weight" not in self.tensors
        self.n_vocab = int(self.tensor_shape("token_embd.weight")[0])
        if self.n_head % self.n_head_kv:
            raise ValueError(f"{self.path}: n_head={self.n_head} not divisible by "
                             f"n_head_kv={self.n_head_kv}")
        self._cache: dict[str, np.ndarray] | None = {} if cache_weights else None
        # vectors added to the output of a layer (0-based index -> [n_embd]): control vectors
        self.layer_add: dict[int, np.ndarray] = {}
        # after forward(): layer id l -> the input rows of layer l ([T, n_embd] float64; id
        # n_layer = the last layer's output before the output norm), for feature-capture tests
        self.layer_inputs: dict[int, np.ndarray] = {}

    # -- file access --------------------------------------------------------------------------

    def get_meta(self, key: str, default=None):
        f = self.meta.get(key)
        if f is None:
            if default is None:
                raise KeyError(f"{self.path}: missing metadata key {key!r}")
            return default
        return _field_value(f)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Outermost-first shape (gguf-py's ``shape`` is ggml ne order, innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape))

    def weight(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, outermost-first ([n_out, n_in] for matrices)."""
        if self._cache is not None and name in self._cache:
            return self._cache[name]
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: missing tensor {name!r}")
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(self.tensor_shape(name))
        if self._cache is not None:
            self._cache[name] = arr
        return arr

    def _mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T in float64. x: [T, n_in], W: [n_out, n_in] -> [T, n_out]."""
        w = self.weight(name)
        return x @ w.T.astype(np.float64)

    # -- model --------------------------------------------------------------------------------

    def new_state(self) -> KVState:
        return KVState(k=[np.zeros((0, self.n_head_kv, self.head_dim))] * self.n_layer,
                       v=[np.zeros((0, self.n_head_kv, self.head_dim))] * self.n_layer)

    def forward(
        self,
        tokens: Sequence[int],
        positions: Sequence[int] | None = None,
        past: KVState | None = None,
    ) -> tuple[np.ndarray, KVState]:
        """Run ``tokens`` after the cached ``past`` (None = empty).

        ``positions`` default to ``past.next_pos() + arange(T)``. Returns
        ``(logits [T, n_vocab] float64, new_state)``; ``past`` itself is not modified, so a
        state can be branched.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = tokens.size
        if T == 0:
            raise ValueError("forward: no tokens")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError(f"forward: token id outside [0, {self.n_vocab})")
        past = past if past is not None else self.new_state()
        if positions is None:
            pos = past.next_pos() + np.arange(T, dtype=np.int64)
        else:
            pos = np.asarray(positions, dtype=np.int64).reshape(-1)
            if pos.size != T:
                raise ValueError(f"forward: {T} tokens but {pos.size} positions")
        all_pos = np.concatenate([past.pos, pos])
        # mask[i, j]: query i may attend key j
        mask = all_pos[None, :] <= pos[:, None]  # [T, n_past + T]

        D, Hq, Hkv = self.head_dim, self.n_head, self.n_head_kv
        group = Hq // Hkv
        scale = 1.0 / np.sqrt(D)

        x = self.weight("token_embd.weight")[tokens].astype(np.float64)  # [T, n_embd]
        new_k, new_v = [], []
        self.layer_inputs = {}
        for il in range(self.n_layer):
            self.layer_inputs[il] = x
            b = f"blk.{il}."
            h = rms_norm(x, self.eps) * self.weight(b + "attn_norm.weight")
            q = self._mm(h, b + "attn_q.weight").reshape(T, Hq, D)
            k = self._mm(h, b + "attn_k.weight").reshape(T, Hkv, D)
            v = self._mm(h, b + "attn_v.weight").reshape(T, Hkv, D)
            q = rope_normal(q, pos, self.n_rot, self.rope_base)
            k = rope_normal(k, pos, self.n_rot, self.rope_base)
            K = np.concatenate([past.k[il], k], axis=0)  # [n_kv, Hkv, D]
            V = np.concatenate([past.v[il], v], axis=0)
            new_k.append(K)
            new_v.append(V)

            attn = np.empty((T, Hq, D))
            for hq in range(Hq):
                hk = hq // group
                s = (q[:, hq, :] @ K[:, hk, :].T) * scale  # [T, n_kv]
                s = np.where(mask, s, -np.inf)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=-1, keepdims=True)
                attn[:, hq, :] = p @ V[:, hk, :]
            x = x + self._mm(attn.reshape(T, Hq * D), b + "attn_output.weight")

            h = rms_norm(x, self.eps) * self.weight(b + "ffn_norm.weight")
            g = self._mm(h, b + "ffn_gate.weight")
            u = self._mm(h, b + "ffn_up.weight")
            x = x + self._mm(g / (1.0 + np.exp(-g)) * u, b + "ffn_down.weight")
            if il in self.layer_add:
                x = x + np.asarray(self.layer_add[il], dtype=np.float64)
        self.layer_inputs[self.n_layer] = x

        h = rms_norm(x, self.eps) * self.weight("output_norm.weight")
        w_out = self.weight("token_embd.weight" if self.tied else "output.weight")
        logits = np.empty((T, self.n_vocab))
        for r0 in range(0, self.n_vocab, 8192):  # bounded float64 temporaries for big vocabs
            logits[:, r0:r0 + 8192] = h @ w_out[r0:r0 + 8192].T.astype(np.float64)
        state = KVState(k=new_k, v=new_v, pos=all_pos)
        return logits, state

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Prefill ``tokens`` at positions 0..T-1 and return logits [T, n_vocab]."""
        return self.forward(tokens)[0]

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """Greedy-decode ``n`` tokens after ``prompt`` (argmax, lowest id on ties)."""
        logits, state = self.forward(prompt)
        out = []
        for _ in range(n):
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            logits, state = self.forward([tok], past=state)
        return out
