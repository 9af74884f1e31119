"""The HTTP API (Starlette, served by uvicorn): a thin translation onto `Service`.

  GET    /ready       200 when every model is resident (models, dtypes, device, memory, supported kernels),
                      503 with what is still loading (or why loading failed)
  POST   /generate    JSON (serve/validation.py lists the fields) -> 202 {"id", "state", "url"}
                      400 bad field or JSON, 408 body not received in time, 409 output exists / taken,
                      413 too large, 415 not Content-Type: application/json, 429 queue full (Retry-After),
                      431 too many headers, 503 not ready
  GET    /jobs        queue state and the jobs on record
  GET    /jobs/{id}   state (queued | running | done | failed | cancelled), progress, timings, output,
                      backends, step-cache report, error
  DELETE /jobs/{id}   cancel: a queued job at once (200), a running one within a DiT block (202)
  GET    /jobs/{id}/preview  PNG of the newest sampling step's preview strip (404 until the first step)
  GET    /live       liveness: the process answers
  GET    /metrics    Prometheus text: jobs by state, queue, stage seconds, GPU memory, kernels
Errors are JSON: {"error": "..."}.
"""

from __future__ import annotations

import contextlib
import json

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .http_limits import ClientGone, HeaderLimits, client_gone_line, read_body
from .service import Service
from .validation import RequestError


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Starlette's own refusals (unknown route, wrong method) in the API's JSON shape.
    return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"}, status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)


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


def create_app(service: Service) -> Starlette:
    async def ready(request: Request) -> JSONResponse:
        ok, body = await run_in_threadpool(service.ready)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def generate(request: Request) -> JSONResponse:
        try:
            check_json_type(request)
            raw = await read_body(request, service.limits.max_body_bytes, service.config.http.body_timeout_s)
            job = await run_in_threadpool(service.submit, parse_json(raw))
        except RequestError as exc:
            return _error(exc)
        except ClientGone:
            service.log(client_gone_line(request))
            return Response(status_code=400)  # no one reads it
        url = f"/jobs/{job.id}"
        return JSONResponse({"id": job.id, "state": "queued", "url": url}, status_code=202,
                            headers={"Location": url})

    async def jobs(request: Request) -> JSONResponse:
        return JSONResponse({"queue": service.queue.stats(), "jobs": service.queue.list()})

    async def job(request: Request) -> JSONResponse:
        job_id = request.path_params["job_id"]
        if request.method == "DELETE":
            try:
                record = service.cancel(job_id)
            except RequestError as exc:
                return _error(exc)
            return JSONResponse(record, status_code=202 if record["state"] == "running" else 200)
        record = service.queue.snapshot(job_id)
        if record is None:
            return JSONResponse({"error": f"no job {job_id}"}, status_code=404)
        return JSONResponse(record)

    async def preview(request: Request) -> Response:
        try:
            png = await run_in_threadpool(service.preview_png, request.path_params["job_id"])
        except RequestError as exc:
            return _error(exc)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    async def live(request: Request) -> JSONResponse:
        # Liveness: the process answers (whatever the models' state; /ready says whether it can take work).
        return JSONResponse({"alive": True})

    async def metrics(request: Request) -> Response:
        if service.metrics is None:
            return JSONResponse({"error": "/metrics needs prometheus-client: pip install 'h3-spark[serve]'"},
                                status_code=501)
        body, media_type = await run_in_threadpool(service.metrics.render)
        return Response(body, media_type=media_type)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await run_in_threadpool(service.stop)

    routes = [Route("/ready", ready, methods=["GET"]), Route("/generate", generate, methods=["POST"]),
              Route("/jobs", jobs, methods=["GET"]), Route("/jobs/{job_id}", job, methods=["GET", "DELETE"]),
              Route("/jobs/{job_id}/preview", preview, methods=["GET"]), Route("/live", live, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    middleware = []
    from starlette.middleware import Middleware

    if service.config.allowed_hosts:
        # DNS rebinding: a page at attacker.example, resolved to 127.0.0.1, sends Host: attacker.example.
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(service.config.allowed_hosts)))
    if service.config.api_key is not None:
        from .auth import BearerAuth

        middleware.append(Middleware(BearerAuth, key=service.config.api_key))
    # Outermost: a request with too many headers costs nothing more.
    middleware.insert(0, Middleware(HeaderLimits, count=service.config.http.max_headers,
                                    size=service.config.http.max_header_bytes))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.service = service
    return app
