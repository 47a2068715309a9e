"""``pyfast serve --spec-type draft-dspark -md drafter.gguf`` on the hybrid Qwen3.5 fixture: the
block drafter serves several concurrent requests (their prompt chunks and verify rows sharing
decodes, features passed per slice), greedy output equal to ``pyfast.LLM``'s, drafts counted and
partly accepted, rollback through snapshot planes and save / restore / replay (draft-max 5 >
the planes when the server's n_rollback is smaller)."""
from __future__ import annotations

import asyncio

import httpx

from tests.server.helpers import ServerProcess, metric

PROMPTS = ["def fibonacci(n):", "Copy: apple, river, stone, apple, river, stone, apple, river,",
           "The capital of France is"]
N = 32


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json() for r in rs]


def test_dspark_served_equals_llm(hybrid_path, hybrid_llm, tmp_path):
    from pyfast.models import Model
    from tests.spec.test_dflash import _oracle_markov

    model = Model(hybrid_path)
    want = [hybrid_llm.generate(p, max_tokens=N, temperature=0) for p in PROMPTS]
    traj = [hybrid_llm.tokenize(p) + w.tokens for p, w in zip(PROMPTS, want)]
    gguf = _oracle_markov(tmp_path, model, block=6, trajectories=traj)
    with ServerProcess("-m", str(hybrid_path), "--parallel", "3", "--ctx-size", str(3 * 512),
                       "--spec-type", "draft-dspark", "-md", str(gguf), "--draft-max", "5") as srv:
        meta = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
        assert meta["speculative"] is True
        bodies = [{"prompt": p, "max_tokens": N, "temperature": 0} for p in PROMPTS]
        got = asyncio.run(_post_all(srv.url, bodies))
        assert [g["choices"][0]["text"] for g in got] == [w.text for w in want]
        drafted = sum(g["timings"]["draft_n"] for g in got)
        accepted = sum(g["timings"]["draft_n_accepted"] for g in got)
        assert drafted > 0 and 0 < accepted < drafted
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert metric(m, "pyfast_spec_draft_tokens_total") == drafted
