"""The official ``openai`` client against a live ``pyfast serve`` over loopback: chat and
completions, streamed and not, with logprobs; greedy answers equal ``pyfast.LLM``'s."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.server.helpers import metric

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def oa(main_server):
    return openai.OpenAI(base_url=main_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(oa):
    return oa.models.list().data[0].id


@pytest.fixture(scope="module")
def want_chat(ref_llm):
    return ref_llm.chat(CHAT, max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def want_completion(ref_llm):
    return ref_llm.generate(PROMPT, max_tokens=20, temperature=0)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_models(oa, main_server, smollm2_path):
    models = oa.models.list().data
    assert len(models) == 1 and models[0].id == smollm2_path.stem


def test_chat(oa, model_id, want_chat, ref_llm):
    r = oa.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want_chat.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want_chat.finish_reason
    assert r.usage.prompt_tokens == len(want_chat.prompt_tokens)
    assert r.usage.completion_tokens == len(want_chat.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == len(want_chat.tokens) and t["prompt_n"] + t["prompt_cached"] == r.usage.prompt_tokens


def test_chat_stream(oa, model_id, want_chat):
    chunks = list(oa.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_chat.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == want_chat.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want_chat.tokens)


def test_chat_logprobs(oa, model_id, want_chat, ref_llm):
    r = oa.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want_chat.tokens)
    assert "".join(bytes(c.bytes).decode("utf-8", "replace") for c in content) == want_chat.text
    # the first token's logprobs are the model's own (log-softmax of the raw logits)
    lsm = _log_softmax(ref_llm.logits(want_chat.prompt_tokens)[-1])
    assert content[0].logprob == pytest.approx(lsm[want_chat.tokens[0]], abs=1e-6)
    top = np.argsort(-lsm, kind="stable")[:3]
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(lsm[top].tolist(), abs=1e-6)
    for c in content:  # greedy: the chosen token is the most likely one
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.logprob <= 0.0


def test_chat_stream_logprobs(oa, model_id, want_chat):
    chunks = list(oa.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0,
                                             stream=True, logprobs=True, top_logprobs=2))
    lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(lps) == len(want_chat.tokens)
    assert all(len(lp.top_logprobs) == 2 for lp in lps)


def test_completion(oa, model_id, want_completion):
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.choices[0].text == want_completion.text
    assert r.choices[0].finish_reason == want_completion.finish_reason
    assert r.usage.prompt_tokens == len(want_completion.prompt_tokens)
    assert r.usage.completion_tokens == len(want_completion.tokens)


def test_completion_stream(oa, model_id, want_completion):
    chunks = list(oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_completion.text
    assert chunks[-1].choices[0].finish_reason == want_completion.finish_reason


def test_completion_logprobs(oa, model_id, want_completion, ref_llm):
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want_completion.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == want_completion.text
    lsm = _log_softmax(ref_llm.logits(want_completion.prompt_tokens)[-1])
    assert lp.token_logprobs[0] == pytest.approx(lsm[want_completion.tokens[0]], abs=1e-6)
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_token_prompt_and_several_prompts(oa, model_id, ref_llm, want_completion):
    other = "Once upon a time"
    r = oa.completions.create(model=model_id, prompt=[PROMPT, other], max_tokens=20, temperature=0)
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == want_completion.text
    assert by_index[1] == ref_llm.generate(other, max_tokens=20, temperature=0).text
    r = oa.completions.create(model=model_id, prompt=want_completion.prompt_tokens, max_tokens=20, temperature=0)
    assert r.choices[0].text == want_completion.text


def test_n_and_seed(oa, model_id, want_completion, ref_llm):
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.text == want_completion.text for c in r.choices)
    kw = dict(model=model_id, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=1.0, seed=1234, n=2)
    a = sorted(oa.completions.create(**kw).choices, key=lambda c: c.index)
    b = sorted(oa.completions.create(**kw).choices, key=lambda c: c.index)
    assert [c.text for c in a] == [c.text for c in b]
    # the server's seeded sampling equals LLM's with the same seed (choice i uses seed + i)
    want = ref_llm.generate(PROMPT, max_tokens=16, temperature=1.0, top_p=1.0, seed=1234).text
    assert a[0].text == want


def test_stop_strings(oa, model_id, want_completion, ref_llm):
    text = want_completion.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assume = stop.strip()
    if not assume:
        pytest.skip("the reference text has no usable stop string")
    want = ref_llm.generate(PROMPT, max_tokens=20, temperature=0, stop=[stop])
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    chunks = list(oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                        stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_prompt_cache_reuse_keeps_output(oa, model_id, ref_llm):
    """A second turn reuses the first turn's cached prefix and still equals a fresh LLM run."""
    msgs = [{"role": "user", "content": "Give me a word that rhymes with cat."}]
    r1 = oa.chat.completions.create(model=model_id, messages=msgs, max_tokens=12, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And one that rhymes with dog?"}]
    r2 = oa.chat.completions.create(model=model_id, messages=msgs, max_tokens=12, temperature=0)
    want = ref_llm.chat(msgs, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == want.text
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 4


def test_tokenize_detokenize(client, ref_llm):
    text = "Hello, world! <|im_start|>"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    assert r.json()["tokens"] == ref_llm.tokenize(text, add_bos=False)
    r2 = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r2.status_code == 200 and r2.json()["content"] == text
    r3 = client.post("/tokenize", json={"content": "Hi", "with_pieces": True})
    assert all({"id", "piece"} <= set(p) for p in r3.json()["tokens"])


def test_health_and_metrics(client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["slots_idle"] + h["slots_processing"] == 8
    m = client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("pyfast_prompt_tokens_total", "pyfast_generation_tokens_total", "pyfast_queue_depth",
                 "pyfast_time_to_first_token_seconds_count", "pyfast_time_per_output_token_seconds_count",
                 "pyfast_spec_acceptance_rate", "pyfast_http_requests_total"):
        assert not math.isnan(metric(text, name))
    assert metric(text, "pyfast_generation_tokens_total") > 0
    assert metric(text, "pyfast_time_to_first_token_seconds_count") > 0


def test_stream_n_choices(oa, model_id, want_completion):
    chunks = list(oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, n=2,
                                        stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == {0: want_completion.text, 1: want_completion.text}


def test_echo(oa, model_id, want_completion):
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + want_completion.text


def test_logit_bias(oa, model_id, want_completion, ref_llm):
    """Banning the greedy first token (-100) makes the server pick the runner-up, exactly as LLM does
    with the same bias; a +100 bias forces a chosen token at every step."""
    first = want_completion.tokens[0]
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0,
                              logit_bias={str(first): -100})
    want = ref_llm.generate(PROMPT, max_tokens=6, temperature=0, logit_bias={first: float("-inf")})
    assert want.tokens[0] != first
    assert r.choices[0].text == want.text
    row = ref_llm.logits(want_completion.prompt_tokens)[-1].copy()
    row[first] = -np.inf
    assert want.tokens[0] == int(np.argmax(row))
    forced = ref_llm.tokenize(" blue", add_bos=False)[0]
    r = oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, temperature=0.7, seed=5,
                              logit_bias={str(forced): 100})
    assert r.usage.completion_tokens == 3
    assert ref_llm.tokenize(r.choices[0].text, add_bos=False) == [forced] * 3
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, logit_bias={"999999999": 5})
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, logit_bias={"abc": 5})
