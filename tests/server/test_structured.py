"""Constrained output through the server (issue 22, item 1): JSON mode, JSON Schema
(``response_format`` and llama-server's ``json_schema``), GBNF ``grammar`` and ``regex``; every
output under a schema validates with jsonschema; invalid schemas and grammars are 400s naming the
field."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

S = {"type": "string", "maxLength": 12}

SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                      "y": {"type": "number", "minimum": -10, "maximum": 10}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 999},
                                                                                "email": S},
                                               "required": ["id", "email"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}},
     "required": ["kind", "v"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                           {"type": "string", "maxLength": 8}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": S, "q": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n", "q"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 1, "maximum": 10},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5}},
     "required": ["title", "year", "rating"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": ["string", "null"], "maxLength": 6}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"k": {"type": "boolean"}},
                                            "required": ["k"], "additionalProperties": False},
                                      "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
     "required": ["m", "l"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/$defs/pt"}},
     "required": ["p", "q"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer",
                                                                                         "minimum": 0,
                                                                                         "maximum": 1000}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
     "required": ["word"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": S}, "required": ["flag"],
     "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"cat": {"const": "a"}}, "required": ["cat"],
                "additionalProperties": False},
               {"type": "object", "properties": {"dog": {"type": "integer", "minimum": 0, "maximum": 5}},
                "required": ["dog"], "additionalProperties": False}]},
]


@pytest.fixture(scope="module")
def oc(main_server):
    return openai.OpenAI(base_url=main_server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_at_least_20_schemas():
    assert len(SCHEMAS) >= 20
    for s in SCHEMAS:
        jsonschema.validators.validator_for(s).check_schema(s)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_output_validates(oc, i):
    schema = SCHEMAS[i]
    r = oc.chat.completions.create(
        model="any", max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Reply with JSON for this schema: " + json.dumps(schema)}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch.message.content
    jsonschema.validate(json.loads(ch.message.content), schema)


def test_sampled_outputs_validate(client):
    """Sampling (temperature 1, several seeds) under a schema: still always valid. (A schema with
    a free-precision number is avoided: sampling may write digits until max_tokens.)"""
    schema = SCHEMAS[6]
    for seed in range(4):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "A user as JSON."}], "max_tokens": 200, "temperature": 1.0,
            "seed": seed, "json_schema": schema}).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)


def test_json_mode_and_streaming(oc):
    msgs = [{"role": "user", "content": "Describe a cat as JSON."}]
    r = oc.chat.completions.create(model="x", messages=msgs, max_tokens=300, temperature=0,
                                   response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert text.startswith("{")
    schema = SCHEMAS[0]
    parts = [c.choices[0].delta.content or "" for c in oc.chat.completions.create(
        model="x", messages=msgs, max_tokens=100, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}) if c.choices]
    jsonschema.validate(json.loads("".join(parts)), schema)


def test_llama_server_fields(client):
    """llama-server's json_schema / grammar on /completion and /v1/completions, and a regex."""
    r = client.post("/completion", json={"prompt": "Answer yes or no: is the sky blue?", "n_predict": 20,
                                         "temperature": 0, "grammar": 'root ::= ("yes" | "no") "."'}).json()
    assert r["content"] in ("yes.", "no.") and r["stop_type"] == "eos"
    r = client.post("/v1/completions", json={"prompt": "A person: ", "max_tokens": 100, "temperature": 0,
                                             "json_schema": SCHEMAS[6]}).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMAS[6])
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "A phone number?"}],
                                                  "max_tokens": 30, "temperature": 0,
                                                  "regex": "[0-9]{3}-[0-9]{4}"}).json()
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r["choices"][0]["message"]["content"])
    gbnf = 'root ::= item ("," item)*\nitem ::= [a-z]+'
    r = client.post("/completion", json={"prompt": "List fruits:", "n_predict": 12, "temperature": 0,
                                         "grammar": gbnf}).json()
    assert re.fullmatch(r"[a-z]+(,[a-z]+)*,?[a-z]*", r["content"]), r["content"]


@pytest.mark.parametrize("body,param,needle", [
    ({"json_schema": {"type": "nope"}}, "json_schema", "invalid JSON schema"),
    ({"json_schema": {"properties": {"a": {"minimum": "x"}}}}, "json_schema", "invalid JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"grammar": "root ::= foo"}, "grammar", "foo"),
    ({"grammar": "root ::= \"unterminated"}, "grammar", "GBNF"),
    ({"grammar": ""}, "grammar", "empty"),
    ({"regex": "(abc"}, "regex", "regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}, "grammar", "only one"),
])
def test_invalid_constraint_is_400(client, body, param, needle):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle.lower() in err["message"].lower(), err
    if "response_format" not in body and "regex" not in body:
        r = client.post("/completion", json={"prompt": "hi", "n_predict": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_server_still_serves_after_bad_constraints(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "temperature": 0})
    assert r.status_code == 200
    with httpx.Client(base_url=str(client.base_url), timeout=60) as c2:
        assert c2.get("/health").status_code == 200


def test_speculative_server_under_schema(smollm2_path, client):
    """A server speculating with ngram-simple gives the same greedy output under a schema as the
    plain server (the verifier samples the rows through the grammar), and sampled output stays
    valid."""
    from tests.server.helpers import ServerProcess

    schema = {"type": "object", "properties": {"list": {"type": "array", "maxItems": 6, "items": {
        "type": "string", "maxLength": 8}}}, "required": ["list"], "additionalProperties": False}
    body = {"prompt": 'Repeat: {"list":["pear","pear","pear","pear"]} Again: ', "max_tokens": 60,
            "temperature": 0, "json_schema": schema}
    want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with ServerProcess("-m", str(smollm2_path), "--parallel", "2", "--ctx-size", "2048", "--spec-type",
                       "ngram-simple", "--draft-max", "4") as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["text"] == want
        assert r["timings"]["draft_n"] > 0
        for seed in range(3):
            r = httpx.post(s.url + "/v1/completions", json={**body, "temperature": 1.0, "seed": seed},
                           timeout=120).json()
            if r["choices"][0]["finish_reason"] == "stop":
                jsonschema.validate(json.loads(r["choices"][0]["text"]), schema)
    jsonschema.validate(json.loads(want), schema)
