"""Where and with what a result was measured: GPU, driver, clocks, power limit, versions, commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

GPU_QUERY = ("name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,power.draw,"
             "temperature.gpu,memory.total")


def gpu_state() -> dict | None:
    """One nvidia-smi reading (read-only; the card's settings are never changed)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    fields = GPU_QUERY.split(",")
    return {f: v.strip() for f, v in zip(fields, out[0].split(","))} if out else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    if os.environ.get("H3_GIT_COMMIT"):
        return os.environ["H3_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def software() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _version("triton"),
        "comfy_kitchen": _version("comfy-kitchen"),
        "diffusers": _version("diffusers"),
        "h3_spark_commit": git_commit(),
    }
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        info["device"] = torch.cuda.get_device_name()
        info["sm"] = f"{cap[0]}{cap[1]}"
    return info


def stamp_before() -> dict:
    return {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu_before": gpu_state(),
            "software": software(), "host": platform.node()}


def stamp_after(stamp: dict) -> dict:
    stamp["gpu_after"] = gpu_state()
    return stamp
