"""draft-mtp: drafting with the target's own MTP (nextn) block (``pyfast/spec/mtp.py``,
``algorithms.md`` §1) on the tiny hybrid fixtures (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; one MTP block
each, random weights, so acceptance is low: these tests check exactness and the carry plumbing).

- greedy output with draft-mtp (alone and with ngram-simple, in both orders) equals plain decoding,
  for one and three sequences, draft_max 2 and 3 (T1.1), with statistics reported;
- the MTP logits through the proposer's own plans match the transformers reference (npz);
- T1.3: catch-up over a prompt split into several batches gives the same MTP logits as one batch;
- T1.4: after a partial accept the next step-0 hidden input is the trunk's hidden at the position
  before the new id_last, computed without speculation (also through the restore + replay
  fallback and with three sequences), and the MTP KV matches a non-speculative catch-up;
- sampling runs with draft probabilities; p_min stops greedy drafts; errors come before decoding.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyfast._loader import native
from pyfast.context import Context
from pyfast.llm import LLM
from pyfast.spec import SpecConfig
from pyfast.spec.base import DecodeBatch, Draft, DraftRequest, Proposer
from tests.models.test_hybrid_common import NAMES, _count_fallbacks, fixture, rel_err

N_GEN = 20
TOL = 1e-3        # vs the float64 transformers reference
TOL_SELF = 1e-5   # our own runs compared with each other


def _prompts(ref) -> list[list[int]]:
    V = int(ref["logits_0"].shape[1])
    rng = np.random.default_rng(3)
    rep = ref["tokens_0"][:5].tolist()
    return [rng.integers(0, V, 30).tolist(), rep * 3 + rep[:2], ref["tokens_1"][:6].tolist()]


_PLAIN: dict[str, list[list[int]]] = {}


def _plain(name):
    path, ref = fixture(name)
    if name not in _PLAIN:
        llm = LLM(path, n_ctx=512, n_threads=2)
        _PLAIN[name] = [llm.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True).tokens
                        for p in _prompts(ref)]
    return path, ref, _PLAIN[name]


def _mtp(llm):
    from pyfast.spec.mtp import MTPProposer

    return next(p for p in llm._spec.proposers if isinstance(p, MTPProposer))


def _check_stats(st):
    assert st.accepted <= st.drafted
    assert all(a >= b for a, b in zip(st.pos_accepted, st.pos_accepted[1:]))
    assert st.recovered + st.bonus == st.draft_rounds
    assert sum(v.drafted for v in st.by_proposer.values()) == st.drafted
    assert all(v.accepted <= v.drafted for v in st.by_proposer.values())


# --- T1.1: greedy speculation equals plain decoding ------------------------------------------------
@pytest.mark.parametrize("types", ["draft-mtp", "draft-mtp,ngram-simple", "ngram-simple,draft-mtp"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_identical(name, types):
    path, ref, want = _plain(name)
    prompts = _prompts(ref)
    for dm in (2, 3):
        llm = LLM(path, n_ctx=512, n_threads=2,
                  speculative=SpecConfig(types=types, draft_max=dm, ngram_n=1))
        assert llm.ctx.export_hidden and llm.ctx.n_rollback == dm
        mtp = _mtp(llm)
        for p, w in zip(prompts, want):
            res = llm.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True)
            assert res.tokens == w, f"{name} {types} draft_max={dm}: differs from plain decoding"
            assert res.spec is not None and res.spec.drafted > 0
            _check_stats(res.spec)
        builds = mtp.n_plan_builds
        got = llm.generate_batch(prompts, max_tokens=N_GEN, temperature=0, ignore_eos=True)
        assert [r.tokens for r in got] == want
        st = llm.spec_stats
        _check_stats(st)
        assert st.by_proposer["draft-mtp"].drafted > 0
        if types.startswith("ngram"):  # the MTP also lost rounds and still kept its carry
            assert st.by_proposer.get("ngram-simple") and st.by_proposer["ngram-simple"].drafted > 0
        assert mtp.n_lost == 0, "a catch-up found no carry for its first position"
        # the same requests again build no new graph: plans are cached per batch shape
        for p in prompts:
            llm.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True)
        n1 = mtp.n_plan_builds
        for p in prompts:
            llm.generate(p, max_tokens=N_GEN, temperature=0, ignore_eos=True)
        assert mtp.n_plan_builds == n1 and n1 - builds < 40


def test_llm_without_mtp_exports_no_hidden():
    path, _ = fixture("qwen35")
    assert not LLM(path, n_ctx=256, n_threads=2).ctx.export_hidden
    llm = LLM(path, n_ctx=256, n_threads=2, speculative=SpecConfig(types="ngram-simple"))
    assert not llm.ctx.export_hidden


# --- the MTP block through the proposer's plans vs the reference -----------------------------------
def _setup(name, n_ctx=128, n_rollback=0, **kw):
    """A target Context with hidden export (F32 KV) and a bound MTPProposer (F32 KV)."""
    from pyfast.models import Model
    from pyfast.spec.mtp import MTPProposer

    path, ref = fixture(name)
    model = Model(path)
    ctx = Context(model, n_ctx=n_ctx, n_threads=2, kv_dtype=native.DType.F32, export_hidden=True,
                  n_rollback=n_rollback, n_seq_max=4)
    prop = MTPProposer(model, n_ctx=n_ctx, n_threads=2, kv_dtype=native.DType.F32, **kw)
    prop.bind_target(ctx)
    return model, ref, ctx, prop


def _greedy_req(seq, toks, n=1, p_min=0.0):
    return DraftRequest(seq, np.asarray(toks, dtype=np.int32), n, 1, p_min, None)


def _prompt_batch(ctx, prop, seq, toks, p0):
    toks = np.asarray(toks, dtype=np.int32)
    pos = np.arange(p0, p0 + toks.size, dtype=np.int32)
    seqs = np.full(toks.size, seq, dtype=np.int32)
    ctx.decode(toks, positions=pos, seq_ids=seqs, logits="none")
    prop.process(DecodeBatch("prompt", seqs, toks, pos))


@pytest.mark.parametrize("name", NAMES)
def test_mtp_logits_match_reference(name):
    """Row p of the reference pairs (tokens[p], h_{p-1}): the proposer's step 0 with id_last =
    tokens[p] after the target decoded tokens[:p] one at a time (catch-up after each)."""
    model, ref, ctx, prop = _setup(name)
    prop.trace = []
    for s in (0, 1):
        toks = ref[f"tokens_{s}"]
        seq = 4 + s
        lg, hid = [], []
        for p in range(toks.size):
            prop.trace.clear()
            d = prop.draft([_greedy_req(seq, toks[: p + 1])])
            assert d[0] is not None and len(d[0]) == 1
            tr = prop.trace[0]
            assert tr["pos"].tolist() == [p] and tr["tokens"].tolist() == [int(toks[p])]
            lg.append(tr["logits"][0])
            hid.append(tr["hidden"][0])
            _prompt_batch(ctx, prop, seq, toks[p: p + 1], p)
        assert rel_err(np.stack(lg), ref[f"mtp_logits_{s}"]) < TOL
        assert rel_err(np.stack(hid), ref[f"mtp_hidden_{s}"]) < TOL
    assert prop.n_lost == 0


# --- T1.3: split catch-up ------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_split_catchup_matches_single_batch(name):
    """A prompt caught up in one batch, and in several batches (and MTP micro-batches of 3 rows),
    gives the same MTP logits for the next position; both match the reference."""
    _, ref, ctx, one = _setup(name)
    _, _, ctx2, split = _setup(name, n_ubatch=3)
    toks = ref["tokens_0"]
    n = toks.size - 1
    _prompt_batch(ctx, one, 0, toks[:n], 0)
    i = 0
    for m in (5, 1, 4, n - 10):
        _prompt_batch(ctx2, split, 0, toks[i: i + m], i)
        i += m
    assert i == n
    out = []
    for prop in (one, split):
        prop.trace = []
        prop.draft([_greedy_req(0, toks)])
        out.append(prop.trace[0]["logits"][0])
    assert rel_err(out[1][None], out[0][None]) < TOL_SELF
    assert rel_err(out[0][None], ref["mtp_logits_0"][n: n + 1]) < TOL


# --- T1.4: the carry after a partial accept -----------------------------------------------------------
class _Partial(Proposer):
    """Every other round drafts the target's known greedy continuation with one wrong token at a
    cycling position (partial accepts k = 0..n-1 and full ones); the other rounds draft nothing,
    so the MTP (next in the list) drafts."""

    name = "partial"
    default_n_max = 3

    def __init__(self, truth, n, n_vocab):
        self.truth, self.n, self.n_vocab, self.round = truth, n, n_vocab, 0

    def draft(self, requests):
        self.round += 1
        out = []
        for r in requests:
            L = r.tokens.size
            cont = list(self.truth[r.seq][L: L + min(self.n, r.n_max)])
            if self.round % 2 == 0 or not cont:
                out.append(None)
                continue
            j = (self.round // 2 + r.seq) % (self.n + 1)
            if j < len(cont):
                cont[j] = (cont[j] + 1) % self.n_vocab
            out.append(Draft(np.asarray(cont, dtype=np.int32)))
        return out


def _run(ctx, proposers, prompts, n_gen):
    from pyfast.sampling import Sampler, SamplingParams
    from pyfast.spec.decoder import SpecDecoder

    dec = SpecDecoder(ctx, proposers, SpecConfig(types=list(proposers), draft_max=3))
    slots = [dec.add(i, p, Sampler(SamplingParams(temperature=0.0), ctx.model.n_vocab))
             for i, p in enumerate(prompts)]
    first = dec.prefill(slots)
    out = [[dec.start(s, lg)] for s, lg in zip(slots, first)]
    while any(len(o) < n_gen for o in out):
        act = [i for i in range(len(slots)) if len(out[i]) < n_gen]
        for i in act:
            slots[i].n_remaining = n_gen - len(out[i])
        for i, new in zip(act, dec.step([slots[i] for i in act])):
            out[i] += new
    return [o[:n_gen] for o in out], dec


@pytest.mark.parametrize("n_rollback", [3, 1])
@pytest.mark.parametrize("name", NAMES)
def test_carry_after_partial_accept(name, n_rollback):
    """n_rollback 3: rollback by snapshot planes; 1: drafts of 2-3 tokens take the save / restore
    + replay path. Every MTP step-0 input hidden must equal the trunk's hidden at n_past - 1 of a
    plain (non-speculative) run, and its logits the MTP over the plain run's rows."""
    from pyfast.models import Model

    path, ref = fixture(name)
    model = Model(path)
    prompts = [ref["tokens_0"][:7].tolist(), ref["tokens_1"][:5].tolist(), ref["tokens_0"][3:6].tolist()]
    n_gen = 24
    # plain greedy continuations and the trunk's hidden rows of the whole sequences
    plain_ctx = Context(model, n_ctx=256, n_threads=2, kv_dtype=native.DType.F32, export_hidden=True)
    truth, trunk = {}, {}
    for i, p in enumerate(prompts):
        plain_ctx.clear()
        toks = list(p)
        lg = plain_ctx.decode(toks, seq_ids=0)[-1]
        for _ in range(n_gen):
            toks.append(int(np.argmax(lg)))
            lg = plain_ctx.decode([toks[-1]], seq_ids=0)[-1]
        truth[i] = toks
        plain_ctx.clear()
        plain_ctx.decode(toks, seq_ids=0, logits="none")
        trunk[i] = plain_ctx.last_hidden.copy()
    for n_seq in (1, 3):
        _, _, ctx, mtp = _setup(name, n_ctx=256, n_rollback=n_rollback)
        fails = _count_fallbacks(ctx)
        mtp.trace = []
        partial = _Partial(truth, 3, model.n_vocab)
        got, dec = _run(ctx, [partial, mtp], prompts[:n_seq], n_gen)
        assert got == [truth[i][len(prompts[i]):] for i in range(n_seq)]
        by = dec.stats.by_proposer
        assert by["partial"].drafted > by["partial"].accepted > 0 and by["draft-mtp"].drafted > 0
        if n_rollback == 1:
            assert fails["fail"] > 0 and fails["restore"] == fails["fail"]
        step0 = [t for t in mtp.trace if t["step"] == 0]
        assert len(step0) >= 4
        for t in step0:
            for s, p, h in zip(t["seqs"].tolist(), t["pos"].tolist(), t["h"]):
                want = trunk[s][p - 1]
                assert np.abs(h - want).max() <= TOL_SELF * np.abs(want).max(), (s, p)
        # the MTP KV after rollbacks equals a non-speculative catch-up: same step-0 logits
        _, _, ctx_ref, mtp_ref = _setup(name, n_ctx=256)
        for s in range(n_seq):
            toks = np.asarray(truth[s], dtype=np.int32)
            h_in = np.concatenate([np.zeros((1, trunk[s].shape[1]), np.float32), trunk[s][:-1]])
            lg_ref, _ = mtp_ref.forward(toks, np.arange(toks.size), s, h_in)
            for t in step0:
                for i, (ss, p) in enumerate(zip(t["seqs"].tolist(), t["pos"].tolist())):
                    if ss == s:
                        assert rel_err(t["logits"][i][None], lg_ref[p][None]) < TOL_SELF, (s, p)
        assert mtp.n_lost == 0


def test_accept_before_or_after_process():
    """accept(k) may come before process() of the verify batch (SpecDecoder) or after it (the
    order of llama.cpp's server): the carry and the MTP KV end up the same."""
    _, ref, ctx_a, a = _setup("qwen35", n_rollback=3)
    _, _, ctx_b, b = _setup("qwen35", n_rollback=3)
    toks = ref["tokens_0"]
    for ctx, prop in ((ctx_a, a), (ctx_b, b)):
        _prompt_batch(ctx, prop, 0, toks[:6], 0)
        prop.draft([_greedy_req(0, toks[:7], n=3)])
        v = np.asarray(toks[6:10], dtype=np.int32)
        pos = np.arange(6, 10, dtype=np.int32)
        seqs = np.zeros(4, dtype=np.int32)
        ctx.decode(v, positions=pos, seq_ids=seqs, logits="all")
        ctx.truncate(0, 6 + 2)                       # k = 1: keep id_last and d1
        if prop is a:
            prop.accept(0, 1)
            prop.process(DecodeBatch("verify", seqs, v, pos, None))
        else:
            prop.process(DecodeBatch("verify", seqs, v, pos, None))
            prop.accept(0, 1)
        assert prop.kv.seq_len(0) == 8
    assert np.array_equal(a.carry_in(0, 8), b.carry_in(0, 8))
    assert np.array_equal(a.carry_in(0, 8), ctx_b.last_hidden[1])
    out = []
    for prop in (a, b):
        prop.trace = []
        prop.draft([_greedy_req(0, toks[:9], n=2)])
        out.append(np.stack([t["logits"][0] for t in prop.trace]))
    assert np.array_equal(out[0], out[1])


def test_prefix_reuse_keeps_the_carry():
    """A follow-up request that extends the previous conversation reuses the cached prefix: the
    MTP resumes from its rows (no lost carry) and output still equals plain decoding."""
    path, ref = fixture("qwen35")
    plain = LLM(path, n_ctx=512, n_threads=2)
    llm = LLM(path, n_ctx=512, n_threads=2, speculative=SpecConfig(types="draft-mtp", draft_max=3))
    p = ref["tokens_0"].tolist()
    r1 = llm.generate(p, max_tokens=8, temperature=0, ignore_eos=True)
    p2 = p + r1.tokens + ref["tokens_1"][:3].tolist()
    r2 = llm.generate(p2, max_tokens=8, temperature=0, ignore_eos=True)
    assert r2.timings.n_prompt_cached > len(p)
    assert r2.tokens == plain.generate(p2, max_tokens=8, temperature=0, ignore_eos=True).tokens
    mtp = _mtp(llm)
    assert mtp.n_lost == 0
    # a plain request in between (the proposers never see it), then a speculative one reusing its
    # prefix: the MTP notices that its rows belong to another history and drafts on (exactly)
    q = ref["tokens_1"].tolist()
    r3 = llm.generate(q, max_tokens=6, temperature=0, ignore_eos=True, speculative=False)
    q2 = q + r3.tokens + p[:4]
    r4 = llm.generate(q2, max_tokens=8, temperature=0, ignore_eos=True)
    assert r4.timings.n_prompt_cached > len(q)
    assert r4.tokens == plain.generate(q2, max_tokens=8, temperature=0, ignore_eos=True).tokens
    assert mtp.n_lost >= 1
    st = mtp._seqs[0]
    known = st.toks >= 0                      # positions decoded plainly are unknown to the MTP
    assert np.array_equal(st.toks[known], np.asarray(q2 + r4.tokens)[: st.n_mtp][known])


# --- sampling, p_min ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_sampled_speculation_runs(name):
    path, ref = fixture(name)
    V = int(ref["logits_0"].shape[1])
    llm = LLM(path, n_ctx=512, n_threads=2, speculative=SpecConfig(types="draft-mtp", draft_max=3))
    prompts = _prompts(ref)
    for seed in (1, 2):
        res = llm.generate(prompts[0], max_tokens=N_GEN, temperature=0.8, seed=seed, ignore_eos=True)
        assert len(res.tokens) == N_GEN and all(0 <= t < V for t in res.tokens)
        _check_stats(res.spec)
        assert res.spec.drafted > 0
    out = llm.generate_batch(prompts, max_tokens=N_GEN, temperature=0.8, seed=5, ignore_eos=True)
    assert all(len(r.tokens) == N_GEN and all(0 <= t < V for t in r.tokens) for r in out)
    # sampled drafts carry the distribution each token was drawn from
    from pyfast.sampling import Sampler, SamplingParams

    mtp = _mtp(llm)
    s = Sampler(SamplingParams(temperature=0.8, top_k=20, seed=3), V)
    ctx = llm.ctx
    ctx.clear()
    toks = np.asarray(prompts[0], dtype=np.int32)
    ctx.decode(toks[:-1], seq_ids=0, logits="none")
    mtp.process(DecodeBatch("prompt", np.zeros(toks.size - 1, np.int32), toks[:-1],
                            np.arange(toks.size - 1, dtype=np.int32)))
    d = mtp.draft([DraftRequest(0, toks, 3, 1, 0.0, s)])[0]
    assert d is not None and d.probs is not None and d.probs.shape == (len(d), V)
    assert np.allclose(d.probs.sum(axis=1), 1.0, atol=1e-5)
    assert all(d.probs[i, t] > 0 for i, t in enumerate(d.tokens.tolist()))
    assert (np.count_nonzero(d.probs, axis=1) <= 20).all()
    ctx.clear()


def test_greedy_p_min_stops_drafts():
    _, ref, ctx, prop = _setup("qwen35")
    toks = ref["tokens_0"]
    _prompt_batch(ctx, prop, 0, toks[:8], 0)
    prop.trace = []
    assert prop.draft([_greedy_req(0, toks[:9], n=3, p_min=0.999)]) == [None]
    row = prop.trace[0]["logits"][0].astype(np.float64)
    assert 1.0 / np.exp(row - row.max()).sum() < 0.999
    d = prop.draft([_greedy_req(0, toks[:9], n=3)])[0]
    assert len(d) == 3 and d.probs is None


# --- errors ---------------------------------------------------------------------------------------
@pytest.fixture
def no_decode(monkeypatch):
    def decode(*a, **k):
        raise AssertionError("decoded before the settings were checked")

    monkeypatch.setattr(Context, "decode", decode)


def test_model_without_mtp_layers(tmp_path, no_decode):
    from pyfast.convert import convert
    from tests.models.test_hybrid_common import FIXTURES

    hf = FIXTURES / "hf" / "qwen35"
    if not hf.is_dir():
        pytest.skip(f"{hf} not present")
    out = tmp_path / "qwen35-nomtp.gguf"
    convert(hf, out, mtp=False)
    with pytest.raises(ValueError, match=r"draft-mtp: .* has no MTP \(nextn\) layers.*nextn_predict_layers = 0"):
        LLM(out, n_ctx=256, n_threads=2, speculative=SpecConfig(types="draft-mtp"))
    with pytest.raises(ValueError, match="no MTP"):
        LLM(out, n_ctx=256, n_threads=2, speculative=SpecConfig(types="ngram-simple,draft-mtp"))


def test_smollm2_has_no_mtp(smollm2_path, no_decode):
    with pytest.raises(ValueError, match=r"draft-mtp: .*architecture 'llama'.* has no MTP \(nextn\) layers"):
        LLM(smollm2_path, n_ctx=256, n_threads=2, speculative=SpecConfig(types="draft-mtp"))


def test_bad_settings(no_decode):
    path, _ = fixture("qwen35")
    with pytest.raises(ValueError, match=r"--draft-max must be >= 1.*draft-mtp"):
        LLM(path, n_ctx=256, n_threads=2, speculative=SpecConfig(types="draft-mtp", draft_max=0))
    with pytest.raises(ValueError, match="listed twice"):
        SpecConfig(types="draft-mtp,draft-mtp").validate()
    assert "draft-mtp" in __import__("pyfast.spec", fromlist=["SPEC_TYPES"]).SPEC_TYPES


def test_target_without_hidden_export():
    from pyfast.models import Model
    from pyfast.spec.decoder import SpecDecoder
    from pyfast.spec.mtp import MTPProposer

    path, _ = fixture("qwen35")
    model = Model(path)
    ctx = Context(model, n_ctx=128, n_threads=2, n_rollback=3)
    with pytest.raises(ValueError, match="export_hidden=True"):
        SpecDecoder(ctx, [MTPProposer(model, n_ctx=128, n_threads=2)], SpecConfig(types="draft-mtp"))
