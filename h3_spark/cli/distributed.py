"""Run a command on N GPUs: relaunch it under torchrun, then join the process group in each process.

Shared by `generate --gpus N` and `serve --gpus N`. The command first replaces itself with
`python -m torch.distributed.run --standalone --nproc_per_node=N -m h3_spark.cli <same arguments>`;
torchrun sets WORLD_SIZE/RANK/LOCAL_RANK, and each of its processes calls `init_distributed`. Across hosts
(`--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`, the same command on every host) torchrun meets the
other hosts at node 0's endpoint instead of `--standalone`; NCCL then needs a network every host reaches
(NCCL_SOCKET_IFNAME names its interface; InfiniBand is used when present).
"""

from __future__ import annotations

import os
import sys


def relaunch_with_torchrun(gpus: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
                           endpoint: str | None = None):
    """Replace this process with torchrun running the same command in `gpus` processes; does not return.

    exec rather than a child process: the signals a supervisor or a terminal sends to this command
    (SIGTERM, Ctrl-C) then reach torchrun itself, which passes them on to every rank and reaps them.
    A parent waiting on torchrun would die alone and leave the ranks running (torchrun starts each rank
    in its own session, so a signal to the parent's process group does not reach them either).
    """
    package = __package__ or "h3_spark.cli"
    if nnodes == 1:
        launch = ["--standalone", f"--nproc_per_node={gpus}"]
    else:
        # Static rendezvous at node 0's endpoint: every host runs the same command with its own node rank.
        host, _, port = endpoint.rpartition(":")
        launch = [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={gpus}",
                  f"--master_addr={host}", f"--master_port={port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", package, *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


def init_distributed(gpus: int, device: str | None, nnodes: int = 1) -> tuple[int, int, str]:
    """(rank, world size, this rank's device) under torchrun, with the default process group initialised.

    CUDA: NCCL, one GPU per process (cuda:LOCAL_RANK). CPU (`--device cpu`, or no GPU): gloo.
    """
    import torch
    import torch.distributed as dist

    from ..errors import InputError

    world = int(os.environ["WORLD_SIZE"])
    if world != gpus * nnodes:
        raise InputError(f"--gpus {gpus} x --nnodes {nnodes} but torchrun started {world} processes")
    if device not in (None, "cuda", "cpu"):
        # Each rank picks its own GPU; a fixed index would put every rank on the same one.
        raise InputError(f"with --gpus N, --device is cuda or cpu (rank r runs on cuda:r), got {device!r}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        dist.init_process_group("gloo")
        return dist.get_rank(), world, "cpu"
    if not torch.cuda.is_available():
        raise InputError("--device cuda asked for, but this machine has no CUDA GPU")
    if local >= torch.cuda.device_count():
        raise InputError(f"--gpus {gpus} but this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return dist.get_rank(), world, f"cuda:{local}"


def command_argv(args) -> list[str]:
    """The arguments this command was started with (main() records them; sys.argv otherwise)."""
    argv = getattr(args, "_argv", None)
    return list(argv) if argv is not None else sys.argv[1:]
