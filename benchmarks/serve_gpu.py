"""The hot service on one GPU: cold start to /ready, then warm /generate latency and the step caches.

Usage (repository root on the GPU machine):
    python3 benchmarks/serve_gpu.py --contract benchmarks/ref2va-960x544-124f.json --out $OUT/serve.json \
        [--synthetic full] [--warm 2] [--cache-modes easycache,h3_cache]

Starts `h3-spark serve --synthetic full` (random weights with the released shapes, built on the GPU: the
released weights cannot be downloaded here, so the cold start measured is building and placing the models,
not reading them from disk) on a free loopback port and times, from the process start:
- cold start: until /ready answers 200 (every model resident), with the per-model load seconds it lists;
- the contract's request (its six 1920x1080 references written as PNGs into the input folder) sent
  1 + --warm times, one after another: the first includes one-time work (kernel selection, first
  reference encode), the rest are warm (a new prompt each, the same references, which the service's
  reference cache then holds); latency = submit to done, plus the job's own stage timings;
- each --cache-modes step cache on the same request: latency, steps computed and reused.
Everything it measured is written to --out as JSON with the GPU stamp, and the server is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(http, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /ready")
        try:
            r = http.get("/ready")
            if r.status_code == 200:
                return r.json()
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"/ready not 200 within {timeout} s")


def run_job(http, body: dict, timeout: float) -> dict:
    start = time.monotonic()
    r = http.post("/generate", json=body)
    if r.status_code != 202:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
    job = r.json()["id"]
    while time.monotonic() - start < timeout:
        snap = http.get(f"/jobs/{job}").json()
        if snap["state"] in ("done", "failed", "cancelled"):
            snap["latency_s"] = time.monotonic() - start
            return snap
        time.sleep(0.1)
    raise RuntimeError(f"job {job} did not end within {timeout} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contract", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--synthetic", default="full", choices=["full", "tiny"])
    p.add_argument("--warm", type=int, default=2, help="warm requests after the first one")
    p.add_argument("--cache-modes", default="easycache,h3_cache")
    p.add_argument("--device", default=None)
    p.add_argument("--timeout", type=float, default=400.0)
    args = p.parse_args(argv)
    import_package()
    import httpx
    import torch
    from PIL import Image

    from h3_spark.measure import stamp
    from h3_spark.measure.contract import load_contract

    contract = load_contract(args.contract)
    record = stamp.stamp_before()
    work = Path(tempfile.mkdtemp(prefix="h3serve_"))
    (work / "in").mkdir()
    (work / "out").mkdir()
    refs = []
    for i, ref in enumerate(contract.get("references", [])):
        gen = torch.Generator().manual_seed(contract["seed"] + i)
        pixels = torch.randint(0, 256, (ref["source_height"], ref["source_width"], 3), generator=gen, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(work / "in" / f"ref{i}.png")
        refs.append({"kind": "image", "path": f"ref{i}.png"})
    port = free_port()
    cmd = [sys.executable, "-m", "h3_spark.cli", "serve", "--synthetic", args.synthetic, "--synthetic-modes",
           contract["mode"], "--output-dir", str(work / "out"), "--input-dir", str(work / "in"), "--port", str(port),
           "--log-level", "warning"] + (["--device", args.device] if args.device else [])
    body = {"mode": contract["mode"], "prompt": contract.get("prompt", "benchmark"), "width": contract["width"],
            "height": contract["height"], "frames": contract["frames"], "steps": contract["steps"],
            "seed": contract["seed"]}
    if refs:
        body["references"] = refs
    result: dict = {"contract": contract["name"], "command": " ".join(cmd[1:]), "request": body}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            ready = wait_ready(http, proc, args.timeout)
            result["cold_start_to_ready_s"] = time.monotonic() - start
            result["ready"] = {k: ready.get(k) for k in ("models", "memory", "weights", "loading", "supported")}
            print(json.dumps({"cold_start_to_ready_s": result["cold_start_to_ready_s"]}), flush=True)
            runs = []
            for i in range(1 + args.warm):
                # A new prompt each time: the text encoder runs as for a new request; the references
                # repeat, so they come from the reference cache (the job's info counts the hits).
                prompt = body["prompt"] if i == 0 else f"{body['prompt']} Take {i + 1}."
                snap = run_job(http, {**body, "prompt": prompt, "output": f"run{i}.mp4"}, args.timeout)
                runs.append({k: snap.get(k) for k in ("state", "latency_s", "timings", "backends", "info", "error")})
                print(json.dumps({"run": i, "state": snap["state"], "latency_s": snap["latency_s"],
                                  "timings": snap.get("timings")}), flush=True)
            result["first_request"] = runs[0]
            result["warm_requests"] = runs[1:]
            warm = [r["latency_s"] for r in runs[1:] if r["state"] == "done"]
            result["warm_latency_s_median"] = statistics.median(warm) if warm else None
            caches = {}
            for mode in (m for m in args.cache_modes.split(",") if m):
                snap = run_job(http, {**body, "output": f"cache-{mode}.mp4", "cache_mode": mode}, args.timeout)
                sc = snap.get("step_cache") or {}
                caches[mode] = {"state": snap["state"], "latency_s": snap["latency_s"], "timings": snap.get("timings"),
                                "computed_steps": len(sc.get("computed", [])),
                                "reused_steps": len(sc.get("reused", [])), "reused": sc.get("reused"),
                                "error": snap.get("error")}
                brief = {k: caches[mode][k] for k in ("state", "latency_s", "reused_steps")}
                print(json.dumps({"cache": mode, **brief}), flush=True)
            result["step_caches"] = caches
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result["stamp"] = stamp.stamp_after(record)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
