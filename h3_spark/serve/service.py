"""The service without HTTP: load the models in the background, accept jobs, report readiness.

`Service.start()` returns at once; a loader thread builds the resident models while `/ready` answers
503 with what is still loading. Jobs are refused (503) until every model is resident. The HTTP layer
(app.py) only translates between requests and these methods. With several GPUs this is rank 0's
service, and `leader` (lockstep.py) hands each job to the other ranks.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import H3Error, InputError
from ..h3_model.engine.engine import Engine
from ..h3_model.engine.host_memory import host_memory_report
from ..h3_model.engine.report import describe_models, memory_report, supported_kernels
from .auth import sees
from .execute import JobRunner, dit_key, stderr_log
from .http_limits import HttpLimits
from .jobs import Job, JobQueue, QueueFull
from .lockstep import Leader
from .models import LoadTracker
from .outputs import InputFolder, OutputFolder
from .records import JobRecords
from .validation import JobRequest, Limits, RequestError, parse_request

Loader = Callable[[LoadTracker], Engine]
NOT_READY_RETRY_S = 5
# /jobs/{id}/preview: a strip of this many frames spread over the clip, about this many pixels wide.
PREVIEW_FRAMES, PREVIEW_SIZE = 4, 768
STATE_FILE = ".h3-spark-jobs.sqlite"  # hidden: a client cannot name it as an output (outputs.py)


@dataclass
class ServiceConfig:
    output_dir: Path
    input_dir: Path | None = None
    queue_size: int = 4
    limits: Limits = field(default_factory=Limits)
    keep_finished: int = 1000
    vae_tile_size: int | None = 256  # None: untiled decode
    mlp_chunks: int = 1
    weights: str = "checkpoint files"  # what /ready says the weights are (serve --synthetic: random ones)
    # The bearer token every request needs, or {token: Client} of named keys (serve/auth.py).
    api_key: "str | dict | None" = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] | None = None  # Host headers answered (others: 400); None: any (serve --allowed-host)
    state_dir: Path | None = None  # the job records file's folder (records.py); None: records in memory only
    state_name: str = STATE_FILE
    keep_days: float = 7.0  # ended records older than this are dropped from the file
    http: HttpLimits = field(default_factory=HttpLimits)
    taeh3: Path | None = None  # serve --taeh3: the file the loader reads TAEH3 from (checked by command.py)
    controlnet: Path | None = None  # serve --controlnet: the H3 Fun ControlNet file (header checked by command.py)

    def __post_init__(self) -> None:
        if not 1 <= self.queue_size <= 10_000:
            raise H3Error(f"--queue-size must be 1..10000, got {self.queue_size}")
        if self.vae_tile_size is not None and self.vae_tile_size < 1:
            raise H3Error(f"the VAE tile size must be positive (or none for untiled), got {self.vae_tile_size}")
        if self.mlp_chunks < 1:
            raise H3Error(f"--mlp-chunks must be at least 1, got {self.mlp_chunks}")


class Service:
    def __init__(self, config: ServiceConfig, loader: Loader, *, log: Callable[[str], None] = stderr_log,
                 leader: Leader | None = None):
        self.config = config
        self.leader = leader
        self.limits = config.limits
        self.outputs = OutputFolder(config.output_dir)
        self.inputs = InputFolder(config.input_dir, config.limits.max_input_file_bytes) if config.input_dir else None
        self.tracker = LoadTracker()
        self.models: Engine | None = None
        self.supported: dict | None = None
        self.log = log
        self._loader = loader
        self._thread: threading.Thread | None = None
        self.records = self._open_records() if config.state_dir is not None else None
        self.queue = JobQueue(config.queue_size, self._run_job, on_finish=self._release,
                              keep_finished=config.keep_finished, records=self.records)
        self._runner: JobRunner | None = None
        from .metrics import ServiceMetrics, available

        # /metrics (prometheus-client, the serve extra); None when the package is missing.
        self.metrics = ServiceMetrics(self) if available() else None
        # Called with the error message when loading fails (the CLI stops the server then).
        self.on_load_failed: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._load, name="h3-spark-loader", daemon=True)
            self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.tracker.state == "ready"

    def stop(self) -> None:
        self.queue.stop()
        if self.leader is not None:
            # After the worker has stopped (a running job is cancelled on every rank first).
            self.leader.close()
        if self.records is not None:
            self.records.close()

    def _open_records(self) -> JobRecords:
        """The job records file; what a process that died left queued or running is ended `failed` first."""
        folder = Path(self.config.state_dir)
        if not folder.exists():
            try:
                folder.mkdir(parents=True)
            except OSError as exc:
                raise InputError(f"--state-dir {folder}: cannot create it ({exc.strerror})") from None
            self.log(f"created the state folder {folder} (--state-dir did not exist)")
        elif not folder.is_dir():
            raise InputError(f"--state-dir {folder}: not a folder")
        records = JobRecords(folder / self.config.state_name, keep=self.config.keep_finished,
                             max_age_s=self.config.keep_days * 86400)
        try:
            for job_id, state in records.end_unfinished("the service stopped"):
                self.log(f"job {job_id}: the service stopped while this job was {state}; recorded as failed")
            records.expire()
        except BaseException:
            records.close()
            raise
        return records

    def _load(self) -> None:
        try:
            # Before the worker starts: the sweep must not race this service's own writers (outputs.py).
            self._sweep_partials()
            models = self._loader(self.tracker)
            fmt = "nvfp4" if "nvfp4" in models.checkpoint_formats.values() else "bf16"
            self.supported = supported_kernels(models.device, models.settings, fmt)
            self.models = models
            self._runner = JobRunner(models, self.outputs, self.log,
                                     vae_tile_size=self.config.vae_tile_size, mlp_chunks=self.config.mlp_chunks,
                                     leader=self.leader, limits=self.config.limits)
            self.queue.start()
            self.tracker.ready()
            self.log(f"ready: {', '.join(models.modes)} on {', '.join(models.devices)}; loaded in "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in models.load_seconds.items()))
            self._log_auto_attention(models)
        except Exception as exc:  # noqa: BLE001 - recorded for /ready and the CLI; nothing to serve
            message = str(exc) if isinstance(exc, H3Error) else f"{type(exc).__name__}: {exc}"
            if self.tracker.state != "failed":
                self.tracker.fail(message)
            if not isinstance(exc, H3Error):
                self.log(traceback.format_exc())
            self.log(f"loading failed: {message}")
            if self.on_load_failed is not None:
                self.on_load_failed(message)

    def _log_auto_attention(self, models: Engine) -> None:
        """What `auto` chose for each DiT, and why it refused each faster backend (fail closed: say it)."""
        from ..kernels.attention import auto_line

        for key in models.dit_keys():
            attention = models.kernel_reports.get(key, {}).get("attention", {})
            if attention.get("requested") == "auto":
                self.log(f"{key}: attention {auto_line(attention)}")

    def _sweep_partials(self) -> None:
        removed = self.outputs.sweep_partials()
        if removed is None:
            self.log(f"leftover partial outputs (.<job id>.partial.mp4) under {self.outputs.root} are not removed: "
                     f"this platform has no fcntl to tell them from ones another service is still writing")
            return
        for path in removed:
            self.log(f"removed {path.relative_to(self.outputs.root).as_posix()}: the partial output of a job "
                     f"whose service stopped before it finished")

    # ------------------------------------------------------------------ readiness
    def ready(self) -> tuple[bool, dict]:
        load = self.tracker.snapshot()
        ready = load["state"] == "ready"
        body: dict = {"ready": ready, "loading": load, "queue": self.queue.stats()}
        # Host memory while loading too: that is when it peaks (a budget's host copies, the files' page cache),
        # and a container is stopped on its cgroup's count, not the GPU's.
        body.update(host_memory_report())
        if ready:
            m = self.models
            body.update(device=m.device, world_size=m.world_size, devices=m.devices, modes=m.modes,
                        models=describe_models(m), weights=self.config.weights,
                        memory=memory_report(m.device), supported=self.supported, vram_budget_auto=m.auto_budget,
                        limits=vars(self.limits), input_dir=str(self.inputs.root) if self.inputs else None,
                        output_dir=str(self.outputs.root),
                        draft_decoder=None if m.taeh3 is None else Path(m.taeh3.source).name)
        return ready, body

    # ------------------------------------------------------------------ jobs
    def visible(self, job_id: str, client) -> None:
        """404 unless `client` (auth.Client, None without keys) may see job `job_id`: its own, or every job for an
        admin key. Another client's job is answered as if it did not exist."""
        if client is None or client.admin:
            return
        record = self.queue.snapshot(job_id)
        if record is None or not sees(client, record):
            raise RequestError(404, f"no job {job_id}")

    def jobs_of(self, client) -> list[dict]:
        return [j for j in self.queue.list() if sees(client, j)]

    def submit(self, body: object, client=None, files: dict | None = None, labels: dict | None = None) -> Job:
        """Queue a job for a /generate body. `files` (the /v1/ routes): media names in `body` that stand for
        files the service already holds (uploads, an earlier job's output), checked where they were made; the
        uploads among them (`labels["uploads"]`) are removed when the job ends. `labels` go into its record."""
        if self.tracker.state != "ready":
            still = self.tracker.snapshot()
            what = ("loading failed: " + still.get("error", "")) if still["state"] == "failed" else \
                "models still loading: " + ", ".join(still["still_loading"] or ["(starting)"])
            raise RequestError(503, f"not ready ({what})", {"Retry-After": str(NOT_READY_RETRY_S)})
        req = parse_request(body, self.limits)
        if req.mode not in self.models.modes:
            raise RequestError(400, f"{req.mode} needs a DiT partition this service did not load; it serves "
                                    f"{', '.join(self.models.modes)}", param="mode")
        if req.decoder == "taeh3" and self.models.taeh3 is None:
            raise RequestError(400, "decoder taeh3 needs the TAEH3 file, and this service was started without "
                                    "--taeh3 PATH; use decoder vae", param="decoder")
        if req.control is not None and self.models.components.controlnet is None:
            raise RequestError(400, "control needs the ControlNet, and this service was started without "
                                    "--controlnet FILE", param="control")
        attention = self._choose_attention(req)
        if req.recipes:
            self._check_recipes(req.recipes)
        # Checked before any file work so a full queue answers 429 whatever else the request holds.
        if self.queue.stats()["queued"] >= self.queue.capacity:
            raise QueueFull(self.queue.capacity, self.queue.retry_after())
        payload = self._input_paths(req, files or {})
        if req.continue_from is not None:
            self._continued_geometry(req, payload["continue"])
        if attention is not None:
            payload["attention"] = attention  # resolved once, here; the worker installs it
        job = Job(req, payload)
        job.client = None if client is None else client.name
        if labels is not None:
            job.labels = labels
            payload["uploads"] = [files[name] for name in labels.get("uploads", [])]
        try:
            job.payload["output_path"] = self.outputs.reserve(req.output, req.overwrite, job.id)
        except RequestError as exc:
            exc.param = exc.param or "output"
            raise
        try:
            return self.queue.submit(job)
        except Exception:
            self.outputs.release(job.payload["output_path"])
            raise

    def delete(self, job_id: str) -> dict:
        """Forget a job and remove its output: a queued one at once, a running one once it stops. 404 for an
        unknown id."""
        try:
            record = self.queue.forget(job_id)
        except KeyError:
            raise RequestError(404, f"no job {job_id}") from None
        if record["state"] in ("done", "failed", "cancelled") and record.get("output"):
            Path(record["output"]).unlink(missing_ok=True)
        return record

    def cancel(self, job_id: str) -> dict:
        """Cancel a job: a queued one at once, a running one within a DiT block. 404 for an unknown id."""
        try:
            return self.queue.cancel(job_id)
        except KeyError:
            raise RequestError(404, f"no job {job_id}") from None

    def preview_png(self, job_id: str) -> bytes:
        """PNG of the job's newest sampling-step preview (a 4-frame strip); 404 before the first step. With TAEH3
        loaded the strip's frames are decoded pictures (each from the few latent frames up to it, here on the
        thread that serves the request), else the false-colour view of the latents."""
        job = self.queue.get(job_id)
        if job is None:
            raise RequestError(404, f"no job {job_id}")
        latents = job.preview_latents
        if latents is None:
            raise RequestError(404, f"job {job_id} has no preview yet (one comes after each sampling step)")
        from ..h3_model.pipeline.preview import decoded_strip, png_bytes, preview_image

        taeh3 = self.models.taeh3
        if taeh3 is not None:
            return png_bytes(decoded_strip(taeh3, latents, PREVIEW_SIZE, frames=PREVIEW_FRAMES))
        return png_bytes(preview_image(latents, PREVIEW_SIZE, frames=PREVIEW_FRAMES))

    def _choose_attention(self, req: JobRequest):
        """The job's own attention, resolved once for its DiT's heads: the request fails now, not in the worker,
        when it cannot run here. None: the load-time attention."""
        try:
            return self.models.choose_attention(dit_key(req.mode), req.attention)
        except H3Error as exc:
            raise RequestError(400, f"attention {req.attention!r} cannot run here: {exc}", param="attention") from None

    def _check_recipes(self, recipes) -> None:
        """A recipe whose kernel cannot run here fails the request now, in one line."""
        from ..h3_model.engine.recipes import check_recipes

        try:
            check_recipes(recipes, self.models.device, self.models.settings)
        except H3Error as exc:
            raise RequestError(400, str(exc), param="recipes") from None

    def _input_paths(self, req: JobRequest, files: dict) -> dict:
        named = ([k for k in ("first_frame", "last_frame") if getattr(req, k) and getattr(req, k) not in files]
                 + (["references"] if any(p not in files for _, p in req.references) else [])
                 + (["guides"] if any(p not in files for _, p, _ in req.guides) else [])
                 + [k for k, v in (("continue", req.continue_from), ("repaint", req.repaint), ("mask", req.mask))
                    if v and v not in files]
                 + (["control"] if any(v not in files for v in _control_files(req).values()) else []))
        if named and self.inputs is None:
            raise RequestError(400, f"{', '.join(named)} name input files, but this service was started without "
                                    f"--input-dir", param=named[0])

        def media(name: str, kind: str, param: str) -> Path:
            if name in files:
                return files[name]
            try:
                return self.inputs.media(name, kind)
            except RequestError as exc:
                exc.param = exc.param or param  # the input folder knows the file, the request its field
                raise

        payload: dict = {"references": [(kind, media(path, kind, "references")) for kind, path in req.references]}
        for key in ("first_frame", "last_frame"):
            if getattr(req, key):
                payload[key] = media(getattr(req, key), "image", key)
        file_kind = {"image": "image", "clip": "video", "audio": "audio"}
        payload["guides"] = [(kind, media(path, file_kind[kind], "guides"), frame) for kind, path, frame in req.guides]
        for key, name, kind in (("continue", req.continue_from, "video"), ("repaint", req.repaint, "video"),
                                ("mask", req.mask, "image")):
            if name:
                payload[key] = media(name, kind, key)
        payload["control"] = {key: media(name, _control_kind(key, name), "control")
                              for key, name in _control_files(req).items()}
        return payload

    def _continued_geometry(self, req: JobRequest, path: Path) -> None:
        """The canvas and length of the clip a film goes on from, read from its file's index when the job is
        accepted: the job's record (and a /v1/ video's `size` and `seconds`) shows the output's from the start, and
        a request for another canvas is refused now."""
        from ..h3_model import geometry
        from ..h3_model.media import files as media

        try:
            frames, width, height = media.video_geometry(
                path, fps=geometry.FPS, max_frames=round(self.limits.max_film_seconds * geometry.FPS))
        except H3Error as exc:
            raise RequestError(400, f"continue {req.continue_from!r}: {str(exc).replace(f'{path}: ', '')}",
                               param="continue") from None
        if req.width is not None and (req.width, req.height) != (width, height):
            raise RequestError(400, f"continue {req.continue_from!r} is {width}x{height}; the request asks for "
                                    f"{req.width}x{req.height}: a clip is continued at its own size", param="size")
        req.width, req.height, req.continued_frames = width, height, frames

    def _run_job(self, job: Job) -> tuple[str, str | None]:
        return self._runner(job)

    def _release(self, job: Job) -> None:
        self.outputs.release(job.payload.get("output_path"))
        for upload in job.payload.get("uploads", []):  # read by now, or never to be
            Path(upload).unlink(missing_ok=True)
        if job.forgotten and job.output:  # deleted while it ran, and it finished anyway
            Path(job.output).unlink(missing_ok=True)
        if self.metrics is not None:
            self.metrics.job_finished(job)


def _control_files(req: JobRequest) -> dict:
    """The control's files by field (video, inpaint_mask, inpaint_source), those given."""
    c = req.control or {}
    return {k: c[k] for k in ("video", "inpaint_mask", "inpaint_source") if c.get(k)}


def _control_kind(key: str, name: str) -> str:
    """An inpaint mask may be an image (every frame) or a video; the others are videos."""
    from ..h3_model.media.files import IMAGE_SUFFIXES

    return "image" if key == "inpaint_mask" and Path(name).suffix.lower() in IMAGE_SUFFIXES else "video"
