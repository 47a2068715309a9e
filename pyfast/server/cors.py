"""CORS (cross-origin resource sharing) as pure ASGI middleware.

``--cors-origins`` lists the origins whose pages may call the API from a browser. The default,
``localhost``, allows pages served from the local machine only (``http(s)://localhost``,
``127.0.0.1`` and ``[::1]`` on any port); ``*`` allows every origin and must be given
explicitly. Preflight requests (``OPTIONS`` with ``Access-Control-Request-Method``) are answered
here, before authentication (browsers send no credentials with them); every other response to an
allowed origin carries ``Access-Control-Allow-Origin`` (errors, 401s and streams included). A
request from an origin that is not allowed is still served (CORS is enforced by the browser),
but without the headers, so the browser does not hand the response to the page; its preflight
gets a 403 naming the origin.
"""
from __future__ import annotations

import json
import re
from typing import Iterable

DEFAULT_ORIGINS = ("localhost",)
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key"
EXPOSE_HEADERS = "Content-Type, WWW-Authenticate"
MAX_AGE = "600"
_LOCAL = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?")
_ORIGIN = re.compile(r"(https?)://[^\s/?#]+")
_HEADER_NAMES = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")


class CorsPolicy:
    """Which origins may read responses. ``origins``: exact origins (``https://app.example``),
    ``localhost`` (the loopback origins on any port) and/or ``*`` (any origin)."""

    def __init__(self, origins: Iterable[str] = DEFAULT_ORIGINS):
        self.any = False
        self.local = False
        self.exact: set[str] = set()
        for o in origins:
            o = o.strip()
            if not o:
                continue
            if o == "*":
                self.any = True
            elif o.lower() in ("localhost", "local"):
                self.local = True
            elif o.lower() == "none":
                continue
            else:
                o = o.rstrip("/")
                if not _ORIGIN.fullmatch(o):
                    raise ValueError(f"--cors-origins: {o!r} is not an origin (scheme://host[:port]), 'localhost' "
                                     "or '*'")
                self.exact.add(o.lower())

    @classmethod
    def parse(cls, spec: str | Iterable[str] | None) -> "CorsPolicy":
        if spec is None:
            return cls()
        if isinstance(spec, str):
            spec = spec.split(",")
        return cls(list(spec))

    def allows(self, origin: str) -> bool:
        if self.any:
            return True
        o = origin.lower()
        return o in self.exact or (self.local and bool(_LOCAL.fullmatch(o)))

    def allow_origin_value(self, origin: str) -> str:
        return "*" if self.any else origin


class CorsMiddleware:
    def __init__(self, app, policy: CorsPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers", []):
            if k in (b"origin", b"access-control-request-method", b"access-control-request-headers"):
                headers[k.decode()] = v.decode("latin-1")
        origin = headers.get("origin")
        if scope.get("method") == "OPTIONS":
            return await self._options(origin, headers, send)
        if origin is None or not self.policy.allows(origin):
            return await self.app(scope, receive, send)
        extra = [(b"access-control-allow-origin", self.policy.allow_origin_value(origin).encode("latin-1")),
                 (b"access-control-expose-headers", EXPOSE_HEADERS.encode())]
        if not self.policy.any:
            extra.append((b"vary", b"Origin"))

        async def send_cors(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg, headers=list(msg.get("headers", [])) + extra)
            await send(msg)

        await self.app(scope, receive, send_cors)

    async def _options(self, origin: str | None, headers: dict, send) -> None:
        method = headers.get("access-control-request-method")
        if origin is None or method is None:  # not a preflight: say what the server takes
            return await _respond(send, 204, [(b"allow", ALLOW_METHODS.encode())])
        if not self.policy.allows(origin):
            body = json.dumps({"error": {"message": f"CORS: origin {origin[:200]!r} is not allowed (--cors-origins)",
                                         "type": "invalid_request_error", "param": "Origin",
                                         "code": "cors_origin_not_allowed"}}).encode()
            return await _respond(send, 403, [(b"content-type", b"application/json")], body)
        req_headers = headers.get("access-control-request-headers", "").strip()
        allow_headers = req_headers if req_headers and _HEADER_NAMES.fullmatch(req_headers) else ALLOW_HEADERS
        out = [(b"access-control-allow-origin", self.policy.allow_origin_value(origin).encode("latin-1")),
               (b"access-control-allow-methods", ALLOW_METHODS.encode()),
               (b"access-control-allow-headers", allow_headers.encode("latin-1")),
               (b"access-control-max-age", MAX_AGE.encode())]
        if not self.policy.any:
            out.append((b"vary", b"Origin"))
        await _respond(send, 204, out)


async def _respond(send, status: int, headers: list, body: bytes = b"") -> None:
    headers = headers + [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
