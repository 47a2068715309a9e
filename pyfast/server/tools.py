"""Tool calling: OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` over chat templates.

The template family decides how a model writes a call; it is recognised from the template text:

* ``hermes`` (Hermes, Qwen 2.5 / 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, text around them is content;
* ``llama3`` (Llama 3.1 / 3.2 / 3.3): the reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``; several calls separated by ``;``);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any content;
* ``generic`` (a template that does not render tools): the tools and the expected reply
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` are described in a system message.

``tool_choice`` ``required`` or a named function is enforced by the constraint stage
(``pyfast.constrain``): a Lark grammar that admits only the family's call syntax with arguments
matching each function's JSON schema. ``none`` parses nothing (the tools still reach the
template); ``auto`` parses calls when the model writes them. :class:`ToolStream` turns the
generated text into content deltas and, at the end, ``tool_calls``; text that may still turn out
to be a call is held back while streaming.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral", "generic")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ToolError(ValueError):
    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


def detect_family(template_source: str | None) -> str:
    src = template_source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ("ipython" in src and "<|eot_id|>" in src):
        return "llama3"
    return "generic"


def normalize_tool_calls(calls: list) -> list[dict]:
    """Assistant-message tool calls as templates expect them: OpenAI's
    ``{"id", "type", "function": {"name", "arguments": "<JSON text>"}}`` with ``arguments``
    also parsed into an object (HF templates render ``arguments`` with ``tojson``)."""
    out = []
    for i, c in enumerate(calls):
        if not isinstance(c, dict):
            raise ValueError(f"[{i}] must be an object")
        fn = c.get("function", c)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"[{i}].function.name must be a string")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"[{i}].function.arguments is not valid JSON") from None
        d = dict(c)
        d["type"] = c.get("type", "function")
        d["function"] = {"name": fn["name"], "arguments": args}
        out.append(d)
    return out


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ToolPlan:
    """What a chat request's tools mean for rendering, constraining and parsing."""

    tools: list[Tool] = field(default_factory=list)
    raw: list[dict] | None = None        # the request's tools, for the template
    choice: str = "auto"                 # auto | none | required | function
    function: str | None = None          # the named function when choice == "function"
    parallel: bool = True
    family: str = "generic"
    constraint: Any = None               # pyfast.constrain.Constraint for required / named choices
    system_prompt: str | None = None     # generic family: the tools described to the model

    @property
    def active(self) -> bool:
        """Calls are parsed from the output."""
        return bool(self.tools) and self.choice != "none"

    @property
    def choice_name(self) -> str:
        return self.function if self.choice == "function" else self.choice

    @property
    def template_tools(self) -> list[dict] | None:
        return self.raw if self.tools else None

    @classmethod
    def from_request(cls, tools: list[dict] | None, tool_choice, parallel: bool | None, template) -> "ToolPlan":
        plan = cls()
        if tool_choice is not None and not tools:
            if tool_choice in ("none", "auto"):
                return plan
            raise ToolError("tool_choice: no tools were given", "tool_choice")
        if not tools:
            return plan
        seen = set()
        for i, t in enumerate(tools):
            if t.get("type", "function") != "function":
                raise ToolError(f"tools[{i}].type: only 'function' tools are supported, got {t.get('type')!r}",
                                f"tools.{i}.type")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise ToolError(f"tools[{i}].function: expected an object", f"tools.{i}.function")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ToolError(f"tools[{i}].function.name: expected 1-64 letters, digits, '_', '-' or '.', "
                                f"got {name!r}", f"tools.{i}.function.name")
            if name in seen:
                raise ToolError(f"tools[{i}].function.name: {name!r} is given twice", f"tools.{i}.function.name")
            seen.add(name)
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise ToolError(f"tools[{i}].function.parameters: expected a JSON schema object",
                                f"tools.{i}.function.parameters")
            _check_params(params, i)
            desc = fn.get("description") or ""
            plan.tools.append(Tool(name, desc if isinstance(desc, str) else str(desc), params))
        plan.raw = [dict(t, type="function") for t in tools]
        plan.parallel = True if parallel is None else bool(parallel)
        plan.family = detect_family(getattr(template, "source", None))
        if tool_choice is None or tool_choice == "auto":
            plan.choice = "auto"
        elif tool_choice in ("none", "required"):
            plan.choice = tool_choice
        elif isinstance(tool_choice, dict):
            fn = tool_choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
                raise ToolError("tool_choice: expected 'auto', 'none', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
            if name not in seen:
                raise ToolError(f"tool_choice: the function {name!r} is not among the tools", "tool_choice")
            plan.choice, plan.function = "function", name
        else:
            raise ToolError(f"tool_choice: expected 'auto', 'none', 'required' or a named function, got "
                            f"{tool_choice!r}", "tool_choice")
        if plan.family == "generic":
            plan.system_prompt = _generic_prompt(plan.tools, plan.parallel)
        if plan.choice in ("required", "function"):
            from pyfast.constrain import Constraint

            plan.constraint = Constraint("lark", _call_grammar(plan), "tool_choice")
        return plan

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def _check_params(params: dict, i: int) -> None:
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ToolError(f"tools[{i}].function.parameters: invalid JSON schema at {where}: {e.message}",
                        f"tools.{i}.function.parameters") from None


def _generic_prompt(tools: list[Tool], parallel: bool) -> str:
    desc = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools],
                      ensure_ascii=False)
    many = "one or more calls" if parallel else "exactly one call"
    return ("You can call these tools:\n" + desc + "\n\nTo call tools, reply with only a JSON object of the form "
            '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} (' + many + "). "
            "Otherwise reply normally.")


def _call_schema(plan: ToolPlan, args_key: str) -> dict:
    tools = [t for t in plan.tools if plan.choice != "function" or t.name == plan.function]
    alts = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: t.parameters},
             "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _compact(schema: dict) -> str:
    """A schema for llguidance's %json with JSON written compactly (no free whitespace), so a
    small model cannot spend its tokens on newlines."""
    return json.dumps(dict(schema, **{"x-guidance": {"whitespace_flexible": False}}), ensure_ascii=False)


def _call_grammar(plan: ToolPlan) -> str:
    """A Lark grammar (llguidance dialect) admitting only calls in the family's syntax. Llama 3.x
    writes one call per reply (its JSON format has no parallel calls)."""
    fam = plan.family
    many = plan.parallel and plan.choice != "function" and fam != "llama3"
    args_key = "parameters" if fam == "llama3" else "arguments"
    schema = _compact(_call_schema(plan, args_key))
    if fam == "hermes":
        rep = "call (\"\\n\" call)*" if many else "call"
        return (f"start: {rep}\n"
                f"call: \"<tool_call>\\n\" obj \"\\n</tool_call>\"\n"
                f"obj: %json {schema}\n")
    if fam == "llama3":
        return f"start: obj\nobj: %json {schema}\n"
    if fam == "mistral":
        arr = {"type": "array", "items": _call_schema(plan, "arguments"), "minItems": 1}
        if not many:
            arr["maxItems"] = 1
        return f"start: \"[TOOL_CALLS]\" arr\narr: %json {_compact(arr)}\n"
    wrapper = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": _call_schema(plan, "arguments"),
                                                                 "minItems": 1, **({} if many else {"maxItems": 1})}},
               "required": ["tool_calls"], "additionalProperties": False}
    return f"start: obj\nobj: %json {_compact(wrapper)}\n"


# --- parsing -------------------------------------------------------------------------------
def _call(name, args) -> dict:
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def _json_objects(text: str) -> list | None:
    """The JSON values of ``text`` written one after another (separated by whitespace, ';' or
    ','); None when it is not such a sequence."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


def _as_calls(objs, names: set[str], args_keys=("arguments", "parameters")) -> list[dict] | None:
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str) or o["name"] not in names:
            return None
        args = next((o[k] for k in args_keys if k in o), {})
        if not isinstance(args, (dict, str)):
            return None
        calls.append(_call(o["name"], args))
    return calls or None


def parse_calls(plan: ToolPlan, text: str) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a finished reply; calls to unknown functions or malformed JSON
    leave the text as content."""
    names = {t.name for t in plan.tools}
    fam = plan.family
    if fam == "hermes":
        calls, parts, pos = [], [], 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            objs = _json_objects(m.group(1))
            got = _as_calls(objs, names) if objs else None
            if got is None:
                continue
            parts.append(text[pos:m.start()])
            pos = m.end()
            calls += got
        if calls:
            parts.append(text[pos:])
            return "".join(parts).strip(), calls
        return text, []
    if fam == "mistral":
        i = text.find("[TOOL_CALLS]")
        if i >= 0:
            objs = _json_objects(text[i + len("[TOOL_CALLS]"):])
            if objs and len(objs) == 1 and isinstance(objs[0], list):
                objs = objs[0]
            got = _as_calls(objs, names) if objs else None
            if got:
                return text[:i].strip(), got
        return text, []
    body = text.strip()
    if fam == "llama3" and body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    objs = _json_objects(body) if body.startswith("{") else None
    if objs:
        if fam == "generic" and len(objs) == 1 and isinstance(objs[0], dict):
            o = objs[0]
            if isinstance(o.get("tool_calls"), list):
                objs = o["tool_calls"]
            elif isinstance(o.get("tool_call"), dict):
                objs = [o["tool_call"]]
        got = _as_calls(objs, names)
        if got:
            return "", got
    return text, []


class ToolStream:
    """Streams a reply's content while holding back text that may be a tool call; ``finish``
    returns the held content and the calls."""

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0          # characters of text streamed as content
        self.holding = False   # a call has started: nothing more is streamed

    def feed(self, delta: str) -> str:
        """Add generated text; returns the content that can be streamed now."""
        self.text += delta
        if self.holding:
            return ""
        fam = self.plan.family
        if fam in self.MARKERS:
            mk = self.MARKERS[fam]
            i = self.text.find(mk, max(0, self.sent - len(mk) + 1))
            if i >= 0:
                self.holding = True
                out, self.sent = self.text[self.sent:i], i
                return out
            safe = len(self.text)  # keep back a tail that may be the marker's beginning
            for k in range(min(len(mk) - 1, len(self.text)), 0, -1):
                if mk.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
            safe = max(safe, self.sent)
            out, self.sent = self.text[self.sent:safe], safe
            return out
        # llama3 / generic: a call is the whole reply, starting with '{' (or the python tag)
        if self.sent == 0:
            head = self.text.lstrip()
            if head.startswith("{") or head.startswith("<|python_tag|>"):
                self.holding = True
                return ""
            if not head or "<|python_tag|>".startswith(head):  # not decided yet
                return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet streamed, tool calls)."""
        content, calls = parse_calls(self.plan, self.text)
        if calls:
            # the content before the call was streamed already; what is left is the part after it
            done = self.text[:self.sent]
            rest = content[len(done):] if content.startswith(done) else ""
            return rest.strip() if rest.strip() else "", calls
        return self.text[self.sent:], []
