"""The router's record: each replica as last seen, and which replica (and which process of it) owns each job.

Ray Serve picks a replica per call by load, which suits stateless requests; a job's state lives in the one
process that accepted it, so every poll of that job must reach that process. The ledger keeps job ->
(replica name, instance id) for that, and the last record seen of each job, so that when the owner is gone
the job can still be answered: ended as `failed` with the reason, not `404` and not `running` forever.

It has no locks: the router mutates it from its one event loop only. With `records` (serve/records.py) every
change to a job's entry is written to that file before the router answers, and a router that starts on the file
finds its entries again: polls of jobs placed before a restart still reach their replica, and a job whose replica
process is no longer the one it was placed on is ended `failed` at that replica's first answer.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..jobs import TERMINAL

if TYPE_CHECKING:
    from ..records import JobRecords

ACTIVE = ("queued", "running")


@dataclass
class ReplicaView:
    name: str
    instance: str | None = None
    state: str = "starting"  # starting | loading | ready | failed (set-up or load) | unreachable
    error: str | None = None
    queue: dict | None = None
    info: dict = field(default_factory=dict)  # pid, host, actor, started, still_loading
    since: float | None = None  # the replica's clock at its last answer: ask only for what changed after it
    unreachable_since: float | None = None  # monotonic
    assigned: int = 0  # jobs this router has placed on it (a tie-break between equally loaded replicas)
    pending: int = 0  # submissions on their way to it: counted as load so concurrent ones spread

    def report(self, active: int) -> dict:
        out = {"state": self.state, "instance": self.instance, "active_jobs": active, "assigned": self.assigned,
               "queue": self.queue, **self.info}
        if self.error:
            out["error"] = self.error
        return out


@dataclass
class Entry:
    replica: str
    instance: str
    record: dict
    lost: bool = False  # ended by the router because its owner was lost; the owner's word no longer counts


class Ledger:
    def __init__(self, names: list[str], keep_finished: int = 10_000, records: "JobRecords | None" = None):
        self.views = {name: ReplicaView(name) for name in names}
        self.entries: dict[str, Entry] = {}
        self.lost_instances: set[tuple[str, str]] = set()
        self.keep_finished = keep_finished
        # Since the router started, per replica (the /metrics counters): processes lost, jobs ended by it.
        self.processes_lost = {name: 0 for name in names}
        self.jobs_lost = {name: 0 for name in names}
        self.records = records
        if records is not None:
            self._load(records)

    def _load(self, records: "JobRecords") -> None:
        now = time.time()
        for record, owner in records.rows():
            if not owner:
                continue
            entry = Entry(owner["replica"], owner["instance"], record, bool(owner.get("lost")))
            self.entries[record["id"]] = entry
            if owner["replica"] not in self.views and record.get("state") in ACTIVE and not entry.lost:
                entry.lost = True
                entry.record = {**record, "state": "failed", "finished": now,
                                "error": f"replica {owner['replica']} is no longer in the fleet; this job was "
                                         f"{record.get('state')} on it"}
                self._save(record["id"])

    def _save(self, job_id: str) -> None:
        if self.records is not None:
            entry = self.entries[job_id]
            self.records.save(entry.record, {"replica": entry.replica, "instance": entry.instance,
                                             "lost": entry.lost})

    # ------------------------------------------------------------------ what the replicas say
    def observe(self, name: str, status: dict) -> list[str]:
        """Take a replica's status answer. Returns ids of jobs it still runs that the router already reported
        failed (it had stopped answering for too long): the router cancels them."""
        view = self.views[name]
        instance = status["instance"]
        restarted = view.instance is not None and instance != view.instance
        if restarted:
            self.lose(name, view.instance, "its process ended and Ray started a new one")
        elif view.instance is None:
            # The first answer since this router started: entries it read from its file that name an older
            # process of this replica are gone with that process.
            older = {e.instance for e in self.entries.values() if e.replica == name and e.instance != instance
                     and not e.lost and e.record.get("state") in ACTIVE}
            for gone in older:
                self.lose(name, gone, "its process ended while the router was down")
        view.instance = instance
        view.state, view.error, view.queue = status["state"], status.get("error"), status.get("queue")
        view.info = {k: status.get(k) for k in ("pid", "host", "actor", "started", "still_loading") if k in status}
        view.unreachable_since = None
        # After a restart the next answer is a full one: `since` was the old process's clock.
        view.since = None if restarted else status.get("now")
        stale = []
        for record in status.get("jobs", []):
            entry = self.entries.get(record["id"])
            if entry is not None and entry.lost:
                if record["state"] in ACTIVE:
                    stale.append(record["id"])
                continue
            self.record(record["id"], name, instance, record)
        return stale

    def unanswered(self, name: str, why: str, lost_after: float, now: float | None = None) -> None:
        """A call to the replica failed without proof it died (timeout, actor restarting). Not routed to;
        its jobs end only once it has been silent for `lost_after` seconds."""
        view = self.views[name]
        now = time.monotonic() if now is None else now
        if view.unreachable_since is None:
            view.unreachable_since = now
        view.state, view.error = "unreachable", why
        if view.instance is not None and now - view.unreachable_since >= lost_after:
            self.lose(name, view.instance, f"it did not answer for {lost_after:g} s: {why}")

    def died(self, name: str, why: str) -> None:
        """Ray said the replica's actor died: the jobs of the process last seen there are gone."""
        view = self.views[name]
        if view.instance is not None:
            self.lose(name, view.instance, why)
        view.state, view.error = "unreachable", why
        if view.unreachable_since is None:
            view.unreachable_since = time.monotonic()

    def lose(self, name: str, instance: str, why: str) -> None:
        if (name, instance) in self.lost_instances:
            return
        self.lost_instances.add((name, instance))
        self.processes_lost[name] += 1
        now = time.time()
        for job_id, entry in self.entries.items():
            if entry.replica == name and entry.instance == instance and not entry.lost:
                state = entry.record.get("state")
                if state in TERMINAL:
                    continue
                entry.lost = True
                self.jobs_lost[name] += 1
                entry.record = {**entry.record, "state": "failed", "finished": now,
                                "error": f"replica {name} was lost ({why}) while this job was {state}"}
                self._save(job_id)

    # ------------------------------------------------------------------ jobs
    def record(self, job_id: str, name: str, instance: str, record: dict) -> None:
        entry = self.entries.get(job_id)
        if entry is not None and entry.lost:
            return
        if (name, instance) in self.lost_instances and record.get("state") in ACTIVE:
            return  # a late word from a process the router already gave up on
        self.entries[job_id] = Entry(name, instance, record)
        # On disk at each change of state (or owner), not at each progress step a poll brings.
        if entry is None or (entry.replica, entry.instance) != (name, instance) or \
                entry.record.get("state") != record.get("state"):
            self._save(job_id)
        self._evict()

    def forget(self, job_id: str) -> None:
        """A deleted job: gone from the ledger and its file."""
        self.entries.pop(job_id, None)
        if self.records is not None:
            self.records.delete(job_id)

    def placed(self, job_id: str, name: str, instance: str, record: dict) -> None:
        self.views[name].assigned += 1
        self.record(job_id, name, instance, record)

    def entry(self, job_id: str) -> Entry | None:
        return self.entries.get(job_id)

    def answer(self, job_id: str) -> dict | None:
        """The job's last known record, with its replica named."""
        entry = self.entries.get(job_id)
        return None if entry is None else {**entry.record, "replica": entry.replica}

    def output_taken(self, output: object) -> str | None:
        """The id of a live job writing the same output name, on any replica (each checks only its own)."""
        if not isinstance(output, str) or not output:
            return None
        key = posixpath.normpath(output)
        for job_id, entry in self.entries.items():
            if entry.record.get("state") in ACTIVE and not entry.lost:
                request = entry.record.get("request") or {}
                if isinstance(request.get("output"), str) and posixpath.normpath(request["output"]) == key:
                    return job_id
        return None

    def _evict(self) -> None:
        ended = [k for k, e in self.entries.items() if e.record.get("state") in TERMINAL]
        for job_id in ended[: max(0, len(ended) - self.keep_finished)]:
            del self.entries[job_id]
            if self.records is not None:
                self.records.delete(job_id)

    # ------------------------------------------------------------------ routing
    def active(self, name: str) -> int:
        view = self.views[name]
        return sum(1 for e in self.entries.values()
                   if e.replica == name and e.instance == view.instance and not e.lost
                   and e.record.get("state") in ACTIVE)

    def candidates(self) -> list[str]:
        """Ready replicas, least loaded first (queued + running jobs, then fewest placed)."""
        ready = [name for name, view in self.views.items() if view.state == "ready"]
        return sorted(ready, key=lambda n: (self.active(n) + self.views[n].pending, self.views[n].assigned, n))

    def not_ready_reason(self) -> str:
        parts = []
        for name, view in self.views.items():
            state = view.state + (f": {view.error}" if view.error else "")
            parts.append(f"{name} {state}")
        return "; ".join(parts)

    # ------------------------------------------------------------------ reports
    def report(self) -> dict:
        return {name: view.report(self.active(name)) for name, view in self.views.items()}

    def jobs(self) -> list[dict]:
        return [{"id": k, "state": e.record.get("state"), "replica": e.replica} for k, e in self.entries.items()]
