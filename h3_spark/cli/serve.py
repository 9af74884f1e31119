"""`h3-spark serve`: load the models once, keep them resident, and serve generations over HTTP."""

from __future__ import annotations

import os
import sys

from ..serve.command import add_parser, build_service, server_config, service_settings, synthetic_overrides

__all__ = ["add_parser", "run"]


def run(args) -> int:
    from ..errors import H3Error

    try:
        import uvicorn

        from ..serve.app import create_app
    except ImportError as exc:
        raise H3Error(f"`h3-spark serve` needs starlette and uvicorn ({exc}); install them with "
                      f"pip install 'h3-spark[serve]'") from None
    from ..h3_model.engine.options import check_placement

    world_size = check_placement(args)
    lockstep = None
    if world_size > 1:
        from .distributed import command_argv, init_distributed, relaunch_with_torchrun

        if "WORLD_SIZE" not in os.environ:
            return relaunch_with_torchrun(args.gpus, command_argv(args), args.nnodes, args.node_rank,
                                          args.rdzv_endpoint)
        from ..serve.follower import follow, rank_log
        from ..serve.lockstep import Lockstep

        lockstep = Lockstep.join(*init_distributed(args.gpus, args.device, args.nnodes))
        if lockstep.rank > 0:
            from ..serve.models import LoadTracker, load_models

            # The same checks as rank 0 (a bad flag stops every rank before any loading).
            paths, options, config = service_settings(args, lockstep.device)
            overrides = synthetic_overrides(args, options)
            # TAEH3 and the ControlNet too: every rank runs the job's decode and its share of the control tower.
            return follow(lockstep, lambda: load_models(paths, options, LoadTracker(), overrides, config.taeh3,
                                                        config.controlnet),
                          rank_log(lockstep.rank))
    service = build_service(args, lockstep)
    if args.auth_line:
        print(f"h3-spark serve: {args.auth_line}", file=sys.stderr, flush=True)
    server = uvicorn.Server(server_config(args, create_app(service), service.config.http))
    failures: list[str] = []

    def stop(message: str) -> None:
        # A service that cannot load its models has nothing to serve: exit so a supervisor sees it.
        failures.append(message)
        server.should_exit = True

    service.on_load_failed = stop
    server.run()
    if failures:
        raise H3Error(f"the models could not be loaded: {failures[0]}")
    return 0
