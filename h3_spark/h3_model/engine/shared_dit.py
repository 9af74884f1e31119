"""One loaded DiT that several callers share, each with its own LoRA set and attention backend.

ComfyUI caches a loader node's output, so many MODEL clones point at one DiT; each run asks for the LoRAs
and the attention of its own clone. `use_loras` merges exactly the asked set into the shared weights
(backing up and restoring only the parameters a LoRA touches), `use_kernels` converts the linears once and
chooses each run's attention and Q/K preparation (job_attention.py installs it for the run), and
`kernels_line` says what runs. The state lives on the DiT itself, so every clone sees the same truth.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import InputError

LORAS = "_h3_spark_loras"  # the merged set and the backed-up parameters
KERNELS = "_h3_spark_kernels"  # the attention in use and the latest kernel report
REPORTED = "_h3_spark_reported"  # the last kernel line logged


def use_loras(dit, loras: list) -> None:
    """Merge exactly `loras` into the DiT, restoring the weights a previous set changed.

    Several MODEL clones share one DiT (ComfyUI caches the loader's output), so the merged set is
    tracked on the DiT itself; only the parameters a LoRA touches are backed up (on the CPU).
    """
    from ..checkpoint.lora import LoraSpec, apply_loras, plan_lora, read_lora

    want = tuple((str(p), float(s)) for p, s in loras)
    state = dit.__dict__.setdefault(LORAS, {"applied": (), "backup": {}})
    if state["applied"] == want:
        return
    linear = dit.__dict__.get(KERNELS, {}).get("report", {}).get("linear", {})
    if not linear.get("exact", True):
        # The first run converted the linears in place; the bf16 weights a LoRA merges into are gone.
        raise InputError(
            f"this DiT's linears already run as {linear.get('format')} with "
            f"{_lora_names(state['applied'])}; another LoRA set ({_lora_names(want)}) needs its bf16 weights. "
            "Load the model again (e.g. change the H3 Model Loader's linear input) to run this set, or use "
            "linear bf16 to switch LoRAs on one loaded model")
    from .placement import Placement

    Placement.of(dit).unstream()  # a streamed block's weights are back in its module for the merge
    params = dict(dit.named_parameters())
    _restore(params, state)
    dit.head_bank = None  # a PDD LoRA's heads leave with it (apply_loras installs the new set's)
    if not want:
        return
    specs = [LoraSpec(Path(p), s) for p, s in want]
    names: set[str] = set()
    for spec in specs:
        tensors, metadata = read_lora(spec.path)
        ops, _ = plan_lora(dit, tensors, metadata, interleaved_qkv=any(".default." in k for k in tensors))
        names |= {op.param for op in ops}
        del ops, tensors
    from ..checkpoint.lora import dense_weights

    if dense_weights(dit, names):  # StoredLinears a LoRA touches hold values from now on
        params = dict(dit.named_parameters())
    state["backup"] = {n: params[n].detach().to("cpu", copy=True) for n in names if n in params}
    try:
        apply_loras(dit, specs, base={n: t.float() for n, t in state["backup"].items()})
    except Exception:
        _restore(params, state)
        raise
    state["applied"] = want


def _lora_names(loras: tuple) -> str:
    return ", ".join(f"{Path(p).name} at {s:g}" for p, s in loras) or "no LoRA"


@torch.no_grad()
def _restore(params: dict, state: dict) -> None:
    for name, saved in state["backup"].items():
        params[name].copy_(saved.to(params[name].device))
    state["applied"], state["backup"] = (), {}


def use_kernels(dit, attention: str, linear: str, device):
    """Linears once per loaded DiT (they are converted in place, with the first run's attention); then this run's
    attention, when it is another, resolved once for this run. Returns (the run's kernel report, the
    job_attention choice to run it with, or None for the configured one)."""
    from ...kernels.dispatch import exactness
    from ...kernels.settings import KernelSettings
    from .job_attention import choose_attention
    from .kernel_plan import apply_kernels

    settings = KernelSettings.from_env().replace(attention=attention, linear=linear)
    state = dit.__dict__.get(KERNELS)
    if state is None:
        # The format H3_LINEAR=auto hears comes with the loaded DiT. One waiting in host memory for a GPU
        # (ComfyUI loads it only when it samples) is converted block by block on that GPU.
        if torch.device(device).type == "cuda" and _in_host(dit):
            from .memory import configure_in_host

            report = configure_in_host(dit, settings, device)
        else:
            report = apply_kernels(dit, settings)
        dit.__dict__[KERNELS] = state = {"attention": attention, "report": report}
    if state["attention"] == attention:
        return state["report"], None
    choice = choose_attention(dit, attention, settings, device)
    report = {**state["report"], **choice.report}
    return {**report, **exactness(report)}, choice


def _in_host(dit) -> bool:
    return all(p.device.type == "cpu" for p in dit.transformer_blocks.parameters() if p.numel())


def kernels_line(dit, report: dict) -> str | None:
    """What `auto` and the loader's choices resolved to, as one line (with why auto refused each faster
    backend); None when it is the line said last (fail closed means saying it, once per change)."""
    attention, linear = report.get("attention", {}), report.get("linear", {})
    approx = report.get("approximate_paths") or []
    line = (f"attention {attention.get('chosen')} (asked {attention.get('requested')}), linear {linear.get('format')}, "
            + (f"approximate: {', '.join(approx)}" if approx else "exact"))
    refused = attention.get("refused_by_auto") or {}
    if refused:
        line += "; auto refused " + "; ".join(f"{name}: {why}" for name, why in refused.items())
    if dit.__dict__.get(REPORTED) == line:
        return None
    dit.__dict__[REPORTED] = line
    return line
