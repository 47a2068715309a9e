"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~pyfast.server.engine.Engine`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming for both),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/embeddings``, and llama-server's native routes
(``POST /completion``, ``GET /props``, ``GET /slots``, ``POST /apply-template``; ``native.py``).
Any model name is served by the one model unless ``--strict-model-name``. Output can be
constrained (``response_format``, ``json_schema``, ``grammar``, ``regex``: ``pyfast.constrain``)
and tool calls are parsed from it (``tools.py``). CORS: ``cors.py``. Every error is an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Request bodies are parsed by pydantic straight from the raw bytes (``model_validate_json``), so
malformed JSON, invalid UTF-8 and wrong types all become 400s naming the field at fault.
Template rendering and tokenization run in worker threads; generation runs in the engine's
scheduler thread; the event loop only moves bytes.

Work is bounded before it is done (``limits.py``): the body is read in chunks up to its limit and
within its timeouts; a prompt whose bytes cannot fit the slot's context (every token covers at
most ``max_token_bytes`` bytes) is refused before it is tokenized; templates render under their
budget (stopped when the client goes); rendering and tokenizing run at most ``max_prepare`` at a
time; a request that could never fit the queue is a 400. Special-token text in chat message
content is plain text unless the request says ``"parse_special": true``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyfast import __version__
from pyfast.constrain import ConstraintError
from pyfast.sampling import SamplingParams
from pyfast.server.engine import Engine, EngineStopped, Event, GenParams, Job, JobStats, QueueFull
from pyfast.server.limits import Drain, Limits
from pyfast.server.schemas import (ApplyTemplateRequest, ChatCompletionRequest, CompletionRequest,
                                   DetokenizeRequest, TokenizeRequest)

MAX_BODY_BYTES = Limits.max_body_bytes
MAX_TOKENIZE_BYTES = 1 << 20  # /tokenize content (at least; more when a slot's context holds more)
REPEAT_PENALTY_RANGE = (1e-4, 1e4)  # beyond these, logits / penalty overflows float32 or rounds to 0
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                     "/v1/models", "/models", "/health", "/v1/health", "/metrics", "/tokenize",
                     "/detokenize", "/completion", "/props", "/slots", "/apply-template", "/v1/embeddings",
                     "/embeddings"})


@dataclass
class ServerOptions:
    """Server-wide behaviour set by ``pyfast serve`` flags.

    strict_model_name: a request naming another model than this server's gets 404 (otherwise
    any name is served by the one model, as llama-server does). cors_origins: see ``cors.py``.
    n_predict / temperature / seed: defaults for requests that do not set them (llama-server's
    ``--n-predict``, ``--temp``, ``--seed``; n_predict -1 = until the context is full).
    pooling: how /v1/embeddings pools the final hidden states (mean, last or cls).
    """

    strict_model_name: bool = False
    cors_origins: list[str] = field(default_factory=lambda: ["localhost"])
    n_predict: int | None = None
    temperature: float | None = None
    seed: int | None = None
    pooling: str = "mean"

    def validate(self) -> "ServerOptions":
        if self.n_predict is not None and self.n_predict < -1:
            raise ValueError(f"--n-predict must be >= -1 (-1 = until the context is full), got {self.n_predict}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--temp must be in [0, 2], got {self.temperature}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2^63), got {self.seed}")
        if self.pooling not in ("mean", "last", "cls"):
            raise ValueError(f"--pooling must be mean, last or cls, got {self.pooling!r}")
        from pyfast.server.cors import CorsPolicy

        CorsPolicy.parse(self.cors_origins)  # a bad origin fails at start
        return self


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status in (408, 413):  # the rest of the body is not wanted: close instead of reading it
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


class _Guard:
    """ASGI middleware: API keys and per-route request counts (pure ASGI, so streaming
    responses and disconnects pass through untouched)."""

    def __init__(self, app, engine: Engine, api_keys: list[str], drain: Drain | None = None):
        self.app = app
        self.engine = engine
        self.keys = [k.encode() for k in api_keys]
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        status = {"code": 500}

        async def send_wrapped(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            if self.drain is not None and self.drain.draining and path not in PUBLIC_PATHS:
                err = APIError(503, "the server is shutting down", "server_error", code="shutting_down")
                await _error_response(err)(scope, receive, send_wrapped)
                return
            if self.keys and path not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
                err = self._check_key(scope)
                if err is not None:
                    await _error_response(err)(scope, receive, send_wrapped)
                    return
            await self.app(scope, receive, send_wrapped)
        finally:
            self.engine.metrics.http_requests.inc(route=route, status=str(status["code"]))

    def _check_key(self, scope) -> APIError | None:
        got = None
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                parts = v.split(None, 1)
                if len(parts) == 2 and parts[0].lower() == b"bearer":
                    got = parts[1].strip()
            elif k == b"x-api-key" and got is None:
                got = v.strip()
        if got is None:
            return APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                            "authentication_error", code="missing_api_key")
        ok = False
        for k in self.keys:  # compare against every key in constant time
            ok |= hmac.compare_digest(got, k)
        if not ok:
            return APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return None


def create_app(engine: Engine, api_keys: list[str] | None = None, limits: Limits | None = None,
               drain: Drain | None = None, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI application serving ``engine``; the engine's scheduler runs while the app
    does (started and stopped by the app's lifespan). ``limits``: request bounds (defaults:
    :class:`Limits`); ``drain``: the shutdown state a :class:`~pyfast.server.limits.GracefulServer`
    starts on SIGTERM (running requests then get ``drain.timeout`` seconds); ``options``:
    :class:`ServerOptions` (model names, CORS, request defaults)."""
    from pyfast.server.cors import CorsMiddleware, CorsPolicy
    from pyfast.server import native

    limits = (limits or Limits()).validate()
    options = (options or ServerOptions()).validate()
    drain = drain or Drain(limits.shutdown_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        drain.bind(asyncio.get_running_loop())
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop)

    app = FastAPI(title="pyfast", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.drain = drain
    app.state.limits = limits

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), type_))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    api = _API(engine, limits, drain, options)
    app.state.api = api
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/models", api.models, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/completions", api.completions, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/apply-template", api.apply_template, methods=["POST"])
    native.add_routes(app, api)
    app.add_middleware(_Guard, engine=engine, api_keys=list(api_keys or []), drain=drain)
    app.add_middleware(CorsMiddleware, policy=CorsPolicy.parse(options.cors_origins))  # outermost
    return app


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, read chunk by chunk: refused (413) as soon as it passes the limit, and (408)
    when a chunk does not come within body_idle_timeout or the whole within body_timeout."""
    limit = limits.max_body_bytes
    n = request.headers.get("content-length")
    if n is not None:
        if not n.strip().isdigit():
            raise APIError(400, f"invalid Content-Length header {n[:40]!r}")
        if int(n) > limit:
            raise APIError(413, f"request body too large (limit {limit} bytes)")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        wait = min(limits.body_idle_timeout, deadline - loop.time())
        try:
            if wait <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), wait)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive in time (at most {limits.body_idle_timeout:g} s "
                                f"between chunks, {limits.body_timeout:g} s in all)", code="body_timeout") from None
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body") from None
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body too large (limit {limit} bytes)")
        if chunk:
            chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, schema: type[BaseModel], limits: Limits | None = None) -> Any:
    body = await _read_body(request, limits or Limits())
    if not body.strip():
        raise APIError(400, "empty request body: expected a JSON object")
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise APIError(400, *_describe(e)) from None


def _describe(e: ValidationError) -> tuple[str, str, str | None]:
    """(message, type, param) for the first error of a pydantic validation."""
    errs = e.errors(include_url=False)
    if not errs:
        return "invalid request", "invalid_request_error", None
    err = errs[0]
    if err["type"] == "json_invalid":
        return f"malformed JSON body: {err['msg']}", "invalid_request_error", None
    # Union branches add their type ("str", "list[int]", "ContentPart") to the location; keep
    # only the user's field path.
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
    param = ".".join(loc) or None
    msg = err["msg"]
    if param:
        msg = f"{param}: {msg}"
    return msg, "invalid_request_error", param


def _is_type_tag(p: str) -> bool:
    return "[" in p or p[:1].isupper() or p in ("str", "int", "float", "bool", "none", "dict", "list")


class _API:
    def __init__(self, engine: Engine, limits: Limits | None = None, drain: Drain | None = None,
                 options: ServerOptions | None = None):
        self.engine = engine
        self.limits = limits or Limits()
        self.drain = drain
        self.options = options or ServerOptions()
        self._grammars: dict = {}  # compiled constraints, most recent last (bounded)
        self._grammar_lock = threading.Lock()
        import anyio

        self.prepare_limiter = anyio.CapacityLimiter(self.limits.max_prepare)
        tok = engine.tokenizer
        # every token stands for at most this many bytes of text, so a text of more than
        # n_ctx_slot * max_token_bytes bytes cannot fit in a slot whatever its tokens
        self.max_token_bytes = max(1, max((len(tok.token_piece(i)) for i in range(engine.n_vocab)), default=1))
        self._special_texts = None

    @property
    def special_texts(self) -> list[str]:
        """The control-token texts a chat message's content may not smuggle in."""
        if self._special_texts is None:
            self._special_texts = self.engine.tokenizer.control_texts()
        return self._special_texts

    def _check_bytes(self, n_bytes: int, param: str) -> None:
        n_slot = self.engine.n_ctx_slot
        if n_bytes > n_slot * self.max_token_bytes:
            raise APIError(400, f"the prompt has {n_bytes} bytes, more than {n_slot} tokens can hold (this server's "
                                f"context holds {n_slot} tokens per request; a token covers at most "
                                f"{self.max_token_bytes} bytes)", param=param, code="context_length_exceeded")

    async def _prepare(self, request: Request, fn):
        """Run CPU work for a request (render, tokenize) in a worker thread, at most
        max_prepare at a time; fn(should_stop) sees should_stop() turn True when the client goes."""
        import anyio

        gone = threading.Event()
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        watcher.add_done_callback(lambda _: gone.set())
        try:
            return await anyio.to_thread.run_sync(fn, gone.is_set, limiter=self.prepare_limiter)
        finally:
            watcher.cancel()

    # --- info ------------------------------------------------------------------------------
    async def health(self) -> Response:
        e = self.engine
        return JSONResponse({"status": "ok" if e.alive else "error", "slots_idle": e.cfg.n_parallel - e.n_busy,
                             "slots_processing": e.n_busy, "queue_depth": e.n_waiting},
                            status_code=200 if e.alive else 503)

    async def models(self) -> Response:
        e = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": e.model_id, "object": "model", "created": e.created, "owned_by": "pyfast",
            "meta": {"file": os.path.basename(e.model_path), "n_vocab": e.n_vocab, "n_ctx_slot": e.n_ctx_slot,
                     "n_parallel": e.cfg.n_parallel, "speculative": e.spec_enabled,
                     "recurrent": e.is_recurrent, "n_rollback": e.ctx.n_rollback,
                     "ctx_checkpoints": e.n_checkpoints}}]})

    async def metrics(self) -> Response:
        e = self.engine
        e.metrics.queue_depth.set(e.n_waiting)
        e.metrics.slots_busy.set(e.n_busy)
        return PlainTextResponse(e.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = await _parse(request, TokenizeRequest, self.limits)
        tok = self.engine.tokenizer
        n = len(req.content.encode("utf-8", "surrogatepass"))
        limit = max(MAX_TOKENIZE_BYTES, self.engine.n_ctx_slot * self.max_token_bytes)
        if n > limit:  # tokenizing costs CPU in proportion (a 20 MB text took 46 s)
            raise APIError(400, f"content: {n} bytes is more than /tokenize takes ({limit})", param="content")
        try:
            # add_special adds BOS only when the vocabulary says so (tokenizer.ggml.add_bos_token), as llama.cpp
            ids = await self._prepare(request, lambda _stop: tok.encode(req.content, None if req.add_special else False,
                                                                        req.parse_special,
                                                                        add_eos=None if req.add_special else False))
        except (ValueError, TypeError) as e:
            raise APIError(400, f"content: {e}", param="content") from None
        if req.with_pieces:
            return JSONResponse({"tokens": [{"id": i, "piece": _piece(tok, i)} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = await _parse(request, DetokenizeRequest, self.limits)

        def decode(_stop) -> str:  # millions of ids take a while: not on the event loop
            self._check_ids(req.tokens, "tokens")
            return self.engine.tokenizer.decode(req.tokens)

        return JSONResponse({"content": await self._prepare(request, decode)})

    # --- generation ------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is None or not self.options.strict_model_name:
            return
        e = self.engine
        accepted = {e.model_id, e.model_path, os.path.basename(e.model_path)}
        if name not in accepted:
            raise APIError(404, f"the model {name!r} does not exist (this server serves {e.model_id!r})",
                           "invalid_request_error", param="model", code="model_not_found")

    def _check_ids(self, ids: list[int], param: str) -> None:
        n = self.engine.n_vocab
        for t in ids:
            if not 0 <= t < n:
                raise APIError(400, f"{param}: token id {t} is outside the vocabulary [0, {n})", param=param)

    def _messages(self, req) -> list[dict]:
        messages = []
        for i, m in enumerate(req.messages):
            d = {"role": m.role, "content": _content_text(m.content, i)}
            for k in ("name", "tool_calls", "tool_call_id"):
                v = getattr(m, k)
                if v is not None:
                    d[k] = v
            if d.get("tool_calls"):
                from pyfast.server.tools import normalize_tool_calls

                try:
                    d["tool_calls"] = normalize_tool_calls(d["tool_calls"])
                except ValueError as err:
                    raise APIError(400, f"messages[{i}].tool_calls: {err}", param=f"messages.{i}.tool_calls") from None
            messages.append(d)
        return messages

    def _prefill(self, req, messages: list[dict]) -> bool:
        """True when the reply continues the last message (an assistant prefill): asked with
        continue_final_message, or (as llama-server does) when the conversation ends with an
        assistant message and neither flag says otherwise."""
        last_is_assistant = messages[-1]["role"] == "assistant"
        if req.continue_final_message:
            if not last_is_assistant:
                raise APIError(400, "continue_final_message: the last message must be the assistant's "
                                    f"(got role {messages[-1]['role']!r})", param="continue_final_message")
            if req.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                               param="add_generation_prompt")
            return True
        if req.continue_final_message is None and req.add_generation_prompt is None:
            return last_is_assistant and bool(messages[-1].get("content"))
        return False

    def _render_chat(self, req, messages: list[dict], tools, should_stop, protect) -> str:
        """The prompt text of a chat request (template kwargs, tools, prefill applied)."""
        e = self.engine
        kwargs = dict(req.chat_template_kwargs or {})
        for k in ("messages", "tools", "add_generation_prompt", "time_limit", "should_stop", "protect"):
            kwargs.pop(k, None)
        if self._prefill(req, messages):
            text = e.chat_template.render(messages, add_generation_prompt=False, tools=tools,
                                          should_stop=should_stop, protect=protect, **kwargs)
            content = messages[-1].get("content") or ""
            if protect:  # the template saw the protected content
                from pyfast.chat import _protect

                content = _protect([messages[-1]], protect)[0].get("content") or ""
            cut = text.rfind(content) if content else -1
            if cut < 0:
                raise ValueError("the chat template does not show the final assistant message's content, so the "
                                 "reply cannot continue it")
            return text[:cut + len(content)]
        add = True if req.add_generation_prompt is None else req.add_generation_prompt
        return e.chat_template.render(messages, add_generation_prompt=add, tools=tools, should_stop=should_stop,
                                      protect=protect, **kwargs)

    async def chat(self, request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, self.limits)
        self._check_model(req.model)
        e = self.engine
        if e.chat_template is None:
            raise APIError(500, f"the model's chat template cannot be used: {e.template_error}", "server_error")
        messages = self._messages(req)
        from pyfast.server.tools import ToolPlan

        try:
            plan = ToolPlan.from_request(req.tools, req.tool_choice, req.parallel_tool_calls, e.chat_template)
        except ValueError as err:
            raise APIError(400, str(err), param=getattr(err, "param", None) or "tools") from None
        if plan.active and plan.system_prompt:  # a template that does not render tools: describe them
            if messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
                messages[0] = dict(messages[0], content=plan.system_prompt + "\n\n" + messages[0]["content"])
            else:
                messages.insert(0, {"role": "system", "content": plan.system_prompt})
        constraint = self._constraint(req, chat=True)
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {plan.choice_name!r} cannot be combined with a response format, "
                                    "grammar or JSON schema", param="tool_choice")
            constraint = plan.constraint
        # content that cannot fit is refused before the template runs
        self._check_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                              if isinstance(m["content"], str)), "messages")
        protect = None if req.parse_special else self.special_texts

        def render(should_stop) -> tuple[list[int], object]:
            text = self._render_chat(req, messages, plan.template_tools, should_stop, protect)
            self._check_bytes(len(text.encode("utf-8", "surrogatepass")), "messages")
            ids = e.tokenizer.encode_rendered(text) if protect else e.tokenizer.encode(text)
            return ids, self._compile(constraint)

        try:
            prompt, grammar = await self._prepare(request, render)
        except ConstraintError as err:
            raise APIError(400, f"{err.param}: {err}" if err.param else str(err), param=err.param) from None
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(req, None)
        k = (req.top_logprobs or 0) if req.logprobs else None
        return await self._generate(request, req, [prompt], max_tokens, k, chat=True, grammar=grammar, tools=plan)

    async def apply_template(self, request: Request) -> Response:
        """llama-server's ``POST /apply-template``: the prompt text a chat request would be
        given, without generating."""
        req: ApplyTemplateRequest = await _parse(request, ApplyTemplateRequest, self.limits)
        e = self.engine
        if e.chat_template is None:
            raise APIError(500, f"the model's chat template cannot be used: {e.template_error}", "server_error")
        messages = self._messages(req)
        self._check_bytes(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                              if isinstance(m["content"], str)), "messages")
        try:
            text = await self._prepare(request, lambda stop: self._render_chat(req, messages, req.tools, stop, None))
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param="messages") from None
        return JSONResponse({"prompt": text})

    # --- constraints and defaults -----------------------------------------------------------
    def _default_max_tokens(self, req, fallback: int | None) -> int | None:
        """max_tokens when the request gives none: its n_predict, else --n-predict, else
        ``fallback`` (-1 means until the slot's context is full)."""
        n = req.n_predict if req.n_predict is not None else self.options.n_predict
        if n is None:
            return fallback
        return None if n < 0 else n

    def _constraint(self, req, chat: bool):
        """The request's output constraint (pyfast.constrain.Constraint) or None."""
        from pyfast.constrain import Constraint

        found = []
        rf = getattr(req, "response_format", None) if chat else None
        if rf is not None:
            t = rf.get("type", "text")
            if t == "text":
                pass
            elif t == "json_object":
                schema = rf.get("schema")  # llama-server also takes a schema here
                found.append(Constraint.json_schema(schema, "response_format.schema") if schema is not None
                             else Constraint.json_object())
            elif t == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict):
                    raise APIError(400, "response_format.json_schema: expected an object with a 'schema'",
                                   param="response_format.json_schema")
                schema = js.get("schema")
                if schema is None:
                    raise APIError(400, "response_format.json_schema.schema: missing",
                                   param="response_format.json_schema.schema")
                found.append(Constraint.json_schema(schema, "response_format.json_schema.schema"))
            else:
                raise APIError(400, f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {t!r}",
                               param="response_format.type")
        for make, fields in ((Constraint.json_schema, ("json_schema", "guided_json")),
                             (Constraint.gbnf, ("grammar", "guided_grammar")),
                             (Constraint.regex, ("regex", "guided_regex"))):
            for f in fields:
                if getattr(req, f) is not None:
                    found.append(make(getattr(req, f), f))
        if len(found) > 1:
            names = ", ".join(c.param for c in found)
            raise APIError(400, f"only one output constraint per request, got {names}", param=found[1].param)
        return found[0] if found else None

    def _compile(self, constraint):
        """The compiled grammar of a constraint (cached; runs in a worker thread)."""
        if constraint is None:
            return None
        from pyfast.constrain import compile_constraint

        key = (constraint.kind, json.dumps(constraint.source, sort_keys=True, default=str), constraint.param)
        with self._grammar_lock:
            g = self._grammars.pop(key, None)
            if g is not None:
                self._grammars[key] = g
                return g
        g = compile_constraint(constraint, self.engine.tokenizer, self.engine.n_vocab)
        with self._grammar_lock:
            self._grammars[key] = g
            while len(self._grammars) > 64:
                self._grammars.pop(next(iter(self._grammars)))
        return g

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest, self.limits)
        self._check_model(req.model)
        e = self.engine
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
        p = req.prompt
        if isinstance(p, str):
            self._check_bytes(len(p.encode("utf-8", "surrogatepass")), "prompt")
        elif all(isinstance(x, str) for x in p):
            for x in p:
                self._check_bytes(len(x.encode("utf-8", "surrogatepass")), "prompt")
        try:
            if isinstance(p, str):
                prompts = [await self._prepare(request, lambda _stop: e.tokenizer.encode(p))]
            elif all(isinstance(x, str) for x in p):
                prompts = await self._prepare(request, lambda _stop: [e.tokenizer.encode(x) for x in p])
            elif all(isinstance(x, int) for x in p):
                prompts = [list(p)]
            else:
                prompts = [list(x) for x in p]
        except (ValueError, TypeError) as err:
            raise APIError(400, f"prompt: {err}", param="prompt") from None
        for x in prompts:
            self._check_ids(x, "prompt")
        grammar = await self._grammar_of(request, req, chat=False)
        max_tokens = self._default_max_tokens(req, 16) if req.max_tokens is None else req.max_tokens
        return await self._generate(request, req, prompts, max_tokens, req.logprobs, chat=False, grammar=grammar)

    async def _grammar_of(self, request: Request, req, chat: bool):
        constraint = self._constraint(req, chat)
        if constraint is None:
            return None
        try:
            return await self._prepare(request, lambda _stop: self._compile(constraint))
        except ConstraintError as err:
            raise APIError(400, f"{err.param}: {err}" if err.param else str(err), param=err.param) from None

    async def _generate(self, request: Request, req, prompts: list[list[int]], max_tokens: int | None,
                        logprobs: int | None, chat: bool, grammar=None, tools=None) -> Response:
        jobs, queue = self._submit(req, prompts, max_tokens, logprobs, chat, grammar)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        fmt = _Formatter(self.engine, rid, chat, logprobs is not None, len(prompts), req, tools)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(fmt, jobs, queue, include_usage, self.engine, self.drain),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, fmt, jobs, queue, self.engine, self.drain)

    def _submit(self, req, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, chat: bool,
                grammar=None, n: int | None = None) -> tuple[list[Job], asyncio.Queue]:
        """Check a request's generation settings, make its jobs (``n`` per prompt; default
        ``req.n``) and queue them; returns the jobs and the queue their events arrive on."""
        e = self.engine
        n = req.n if n is None else n
        n_slot = e.n_ctx_slot
        if max_tokens is not None and max_tokens > n_slot:
            raise APIError(400, f"max_tokens is too large: {max_tokens}; a slot holds at most {n_slot} "
                                "tokens (prompt and completion)", param="max_tokens")
        for p in prompts:
            if not p:
                raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
            if len(p) >= n_slot:
                raise APIError(400, f"the prompt has {len(p)} tokens; this server's context holds {n_slot} "
                                    "per request (prompt and completion)",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
        base = {k: getattr(req, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                              "repeat_last_n", "frequency_penalty", "presence_penalty")
                if getattr(req, k) is not None}
        if "temperature" not in base and self.options.temperature is not None:  # --temp
            base["temperature"] = self.options.temperature
        if grammar is not None:
            base["constraint"] = grammar
        req_seed = req.seed if req.seed is not None else self.options.seed  # --seed
        rp = base.get("repeat_penalty")
        if rp is not None and not REPEAT_PENALTY_RANGE[0] <= rp <= REPEAT_PENALTY_RANGE[1]:
            raise APIError(400, f"repeat_penalty must be in [{REPEAT_PENALTY_RANGE[0]:g}, {REPEAT_PENALTY_RANGE[1]:g}] "
                                f"(1.0 disables), got {rp!r}", param="repeat_penalty")
        if req.logit_bias:
            bias = {}
            for t, b in req.logit_bias.items():
                if not _TOKEN_ID.fullmatch(t):  # int() would also take "1_0", " 3" or "٣"
                    raise APIError(400, f"logit_bias: keys must be token ids written in ASCII digits, got {t[:40]!r}",
                                   param="logit_bias")
                tid = int(t)
                if not 0 <= tid < e.n_vocab:
                    raise APIError(400, f"logit_bias: token id {tid} is outside the vocabulary [0, {e.n_vocab})",
                                   param="logit_bias")
                # OpenAI: -100 effectively bans a token, 100 effectively forces it
                bias[tid] = float("-inf") if b <= -100 else float(b)
            if sum(1 for b in bias.values() if b == float("-inf")) >= e.n_vocab:
                raise APIError(400, f"logit_bias bans every token of the vocabulary ({e.n_vocab}); nothing could be "
                                    "generated", param="logit_bias")
            base["logit_bias"] = bias
        n_jobs = len(prompts) * n
        capacity = e.cfg.max_queue + e.cfg.n_parallel
        if n_jobs > capacity:
            raise APIError(400, f"the request asks for {n_jobs} sequences ({len(prompts)} prompts x n={n}); this "
                                f"server holds at most {capacity} at once (--parallel {e.cfg.n_parallel} + --max-queue "
                                f"{e.cfg.max_queue})", param="n", code="request_too_large")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop = [s for s in stop if s]
        queue: asyncio.Queue = asyncio.Queue()
        jobs = []
        for pi, p in enumerate(prompts):
            for j in range(n):
                seed = None if req_seed is None else (req_seed + j) % (2**63)
                sp = SamplingParams(**base, seed=seed)
                try:
                    sp.validate()
                except ValueError as err:
                    field = str(err).split(" ", 1)[0].split(".")[-1] if str(err).startswith("SamplingParams.") else None
                    raise APIError(400, str(err), param=field) from None
                gp = GenParams(max_tokens=max_tokens, sampling=sp, stop=stop, ignore_eos=req.ignore_eos,
                               logprobs=logprobs)
                jobs.append(Job(p, gp, queue, index=pi * n + j))
        try:
            e.submit(jobs)
        except QueueFull as err:
            raise APIError(503, str(err), "server_error", code="queue_full") from None
        except EngineStopped as err:
            raise APIError(503, str(err), "server_error", code="unavailable") from None
        return jobs, queue


def _content_text(content, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                           param=f"messages.{i}.content")
        parts.append(part.text)
    return "\n".join(parts)  # as llama-server joins text parts


def _piece(tok, i: int) -> str:
    return tok.token_piece(i).decode("utf-8", errors="replace")


class _Formatter:
    """Builds OpenAI response objects from engine events."""

    def __init__(self, engine: Engine, rid: str, chat: bool, logprobs: bool, n_prompts: int, req, tools=None):
        self.engine = engine
        self.tools = tools if tools is not None and tools.active else None
        self._tool_streams: dict = {}
        self.id = rid
        self.chat = chat
        self.logprobs = logprobs
        self.created = int(time.time())
        self.model = engine.model_id
        self.n_prompts = n_prompts
        self.offsets: dict[int, int] = {}  # completions text_offset per choice
        self.echo = (not chat) and bool(getattr(req, "echo", False))

    def tool_stream(self, index: int):
        """The choice's ToolStream (None when no tools are parsed)."""
        if self.tools is None:
            return None
        ts = self._tool_streams.get(index)
        if ts is None:
            ts = self._tool_streams[index] = self.tools.stream()
        return ts

    def tool_call_chunks(self, index: int, calls: list[dict]) -> list[dict]:
        """OpenAI's streamed form of finished calls: per call, its id, type and name, then its
        arguments."""
        out = []
        for k, c in enumerate(calls):
            for d in ({"index": k, "id": c["id"], "type": "function",
                       "function": {"name": c["function"]["name"], "arguments": ""}},
                      {"index": k, "function": {"arguments": c["function"]["arguments"]}}):
                ch = self.chunk(index, None, None, None)
                ch["choices"][0]["delta"] = {"tool_calls": [d]}
                out.append(ch)
        return out

    def _tok(self, t: int) -> tuple[str, list[int]]:
        b = self.engine.tokenizer.token_piece(t)
        return b.decode("utf-8", errors="replace"), list(b)

    def logprobs_obj(self, index: int, lps) -> dict | None:
        if not self.logprobs:
            return None
        lps = lps or []
        if self.chat:
            content = []
            for lp in lps:
                s, b = self._tok(lp.token)
                content.append({"token": s, "logprob": lp.logprob, "bytes": b,
                                "top_logprobs": [dict(zip(("token", "bytes"), self._tok(t)), logprob=v)
                                                 for t, v in lp.top]})
            return {"content": content, "refusal": None}
        tokens, tlp, top, offs = [], [], [], []
        off = self.offsets.get(index, 0)
        for lp in lps:
            s, _ = self._tok(lp.token)
            tokens.append(s)
            tlp.append(lp.logprob)
            d: dict[str, float] = {}
            for t, v in lp.top:
                d.setdefault(self._tok(t)[0], v)
            top.append(d)
            offs.append(off)
            off += len(s)
        self.offsets[index] = off
        return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}

    def chunk(self, index: int, text: str | None, lps, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs_obj(index, lps),
                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs_obj(index, lps),
                      "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": f"pyfast-{__version__}", "choices": [choice]}

    def usage(self, jobs: list[Job]) -> dict:
        seen = set()
        n_prompt = 0
        for j in jobs:  # a prompt counts once however many choices it has
            key = j.index // max(1, len(jobs) // self.n_prompts)
            if key not in seen:
                seen.add(key)
                n_prompt += j.stats.n_prompt
        n_gen = sum(j.stats.n_gen for j in jobs)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                "prompt_tokens_details": {"cached_tokens": sum(j.stats.n_cached for j in jobs)}}

    @staticmethod
    def timings(stats: list[JobStats]) -> dict:
        if not stats:
            return {}
        p_n = sum(s.n_processed for s in stats)
        p_ms = max((s.t_prompt_done - s.t_start) * 1e3 for s in stats)
        g_n = sum(s.n_gen for s in stats)
        g_ms = max((s.t_end - s.t_prompt_done) * 1e3 for s in stats)
        drafted = sum(s.n_drafted for s in stats)
        accepted = sum(s.n_accepted for s in stats)
        return {
            "prompt_n": p_n, "prompt_cached": sum(s.n_cached for s in stats), "prompt_ms": p_ms,
            "prompt_per_second": p_n / p_ms * 1e3 if p_ms > 0 else 0.0,
            "predicted_n": g_n, "predicted_ms": g_ms,
            "predicted_per_second": g_n / g_ms * 1e3 if g_ms > 0 else 0.0,
            "queue_ms": max((s.t_start - s.t_arrival) * 1e3 for s in stats),
            "ttft_ms": max((s.t_prompt_done - s.t_arrival) * 1e3 for s in stats),
            "draft_n": drafted, "draft_n_accepted": accepted,
            "draft_acceptance": accepted / drafted if drafted else None,
        }


def _sse_line(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_SHUTDOWN_MSG = "the server is shutting down; this request did not finish in the shutdown grace period"


class _Events:
    """A request's engine events, or None once the shutdown grace period has expired."""

    def __init__(self, queue: asyncio.Queue, drain: Drain | None):
        self.queue = queue
        self.expired = drain.expired if drain is not None else None
        self._exp_task: asyncio.Future | None = None

    async def next(self, extra: asyncio.Future | None = None):
        """The next event; None when the grace period is over; ``extra`` (e.g. a disconnect
        watcher) finishing first returns it instead."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        if self.expired is not None and self.expired.is_set():
            return None
        waits = set()
        get = asyncio.ensure_future(self.queue.get())
        waits.add(get)
        if self.expired is not None:
            if self._exp_task is None:
                self._exp_task = asyncio.ensure_future(self.expired.wait())
            waits.add(self._exp_task)
        if extra is not None:
            waits.add(extra)
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this request's task is cancelled (the client went away)
            if not get.done():
                get.cancel()
        if get in done and not get.cancelled():
            return get.result()
        if extra is not None and extra in done:
            return extra
        return None

    def close(self) -> None:
        if self._exp_task is not None:
            self._exp_task.cancel()


async def _sse(fmt: _Formatter, jobs: list[Job], queue: asyncio.Queue, include_usage: bool,
               engine: Engine, drain: Drain | None = None) -> AsyncIterator[bytes]:
    events = _Events(queue, drain)
    try:
        if fmt.chat:
            for j in jobs:
                yield _sse_line(fmt.chunk(j.index, "", None, None, role=True))
        elif fmt.echo:
            for j in jobs:
                yield _sse_line(fmt.chunk(j.index, engine.tokenizer.decode(j.prompt), None, None))
        pending = len(jobs)
        while pending:
            ev: Event | None = await events.next()
            if ev is None:  # shutdown: end the stream with an error, not a cut connection
                for j in jobs:
                    engine.cancel(j)
                yield _sse_line(APIError(503, _SHUTDOWN_MSG, "server_error", code="shutting_down").body())
                yield b"data: [DONE]\n\n"
                return
            i = ev.job.index
            ts = fmt.tool_stream(i) if fmt.chat else None
            if ev.kind == "delta":
                text = ts.feed(ev.text) if ts is not None else ev.text
                if text or ts is None or ev.logprobs:
                    yield _sse_line(fmt.chunk(i, text, ev.logprobs, None))
            elif ev.kind == "done":
                pending -= 1
                finish = ev.finish_reason
                text = ev.text
                calls = []
                if ts is not None:
                    text = ts.feed(ev.text)
                    rest, calls = ts.finish()
                    text += rest
                if text or ev.logprobs:
                    yield _sse_line(fmt.chunk(i, text, ev.logprobs, None))
                if calls:
                    for ch in fmt.tool_call_chunks(i, calls):
                        yield _sse_line(ch)
                    finish = "tool_calls"
                last = fmt.chunk(i, None if fmt.chat else "", None, finish)
                last["timings"] = fmt.timings([ev.stats])
                yield _sse_line(last)
            else:
                yield _sse_line(APIError(ev.status, ev.message, "server_error").body())
                pending = 0
                for j in jobs:
                    engine.cancel(j)
                yield b"data: [DONE]\n\n"
                return
        if include_usage:
            yield _sse_line({"id": fmt.id, "object": "chat.completion.chunk" if fmt.chat else "text_completion",
                             "created": fmt.created, "model": fmt.model, "choices": [],
                             "usage": fmt.usage(jobs), "timings": fmt.timings([j.stats for j in jobs])})
        yield b"data: [DONE]\n\n"
    finally:
        events.close()
        for j in jobs:  # the client went away (or we are done): free the slots now
            engine.cancel(j)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(request: Request, fmt: _Formatter, jobs: list[Job], queue: asyncio.Queue,
                   engine: Engine, drain: Drain | None = None) -> Response:
    texts = {j.index: [] for j in jobs}
    lps: dict[int, list] = {j.index: [] for j in jobs}
    finish: dict[int, str] = {}
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    events = _Events(queue, drain)
    try:
        pending = len(jobs)
        while pending:
            ev = await events.next(watcher)
            if ev is watcher:  # the client is gone
                return Response(status_code=499)
            if ev is None:
                raise APIError(503, _SHUTDOWN_MSG, "server_error", code="shutting_down")
            i = ev.job.index
            if ev.kind == "error":
                raise APIError(ev.status, ev.message, "server_error")
            texts[i].append(ev.text)
            if ev.logprobs:
                lps[i].extend(ev.logprobs)
            if ev.kind == "done":
                finish[i] = ev.finish_reason
                pending -= 1
    finally:
        watcher.cancel()
        events.close()
        for j in jobs:
            engine.cancel(j)
    choices = []
    for j in sorted(jobs, key=lambda j: j.index):
        i = j.index
        text = "".join(texts[i])
        lp = fmt.logprobs_obj(i, lps[i])
        if fmt.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            reason = finish[i]
            if fmt.tools is not None:
                from pyfast.server.tools import parse_calls

                content, calls = parse_calls(fmt.tools, text)
                if calls:
                    msg = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    reason = "tool_calls"
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason})
        else:
            if fmt.echo:
                text = engine.tokenizer.decode(j.prompt) + text
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
    return JSONResponse({
        "id": fmt.id, "object": "chat.completion" if fmt.chat else "text_completion",
        "created": fmt.created, "model": fmt.model, "system_fingerprint": f"pyfast-{__version__}",
        "choices": choices, "usage": fmt.usage(jobs), "timings": fmt.timings([j.stats for j in jobs])})
