"""The CUDA caching allocator's segments in h3-spark's own processes: expandable, unless somebody chose.

Why: under a VRAM budget the engine frees and re-allocates gigabytes between stages whose buffers differ in size
(kept text layers given back before a long window samples, VAEs parked, a film's windows of different lengths).
With fixed segments the freed room stays reserved in pieces no larger than the tensors that held it: on an 80 GB
H100 a 15 s film's first window asked 876 MB for VSA and failed with 18.6 GB reserved but unallocated
(`receipts/h100/film-fasth3-15s-auto-5276138-oom.txt`). Expandable segments grow one mapped range per stream, so
freed room serves any later size.

`Engine.load` sets it when it loads onto a CUDA device and nobody chose: not when `PYTORCH_CUDA_ALLOC_CONF` (or
torch's newer `PYTORCH_ALLOC_CONF`) is set, which is also how ComfyUI chooses its allocator (its nodes build our
components without `Engine.load`). Setting it at run time affects the segments made from then on, so it holds
even when CUDA was initialized first.
"""

from __future__ import annotations

import os
from typing import Callable

SETTING = "expandable_segments:True"
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# What this process runs with, once the engine decided (None until then).
_chosen: dict | None = None


def _torch_setter() -> Callable[[str], None] | None:
    import torch

    # torch's own setter (torch.cuda.memory._set_allocator_settings forwards to it and warns that it is deprecated).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter if setter is not None and torch.cuda.is_available() else None


def choose_allocator(device: str, set_settings: Callable[[str], None] | None = None) -> dict:
    """Expandable segments for a CUDA `device` unless the environment chose; returns (and keeps for
    `chosen()`) what the process runs with and who decided. `set_settings` stands in for torch's setter in tests."""
    global _chosen
    if not str(device).startswith("cuda"):
        return {"segments": "not used", "by": f"the models run on {device}"}
    if _chosen is not None and _chosen.get("by") == "h3-spark":
        return _chosen
    env = next(((name, os.environ[name]) for name in ENV_NAMES if os.environ.get(name)), None)
    if env is not None:
        _chosen = {"segments": env[1], "by": f"the environment ({env[0]})"}
    else:
        setter = set_settings or _torch_setter()
        if setter is None:
            _chosen = {"segments": "fixed", "by": "this torch has no allocator setter"}
        else:
            setter(SETTING)
            _chosen = {"segments": SETTING, "by": "h3-spark",
                       "why": "room freed between stages serves later buffers of any size"}
    return _chosen


def chosen() -> dict | None:
    """What `choose_allocator` decided in this process (None when no engine loaded onto a CUDA device yet)."""
    return _chosen
