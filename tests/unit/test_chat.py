"""Chat templates: SmolLM2's real template, the ChatML fallback, HF-compatible helpers, message
validation, and hostile templates that must fail without touching Python internals or files."""
from __future__ import annotations

import datetime

import pytest

from pyfast.chat import CHATML_TEMPLATE, ChatTemplate


CONVO = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def smol_md(smollm2_metadata):
    return smollm2_metadata


# ---------------------------------------------------------------------------------------------
# real template
# ---------------------------------------------------------------------------------------------

def test_smollm2_template_two_turns(smol_md):
    from pyfast.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(smol_md)
    tmpl = ChatTemplate.from_metadata(smol_md, tok)
    assert not tmpl.is_fallback
    assert tmpl.bos_token == "<|im_start|>" and tmpl.eos_token == "<|im_end|>"
    sys = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n")
    expect = (sys
              + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
              + "<|im_start|>assistant\n4<|im_end|>\n"
              + "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
              + "<|im_start|>assistant\n")
    assert tmpl.render(CONVO) == expect
    no_prompt = expect[:-len("<|im_start|>assistant\n")]
    assert tmpl.render(CONVO, add_generation_prompt=False) == no_prompt
    # an explicit system message replaces the default one
    out = tmpl.render([{"role": "system", "content": "Be brief."}] + CONVO[:1])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                   "<|im_end|>\n<|im_start|>assistant\n")
    # the rendered prompt tokenizes with the chat tokens as single control tokens
    ids = tok.encode(tmpl.render(CONVO))
    assert ids.count(tok.bos_id) == 5 and ids.count(tok.eos_id) == 4


def test_from_metadata_without_tokenizer(smol_md):
    tmpl = ChatTemplate.from_metadata(smol_md)
    assert tmpl.bos_token == "<|im_start|>" and tmpl.eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------------------
# fallback and HF-compatible environment
# ---------------------------------------------------------------------------------------------

def test_chatml_fallback():
    md = {"tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 1}
    tmpl = ChatTemplate.from_metadata(md)
    assert tmpl.is_fallback and tmpl.source == CHATML_TEMPLATE
    assert tmpl.bos_token == "<s>" and tmpl.eos_token == "</s>"
    assert tmpl.render(CONVO[:2]) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert ChatTemplate(None).render(CONVO[:1], add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert ChatTemplate("").is_fallback


def test_named_template():
    md = {"tokenizer.chat_template": "A", "tokenizer.chat_template.tool_use": "B{{ tools|length }}"}
    assert ChatTemplate.from_metadata(md, name="tool_use").render([], tools=[{"a": 1}]) == "B1"
    with pytest.raises(ValueError, match="rag"):
        ChatTemplate.from_metadata(md, name="rag")


def test_bos_eos_and_kwargs():
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ extra }}",
                     bos_token="<s>", eos_token="</s>")
    assert t.render(CONVO[:1], extra="!") == "<s>What is 2+2?</s>!"
    assert t.render(CONVO[:1], bos_token="") == "What is 2+2?</s>"


def test_trim_and_lstrip_blocks():
    src = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
           "    {% endif %}\n{% endfor %}")
    assert ChatTemplate(src).render(CONVO) == "[What is 2+2?]\n[And 3+3?]\n"


def test_tojson_keeps_unicode_and_does_not_escape_html():
    t = ChatTemplate("{{ tools|tojson }}|{{ {'k': [1, 2]}|tojson(indent=2) }}")
    tools = [{"name": "météo", "description": "<weather> & 'rain' ☔"}]
    out = t.render([], tools=tools)
    assert out.startswith('[{"name": "météo", "description": "<weather> & \'rain\' ☔"}]|')
    assert out.endswith('{\n  "k": [\n    1,\n    2\n  ]\n}')


def test_strftime_now_and_raise_exception():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render([]) == str(datetime.date.today().year)
    t = ChatTemplate("{% if messages[0].role != 'system' %}"
                     "{{ raise_exception('first message must be system') }}{% endif %}ok")
    with pytest.raises(ValueError, match="chat template error: first message must be system"):
        t.render(CONVO)
    assert t.render([{"role": "system", "content": "s"}]) == "ok"


def test_loop_controls_and_generation_tag():
    src = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
           "{% generation %}{{ m.content }};{% endgeneration %}{% endfor %}")
    assert ChatTemplate(src).render(CONVO) == "What is 2+2?;4;"


def test_tools_and_tool_calls():
    src = ("{% if tools %}T={{ tools[0].function.name }};{% endif %}"
           "{% for m in messages %}{% if m.tool_calls %}"
           "{% for c in m.tool_calls %}call {{ c.function.name }}{% endfor %}"
           "{% else %}{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": {}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    assert ChatTemplate(src).render(msgs, tools=tools) == (
        "T=get_weather;user:weather?;call get_weather" "tool:sunny;")
    assert ChatTemplate(src).render(msgs[:1]) == "user:weather?;"  # tools=None is falsy


def test_namespace_counters_still_work():
    src = ("{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
           "{% set ns.s = ns.s + m.role[0] %}{% endfor %}{{ ns.n }}{{ ns.s }}")
    assert ChatTemplate(src).render(CONVO) == "3uau"


def test_template_does_not_mutate_messages():
    msgs = [dict(m) for m in CONVO]
    ChatTemplate("{% set x = messages[0] %}{{ x.content }}").render(msgs)
    assert msgs == CONVO


# ---------------------------------------------------------------------------------------------
# validation and errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages,match", [
    ("hello", "list"),
    ({"role": "user", "content": "x"}, "list"),
    (None, "list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], "role"),
    ([{"role": "", "content": "x"}], "role"),
    ([{"role": 3, "content": "x"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": "user", "content": 12}], "content"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        ChatTemplate(None).render(messages)


def test_bad_tools():
    with pytest.raises(ValueError, match="tools"):
        ChatTemplate(None).render(CONVO, tools="get_weather")
    with pytest.raises(ValueError, match="tools"):
        ChatTemplate(None).render(CONVO, tools=["get_weather"])


def test_syntax_error_raises_at_construction():
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_runtime_errors_are_value_errors():
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CONVO)
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ 1 // 0 }}").render(CONVO)
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ undefined_thing.attr }}").render(CONVO)


# ---------------------------------------------------------------------------------------------
# hostile templates (a GGUF is untrusted input)
# ---------------------------------------------------------------------------------------------

HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages|attr('__class__') }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ range(10**9)|list|length }}",
    "{{ 'A' * 10**12 }}",
    "{{ [1] * 10**12 }}",
    "{{ 7 ** 10000000 }}",
    # exponential growth through a namespace, macro recursion or list concatenation
    "{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
    "{% endmacro %}{{ f('ab', 200) }}",
    "{% set ns = namespace(s=[1]) %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
]


@pytest.mark.parametrize("src", HOSTILE)
def test_hostile_template_fails(src):
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate(src).render(CONVO)


def test_hostile_template_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}",
        f"{{{{ joiner.__init__.__globals__['os'].popen('touch {marker}').read() }}}}",
        "{{ ''.__class__.__mro__[1].__subclasses__()[0].__init__.__globals__['__builtins__']"
        f"['__import__']('os').system('touch {marker}') }}}}",
        f"{{{{ lipsum.__globals__['os'].system('touch {marker}') }}}}",
    ]
    for src in payloads:
        with pytest.raises(ValueError):
            ChatTemplate(src).render(CONVO)
    assert not marker.exists()


def test_hostile_template_cannot_read_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    for src in (f"{{% include '{secret}' %}}",
                f"{{% import '{secret}' as s %}}",
                f"{{% extends '{secret}' %}}",
                f"{{% from '{secret}' import x %}}"):
        with pytest.raises(ValueError) as ei:
            ChatTemplate(src).render(CONVO)
        assert "TOP-SECRET-VALUE" not in str(ei.value)
    with pytest.raises(ValueError):
        ChatTemplate(f"{{{{ cycler.__init__.__globals__.open('{secret}').read() }}}}").render(CONVO)


def test_template_bos_dropped_when_the_vocabulary_adds_it():
    """A template that writes {{ bos_token }} first, for a vocabulary that adds BOS itself (Gemma,
    Llama 3): the rendered text drops it (as llama.cpp does), so the prompt holds one BOS. Without
    add_bos nothing changes."""
    src = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    msgs = [{"role": "user", "content": "<bos>hi"}]
    assert ChatTemplate(src, bos_token="<bos>", strip_bos=True).render(msgs) == "[<bos>hi]"
    assert ChatTemplate(src, bos_token="<bos>").render(msgs) == "<bos>[<bos>hi]"
    # a leading BOS text goes whoever wrote it (as in llama.cpp); the tokenizer then adds its own
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert ChatTemplate(plain, bos_token="<bos>", strip_bos=True).render(msgs) == "hi"
    md = {"tokenizer.chat_template": src, "tokenizer.ggml.tokens": ["<pad>", "<bos>"],
          "tokenizer.ggml.bos_token_id": 1}
    assert ChatTemplate.from_metadata({**md, "tokenizer.ggml.add_bos_token": True}).render(msgs) == "[<bos>hi]"
    assert ChatTemplate.from_metadata({**md, "tokenizer.ggml.add_bos_token": False}).render(msgs) == "<bos>[<bos>hi]"
