"""Stochastic verification preserves the target's distribution (chi-square, 20k+ samples).

The verifier is a pure function of the logit rows, the draft, its probabilities and the RNG, so
the test computes the real SmolLM2 logits once for a fixed context (the target's rows for every
first token that can occur, and a draft distribution from the same model on a shortened context,
which is close to the target's but not equal) and then runs two-position verification many times
with fresh random drafts. The first two emitted tokens (t1, t2) must follow the target's own
distribution p0(t1) * p1(t2 | t1) under the user's sampler chain (temperature, top-k, top-p):

- draft-model style: d1 ~ q0, d2 ~ q1(. | d1), rejection sampling with q;
- n-gram style: a fixed draft, no q: sample the target and stop at the first mismatch.

When verification returns a single (recovered) token, the second one is what the next round
produces, i.e. a draw from the target's row after t1.

To keep 20k+ verifications fast the rows are restricted to the union of every row's 64 most
likely tokens: with top_k=20 the sampler keeps exactly the same tokens with the same
probabilities on that slice as on the full vocabulary.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pyfast.context import Context
from pyfast.sampling import Sampler, SamplingParams
from pyfast.spec.verify import verify

N_SAMPLES = 20000
TOP = 64
PROMPT = "My favourite thing to do on a rainy Sunday afternoon is"


def chi2_sf_series(x: float, k: int) -> float:
    """Chi-square survival function, 1 - P(k/2, x/2), from the series of the lower incomplete gamma."""
    a, z = k / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while abs(term) > 1e-15 * abs(total) and n < 100000:
        term *= z / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def chi2_sf(x: float, k: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return chi2_sf_series(x, k)
    return float(chi2.sf(x, k))


def chi2_goodness(counts: dict, expected: dict, n: int, min_bins: int) -> None:
    """Pearson's chi-square of observed outcome counts against n * probabilities: outcomes with an
    expected count of at least 5 are bins of their own, the rest are pooled into one bin (dropped
    if its expected count is under 5). Asserts no outcome outside `expected` occurred, at least
    min_bins bins, and p > 0.001."""
    assert set(counts) <= set(expected), "a token outside the target's kept set was emitted"
    big = [c for c, e in expected.items() if e >= 5.0]
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [expected[c] for c in big] + [n - sum(expected[c] for c in big)]
    if exp[-1] < 5.0:
        obs, exp = obs[:-1], exp[:-1]
    assert len(obs) >= min_bins
    x = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    p = chi2_sf(x, len(obs) - 1)
    assert p > 0.001, f"chi-square {x:.1f} on {len(obs) - 1} dof: p = {p:.2e}"


def test_chi2_sf_series_matches_known_values():
    assert chi2_sf_series(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf_series(18.307, 10) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf_series(149.449, 100) == pytest.approx(0.001, abs=2e-4)


@pytest.fixture(scope="module")
def rows(smollm2_model, base_llm):
    """Target rows p0, p1[t] and draft rows q0, q1[t] (full-vocabulary float32 logits)."""
    ctx = Context(smollm2_model, n_ctx=256, n_threads=2)
    toks = base_llm.tokenize(PROMPT)
    short = toks[3:]  # the draft sees less context: a different, overlapping distribution

    def after(prefix: list[int], firsts) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        ctx.clear()
        r0 = ctx.decode(prefix, seq_ids=0)[-1]
        out = {}
        for t in firsts:
            ctx.truncate(0, len(prefix))
            out[int(t)] = ctx.decode([int(t)], positions=[len(prefix)], seq_ids=0)[-1]
        return r0, out

    p0, _ = after(toks, [])
    q0, _ = after(short, [])
    firsts = np.union1d(np.argsort(-p0)[:24], np.argsort(-q0)[:24])
    _, p1 = after(toks, firsts)
    _, q1 = after(short, firsts)
    return p0, p1, q0, q1


def sliced(rows):
    """Restrict every row to the union of their top-64 ids; returns (ids, p0, p1, q0, q1)."""
    p0, p1, q0, q1 = rows
    allrows = [p0, q0, *p1.values(), *q1.values()]
    ids = np.unique(np.concatenate([np.argsort(-r)[:TOP] for r in allrows]))
    pos = {int(t): i for i, t in enumerate(ids)}
    def s(r):
        return np.ascontiguousarray(r[ids])

    return (ids, pos, s(p0), {pos[t]: s(r) for t, r in p1.items() if t in pos},
            s(q0), {pos[t]: s(r) for t, r in q1.items() if t in pos})


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("style", ["draft-model", "ngram"])
def test_two_token_distribution_matches_target(rows, temperature, style):
    ids, _, p0, p1, q0, q1 = sliced(rows)
    V = ids.size
    params = SamplingParams(temperature=temperature, top_k=20, top_p=0.9, min_p=0.0, seed=11)
    target = Sampler(params, V)
    draft_s = Sampler(SamplingParams(temperature=temperature, top_k=20, top_p=0.9, min_p=0.0), V)
    rng = np.random.default_rng(1234 + int(temperature * 10))

    # exact target distribution of (t1, t2) and the draft's q
    P0 = target.probs(p0)
    assert set(np.flatnonzero(P0)) <= set(p1), "a possible first token lacks its target row"
    P1 = {t: target.probs(r) for t, r in p1.items()}
    Q0 = draft_s.probs(q0)
    Q1 = {t: draft_s.probs(r) for t, r in q1.items()}
    assert 0.05 < np.minimum(P0, Q0).sum() < 0.97, "draft should overlap the target, not equal it"

    hist = np.zeros(1, dtype=np.int64)
    fixed = np.array([int(np.argsort(-P0)[1]), 0])  # n-gram style: the 2nd most likely token, then
    fixed[1] = int(np.argmax(P1[int(fixed[0])]))      # the target's favourite after it
    counts: dict[tuple[int, int], int] = {}
    for _ in range(N_SAMPLES):
        if style == "draft-model":
            d1 = int(rng.choice(V, p=Q0))
            d2 = int(rng.choice(V, p=Q1[d1]))
            draft, q = np.array([d1, d2]), np.stack([Q0, Q1[d1]])
        else:
            draft, q = fixed, None
        lrows = np.stack([p0, p1[int(draft[0])], p0])  # row 2 (the bonus) is never looked at
        res = verify(lrows, draft, target, hist, q)
        t1 = res.tokens[0]
        if len(res.tokens) >= 2:
            t2 = res.tokens[1]
        else:  # the next round: row 0 is the target's row after t1
            t2 = verify(p1[t1][None, :], np.zeros(0, dtype=np.int64), target, hist).tokens[0]
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1

    expected = {(a, b): N_SAMPLES * P0[a] * P1[a][b] for a in np.flatnonzero(P0) for b in np.flatnonzero(P1[a])}
    chi2_goodness(counts, expected, N_SAMPLES, 20)
    # and the first token alone
    first = np.zeros(V)
    for (a, _), c in counts.items():
        first[a] += c
    sup = np.flatnonzero(P0 * N_SAMPLES >= 5.0)
    x1 = float((((first[sup] - N_SAMPLES * P0[sup]) ** 2) / (N_SAMPLES * P0[sup])).sum())
    assert chi2_sf(x1, sup.size) > 0.001



def test_draft_mtp_two_token_distribution_matches_target():
    """draft-mtp's sampled drafts (d1 ~ q0, d2 ~ q1(. | d1), drawn by the proposer itself with the
    tiny Qwen3.5 fixture's MTP block), verified by rejection sampling with the q it supplies: the
    first two emitted tokens follow the target's p0(t1) * p1(t2 | t1)."""
    from pyfast.models import Model
    from pyfast.spec.base import DecodeBatch, DraftRequest
    from pyfast.spec.mtp import MTPProposer
    from tests.models.test_hybrid_common import fixture

    n = 12000
    path, ref = fixture("qwen35")
    model = Model(path)
    V = model.n_vocab
    toks = ref["tokens_1"][:8].astype(np.int32)  # a context where the random MTP overlaps the target
    ctx = Context(model, n_ctx=64, n_threads=2, export_hidden=True)
    prop = MTPProposer(model, n_ctx=64, n_threads=2)
    prop.bind_target(ctx)
    ctx.decode(toks[:-1], seq_ids=0, logits="none")
    prop.process(DecodeBatch("prompt", np.zeros(7, np.int32), toks[:-1], np.arange(7, dtype=np.int32)))

    params = SamplingParams(temperature=1.5, top_k=30, top_p=1.0, min_p=0.0, seed=5)
    target = Sampler(params, V)
    plain = Context(model, n_ctx=64, n_threads=2)

    def row(seq):
        plain.clear()
        return plain.decode(np.asarray(seq, dtype=np.int32), seq_ids=0)[-1]

    p0 = row(toks)
    P0 = target.probs(p0)
    p1 = {int(t): row(list(toks) + [int(t)]) for t in np.flatnonzero(P0)}
    P1 = {t: target.probs(r) for t, r in p1.items()}
    req = DraftRequest(0, toks, 2, 1, 0.0, Sampler(params, V))
    hist = np.zeros(1, dtype=np.int64)
    counts: dict[tuple[int, int], int] = {}
    drawn: dict[tuple[int, int], int] = {}   # the drafts themselves
    q1: dict[int, np.ndarray] = {}
    q0 = None
    for _ in range(n):
        d = prop.draft([req])[0]
        assert d is not None and len(d) == 2 and d.probs is not None
        if q0 is None:
            q0 = d.probs[0].copy()
            overlap = float(np.minimum(P0, q0).sum())
            assert 0.05 < overlap < 0.97, f"the MTP's q should overlap the target's p, not equal it ({overlap:.2f})"
        assert np.array_equal(d.probs[0], q0)          # step 0 sees the same state every time
        d1 = int(d.tokens[0])
        q1.setdefault(d1, d.probs[1].copy())
        drawn[(d1, int(d.tokens[1]))] = drawn.get((d1, int(d.tokens[1])), 0) + 1
        # row 1 is only read when d1 is accepted, i.e. when the target can emit d1 (p0(d1) > 0)
        res = verify(np.stack([p0, p1.get(d1, p0), p0]), d.tokens, target, hist, d.probs)
        t1 = res.tokens[0]
        t2 = res.tokens[1] if len(res.tokens) >= 2 else target.sample(p1[t1], hist)
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1

    # the drafts follow the q the proposer reports: q0(d1) * q1(d2 | d1)
    dexp = {(a, b): n * q0[a] * q1[a][b] for a in q1 for b in np.flatnonzero(q1[a])}
    assert set(drawn) <= set(dexp)
    keys = [c for c, e in dexp.items() if e >= 5.0]
    obs = [drawn.get(c, 0) for c in keys] + [n - sum(drawn.get(c, 0) for c in keys)]
    exp = [dexp[c] for c in keys] + [n - sum(dexp[c] for c in keys)]
    if exp[-1] < 5.0:
        obs, exp = obs[:-1], exp[:-1]
    x = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert chi2_sf(x, len(obs) - 1) > 0.001, f"drafts do not follow their q: chi-square {x:.1f}"

    expected = {(a, b): n * P0[a] * P1[a][b] for a in np.flatnonzero(P0) for b in np.flatnonzero(P1[int(a)])}
    chi2_goodness(counts, expected, n, 20)


class _MixProposer:
    """A test drafter over the target model itself. style "probs" (draft-model style): each draft
    token is drawn from q = 0.6 p + 0.4 u, p being the target's own next-token distribution under
    the request's sampler chain and u uniform over the 12 likeliest tokens of the raw logits, and
    q goes with the draft (rejection sampling). style "fixed" (n-gram style): the second likeliest
    token under p, no probabilities (row-by-row sampling)."""

    name = "mix"

    def __init__(self, model, params: SamplingParams, style: str):
        self.ctx = Context(model, n_ctx=64, n_threads=1)
        self.sampler = Sampler(params, model.n_vocab)
        self.style = style
        self.rng = np.random.default_rng(77)
        self._rows: dict[tuple, np.ndarray] = {}

    def row(self, hist) -> np.ndarray:
        """The target's logits after ``hist`` (plain decoding, cached)."""
        key = tuple(int(t) for t in hist)
        r = self._rows.get(key)
        if r is None:
            self.ctx.clear()
            r = self._rows[key] = self.ctx.decode(np.asarray(key, dtype=np.int32), seq_ids=0)[-1].copy()
        return r

    def draft(self, requests):
        from pyfast.spec.base import Draft

        out = []
        for r in requests:
            hist, toks, qs = list(r.tokens), [], []
            for _ in range(r.n_max):
                row = self.row(hist)
                p = self.sampler.probs(row)
                if self.style == "probs":
                    u = np.zeros_like(p)
                    u[np.argsort(-row, kind="stable")[:12]] = 1.0 / 12
                    q = 0.6 * p + 0.4 * u
                    d = int(self.rng.choice(q.size, p=q))
                    qs.append(q)
                else:
                    d = int(np.argsort(-p, kind="stable")[1])
                toks.append(d)
                hist.append(d)
            out.append(Draft(np.asarray(toks, dtype=np.int32), np.stack(qs) if qs else None))
        return out


@pytest.mark.parametrize("style", ["probs", "fixed"])
def test_server_round_distribution_matches_target(style):
    """The server's scheduler (``Engine.step``: the shared round with prompt chunks, prefix reuse
    and checkpoints around it) samples the target's distribution when it verifies drafts: many
    seeded 4-token requests on the tiny Qwen3.5 fixture, each drafting 2 tokens in its first
    round; the first three emitted tokens (t1 plain, t2 and t3 from the round: accepted, recovered
    at either position, or bonus) must follow p0(t1) * p1(t2 | t1) * p2(t3 | t1, t2)."""
    from pyfast.models import Model
    from pyfast.server.engine import Engine, EngineConfig, GenParams, Job
    from pyfast.server.spec import SpecConfig as ServerSpec
    from tests.models.test_hybrid_common import fixture

    n = 6000
    path, ref = fixture("qwen35")
    model = Model(path)
    prompt = ref["tokens_1"][:8].astype(np.int32).tolist()
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    prop = _MixProposer(model, params, style)
    engine = Engine(EngineConfig(model=str(path), n_parallel=8, n_ctx=8 * 64, n_threads=1,
                                 spec=ServerSpec(n_max=2)), proposers=[prop])
    jobs = [Job(prompt, GenParams(max_tokens=4, sampling=dataclasses.replace(params, seed=i), ignore_eos=True))
            for i in range(n)]
    pending = list(jobs)
    while pending or engine.n_busy or engine.n_waiting:
        if pending and engine.n_waiting < 16:
            engine.submit(pending[:16])
            pending = pending[16:]
        engine.step()
    assert all(len(j.out) == 4 for j in jobs)
    drafted = sum(j.stats.n_drafted for j in jobs)
    accepted = sum(j.stats.n_accepted for j in jobs)
    assert n * 2 <= drafted and 0.1 * drafted < accepted < 0.9 * drafted  # both branches, often

    target = Sampler(params, model.n_vocab)
    P0 = target.probs(prop.row(prompt))
    expected: dict[tuple[int, int, int], float] = {}
    for a in np.flatnonzero(P0):
        P1 = target.probs(prop.row(prompt + [int(a)]))
        for b in np.flatnonzero(P1):
            P2 = target.probs(prop.row(prompt + [int(a), int(b)]))
            for c in np.flatnonzero(P2):
                expected[(int(a), int(b), int(c))] = n * P0[a] * P1[b] * P2[c]
    counts: dict[tuple[int, int, int], int] = {}
    for j in jobs:
        key = tuple(j.out[:3])
        counts[key] = counts.get(key, 0) + 1
    chi2_goodness(counts, expected, n, 50)
