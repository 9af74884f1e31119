"""The fleet's HTTP front: places each job on a ready replica and sends every later call about it to its owner.

  GET    /ready               200 when at least one replica is ready; every replica's state (and error)
  GET    /fleet               every replica: state, instance, process, queue, active jobs; jobs by state
  GET    /live                the router answers
  GET    /metrics             Prometheus text: replica states and queues, jobs by replica and state, losses
  POST   /generate            as `h3-spark serve`, placed on the ready replica with the fewest queued + running
                              jobs; the answer names the replica
  GET    /jobs                every job the router knows, with its replica
  GET    /jobs/{id}           the owner's record (named `replica`); a lost owner's jobs end `failed` with why
  DELETE /jobs/{id}           cancel on the owner
  GET    /jobs/{id}/preview   the owner's preview PNG
  /v1/videos, /v1/models      OpenAI's Videos API (openai_routes.py): a create placed as /generate is, every call
                              about a video sent to the replica that holds it; the files read from the shared folder

The router holds one handle per replica deployment rather than one deployment of N replicas: Ray's handle of a
multi-replica deployment picks the replica itself, and a poll of job X has to reach the one process that holds
X. A replica's jobs are declared lost when Ray says its actor died, when it answers with a new instance id (Ray
restarted it), or when it has not answered for `lost_after_seconds`; a background loop asks every replica for
its state every `poll_seconds`, so a loss is noticed without any client asking.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..auth import client_of, sees
from ..http_app import build_app, json_body, live, metrics_endpoint, png
from ..http_limits import HttpLimits
from ..jobs import TERMINAL
from ..openai_routes import video_routes
from ..validation import Limits
from .ledger import Ledger

RESTARTED = "its process ended and Ray started a new one"


class ReplicaGone(Exception):
    """Ray says the replica's actor died: its jobs are lost."""


class ReplicaSilent(Exception):
    """The replica did not answer (timeout, restarting, unavailable): not routed to, its jobs kept for now."""


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class Router:
    def __init__(self, settings: dict, *replicas):
        self.names = list(settings["replicas"])
        self.handles = dict(zip(self.names, replicas))
        records = None
        if settings.get("state_file"):
            from ..records import JobRecords

            records = JobRecords(settings["state_file"])
        self.ledger = Ledger(self.names, records=records)
        # Output names of submissions on their way to a replica; with the ledger's live jobs, the names taken.
        self.placing: dict[str, str] = {}
        self.poll = settings["poll_seconds"]
        self.timeout = settings["call_timeout_seconds"]
        self.lost_after = settings["lost_after_seconds"]
        self.api_key = settings.get("api_key")  # config.Secret (a token, or token -> auth.Client) or None
        self.limits = settings.get("limits") or Limits()  # the replicas' strictest (FleetConfig.front_limits)
        self.http = settings.get("http") or HttpLimits()
        # The /v1/ routes: how long an ended video's record is kept (the replicas' --keep-days), and the folder its
        # uploads go to (the ledger's, which the replicas share).
        self.keep_days = settings.get("keep_days", 7.0)
        from .videos import state_folder

        self.state_folder = state_folder(settings)
        # Host headers answered (None: any); loopback names only when the front listens on loopback.
        self.allowed_hosts = settings.get("allowed_hosts")
        self._monitor: asyncio.Task | None = None
        from ..metrics import available
        from .metrics import FleetMetrics

        # prometheus-client comes with the fleet extra; without it /metrics says how to get it.
        self.metrics = FleetMetrics(self.ledger) if available() else None

    # ------------------------------------------------------------------ calls to replicas
    async def call(self, name: str, method: str, *args) -> dict:
        """The replica's answer. A failed call is entered in the ledger here, whoever made it (the replica died:
        its jobs are lost; it is silent: not routed to, lost after `lost_after`), then raised for the caller's
        reply."""
        try:
            return await self._call(name, method, *args)
        except ReplicaGone as exc:
            self.ledger.died(name, str(exc))
            raise
        except ReplicaSilent as exc:
            self.ledger.unanswered(name, str(exc), self.lost_after)
            raise

    async def _call(self, name: str, method: str, *args) -> dict:
        from ray.exceptions import ActorDiedError, NodeDiedError, RayTaskError, WorkerCrashedError

        try:
            return await asyncio.wait_for(getattr(self.handles[name], method).remote(*args), self.timeout)
        except (ActorDiedError, NodeDiedError, WorkerCrashedError) as exc:
            raise ReplicaGone(f"its actor died: {_last_line(exc)}") from None
        except RayTaskError:
            raise  # the replica's own code failed on this call: an internal error, not a lost replica
        except asyncio.TimeoutError:
            raise ReplicaSilent(f"no answer within {self.timeout:g} s") from None
        except Exception as exc:  # noqa: BLE001 - Ray's unavailable/back-pressure errors: try again later
            raise ReplicaSilent(f"{type(exc).__name__}: {_last_line(exc)}") from None

    async def ask_owner(self, entry, method: str, job_id: str) -> dict | None:
        """The owning replica's answer about a job, or None when that replica's process is no longer the one
        the job was placed on (Ray restarted it): the job is then lost, and the ledger says so."""
        got = await self.call(entry.replica, method, job_id)
        if got["instance"] != entry.instance:
            self.ledger.lose(entry.replica, entry.instance, RESTARTED)
            return None
        return got

    async def refresh(self, name: str) -> None:
        view = self.ledger.views[name]
        try:
            status = await self.call(name, "status", view.since)
        except (ReplicaGone, ReplicaSilent):
            return
        for job_id in self.ledger.observe(name, status):
            # Reported failed while the replica was silent: stop them so nothing runs that nobody follows.
            with contextlib.suppress(ReplicaGone, ReplicaSilent):
                await self._call(name, "cancel", job_id)

    async def monitor(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(name) for name in self.names), return_exceptions=True)
            await asyncio.sleep(self.poll)

    # ------------------------------------------------------------------ jobs
    async def submit(self, body: object, client=None) -> tuple[int, dict, dict]:
        """Place a job. Its output name is held from here (before the first await, so no concurrent submission
        can take it in between) until its replica answers, and then by its live entry in the ledger until it
        ends: a second job for a name held either way is refused (409) at once, `overwrite` or not."""
        output = body.get("output") if isinstance(body, dict) else None
        key = posixpath.normpath(output) if isinstance(output, str) and output else None
        if key is not None:
            if key in self.placing:
                return 409, {"error": f"output {output!r} is being placed for another request"}, {}
            taken = self.ledger.output_taken(key)
            if taken is not None:
                return 409, {"error": f"output {output!r} is being written by job {taken}"}, {}
            self.placing[key] = output
        try:
            status, answer, headers = await self.place("submit", body, client)
        finally:
            if key is not None:
                self.placing.pop(key, None)
        if status != 202:
            return status, answer, headers
        url = f"/jobs/{answer['id']}"
        return 202, {"id": answer["id"], "state": "queued", "url": url, "replica": answer["replica"]}, \
            {"Location": url}

    async def place(self, method: str, *args) -> tuple[int, dict, dict]:
        """Call `method(*args)` (a submission) on the ready replica with the fewest jobs, the next one when it is
        full or not ready: (202, the job's record with its `replica`, {}), or the refusal."""
        refusals: list[tuple[int, dict, dict]] = []
        for name in self.ledger.candidates():
            view = self.ledger.views[name]
            view.pending += 1
            try:
                got = await self.call(name, method, *args)
            except (ReplicaGone, ReplicaSilent):
                continue
            finally:
                view.pending -= 1
            if got["status"] == 202:
                record = got["body"]
                self.ledger.placed(record["id"], name, got["instance"], record)
                return 202, {**record, "replica": name}, {}
            if got["status"] in (429, 503):  # full or not (yet, any more) ready: the next replica may take it
                refusals.append((got["status"], got["body"], got["headers"]))
                continue
            return got["status"], got["body"], got["headers"]
        full = [r for r in refusals if r[0] == 429]
        if full:
            wait = min(int(r[2].get("Retry-After", "10")) for r in full)
            return 429, {"error": f"every ready replica's queue is full; retry after {wait} s"}, \
                {"Retry-After": str(wait)}
        return 503, {"error": f"no replica is ready ({self.ledger.not_ready_reason()})"}, {"Retry-After": "5"}

    async def owned(self, job_id: str, client):
        """The ledger's entry of a job `client` may see (its own, or any for an admin key or without keys), else
        None: another client's job is answered as if it did not exist."""
        entry = self.ledger.entry(job_id) or await self.find(job_id)
        if entry is None or not sees(client, entry.record):
            return None
        return entry

    async def job(self, job_id: str, client=None) -> tuple[int, dict]:
        entry = await self.owned(job_id, client)
        if entry is None:
            return 404, {"error": f"no job {job_id}"}
        if entry.lost or entry.record.get("state") in TERMINAL:
            return 200, self.ledger.answer(job_id)  # an ended record never changes
        try:
            got = await self.ask_owner(entry, "job", job_id)
        except ReplicaGone:
            return 200, self.ledger.answer(job_id)
        except ReplicaSilent as exc:
            return 200, {**self.ledger.answer(job_id), "replica_unreachable": str(exc)}
        if got is not None and got["status"] == 200:
            self.ledger.record(job_id, entry.replica, entry.instance, got["body"])
        return 200, self.ledger.answer(job_id)

    async def cancel(self, job_id: str, client=None) -> tuple[int, dict, dict]:
        entry = await self.owned(job_id, client)
        if entry is None:
            return 404, {"error": f"no job {job_id}"}, {}
        if entry.lost:
            return 409, {"error": f"job {job_id} already ended (failed: {entry.record.get('error')})"}, {}
        try:
            got = await self.ask_owner(entry, "cancel", job_id)
        except ReplicaGone:
            got = None
        except ReplicaSilent as exc:
            return _not_answering(entry, job_id, exc)
        if got is None:  # its replica was lost: the ledger has failed it
            return 409, {"error": f"job {job_id} already ended (failed: {self.ledger.answer(job_id)['error']})"}, {}
        if got["status"] in (200, 202):
            self.ledger.record(job_id, entry.replica, entry.instance, got["body"])
            return got["status"], self.ledger.answer(job_id), {}
        return got["status"], got["body"], got["headers"]

    async def delete(self, job_id: str, client=None) -> tuple[int, dict, dict]:
        """Forget a job on its owner (cancelled if it runs, its output removed) and in the ledger."""
        entry = await self.owned(job_id, client)
        if entry is None:
            return 404, {"error": f"no job {job_id}"}, {}
        if not entry.lost:
            try:
                got = await self.ask_owner(entry, "delete", job_id)
            except ReplicaGone:
                got = None
            except ReplicaSilent as exc:
                return _not_answering(entry, job_id, exc)
            if got is not None and got["status"] not in (200, 404):
                return got["status"], got["body"], got["headers"]
        self.ledger.forget(job_id)
        return 200, {"id": job_id, "deleted": True}, {}

    async def preview(self, job_id: str, client=None) -> tuple[int, dict | bytes]:
        entry = await self.owned(job_id, client)
        if entry is None:
            return 404, {"error": f"no job {job_id}"}
        if entry.lost:
            return 404, {"error": f"job {job_id} has no preview: {entry.record.get('error')}"}
        try:
            got = await self.ask_owner(entry, "preview", job_id)
        except ReplicaGone:
            got = None
        except ReplicaSilent as exc:
            return 503, {"error": f"replica {entry.replica}, which holds job {job_id}, is not answering ({exc})"}
        if got is None:  # its replica was lost: the ledger has failed it
            return 404, {"error": f"job {job_id} has no preview: {self.ledger.answer(job_id)['error']}"}
        return got["status"], got["body"]

    async def find(self, job_id: str):
        """A job this router has no record of (it was restarted): ask every replica that answers."""
        for name in self.names:
            if self.ledger.views[name].instance is None:
                continue
            with contextlib.suppress(ReplicaGone, ReplicaSilent):
                got = await self._call(name, "job", job_id)
                if got["status"] == 200:
                    self.ledger.record(job_id, name, got["instance"], got["body"])
                    return self.ledger.entry(job_id)
        return None

    # ------------------------------------------------------------------ reports
    def ready(self) -> tuple[int, dict]:
        replicas = self.ledger.report()
        ready = sum(1 for r in replicas.values() if r["state"] == "ready")
        return (200 if ready else 503), {"ready": ready > 0, "ready_replicas": ready, "replicas": replicas}

    def fleet(self) -> dict:
        counts: dict[str, int] = {}
        for job in self.ledger.jobs():
            counts[job["state"]] = counts.get(job["state"], 0) + 1
        return {"replicas": self.ledger.report(), "jobs": counts}

    # ------------------------------------------------------------------ Ray Serve's ASGI hook
    def __serve_build_asgi_app__(self):
        return create_router_app(self)


def _not_answering(entry, job_id: str, exc: Exception) -> tuple[int, dict, dict]:
    return 503, {"error": f"replica {entry.replica}, which holds job {job_id}, is not answering ({exc}); retry"}, \
        {"Retry-After": "5"}


def _json(status: int, body, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers or None)


def create_router_app(router: Router) -> Starlette:
    async def ready(request: Request) -> JSONResponse:
        return _json(*router.ready())

    async def fleet(request: Request) -> JSONResponse:
        return _json(200, router.fleet())

    async def generate(request: Request) -> JSONResponse:
        body = await json_body(request, router.limits.max_body_bytes, router.http.body_timeout_s)
        return _json(*await router.submit(body, client_of(request)))

    async def jobs(request: Request) -> JSONResponse:
        client = client_of(request)
        queues = {name: view.queue for name, view in router.ledger.views.items()}
        mine = [job for job in router.ledger.jobs() if sees(client, router.ledger.entry(job["id"]).record)]
        return _json(200, {"replicas": queues, "jobs": mine})

    async def job(request: Request) -> JSONResponse:
        job_id = request.path_params["job_id"]
        if request.method == "DELETE":
            return _json(*await router.cancel(job_id, client_of(request)))
        return _json(*await router.job(job_id, client_of(request)))

    async def preview(request: Request) -> Response:
        status, body = await router.preview(request.path_params["job_id"], client_of(request))
        if isinstance(body, bytes):
            return png(body)
        return _json(status, body)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        router._monitor = asyncio.get_running_loop().create_task(router.monitor())
        try:
            yield
        finally:
            router._monitor.cancel()

    from .videos import FleetVideos

    routes = [*video_routes(FleetVideos(router)), Route("/ready", ready, methods=["GET"]),
              Route("/fleet", fleet, methods=["GET"]),
              Route("/live", live, methods=["GET"]),
              Route("/metrics", metrics_endpoint(lambda: router.metrics, "fleet", in_thread=False), methods=["GET"]),
              Route("/generate", generate, methods=["POST"]),
              Route("/jobs", jobs, methods=["GET"]), Route("/jobs/{job_id}", job, methods=["GET", "DELETE"]),
              Route("/jobs/{job_id}/preview", preview, methods=["GET"])]
    api_key = router.api_key.value if router.api_key is not None else None
    return build_app(routes, lifespan, router.http, router.allowed_hosts, api_key, _log)


def _log(message: str) -> None:
    print(f"h3-spark fleet: {message}", file=sys.stderr, flush=True)
