#!/usr/bin/env python3
"""Bounded load on a running `h3-spark serve`: concurrent clients, every request accounted for.

    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 8 --requests 16 \
        --body '{"prompt": "a cat", "steps": 3, "width": 64, "height": 64, "frames": 124}'

Each client submits its share of requests one after another (unique output names), follows every
accepted job until it ends and counts 429s (queue full) as answered. Prints one JSON report:
submitted, accepted, rejected (429), done / failed / cancelled, lost (accepted but never ended within
--timeout), requests per second (ended jobs / wall time) and latency percentiles (submit to end). Against a
fleet (`h3-spark fleet`) it also counts the jobs each replica took and the reasons failed jobs give. A poll
that is not answered with the job's record (a front restarting) is retried until --timeout. The bearer token,
if the service asks for one, comes from --api-key-file or $H3_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _record(http, job: str) -> dict | None:
    """The job's record, or None when this poll got no record (not 200, not JSON, the connection dropped)."""
    import httpx

    try:
        r = http.get(f"/jobs/{job}")
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def run_load(url: str, body: dict, clients: int, requests: int, timeout: float, poll: float = 0.05,
             headers: dict | None = None) -> dict:
    import httpx

    lock = threading.Lock()
    counts = {"submitted": 0, "accepted": 0, "rejected": 0, "done": 0, "failed": 0, "cancelled": 0, "lost": 0,
              "errors": 0}
    latencies: list[float] = []
    by_replica: dict[str, int] = {}
    failures: dict[str, int] = {}
    per_client = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]

    def client(n: int) -> None:
        with httpx.Client(base_url=url, timeout=30, headers=headers) as http:
            for _ in range(n):
                start = time.monotonic()
                r = http.post("/generate", json={**body, "output": f"load-{uuid.uuid4().hex[:12]}.mp4"})
                with lock:
                    counts["submitted"] += 1
                if r.status_code == 429:
                    with lock:
                        counts["rejected"] += 1
                    continue
                if r.status_code != 202:
                    with lock:
                        counts["errors"] += 1
                    continue
                placed = r.json()
                with lock:
                    counts["accepted"] += 1
                    if "replica" in placed:
                        by_replica[placed["replica"]] = by_replica.get(placed["replica"], 0) + 1
                state, record = None, None
                while time.monotonic() - start < timeout:
                    record = _record(http, placed["id"])
                    state = record["state"] if record else state
                    if state in ("done", "failed", "cancelled"):
                        break
                    time.sleep(poll)
                with lock:
                    if state in ("done", "failed", "cancelled"):
                        counts[state] += 1
                        latencies.append(time.monotonic() - start)
                        if state == "failed":
                            why = record.get("error") or "(no reason given)"
                            failures[why] = failures.get(why, 0) + 1
                    else:
                        counts["lost"] += 1

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in per_client if n]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    ended = counts["done"] + counts["failed"] + counts["cancelled"]
    extra = {"by_replica": by_replica} if by_replica else {}
    if failures:
        extra["failure_reasons"] = failures
    return {**counts, **extra, "clients": clients, "wall_s": round(wall, 3),
            "requests_per_s": round(ended / wall, 4) if wall > 0 else None,
            "latency_s": {"p50": _percentile(latencies, 0.5), "p90": _percentile(latencies, 0.9),
                          "p99": _percentile(latencies, 0.99),
                          "mean": statistics.fmean(latencies) if latencies else None}}


def _auth(key_file: str | None) -> dict | None:
    if key_file is not None:
        with open(key_file, encoding="utf-8") as f:
            key = (f.read().splitlines() or [""])[0].strip()
    else:
        key = os.environ.get("H3_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take before it counts as lost")
    p.add_argument("--body", default='{"prompt": "a cat plays the piano"}', help="request JSON (without output)")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between polls of one job")
    p.add_argument("--api-key-file", default=None, help="file whose first line is the bearer token "
                                                        "(default: $H3_API_KEY)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.poll <= 0:
        print("load_test: --clients and --requests must be at least 1 and --poll positive", file=sys.stderr)
        return 2
    headers = _auth(args.api_key_file)
    report = run_load(args.url, json.loads(args.body), args.clients, args.requests, args.timeout, args.poll,
                      headers)
    print(json.dumps(report))
    return 0 if report["lost"] == 0 and report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
