"""The jinja2 environment chat templates run in, and the budget every render runs under.

A chat template comes from a GGUF, which is untrusted input. On top of jinja2's
``ImmutableSandboxedEnvironment`` (no unsafe attributes, no mutation of lists / dicts):

* **No constant folding.** jinja2 evaluates constant expressions while compiling (so
  ``{% if false %}{{ '%1000000000d' % 1 }}{% endif %}`` used to cost 4 GB before any render).
  Every literal is wrapped in an identity filter that takes the context (jinja2 never folds
  those), and the optimizer is off, so all template code runs at render time, under the budget.
* **Sizes are checked before anything is built.** Operators (``+ * % ** ~``), filters (``center``,
  ``indent``, ``replace``, ``join``, ``format``, ``tojson``, ``batch``, ...), string methods
  (``ljust``, ``rjust``, ``zfill``, ``center``, ``expandtabs``, ``replace``, ``join``,
  ``format``...), format specs (``{:>1000000000}``, ``%*d``) and stringification of containers
  estimate their result first and raise when it would pass ``MAX_VALUE`` bytes.
* **A budget per render** (:class:`Budget`): the bytes built by template operations are counted
  (``max_alloc``, so a template cannot keep many large values alive), and a wall-clock deadline
  plus a ``should_stop`` callback (the request is gone) are checked on every loop iteration,
  call, attribute access, operator and filter.

Budget problems raise :class:`TemplateBudgetError` (a ``SecurityError``); ``pyfast.chat`` turns
every template failure into a one-line ``ValueError``.
"""
from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import sys
import time
from datetime import datetime
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

MAX_VALUE = 16 << 20        # bytes: any one string / container a template builds or stringifies
MAX_ITEMS = 1 << 18         # items in a list / tuple / dict a template builds (or pieces a string splits into)
MAX_ALLOC = 64 << 20        # bytes built by template operations in one render (at least)
MAX_INT_BITS = 1 << 16      # size of integers from * and **
MAX_JSON_INDENT = 16
DEFAULT_TIME_LIMIT = 1.0    # seconds per render


class TemplateBudgetError(SecurityError):
    """A render went past its time, size or allocation budget, or its request was cancelled."""


class Budget:
    """What one render may spend. ``should_stop`` is polled with the clock (a cancelled
    request's render stops at its next operation)."""

    __slots__ = ("deadline", "time_limit", "should_stop", "max_alloc", "alloc", "_n")

    def __init__(self, time_limit: float | None = DEFAULT_TIME_LIMIT, should_stop: Callable[[], bool] | None = None,
                 max_alloc: int = MAX_ALLOC):
        self.time_limit = time_limit
        self.deadline = math.inf if time_limit is None else time.monotonic() + time_limit
        self.should_stop = should_stop
        self.max_alloc = max_alloc
        self.alloc = 0
        self._n = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"rendering took longer than its {self.time_limit:g} s limit")
        if self.should_stop is not None:
            self._n += 1
            if not self._n & 15 and self.should_stop():
                raise TemplateBudgetError("rendering stopped: the request was cancelled")

    def spend(self, nbytes: int, what: str = "value") -> None:
        if nbytes > MAX_VALUE:
            raise TemplateBudgetError(f"{what} too large ({nbytes} bytes; the limit is {MAX_VALUE})")
        self.alloc += nbytes
        if self.alloc > self.max_alloc:
            raise TemplateBudgetError(f"the template built more than {self.max_alloc} bytes of values")


_UNLIMITED = Budget(time_limit=None, max_alloc=1 << 62)
_BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("pyfast_template_budget", default=_UNLIMITED)


def current() -> Budget:
    return _BUDGET.get()


def use(budget: Budget):
    """Make ``budget`` the current render's (returns the token for :func:`release`)."""
    return _BUDGET.set(budget)


def release(token) -> None:
    _BUDGET.reset(token)


# --- sizes ---------------------------------------------------------------------------------------
def shallow(v: Any) -> int:
    """Bytes a freshly built value occupies itself (its items are counted where they were built)."""
    if isinstance(v, (str, bytes, int, float)):
        return sys.getsizeof(v)
    if isinstance(v, (list, tuple, set, frozenset, dict)):
        return 56 + 8 * len(v) * (2 if isinstance(v, dict) else 1)
    return 0


def deep(v: Any, limit: int = MAX_VALUE) -> int:
    """Bytes ``v`` would take as text, roughly (every reference counted again, as ``str()`` of a
    list repeats a shared item); stops counting past ``limit``."""
    total = 0
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x) if x.isascii() else 4 * len(x)
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(x)
            if len(x) > limit:
                return limit + 1
            stack.extend(x)
        elif isinstance(x, dict):
            total += 2 + 4 * len(x)
            if len(x) > limit:
                return limit + 1
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, int) and not isinstance(x, bool):
            total += x.bit_length() // 3 + 1
        elif isinstance(x, bytes):
            total += 4 * len(x)
        elif isinstance(x, Namespace):  # str() shows its attributes
            total += 32
            stack.extend(object.__getattribute__(x, "_Namespace__attrs").values())
        else:
            total += 32
        if total > limit:
            return total
    return total


def _check_text(v: Any, what: str) -> None:
    """Before ``v`` is turned into text: its text must stay under MAX_VALUE."""
    n = deep(v)
    if n > MAX_VALUE:
        raise TemplateBudgetError(f"{what}: the text would be too large (over {MAX_VALUE} bytes)")


def _check_len(n: int, what: str) -> None:
    if n > MAX_VALUE:
        raise TemplateBudgetError(f"{what}: the result would be too large ({n} bytes; the limit is {MAX_VALUE})")


def _new(v: Any, what: str = "value") -> Any:
    """Count a value an operation built; returns it."""
    b = _BUDGET.get()
    if isinstance(v, (list, tuple, dict)) and len(v) > MAX_ITEMS:
        raise TemplateBudgetError(f"{what} too large ({len(v)} items; the limit is {MAX_ITEMS})")
    b.spend(shallow(v), what)
    return v


def _int_arg(v: Any, hi: int, what: str) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and v > hi:
        raise TemplateBudgetError(f"{what} = {v} is too large (limit {hi})")


# --- format strings ------------------------------------------------------------------------------
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)
_DIGITS = re.compile(r"\d+")


def _number(digits: str, what: str) -> int:
    if len(digits) > 9:
        raise TemplateBudgetError(f"{what}: width or precision {digits[:12]}... is too large")
    return int(digits)


def check_percent(fmt: str, args: Any) -> None:
    """Estimate ``fmt % args`` before it is built (widths, precisions, ``*`` arguments, values)."""
    size = len(fmt)
    star = False
    for m in _PERCENT.finditer(fmt):
        width, prec, conv = m.groups()
        if conv == "%":
            continue
        for x in (width, prec):
            if x == "*":
                star = True
            elif x:
                size += _number(x, "% format")
    vals = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    for v in vals:
        if star:
            _int_arg(v, MAX_VALUE, "% format width")
            if isinstance(v, int) and not isinstance(v, bool):
                size += max(v, 0)
        size += 2 * deep(v)
    _check_len(size, "% format")


def check_format_spec(spec: str) -> None:
    """A ``str.format`` spec's width / precision (the only parts that grow the output)."""
    for d in _DIGITS.findall(spec or ""):
        if _number(d, "format spec") > MAX_VALUE:
            raise TemplateBudgetError(f"format spec {spec[:40]!r}: width or precision too large")


class _Formatter(SandboxedFormatter):
    def format_field(self, value: Any, format_spec: str) -> Any:
        _BUDGET.get().tick()
        check_format_spec(format_spec)
        _check_text(value, "format")
        return super().format_field(value, format_spec)


# --- string methods called from templates ---------------------------------------------------------
def _pad_check(s: str, width: Any, what: str) -> None:
    if isinstance(width, int) and not isinstance(width, bool):
        _check_len(max(width, len(s)) * (1 if s.isascii() else 4), what)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> None:
    if name in ("center", "ljust", "rjust", "zfill") and args:
        _pad_check(s, args[0], f"str.{name}")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_len(len(s) + s.count("\t") * max(size, 0), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1))
    elif name == "join" and args:
        _check_text(args[0], "str.join")
        items = args[0]
        if hasattr(items, "__len__"):
            _check_len(deep(items) + len(s) * len(items), "str.join")
    elif name in ("split", "rsplit", "splitlines") and len(s) > MAX_ITEMS:
        sep = args[0] if args else kwargs.get("sep")
        if name == "splitlines":
            pieces = s.count("\n") + s.count("\r") + 1
        elif isinstance(sep, str) and sep:
            pieces = s.count(sep) + 1
        else:
            pieces = sum(s.count(c) for c in " \t\n\r\x0b\x0c") + 1
        if pieces > MAX_ITEMS:
            raise TemplateBudgetError(f"str.{name}: more than {MAX_ITEMS} pieces")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_len(len(s) * max(longest, 1), "str.translate")


def _check_replace(s: str, old: str, new: str, count: Any) -> None:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    _check_len(len(s) + n * max(len(new) - len(old), 0), "replace")


def _ticking(it):
    b = _BUDGET.get()
    for x in it:
        b.tick()
        yield x


def _materialize(value: Any, what: str) -> list:
    """A filter's iterable input as a list, ticking per item and bounded in length."""
    if isinstance(value, (list, tuple)):
        return list(value) if isinstance(value, tuple) else value
    out = []
    b = _BUDGET.get()
    for x in value:
        b.tick()
        out.append(x)
        if len(out) > MAX_ITEMS:
            raise TemplateBudgetError(f"{what}: more than {MAX_ITEMS} items")
    return out


# --- filters -------------------------------------------------------------------------------------
def _pre_center(value, width=80, *a, **k):
    _pad_check(str(value), width, "center")


def _pre_indent(s, width=4, first=False, blank=False, *a, **k):
    pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    s = str(s)
    lines = s.count("\n") + s.count("\r") + 1
    if lines > MAX_ITEMS:
        raise TemplateBudgetError(f"indent: more than {MAX_ITEMS} lines")
    _check_len(len(s) + max(pad, 0) * lines, "indent")


def _pre_wordwrap(s, width=79, break_long_words=True, wrapstring=None, *a, **k):
    s = str(s)
    if len(s) > MAX_ITEMS:  # textwrap splits the text into a list of words first
        raise TemplateBudgetError(f"wordwrap: input longer than {MAX_ITEMS} characters")
    sep = len(wrapstring) if isinstance(wrapstring, str) else 1
    lines = s.count("\n") + 1 + (len(s) // width if isinstance(width, int) and width > 0 else len(s))
    _check_len(len(s) + sep * lines, "wordwrap")


def _pre_replace(s, old, new, count=None, *a, **k):
    if isinstance(old, str) and isinstance(new, str):
        _check_replace(str(s), old, new, count)


def _pre_format(value, *args, **kwargs):
    check_percent(str(value), kwargs or tuple(args))


def _pre_tojson(value, ensure_ascii=False, indent=None, *a, **k):
    if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT or \
            isinstance(indent, int) and not isinstance(indent, bool) and not 0 <= indent <= MAX_JSON_INDENT:
        raise TemplateBudgetError(f"tojson: indent {indent!r} is not in [0, {MAX_JSON_INDENT}]")
    _check_len(6 * deep(value), "tojson")


def _pre_batch(value, linecount, fill_with=None, *a, **k):
    _int_arg(linecount, MAX_ITEMS, "batch size")


def _pre_slice(value, slices, fill_with=None, *a, **k):
    _int_arg(slices, 1 << 16, "slice count")


def _pre_text(value, *a, **k):
    _check_text(value, "filter input")


def _pre_words(value, *a, **k):
    _check_text(value, "filter input")
    if isinstance(value, str) and len(value) > MAX_ITEMS:  # split into words by a regex first
        raise TemplateBudgetError(f"filter input longer than {MAX_ITEMS} characters")


_PRE = {
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap, "replace": _pre_replace,
    "format": _pre_format, "tojson": _pre_tojson, "batch": _pre_batch, "slice": _pre_slice,
    "string": _pre_text, "pprint": _pre_text, "xmlattr": _pre_text, "urlencode": _pre_text, "urlize": _pre_words,
    "e": _pre_text, "escape": _pre_text, "forceescape": _pre_text, "striptags": _pre_words, "title": _pre_text,
    "upper": _pre_text, "lower": _pre_text, "capitalize": _pre_text, "trim": _pre_text, "truncate": _pre_text,
}
_MATERIALIZE = {"join", "list", "sum", "unique", "sort", "dictsort", "groupby", "reverse", "batch", "slice",
                "min", "max"}
_LAZY = {"map", "select", "reject", "selectattr", "rejectattr", "items"}


def _wrap_filter(name: str, f: Callable) -> Callable:
    pass_arg = _PassArg.from_obj(f)
    pre = _PRE.get(name)
    n_lead = 1 if pass_arg is not None else 0

    @functools.wraps(f)
    def checked(*args, **kwargs):
        b = _BUDGET.get()
        b.tick()
        lead, rest = args[:n_lead], list(args[n_lead:])
        if rest and isinstance(rest[0], str) and len(rest[0]) > MAX_ITEMS and (name in _MATERIALIZE or name in _LAZY):
            raise TemplateBudgetError(f"{name}: a string of more than {MAX_ITEMS} characters as a sequence")
        if rest and name in _MATERIALIZE and not isinstance(rest[0], (str, dict)):
            rest[0] = _materialize(rest[0], name)
        if name == "join" and rest:
            sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
            _check_text(rest[0], "join")
            _check_len(deep(rest[0]) + len(str(sep)) * len(rest[0]), "join")
        if name == "sum" and rest:
            start = rest[2] if len(rest) > 2 else kwargs.get("start", 0)
            if isinstance(start, (list, tuple, str)) and len(rest[0]) > 4096:
                raise TemplateBudgetError("sum: too many sequences to concatenate")
        if pre is not None and rest:
            pre(*rest, **kwargs)
        out = f(*lead, *rest, **kwargs)
        if name in _LAZY and not isinstance(out, (list, tuple, dict, str)):
            return _ticking(out)
        if out is not (rest[0] if rest else None):
            _new(out, name)
        b.tick()
        return out

    return checked


# --- the AST: no compile-time evaluation; loops and ~ go through the budget ------------------------
@jinja2.pass_context
def _literal(context, value):
    """Identity: wraps every literal so that nothing built from literals is evaluated while the
    template compiles (a filter that needs the context is never folded)."""
    return value


class _Harden(NodeTransformer):
    def visit_Const(self, node: nodes.Const) -> nodes.Node:
        return nodes.Filter(node, "_pyfast_literal", [], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_pyfast_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        # jinja2 compiles x[a:b] as a plain subscript (no sandbox hook): make it a counted call
        self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):
            return node
        sl = node.arg
        args = [part if part is not None else nodes.Const(None) for part in (sl.start, sl.stop, sl.step)]
        return nodes.Filter(node.node, "_pyfast_slice", args, [], None, None, lineno=node.lineno)

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "_pyfast_concat", [], [], None, None,
                            lineno=node.lineno)


@jinja2.pass_context
def _slice(context, value, start=None, stop=None, step=None):
    """``value[start:stop:step]``, counted (a slice of a big string is a new big string)."""
    _BUDGET.get().tick()
    out = value[start:stop:step]
    if out is not value:
        _new(out, "slice")
    return out


def _concat(parts: list) -> str:
    b = _BUDGET.get()
    b.tick()
    _check_text(parts, "~")
    return _new("".join(str(p) for p in parts), "~")


def _join_output(pieces) -> str:
    """What jinja2 joins captured output with (``{% set x %}...{% endset %}``, macro and call
    bodies, filter blocks): the size is checked before the string is built."""
    b = _BUDGET.get()
    parts = []
    size = 0
    for p in pieces:
        size += len(p) if p.isascii() else 4 * len(p)
        if size > MAX_VALUE:
            raise TemplateBudgetError(f"captured output too large (over {MAX_VALUE} bytes)")
        parts.append(p)
    b.tick()
    return _new("".join(parts), "captured output")


def _finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value, before it is turned into output text."""
    _BUDGET.get().tick()
    if not isinstance(value, str):
        _check_text(value, "output")
    return value


# --- the environment -------------------------------------------------------------------------------
class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask markers): render the body
    unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedNamespace(Namespace):
    """``namespace()`` whose attributes stay bounded in size."""

    def __setitem__(self, name, value):
        _BUDGET.get().tick()
        _check_len(deep(value), f"namespace attribute {name!r}")
        super().__setitem__(name, value)


class ChatEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%", "//"])
    concat = staticmethod(_join_output)

    def _parse(self, source, name, filename):
        tree = _Harden().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def unsafe_undefined(self, obj, attribute):
        # the stock sandbox returns an Undefined that prints as '' - fail loudly instead
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj, attribute):
        _BUDGET.get().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _BUDGET.get().tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        if getattr(value, "__name__", None) not in ("format", "format_map") \
                or not isinstance(getattr(value, "__self__", None), str):
            return None
        text = value.__self__
        is_map = value.__name__ == "format_map"
        fmt = _Formatter(self)

        def checked_format(*args, **kwargs):
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one mapping argument")
                args, kwargs = (), args[0]
            return _new(str(fmt.vformat(str(text), args, kwargs)), "format")

        return checked_format

    def call_binop(self, context, op, left, right):
        b = _BUDGET.get()
        b.tick()
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                    if isinstance(seq, str):
                        _check_len(len(seq) * (1 if seq.isascii() else 4) * max(n, 0), "*")
                    elif len(seq) * max(n, 0) > MAX_ITEMS:
                        raise TemplateBudgetError(f"*: sequence repetition result too large (over {MAX_ITEMS} items)")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBudgetError("*: integer result too large")
            return _new(left * right, "*")
        if op == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                    and right * abs(left).bit_length() > MAX_INT_BITS:
                raise TemplateBudgetError("**: power result too large")
            return left ** right
        if op == "+":
            if isinstance(left, str) and isinstance(right, str):
                _check_len(len(left) + len(right), "+")
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)) \
                    and len(left) + len(right) > MAX_ITEMS:
                raise TemplateBudgetError(f"+: sequence too large (over {MAX_ITEMS} items)")
            return _new(left + right, "+")
        if op == "%":
            if isinstance(left, str):
                check_percent(left, right)
                return _new(left % right, "%")
            return left % right
        if op == "//":
            return left // right
        return super().call_binop(context, op, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's convention
        b = _BUDGET.get()
        b.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        if out is not owner:
            _new(out, "call result")
        b.tick()
        return out


def _raise_exception(message: Any = "") -> None:
    raise TemplateRaise(str(message))


class TemplateRaise(Exception):
    """raise_exception() called by a template."""


def _strftime_now(fmt: str) -> str:
    fmt = str(fmt)
    if len(fmt) > 256:
        raise TemplateBudgetError("strftime_now: format longer than 256 characters")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, jinja2.Undefined):
            return None
        raise TypeError(f"object of type {type(o).__name__} is not JSON serializable")

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys, default=default)


def make_env() -> ChatEnvironment:
    """The environment every ChatTemplate compiles in (HF ``transformers``-compatible: trim_blocks,
    lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
    non-ASCII text and does not escape HTML)."""
    env = ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag],
                          loader=None, autoescape=False, undefined=jinja2.Undefined, optimized=False,
                          finalize=_finalize)
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _wrap_filter(name, f)
    env.filters["_pyfast_iter"] = _ticking
    env.filters["_pyfast_concat"] = _concat
    env.filters["_pyfast_literal"] = _literal
    env.filters["_pyfast_slice"] = _slice
    lipsum = env.globals.get("lipsum")

    def bounded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's names
        _int_arg(n, 100, "lipsum n")
        _int_arg(max, 1000, "lipsum max")
        return lipsum(n=n, html=html, min=min, max=max)

    if lipsum is not None:
        env.globals["lipsum"] = bounded_lipsum
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _BoundedNamespace
    return env
