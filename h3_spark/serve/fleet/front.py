"""The fleet's HTTP front: our uvicorn, with `h3-spark serve`'s protocol and middleware, before Ray Serve's proxy.

Ray Serve's proxy is a uvicorn that Ray configures itself (host, port, keep-alive, request timeout, ASGI
middlewares): it takes no protocol class, so it has no deadline for a request's head and no cap on open sockets,
and its ASGI middlewares see a request only once its head is whole. Stalled sockets that `serve` closes at its
deadlines would stay open on it for as long as their clients like. So `h3-spark fleet` listens here instead:

  uvicorn      http_limits.uvicorn_settings: the head deadline and the socket cap (http_guard.py), the head-size
               limit, the keep-alive; the same HttpLimits as `serve` (the fleet config's `http`)
  middleware   http_app.middleware: requests worked on at once (503 + Retry-After, stalled ones not counted), header
               count and size (431), the Host list, the token: the same stack, in the same order, as `serve`
  body         received whole here within the body deadline (408; spooled to disk past 1 MiB), at most the largest
               body a route takes (413), before anything reaches Ray: a stalled body never holds a place upstream
  forwarding   method, path, query, headers (but hop-by-hop ones) and the body to Ray's proxy on a loopback port of
               its own (nothing else listens there); the answer streamed back as it comes (an mp4 download, /sync)

The router behind Ray's proxy still checks the Host, the token and each route's own limits: the front keeps slow and
unwelcome clients off Ray, the router stays what `serve run` exposes alone.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ..http_app import build_app
from ..http_limits import HttpLimits, body_chunks, check_declared_length
from ..validation import Limits, RequestError

# Hop-by-hop headers (RFC 9110 7.6.1) and the length, which is this hop's own.
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
        b"transfer-encoding", b"upgrade", b"content-length"}
_IN_MEMORY = 1 << 20  # a body past this is spooled to a temporary file
_CHUNK = 1 << 16
_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
# The form fields a multipart body may carry besides its file (openai_routes.MAX_FORM_FIELDS), each at most a JSON
# body's size: the largest body a route takes is one upload and those.
_FORM_FIELDS = 64


def largest_body(limits: Limits) -> int:
    """The largest request body any route of the router takes: an upload with its form fields."""
    return limits.max_input_file_bytes + _FORM_FIELDS * limits.max_body_bytes


async def receive_body(request: Request, limit: int, timeout_s: float):
    """The whole body in a spooled temporary file (rewound), with its size; 413 past `limit` (on the declared
    length before reading), 408 when it has not all arrived within `timeout_s`, ClientGone when the client hangs
    up first."""
    check_declared_length(request, limit)
    spool = tempfile.SpooledTemporaryFile(max_size=_IN_MEMORY)
    total = 0
    try:
        async for chunk in body_chunks(request, timeout_s, limit):
            total += len(chunk)
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool, total


def _chunks(spool):
    async def read():
        try:
            while chunk := spool.read(_CHUNK):
                yield chunk
        finally:
            spool.close()

    return read()


def front_app(upstream: str, http: HttpLimits, limits: Limits, allowed_hosts: tuple[str, ...] | None, api_key,
              log: Callable[[str], None]):
    """The front's ASGI app: every request, once its head and body are in and the middleware let it through,
    forwarded to `upstream` (Ray Serve's proxy, http://127.0.0.1:PORT) and its answer streamed back."""
    import httpx

    state: dict = {}
    body_limit = largest_body(limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # No read deadline: /v1/videos/sync holds its answer until the job ends (the router bounds that wait).
        state["client"] = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(10.0, read=None),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            yield
        finally:
            await state["client"].aclose()

    async def forward(request: Request) -> StreamingResponse:
        client: httpx.AsyncClient = state["client"]
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        spool, size = None, 0
        if request.method not in ("GET", "HEAD", "DELETE", "OPTIONS") or "content-length" in request.headers or \
                "transfer-encoding" in request.headers:
            spool, size = await receive_body(request, body_limit, http.body_timeout_s)
            headers.append((b"content-length", str(size).encode()))
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        outgoing = client.build_request(request.method, target, headers=headers,
                                        content=_chunks(spool) if spool is not None else None)
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            if spool is not None:
                spool.close()
            raise RequestError(503, f"the fleet's router is not answering ({type(exc).__name__}); retry shortly",
                               {"Retry-After": "5"}, code="not_ready") from None
        async def relay():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # sent, or the client went away: the upstream connection goes back either way
                await answer.aclose()

        response = StreamingResponse(relay(), status_code=answer.status_code)
        response.raw_headers = [(k, v) for k, v in answer.headers.raw
                                if k.lower() not in _HOP or k.lower() == b"content-length"]
        return response

    routes = [Route("/", forward, methods=_METHODS), Route("/{path:path}", forward, methods=_METHODS)]
    return build_app(routes, lifespan, http, allowed_hosts, api_key, log)
