"""Token sampling: the sampler chain that turns one row of logits into one token.

The chain follows llama.cpp's default order::

    logit bias -> penalties (repeat / frequency / presence over the last ``repeat_last_n`` tokens)
      -> top-k -> top-p -> min-p -> temperature -> draw

``temperature <= 0`` means greedy: the argmax of the penalized logits (lowest index on ties).
The filters see the logits *before* temperature scaling, as in llama.cpp, so temperature changes
the shape of the kept distribution but not which tokens are kept.

Logit bias and penalties are numpy on one row of ``n_vocab`` float32 logits. With top-k on (the
default), the rest of the chain and the draw are one native call (``native.sample_row``, a few
microseconds for a 49k vocabulary); without top-k it runs in numpy over the whole vocabulary.

``Sampler.probs`` returns the exact distribution ``Sampler.sample`` draws from (full vocabulary,
zeros outside the kept set); the speculative verifier uses it for rejection sampling, together
with ``Sampler.sample_from_probs`` to draw from a residual distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["SamplingParams", "Sampler"]


_NATIVE = None


def _native():
    """The native module, imported on first use (sampling itself needs it only for top-k)."""
    global _NATIVE
    if _NATIVE is None:
        from pyfast._loader import native

        _NATIVE = native
    return _NATIVE


@dataclass
class SamplingParams:
    """Sampling settings (llama.cpp-like defaults).

    temperature:       <= 0 means greedy (argmax). Must not be negative.
    top_k:             keep the k most likely tokens; 0 disables.
    top_p:             nucleus: keep the smallest most-likely prefix whose mass reaches top_p;
                       1.0 disables. Must be in (0, 1].
    min_p:             keep tokens with p >= min_p * p_max; 0 disables. Must be in [0, 1].
    repeat_penalty:    divide positive (multiply non-positive) logits of recently seen tokens;
                       1.0 disables. Must be > 0.
    repeat_last_n:     window of recent tokens the penalties look at; 0 disables, -1 = all.
    frequency_penalty: subtract ``count * frequency_penalty`` from a seen token's logit.
    presence_penalty:  subtract ``presence_penalty`` once from a seen token's logit.
    seed:              RNG seed (None = fresh entropy each Sampler).
    logit_bias:        token id -> value added to its logit before anything else (OpenAI's
                       ``logit_bias``; -inf bans a token). None or {} disables.
    constraint:        a compiled grammar (:func:`pyfast.constrain.compile_constraint`): each
                       Sampler follows it with its own matcher, masking the tokens it cannot
                       take next before the rest of the chain. None disables.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    constraint: object | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature <= 0)."""
        return self.temperature <= 0.0

    def validate(self) -> "SamplingParams":
        """Check every field; raise ValueError naming the first bad one. Returns self."""

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"SamplingParams.{name} must be a number, got {v!r}")
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be finite, got {v!r}")
            return v

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
            return int(v)

        if num("temperature") < 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if integer("top_k") < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k!r}")
        top_p = num("top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        min_p = num("min_p")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        if num("repeat_penalty") <= 0.0:
            raise ValueError(
                f"SamplingParams.repeat_penalty must be > 0 (1.0 disables), "
                f"got {self.repeat_penalty!r}"
            )
        if integer("repeat_last_n") < -1:
            raise ValueError(
                f"SamplingParams.repeat_last_n must be >= -1 (-1 = all, 0 disables), "
                f"got {self.repeat_last_n!r}"
            )
        num("frequency_penalty")
        num("presence_penalty")
        if self.seed is not None and (integer("seed") < 0):
            raise ValueError(f"SamplingParams.seed must be None or >= 0, got {self.seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                    raise ValueError(f"SamplingParams.logit_bias: token ids must be integers >= 0, got {t!r}")
                if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) or math.isnan(b) \
                        or b == math.inf:
                    raise ValueError(f"SamplingParams.logit_bias[{t}] must be a finite number or -inf, got {b!r}")
        if self.constraint is not None and not callable(getattr(self.constraint, "matcher", None)):
            raise ValueError("SamplingParams.constraint must be a compiled grammar "
                             f"(pyfast.constrain.compile_constraint), got {type(self.constraint).__name__}")
        return self


class Sampler:
    """Samples token ids from logits with a fixed :class:`SamplingParams` and its own RNG.

    The RNG is ``np.random.Generator(np.random.PCG64(seed))``: the same seed and the same
    sequence of calls give the same tokens.
    """

    def __init__(self, params: SamplingParams, n_vocab: int):
        params.validate()
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, (int, np.integer)) or n_vocab <= 0:
            raise ValueError(f"Sampler: n_vocab must be a positive integer, got {n_vocab!r}")
        self.params = params
        self.n_vocab = int(n_vocab)
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self._ubuf: list[float] = []
        self._ui = 0
        self._bias_ids = self._bias_vals = None
        # the constraint stage: this sequence's matcher (masks logits, advanced by every sampled token)
        self.matcher = params.constraint.matcher() if params.constraint is not None else None
        plain = not params.logit_bias and not self._penalties_active() and self.matcher is None
        self._plain_greedy = params.greedy and plain
        # the per-token fast path: the native chain on the raw logits
        self._plain_topk = not params.greedy and plain and 0 < params.top_k < self.n_vocab
        if params.logit_bias:
            ids = np.fromiter((int(t) for t in params.logit_bias), dtype=np.int64)
            if ids.max() >= self.n_vocab:
                raise ValueError(f"SamplingParams.logit_bias: token id {int(ids.max())} is outside the "
                                 f"vocabulary [0, {self.n_vocab})")
            self._bias_ids = ids
            self._bias_vals = np.array([float(b) for b in params.logit_bias.values()], dtype=np.float32)

    def reseed(self, seed: int | None) -> None:
        """Restart the RNG from ``seed`` (None = fresh entropy)."""
        if seed is not None and int(seed) < 0:
            raise ValueError(f"Sampler.reseed: seed must be None or >= 0, got {seed!r}")
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._ubuf, self._ui = [], 0

    def uniform(self) -> float:
        """The next uniform draw in [0, 1) of this sampler's stream. Every draw the sampler (and
        the speculative verifier) makes goes through here; values come from ``rng.random`` in
        blocks of 64, which yields the same sequence as one ``rng.random()`` per draw."""
        i = self._ui
        if i >= len(self._ubuf):
            self._ubuf, i = self.rng.random(64).tolist(), 0
        self._ui = i + 1
        return self._ubuf[i]

    # -- chain pieces -------------------------------------------------------------------------

    def _check_logits(self, logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits)
        if x.shape != (self.n_vocab,):
            raise ValueError(f"Sampler: logits must have shape ({self.n_vocab},), got {x.shape}")
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        return x

    def _penalties_active(self) -> bool:
        p = self.params
        return p.repeat_last_n != 0 and (
            p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        )

    def apply_penalties(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """Return the logits after the repeat / frequency / presence penalties (float32).

        ``logit_bias`` is added first. Over the last ``repeat_last_n`` tokens of ``history``
        (all when -1), a token seen ``c > 0`` times gets: ``l = l * rp if l <= 0 else l / rp``, then
        ``l -= c * frequency_penalty + presence_penalty``. Returns the input itself (not a copy)
        when no bias or penalty applies.
        """
        x = self._check_logits(logits)
        if self.matcher is not None:  # the constraint stage (returns a copy)
            x = self.matcher.apply(x)
        if self._bias_ids is not None:
            x = x.copy()
            x[self._bias_ids] += self._bias_vals
        if not self._penalties_active() or len(history) == 0:
            return x
        p = self.params
        if not isinstance(history, (list, tuple, np.ndarray)):
            history = list(history)  # e.g. a deque; slice before converting the window
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
        toks = np.asarray(window, dtype=np.int64)
        if toks.size == 0:
            return x
        toks, counts = np.unique(toks, return_counts=True)
        if toks[0] < 0 or toks[-1] >= self.n_vocab:
            raise ValueError(f"Sampler: history holds a token id outside [0, {self.n_vocab})")
        x = x.copy()
        v = x[toks].astype(np.float32)
        if p.repeat_penalty != 1.0:
            rp = np.float32(p.repeat_penalty)
            v = np.where(v <= 0, v * rp, v / rp)
        v = v - (counts.astype(np.float32) * np.float32(p.frequency_penalty)
                 + np.float32(p.presence_penalty))
        x[toks] = v
        return x

    def _candidates(self, logits: np.ndarray, history: Sequence[int]):
        """Run the chain up to (and including) temperature.

        Returns ``(ids, probs)``: kept token ids and their float64 probabilities (sum 1), in an
        order that depends only on the inputs. Greedy returns a single id with probability 1.
        """
        x = self.apply_penalties(logits, history)
        p = self.params
        n = self.n_vocab

        if p.greedy:
            i = int(np.argmax(x))  # first occurrence on ties
            if not np.isfinite(x[i]) and not (np.isinf(x[i]) and x[i] > 0):
                raise ValueError("Sampler: logits have no finite maximum (all -inf or NaN)")
            return np.array([i], dtype=np.int64), np.ones(1, dtype=np.float64)

        k = p.top_k
        if 0 < k < n:
            # the usual case, in native code (native/cpu/sample_row.cpp follows the steps below)
            ids, pr = _native().sample_candidates(x, k, p.top_p, p.min_p, p.temperature)
            return ids.astype(np.int64), pr

        # top-k disabled: the same chain over the whole vocabulary, in id order
        vals = x.astype(np.float64)

        m = vals.max()
        if not np.isfinite(m):
            raise ValueError("Sampler: logits have no finite maximum (all -inf, +inf or NaN)")

        # min-p and top-p both keep a most-likely prefix of the same order, so their
        # composition is the intersection of the two prefixes. Apply min-p first (cheap, O(n)) so
        # only its survivors are sorted; top-p still normalizes over the full pre-filter set,
        # exactly as when it runs first.
        if p.min_p > 0.0:
            ids = np.flatnonzero(vals >= m + math.log(p.min_p)).astype(np.int64, copy=False)
            vals_kept = vals[ids]
        else:
            ids = np.arange(n, dtype=np.int64)
            vals_kept = vals

        if p.top_p < 1.0:
            z = np.exp(vals - m).sum()
            ids, vals_kept = _top_p(ids, vals_kept, m, z, p.top_p)

        # temperature, then softmax over the kept set
        e = np.exp((vals_kept - m) / p.temperature)
        return ids, e / e.sum()

    # -- public API ---------------------------------------------------------------------------

    def probs(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution ``sample`` draws from: float64 [n_vocab], zero outside the kept set."""
        ids, pr = self._candidates(logits, history)
        out = np.zeros(self.n_vocab, dtype=np.float64)
        out[ids] = pr
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), argmax: int | None = None) -> int:
        """Sample one token id from ``logits`` (float32 [n_vocab]) given the token ``history``.
        argmax: the row's first maximum when the caller has it (the plan computes it).
        With a constraint, the token is also consumed by this sampler's matcher: every token
        sample returns must be part of the sequence (the speculative verifier samples row by
        row and keeps every token it draws)."""
        if self.matcher is not None:
            t = self._sample(logits, history, None)
            self.matcher.consume(t)
            return t
        return self._sample(logits, history, argmax)

    def _sample(self, logits: np.ndarray, history: Sequence[int], argmax: int | None) -> int:
        if self._plain_greedy and type(logits) is np.ndarray and logits.dtype == np.float32 \
                and logits.shape == (self.n_vocab,):
            # the per-token fast path: nothing modifies the logits
            i = int(logits.argmax()) if argmax is None else int(argmax)
            if np.isfinite(logits[i]):
                return i
        p = self.params
        if not p.greedy and 0 < p.top_k < self.n_vocab:
            x = logits if self._plain_topk and type(logits) is np.ndarray and logits.dtype == np.float32 \
                and logits.shape == (self.n_vocab,) else self.apply_penalties(logits, history)
            return _native().sample_row(x, p.top_k, p.top_p, p.min_p, p.temperature, self.uniform())
        ids, pr = self._candidates(logits, history)
        if ids.size == 1:
            return int(ids[0])
        return int(ids[self._draw(pr)])

    def sample_from_probs(self, probs: np.ndarray) -> int:
        """Draw one token id from a (not necessarily normalized) non-negative [n_vocab] vector."""
        q = np.asarray(probs, dtype=np.float64)
        if q.shape != (self.n_vocab,):
            raise ValueError(f"Sampler: probs must have shape ({self.n_vocab},), got {q.shape}")
        ids = np.flatnonzero(q > 0)
        if ids.size == 0 or not np.all(np.isfinite(q[ids])) or np.any(q < 0):
            raise ValueError("Sampler: probs must be finite, non-negative and not all zero")
        return int(ids[self._draw(q[ids])])

    def _draw(self, weights: np.ndarray) -> int:
        c = np.cumsum(weights)
        # side="right" never lands on a zero-weight entry
        i = int(np.searchsorted(c, self.uniform() * c[-1], side="right"))
        return min(i, c.size - 1)


def _top_p(ids: np.ndarray, vals: np.ndarray, m: float, z: float, top_p: float):
    """Keep the smallest most-likely prefix of (ids, vals) whose mass (``exp(v - m) / z``)
    reaches ``top_p``; order by value descending, lowest id first on ties.

    ``z`` normalizes over the set top-p saw *before* any earlier-applied min-p cut, so this gives
    the same prefix as running top-p first. To avoid sorting a whole vocabulary, look at the top
    64, 256, ... values first and sort only once they hold enough mass.
    """
    size = ids.size
    sel = None
    m_try = 64
    while m_try < size:
        part = np.argpartition(vals, size - m_try)[size - m_try:]
        # include every tie of the smallest picked value so the prefix is exact
        cand = np.flatnonzero(vals >= vals[part].min())
        if np.exp(vals[cand] - m).sum() / z >= top_p:
            sel = cand
            break
        m_try *= 4
    if sel is not None:
        ids, vals = ids[sel], vals[sel]
    order = np.lexsort((ids, -vals))
    ids, vals = ids[order], vals[order]
    cum = np.cumsum(np.exp(vals - m)) / z
    cut = int(np.searchsorted(cum, top_p, side="left")) + 1
    if cut < ids.size:
        ids, vals = ids[:cut], vals[:cut]
    return ids, vals
