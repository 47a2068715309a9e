"""Bounds on what a request may cost before the server does its work, and graceful shutdown.

* :class:`Limits`: body size (enforced while the body streams in, not after it is buffered),
  header and body read timeouts (a client that trickles bytes or promises a longer body than it
  sends is dropped), the render / tokenize concurrency, and the shutdown grace period.
* :class:`HeaderTimeoutH11Protocol`: uvicorn's h11 protocol with a deadline on each request's
  headers (uvicorn only times out idle keep-alive connections).
* :class:`Drain` and :class:`GracefulServer`: on SIGTERM uvicorn stops accepting connections;
  requests already running get ``shutdown_timeout`` seconds to finish, then the app ends the
  rest itself (an SSE error event and ``[DONE]``, or a 503 body) so no stream is cut silently.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class Limits:
    max_body_bytes: int = 64 * 1024 * 1024
    body_timeout: float = 30.0        # seconds for the whole body
    body_idle_timeout: float = 10.0   # seconds without a body byte
    header_timeout: float = 10.0      # seconds from a request's first byte to its last header
    shutdown_timeout: float = 10.0    # seconds running requests get after SIGTERM
    max_prepare: int = 2              # requests rendering / tokenizing at once (CPU work off the loop)

    def validate(self) -> "Limits":
        for name, flag in (("body_timeout", "--timeout"), ("body_idle_timeout", "body_idle_timeout"),
                           ("header_timeout", "--header-timeout")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a positive number of seconds, got {v!r}")
        if not (isinstance(self.shutdown_timeout, (int, float)) and 0 <= self.shutdown_timeout < math.inf):
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_prepare < 1:
            raise ValueError(f"max_prepare must be >= 1, got {self.max_prepare}")
        return self


class Drain:
    """Shutdown state shared by the app and the server: ``draining`` once shutdown begins,
    ``expired`` (an asyncio.Event) once running requests have had their grace period."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.draining = False
        self.expired: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.expired = asyncio.Event()

    def start(self) -> None:
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        if self.expired is None:
            self.expired = asyncio.Event()
        self._timer = loop.call_later(self.timeout, self.expired.set)

    def expire_now(self) -> None:
        self.draining = True
        if self.expired is not None:
            self.expired.set()


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that starts the app's drain when it begins shutting down."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets=None) -> None:
        self.drain.start()
        await super().shutdown(sockets)


class HeaderTimeoutH11Protocol(H11Protocol):
    """Closes a connection whose request headers do not all arrive within ``header_timeout``
    seconds of the request's first byte (slowloris)."""

    header_timeout = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()
        before = self.cycle
        super().data_received(data)
        if self.cycle is not None and self.cycle is not before:  # a request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # idle keep-alive time is uvicorn's timeout_keep_alive; the next request's first byte
        # arms the header timer again

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %.0f s", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_timeout_protocol(seconds: float) -> type:
    """The protocol class for uvicorn's ``http=`` option with this header deadline."""
    return type("PyfastH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": float(seconds)})
