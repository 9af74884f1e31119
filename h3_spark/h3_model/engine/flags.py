"""The values of the flags the front doors share (cli/, serve/), checked the same way everywhere: as the user typed
them, before loading. The flags themselves are declared in options.py."""

from __future__ import annotations

from pathlib import Path

def check_device(name: str) -> str:
    """`cpu` or `cuda[:N]` that exists here; anything else is refused naming the flag (torch would raise a
    RuntimeError deep inside the first tensor move)."""
    from ...errors import InputError

    if name == "cpu":
        return name
    index = name[len("cuda:"):] if name.startswith("cuda:") else None
    if name != "cuda" and not (index and index.isdigit()):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    import torch

    if not torch.cuda.is_available():
        raise InputError(f"--device {name} asked for, but this machine has no CUDA GPU")
    if index is not None and int(index) >= torch.cuda.device_count():
        raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return name


def host_budget(flag: str | None) -> int | None:
    """--host-budget, else H3_HOST_BUDGET: bytes, or None (unchecked); "auto" has no meaning for it."""
    import os

    from ...errors import InputError
    from .memory import parse_budget

    source, text = ("--host-budget", flag) if flag is not None else ("H3_HOST_BUDGET", os.environ.get("H3_HOST_BUDGET"))
    if text is not None and text.strip().lower() == "auto":
        raise InputError(f"{source} takes a size (24, 24GB, 22.5GiB), not auto")
    try:
        return parse_budget(text, source)
    except InputError as exc:
        if "not a size" not in str(exc):
            raise
        raise InputError(f"{source} {text!r} is not a size; use 24, 24GB, 22.5GiB or 800MB") from None


TEXT_PIN_CHOICES = ("auto", "on", "off")


def text_pin(environ=None) -> str:
    """H3_TEXT_PIN: whether streamed text-encoder layers sit in page-locked host memory (memory.text_pinning);
    auto (the default) when the host has room for them."""
    import os

    from ...errors import InputError

    value = (os.environ if environ is None else environ).get("H3_TEXT_PIN", "auto").strip().lower() or "auto"
    if value not in TEXT_PIN_CHOICES:
        raise InputError(f"H3_TEXT_PIN must be one of {', '.join(TEXT_PIN_CHOICES)}, got {value!r}")
    return value


# Off by default: on the H100 machine's disk (capped at ~1.1 GB/s whatever reads it) the reader read no faster
# than the kernel's read-ahead (receipts/h100/disk-read-8gb-*.json); it pays where an engine waits after its load.
READ_THREADS_DEFAULT = 0
READ_THREADS_MAX = 64


def read_threads(environ=None) -> int:
    """H3_READ_THREADS: threads reading the text encoder's streamed layers from their file ahead of the copies
    (dit/page_reader.py) when they stream from the file's pages, from the moment the plan is made; 0 (the default):
    the kernel's read-ahead of the next layer alone (madvise)."""
    import os

    from ...errors import InputError

    text = (os.environ if environ is None else environ).get("H3_READ_THREADS", "").strip()
    if not text:
        return READ_THREADS_DEFAULT
    if not text.isdigit() or int(text) > READ_THREADS_MAX:
        raise InputError(f"H3_READ_THREADS must be a whole number from 0 to {READ_THREADS_MAX} (0: no reader "
                         f"threads), got {text!r}")
    return int(text)


def vram_budget(flag: str | None, default: str | None = "auto") -> int | str | None:
    """--vram-budget, else H3_VRAM_BUDGET, else `default`: bytes, "auto" or None; an error names the source."""
    import os

    from .memory import parse_budget

    if flag is not None:
        return parse_budget(flag, "--vram-budget")
    env = os.environ.get("H3_VRAM_BUDGET")
    if env is not None and env.strip():
        return parse_budget(env, "H3_VRAM_BUDGET")
    return parse_budget(default)


def check_depth(depth: int) -> int:
    from ...errors import InputError

    if depth < 1:
        raise InputError(f"--prefetch-depth must be at least 1, got {depth}")
    return depth


def file_in_the_way(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists but is not a folder (so `folder` cannot be made)."""
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)


def check_nodes(args) -> int:
    """The world size (--gpus x --nnodes), after checking the node flags."""
    from ...errors import InputError

    if args.nnodes < 1:
        raise InputError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise InputError(f"--node-rank must be 0..{args.nnodes - 1} with --nnodes {args.nnodes}, got {args.node_rank}")
    if args.nnodes == 1:
        if args.rdzv_endpoint is not None:
            raise InputError("--rdzv-endpoint joins hosts: it needs --nnodes 2 or more")
        return args.gpus
    endpoint = args.rdzv_endpoint
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free "
                         f"port), got {endpoint!r}")
    return args.gpus * args.nnodes
