"""The fleet as a Ray Serve application: N replica deployments and the router in front of them.

    h3-spark fleet --replicas 2 --models /models/MiniMax-H3 --output-dir /srv/h3/out
    serve run h3_spark.serve.fleet.app:app_builder config=fleet.yaml     # the same, under `serve run`

Each replica is its own deployment with one Ray replica (names replica-1..N, or the config's), bound into the
router's arguments; the router is the ingress. A replica asks Ray for `gpus_per_replica` GPUs and
`cpus_per_replica` CPUs, so Ray places one per GPU (CUDA_VISIBLE_DEVICES) and never two on a GPU unless the
share says so. The router asks for no CPU: it only forwards, and it must fit beside the replicas.
"""

from __future__ import annotations

from ..command import allowed_hosts
from . import require_ray
from .config import FleetConfig, Secret, load_config

APP_NAME = "h3-spark-fleet"
# Router -> replica calls in flight: status polls and job polls must never wait behind each other.
REPLICA_MAX_ONGOING = 256
ROUTER_MAX_ONGOING = 1024


def build_fleet(config: FleetConfig, api_key=None):
    """The bound application (`serve.run` takes it); `api_key` is the token the router asks every request for, or
    the named keys (token -> auth.Client) of a keys file, each owning its jobs."""
    serve = require_ray()
    from .replica import Replica
    from .router import Router

    actor = {"num_cpus": config.cpus_per_replica, "num_gpus": config.gpus_per_replica}
    if config.env:
        actor["runtime_env"] = {"env_vars": dict(config.env)}
    # No access log on replicas: the router's state polls would fill it; the router logs each HTTP request.
    replica = serve.deployment(Replica, max_ongoing_requests=REPLICA_MAX_ONGOING,
                               logging_config={"enable_access_log": False})
    bound = [replica.options(name=spec.name, num_replicas=1, ray_actor_options=actor)
             .bind(spec.name, list(spec.serve_argv), config.threads_per_replica) for spec in config.replicas]
    router = serve.deployment(serve.ingress(None)(Router), name="router", num_replicas=1,
                              max_ongoing_requests=ROUTER_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    limits, keep_days = config.front_limits()
    settings = {"replicas": [spec.name for spec in config.replicas], "poll_seconds": config.poll_seconds,
                "call_timeout_seconds": config.call_timeout_seconds, "lost_after_seconds": config.lost_after_seconds,
                "api_key": Secret(api_key) if api_key is not None else None,
                "allowed_hosts": allowed_hosts(config.host, None), "state_file": check_state_file(config),
                # The soonest any replica drops an ended record (what a video's expires_at says), and the strictest
                # upload and step limits: checked at the front, whichever replica then takes the job.
                "keep_days": keep_days, "limits": limits, "http": config.http}
    return router.bind(settings, *bound)


def check_state_file(config: FleetConfig) -> str | None:
    """The router's ledger file, opened once here so that a bad one is refused in one line before Ray starts
    (the router opens it again in its actor)."""
    path = config.state_file
    if path is None:
        return None
    from ..records import JobRecords

    if not path.parent.exists():
        import sys

        path.parent.mkdir(parents=True)
        print(f"h3-spark fleet: created the state folder {path.parent} (state_dir did not exist)", file=sys.stderr,
              flush=True)
    JobRecords(path).close()
    return str(path)


def app_builder(args: dict):
    """`serve run h3_spark.serve.fleet.app:app_builder config=FILE`: the fleet from a config file; the token
    from the config's `api_key_file` or H3_API_KEY, or its `keys_file`. `serve run`'s own --host/--port say where it listens."""
    from ...errors import InputError
    from ..auth import read_api_key, read_keys_file

    if "config" not in args:
        raise InputError("the fleet's serve run target needs config=FILE (a YAML or JSON fleet config)")
    config = load_config(args["config"])
    keys = read_keys_file(config.keys_file) if config.keys_file is not None else read_api_key(config.api_key_file)
    return build_fleet(config, keys)
