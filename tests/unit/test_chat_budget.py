"""Chat templates render under a budget (issue 21): no constant folding, sizes checked before
anything is built, a wall-clock limit per render and a stop when the request is gone. Each
hostile template must end in a clear one-line error within 2 s and 100 MB."""
from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from pyfast.chat import ChatTemplate

CONVO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
LIMIT_S = 2.0
LIMIT_BYTES = 100 << 20

# (template, what the error says)
HOSTILE = [
    ("{{ '%1000000000d' % 1 }}", "% format"),
    ("{{ '%*d' % (1000000000, 1) }}", "% format width"),
    ("{{ '%.1000000000f' % 1.5 }}", "% format"),
    ("{{ messages|tojson(indent=10**9) }}", "tojson: indent"),
    ("{{ 'x'|center(10**9) }}", "center"),
    ("{{ 'x'.center(10**9) }}", "str.center"),
    ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    ("{{ 'x'.rjust(10**9) }}", "str.rjust"),
    ("{{ '1'.zfill(10**9) }}", "str.zfill"),
    ("{{ ('\t' * 100000).expandtabs(100000) }}", "str.expandtabs"),
    ("{{ ('a' * 1000000)|replace('a', 'b' * 1000) }}", "replace"),
    ("{{ ('a' * 1000000).replace('a', 'b' * 1000) }}", "replace"),
    ("{{ ('x' * 1000000)|replace('', 'yy' * 100) }}", "replace"),
    ("{{ (['x' * 1000000] * 1000)|join }}", "join"),
    ("{{ ''.join(['x' * 1000000] * 1000) }}", "str.join"),
    ("{{ '%1000000000s'|format(1) }}", "% format"),
    ("{{ '{:>1000000000}'.format(1) }}", "format spec"),
    ("{{ '{0:{1}}'.format(1, 1000000000) }}", "format spec"),
    ("{{ ('a\n' * 1000000)|indent(1000) }}", "indent"),
    ("{{ [1]|batch(10**9, 'x')|list }}", "batch size"),
    ("{{ [1]|slice(10**9, 'x')|list }}", "slice count"),
    ("{{ ['x' * 4000000] * 1000 }}", "output"),
    ("{{ (['x' * 4000000] * 1000)|string }}", "filter input"),
    ("{{ 'x' * 10**9 }}", "*"),
    ("{{ lipsum(n=10**6, max=10**6) }}", "lipsum"),
    ("{{ strftime_now('%c' * 10**6) }}", "strftime_now"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% for c in x %}{% endfor %}{% endfor %}"
     "{% endfor %}", "longer than"),
    ("{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ("{% macro f(n) %}{% if n < 30 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
     "longer than"),
    ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ 'x', n - 1) }}{% endif %}{% endmacro %}{{ f('y' * 4000000, 900) }}",
     "built more than"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 4000000] %}"
     "{% endfor %}{{ ns.l|length }}", "too large"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "too large"),
    # every frame of a deep recursion holding its own copy (a slice) of a big string
    ("{% macro f(s, n) %}{% if n > 0 %}{{ f(s[1:], n - 1) }}{% endif %}{% endmacro %}{{ f('y' * 8000000, 900) }}",
     "built more than"),
    ("{% set ns = namespace(a='x' * 8000000, b='y' * 8000000, c='z' * 8000000) %}{{ ns }}", "too large"),
    # a big string turned into many small objects
    ("{{ ('x' * 10000000)|list|length }}", "as a sequence"),
    ("{{ ('ab ' * 5000000).split()|length }}", "str.split: more than"),
    ("{{ ('ab\n' * 5000000).splitlines()|length }}", "str.splitlines: more than"),
    ("{{ ('ab\n' * 5000000)|indent(0)|length }}", "indent: more than"),
    ("{{ ('ab ' * 5000000)|wordwrap(10)|length }}", "wordwrap: input longer"),
    # output captured by a block set / a macro body is joined under the size check
    ("{% set s = 'x' * 10000000 %}{% set x %}{% for i in range(1000) %}{{ s }}{% endfor %}{% endset %}{{ x|length }}",
     "captured output too large"),
    ("{% macro m() %}{% for i in range(100000) %}" + "literal text " * 100 + "{% endfor %}{% endmacro %}"
     "{{ m()|length }}", "captured output too large"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% for i in range(100000) %}{{ 'x' * 1000 }}"
     "{% endfor %}", "too large"),
]


def _measure(fn):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        try:
            fn()
            err = None
        except ValueError as e:
            err = e
        dt = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return err, dt, peak


@pytest.mark.parametrize("src, what", HOSTILE, ids=[f"t{i}" for i in range(len(HOSTILE))])
def test_hostile_template_ends_in_a_clear_error(src, what):
    err, dt, peak = _measure(lambda: ChatTemplate(src).render(CONVO))
    assert err is not None, f"rendered without error: {src}"
    msg = str(err)
    assert msg.startswith("chat template error: ") and "\n" not in msg, msg
    assert what in msg, msg
    assert dt < LIMIT_S, (dt, src)
    assert peak < LIMIT_BYTES, (peak, src)


def test_constant_expressions_are_not_folded_at_compile_time():
    """The issue's worst case: 28 s and 4 GB at LLM() start, even with --raw, from a branch that
    never runs. Compiling and rendering it now costs nothing."""
    src = "{% if false %}{{ '%1000000000d' % 1 }}{{ 'x' * 10**10 }}{{ 'a'|center(10**10) }}{% endif %}ok"
    err, dt, peak = _measure(lambda: ChatTemplate(src).render(CONVO))
    assert err is None and dt < 0.5 and peak < 10 << 20, (err, dt, peak)
    assert ChatTemplate(src).render(CONVO) == "ok"


def test_budget_errors_reach_the_caller_of_a_compiled_constant():
    # folded, this raised at construction (or hung); now it fails when (and only if) it runs
    t = ChatTemplate("{% if messages|length > 5 %}{{ 'x' * 10**10 }}{% endif %}{{ messages|length }}")
    assert t.render(CONVO) == "2"
    with pytest.raises(ValueError, match="chat template error: .*too large"):
        t.render(CONVO * 3)


def test_time_limit_is_per_render_and_configurable():
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"longer than its 0.2 s limit"):
        ChatTemplate(src, time_limit=0.2).render(CONVO)
    assert time.perf_counter() - t0 < 0.6
    with pytest.raises(ValueError, match=r"longer than its 0.1 s limit"):
        ChatTemplate(src).render(CONVO, time_limit=0.1)


def test_render_stops_when_the_request_is_gone():
    gone = threading.Event()
    src = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"
    threading.Timer(0.1, gone.set).start()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="request was cancelled"):
        ChatTemplate(src, time_limit=30).render(CONVO, should_stop=gone.is_set)
    assert time.perf_counter() - t0 < 0.5


def test_ordinary_templates_are_unaffected():
    t = ChatTemplate("{% for m in messages %}{{ '%-10s|' % m.role }}{{ '{:>3}'.format(loop.index) }}"
                     "{{ m.content|center(9)|replace(' ', '.') }}{{ m|tojson(indent=2)|length > 0 }}"
                     "{{ [m.role, m.content]|join(',') ~ '!' }}{% endfor %}{{ 'ab' * 3 }}{{ 2 ** 10 }}")
    out = t.render(CONVO)
    assert out.startswith("user      |  1....hi...Trueuser,hi!assistant |  2..hello..True")
    assert out.endswith("ababab1024")


def test_real_template_renders_a_long_conversation_quickly(smollm2_metadata):
    t = ChatTemplate.from_metadata(smollm2_metadata)
    convo = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 2000} for i in range(200)]
    t0 = time.perf_counter()
    out = t.render(convo)
    assert time.perf_counter() - t0 < 0.5
    assert out.count("<|im_start|>") == 202  # the default system message, 200 turns, the prompt
