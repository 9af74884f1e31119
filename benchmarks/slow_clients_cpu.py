"""Slow clients against a live `h3-spark serve --synthetic tiny` on loopback (CPU), or with `--fleet N` against
`h3-spark fleet` of N such replicas (its front, serve/fleet/front.py): stalled sockets held while real clients loop;
JSON to --out.

Usage (repository root, any machine):
    python benchmarks/slow_clients_cpu.py --out receipts/cpu/slow-clients.json [--stalled 500] [--clients 8]
        [--seconds 30]
    python benchmarks/slow_clients_cpu.py --fleet 2 --out receipts/cpu/slow-clients-fleet.json

Half of the stalled sockets send part of a request head and stop, half a whole head and 6 bytes of a 100-byte
body. Each client loops: POST /generate (a tiny job: 202, or 429 with Retry-After once the queue is full) and
GET /live. Reported: the answers by status, requests that got no answer (lost), /live latency (median, p99),
and when each stalled socket was closed (the head deadline, or the body deadline's 408).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int | None, dict, float]:
    start = time.perf_counter()
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
            s.sendall(head.encode() + b"\r\n" + (body or b""))
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None, {}, time.perf_counter() - start
    if not data:
        return None, {}, time.perf_counter() - start
    lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    return int(lines[0].split()[1]), headers, time.perf_counter() - start


def _stall(port: int, i: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    if i % 2:
        s.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    else:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"a\": ")
    return s


def _watch(stalled: list[socket.socket], t0: float, until: float) -> list[tuple[float | None, str]]:
    """When the server closed each stalled socket (seconds after t0) and what it said first, watched as it
    happens (one selector for all of them)."""
    import selectors

    sel = selectors.DefaultSelector()
    said = {}
    for i, s in enumerate(stalled):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        said[i] = b""
    closed: dict[int, float] = {}
    while len(closed) < len(stalled) and time.monotonic() < until:
        for key, _ in sel.select(timeout=0.05):
            i = key.data
            try:
                chunk = key.fileobj.recv(4096)
            except (ConnectionResetError, BlockingIOError):
                chunk = b""
            if chunk:
                said[i] += chunk
                continue
            closed[i] = time.monotonic() - t0
            sel.unregister(key.fileobj)
    return [(closed.get(i), said[i][:12].decode("latin-1")) for i in range(len(stalled))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--stalled", type=int, default=500)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--head-timeout-s", type=float, default=10.0)
    p.add_argument("--body-timeout-s", type=float, default=30.0)
    p.add_argument("--fleet", type=int, default=0, help="measure `h3-spark fleet` of this many replicas instead")
    args = p.parse_args(argv)
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if args.fleet:
            config = Path(out_dir) / "fleet.json"
            config.write_text(json.dumps({"http": {"head_timeout_s": args.head_timeout_s,
                                                   "body_timeout_s": args.body_timeout_s}}))
            command = ["fleet", "--config", str(config), "--replicas", str(args.fleet), "--synthetic", "tiny",
                       "--synthetic-modes", "t2va", "--device", "cpu", "--cpus-per-replica",
                       str(max(0.25, (os.cpu_count() or 2) / (args.fleet + 1))), "--num-cpus", str(os.cpu_count() or 2)]
        else:
            command = ["serve", "--synthetic", "tiny", "--synthetic-modes", "t2va", "--head-timeout-s",
                       str(args.head_timeout_s), "--body-timeout-s", str(args.body_timeout_s), "--log-level", "warning"]
        service = subprocess.Popen([sys.executable, "-m", "h3_spark.cli", *command, "--output-dir", out_dir, "--port",
                                    str(port), "--queue-size", "4"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                        if r.status == 200 and json.loads(r.read()).get("ready_replicas", 1) >= max(args.fleet, 1):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or service.poll() is not None:
                    raise SystemExit("the service did not become ready")
                time.sleep(0.5)
            t0 = time.monotonic()
            stalled = [_stall(port, i) for i in range(args.stalled)]
            opened = time.monotonic() - t0
            results: list[tuple[str, int | None, dict, float]] = []
            stop = time.monotonic() + args.seconds
            closes: list = []
            watcher = threading.Thread(target=lambda: closes.extend(_watch(
                stalled, t0, t0 + max(args.seconds, args.head_timeout_s, args.body_timeout_s) + 5)))
            watcher.start()
            lock = threading.Lock()

            def client(k: int) -> None:
                n = 0
                while time.monotonic() < stop:
                    body = json.dumps({"prompt": "a cat", "output": f"c{k}-{n}.mp4", "width": 64, "height": 64,
                                       "frames": 124, "steps": 2}).encode()
                    job = _request(port, "POST", "/generate", body)
                    live = _request(port, "GET", "/live")
                    with lock:
                        results.append(("generate", *job))
                        results.append(("live", *live))
                    n += 1

            threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            watcher.join()
        finally:
            service.send_signal(signal.SIGINT)  # a fleet stops Serve and Ray on Ctrl-C
            try:
                service.wait(timeout=120)
            except subprocess.TimeoutExpired:
                service.kill()
    heads = [c for i, c in enumerate(closes) if i % 2]
    bodies = [c for i, c in enumerate(closes) if not i % 2]
    generate = [r for r in results if r[0] == "generate"]
    live = [r for r in results if r[0] == "live"]
    live_s = sorted(r[3] for r in live if r[1] == 200)
    by_status = {}
    for kind, code, _, _ in results:
        by_status.setdefault(kind, {}).setdefault(str(code), 0)
        by_status[kind][str(code)] += 1
    result = {
        "what": f"{args.stalled} stalled sockets (half a partial head, half a head and 6 of 100 body bytes) held "
                f"while {args.clients} clients loop POST /generate + GET /live for {args.seconds:g} s against "
                + (f"`h3-spark fleet --replicas {args.fleet} --synthetic tiny` (its front before Ray Serve's proxy)"
                   if args.fleet else "`h3-spark serve --synthetic tiny`")
                + " on loopback (CPU; tiny synthetic random weights)",
        "cpus": os.cpu_count(),
        "limits": {"head_timeout_s": args.head_timeout_s, "body_timeout_s": args.body_timeout_s,
                   "max_connections": 64, "queue_size": 4 if not args.fleet else f"4 per replica, {args.fleet}"},
        "stalled_opened_in_s": round(opened, 3),
        "answers": by_status,
        "lost": sum(1 for r in results if r[1] is None),
        "generate_429_with_retry_after": sum(1 for r in generate if r[1] == 429 and "retry-after" in r[2]),
        "live_s": {"median": statistics.median(live_s), "p99": statistics.quantiles(live_s, n=100)[98],
                   "max": live_s[-1], "count": len(live_s)},
        "stalled_heads_closed": {"count": sum(1 for c in heads if c[0] is not None), "of": len(heads),
                                 "at_s_min": min(c[0] for c in heads if c[0] is not None),
                                 "at_s_max": max(c[0] for c in heads if c[0] is not None),
                                 "said": sorted({c[1] for c in heads})},
        "stalled_bodies_closed": {"count": sum(1 for c in bodies if c[0] is not None), "of": len(bodies),
                                  "at_s_min": min(c[0] for c in bodies if c[0] is not None),
                                  "at_s_max": max(c[0] for c in bodies if c[0] is not None),
                                  "said": sorted({c[1] for c in bodies})},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
