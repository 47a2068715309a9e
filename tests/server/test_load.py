"""Load: 64 concurrent streaming clients x 4 requests against --parallel 8.

Every request first runs alone (one at a time: the sequential baseline and the reference text),
then all clients run together. Under load no request may fail, and every streamed text must equal
the same request run alone (greedy; batch invariance makes this exact). Aggregate throughput must
be at least PYFAST_MIN_SPEEDUP (default 1.8) times the sequential one, measured in the same run.
The figures are printed and, with PYFAST_LOAD_REPORT=path, written as JSON.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import numpy as np

N_CLIENTS = 64
PER_CLIENT = 4
MAX_TOKENS = 24
TIME_LIMIT_S = 400  # per phase

TOPICS = ["the sea", "volcanoes", "bees", "the moon", "rain", "mountains", "owls", "bread", "rivers", "trains",
          "chess", "gardens", "snow", "deserts", "whales", "music", "clocks", "bicycles", "coffee", "forests",
          "lighthouses", "maps", "tea", "wolves", "stars", "islands", "bridges", "libraries", "kites", "cats",
          "dogs", "horses", "apples", "glaciers", "storms", "castles", "robots", "paper", "salt", "honey",
          "sailing", "caves", "dragons", "pianos", "gold", "rainbows", "ants", "clouds", "tigers", "cheese",
          "windmills", "dolphins", "mushrooms", "comets", "pencils", "marathons", "penguins", "tulips",
          "submarines", "rockets", "violins", "lemons", "canyons", "fireflies"]
STYLES = ["In one sentence, tell me something about {}.", "Give me a fun fact about {}.",
          "Write a two-line poem about {}.", "Explain {} to a small child."]


def _requests() -> list[list[dict]]:
    """Per client, its 4 chat requests (256 distinct prompts in all)."""
    assert len(TOPICS) >= N_CLIENTS
    return [[{"messages": [{"role": "user", "content": STYLES[k].format(TOPICS[c])}],
              "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}} for k in range(PER_CLIENT)] for c in range(N_CLIENTS)]


async def _one(http: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    text, usage, errors, finish, timings = [], None, [], None, {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread()).decode(errors="replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                errors.append(ev["error"])
                continue
            if ev.get("usage"):
                usage = ev["usage"]
            elif ev.get("timings"):
                timings = ev["timings"]
            for ch in ev.get("choices", []):
                piece = ch["delta"].get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
    return {"status": 200, "text": "".join(text), "usage": usage, "errors": errors, "finish": finish,
            "timings": timings, "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "latency": time.perf_counter() - t0}


async def _run(url: str, plan: list[list[dict]], concurrent: bool) -> tuple[list[list[dict]], float]:
    limits = httpx.Limits(max_connections=N_CLIENTS + 8, max_keepalive_connections=N_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as http:
        results: list[list[dict]] = [[] for _ in plan]

        async def client(c: int) -> None:
            for body in plan[c]:
                results[c].append(await _one(http, body))

        t0 = time.perf_counter()
        if concurrent:
            await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(len(plan)))), TIME_LIMIT_S)
        else:
            async def serial() -> None:
                for c in range(len(plan)):
                    await client(c)
            await asyncio.wait_for(serial(), TIME_LIMIT_S)
        return results, time.perf_counter() - t0


def _summary(results: list[list[dict]], wall: float) -> dict:
    flat = [r for rs in results for r in rs]
    ttft = np.array([r["ttft"] for r in flat])
    # the server's view: from getting a slot to the first token (no queueing)
    in_slot = np.array([r["timings"].get("ttft_ms", 0.0) - r["timings"].get("queue_ms", 0.0) for r in flat])
    n_tok = sum(r["usage"]["completion_tokens"] for r in flat)
    return {"requests": len(flat), "completion_tokens": n_tok, "wall_s": round(wall, 2),
            "tokens_per_s": round(n_tok / wall, 1), "requests_per_s": round(len(flat) / wall, 2),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)) * 1e3, 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)) * 1e3, 1),
            "ttft_in_slot_p50_ms": round(float(np.percentile(in_slot, 50)), 1),
            "ttft_in_slot_p99_ms": round(float(np.percentile(in_slot, 99)), 1)}


def test_load_64_clients_parallel_8(main_server):
    plan = _requests()
    warm = [[dict(plan[0][0], max_tokens=4)]]
    asyncio.run(_run(main_server.url, warm, concurrent=False))  # plans for the first shapes

    alone, t_seq = asyncio.run(_run(main_server.url, plan, concurrent=False))
    for rs in alone:
        for r in rs:
            assert r["status"] == 200 and not r["errors"], r
    loaded, t_conc = asyncio.run(_run(main_server.url, plan, concurrent=True))

    bad = [(c, k, r) for c, rs in enumerate(loaded) for k, r in enumerate(rs) if r["status"] != 200 or r["errors"]]
    assert not bad, bad[:3]
    assert [len(rs) for rs in loaded] == [PER_CLIENT] * N_CLIENTS
    mismatched = [(c, k) for c in range(N_CLIENTS) for k in range(PER_CLIENT)
                  if (loaded[c][k]["text"], loaded[c][k]["finish"], loaded[c][k]["usage"]["completion_tokens"])
                  != (alone[c][k]["text"], alone[c][k]["finish"], alone[c][k]["usage"]["completion_tokens"])]
    assert not mismatched, [(alone[c][k]["text"], loaded[c][k]["text"]) for c, k in mismatched[:3]]

    seq, conc = _summary(alone, t_seq), _summary(loaded, t_conc)
    speedup = conc["tokens_per_s"] / seq["tokens_per_s"]
    report = {"sequential": seq, "concurrent_64x4_parallel_8": conc, "speedup": round(speedup, 2)}
    print("\nload report:", json.dumps(report, indent=1))
    if os.environ.get("PYFAST_LOAD_REPORT"):
        with open(os.environ["PYFAST_LOAD_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    min_speedup = float(os.environ.get("PYFAST_MIN_SPEEDUP", "1.8"))
    assert speedup >= min_speedup, report

    with httpx.Client(base_url=main_server.url, timeout=30) as c:
        h = c.get("/health").json()
        assert h["slots_processing"] == 0 and h["queue_depth"] == 0
