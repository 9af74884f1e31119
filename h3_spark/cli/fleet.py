"""`h3-spark fleet`: N hot services on Ray Serve behind one router (serve/fleet/); runs until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..h3_model.engine.options import MODELS_HELP, add_dtype_flag, add_kernel_flags

# Flags that fill the config's `serve` mapping (each replica's `h3-spark serve` flags), as (flag, type).
SERVE_FLAGS = (("models", Path), ("synthetic", str), ("synthetic-modes", str), ("device", str), ("dtype", str),
               ("output-dir", Path), ("input-dir", Path), ("queue-size", int), ("max-steps", int),
               ("attention", str), ("linear", str), ("log-format", str))
WATCH_SECONDS = 2.0


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run N hot services on Ray Serve behind one router",
                       description="Deploy N replicas of the hot service on Ray Serve (one GPU each, or CPU), "
                                   "with a router that places each job and sends every call about it to its "
                                   "replica, behind a front that holds h3-spark serve's HTTP limits (head and "
                                   "body deadlines, socket and request caps; the config's `http`). Flags override "
                                   "the --config file's settings.")
    p.add_argument("--config", type=Path, help="a YAML or JSON fleet config (serve/README.md, 'A fleet')")
    p.add_argument("--replicas", type=int, help="number of replicas (default 1)")
    p.add_argument("--gpus-per-replica", type=float,
                   help="GPUs Ray gives each replica, 0..1 (default 1; 0 with --device cpu)")
    p.add_argument("--cpus-per-replica", type=float, help="CPUs Ray gives each replica (default 1; on the CPU, "
                                                          "also its torch threads)")
    p.add_argument("--host", help="address the front binds (default 127.0.0.1; beyond it a token is required)")
    p.add_argument("--port", type=int, help="the front's port (default 8000)")
    p.add_argument("--api-key-file", type=Path, help="a file whose first line is the bearer token every request "
                                                     "must send (default: $H3_API_KEY)")
    p.add_argument("--keys-file", type=Path, help="named keys instead, one `NAME TOKEN [admin]` a line, chmod 600: "
                                                  "each key sees, reads and cancels only its own jobs and videos, an "
                                                  "admin key all")
    ray_group = p.add_argument_group("Ray")
    ray_group.add_argument("--address", help="join this Ray cluster (e.g. auto); without it, a local head starts")
    ray_group.add_argument("--num-cpus", type=int, help="CPUs of the local head (default: all)")
    ray_group.add_argument("--num-gpus", type=int, help="GPUs of the local head (default: all)")
    serve_group = p.add_argument_group("each replica (h3-spark serve's flags; others through --config)")
    serve_group.add_argument("--models", type=Path, help=MODELS_HELP)
    serve_group.add_argument("--synthetic", choices=["full", "tiny"], help="random weights instead of files")
    serve_group.add_argument("--synthetic-modes", help="with --synthetic: the modes to build (default ref2va)")
    serve_group.add_argument("--device", help="cuda (default when present; Ray picks the GPU) or cpu")
    add_dtype_flag(serve_group)
    serve_group.add_argument("--output-dir", type=Path, help="every replica writes inside this folder (on several "
                                                             "hosts: a shared file system)")
    serve_group.add_argument("--input-dir", type=Path, help="references and keyframes are read from this folder")
    serve_group.add_argument("--queue-size", type=int, help="jobs that may wait per replica (default 4)")
    serve_group.add_argument("--max-steps", type=int, help="largest `steps` a request may ask for")
    add_kernel_flags(serve_group, attention_note="; every replica's (requests may pick another per job)",
                     linear_note="; every replica's, fixed at load")
    serve_group.add_argument("--log-format", choices=["text", "json"], help="the replicas' own log lines")
    return p


def config_from_args(args):
    """The fleet config: --config's file with the flags given on top, or the flags alone."""
    from ..serve.fleet.config import config_from_mapping, load_config

    overrides = {key: getattr(args, key) for key in ("replicas", "gpus_per_replica", "cpus_per_replica", "host",
                                                      "port") if getattr(args, key) is not None}
    for key in ("api_key_file", "keys_file"):
        if getattr(args, key) is not None:
            overrides[key] = str(getattr(args, key))
    serve_options = {flag: getattr(args, flag.replace("-", "_")) for flag, _ in SERVE_FLAGS}
    serve_options = {k.replace("-", "_"): str(v) if isinstance(v, Path) else v
                     for k, v in serve_options.items() if v is not None}
    if serve_options:
        overrides["serve"] = serve_options
    if args.config is not None:
        return load_config(args.config, overrides)
    return config_from_mapping(overrides, "from the flags")


# Ray's switch for "this machine alone, not a cluster": with it off, Ray takes the loopback address as the node's and
# its gRPC servers (GCS, raylet, workers, object manager, agents) listen on 127.0.0.1; on Linux Ray otherwise uses
# the machine's address and listens on every interface, with no authentication.
RAY_LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def keep_ray_on_loopback(args) -> None:
    """Before Ray is imported (it reads the switch then): a local head listens on loopback only (start_ray checks
    that it did). Joining a cluster (--address) leaves the cluster's own settings alone."""
    if args.address is None:
        os.environ.update(RAY_LOCAL_ONLY)


def start_ray(args) -> bool:
    """Join --address or start a local head (on loopback: keep_ray_on_loopback); True when this process started
    Ray (and so stops it)."""
    import ray

    from ..errors import InputError

    if args.address is not None:
        if args.num_cpus is not None or args.num_gpus is not None:
            raise InputError("--num-cpus/--num-gpus size a local Ray head; with --address the cluster has its own")
        ray.init(address=args.address, include_dashboard=False)
        return False
    for flag, value in (("--num-cpus", args.num_cpus), ("--num-gpus", args.num_gpus)):
        if value is not None and value < 0:
            raise InputError(f"{flag} must be at least 0, got {value}")
    from ..serve.fleet.loopback import HOOK

    # The hook runs in every worker process of this job (Serve's controller, proxy and replicas included).
    ray.init(num_cpus=args.num_cpus, num_gpus=args.num_gpus, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env={"worker_process_setup_hook": HOOK})
    node = ray.util.get_node_ip_address()
    if node != "127.0.0.1":
        ray.shutdown()
        from ..errors import H3Error

        raise H3Error(f"the local Ray head took the address {node}, so it would listen beyond this machine; start "
                      f"h3-spark fleet in a process that has not imported Ray yet, or run a Ray cluster yourself and "
                      f"pass --address")
    return True


def watch(serve, app_name: str) -> None:
    """Print each replica's state when it changes (loading, ready, failed with why), until Ctrl-C."""
    router = serve.get_deployment_handle("router", app_name=app_name)
    seen: dict[str, str] = {}
    while True:
        try:
            report = router.fleet.remote().result(timeout_s=30)["replicas"]
        except Exception as exc:  # noqa: BLE001 - the router restarting; the fleet itself goes on
            report, line = {}, f"h3-spark fleet: the router did not answer ({type(exc).__name__}); retrying"
            if seen.get("") != line:
                print(line, file=sys.stderr, flush=True)
            seen[""] = line
        for name, replica in report.items():
            line = replica["state"] + (f": {replica['error']}" if replica.get("error") else "")
            if seen.get(name) != line:
                print(f"h3-spark fleet: {name} {line}", file=sys.stderr, flush=True)
                seen[name] = line
        time.sleep(WATCH_SECONDS)


def _loopback_port() -> int:
    """A free port on loopback for Ray's proxy (the front's upstream)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def front_server(config, key, upstream: str):
    """The fleet's front (serve/fleet/front.py) as a uvicorn server on the config's host and port, with serve's HTTP
    limits (the config's `http`)."""
    import uvicorn

    from ..serve.command import allowed_hosts
    from ..serve.fleet.front import front_app
    from ..serve.http_limits import uvicorn_settings

    limits, _ = config.front_limits()
    app = front_app(upstream, config.http, limits, allowed_hosts(config.host, None), key,
                    lambda line: print(f"h3-spark fleet: {line}", file=sys.stderr, flush=True))
    return uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                         lifespan="on", timeout_graceful_shutdown=30,
                                         **uvicorn_settings(config.http)))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args) -> int:
    from ..serve.auth import check_binding, read_api_key, read_keys_file
    from ..serve.fleet import require_ray

    keep_ray_on_loopback(args)
    serve = require_ray()
    config = config_from_args(args)
    key = read_keys_file(config.keys_file) if config.keys_file is not None else read_api_key(config.api_key_file)
    auth_line = check_binding(config.host, key)
    from ..serve.fleet.app import APP_NAME, build_fleet

    application = build_fleet(config, key)
    import ray

    owns_ray = start_ray(args)
    # A supervisor stops the fleet with SIGTERM: the same clean shutdown as Ctrl-C (Serve, then Ray). Set after
    # ray.init, which installs its own handler.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        # Ray's proxy listens on a loopback port of its own; the front (serve/fleet/front.py: serve's uvicorn
        # protocol and middleware, which Ray's proxy cannot take) listens where the config says and forwards to it.
        upstream = _loopback_port()
        serve.start(http_options={"host": "127.0.0.1", "port": upstream,
                                  "keep_alive_timeout_s": config.http.keep_alive_s}, proxy_location="HeadOnly")
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        server = front_server(config, key, f"http://127.0.0.1:{upstream}")
        print(f"h3-spark fleet: {len(config.replicas)} replica(s) behind http://{config.host}:{config.port} "
              f"(GET /fleet for each one's state; Ctrl-C stops the fleet)", file=sys.stderr, flush=True)
        if auth_line:
            print(f"h3-spark fleet: {auth_line}", file=sys.stderr, flush=True)
        threading.Thread(target=watch, args=(serve, APP_NAME), name="h3-fleet-watch", daemon=True).start()
        server.run()  # until Ctrl-C or SIGTERM (uvicorn's own handlers), then Serve and Ray stop below
    finally:
        try:
            if owns_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if owns_ray:
                ray.shutdown()
    return 0
