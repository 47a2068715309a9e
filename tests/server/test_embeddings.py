"""/v1/embeddings (issue 22, item 5): pooled final hidden states, normalised, against numpy on the
hidden rows of a pyfast.Context(export_hidden=True)."""
from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.server.helpers import ServerProcess

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hi"]


@pytest.fixture(scope="module")
def hidden(smollm2_path):
    """text -> the post-final-norm hidden rows [n_tokens, n_embd] (float64), decoded alone."""
    from pyfast.context import Context
    from pyfast.models import Model
    from pyfast.tokenizer import Tokenizer

    model = Model(smollm2_path)
    tok = Tokenizer.from_gguf_metadata(model.metadata)
    ctx = Context(model, n_ctx=512, n_threads=1, export_hidden=True)
    out = {}
    for t in TEXTS:
        ids = tok.encode(t)
        ctx.clear()
        ctx.decode(ids, logits="all")
        out[t] = np.asarray(ctx.last_hidden[: len(ids)], dtype=np.float64).copy()
    return out


def _ref(h: np.ndarray, pooling: str) -> np.ndarray:
    v = {"mean": h.mean(axis=0), "last": h[-1], "cls": h[0]}[pooling]
    return v / np.linalg.norm(v)


def test_embeddings_match_numpy(main_server, hidden):
    oc = openai.OpenAI(base_url=main_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = oc.embeddings.create(model="any-embedding-model", input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, t in zip(r.data, TEXTS):
        v = np.asarray(d.embedding)
        assert v.shape == (576,)
        np.testing.assert_allclose(v, _ref(hidden[t], "mean"), atol=2e-5)
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5
    assert r.usage.prompt_tokens == sum(len(h) for h in hidden.values())
    sims = [float(np.dot(r.data[0].embedding, d.embedding)) for d in r.data]
    assert sims[0] == pytest.approx(1.0, abs=1e-5) and max(sims[1:]) < 0.999


@pytest.mark.parametrize("pooling", ["last", "cls", "mean"])
def test_pooling_modes(client, hidden, pooling):
    t = TEXTS[0]
    r = client.post("/v1/embeddings", json={"input": t, "pooling": pooling})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.asarray(r.json()["data"][0]["embedding"]), _ref(hidden[t], pooling), atol=2e-5)


def test_base64_and_token_input(client, hidden, ref_llm):
    t = TEXTS[1]
    r = client.post("/v1/embeddings", json={"input": t, "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(v, _ref(hidden[t], "mean"), atol=2e-5)
    ids = ref_llm.tokenize(t)
    r2 = client.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    np.testing.assert_allclose(r2["data"][0]["embedding"], v, atol=1e-6)


def test_server_pooling_flag(smollm2_path, hidden):
    import httpx

    with ServerProcess("-m", str(smollm2_path), "--parallel", "1", "--ctx-size", "512", "--pooling", "last") as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS[2]}, timeout=60).json()
    np.testing.assert_allclose(r["data"][0]["embedding"], _ref(hidden[TEXTS[2]], "last"), atol=2e-5)


@pytest.mark.parametrize("body,param", [({"input": ""}, "input"), ({"input": [[10**9]]}, "input"),
                                        ({"input": "a", "pooling": "max"}, "pooling"),
                                        ({"input": "a", "dimensions": 8}, "dimensions"), ({}, "input"),
                                        ({"input": "a", "encoding_format": "int8"}, "encoding_format")])
def test_bad_embedding_requests(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_while_generating(client, hidden):
    """An embedding request during generation: both answer correctly (separate contexts)."""
    import threading

    res = {}

    def gen():
        res["g"] = client.post("/v1/completions", json={"prompt": "Count: 1, 2,", "max_tokens": 40,
                                                        "temperature": 0}).status_code

    th = threading.Thread(target=gen)
    th.start()
    r = client.post("/v1/embeddings", json={"input": TEXTS[0]}).json()
    th.join()
    assert res["g"] == 200
    np.testing.assert_allclose(r["data"][0]["embedding"], _ref(hidden[TEXTS[0]], "mean"), atol=2e-5)
