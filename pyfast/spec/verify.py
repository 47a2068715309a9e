"""Lossless verification of a draft against the target's logits.

The verify batch ``[id_last, d1..dN]`` gives the target's logits at N+1 rows: row i is the
target's distribution for the token after ``d_i`` (row 0: after ``id_last``). Verification walks
the rows in order and returns the *accepted* draft tokens ``d1..dk`` followed by exactly one token
of the target's own:

- a *recovered* token, drawn at the first rejected position, or
- a *bonus* token, drawn from row N when all N draft tokens were accepted.

Three rules, each leaving the output distribution equal to plain decoding with the same sampler:

- greedy (temperature <= 0): accept while the target's argmax equals the draft token; the
  recovered / bonus token is the argmax. Exact, and with a batch-invariant engine
  token-identical to plain greedy decoding.
- stochastic with draft probabilities q (model drafters): accept d with probability
  ``min(1, p(d) / q(d))``; on rejection draw the recovered token from the normalized
  ``max(0, p - q)``. (Leviathan et al. / Chen et al. speculative sampling.)
- stochastic without q (n-gram drafts): draw the target's token at each row with the full sampler
  chain; accept while it equals the draft, else it is the recovered token.

``p`` is the exact distribution the user's sampler chain draws from (penalties, top-k, top-p,
min-p, temperature: ``Sampler.probs``), with the penalty history extended by the draft tokens
before each row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyfast.sampling import Sampler, SamplingParams

BONUS = "bonus"
RECOVERED = "recovered"


@dataclass
class VerifyResult:
    tokens: list[int]   # the accepted draft tokens, then one recovered or bonus token
    n_accepted: int     # k: how many draft tokens were accepted
    kind: str           # "bonus" (all accepted) or "recovered"


def has_penalties(p: SamplingParams) -> bool:
    """True when the logits are modified before sampling (penalties, a logit bias or a grammar
    constraint), so the greedy shortcut (argmax of the raw rows) does not apply."""
    return bool(p.logit_bias) or p.constraint is not None or (p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0))


def verify(rows: np.ndarray, draft: np.ndarray, sampler: Sampler, history: np.ndarray,
           draft_probs: np.ndarray | None = None, argmax: np.ndarray | None = None) -> VerifyResult:
    """Verify ``draft`` (N token ids) against the target's ``rows`` (float32 [N+1, n_vocab]).
    argmax: each row's first maximum when the caller has it (the plan computes it; greedy reads
    it instead of scanning the rows).

    history: the sequence before the verify batch, ending with id_last ([..., id_last]); the
    penalty history of row i is ``history + draft[:i]``. With draft_probs ([N, n_vocab], row i =
    the distribution draft[i] was drawn from) and a sampling (non-greedy) sampler, rejection
    sampling is used. Uses the sampler's RNG.
    """
    if len(draft) == 0:  # no draft: plain decoding, the sampled token is the bonus token
        if rows.shape[0] != 1:
            raise ValueError(f"verify: 0 draft tokens need 1 logit row, got {rows.shape[0]}")
        return VerifyResult([sampler.sample(rows[0], history, None if argmax is None else argmax[0])], 0, BONUS)
    draft = np.asarray(draft).reshape(-1)
    n = int(draft.size)
    if rows.shape[0] != n + 1:
        raise ValueError(f"verify: {n} draft tokens need {n + 1} logit rows, got {rows.shape[0]}")
    params = sampler.params
    pen = has_penalties(params)
    if pen and n:
        ext = np.concatenate([np.asarray(history, dtype=np.int64).reshape(-1), draft.astype(np.int64)])
        n_hist = ext.size - n
    else:
        ext, n_hist = history, len(history)

    def hist(i: int):
        return ext[: n_hist + i] if pen else ext

    if params.greedy:
        if not pen:
            if argmax is not None:  # the plan's argmax of every row
                am = argmax[: n + 1].tolist()
                dl = draft.tolist()
                for i in range(n):
                    if am[i] != dl[i]:
                        return VerifyResult(dl[:i] + [am[i]], i, RECOVERED)
                return VerifyResult(dl + [am[n]], n, BONUS)
            for i in range(n):  # row by row: the rows after the first mismatch are never scanned
                t = int(rows[i].argmax())
                if t != draft[i]:
                    return VerifyResult(draft[:i].tolist() + [t], i, RECOVERED)
            return VerifyResult(draft.tolist() + [int(rows[n].argmax())], n, BONUS)
        return _verify_by_sampling(rows, draft, sampler, hist)
    if draft_probs is None or n == 0 or params.constraint is not None:
        # under a grammar the sampler's matcher advances with every token it returns, so the rows
        # are sampled in order (each token drawn is kept): the target's distribution, exactly
        return _verify_by_sampling(rows, draft, sampler, hist)

    q = np.asarray(draft_probs)
    if q.shape != (n, rows.shape[1]):
        raise ValueError(f"verify: draft probabilities must be [{n}, {rows.shape[1]}], got {list(q.shape)}")
    for i in range(n):
        p = sampler.probs(rows[i], hist(i))
        d = int(draft[i])
        pd, qd = float(p[d]), float(q[i, d])
        if qd <= 0.0:
            # d was not drawn from q (a broken drafter): verify this position by sampling instead
            t = sampler.sample_from_probs(p)
            if t == d:
                continue
            return VerifyResult(draft[:i].tolist() + [t], i, RECOVERED)
        if pd >= qd or sampler.uniform() * qd < pd:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p - q[i], 0.0)
        t = sampler.sample_from_probs(residual) if residual.sum() > 0.0 else sampler.sample_from_probs(p)
        return VerifyResult(draft[:i].tolist() + [t], i, RECOVERED)
    t = sampler.sample(rows[n], hist(n))
    return VerifyResult(draft.tolist() + [t], n, BONUS)


def _verify_by_sampling(rows: np.ndarray, draft: np.ndarray, sampler: Sampler, hist) -> VerifyResult:
    """Draw the target's token at each row; stop at the first one that differs from the draft."""
    n = int(draft.size)
    for i in range(n):
        t = sampler.sample(rows[i], hist(i))
        if t != int(draft[i]):
            return VerifyResult(draft[:i].tolist() + [t], i, RECOVERED)
    t = sampler.sample(rows[n], hist(n))
    return VerifyResult(draft.tolist() + [t], n, BONUS)
