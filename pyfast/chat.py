"""Chat templates: render a conversation into the prompt text a model was trained on.

GGUF files carry the HF Jinja chat template in ``tokenizer.chat_template``. A GGUF is untrusted
input, so templates run in jinja2's ``ImmutableSandboxedEnvironment`` with extra limits:

* any access to an unsafe attribute (``__class__``, ``__globals__``, ``func_code``...) raises at
  once instead of rendering as an empty string;
* no loader, so ``{% include %}`` / ``{% import %}`` / ``{% extends %}`` cannot read files;
* ``*``, ``**``, ``+``, calls (macros included) and ``namespace`` attributes are checked so a
  template cannot build gigantic strings, lists or numbers, and the rendered text is capped in
  size. There is no time limit: a template can still loop for long (``range`` is capped at
  100,000 items per call by jinja's sandbox); callers that need one should render in a worker.

The environment otherwise matches what HF ``transformers`` gives templates (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII characters and does not HTML-escape), so templates written for HF render the same.
"""
from __future__ import annotations

import json
import operator
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["ChatTemplate", "CHATML_TEMPLATE"]

#: Used when the GGUF has no chat template.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_MAX_OUTPUT_CHARS = 16 * 1024 * 1024  # rendered prompt
_MAX_VALUE_LEN = 4 * 1024 * 1024  # any str / list built by a template
_MAX_POW_BITS = 4096  # size of a ** b results


class _TemplateRaise(Exception):
    """raise_exception() called by a template."""


def _make_env():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import Namespace
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def _check_size(v):
        if isinstance(v, (str, list, tuple, dict)) and len(v) > _MAX_VALUE_LEN:
            raise SecurityError(f"value too large ({len(v)} items) in template")
        return v

    class _GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask markers): render the
        body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class _Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def unsafe_undefined(self, obj, attribute):
            # the stock sandbox returns an Undefined that prints as '' - fail loudly instead
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def call_binop(self, context, op, left, right):
            if op == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        if len(seq) * max(n, 0) > _MAX_VALUE_LEN:
                            raise SecurityError("sequence repetition result too large")
                return operator.mul(left, right)
            if op == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0:
                    if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > _MAX_POW_BITS:
                        raise SecurityError("power result too large")
                return operator.pow(left, right)
            if op == "+":
                return _check_size(operator.add(left, right))
            return super().call_binop(context, op, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's convention
            # values passed between macros / produced by calls stay bounded, so a template
            # cannot grow a string exponentially through recursion
            for a in args:
                _check_size(a)
            for a in kwargs.values():
                _check_size(a)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

    class _BoundedNamespace(Namespace):
        """``namespace()`` whose attributes stay bounded in size (a loop could otherwise
        double a string held in a namespace on every iteration)."""

        def __setitem__(self, name, value):
            super().__setitem__(name, _check_size(value))

    env = _Env(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationTag],
        loader=None,
        autoescape=False,
        undefined=jinja2.Undefined,
    )

    def raise_exception(message: Any = "") -> None:
        raise _TemplateRaise(str(message))

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(str(fmt))

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        def default(o: Any) -> Any:
            if isinstance(o, jinja2.Undefined):
                return None
            raise TypeError(f"object of type {type(o).__name__} is not JSON serializable")

        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=tuple(separators) if separators else None,
                          sort_keys=sort_keys, default=default)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _BoundedNamespace
    return env


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        _ENV = _make_env()
    return _ENV


def _error(e: BaseException) -> ValueError:
    msg = str(e) or type(e).__name__
    return ValueError(f"chat template error: {msg}")


def _validate_messages(messages: Any) -> list[dict]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role'")
        if "content" not in m:
            if not m.get("tool_calls"):
                raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        else:
            c = m["content"]
            if c is None and not m.get("tool_calls"):
                raise ValueError(f"messages[{i}] ({role}) has null 'content' and no 'tool_calls'")
            if c is not None and not isinstance(c, str):
                raise ValueError(
                    f"messages[{i}] ({role}) 'content' must be a string, got {type(c).__name__}")
        d = dict(m)
        d.setdefault("content", None)
        out.append(d)
    return out


class ChatTemplate:
    """A sandboxed Jinja chat template.

    ``ChatTemplate(source)`` compiles ``source`` (``None`` -> ChatML); ``render(messages)``
    returns the prompt text. All template problems raise ``ValueError("chat template error:
    ...")``; bad messages raise ``ValueError`` naming the message.
    """

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.is_fallback = source is None or not str(source).strip()
        self.source = CHATML_TEMPLATE if self.is_fallback else str(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        try:
            self._template = _env().from_string(self.source)
        except Exception as e:  # TemplateSyntaxError and friends
            raise _error(e) from e

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], tokenizer: Any = None,
                      name: str | None = None) -> "ChatTemplate":
        """The template of a GGUF (``tokenizer.chat_template``, or
        ``tokenizer.chat_template.<name>`` when ``name`` is given), with its BOS/EOS token texts.
        Falls back to ChatML when the file has none."""
        key = "tokenizer.chat_template" + (f".{name}" if name else "")
        src = md.get(key)
        if isinstance(src, bytes):
            src = src.decode("utf-8", errors="replace")
        if src is not None and not isinstance(src, str):
            raise ValueError(f"GGUF metadata {key!r} must be a string, got {type(src).__name__}")
        if name and src is None:
            raise ValueError(f"GGUF has no chat template named {name!r} ({key!r})")
        return cls(src, bos_token=_token_text(md, tokenizer, "bos"),
                   eos_token=_token_text(md, tokenizer, "eos"))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Prompt text for ``messages``; extra keyword arguments become template variables
        (e.g. ``enable_thinking=False``)."""
        msgs = _validate_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
                raise ValueError("tools must be a list of dicts")
            tools = list(tools)
            for i, t in enumerate(tools):
                if not isinstance(t, Mapping):
                    raise ValueError(f"tools[{i}] must be a dict, got {type(t).__name__}")
        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        ctx.update(kwargs)
        ctx.update(messages=msgs, tools=tools, add_generation_prompt=bool(add_generation_prompt))
        try:
            parts = []
            size = 0
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                if size > _MAX_OUTPUT_CHARS:
                    raise _TemplateRaise("rendered prompt is too large")
                parts.append(chunk)
            return "".join(parts)
        except Exception as e:
            raise _error(e) from e

    def __repr__(self) -> str:
        kind = "chatml-fallback" if self.is_fallback else f"{len(self.source)} chars"
        return f"<ChatTemplate {kind}>"


def _token_text(md: Mapping[str, Any], tokenizer: Any, which: str) -> str:
    tid = getattr(tokenizer, f"{which}_id", None) if tokenizer is not None else None
    if tokenizer is not None:
        return tokenizer.id_to_piece(tid) if tid is not None else ""
    tid = md.get(f"tokenizer.ggml.{which}_token_id")
    tokens = md.get("tokenizer.ggml.tokens")
    try:
        return str(tokens[int(tid)]) if tid is not None and tokens is not None else ""
    except (IndexError, TypeError, ValueError):
        return ""
