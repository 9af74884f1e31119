"""What one HTTP client may cost the service: header size and count, idle and half-sent connections, bodies.

uvicorn enforces what it has settings for (`uvicorn_settings`): the size of a request's head
(h11_max_incomplete_event_size: past it h11 answers 431/400 and closes) and the keep-alive timeout between
requests. `http_guard.py` adds, on uvicorn's protocol, a deadline for a whole head and a cap on open sockets,
and the cap on requests being worked on (503 with Retry-After) that stalled clients do not count against. Here:
a cap on the number and bytes of headers (`HeaderLimits`, 431), a deadline for reading a body (`read_body`, 408),
and a client that hangs up mid-body is one log line, not a traceback.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from ..errors import InputError
from .validation import RequestError


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024  # the request line and every header together
    max_headers: int = 64
    keep_alive_s: int = 5  # an idle connection is closed after this long
    max_connections: int = 64  # requests worked on at once (a body counts once it has arrived); past it 503
    body_timeout_s: float = 30.0  # a body not fully received this long after the head is refused (408)
    head_timeout_s: float = 10.0  # a head not whole this long after the connection or the last response: closed
    max_sockets: int = 2048  # open sockets at once; one more is closed as it opens
    # POST /v1/videos/sync holds its answer this long for the job to end, then answers 504 naming the video to poll
    # (the job goes on). Five minutes: a clip of a few seconds on a GPU ends well within it, and a longer wait
    # outlasts what HTTP clients and proxies in between commonly keep a silent connection for.
    sync_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # Named as serve's flags (its --max-header-kb is checked there, in KiB).
        for name, low, high in (("max_header_bytes", 1024, 1 << 20), ("max_headers", 8, 1000),
                                ("keep_alive_s", 1, 3600), ("max_connections", 4, 100_000),
                                ("body_timeout_s", 1, 3600), ("head_timeout_s", 0.1, 3600),
                                ("max_sockets", 16, 1_000_000), ("sync_timeout_s", 1, 86400)):
            value = getattr(self, name)
            if not low <= value <= high:
                raise InputError(f"--{name.replace('_', '-')} must be {low}..{high}, got {value}")


def uvicorn_settings(limits: HttpLimits) -> dict:
    """uvicorn.Config keywords for `limits`: h11 (its head-size limit is the one uvicorn can set) with our head
    deadline and socket cap; no `limit_concurrency`, which would count stalled sockets (RequestLimit counts the
    requests being worked on instead)."""
    from .http_guard import guarded_protocol

    return {"http": guarded_protocol(limits.head_timeout_s, limits.max_sockets),
            "h11_max_incomplete_event_size": limits.max_header_bytes, "timeout_keep_alive": limits.keep_alive_s,
            "limit_concurrency": None}


class HeaderLimits:
    """ASGI middleware: a request with more than `count` headers, or more than `size` bytes of them, is answered
    431 before any route sees it. h11's own limit (uvicorn_settings) counts only a head still incomplete after a
    read, so one that arrives whole in a read of up to 64 KiB passes it; this one counts every head."""

    def __init__(self, app, count: int, size: int):
        self.app, self.count, self.size = app, count, size

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) for name, value in headers)
            problem = (f"the request has {len(headers)} headers; the limit is {self.count}"
                       if len(headers) > self.count else
                       f"the request's headers are {size} bytes; the limit is {self.size}" if size > self.size
                       else None)
            if problem is not None:
                from .api_errors import error_response

                response = error_response(scope["path"], 431, problem, {"Connection": "close"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client hung up before its body arrived: nothing to answer."""


def check_declared_length(request: Request, limit: int) -> None:
    """413 when the declared Content-Length is past `limit` (before a byte is read); 400 when it is not a number."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise RequestError(400, f"Content-Length {declared!r} is not a number") from None
        if size > limit:
            raise RequestError(413, f"the request body is {size} bytes; the limit is {limit}")


async def body_chunks(request: Request, timeout_s: float, limit: int | None = None):
    """The body's chunks as they arrive: 408 when it has not all arrived within `timeout_s`, 413 once past `limit`
    bytes (None: no limit here) without reading the rest, ClientGone when the client hangs up first. The one
    deadline-bounded read every body reader here (JSON bodies, multipart uploads, the fleet's front) goes through."""
    total, deadline = 0, time.monotonic() + timeout_s
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(deadline - time.monotonic(), 0.001))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s",
                               {"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientGone() from None
        total += len(chunk)
        if limit is not None and total > limit:
            raise RequestError(413, f"the request body exceeds the {limit} byte limit")
        yield chunk


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refusing (413) past `limit` bytes without reading the rest and (408) when it has not all
    arrived within `timeout_s`; ClientGone when the client disconnects first."""
    check_declared_length(request, limit)
    return b"".join([chunk async for chunk in body_chunks(request, timeout_s, limit)])


def client_gone_line(request: Request, received: str = "its body") -> str:
    client = request.client
    who = f"{client.host}:{client.port}" if client else "a client"
    return f"{who} disconnected before sending {received} of {request.method} {request.url.path}; nothing done"
