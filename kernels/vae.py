"""The video VAE decoder's kernels: its attention backend and the fused Q/K norm + RoPE and SwiGLU passes.

The decoder only takes exact paths: an approximate H3_ATTENTION (fa3_fp8, Sage, INT8, sparse) is a DiT
choice, and the VAE then decodes with the exact backend `auto` picks; the report says so. The fused
passes follow the DiT's switches (H3_Q_RMS_ROPE_INT8_FUSION for Q/K, H3_MODULATION_FUSION for SwiGLU).
"""

from __future__ import annotations

import torch

from .attention import EXACT_BACKENDS, resolve_attention
from .capability import KernelUnavailable, as_device, describe_device, require_triton
from .settings import KernelSettings


def fused_decoder_qk_prep(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`video_vae.reference_qk_prep` in one Triton pass (cos/sin are the decoder's (1, S, 1, R) tables)."""
    from .qk_prep import norm_rope_heads

    return norm_rope_heads(x, None, eps, (cos[0, :, 0], sin[0, :, 0]))


def _fusion_on(mode: str, what: str, device) -> bool:
    if mode == "off":
        return False
    try:
        require_triton(what, device)
        return True
    except KernelUnavailable:
        if mode == "exact":
            raise
        return False


def apply_vae_kernels(vae, settings: KernelSettings | None = None) -> dict:
    """Set the decoder's attention backend and fused passes from `settings`; return what runs and why."""
    settings = settings or KernelSettings()
    device = as_device(vae.device)
    requested = settings.attention
    if requested in EXACT_BACKENDS or requested == "auto":
        backend, chosen = resolve_attention(requested, device, settings)
        why = getattr(backend, "auto_reason", None) or "requested"
    else:
        backend, chosen = resolve_attention("auto", device, settings)
        why = (f"{requested} is approximate and applies to the DiT only; the VAE decodes exactly with auto's "
               f"choice ({backend.auto_reason})")
    qk = _fusion_on(settings.q_rms_rope_int8_fusion, "the decoder's fused Q/K norm + RoPE", device)
    act = _fusion_on(settings.modulation_fusion, "the decoder's fused SwiGLU", device)
    from .swiglu import fused_swiglu

    vae.attention = backend
    for block in vae.decoder.transformer_blocks:
        block.attn.qk_prep = fused_decoder_qk_prep if qk else None
        block.ff.net[0].activation = fused_swiglu if act else None
    impl = {True: "triton", False: "pytorch-reference"}
    return {"device": describe_device(device), "attention": {"requested": requested, "chosen": chosen, "why": why},
            "qk_prep": impl[qk], "swiglu": impl[act], "exact": True}
