"""Chat templates: render a conversation into the prompt text a model was trained on.

GGUF files carry the HF Jinja chat template in ``tokenizer.chat_template``. A GGUF is untrusted
input, so templates run in jinja2's ``ImmutableSandboxedEnvironment`` with extra limits:

* any access to an unsafe attribute (``__class__``, ``__globals__``, ``func_code``...) raises at
  once instead of rendering as an empty string;
* no loader, so ``{% include %}`` / ``{% import %}`` / ``{% extends %}`` cannot read files;
* every render runs under a budget (``pyfast/chat_sandbox.py``): nothing is evaluated at compile
  time, every string- or list-building operation is size-checked before it allocates, the bytes
  built are counted, and a wall-clock limit (1 s by default) and ``should_stop`` (the request is
  gone) are checked on every loop item, call and operator. The rendered text is capped in size.

The environment otherwise matches what HF ``transformers`` gives templates (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII characters and does not HTML-escape), so templates written for HF render the same.
"""
from __future__ import annotations

import io
from typing import Any, Callable, Iterable, Mapping, Sequence

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

_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        from pyfast.chat_sandbox import make_env

        _ENV = make_env()
    return _ENV


def _error(e: BaseException) -> ValueError:
    msg = " ".join((str(e) or type(e).__name__).split())  # one line
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return ValueError(f"chat template error: {msg}")


#: Inserted into special-token texts found in message content so the template's output does not
#: contain them verbatim (a Unicode noncharacter: never meaningful in text).
NO_SPECIAL = "\ufdd0"


def _protect(msgs: list[dict], specials: Iterable[str]) -> list[dict]:
    """Messages whose content has NO_SPECIAL after the first character of every special-token
    text (and no NO_SPECIAL of its own)."""
    import re

    texts = sorted({t for t in specials if t and len(t) > 1}, key=len, reverse=True)
    if not texts:
        return msgs
    pat = re.compile("|".join(re.escape(t) for t in texts))
    out = []
    for m in msgs:
        c = m.get("content")
        if isinstance(c, str) and (NO_SPECIAL in c or pat.search(c)):
            c = pat.sub(lambda x: x.group(0)[0] + NO_SPECIAL + x.group(0)[1:], c.replace(NO_SPECIAL, ""))
            m = dict(m, content=c)
        out.append(m)
    return out


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

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 time_limit: float | None = None, strip_bos: bool = False) -> None:
        from pyfast.chat_sandbox import DEFAULT_TIME_LIMIT

        self.time_limit = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
        self.is_fallback = source is None or not str(source).strip()
        self.source = CHATML_TEMPLATE if self.is_fallback else str(source)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        # the tokenizer adds BOS itself: a BOS the template writes first is dropped (as llama.cpp
        # does), so that templates starting with {{ bos_token }} (Gemma, Llama 3) give one BOS
        self.strip_bos = bool(strip_bos)
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
        add_bos = getattr(tokenizer, "add_bos", None) if tokenizer is not None else None
        if add_bos is None:
            add_bos = md.get("tokenizer.ggml.add_bos_token") is True
        return cls(src, bos_token=_token_text(md, tokenizer, "bos"),
                   eos_token=_token_text(md, tokenizer, "eos"), strip_bos=bool(add_bos))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, *, time_limit: float | None = None,
               should_stop: Callable[[], bool] | None = None, protect: Iterable[str] | None = None,
               **kwargs: Any) -> str:
        """Prompt text for ``messages``; extra keyword arguments become template variables
        (e.g. ``enable_thinking=False``).

        time_limit: seconds this render may take (default ``self.time_limit``, 1 s).
        should_stop: polled while rendering; when it returns True the render stops with an error
        (the request it was for is gone).
        protect: special-token texts (e.g. ``tokenizer.control_texts``) that must stay text when
        they occur in message content: each occurrence gets ``NO_SPECIAL`` inserted, which
        :meth:`pyfast.tokenizer.Tokenizer.encode_rendered` removes after matching the template's
        own special tokens.
        """
        from pyfast import chat_sandbox as sb

        msgs = _validate_messages(messages)
        if protect:
            msgs = _protect(msgs, protect)
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
        # values may be built up to a few times the caller's own input, and at least MAX_ALLOC
        budget = sb.Budget(self.time_limit if time_limit is None else time_limit, should_stop,
                           max(sb.MAX_ALLOC, 8 * sb.deep(ctx, 1 << 40)))
        token = sb.use(budget)
        try:
            out = io.StringIO()
            size = 0
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                if size > _MAX_OUTPUT_CHARS:
                    raise sb.TemplateBudgetError(f"the rendered prompt is too large (over {_MAX_OUTPUT_CHARS} "
                                                 "characters)")
                out.write(chunk)
            text = out.getvalue()
            if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
                text = text[len(self.bos_token):]
            return text
        except RecursionError:
            raise ValueError("chat template error: recursion too deep") from None
        except MemoryError:
            raise ValueError("chat template error: out of memory") from None
        except Exception as e:
            raise _error(e) from None
        finally:
            sb.release(token)

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
