"""The fleet front's `GET /metrics`: the router's picture of the fleet, in Prometheus' text format.

Each replica's own `/metrics` (stage seconds, GPU memory, kernels) stays with its service; what only the router
knows is here: each replica's state, the jobs it holds by state as last seen, and the processes and jobs lost.
Read from the ledger at each scrape; one registry per router.
"""

from __future__ import annotations

REPLICA_STATES = ("starting", "loading", "ready", "failed", "unreachable")
JOB_STATES = ("queued", "running", "done", "failed", "cancelled")


class FleetMetrics:
    def __init__(self, ledger):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.registry.register(_Fleet(ledger))

    def render(self) -> tuple[bytes, str]:
        from ..metrics import render

        return render(self.registry)


class _Fleet:
    def __init__(self, ledger):
        self.ledger = ledger

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ledger = self.ledger
        state = GaugeMetricFamily("h3_spark_fleet_replica_state", "1 for each replica's current state",
                                  labels=["replica", "state"])
        queue = GaugeMetricFamily("h3_spark_fleet_replica_queue_depth", "Jobs waiting in each replica's queue",
                                  labels=["replica"])
        for name, view in ledger.views.items():
            for s in REPLICA_STATES:
                state.add_metric([name, s], 1 if view.state == s else 0)
            if view.queue is not None:
                queue.add_metric([name], view.queue.get("queued", 0))
        yield state
        yield queue
        counts = {(name, s): 0 for name in ledger.views for s in JOB_STATES}
        for entry in ledger.entries.values():
            key = (entry.replica, entry.record.get("state"))
            if key in counts:
                counts[key] += 1
        jobs = GaugeMetricFamily("h3_spark_fleet_jobs", "Jobs on the router's record, by replica and last state",
                                 labels=["replica", "state"])
        for (name, s), n in counts.items():
            jobs.add_metric([name, s], n)
        yield jobs
        processes = CounterMetricFamily("h3_spark_fleet_replica_processes_lost",
                                        "Replica processes declared lost (died, restarted or silent)",
                                        labels=["replica"])
        lost = CounterMetricFamily("h3_spark_fleet_jobs_lost", "Jobs ended failed because their replica was lost",
                                   labels=["replica"])
        for name in ledger.views:
            processes.add_metric([name], ledger.processes_lost[name])
            lost.add_metric([name], ledger.jobs_lost[name])
        yield processes
        yield lost
