"""The video VAE decoder's kernels: its attention backend and the fused Q/K norm + RoPE and SwiGLU passes
(`plan_vae_kernels` chooses them; the engine installs them: h3_model/engine/kernel_plan.py).

The decoder only takes exact paths, so H3_ATTENTION (a DiT choice, often approximate) does not apply to it:
it decodes with `auto`'s choice for its dtype (the fastest exact backend with kernels for fp16 or fp32 heads
of its size), and the report says which. The
fused passes follow the DiT's switches (H3_Q_RMS_ROPE_INT8_FUSION for Q/K, H3_MODULATION_FUSION for SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import EXACT_BACKENDS, resolve_attention
from .capability import KernelUnavailable, as_device, describe_device, require_triton, triton_ready
from .settings import KernelSettings


def fused_decoder_qk_prep(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`video_vae.reference_qk_prep` in one Triton pass (cos/sin are the decoder's (1, S, 1, R) tables)."""
    from .qk_prep import prepare_heads

    return prepare_heads(x, None, eps, (cos[0, :, 0], sin[0, :, 0]))


def _fusion_on(mode: str, what: str, device) -> bool:
    """auto: where Triton runs; exact: there or an error; off: never (as the DiT's switches)."""
    if mode == "exact":
        require_triton(what, device)
    return mode != "off" and triton_ready(device)


@dataclass
class VaePlan:
    """The decoder's kernels, resolved and checked (h3_model/engine/kernel_plan.py installs them)."""

    device_name: str
    attention: object
    chosen: str
    why: str
    fused_qk_prep: bool
    fused_swiglu: bool

    def report(self) -> dict:
        impl = {True: "triton", False: "pytorch-reference"}
        return {"device": self.device_name, "attention": {"chosen": self.chosen, "why": self.why},
                "qk_prep": impl[self.fused_qk_prep], "swiglu": impl[self.fused_swiglu], "exact": True}


def plan_vae_kernels(vae, settings: KernelSettings | None = None, attention: str | None = None) -> VaePlan:
    """The decoder's attention backend and fused passes, and why.

    `attention` names an exact backend for the decoder (benchmarks compare them); by default the decoder
    takes `auto`'s exact choice for its dtype, whatever H3_ATTENTION asks of the DiT.
    """
    settings = settings or KernelSettings()
    device = as_device(vae.device)
    dtype = vae.decode_dtype
    head_dim = vae.config.decoder_attention_head_dim
    if attention is not None:
        if attention not in EXACT_BACKENDS:
            raise KernelUnavailable(f"the VAE decoder takes exact attention only ({', '.join(EXACT_BACKENDS)}), "
                                    f"not {attention!r}")
        backend, chosen = resolve_attention(attention, device, settings, dtype=dtype, head_dim=head_dim)
        why = "requested"
    else:
        backend, chosen = resolve_attention("auto", device, settings, dtype=dtype, head_dim=head_dim)
        why = backend.auto_reason
    qk = _fusion_on(settings.q_rms_rope_int8_fusion, "the decoder's fused Q/K norm + RoPE", device)
    act = _fusion_on(settings.modulation_fusion, "the decoder's fused SwiGLU", device)
    return VaePlan(describe_device(device), backend, chosen, why, qk, act)
