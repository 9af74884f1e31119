"""`GET /metrics`: the service's state for an operator, in Prometheus' text format (prometheus-client).

Counted as jobs end: `h3_spark_jobs_finished_total{state, client}` and, for finished jobs, the seconds of each stage
(`h3_spark_stage_seconds{stage}`, a histogram). Read at each scrape: the jobs the service holds by state,
the queue's depth and capacity, whether the models are loaded, GPU memory, and which kernels the loaded
DiTs run (an info metric). Each service has its own registry (tests run several in one process).
"""

from __future__ import annotations

STAGE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 2400)


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def render(registry) -> tuple[bytes, str]:
    """A registry's samples in Prometheus' text format, and the content type to send them with."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


class ServiceMetrics:
    def __init__(self, service):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        # By the name of the key that submitted the job (--keys-file), never the key; "" without keys.
        self.finished = Counter("h3_spark_jobs_finished", "Jobs that ended, by their final state and client",
                                ["state", "client"], registry=self.registry)
        self.stage = Histogram("h3_spark_stage_seconds", "Seconds per stage of the jobs that finished",
                               ["stage"], buckets=STAGE_BUCKETS, registry=self.registry)
        self.registry.register(_Now(service))

    def job_finished(self, job) -> None:
        self.finished.labels(job.state, job.client or "").inc()
        if job.state == "done":
            for stage, seconds in job.timings.items():
                self.stage.labels(stage).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return render(self.registry)


class _Now:
    """What the service is doing at the moment of the scrape."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        service = self.service
        jobs = GaugeMetricFamily("h3_spark_jobs", "Jobs the service holds now, by state", labels=["state"])
        counts: dict[str, int] = {}
        for record in service.queue.list():
            counts[record["state"]] = counts.get(record["state"], 0) + 1
        for state in ("queued", "running", "done", "failed", "cancelled"):
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        stats = service.queue.stats()
        yield GaugeMetricFamily("h3_spark_queue_depth", "Jobs waiting behind the running one", value=stats["queued"])
        yield GaugeMetricFamily("h3_spark_queue_capacity", "Jobs that may wait", value=stats["capacity"])
        load = service.tracker.snapshot()
        state = GaugeMetricFamily("h3_spark_models_state", "1 for the models' current load state",
                                  labels=["state"])
        for name in ("loading", "ready", "failed"):
            state.add_metric([name], 1 if load["state"] == name else 0)
        yield state
        yield from _gpu_memory(service)
        models = service.models
        if models is not None and load["state"] == "ready":
            kernels = InfoMetricFamily("h3_spark_kernels", "What each loaded DiT runs", labels=["dit"])
            for key, report in (models.kernel_reports or {}).items():
                if key.startswith("dit"):
                    kernels.add_metric([key], {"attention": str(report.get("attention", {}).get("chosen")),
                                               "linear": str(report.get("linear", {}).get("format")),
                                               "exact": str(report.get("exact"))})
            yield kernels


def _gpu_memory(service):
    import torch
    from prometheus_client.core import GaugeMetricFamily

    models = service.models
    device = torch.device(models.device) if models is not None else None
    if device is None or device.type != "cuda":
        return
    allocated = GaugeMetricFamily("h3_spark_gpu_memory_bytes", "GPU memory of this process", labels=["kind"])
    allocated.add_metric(["allocated"], torch.cuda.memory_allocated(device))
    allocated.add_metric(["reserved"], torch.cuda.memory_reserved(device))
    free, total = torch.cuda.mem_get_info(device)
    allocated.add_metric(["free"], free)
    allocated.add_metric(["total"], total)
    yield allocated
