"""One job's attention: chosen once, installed on the DiT for the job, the previous one put back after.

The one per-job switch under every front door that runs a job on another attention backend than the DiT
was configured with: the service (a request's `attention`), the ComfyUI nodes (a MODEL clone's). The
backend goes with its Q/K preparation (a low-bit backend may take pre-quantized Q/K that another backend
cannot read), so both are switched and both put back, even when the job fails; the weights are untouched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass
class AttentionChoice:
    """A backend resolved for one DiT's heads, its Q/K preparation, and what the job's report says of them."""

    requested: str
    backend: object
    qk_prep: object
    report: dict  # {"attention": {...}, "qk_prep": {...}}, as apply_kernels reports them


def choose_attention(dit, name: str, settings, device) -> AttentionChoice:
    """Resolve `name` for `dit`'s heads on `device`, with the Q/K preparation its registry entry takes; raises
    KernelUnavailable (naming what is missing) when it cannot run them."""
    from ...kernels.attention import resolve_attention
    from ...kernels.dispatch import model_heads, resolve_qk_prep

    backend, chosen = resolve_attention(name, device, settings, **model_heads(dit))
    qk_prep, qk_report = resolve_qk_prep(settings, getattr(backend, "inner", backend).name, device)
    report = {"attention": {"requested": name, "chosen": chosen, **backend.describe()}, "qk_prep": qk_report}
    return AttentionChoice(name, backend, qk_prep, report)


def install_attention(dit, backend, qk_prep) -> None:
    """Make `dit` run `backend` with `qk_prep` from its next forward on."""
    dit.set_attention(backend)
    dit.qk_prep = qk_prep


@contextlib.contextmanager
def running(dit, choice: AttentionChoice | None, after: tuple | None = None) -> Iterator[None]:
    """`dit` runs `choice` inside the block, then `after` ((backend, Q/K preparation); by default what it ran
    before); None: nothing changes."""
    if choice is None:
        yield
        return
    after = after if after is not None else (dit.attention, dit.qk_prep)
    install_attention(dit, choice.backend, choice.qk_prep)
    try:
        yield
    finally:
        install_attention(dit, *after)
