"""Tool calling (issue 22, item 2) with the openai client, on small chat templates written here for
each family (the real ones are not available offline; these keep each family's call syntax):
Hermes / Qwen ``<tool_call>``, Llama 3.x JSON, Mistral ``[TOOL_CALLS]`` and the generic fallback
(a template without tool support). The model is SmolLM2 served in-process; the template is
swapped per test. ``required`` / named choices are enforced by the grammar stage, so even this
small model must produce well-formed calls whose arguments validate against the tool's schema."""
from __future__ import annotations

import json

import openai
import pytest

from pyfast.server.tools import ToolPlan, ToolStream, detect_family, parse_calls
from tests.server.helpers import ThreadServer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

HERMES = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nReturn each call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>"
    "{% for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if loop.last and tools %}Tools: {{ tools | tojson }}\nCall one as {\"name\": ..., \"parameters\": ...}\n"
    "{% endif %}{{ m.content }}<|eot_id|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{%- else %}{{ m.content }}</s>{% endif %}"
    "{%- endfor %}")
GENERIC = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAMILIES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "generic": GENERIC}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(smollm2_path), n_parallel=2, n_ctx=4096, n_threads=1))
    with ThreadServer(create_app(engine)) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _use(engine, family):
    from pyfast.chat import ChatTemplate

    engine.chat_template = ChatTemplate(FAMILIES[family], bos_token="", eos_token="<|im_end|>")
    assert detect_family(engine.chat_template.source) == family


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_required_and_named(served, family):
    engine, oc = served
    _use(engine, family)
    r = oc.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                                   temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    _check_calls(ch.message.tool_calls)
    r = oc.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    _check_calls(ch.message.tool_calls, {"get_time"})
    assert len(ch.message.tool_calls) == 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_calls_equal_non_streamed(served, family):
    engine, oc = served
    _use(engine, family)
    kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
              parallel_tool_calls=False)
    whole = oc.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oc.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert all(c["id"] for c in calls.values())


def test_tool_choice_none_and_results_fed_back(served):
    engine, oc = served
    _use(engine, "hermes")
    r = oc.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20,
                                   temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    # a call and its result go back through the template
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    import httpx

    prompt = httpx.post(str(oc.base_url).replace("/v1/", "") + "/apply-template",
                        json={"messages": msgs, "tools": TOOLS}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
    r = oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls"),
])
def test_bad_tool_requests(served, body, param):
    engine, oc = served
    _use(engine, "hermes")
    with pytest.raises(openai.BadRequestError) as ei:
        oc.chat.completions.create(model="m", **{"messages": ASK, "max_tokens": 4, **body})
    err = ei.value.body
    assert err["param"] == param, err


# --- parsing (auto mode: what a model writes unprompted) -------------------------------------------
def _plan(family, parallel=True):
    from pyfast.chat import ChatTemplate

    return ToolPlan.from_request(TOOLS, "auto", parallel, ChatTemplate(FAMILIES[family]))


@pytest.mark.parametrize("family,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
     "Let me check.", [("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "A"}}</tool_call>\n<tool_call>{"name": '
               '"get_weather", "arguments": {"city": "B", "unit": "celsius"}}</tool_call>', "",
     [("get_time", {"tz": "A"}), ("get_weather", {"city": "B", "unit": "celsius"})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}', "", [("get_time", {"tz": "CET"})]),
    ("llama3", '{"name": "get_time", "parameters": {"tz": "X"}}; {"name": "get_time", "parameters": {"tz": "Y"}}',
     "", [("get_time", {"tz": "X"}), ("get_time", {"tz": "Y"})]),
    ("llama3", "{not json at all", "{not json at all", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "EST"}}]', "Sure.",
     [("get_time", {"tz": "EST"})]),
    ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {"tz": "PST"}}]}', "",
     [("get_time", {"tz": "PST"})]),
    ("generic", '{"tool_call": {"name": "get_time", "arguments": {"tz": "PST"}}}', "",
     [("get_time", {"tz": "PST"})]),
    ("generic", "The weather is nice.", "The weather is nice.", []),
])
def test_parse_calls(family, text, content, calls):
    plan = _plan(family)
    got_content, got = parse_calls(plan, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    # streamed in small pieces: the content streamed plus finish() equals the parse
    st = ToolStream(plan)
    streamed = "".join(st.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, got2 = st.finish()
    assert [c["function"]["name"] for c in got2] == [c[0] for c in calls]
    if calls:
        assert (streamed + rest).strip() == content
        assert "<tool_call>" not in streamed and "[TOOL_CALLS]" not in streamed and "{" not in streamed
    else:
        assert streamed + rest == text
