"""The server runs ``LLM.generate``'s speculative round (issue 28): with drafts that carry
probabilities (a draft model, ``draft-mtp``) and sampling requests, the server verifies by
rejection sampling with the same verifier, so for the same prompts and seeds its output and its
acceptance (``draft_n``, ``draft_n_accepted``) equal ``LLM.generate``'s, request by request,
with several requests sharing each batched decode.
"""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from pyfast.sampling import SamplingParams
from tests.server.helpers import ThreadServer, metric, server_threads

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Copy: apple, river, stone, apple, river, stone, apple,"]


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


class Recording:
    """Wraps a proposer; records whether each non-empty draft carried probabilities."""

    def __init__(self, inner):
        self.inner, self.with_probs = inner, []
        for name in ("name", "default_n_max", "default_n_min", "is_model", "needs_hidden", "provides_probs"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))
        if hasattr(inner, "bind_target"):
            self.bind_target = inner.bind_target

    def begin(self, seq, prompt):
        self.inner.begin(seq, prompt)

    def draft(self, requests):
        out = self.inner.draft(requests)
        self.with_probs += [d.probs is not None for d in out if d is not None]
        return out

    def accept(self, seq, k, other=False):
        self.inner.accept(seq, k, other=other)

    def process(self, batch):
        self.inner.process(batch)

    def end(self, seq):
        self.inner.end(seq)


def _compare(got: list[dict], want: list) -> None:
    for g, w in zip(got, want):
        assert g["choices"][0]["text"] == w.text
        assert g["usage"]["completion_tokens"] == len(w.tokens)
        assert (g["timings"]["draft_n"], g["timings"]["draft_n_accepted"]) == (w.spec.drafted, w.spec.accepted)
    drafted = sum(w.spec.drafted for w in want)
    accepted = sum(w.spec.accepted for w in want)
    assert 0 < accepted < drafted  # accepted and rejected drafts both occur


@pytest.fixture(scope="module")
def perturbed_draft(smollm2_path):
    """SmolLM2 with random control-vector directions after layers 10 and 20: a draft model whose
    distribution overlaps the target's (about half of its sampled drafts are accepted)."""
    from pyfast.control_vector import ControlVector
    from pyfast.models import Model

    dm = Model(smollm2_path)
    rng = np.random.default_rng(0)
    cv = ControlVector(n_embd=dm.args.n_embd)
    for layer in (10, 20):
        cv._add(layer, (2.0 * rng.standard_normal(dm.args.n_embd)).astype(np.float32))
    dm.set_control_vector(cv)
    return dm


def test_draft_model_sampling_equals_llm(smollm2_path, perturbed_draft):
    from pyfast.llm import LLM
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec
    from pyfast.spec import SpecConfig
    from pyfast.spec.draft_model import DraftModelProposer

    llm = LLM(smollm2_path, n_ctx=1024, n_threads=server_threads(),
              speculative=SpecConfig(draft_model=perturbed_draft, draft_max=3))
    reqs = [dict(prompt=p, max_tokens=24, temperature=t, seed=11 + i, top_p=tp)
            for i, (p, t, tp) in enumerate([(PROMPTS[0], 0.8, 0.95), (PROMPTS[1], 0.8, 0.95),
                                            (PROMPTS[2], 1.0, 1.0), (PROMPTS[3], 0.6, 0.9),
                                            (PROMPTS[0], 1.0, 0.95)])]
    want = [llm.generate(r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"], seed=r["seed"],
                         top_p=r["top_p"]) for r in reqs]

    prop = Recording(DraftModelProposer(perturbed_draft, perturbed_draft, n_ctx=3 * 1024,
                                        n_threads=server_threads()))
    engine = Engine(EngineConfig(model=str(smollm2_path), n_parallel=3, n_ctx=3 * 1024, n_threads=server_threads(),
                                 spec=ServerSpec(n_max=3)), proposers=[prop])
    with ThreadServer(create_app(engine)) as srv:
        got = asyncio.run(_post_all(srv.url, reqs))
        m = httpx.get(srv.url + "/metrics", timeout=30).text
    _compare(got, want)
    assert prop.with_probs and all(prop.with_probs)  # rejection sampling had q for every draft
    assert metric(m, "pyfast_spec_draft_tokens_total") == sum(w.spec.drafted for w in want)
    assert metric(m, "pyfast_spec_accepted_tokens_total") == sum(w.spec.accepted for w in want)


def test_draft_mtp_sampling_equals_llm(hybrid_path):
    """draft-mtp on the tiny Qwen3.5 fixture (random MTP weights: few drafts accepted, at a high
    temperature some are), through ``--spec-type draft-mtp``'s wiring."""
    from pyfast.llm import LLM
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig as ServerSpec
    from pyfast.spec import SpecConfig

    llm = LLM(hybrid_path, n_ctx=512, n_threads=1, speculative=SpecConfig(types="draft-mtp", draft_max=3))
    reqs = [dict(prompt=p, max_tokens=40, temperature=1.5, top_k=30, top_p=1.0, min_p=0.0, seed=5 + i,
                 ignore_eos=True) for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    want = [llm.generate(r["prompt"], max_tokens=r["max_tokens"], temperature=r["temperature"], top_k=r["top_k"],
                         top_p=r["top_p"], min_p=r["min_p"], seed=r["seed"], ignore_eos=True) for r in reqs]

    engine = Engine(EngineConfig(model=str(hybrid_path), n_parallel=3, n_ctx=3 * 512, n_threads=server_threads(),
                                 spec=ServerSpec(spec_type="draft-mtp", n_max=3)))
    assert engine.ctx.export_hidden and engine.ctx.n_rollback == 3
    with ThreadServer(create_app(engine)) as srv:
        got = asyncio.run(_post_all(srv.url, reqs))
    _compare(got, want)
    for s in engine.slots:  # every slot's record of its cache is exact
        assert engine.ctx.seq_len(s.id) == len(s.tokens)


class Oracle:
    """Drafts the reference greedy continuation of the one prompt it knows (all accepted)."""

    name = "oracle"
    default_n_max = 4

    def __init__(self, prompt: list[int], cont: list[int]):
        self.prompt, self.cont = prompt, cont

    def draft(self, requests):
        out = []
        for r in requests:
            done = len(r.tokens) - len(self.prompt)
            ok = list(r.tokens[: len(self.prompt)]) == self.prompt
            out.append(self.cont[done: done + r.n_max] if ok else None)
        return out


@pytest.mark.parametrize("name", ["smollm2", "hybrid", "hybrid-replay"])
def test_stop_inside_a_round_keeps_the_cache_exact(name, smollm2_path, hybrid_path, ref_llm, hybrid_llm):
    """A stop string completed by a token in the middle of an accepted draft ends the request
    there: the tokens after it leave the slot's cache (snapshot planes roll them back on the
    hybrid model; with one plane, the state saved before the round is restored and the kept
    tokens replayed), so the cache holds exactly the prompt and the reply but its last token, and
    the next turn reuses all of it."""
    from pyfast.server.engine import Engine, EngineConfig, GenParams, Job
    from pyfast.server.spec import SpecConfig as ServerSpec

    path, llm = (smollm2_path, ref_llm) if name == "smollm2" else (hybrid_path, hybrid_llm)
    prompt = llm.tokenize("Once upon a time, in a small village by the sea, there lived")
    cont = llm.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).tokens
    # 1 plain token, then rounds of 4 drafted + 1 bonus: tokens 1-5, 6-10, ...; stop on token 7
    stop = llm.detokenize(cont[:8])[len(llm.detokenize(cont[:6])):]
    assert stop and stop not in llm.detokenize(cont[:6])
    want = llm.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=stop)
    assert want.finish_reason == "stop"

    engine = Engine(EngineConfig(model=str(path), n_parallel=1, n_ctx=512, n_threads=server_threads(),
                                 spec=ServerSpec(n_max=4), n_rollback=1 if name == "hybrid-replay" else None),
                    proposers=[Oracle(prompt, cont)])

    def run(p, **kw):
        job = Job(p, GenParams(max_tokens=kw.get("max_tokens", 24), sampling=SamplingParams(temperature=0),
                               stop=kw.get("stop", []), ignore_eos=True))
        engine.submit([job])
        while engine.step():
            pass
        return job

    job = run(prompt, stop=[stop])
    assert job.text == want.text and job.out == cont[:8]
    assert job.stats.n_drafted >= 8 and job.stats.n_accepted == job.stats.n_drafted
    slot = engine.slots[0]
    assert slot.tokens == prompt + job.out[:-1] and engine.ctx.seq_len(0) == len(slot.tokens)
    restores = engine.metrics.spec_state_restores.value()
    assert restores == (1 if name == "hybrid-replay" else 0)  # only the stop's round rolls back
    assert engine.metrics.spec_replayed_tokens.value() == 2 * restores  # its id_last and one draft token
    nxt = prompt + job.out + llm.tokenize(" and then")
    job2 = run(nxt, max_tokens=6)
    assert job2.stats.n_cached == len(prompt) + len(job.out) - 1
    assert job2.out == llm.generate(nxt, max_tokens=6, temperature=0, ignore_eos=True, speculative=False).tokens
