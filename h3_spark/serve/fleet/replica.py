"""One replica of the fleet: a `Service` in its own Ray actor, answering the router with plain dicts.

Every answer carries `instance`, a uuid made when this process started. Ray restarts a replica whose actor
died under the same deployment name, so the name alone cannot tell the router that the jobs it placed there
are gone; a new instance id can. Loading runs in the service's background thread, so the actor is up (and
answers `status`) while its models load, and a replica whose set-up or loading fails stays up to say why
instead of being restarted by Ray into the same failure.

Jobs keep the service's uuid4 ids (serve/jobs.py), unique across replicas without any coordination.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import uuid

from ...errors import H3Error
from ..jobs import TERMINAL
from ..validation import RequestError


def answer(instance: str, status: int, body, headers: dict | None = None) -> dict:
    return {"instance": instance, "status": status, "body": body, "headers": headers or {}}


class Replica:
    def __init__(self, name: str, serve_argv: list[str] | tuple[str, ...], threads: int | None = None):
        self.name = name
        self.instance = uuid.uuid4().hex
        self.started = time.time()
        self.service = None
        self.setup_error: str | None = None
        try:
            self.service = self._build(name, list(serve_argv), threads)
            self.service.start()
        except Exception as exc:  # noqa: BLE001 - reported through status(); the replica routes nothing
            self.setup_error = str(exc) if isinstance(exc, H3Error) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, H3Error):
                traceback.print_exc()
            print(f"h3-spark fleet replica {name}: set-up failed: {self.setup_error}", file=sys.stderr, flush=True)

    @staticmethod
    def _build(name: str, argv: list[str], threads: int | None):
        from ..command import build_service
        from .config import serve_parser

        args = serve_parser().parse_args(argv)
        if threads is not None and (args.device or "cpu").startswith("cpu"):
            import torch

            # Replicas sharing a host's cores: one replica's torch must not take them all.
            torch.set_num_threads(threads)
        # Replicas share the output folder; each keeps its job records in its own file there.
        return build_service(args, state_name=f".h3-spark-jobs-{name}.sqlite")

    # ------------------------------------------------------------------ the router's view
    def status(self, since: float | None = None) -> dict:
        """Load state, queue, and the records of jobs not ended or ended at or after `since` (this process's
        clock, from the previous answer's `now`): the router's picture of this replica, sent incrementally."""
        now = time.time()
        out = {"name": self.name, "instance": self.instance, "started": self.started, "now": now,
               "pid": os.getpid(), "host": socket.gethostname(), "actor": _actor_name()}
        if self.service is None:
            return {**out, "state": "failed", "error": f"set-up failed: {self.setup_error}", "queue": None,
                    "jobs": []}
        load = self.service.tracker.snapshot()
        out.update(state=load["state"], queue=self.service.queue.stats(), jobs=self._records(since))
        if load["state"] == "failed":
            out["error"] = f"loading failed: {load.get('error', '')}"
        elif load["state"] == "loading":
            out["still_loading"] = load["still_loading"]
        return out

    def _records(self, since: float | None) -> list[dict]:
        queue, records = self.service.queue, []
        for item in queue.list(stored=False):  # the router keeps its own record of ended jobs
            job = queue.get(item["id"])
            if job is None:
                continue
            if since is None or job.state not in TERMINAL or (job.finished or 0) >= since:
                record = queue.snapshot(job.id)
                if record is not None:
                    records.append(record)
        return records

    # ------------------------------------------------------------------ the service's routes
    def ready(self) -> dict:
        if self.service is None:
            return answer(self.instance, 503, {"ready": False, "error": f"set-up failed: {self.setup_error}"})
        ok, body = self.service.ready()
        return answer(self.instance, 200 if ok else 503, body)

    def submit(self, body, client=None) -> dict:
        """A /generate body the router placed here; `client` (auth.Client, None without keys) owns the job."""
        if self.service is None:
            return answer(self.instance, 503, {"error": f"replica {self.name} set-up failed: {self.setup_error}"})
        try:
            job = self.service.submit(body, client)
        except RequestError as exc:
            return answer(self.instance, exc.status, {"error": str(exc)}, exc.headers)
        return answer(self.instance, 202, job.to_dict())

    def submit_video(self, body: dict, files: dict, labels: dict, client) -> dict:
        """A /v1/ create the router translated: `files` are its uploads (under the shared state folder) or an
        earlier job's output, by the names `body` gives them."""
        from pathlib import Path

        from ..openai_routes import submit_video
        from ..openai_videos import Submission

        if self.service is None:
            return answer(self.instance, 503, {"error": f"replica {self.name} set-up failed: {self.setup_error}"})
        try:
            job = submit_video(self.service, Submission(body, {k: Path(v) for k, v in files.items()}, labels), client)
        except RequestError as exc:
            return answer(self.instance, exc.status, {"error": str(exc), "param": exc.param, "code": exc.code},
                          exc.headers)
        return answer(self.instance, 202, job.to_dict())

    def delete(self, job_id: str) -> dict:
        if self.service is None:
            return answer(self.instance, 404, {"error": f"no job {job_id}"})
        try:
            return answer(self.instance, 200, self.service.delete(job_id))
        except RequestError as exc:
            return answer(self.instance, exc.status, {"error": str(exc)}, exc.headers)

    def job(self, job_id: str) -> dict:
        record = None if self.service is None else self.service.queue.snapshot(job_id)
        if record is None:
            return answer(self.instance, 404, {"error": f"no job {job_id}"})
        return answer(self.instance, 200, record)

    def cancel(self, job_id: str) -> dict:
        if self.service is None:
            return answer(self.instance, 404, {"error": f"no job {job_id}"})
        try:
            record = self.service.cancel(job_id)
        except RequestError as exc:
            return answer(self.instance, exc.status, {"error": str(exc)}, exc.headers)
        return answer(self.instance, 202 if record["state"] == "running" else 200, record)

    def preview(self, job_id: str) -> dict:
        """PNG bytes of the job's newest preview (the same picture `h3-spark serve` draws)."""
        if self.service is None:
            return answer(self.instance, 404, {"error": f"no job {job_id}"})
        try:
            return answer(self.instance, 200, self.service.preview_png(job_id))
        except RequestError as exc:
            return answer(self.instance, exc.status, {"error": str(exc)}, exc.headers)

    def __del__(self):
        # Ray Serve deletes the replica on a graceful shutdown: cancel the queue, let the worker end.
        if getattr(self, "service", None) is not None:
            self.service.stop()


def _actor_name() -> str | None:
    """This replica's Ray actor name (what `ray.get_actor` takes in Serve's namespace), None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - only for reports; a replica outside an actor (tests) has none
        return None
