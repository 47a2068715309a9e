"""llama-server compatibility (issue 22, item 4) and CORS (item 3), through real HTTP on loopback.

Preflights and response headers are checked with httpx as a browser sends and reads them, and
``test_cors_from_browser`` runs a page in headless Chromium (skipped when Chromium is not
installed; ``apt-get install chromium``) served from another loopback port that calls the API
with fetch.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    with ServerProcess("-m", str(smollm2_path), "--parallel", "2", "--ctx-size", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def strict_srv(smollm2_path):
    """Strict names, an alias, server-side defaults and CORS for one exact origin and localhost."""
    with ServerProcess("-m", str(smollm2_path), "--parallel", "2", "--ctx-size", "2048", "--strict-model-name",
                       "-a", "mymodel", "-n", "5", "--temp", "1.0", "--seed", "1234",
                       "--cors-origins", "localhost,https://app.example:8443", "--api-key", "k1") as s:
        yield s


@pytest.fixture
def c(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as cl:
        yield cl


# --- model names -----------------------------------------------------------------------------
def test_any_model_name_and_models_list(srv):
    oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    ids = [m.id for m in oc.models.list().data]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1"]
    for name in ("gpt-4o", "llama", ids[0]):
        r = oc.chat.completions.create(model=name, **CHAT)
        assert r.choices[0].message.content


def test_strict_model_name(strict_srv):
    h = {"Authorization": "Bearer k1"}
    r = httpx.post(strict_srv.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}, headers=h, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(strict_srv.url + "/v1/chat/completions", json={**CHAT, "model": "mymodel"}, headers=h, timeout=60)
    assert r.status_code == 200
    assert httpx.get(strict_srv.url + "/v1/models", headers=h).json()["data"][0]["id"] == "mymodel"


# --- /tokenize, content parts, /apply-template ---------------------------------------------------
def test_tokenize_bos_follows_vocabulary(c, ref_llm):
    tok = ref_llm.tokenizer
    assert tok.add_bos is False  # SmolLM2: tokenizer.ggml.add_bos_token is false
    got = c.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    assert got == tok.encode("Hello world", add_bos=False)
    assert tok.bos_id is not None and got[0] != tok.bos_id
    assert c.post("/tokenize", json={"content": "Hello world"}).json()["tokens"] == got


def test_tokenize_bos_when_vocabulary_wants_it(smollm2_path):
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig
    from tests.server.helpers import ThreadServer

    engine = Engine(EngineConfig(model=str(smollm2_path), n_parallel=1, n_ctx=512, n_threads=1))
    engine.tokenizer.add_bos = True  # as a GGUF with tokenizer.ggml.add_bos_token = true
    with ThreadServer(create_app(engine)) as s:
        got = httpx.post(s.url + "/tokenize", json={"content": "Hello", "add_special": True}).json()["tokens"]
        plain = httpx.post(s.url + "/tokenize", json={"content": "Hello", "add_special": False}).json()["tokens"]
    assert got[0] == engine.tokenizer.bos_id and got[1:] == plain


def test_content_parts_joined_with_newline(c):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]}]
    prompt = c.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert "What is\nthe best book" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_assistant_prefill(c, ref_llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    prompt = c.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert prompt.endswith("The capital of France is")
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0}).json()
    want = ref_llm.generate(prompt, max_tokens=4, temperature=0)
    assert r["choices"][0]["message"]["content"] == want.text
    assert r["usage"]["prompt_tokens"] == len(ref_llm.tokenize(prompt))
    # vLLM's explicit flags: continue_final_message, or add_generation_prompt without it
    r2 = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0,
                                               "continue_final_message": True}).json()
    assert r2["choices"][0]["message"]["content"] == want.text
    # continue_final_message=False: a new assistant turn after the given one
    p3 = c.post("/apply-template", json={"messages": msgs, "continue_final_message": False}).json()["prompt"]
    assert p3.endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    bad = c.post("/v1/chat/completions", json={"messages": msgs[:1], "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


# --- POST /completion, /props, /slots -------------------------------------------------------------
def test_completion_native(c, ref_llm):
    prompt = "The capital of France is"
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 7, "temperature": 0, "cache_prompt": True})
    assert r.status_code == 200, r.text
    b = r.json()
    want = ref_llm.generate(prompt, max_tokens=7, temperature=0, ignore_eos=False)
    assert b["content"] == want.text
    assert b["tokens"] == want.tokens and b["tokens_predicted"] == len(want.tokens)
    assert b["stop"] is True and b["stop_type"] in ("limit", "eos")
    assert b["tokens_evaluated"] == len(ref_llm.tokenize(prompt))
    t = b["timings"]
    assert t["predicted_n"] == len(want.tokens) and t["prompt_n"] + t["cache_n"] == b["tokens_evaluated"]
    assert b["generation_settings"]["params"]["n_predict"] == 7


def test_completion_stop_word_probs_and_token_prompt(c, ref_llm):
    ids = ref_llm.tokenize("1, 2, 3, 4, 5,")
    full = ref_llm.generate(ids, max_tokens=12, temperature=0).text
    word = full.strip().split(",")[1].strip()  # a number the model writes (after the first one)
    assert word
    b = c.post("/completion", json={"prompt": ids, "n_predict": 12, "temperature": 0, "stop": [word],
                                    "n_probs": 3}).json()
    assert b["stop_type"] == "word" and b["stopping_word"] == word
    assert b["content"] == full[:full.index(word)]
    probs = b["completion_probabilities"]
    assert len(probs) == len(b["tokens"]) and all(len(p["top_logprobs"]) == 3 for p in probs)
    assert all(p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][1]["logprob"] for p in probs)
    assert all(p["id"] == t for p, t in zip(probs, b["tokens"]))
    # a prompt mixing text and ids is tokenized in place
    mixed = c.post("/completion", json={"prompt": [ids[0], ref_llm.detokenize(ids[1:])], "n_predict": 3,
                                        "temperature": 0}).json()
    assert mixed["tokens_evaluated"] == len(ids)


def test_completion_stream(c):
    body = {"prompt": "Once upon a time", "n_predict": 10, "temperature": 0, "stream": True}
    chunks = []
    with c.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert chunks and chunks[-1]["stop"] is True and "timings" in chunks[-1]
    assert all(ch["stop"] is False for ch in chunks[:-1])
    whole = c.post("/completion", json={**body, "stream": False}).json()
    assert "".join(ch["content"] for ch in chunks) == whole["content"]
    assert [t for ch in chunks for t in ch["tokens"]] == whole["tokens"]


def test_completion_bad_input(c):
    for body, param in (({"prompt": "a", "n_predict": -5}, "n_predict"), ({"prompt": [10**9]}, "prompt"),
                        ({"prompt": "a", "n_probs": 500}, "n_probs"), ({"n_predict": 3}, "prompt")):
        r = c.post("/completion", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param


def test_props_and_slots(c):
    p = c.get("/props").json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == 1024
    assert "<|im_start|>" in p["chat_template"] and p["model_alias"] == "SmolLM2-135M-Instruct.Q4_1"
    s = c.get("/slots").json()
    assert [x["id"] for x in s] == [0, 1] and all(x["n_ctx"] == 1024 and not x["is_processing"] for x in s)


def test_server_defaults(strict_srv):
    """--n-predict caps replies that set no limit; --temp / --seed apply when the request sets none."""
    h = {"Authorization": "Bearer k1"}
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "ignore_eos": True}
    r1 = httpx.post(strict_srv.url + "/v1/chat/completions", json=body, headers=h, timeout=60).json()
    r2 = httpx.post(strict_srv.url + "/v1/chat/completions", json=body, headers=h, timeout=60).json()
    assert r1["usage"]["completion_tokens"] == 5  # -n 5
    assert r1["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]  # --seed 1234
    other = [httpx.post(strict_srv.url + "/v1/chat/completions", json={**body, "seed": s}, headers=h,
                        timeout=60).json()["choices"][0]["message"]["content"] for s in (1, 2, 3)]
    assert len(set(other + [r1["choices"][0]["message"]["content"]])) > 1  # --temp 1.0 samples
    n = httpx.post(strict_srv.url + "/completion", json={"prompt": "Hello", "ignore_eos": True}, headers=h,
                   timeout=60).json()
    assert n["tokens_predicted"] == 5


# --- CORS --------------------------------------------------------------------------------------
def _preflight(url, origin, method="POST", headers="content-type, authorization"):
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})


def test_cors_default_localhost_only(srv, c):
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8000", "https://localhost"):
        r = _preflight(srv.url, origin)
        assert r.status_code == 204, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    for origin in ("http://evil.example", "http://localhost.evil.example", "null"):
        r = _preflight(srv.url, origin)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, origin
    # headers on real responses: success, streaming, errors
    o = {"Origin": "http://localhost:3000"}
    r = c.post("/v1/chat/completions", json=CHAT, headers=o)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "origin" in r.headers["vary"].lower()
    with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=o) as s:
        assert s.headers["access-control-allow-origin"] == "http://localhost:3000"
        s.read()
    for resp in (c.post("/v1/chat/completions", json={"messages": []}, headers=o), c.get("/nothing", headers=o),
                 c.get("/health", headers=o), c.get("/v1/models", headers=o)):
        assert resp.headers.get("access-control-allow-origin") == "http://localhost:3000", resp.status_code
    r = c.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_configured_origins_and_auth(strict_srv):
    url = strict_srv.url
    assert _preflight(url, "https://app.example:8443").status_code == 204  # no key needed for a preflight
    assert _preflight(url, "http://localhost:9999").status_code == 204
    assert _preflight(url, "https://app.example").status_code == 403  # other port: another origin
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example:8443"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example:8443"


def test_cors_star(smollm2_path):
    with ServerProcess("-m", str(smollm2_path), "--parallel", "1", "--ctx-size", "512", "--cors-origins", "*") as s:
        r = _preflight(s.url, "https://anything.example")
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "https://anything.example"})
        assert r.headers["access-control-allow-origin"] == "*"


def test_cors_bad_flag(smollm2_path):
    with pytest.raises(RuntimeError, match="cors-origins"):
        ServerProcess("-m", str(smollm2_path), "--cors-origins", "not an origin", startup_timeout=60)


# --- CORS from a real browser (headless Chromium, when installed) ------------------------------
PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
fetch("%s/v1/chat/completions", {method: "POST",
  headers: {"Content-Type": "application/json", "Authorization": "Bearer k1"},
  body: JSON.stringify({model: "mymodel", messages: [{role: "user", content: "Say hi"}], max_tokens: 3, temperature: 0})})
 .then(r => r.json().then(j => { document.getElementById("out").textContent = "OK " + r.status + " " + j.object; }))
 .catch(e => { document.getElementById("out").textContent = "BLOCKED " + e; });
</script></body></html>"""


def _browser_fetch(api_url: str, tmp_path) -> str:
    import re
    import shutil
    import subprocess
    import sys

    from tests.server.helpers import free_port

    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("no Chromium installed")
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "page.html").write_text(PAGE % api_url)
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                            "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        for _ in range(100):  # wait for the page server
            try:
                httpx.get(f"http://127.0.0.1:{port}/page.html", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=" + str(tmp_path / "p"),
                            "--virtual-time-budget=30000", "--dump-dom", f"http://127.0.0.1:{port}/page.html"],
                           capture_output=True, text=True, timeout=120)
        m = re.search(r'<pre id="out">(.*?)</pre>', r.stdout, re.S)
        assert m, r.stdout[-2000:] + r.stderr[-2000:]
        return m.group(1)
    finally:
        web.terminate()
        web.wait(10)


def test_cors_from_browser(strict_srv, smollm2_path, tmp_path):
    """A page on another loopback port calls the API with fetch (a preflighted POST with an
    Authorization header): allowed by the default localhost policy, blocked by a policy that
    does not list the page's origin."""
    assert _browser_fetch(strict_srv.url, tmp_path) == "OK 200 chat.completion"
    with ServerProcess("-m", str(smollm2_path), "--parallel", "1", "--ctx-size", "512", "--api-key", "k1",
                       "-a", "mymodel", "--cors-origins", "https://app.example") as s:
        assert _browser_fetch(s.url, tmp_path / "b").startswith("BLOCKED")
