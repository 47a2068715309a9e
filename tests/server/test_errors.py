"""Bad input gets the right 4xx with an OpenAI-style error body, and the server keeps serving."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric, no_leaks

GOOD_CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _still_serving(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=GOOD_CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


CASES = [
    # (id, path, raw body, status, param)
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not-an-object", "/v1/chat/completions", b'[1, 2]', 400, None),
    ("empty-body", "/v1/completions", b"", 400, None),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "caf\xc3\x28 \xff", "max_tokens": 1}', 400, None),
    ("lone-surrogate", "/v1/completions", b'{"prompt": "x\\ud800y", "max_tokens": 1}', 400, None),
    ("max-tokens-string", "/v1/chat/completions",
     json.dumps({**GOOD_CHAT, "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    ("max-tokens-float", "/v1/completions", b'{"prompt": "a", "max_tokens": 2.5}', 400, "max_tokens"),
    ("temperature-string", "/v1/chat/completions",
     json.dumps({**GOOD_CHAT, "temperature": "hot"}).encode(), 400, "temperature"),
    ("messages-not-list", "/v1/chat/completions", b'{"messages": "hello"}', 400, "messages"),
    ("content-number", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, None),
    ("stream-not-bool", "/v1/completions", b'{"prompt": "a", "stream": "yes"}', 400, "stream"),
    ("negative-max-tokens", "/v1/chat/completions",
     json.dumps({**GOOD_CHAT, "max_tokens": -1}).encode(), 400, "max_tokens"),
    ("huge-max-tokens", "/v1/completions", b'{"prompt": "a", "max_tokens": 1000000000}', 400, "max_tokens"),
    ("huge-max-completion-tokens", "/v1/chat/completions",
     json.dumps({**GOOD_CHAT, "max_completion_tokens": 10**7}).encode(), 400, "max_tokens"),
    ("empty-messages", "/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("message-without-content", "/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages"),
    ("message-without-role", "/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, None),
    ("empty-prompt", "/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", b'{"prompt": [1, 2, 99999999]}', 400, "prompt"),
    ("negative-token", "/v1/completions", b'{"prompt": [-5]}', 400, "prompt"),
    ("top-p-zero", "/v1/completions", b'{"prompt": "a", "top_p": 0}', 400, "top_p"),
    ("n-too-large", "/v1/completions", b'{"prompt": "a", "n": 1000}', 400, "n"),
    ("top-logprobs-too-large", "/v1/chat/completions",
     json.dumps({**GOOD_CHAT, "logprobs": True, "top_logprobs": 99}).encode(), 400, "top_logprobs"),
    ("image-part", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
                ).encode(), 400, None),
    ("detokenize-bad-id", "/detokenize", b'{"tokens": [1, -3]}', 400, "tokens"),
    ("tokenize-wrong-type", "/tokenize", b'{"content": 12}', 400, "content"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(client, case):
    _, path, body, status, param = case
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    _assert_error(r, status, param)


def test_all_bad_requests_leave_server_serving(client, main_server):
    with no_leaks(main_server.url):
        for _, path, body, _, _ in CASES:
            client.post(path, content=body, headers={"content-type": "application/json"})
    _still_serving(client)


def test_any_model_name_is_served(client):
    # llama-server's behaviour (issue 22): the one model answers any name; --strict-model-name
    # restores the 404 (tests/server/test_llama_compat.py)
    r = client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-9", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert client.post("/v1/completions", json={"prompt": "a", "model": "nope", "max_tokens": 1}).status_code == 200


def test_prompt_longer_than_context(client):
    long_text = "word " * 3000  # > 1024 tokens per slot
    err = _assert_error(client.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    err = _assert_error(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": long_text}], "max_tokens": 1}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    _still_serving(client)


def test_unknown_route_and_method(client):
    _assert_error(client.get("/v1/nothing"), 404)
    _assert_error(client.get("/v1/chat/completions"), 405)


def test_client_disconnect_mid_stream_frees_slot(client, main_server):
    before = _cancelled(client)
    with no_leaks(main_server.url, timeout=5.0):
        body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                "max_tokens": 800, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=main_server.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        n += 1
                    if n >= 4:
                        break
            # leaving the block closes the connection mid-stream
        t0 = time.monotonic()
        while client.get("/health").json()["slots_processing"]:
            assert time.monotonic() - t0 < 5, "the slot was not freed after the client left"
            time.sleep(0.02)
    assert _cancelled(client) == before + 1
    _still_serving(client)


def _cancelled(client) -> float:
    text = client.get("/metrics").text
    return metric(text, 'pyfast_requests_finished_total{reason="cancelled"}') if 'reason="cancelled"' in text else 0.0


def test_client_disconnect_non_streaming_frees_slot(client, main_server):
    before = _cancelled(client)
    with no_leaks(main_server.url, timeout=5.0):
        body = {"prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(main_server.url + "/v1/completions", json=body, timeout=0.5)
    assert _cancelled(client) == before + 1
    _still_serving(client)


@pytest.fixture(scope="module")
def guarded_server(smollm2_path, tmp_path_factory):
    """One slot, no waiting queue, API keys from a file and the command line."""
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text("# keys\nsecret-one\n\nsecret-two\n")
    with ServerProcess("-m", str(smollm2_path), "--parallel", "1", "--ctx-size", "1024", "--max-queue", "0",
                       "--api-key-file", str(keyfile), "--api-key", "cli-key") as srv:
        yield srv


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-one"},
                                     {"X-Api-Key": "nope"}])
def test_missing_or_wrong_api_key(guarded_server, headers):
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("POST", "/tokenize")):
        r = httpx.request(method, guarded_server.url + path, json=GOOD_CHAT, headers=headers, timeout=30)
        err = _assert_error(r, 401)
        assert err["type"] == "authentication_error"


@pytest.mark.parametrize("key", ["secret-one", "secret-two", "cli-key"])
def test_right_api_key(guarded_server, key):
    r = httpx.post(guarded_server.url + "/v1/chat/completions", json=GOOD_CHAT,
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url=guarded_server.url + "/v1", api_key=key, max_retries=0)
    assert oa.models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded_server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_health_needs_no_key(guarded_server):
    assert httpx.get(guarded_server.url + "/health", timeout=10).status_code == 200


def test_queue_full_is_503(guarded_server):
    auth = {"Authorization": "Bearer secret-one"}
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=guarded_server.url, timeout=60, headers=auth) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Keep the line iterator alive: abandoning it would make httpx close the connection,
            # which (correctly) cancels the request and frees the slot.
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the only slot is now busy
            busy = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            err = _assert_error(busy, 503)
            assert err["code"] == "queue_full"
    with no_leaks(guarded_server.url):
        pass
    r = httpx.post(guarded_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth,
                   timeout=60)
    assert r.status_code == 200
    m = httpx.get(guarded_server.url + "/metrics", headers=auth, timeout=10).text
    assert metric(m, 'pyfast_requests_rejected_total{reason="queue_full"}') >= 1


def test_event_loop_answers_during_long_prefill(main_server):
    """Compute runs off the event loop: /health answers while a long prompt is being decoded."""
    import threading

    body = {"prompt": "stone " * 900, "max_tokens": 1, "temperature": 0}
    t = threading.Thread(target=lambda: httpx.post(main_server.url + "/v1/completions", json=body, timeout=300))
    t.start()
    try:
        busy_seen, worst = False, 0.0
        t_end = time.monotonic() + 60
        while t.is_alive() and time.monotonic() < t_end:
            t0 = time.monotonic()
            h = httpx.get(main_server.url + "/health", timeout=30).json()
            worst = max(worst, time.monotonic() - t0)
            busy_seen |= h["slots_processing"] > 0
            time.sleep(0.05)
        assert busy_seen
        assert worst < 1.0, worst
    finally:
        t.join(300)
