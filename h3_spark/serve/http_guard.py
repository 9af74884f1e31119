"""Slow clients cannot starve the service: deadlines for a request's head, a cap on open sockets, and a cap on
the requests being worked on that stalled ones do not count against.

uvicorn closes an idle keep-alive connection, but a client that sends a byte of its head now and then restarts
that timer each time, and uvicorn has no deadline for a head as a whole; its `limit_concurrency` counts every
open socket, so 64 such clients took the service out (every real request 503). Here, on uvicorn's own h11
protocol (a subclass: uvicorn parses, we time and count):
- a head must arrive whole within `head_timeout_s` of the connection opening or of the previous response, or
  the socket is closed (a stalled socket costs a file descriptor and a timer until then);
- at most `max_sockets` sockets are open; one more is closed as soon as it opens;
- `RequestLimit` (ASGI) answers 503 with Retry-After past `max_requests` requests being worked on. A request
  counts from its head, or for a request with a body, from the body's last byte: one whose body stalls waits in
  `read_body`, bounded by the body deadline (408), without holding a place.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

RETRY_AFTER_S = 1


def guarded_protocol(head_timeout_s: float, max_sockets: int) -> type:
    """uvicorn's h11 protocol with a head deadline and a socket cap (uvicorn.Config(http=...) takes the class)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_sockets:
                transport.close()  # refused at once: the set is full of sockets already
                return
            self._heads_seen = 0
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_expired, self._heads_seen)

        def _disarm_head_deadline(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_expired(self, heads_seen: int) -> None:
            if self._heads_seen == heads_seen and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole head arrived: a new request-response cycle began
                self._heads_seen += 1
                self._disarm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()  # the next head, on a kept-alive connection, has its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

    return GuardedH11Protocol


class RequestLimit:
    """ASGI middleware: at most `limit` HTTP requests worked on at once; past it 503 with Retry-After. A request
    with a body counts once its body has arrived (a stalled body holds no place)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        has_body = any(name == b"content-length" and value not in (b"0",) for name, value in scope["headers"]) or \
            any(name == b"transfer-encoding" for name, _ in scope["headers"])
        counted = False

        def take() -> bool:
            nonlocal counted
            if self.active >= self.limit:
                return False
            self.active += 1
            counted = True
            return True

        async def counting_receive():
            message = await receive()
            if not counted and message["type"] == "http.request" and not message.get("more_body", False):
                if not take():
                    raise _Busy()
            return message

        try:
            if not has_body and not take():
                return await _busy(scope, receive, send)
            try:
                return await self.app(scope, counting_receive if has_body else receive, send)
            except _Busy:
                return await _busy(scope, receive, send)
        finally:
            if counted:
                self.active -= 1


class _Busy(Exception):
    """Raised inside a request whose body arrived when every place was taken."""


async def _busy(scope, receive, send) -> None:
    from .api_errors import error_response

    response = error_response(scope["path"], 503, "the service is busy: too many requests at once; retry shortly",
                              {"Retry-After": str(RETRY_AFTER_S)}, code="busy")
    await response(scope, receive, send)
