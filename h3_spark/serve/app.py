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
  /v1/videos, /v1/models   OpenAI's Videos API onto the same jobs (openai_routes.py)
Errors are JSON: {"error": "..."} (OpenAI's error object on /v1/); the errors, the body reading and the middleware
are http_app.py's (the fleet's router shares them).
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .auth import client_of
from .http_app import build_app, json_body, live, metrics_endpoint, png
from .openai_routes import ServiceVideos, video_routes
from .service import Service


def create_app(service: Service) -> Starlette:
    async def ready(request: Request) -> JSONResponse:
        ok, body = await run_in_threadpool(service.ready)
        return JSONResponse(body, status_code=200 if ok else 503)

    async def generate(request: Request) -> JSONResponse:
        body = await json_body(request, service.limits.max_body_bytes, service.config.http.body_timeout_s)
        job = await run_in_threadpool(service.submit, body, client_of(request))
        url = f"/jobs/{job.id}"
        return JSONResponse({"id": job.id, "state": "queued", "url": url}, status_code=202,
                            headers={"Location": url})

    async def jobs(request: Request) -> JSONResponse:
        return JSONResponse({"queue": service.queue.stats(), "jobs": service.jobs_of(client_of(request))})

    async def job(request: Request) -> JSONResponse:
        job_id = request.path_params["job_id"]
        service.visible(job_id, client_of(request))
        if request.method == "DELETE":
            record = service.cancel(job_id)
            return JSONResponse(record, status_code=202 if record["state"] == "running" else 200)
        record = service.queue.snapshot(job_id)
        if record is None:
            return JSONResponse({"error": f"no job {job_id}"}, status_code=404)
        return JSONResponse(record)

    async def preview(request: Request):
        service.visible(request.path_params["job_id"], client_of(request))
        return png(await run_in_threadpool(service.preview_png, request.path_params["job_id"]))

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
              Route("/metrics", metrics_endpoint(lambda: service.metrics, "serve", in_thread=True),
                    methods=["GET"]), *video_routes(ServiceVideos(service))]
    app = build_app(routes, lifespan, service.config.http, service.config.allowed_hosts, service.config.api_key,
                    service.log)
    app.state.service = service
    return app
