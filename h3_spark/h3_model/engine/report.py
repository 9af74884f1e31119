"""What an engine holds and can run, for reports: components, memory, kernels.

The service's `/ready` and the CLI's summaries read these (one job's attention: job_attention.py).
"""

from __future__ import annotations

import os

import torch

from ...errors import H3Error
from ...kernels.settings import KernelSettings
from .cuda_allocator import chosen as chosen_allocator
from .loading import LOADED


# ------------------------------------------------------------------------------------------ reporting
def describe_models(models) -> dict:
    """Per component: class, parameter dtype(s), device, parameter bytes."""
    out = {}
    c = models.components
    for name in LOADED:
        obj = getattr(c, name)
        if obj is None:
            continue
        module = getattr(obj, "model", obj) if name == "text_encoder" else obj
        params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        devices = sorted({str(p.device) for p in params})
        out[name] = {"class": type(module if name != "text_encoder" else obj).__name__, "dtypes": dtypes,
                     "devices": devices, "parameter_bytes": sum(p.numel() * p.element_size() for p in params)}
        note = getattr(getattr(obj, "checkpoint_origin", None), "note", None)
        if note:
            out[name]["note"] = note
        if getattr(getattr(module, "sequence_parallel", None), "world", 1) > 1:
            # Per rank: every rank holds a full copy of the weights.
            out[name]["sequence_parallel"] = models.world_size
        if name == "vae" and name in models.kernel_reports:
            out[name]["kernels"] = models.kernel_reports[name]
        elif name in models.kernel_reports:
            rep = models.kernel_reports[name]
            out[name]["attention"] = rep["attention"]
            out[name]["linear"] = rep["linear"]
            out[name]["exact"] = rep["exact"]
        streaming = models.memory_report(name) if name in ("dit", "dit_ref", "controlnet") else None
        if streaming is not None:
            out[name]["vram_budget"] = streaming  # parameter_bytes above counts the resident part only
    return out


def memory_report(device: str) -> dict:
    """GPU memory on CUDA; the process's resident set on the CPU (what the models occupy there)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(dev)
        return {"device": str(dev), "allocated_bytes": torch.cuda.memory_allocated(dev),
                "reserved_bytes": torch.cuda.memory_reserved(dev), "free_bytes": free, "total_bytes": total,
                "allocator": chosen_allocator()}
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"device": "cpu", "process_rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, IndexError):
        return {"device": "cpu"}


def supported_kernels(device: str, settings: KernelSettings, checkpoint_fmt: str = "bf16") -> dict:
    """Which attention backends and linear formats can run here, and why not for the others."""
    from ...kernels.attention import resolve_attention
    from ...kernels.dispatch import resolve_linear
    from ...kernels.settings import ATTENTION_BACKENDS, LINEAR_FORMATS

    attention, linear = {}, {}
    for name in ATTENTION_BACKENDS:
        try:
            _, chosen = resolve_attention(name, device, settings)
            attention[name] = {"supported": True, "runs": chosen}
        except H3Error as exc:
            attention[name] = {"supported": False, "why": str(exc)}
    for fmt in LINEAR_FORMATS:
        try:
            chosen, why = resolve_linear(settings.replace(linear=fmt), device, checkpoint_fmt)
            linear[fmt] = {"supported": True, "runs": chosen}
        except H3Error as exc:
            linear[fmt] = {"supported": False, "why": str(exc)}
    return {"attention": attention, "linear": linear}
