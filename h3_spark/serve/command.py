"""`h3-spark serve`'s flags and the service they build, without HTTP's server: the CLI (cli/serve.py) runs it under
uvicorn, and each replica of the fleet (fleet/replica.py) builds its service from the same flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..h3_model.engine.options import (add_budget_flags, add_kernel_flags, add_model_flags, add_parallel_flags,
                                       add_precision_flags)

DEFAULT_HOST = "127.0.0.1"  # local only unless --host says otherwise; beyond it a bearer token is required
DEFAULT_PORT = 8000


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run the hot runtime HTTP service (models stay resident)",
                       description="Load the text encoder, DiT partition(s) and VAEs once and serve /ready, "
                                   "/generate and /jobs over HTTP, one GPU job at a time.")
    models = add_model_flags(p, text_layer_help="Qwen3-VL hidden state the DiT reads (50 for the released model)")
    models.add_argument("--synthetic", choices=["full", "tiny"], default=None,
                        help="serve models with random weights built on the device instead of reading files: "
                             "`full` has the released shapes (benchmarks: cold start, latency), `tiny` is the demo's")
    models.add_argument("--synthetic-modes", default="ref2va",
                        help="with --synthetic: the modes whose DiT partition to build (comma-separated; default "
                             "ref2va: one full-size partition and the text encoder fill most of an H200)")
    models.add_argument("--taeh3", type=Path, default=None, metavar="PATH",
                        help="TAEH3, the tiny temporal decoder (madebyollin/taehv's taeh3.safetensors), checked and "
                             "loaded at start: requests may then ask for decoder taeh3 (drafts), and /jobs/{id}/preview "
                             "shows decoded frames instead of the false-colour latent view")
    models.add_argument("--controlnet", type=Path, default=None, metavar="FILE",
                        help="an H3 Fun ControlNet Union file, checked against the DiT and loaded at start: requests "
                             "may then carry `control` (a control video and / or an inpaint mask; docs/controlnet.md)")
    p.add_argument("--output-dir", type=Path, required=True, help="every output is written inside this folder")
    p.add_argument("--input-dir", type=Path, help="references and keyframes are read from inside this folder "
                                                  "(without it, only t2va requests are accepted)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}, this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="a Host header the service answers (repeatable; '*' for any). Default on loopback: "
                        "127.0.0.1, localhost and [::1] only, so a web page cannot reach it through DNS rebinding; "
                        "beyond loopback any Host, since every request then carries the bearer token")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="a file whose first line is the bearer token every request must send (default: $H3_API_KEY); "
                        "required to listen beyond 127.0.0.1")
    p.add_argument("--keys-file", type=Path, default=None,
                   help="several clients' keys, one `NAME TOKEN [admin]` a line (chmod 600): each key sees, reads "
                        "and cancels only its own jobs, an admin key all of them; records carry the name")
    p.add_argument("--queue-size", type=int, default=4, help="jobs that may wait behind the running one")
    add_precision_flags(p)
    add_kernel_flags(p, attention_note="; requests may pick another per job", linear_note="; fixed at load")
    add_budget_flags(p)
    p.add_argument("--max-steps", type=int, default=100, help="largest `steps` a request may ask for")
    p.add_argument("--max-input-mb", type=int, default=256, help="largest reference/keyframe file, MiB")
    state = p.add_argument_group("job records (an SQLite file; they outlive the process)")
    state.add_argument("--state-dir", type=Path, default=None,
                       help="folder of the job records file (default: --output-dir, as .h3-spark-jobs.sqlite); "
                            "created if it does not exist")
    state.add_argument("--keep-jobs", type=int, default=1000, help="ended job records kept, newest first")
    state.add_argument("--keep-days", type=float, default=7.0, help="ended job records older than this are dropped")
    http = p.add_argument_group("HTTP limits (per client)")
    http.add_argument("--max-header-kb", type=int, default=16, help="request line and headers together, KiB")
    http.add_argument("--max-headers", type=int, default=64, help="headers in one request (more: 431)")
    http.add_argument("--keep-alive-s", type=int, default=5, help="an idle connection is closed after this long")
    http.add_argument("--max-connections", type=int, default=64,
                      help="requests worked on at once, a request with a body from its last byte (more: 503 with "
                           "Retry-After); stalled clients do not count")
    http.add_argument("--body-timeout-s", type=float, default=30.0,
                      help="a request body must arrive within this long of its head (else 408)")
    http.add_argument("--head-timeout-s", type=float, default=10.0,
                      help="a request's head must arrive whole within this long of the connection opening or of "
                           "the previous response (else the socket is closed)")
    http.add_argument("--max-sockets", type=int, default=2048,
                      help="open sockets at once, stalled ones included (one more is closed as it opens)")
    http.add_argument("--sync-timeout-s", type=float, default=300.0,
                      help="POST /v1/videos/sync waits this long for its job, then answers 504 naming the video to "
                           "poll (the job goes on)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="the service's own log lines: text, or one JSON object per line with the job id")
    add_parallel_flags(p, gpus_note="; rank 0 serves HTTP, every rank holds the models")
    return p


def service_settings(args, device: str | None = None):
    """(ComponentPaths, LoadOptions, ServiceConfig) from the flags, checked; `device` is this rank's under
    --gpus N."""
    from ..errors import InputError
    from ..h3_model.engine.options import check_placement, component_paths, default_device, load_options
    from .http_limits import HttpLimits
    from .service import ServiceConfig
    from .validation import Limits

    world = check_placement(args)
    device = device or args.device or default_device()
    options, request = load_options(args, device, world)
    if args.synthetic == "full" and not device.startswith("cuda") and args.device is None:
        # Tens of GB of fp32 random weights on the CPU is never what a benchmark of the service meant.
        raise InputError("--synthetic full builds the full-size models for a CUDA GPU and this machine has none; "
                         "use --synthetic tiny, or pass --device cpu to build them on the CPU anyway")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be 1..65535, got {args.port}")
    if args.max_input_mb < 1:
        raise InputError(f"--max-input-mb must be positive, got {args.max_input_mb}")
    if args.keep_jobs < 1:
        raise InputError(f"--keep-jobs must be at least 1, got {args.keep_jobs}")
    if not 0 < args.keep_days <= 36500:
        raise InputError(f"--keep-days must be more than 0 (and at most 36500), got {args.keep_days:g}")
    if not 1 <= args.max_header_kb <= 1024:
        raise InputError(f"--max-header-kb must be 1..1024, got {args.max_header_kb}")
    http = HttpLimits(max_header_bytes=args.max_header_kb << 10, max_headers=args.max_headers,
                      keep_alive_s=args.keep_alive_s, max_connections=args.max_connections,
                      body_timeout_s=args.body_timeout_s, head_timeout_s=args.head_timeout_s,
                      max_sockets=args.max_sockets, sync_timeout_s=args.sync_timeout_s)
    config = ServiceConfig(output_dir=args.output_dir, input_dir=args.input_dir, queue_size=args.queue_size,
                           limits=Limits(max_steps=args.max_steps, max_input_file_bytes=args.max_input_mb << 20),
                           vae_tile_size=request.vae_tile_size, mlp_chunks=request.mlp_chunks,
                           keep_finished=args.keep_jobs,
                           state_dir=args.state_dir or args.output_dir, keep_days=args.keep_days, http=http)
    if args.synthetic:
        from ..measure.synthetic import describe

        config.weights = describe(args.synthetic)
    from .auth import check_binding, read_api_key, read_keys_file

    if args.keys_file is not None and args.api_key_file is not None:
        raise InputError("--keys-file and --api-key-file both give the keys: use one")
    config.api_key = read_keys_file(args.keys_file) if args.keys_file is not None else read_api_key(args.api_key_file)
    args.auth_line = check_binding(args.host, config.api_key)
    config.allowed_hosts = allowed_hosts(args.host, args.allowed_host)
    config.taeh3 = check_taeh3(args.taeh3)
    config.controlnet = check_controlnet(args.controlnet)
    return component_paths(args), options, config


def check_controlnet(path: Path | None) -> Path | None:
    """--controlnet's file, its header checked to be an H3 Fun ControlNet before any model loads (the DiT's width is
    checked against it when it loads)."""
    if path is None:
        return None
    from ..h3_model.checkpoint.controlnet import ControlNetFile

    with ControlNetFile(path) as f:
        f.check()
    return path


def check_taeh3(path: Path | None) -> Path | None:
    """--taeh3's file, read and checked to be the temporal TAEH3 before any model loads (it is small)."""
    if path is None:
        return None
    from ..errors import InputError
    from ..h3_model.vae.tiny_decoder import load_tiny_decoder

    if not path.is_file():
        raise InputError(f"--taeh3 {path}: no such file")
    load_tiny_decoder(path)
    return path


def allowed_hosts(bind: str, given: list[str] | None) -> tuple[str, ...] | None:
    """The Host headers the service answers; None for any."""
    from .auth import LOOPBACK_HOSTS, is_loopback

    if given:
        return None if "*" in given else tuple(h.strip().lower() for h in given)
    return LOOPBACK_HOSTS if is_loopback(bind) else None


def synthetic_overrides(args, options):
    """Component builders for --synthetic (None without it); refuses model paths given alongside."""
    if not args.synthetic:
        return None
    from ..errors import InputError
    from ..h3_model.engine.options import given_model_flags
    from ..measure.synthetic import component_builders

    given = given_model_flags(args)
    if given:
        raise InputError(f"--synthetic builds every model: drop {', '.join(given)}")
    modes = [m for m in args.synthetic_modes.split(",") if m]
    return component_builders(args.synthetic, modes, options.device, options.dtype, options.vae_dtype,
                              text_layer=options.text_layer)


def build_service(args, lockstep=None, state_name: str | None = None):
    """The service; under --gpus N (`lockstep`: rank 0's Lockstep) it loads in lockstep with the other ranks.
    `state_name`: the job records file's name (a fleet's replicas share one output folder, each its own file)."""
    from .lockstep import Leader, load_in_lockstep
    from .logs import make_log
    from .models import load_models
    from .service import Service

    paths, options, config = service_settings(args, lockstep.device if lockstep else None)
    if state_name is not None:
        config.state_name = state_name
    overrides = synthetic_overrides(args, options)
    log = make_log(args.log_format)
    if lockstep is None:
        return Service(config, lambda tracker: load_models(paths, options, tracker, overrides, config.taeh3,
                                                           config.controlnet), log=log)
    leader = Leader(lockstep, log)

    def load(tracker):
        return load_in_lockstep(lambda: load_models(paths, options, tracker, overrides, config.taeh3,
                                                    config.controlnet), lockstep, leader)

    return Service(config, load, leader=leader, log=log)


def server_config(args, app, http):
    """uvicorn's settings: the address, and the HTTP limits (`http`: HttpLimits) it enforces itself."""
    import uvicorn

    from .http_limits import uvicorn_settings

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                          timeout_graceful_shutdown=30, **uvicorn_settings(http))


