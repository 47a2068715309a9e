"""The per-slot speculation hook: drafts are verified inside the batched decode, outputs are
identical to non-speculative serving (greedy and seeded sampling), and the statistics show in
responses and /metrics. The proposers here are test doubles (algorithms.md T0.2): an oracle that
drafts the target's own greedy continuation and one that drafts random tokens; the real n-gram
proposer of ``pyfast.spec`` runs through ``pyfast serve --spec-type`` where it is available."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.server.helpers import ThreadServer, metric, server_threads

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 24


class OracleProposer:
    """Drafts the reference greedy continuation of whichever known prompt a slot runs."""

    name = "oracle"

    def __init__(self, refs: dict[tuple, list[int]]):
        self.refs = refs
        self.seqs: dict[int, tuple[list[int], int]] = {}
        self.events: list[tuple] = []

    def begin(self, seq, prompt):
        self.seqs[seq] = (self.refs.get(tuple(int(t) for t in prompt), []), len(prompt))

    def draft(self, requests):
        out = []
        for r in requests:
            cont, n_prompt = self.seqs[r.seq]
            done = len(r.tokens) - n_prompt  # generated so far (the last one is being decoded)
            out.append(cont[done:done + r.n_max] or None)
        return out

    def accept(self, seq, k, other=False):
        assert seq in self.seqs
        self.events.append(("accept", seq, k, other))

    def process(self, batch):
        self.events.append((batch.kind, len(batch.tokens)))

    def end(self, seq):
        del self.seqs[seq]


class RandomProposer:
    name = "random"

    def __init__(self, n_vocab: int):
        self.rng = np.random.default_rng(0)
        self.n_vocab = n_vocab

    def begin(self, seq, prompt):
        pass

    def draft(self, requests):
        return [self.rng.integers(0, self.n_vocab, size=min(r.n_max, 3)) for r in requests]

    def accept(self, seq, k, other=False):
        pass

    def process(self, batch):
        pass

    def end(self, seq):
        pass


@pytest.fixture(scope="module")
def refs(ref_llm):
    out = {}
    for p in PROMPTS:
        r = ref_llm.generate(p, max_tokens=MAX_TOKENS, temperature=0)
        out[p] = r
    return out


def _serve(smollm2_path, proposers):
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from pyfast.server.spec import SpecConfig

    engine = Engine(EngineConfig(model=str(smollm2_path), n_parallel=3, n_ctx=3 * 512, n_threads=server_threads(),
                                 spec=SpecConfig(n_max=6)), proposers=proposers)
    return ThreadServer(create_app(engine))


async def _all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_speculation_keeps_outputs(smollm2_path, ref_llm, refs, kind):
    table = {tuple(r.prompt_tokens): list(r.tokens) for r in refs.values()}
    proposer = OracleProposer(table) if kind == "oracle" else RandomProposer(ref_llm.n_vocab)

    greedy = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]
    sampled = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 7 + i}
               for i, p in enumerate(PROMPTS)]
    want_sampled = [ref_llm.generate(b["prompt"], max_tokens=MAX_TOKENS, temperature=0.9, seed=b["seed"]).text
                    for b in sampled]
    with _serve(smollm2_path, [proposer]) as srv:
        got = asyncio.run(_all(srv.url, greedy))
        assert [g["choices"][0]["text"] for g in got] == [refs[p].text for p in PROMPTS]
        t = [g["timings"] for g in got]
        drafted = sum(x["draft_n"] for x in t)
        accepted = sum(x["draft_n_accepted"] for x in t)
        assert drafted > 0 and 0 <= accepted <= drafted
        if kind == "oracle":
            # every draft is right: ~MAX_TOKENS / (n_max + 1) verify steps per request
            assert accepted == drafted
            assert all(x["draft_acceptance"] == 1.0 for x in t)
        else:
            assert accepted <= drafted // 10
        m = httpx.get(srv.url + "/metrics").text
        assert metric(m, "pyfast_spec_draft_tokens_total") == drafted
        assert metric(m, "pyfast_spec_accepted_tokens_total") == accepted
        assert metric(m, "pyfast_spec_acceptance_rate") == pytest.approx(accepted / drafted)
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["meta"]["speculative"] is True
        if kind == "oracle":  # the protocol: every request ended, decodes of both kinds seen
            assert not proposer.seqs
            kinds = {e[0] for e in proposer.events}
            assert {"prompt", "verify", "accept"} <= kinds

        # seeded sampling draws the same random numbers with or without drafts
        got = asyncio.run(_all(srv.url, sampled))
        assert [g["choices"][0]["text"] for g in got] == want_sampled


def test_ngram_speculation_via_cli(smollm2_path, ref_llm):
    spec = pytest.importorskip("pyfast.spec")
    if "ngram-simple" not in getattr(spec, "SPEC_TYPES", ()):
        pytest.skip("pyfast.spec has no ngram-simple proposer")
    from tests.server.helpers import ServerProcess

    prompt = ("Copy the list exactly.\nList: apple, river, stone, cloud, maple, tiger, lemon, candle\n"
              "Copy: apple, river, stone, cloud, maple, tiger, lemon, candle\nList: apple, river, stone, "
              "cloud, maple, tiger, lemon, candle\nCopy:")
    want = ref_llm.generate(prompt, max_tokens=32, temperature=0)
    with ServerProcess("-m", str(smollm2_path), "--parallel", "2", "--ctx-size", "2048",
                       "--spec-type", "ngram-simple", "--draft-max", "8") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 32, "temperature": 0},
                       timeout=300).json()
        assert r["choices"][0]["text"] == want.text
        assert r["timings"]["draft_n"] > 0 and r["timings"]["draft_n_accepted"] > 0
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert metric(m, "pyfast_spec_accepted_tokens_total") == r["timings"]["draft_n_accepted"]
