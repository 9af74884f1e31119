"""The openai client's round trip through /v1/videos for a tiny job, against a live `h3-spark serve --synthetic tiny`
and a 2-replica `h3-spark fleet` of the same (CPU, loopback); JSON to --out.

Usage (repository root, any machine):
    python benchmarks/videos_openai_cpu.py --out receipts/cpu/videos-openai.json [--runs 7] [--skip-fleet]

One round trip: `client.videos.create_and_poll` (polling every 50 ms) then `download_content` of the mp4, timed
from the create to the last byte. Reported per front: the median, min and max of `--runs` trips (after one warm-up
trip), and the median of the job's own time (its record's started -> finished), so the API's share is the
difference. The job: 64 x 64, 124 frames, 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = {"size": "64x64", "seconds": "5.17", "extra_body": {"steps": 2, "seed": 7}}
ENV = {"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"not ready within {timeout:g} s")


def _trips(base: str, runs: int) -> dict:
    import openai

    warnings.simplefilter("ignore", DeprecationWarning)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    trips, jobs = [], []
    for i in range(runs + 1):
        start = time.perf_counter()
        video = client.videos.create_and_poll(prompt="a cat plays the piano", poll_interval_ms=50, **JOB)
        size = len(client.videos.download_content(video.id).read())
        elapsed = time.perf_counter() - start
        if video.status != "completed" or size == 0:
            raise SystemExit(f"trip {i}: {video.status} {video.error}")
        record = json.load(urllib.request.urlopen(f"{base}/jobs/{video.job_id}"))
        if i:  # the first is a warm-up
            trips.append(elapsed)
            jobs.append(record["finished"] - record["started"])
    return {"runs": runs, "round_trip_s": {"median": statistics.median(trips), "min": min(trips), "max": max(trips),
                                           "all": trips},
            "job_s_median": statistics.median(jobs), "api_share_s_median": statistics.median(trips) -
            statistics.median(jobs)}


def _run(argv: list[str], base: str, runs: int, timeout: float) -> dict:
    # This checkout's h3_spark in Ray's workers too (they do not start in its folder).
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        ready = _wait_ready(base, proc, timeout)
        return {"command": " ".join(argv[2:]), "ready_after_s": ready, **_trips(base, runs)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--skip-fleet", action="store_true")
    args = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    import torch

    result = {"what": "openai client round trip (create_and_poll + download_content) of a tiny /v1/videos job "
                      "(64x64, 124 frames, 2 steps; synthetic random weights) on loopback, CPU",
              "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
              "python": platform.python_version(),
              "torch": torch.__version__, "commit": commit, "env": ENV,
              "command": f"python benchmarks/videos_openai_cpu.py --out {args.out} --runs {args.runs}"}
    h3 = [sys.executable, "-m", "h3_spark.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "serve").mkdir()
        port = _free_port()
        result["serve"] = _run(h3 + ["serve", "--synthetic", "tiny", "--synthetic-modes", "t2va", "--device", "cpu",
                                     "--output-dir", f"{tmp}/serve", "--port", str(port), "--log-level", "warning"],
                               f"http://127.0.0.1:{port}", args.runs, 120)
        if not args.skip_fleet:
            (Path(tmp) / "fleet").mkdir()
            port = _free_port()
            result["fleet_2_replicas"] = _run(
                h3 + ["fleet", "--replicas", "2", "--synthetic", "tiny", "--synthetic-modes", "t2va", "--device", "cpu",
                      "--output-dir", f"{tmp}/fleet", "--num-cpus", "2", "--cpus-per-replica", "1", "--port",
                      str(port)], f"http://127.0.0.1:{port}", args.runs, 300)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v.get("round_trip_s", {}).get("median") for k, v in result.items() if isinstance(v, dict)
                      and "round_trip_s" in v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
