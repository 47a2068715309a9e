"""Greedy speculative decoding is token-identical to plain greedy decoding on SmolLM2, for every
proposer and a combination, with one and with three sequences in flight; an oracle proposer gets
100% acceptance and a random one about 0% with the same output; a draft model reports its
statistics."""
from __future__ import annotations

import numpy as np
import pytest

from pyfast.llm import LLM
from pyfast.spec import SpecConfig
from tests.spec.conftest import N_GEN
from tests.spec.helpers import OracleProposer, RandomProposer

CONFIGS = {
    "ngram-simple": dict(types="ngram-simple"),
    "ngram-map-k": dict(types="ngram-map-k"),
    "ngram-mod": dict(types="ngram-mod"),
    "draft-model": dict(types="draft-model", draft_model="TINY"),
    "ngram-simple,ngram-mod,draft-model adaptive": dict(types="ngram-simple,ngram-mod,draft-model",
                                                        draft_model="TINY", adaptive=True, draft_max=6),
}


def check_stats(st):
    assert st.accepted <= st.drafted
    assert all(a >= b for a, b in zip(st.pos_accepted, st.pos_accepted[1:]))
    assert st.recovered + st.bonus == st.draft_rounds
    assert sum(v.drafted for v in st.by_proposer.values()) == st.drafted


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_one_and_three_sequences(name, smollm2_path, prompts, references, tiny_draft):
    kw = dict(CONFIGS[name])
    if kw.get("draft_model") == "TINY":
        kw["draft_model"] = tiny_draft
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(**kw))
    if llm._spec.adaptive is not None:
        # a fixed verify-cost curve (a calibration on a busy machine would make this test vary)
        cm = llm._spec.adaptive.cost
        cm.cost = 0.004 * (1.0 + 0.15 * np.maximum(np.arange(cm.t_max + 1) - 1, 0))
    for p, ref in zip(prompts, references):
        res = llm.generate(p, max_tokens=N_GEN, temperature=0)
        assert res.tokens == ref, f"{name}: output differs from plain decoding on {p[:40]!r}"
        assert res.spec is not None and res.spec.n_tokens >= len(ref) - 1
        check_stats(res.spec)
    batch = llm.generate_batch(prompts[:3], max_tokens=N_GEN, temperature=0)
    assert [r.tokens for r in batch] == references[:3]
    check_stats(llm.spec_stats)
    assert llm.spec_stats.drafted > 0
    # the cache is consistent afterwards: a plain call on the same LLM still matches
    assert llm.generate(prompts[0], max_tokens=N_GEN, temperature=0, speculative=False).tokens == references[0]


def test_plain_generate_batch_matches_single(base_llm, prompts, references):
    out = base_llm.generate_batch(prompts[:3], max_tokens=N_GEN, temperature=0)
    assert [r.tokens for r in out] == references[:3]
    assert all(r.spec is None for r in out)


def test_greedy_with_repeat_penalty_identical(smollm2_path, base_llm, prompts):
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(types="ngram-simple,ngram-mod"))
    for p in prompts[1:3]:
        ref = base_llm.generate(p, max_tokens=N_GEN, temperature=0, repeat_penalty=1.3).tokens
        assert llm.generate(p, max_tokens=N_GEN, temperature=0, repeat_penalty=1.3).tokens == ref


def test_oracle_gets_full_acceptance_and_random_about_none(smollm2_path, base_llm, prompts, references):
    oracle = OracleProposer()
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(types=[oracle], draft_max=8))
    for p, ref in zip(prompts[:3], references[:3]):
        oracle.truth[0] = base_llm.tokenize(p) + ref
        res = llm.generate(p, max_tokens=N_GEN, temperature=0)
        assert res.tokens == ref
        assert res.spec.drafted > 0 and res.spec.accepted == res.spec.drafted
        assert res.spec.tokens_per_step > 4
    for i, (p, ref) in enumerate(zip(prompts[:3], references[:3])):
        oracle.truth[i] = base_llm.tokenize(p) + ref
    batch = llm.generate_batch(prompts[:3], max_tokens=N_GEN, temperature=0)
    assert [r.tokens for r in batch] == references[:3]
    assert all(r.spec.acceptance == 1.0 for r in batch)

    rnd = RandomProposer(base_llm.n_vocab, seed=1)
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(types=[rnd]))
    for p, ref in zip(prompts[:2], references[:2]):
        res = llm.generate(p, max_tokens=N_GEN, temperature=0)
        assert res.tokens == ref
        assert res.spec.drafted > 2 * len(ref) and res.spec.acceptance < 0.05
    batch = llm.generate_batch(prompts[:3], max_tokens=N_GEN, temperature=0)
    assert [r.tokens for r in batch] == references[:3]


def test_draft_model_statistics(smollm2_path, prompts, references, tiny_draft):
    # the target as its own draft: with batch invariance every greedy draft token is accepted
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2,
              speculative=SpecConfig(draft_model=smollm2_path, draft_max=4))
    res = llm.generate(prompts[0], max_tokens=N_GEN, temperature=0)
    assert res.tokens == references[0]
    st = res.spec
    assert st.by_proposer["draft-model"].drafted == st.drafted > 0
    assert st.acceptance == 1.0 and st.mean_accepted > 3
    assert st.t_draft > 0 and st.t_verify > 0
    d = st.to_dict()
    assert d["by_proposer"]["draft-model"]["acceptance"] == 1.0 and len(d["pos_accepted"]) == 4
    # a tiny random draft with SmolLM2's vocabulary: runs, reports, and keeps the output exact
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(draft_model=tiny_draft))
    res = llm.generate(prompts[1], max_tokens=N_GEN, temperature=0)
    assert res.tokens == references[1] and res.spec.drafted > 0
    assert llm.spec_stats.drafted == res.spec.drafted


def test_sampling_with_speculation_runs_and_is_seeded(smollm2_path, prompts, tiny_draft):
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2,
              speculative=SpecConfig(types="ngram-simple,draft-model", draft_model=tiny_draft))
    kw = dict(max_tokens=24, temperature=0.8, top_k=40, top_p=0.95, seed=5)
    a = llm.generate(prompts[2], **kw)
    b = llm.generate(prompts[2], **kw)
    assert a.tokens == b.tokens and len(a.tokens) > 0
    assert a.spec.drafted > 0
    batch = llm.generate_batch(prompts[:3], **kw)
    assert all(0 < len(r.tokens) <= 24 for r in batch)
    assert all(0 <= t < llm.n_vocab for r in batch for t in r.tokens)


def test_stream_and_stop_strings_with_speculation(smollm2_path, base_llm, prompts):
    llm = LLM(smollm2_path, n_ctx=1024, n_threads=2, speculative=SpecConfig(types="ngram-simple"))
    p = prompts[2]
    full = base_llm.generate(p, max_tokens=N_GEN, temperature=0)
    chunks = list(llm.generate(p, max_tokens=N_GEN, temperature=0, stream=True))
    assert "".join(c.text for c in chunks) == full.text
    stop = full.text[10:14]
    want = base_llm.generate(p, max_tokens=N_GEN, temperature=0, stop=[stop])
    got = llm.generate(p, max_tokens=N_GEN, temperature=0, stop=[stop])
    assert got.text == want.text and got.finish_reason == "stop"
    # max_tokens cuts inside an accepted run; the next call reuses a consistent cache
    short = llm.generate(p, max_tokens=7, temperature=0)
    assert short.tokens == full.tokens[:7]
    again = llm.generate(p, max_tokens=N_GEN, temperature=0)
    assert again.tokens == full.tokens and again.timings.n_prompt_cached > 0
    assert np.all(np.asarray(llm._cached) == np.asarray(llm.tokenize(p) + full.tokens)[: len(llm._cached)])
