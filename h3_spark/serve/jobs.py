"""Jobs and the single GPU worker: a bounded FIFO queue, cancellation, and a record for every job.

One worker thread runs one job at a time (the GPU holds one generation's working set). Every accepted
job ends in done, failed or cancelled with its error recorded; the worker survives anything a job
raises. Records of finished jobs are kept in memory up to a bound, oldest dropped first; with a `records`
file (records.py) every change of state is written there before it can be seen, and a job no longer in memory
(an older one, or one of a process that ended) is read from it.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable

from .validation import RequestError

if TYPE_CHECKING:
    from .records import JobRecords

STATES = ("queued", "running", "done", "failed", "cancelled")
TERMINAL = ("done", "failed", "cancelled")
DEFAULT_RETRY_AFTER_S = 10


class QueueFull(RequestError):
    def __init__(self, capacity: int, retry_after: int):
        super().__init__(429, f"the queue is full ({capacity} jobs waiting); retry after {retry_after} s",
                         {"Retry-After": str(retry_after)})


class Job:
    def __init__(self, request, payload: dict | None = None):
        self.id = uuid.uuid4().hex
        self.request = request
        self.payload = payload if payload is not None else {}
        self.state = "queued"
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.progress = {"stage": "queued", "step": 0, "total": 0}
        self.timings: dict[str, float] = {}
        self.output: str | None = None
        self.backends: dict | None = None
        self.step_cache: dict | None = None
        self.info: dict = {}
        self.error: str | None = None
        self.cancel = threading.Event()
        self.preview_latents = None  # the newest sampling step's clean-latent estimate (C, T, H, W), for /preview
        self.client: str | None = None  # the name of the key that submitted it (serve/auth.py), never the key
        # What a front door records of its own request (openai_videos.py: the model name, the source video); shown
        # in the record when set.
        self.labels: dict | None = None
        self.forgotten = False  # deleted while it ran: no reader sees it, and it is not recorded again

    def to_dict(self) -> dict:
        out = {"id": self.id, "state": self.state, "progress": dict(self.progress), "created": self.created,
               "started": self.started, "finished": self.finished,
               "timings": {k: round(v, 4) for k, v in self.timings.items()}, "output": self.output,
               "backends": self.backends, "step_cache": self.step_cache, "info": self.info, "error": self.error,
               "client": self.client}
        if self.state == "running" and self.cancel.is_set():
            out["cancel_requested"] = True
        public = getattr(self.request, "public", None)
        out["request"] = public() if public else None
        if self.labels is not None:
            out["labels"] = self.labels
        return out


# run(job) -> (terminal state, error or None); it classifies its own failures and cleans up after them.
Runner = Callable[[Job], "tuple[str, str | None]"]


class JobQueue:
    def __init__(self, capacity: int, run: Runner, *, on_finish: Callable[[Job], None] | None = None,
                 keep_finished: int = 1000, records: "JobRecords | None" = None):
        if capacity < 1:
            raise ValueError(f"queue capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._run = run
        self._on_finish = on_finish or (lambda job: None)
        self._keep = keep_finished
        self._records = records
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._current: Job | None = None
        self._durations: deque[float] = deque(maxlen=20)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="h3-spark-gpu-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued, ask the running job to stop, and wait for the worker."""
        with self._cond:
            self._stopping = True
            while self._pending:
                self._finish(self._pending.popleft(), "cancelled", "the service is shutting down")
            if self._current is not None:
                self._current.cancel.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ client side
    def submit(self, job: Job) -> Job:
        with self._cond:
            if self._stopping:
                raise RequestError(503, "the service is shutting down")
            if len(self._pending) >= self.capacity:
                raise QueueFull(self.capacity, self.retry_after())
            if self._records is not None:
                try:
                    self._records.save(job.to_dict())
                except Exception as exc:  # noqa: BLE001 - not on record: not accepted
                    raise RequestError(503, f"the job could not be recorded ({type(exc).__name__}: {exc})") \
                        from None
            self._pending.append(job)
            self._jobs[job.id] = job
            self._cond.notify_all()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._cond:
            return self._jobs.get(job_id)

    def snapshot(self, job_id: str) -> dict | None:
        with self._cond:
            job = self._jobs.get(job_id)
            if job is not None:
                return job.to_dict()
        return self._records.get(job_id) if self._records is not None else None

    def cancel(self, job_id: str) -> dict:
        """Queued: cancelled now. Running: asked to stop (it ends within one DiT block). Raises KeyError."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                stored = self._records.get(job_id) if self._records is not None else None
                if stored is None:
                    raise KeyError(job_id)
                raise RequestError(409, f"job {job_id} already ended ({stored['state']}); nothing to cancel")
            if job.state == "queued":
                self._pending.remove(job)
                self._finish(job, "cancelled", None)
            elif job.state == "running":
                job.cancel.set()
            elif job.state in ("done", "failed"):
                raise RequestError(409, f"job {job_id} already ended ({job.state}); nothing to cancel")
            return job.to_dict()

    def forget(self, job_id: str) -> dict:
        """Delete a job: its record dropped from memory and the records file at once; a queued one cancelled, a
        running one asked to stop (it is not recorded again when it ends). Raises KeyError for an unknown id."""
        with self._cond:
            job = self._jobs.get(job_id)
            stored = self._records.get(job_id) if job is None and self._records is not None else None
            if job is None and stored is None:
                raise KeyError(job_id)
            if job is not None and job.state == "queued":
                self._pending.remove(job)
                self._finish(job, "cancelled", "deleted")
            if job is not None and job.state == "running":
                # Gone from now on for every reader; it stops within a DiT block and is not recorded again.
                job.cancel.set()
                job.forgotten = True
            record = job.to_dict() if job is not None else stored
            self._jobs.pop(job_id, None)
            if self._records is not None:
                self._records.delete(job_id)
            return record

    def list(self, stored: bool = True) -> list[dict]:
        """{"id", "state"} of the jobs in memory, after those only in the records file (`stored`)."""
        with self._cond:
            live = [{"id": j.id, "state": j.state, "client": j.client} for j in self._jobs.values()]
        if self._records is None or not stored:
            return live
        known = {j["id"] for j in live}
        return [r for r in self._records.states() if r["id"] not in known] + live

    def stats(self) -> dict:
        with self._cond:
            return {"capacity": self.capacity, "queued": len(self._pending),
                    "running": self._current.id if self._current else None}

    def retry_after(self) -> int:
        """Seconds until a slot probably frees: the mean duration of recent jobs."""
        if not self._durations:
            return DEFAULT_RETRY_AFTER_S
        return max(1, math.ceil(sum(self._durations) / len(self._durations)))

    # ------------------------------------------------------------------ worker side
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._pending.popleft()
                job.state, job.started, self._current = "running", time.time(), job
                unrecorded = self._save(job)
            try:
                if unrecorded:
                    raise RuntimeError(unrecorded)
                state, error = self._run(job)
            except BaseException as exc:  # noqa: BLE001 - the worker must outlive any job
                state, error = "failed", f"internal error: {type(exc).__name__}: {exc}"
            if state not in TERMINAL:
                state, error = "failed", f"internal error: the runner ended the job in state {state!r}"
            with self._cond:
                self._current = None
                self._durations.append(time.time() - job.started)
                self._finish(job, state, error)

    def _finish(self, job: Job, state: str, error: str | None) -> None:
        # Called with the condition held.
        job.state, job.error, job.finished = state, error, time.time()
        try:
            self._on_finish(job)
        except Exception as exc:  # noqa: BLE001 - recorded on the job; the worker must go on
            job.error = f"{error + '; ' if error else ''}cleanup failed: {type(exc).__name__}: {exc}"
        if job.forgotten:  # deleted while it ran: its record is already gone
            return
        unrecorded = self._save(job)
        if unrecorded:
            job.error = f"{job.error + '; ' if job.error else ''}{unrecorded}"
        self._evict()

    def _save(self, job: Job) -> str | None:
        """Write the job's record (called with the condition held, so no one sees the state before it is on
        disk); the reason when it could not be written."""
        if self._records is None:
            return None
        try:
            self._records.save(job.to_dict())
        except Exception as exc:  # noqa: BLE001 - the worker goes on; the job's own record says what happened
            return f"its record could not be written ({type(exc).__name__}: {exc})"
        return None

    def _evict(self) -> None:
        finished = [j for j in self._jobs.values() if j.state in TERMINAL]
        for job in finished[: max(0, len(finished) - self._keep)]:
            del self._jobs[job.id]
