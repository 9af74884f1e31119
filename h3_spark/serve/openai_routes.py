"""The `/v1/` routes (OpenAI's Videos API, and the models list) over a backend that holds the jobs: the service
itself (`ServiceVideos`) or the fleet's router (fleet/router.py's `FleetVideos`). The translation is
openai_videos.py's, uploads are uploads.py's; every refusal here is OpenAI's error object (api_errors.py).

  POST   /v1/videos                       create: JSON or multipart/form-data (input_reference uploaded) -> video
  POST   /v1/videos/sync                  create and wait (HttpLimits.sync_timeout_s; then 504 naming the video):
                                          the mp4 itself (x-video-id, x-inference-time-s)
  GET    /v1/videos                       list: after, limit (1..100, 20), order (desc) -> first_id, last_id, has_more
  GET    /v1/videos/{id}                  the video object
  DELETE /v1/videos/{id}                  cancel if it runs, forget it, remove its file -> video.deleted
  GET    /v1/videos/{id}/content          variant video (default; or 0) | thumbnail (WebP) | spritesheet (JPEG)
  POST   /v1/videos/extensions            the video (by id, or uploaded) goes on for `seconds` more
  POST   /v1/videos/{id}/remix            the same request with a new prompt
  GET    /v1/models, /v1/models/{id}      h3, and h3-<mode> for each mode loaded
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Protocol

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from . import openai_videos as ov
from .auth import client_of, sees
from .http_app import json_body
from .uploads import Form, UploadFolder, read_form
from .http_limits import HttpLimits
from .validation import Limits, RequestError

VIDEO_FOLDER = "videos"  # the outputs of /v1/ jobs, in the output folder
SYNC_POLL_S = 0.1
MAX_FORM_FIELDS = 64
TERMINAL = ("done", "failed", "cancelled")


class VideoBackend(Protocol):
    """What the routes need of whoever holds the jobs. `client` is the request's auth.Client (None without keys)."""

    keep_days: float
    started: float
    limits: Limits
    http: HttpLimits
    uploads: UploadFolder | None  # None: no folder to take uploads in (multipart refused)

    async def submit(self, submission: ov.Submission, client) -> dict: ...  # the queued job's record

    async def record(self, job_id: str, client) -> dict | None: ...  # None: no such video for this client

    async def records(self, client) -> list[dict]: ...

    async def delete(self, job_id: str, client) -> None: ...

    async def modes(self) -> list[str]: ...


class ServiceVideos:
    """The service's own jobs."""

    def __init__(self, service):
        self.service = service
        self.keep_days = service.config.keep_days
        self.limits, self.http = service.limits, service.config.http
        self.started = time.time()
        self.uploads = UploadFolder(service.config.state_dir or service.outputs.root, service.limits)

    async def submit(self, submission, client):
        job = await run_in_threadpool(submit_video, self.service, submission, client)
        return job.to_dict()

    async def record(self, job_id, client):
        record = self.service.queue.snapshot(job_id)
        if not ov.is_video(record) or not sees(client, record):
            return None
        return record

    async def records(self, client):
        def read():
            found = (self.service.queue.snapshot(item["id"]) for item in self.service.jobs_of(client))
            return [r for r in found if ov.is_video(r)]

        return await run_in_threadpool(read)

    async def delete(self, job_id, client):
        await run_in_threadpool(self.service.delete, job_id)

    async def modes(self):
        models = self.service.models
        if models is None:
            raise RequestError(503, "not ready: the models are still loading", {"Retry-After": "5"})
        return list(models.modes)


def submit_video(service, submission: ov.Submission, client):
    """Queue a /v1/ job on `service` (the service's routes and a fleet replica both): its output folder made, its
    request kept for a remix."""
    (service.outputs.root / VIDEO_FOLDER).mkdir(exist_ok=True)
    ov.kept_body(submission)
    return service.submit(submission.body, client, files=submission.files, labels=submission.labels)


def _output_name() -> str:
    return f"{VIDEO_FOLDER}/{uuid.uuid4().hex}.mp4"


async def _read_request(request: Request, backend: VideoBackend, file_fields: tuple[str, ...]) -> tuple[dict, Form]:
    """(fields, form with its uploads) of a JSON or multipart/form-data POST."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    limits, timeout = backend.limits, backend.http.body_timeout_s
    if kind == "multipart/form-data":
        if backend.uploads is None:
            raise RequestError(400, "this front has no state folder to take uploads in; send JSON",
                               code="uploads_unavailable")
        if request.headers.get("origin") is not None:
            # A web page may send a form to another origin without asking first; our clients are programs.
            raise RequestError(403, f"{request.url.path} refuses multipart bodies from web pages (Origin "
                                    f"{request.headers['origin']!r:.80}); send JSON", code="forbidden")
        form = await read_form(request, backend.uploads, file_fields=file_fields,
                               max_field_bytes=limits.max_body_bytes, max_fields=MAX_FORM_FIELDS,
                               max_file_bytes=limits.max_input_file_bytes, timeout_s=timeout)
        try:
            return ov.form_values(form.fields), form
        except BaseException:
            form.discard()
            raise
    if kind != "application/json":
        raise RequestError(415, f"{request.method} {request.url.path} takes application/json or multipart/form-data, "
                                f"got {kind or 'no Content-Type'!r}")
    body = await json_body(request, limits.max_body_bytes, timeout)
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body, Form()


async def _submit(backend: VideoBackend, make, form: Form, client, fields: dict) -> dict:
    """Translate (`make()` -> Submission) and queue; the uploads are removed if that fails, and a refusal names
    the field as the client sent it (`fields`)."""
    try:
        submission = make()
        return await backend.submit(submission, client)
    except RequestError as exc:
        form.discard()
        exc.param = ov.client_param(exc.param, fields)
        raise
    except BaseException:
        form.discard()
        raise


async def _visible(backend: VideoBackend, video_id: str, client) -> dict:
    record = await backend.record(ov.job_id(video_id), client)
    if record is None:
        raise RequestError(404, f"no video {video_id}", param="video_id", code="not_found")
    return record


def _finished_file(record: dict, video_id: str) -> Path:
    state = record["state"]
    if state in ("failed", "cancelled"):
        why = record.get("error")
        what = "failed" if state == "failed" else "was cancelled"
        raise RequestError(404, f"video {video_id} has no content: it {what}{': ' + why if why else ''}",
                           code="video_failed")
    if state != "done":
        raise RequestError(409, f"video {video_id} is {ov.STATUS[state]}; its content is there once its status is "
                                f"completed", code="video_not_ready")
    path = Path(record["output"])
    if not path.is_file():
        raise RequestError(404, f"video {video_id}: its file is gone from the output folder", code="not_found")
    return path


def video_routes(backend: VideoBackend) -> list[Route]:
    async def create(request: Request) -> JSONResponse:
        fields, form = await _read_request(request, backend, ov.UPLOAD_FIELDS)
        record = await _submit(backend, lambda: ov.creation(fields, form.files, _output_name()), form,
                               client_of(request), fields)
        return JSONResponse(ov.video_object(record, backend.keep_days))

    async def sync(request: Request) -> Response:
        fields, form = await _read_request(request, backend, ov.UPLOAD_FIELDS)
        client = client_of(request)
        record = await _submit(backend, lambda: ov.creation(fields, form.files, _output_name()), form, client,
                               fields)
        video_id = ov.PREFIX + record["id"]
        wait_s = backend.http.sync_timeout_s
        deadline = time.monotonic() + wait_s
        while record["state"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise RequestError(504, f"video {video_id} did not finish within {wait_s:g} s (the sync wait, "
                                        f"--sync-timeout-s); it goes on: GET /v1/videos/{video_id}",
                                   {"x-video-id": video_id, "Location": f"/v1/videos/{video_id}"},
                                   code="sync_timeout")
            if await request.is_disconnected():
                return Response(status_code=499)  # nginx's "client closed": no one reads it; the job goes on
            await asyncio.sleep(SYNC_POLL_S)
            record = await backend.record(record["id"], client) or record
        if record["state"] != "done":
            raise RequestError(500, f"video {video_id} {record['state']}: {record.get('error')}",
                               code="generation_failed")
        seconds = (record.get("finished") or 0) - (record.get("started") or 0)
        return FileResponse(_finished_file(record, video_id), media_type="video/mp4",
                            headers={"x-video-id": video_id, "x-inference-time-s": f"{seconds:.3f}"})

    async def listing(request: Request) -> JSONResponse:
        after, limit, order = ov.list_params(request.query_params)
        records = await backend.records(client_of(request))
        return JSONResponse(ov.page(records, after, limit, order, backend.keep_days))

    async def video(request: Request) -> JSONResponse:
        video_id = request.path_params["video_id"]
        record = await _visible(backend, video_id, client_of(request))
        if request.method == "DELETE":
            await backend.delete(record["id"], client_of(request))
            return JSONResponse(ov.deleted(video_id))
        return JSONResponse(ov.video_object(record, backend.keep_days))

    async def content(request: Request) -> Response:
        from .video_assets import VARIANTS

        video_id = request.path_params["video_id"]
        variant = request.query_params.get("variant", "video")
        if variant.isdigit() and variant != "0":
            raise RequestError(400, f"variant {variant}: video {video_id} has one output, variant 0 (n is 1 here)",
                               param="variant", code="invalid_variant")
        if variant not in ("video", "0", *VARIANTS):
            raise RequestError(400, f"variant must be video, thumbnail, spritesheet or 0, got {variant!r:.40}",
                               param="variant", code="invalid_variant")
        path = _finished_file(await _visible(backend, video_id, client_of(request)), video_id)
        if variant in ("video", "0"):
            return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")
        make, media_type = VARIANTS[variant]
        return Response(await run_in_threadpool(make, path), media_type=media_type)

    async def extend(request: Request) -> JSONResponse:
        fields, form = await _read_request(request, backend, ov.EXTENSION_UPLOAD_FIELDS)
        client = client_of(request)
        try:
            source_id = ov.extension_source(fields)
            if source_id is None and "video" not in form.files:
                raise RequestError(400, "video is required: {\"id\": \"video_...\"} of a finished video, or an "
                                        "uploaded one", param="video")
            source = None
            if source_id is not None:
                source = await _visible(backend, source_id, client)
                _finished_file(source, source_id)
        except BaseException:
            form.discard()
            raise
        try:
            record = await _submit(backend, lambda: ov.extension(fields, form.files, source, _output_name()), form,
                                   client, fields)
        except RequestError as exc:
            if exc.param == "continue":  # the clip an extension continues is its `video`
                exc.param = "video"
            raise
        return JSONResponse(ov.video_object(record, backend.keep_days))

    async def remix(request: Request) -> JSONResponse:
        video_id = request.path_params["video_id"]
        fields, form = await _read_request(request, backend, ())
        client = client_of(request)
        unknown = sorted(set(fields) - {"prompt"})
        if unknown:
            raise RequestError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; a remix takes prompt",
                               param=unknown[0], code="unknown_parameter")
        source = await _visible(backend, video_id, client)
        record = await _submit(backend, lambda: ov.remix(source, fields.get("prompt"), _output_name()), form, client,
                               fields)
        return JSONResponse(ov.video_object(record, backend.keep_days))

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(ov.models_list(await backend.modes(), backend.started))

    async def model(request: Request) -> JSONResponse:
        name = request.path_params["model"]
        found = [m for m in ov.models_list(await backend.modes(), backend.started)["data"] if m["id"] == name]
        if not found:
            raise RequestError(404, f"no model {name}", param="model", code="model_not_found")
        return JSONResponse(found[0])

    return [Route("/v1/videos", create, methods=["POST"]), Route("/v1/videos", listing, methods=["GET"]),
            Route("/v1/videos/sync", sync, methods=["POST"]),
            Route("/v1/videos/extensions", extend, methods=["POST"]),
            Route("/v1/videos/{video_id}", video, methods=["GET", "DELETE"]),
            Route("/v1/videos/{video_id}/content", content, methods=["GET"]),
            Route("/v1/videos/{video_id}/remix", remix, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model}", model, methods=["GET"])]
