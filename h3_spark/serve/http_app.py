"""What the service's HTTP API (app.py) and the fleet's router (fleet/router.py) are both built on; each keeps only
its routes.

  errors      every refusal is JSON {"error": "..."} (OpenAI's error object on /v1/, api_errors.py): a RequestError
              with its status and headers, Starlette's own (unknown route, wrong method) naming the request, anything
              else 500 naming only the exception's type
  bodies      a POST's JSON: Content-Type checked (415), read within the limits (http_limits.py: 408, 413), parsed
              strictly (400); a client that hangs up mid-body is one log line
  middleware  outermost first: requests at once (503), the header limits (431), the Host list (DNS rebinding; 400 in
              the route family's error shape), the bearer token (401)
  /live, /metrics, the preview PNG
"""

from __future__ import annotations

import json
from typing import Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .api_errors import error_response
from .http_limits import ClientGone, HeaderLimits, HttpLimits, client_gone_line, read_body
from .validation import RequestError


def check_json_type(request: Request) -> None:
    """POST bodies must say they are JSON (415 otherwise). A web page can send text/plain, a form or multipart to
    another origin without asking first (no CORS preflight), but not application/json: this keeps a page the user
    visits from queueing jobs on a token-less service on their machine."""
    given = request.headers.get("content-type", "")
    if given.split(";")[0].strip().lower() != "application/json":
        raise RequestError(415, f"{request.method} {request.url.path} takes Content-Type: application/json, got "
                                f"{given or 'none'!r}")


def _reject_constant(name: str):
    # NaN and Infinity are not JSON; Python's parser would accept them.
    raise RequestError(400, f"{name} is not valid JSON")


def parse_json(raw: bytes) -> object:
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} "
                                f"column {exc.colno})") from None
    except RecursionError:
        raise RequestError(400, "the request body nests too deeply") from None
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise RequestError(400, f"the request body is not acceptable JSON ({exc})") from None


async def json_body(request: Request, limit: int, timeout_s: float) -> object:
    """The POST's JSON body; RequestError (answered by the app's handler) or ClientGone otherwise."""
    check_json_type(request)
    return parse_json(await read_body(request, limit, timeout_s))


async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return error_response(request.url.path, exc.status, str(exc), exc.headers, param=exc.param, code=exc.code)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Starlette's own refusals (unknown route, wrong method) in the API's JSON shape.
    return error_response(request.url.path, exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")


async def live(request: Request) -> JSONResponse:
    # Liveness: the process answers (whatever the models' state; /ready says whether it can take work).
    return JSONResponse({"alive": True})


def metrics_endpoint(metrics: Callable[[], object], extra: str, in_thread: bool):
    """GET /metrics from `metrics()` (its render(), in a worker thread when `in_thread`); 501 naming the extra
    that brings prometheus-client when it is None."""
    async def endpoint(request: Request) -> Response:
        source = metrics()
        if source is None:
            return JSONResponse({"error": f"/metrics needs prometheus-client: pip install 'h3-spark[{extra}]'"},
                                status_code=501)
        body, media_type = await run_in_threadpool(source.render) if in_thread else source.render()
        return Response(body, media_type=media_type)

    return endpoint


def png(body: bytes) -> Response:
    return Response(body, media_type="image/png", headers={"Cache-Control": "no-store"})


def host_name(header: str) -> str:
    """The name of a Host header, its port dropped ("[::1]:8000" -> "[::1]"), lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if ":" in header else header


class HostCheck:
    """ASGI middleware: a request whose Host is not one of `allowed` (names, or "*.domain" for its sub-domains) is
    refused 400 in the route family's error shape (OpenAI's on /v1/), before the token is asked for."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.names = {h for h in allowed if not h.startswith("*.")}
        self.suffixes = tuple(h[1:] for h in allowed if h.startswith("*."))

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            name = host_name(header)
            if name not in self.names and not (self.suffixes and name.endswith(self.suffixes)):
                response = error_response(scope["path"], 400, f"Host {header[:100]!r} is not a name this server "
                                                              f"answers to (--allowed-host)", code="invalid_host")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def middleware(http: HttpLimits, allowed_hosts: tuple[str, ...] | None, api_key: str | None) -> list[Middleware]:
    """Outermost first: the cap on requests worked on at once; a request with too many headers costs nothing more;
    then the Host list; then the token."""
    from .http_guard import RequestLimit

    stack = [Middleware(RequestLimit, limit=http.max_connections),
             Middleware(HeaderLimits, count=http.max_headers, size=http.max_header_bytes)]
    if allowed_hosts:
        # DNS rebinding: a page at attacker.example, resolved to 127.0.0.1, sends Host: attacker.example.
        stack.append(Middleware(HostCheck, allowed=allowed_hosts))
    if api_key is not None:
        from .auth import BearerAuth

        stack.append(Middleware(BearerAuth, key=api_key))
    return stack


def build_app(routes: list, lifespan, http: HttpLimits, allowed_hosts: tuple[str, ...] | None,
              api_key: str | None, log: Callable[[str], None]) -> Starlette:
    """The Starlette app of `routes` behind the shared middleware and error handlers; `log` takes the line of a
    client that hung up mid-body."""
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        log(client_gone_line(request))
        return Response(status_code=400)  # no one reads it

    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware(http, allowed_hosts, api_key),
                     exception_handlers={RequestError: _request_error, ClientGone: client_gone,
                                         HTTPException: _http_error, Exception: _internal_error})
