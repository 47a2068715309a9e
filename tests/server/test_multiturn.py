"""Multi-turn prompt cache: the second turn of a ~2,000-token conversation decodes only its new
tokens (seen in the response's usage/timings and in /metrics)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
             "checking the lamp, and writing the weather in a worn leather book. ")


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess("-m", str(smollm2_path), "--parallel", "2", "--ctx-size", str(2 * 3072)) as srv:
        yield srv


def test_second_turn_reprocesses_only_new_tokens(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        story = PARAGRAPH * 72
        msgs = [{"role": "system", "content": "You are a careful reader."},
                {"role": "user", "content": story + "\nWhat does the keeper write in the book?"}]
        r1 = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16, "temperature": 0}).json()
        n1 = r1["usage"]["prompt_tokens"]
        assert n1 >= 2000, n1
        assert r1["timings"]["prompt_n"] == n1  # a cold slot computes everything

        msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And what does he count?"}]
        m0 = metric(c.get("/metrics").text, "pyfast_prompt_tokens_processed_total")
        r2 = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16, "temperature": 0}).json()
        m1 = metric(c.get("/metrics").text, "pyfast_prompt_tokens_processed_total")
        n2 = r2["usage"]["prompt_tokens"]
        new = n2 - n1
        processed = r2["timings"]["prompt_n"]
        # Only the tail: the previous reply, the new user message and the template around them (the
        # last token of turn 1's reply may retokenize differently, so allow a few tokens more).
        assert processed == m1 - m0
        assert processed <= new + 4, (processed, new)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n2 - processed
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= n1 - 4
        assert r2["timings"]["prompt_ms"] < r1["timings"]["prompt_ms"]
