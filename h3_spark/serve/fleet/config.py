"""The fleet's settings: how many replicas, what each one serves, what Ray gives each, where the front listens.

A config is a mapping, read from a YAML or JSON file or made from `h3-spark fleet`'s flags:

    replicas: 2                  # or a list: [{name: gpu-a, serve: {device: "cuda"}}, ...]
    serve:                       # `h3-spark serve` flags every replica takes, without the leading --
      models: /models/MiniMax-H3
      output_dir: /srv/h3/out
    gpus_per_replica: 1          # Ray resources of one replica (default: 1 GPU, or 0 with device cpu)
    cpus_per_replica: 1
    env: {H3_ATTENTION: auto}    # environment of the replica processes (kernel flags are read there)
    host: 127.0.0.1
    port: 8000
    http: {head_timeout_s: 10, body_timeout_s: 30, max_connections: 64, sync_timeout_s: 300}   # the front's, as serve's

The per-replica `serve` flags go through `h3-spark serve`'s own parser here, before Ray starts, so a typo is
one line naming the replica and the flag rather than N replicas failing on their own. The flags that belong
to the front (host, port, the token) or that would make a replica span processes (--gpus, --nnodes) are
refused there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import InputError
from ..http_limits import HttpLimits

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_REPLICAS = 256
ROUTER_STATE_FILE = ".h3-spark-fleet.sqlite"
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
KEYS = ("replicas", "serve", "gpus_per_replica", "cpus_per_replica", "env", "host", "port", "api_key_file",
        "keys_file", "poll_seconds", "call_timeout_seconds", "lost_after_seconds", "state_dir", "http")
# Flags of `h3-spark serve` a replica must not take, and why.
FRONT_FLAGS = {"host": "the fleet's front listens (set `host` at the top of the config)",
               "port": "the fleet's front listens (set `port` at the top of the config)",
               "api_key_file": "the fleet's front checks the token (set `api_key_file` at the top of the config)",
               "keys_file": "the fleet's front checks the keys (set `keys_file` at the top of the config)"}
SPANNING_FLAGS = ("gpus", "nnodes", "node_rank", "rdzv_endpoint")


class _Refusing(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting: a bad flag in a config is one line."""

    def error(self, message: str):
        raise InputError(message)


def serve_parser() -> argparse.ArgumentParser:
    """`h3-spark serve`'s parser, the one replicas parse their flags with."""
    from ..command import add_parser

    root = _Refusing(prog="h3-spark", add_help=False)
    return add_parser(root.add_subparsers(parser_class=_Refusing), "serve")


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    serve_argv: tuple[str, ...]  # `h3-spark serve` flags (parsed again in the replica's own process)


@dataclass(frozen=True)
class FleetConfig:
    replicas: tuple[ReplicaSpec, ...]
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 1.0
    env: dict = field(default_factory=dict)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key_file: Path | None = None
    keys_file: Path | None = None  # named keys, each owning its jobs (serve/auth.py's format)
    poll_seconds: float = 0.5  # how often the router asks every replica for its state and its jobs'
    call_timeout_seconds: float = 10.0  # one call to a replica; past it the replica counts as not answering
    lost_after_seconds: float = 120.0  # a replica that has not answered this long has lost its jobs
    # The router's job -> replica ledger file's folder (default: the replicas' output folder).
    state_dir: Path | None = None
    # What one HTTP client may cost the front (serve's HTTP limits; the config's `http` mapping, by field name).
    http: HttpLimits = field(default_factory=HttpLimits)

    @property
    def state_file(self) -> Path | None:
        return None if self.state_dir is None else Path(self.state_dir) / ROUTER_STATE_FILE

    def front_limits(self):
        """(validation.Limits, keep_days) the router applies at the front: the strictest of the replicas', since
        any of them may take a job (an upload checked against one replica's larger limit could land on another)."""
        from ..validation import Limits

        parsed = [serve_parser().parse_args(list(spec.serve_argv)) for spec in self.replicas]
        limits = Limits(max_steps=min(p.max_steps for p in parsed),
                        max_input_file_bytes=min(p.max_input_mb for p in parsed) << 20)
        return limits, min(p.keep_days for p in parsed)

    @property
    def threads_per_replica(self) -> int:
        """Torch threads of a CPU replica: its CPU share, so replicas on one host do not fight over cores."""
        return max(1, math.floor(self.cpus_per_replica))


def load_config(path: Path, overrides: dict | None = None) -> FleetConfig:
    """The config in a YAML (.yaml/.yml) or JSON file, with `overrides` (flags given) on top."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"fleet config {path}: no such file") from None
    except OSError as exc:
        raise InputError(f"fleet config {path}: cannot read it ({exc.strerror})") from None
    data = _parse(text, path)
    if not isinstance(data, dict):
        raise InputError(f"fleet config {path}: the top level must be a mapping of settings")
    merged = dict(data)
    for key, value in (overrides or {}).items():
        if key == "serve":
            merged["serve"] = {**_mapping(data.get("serve"), "serve", str(path)), **value}
        else:
            merged[key] = value
    return config_from_mapping(merged, str(path))


def _parse(text: str, path: Path) -> object:
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise InputError(f"fleet config {path}: not valid YAML{line}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"fleet config {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    raise InputError(f"fleet config {path}: name a .yaml, .yml or .json file")


def config_from_mapping(data: dict, source: str = "flags") -> FleetConfig:
    """Check every setting and build the config; each mistake is one line starting with the source."""
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise InputError(f"fleet config {source}: unknown setting {unknown[0]!r} (known: {', '.join(KEYS)})")
    shared = _mapping(data.get("serve"), "serve", source)
    cpus = _number(data, "cpus_per_replica", 1.0, source, low=0.0)
    default_gpus = 0.0 if str(shared.get("device", "")).startswith("cpu") else 1.0
    gpus = _number(data, "gpus_per_replica", default_gpus, source, low=0.0)
    if gpus > 1:
        raise InputError(f"fleet config {source}: gpus_per_replica {gpus:g}: a replica holds its models on one GPU "
                         f"(a sequence-parallel group per replica is not supported by the fleet); use 0..1")
    replicas = _replicas(data.get("replicas", 1), shared, source)
    env = _mapping(data.get("env"), "env", source)
    for key, value in env.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise InputError(f"fleet config {source}: env {key} must be a string or a number")
    host = data.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host:
        raise InputError(f"fleet config {source}: host must be an address, got {host!r}")
    port = data.get("port", DEFAULT_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise InputError(f"fleet config {source}: port must be 1..65535, got {port!r}")
    key_file, keys_file = data.get("api_key_file"), data.get("keys_file")
    for name, value in (("api_key_file", key_file), ("keys_file", keys_file)):
        if value is not None and (not isinstance(value, str) or not value):
            raise InputError(f"fleet config {source}: {name} must be a file path, got {value!r}")
    if key_file is not None and keys_file is not None:
        raise InputError(f"fleet config {source}: api_key_file (one token) and keys_file (named keys) both give the "
                         "front's keys: use one")
    state_dir = data.get("state_dir", shared.get("state_dir", shared.get("output_dir")))
    if state_dir is not None and (not isinstance(state_dir, str) or not state_dir):
        raise InputError(f"fleet config {source}: state_dir must be a folder, got {state_dir!r}")
    return FleetConfig(
        replicas=replicas, cpus_per_replica=cpus, gpus_per_replica=gpus, env={k: str(v) for k, v in env.items()},
        host=host, port=port, api_key_file=Path(key_file) if key_file is not None else None,
        keys_file=Path(keys_file) if keys_file is not None else None,
        poll_seconds=_number(data, "poll_seconds", 0.5, source, low=0.05, high=60),
        call_timeout_seconds=_number(data, "call_timeout_seconds", 10.0, source, low=0.5, high=600),
        lost_after_seconds=_number(data, "lost_after_seconds", 120.0, source, low=1, high=86400),
        state_dir=Path(state_dir) if state_dir is not None else None, http=_http(data.get("http"), source))


def _http(value, source: str) -> HttpLimits:
    """The front's HTTP limits: `serve`'s (http_limits.HttpLimits), any of them set by field name."""
    given = _mapping(value, "http", source)
    known = [f.name for f in dataclasses.fields(HttpLimits)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise InputError(f"fleet config {source}: unknown http setting {unknown[0]!r} (known: {', '.join(known)})")
    for key, item in given.items():
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise InputError(f"fleet config {source}: http {key} must be a number, got {item!r}")
    try:
        return HttpLimits(**given)
    except InputError as exc:  # its message names serve's flag
        raise InputError(f"fleet config {source}: http: {exc}") from None


def _replicas(value, shared: dict, source: str) -> tuple[ReplicaSpec, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= MAX_REPLICAS:
            raise InputError(f"fleet config {source}: replicas must be 1..{MAX_REPLICAS}, got {value}")
        entries = [{"name": f"replica-{i + 1}"} for i in range(value)]
    elif isinstance(value, list) and value:
        if len(value) > MAX_REPLICAS:
            raise InputError(f"fleet config {source}: at most {MAX_REPLICAS} replicas, got {len(value)}")
        entries = value
    else:
        raise InputError(f"fleet config {source}: replicas must be a count or a non-empty list of replicas, "
                         f"got {value!r}")
    specs, seen = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"name", "serve"}:
            raise InputError(f"fleet config {source}: replica {i + 1} must be a mapping with `name` and `serve`")
        name = entry.get("name", f"replica-{i + 1}")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(f"fleet config {source}: replica name {name!r} must be 1-40 of a-z, 0-9 and -, "
                             f"starting with a letter or digit")
        if name in seen:
            raise InputError(f"fleet config {source}: two replicas are named {name!r}")
        seen.add(name)
        options = {**shared, **_mapping(entry.get("serve"), f"replica {name}'s serve", source)}
        specs.append(ReplicaSpec(name, serve_argv(options, f"fleet config {source}: replica {name}")))
    return tuple(specs)


def serve_argv(options: dict, where: str) -> tuple[str, ...]:
    """`h3-spark serve` flags from a mapping, checked by serve's own parser (its error, prefixed by `where`)."""
    argv: list[str] = []
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name in FRONT_FLAGS:
            raise InputError(f"{where}: serve option {key!r} is not per replica: {FRONT_FLAGS[name]}")
        if name in SPANNING_FLAGS:
            raise InputError(f"{where}: serve option {key!r}: a replica is one process on one device; the fleet "
                             f"does not run sequence-parallel replicas")
        if value is None:
            continue
        if isinstance(value, (bool, list, dict)):
            raise InputError(f"{where}: serve option {key!r} must be a string or a number, got {value!r}")
        argv += [f"--{name.replace('_', '-')}", str(value)]
    try:
        serve_parser().parse_args(argv)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return tuple(argv)


def _mapping(value, what: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"fleet config {source}: {what} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _number(data: dict, key: str, default: float, source: str, *, low: float, high: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"fleet config {source}: {key} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"{low:g}..{high:g}" if high is not None else f"at least {low:g}"
        raise InputError(f"fleet config {source}: {key} must be {span}, got {value:g}")
    return float(value)


class Secret:
    """The bearer token, or the named keys (token -> auth.Client), on their way to the router (a deployment
    argument): never shown by repr or str."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return "Secret(hidden)"

    __str__ = __repr__
