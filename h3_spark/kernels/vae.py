"""The video VAE decoder's kernels: its attention backend, the fused Q/K norm + RoPE and SwiGLU passes, and its
block linears' format (`plan_vae_kernels` chooses them; the engine installs them: h3_model/engine/kernel_plan.py).

The decoder's attention takes exact paths only, so H3_ATTENTION (a DiT choice, often approximate) does not apply
to it: it decodes with `auto`'s choice for its dtype (the fastest exact backend with kernels for fp16 or fp32 heads
of its size), and the report says which. The
fused passes follow the DiT's switches (H3_Q_RMS_ROPE_INT8_FUSION for Q/K, H3_MODULATION_FUSION for SwiGLU and for
the residual step between sub-layers: the fp32 residual update and the next RMSNorm in one pass, where eager runs a
product, a sum, the norm and a cast, ~0.7 s of a 1344x768x124 decode on the H100 by its profile).
Its GEMMs are half a decode's time (perf-notes): H3_VAE_LINEAR=fp8 runs the 216 block linears as FP8 e4m3 GEMMs
(per-channel weights, per-token activations, `linear_fp8.Fp8Linear`; q, k and v share one quantized input and the
fused SwiGLU writes the down projection's), an approximate path opted into on its own (H3_LINEAR is the DiT's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import require_kernels, rnd_store, round_code, tl, triton  # noqa: F401  (used in the kernel)
from .attention import EXACT_BACKENDS, resolve_attention
from .capability import KernelUnavailable, as_device, describe_device, require_cuda, require_triton, triton_ready
from .qk_prep import norm_eps
from .settings import KernelSettings


def fused_decoder_qk_prep(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`video_vae.reference_qk_prep` in one Triton pass (cos/sin are the decoder's (1, S, 1, R) tables)."""
    from .qk_prep import prepare_heads

    return prepare_heads(x, None, eps, (cos[0, :, 0], sin[0, :, 0]))


# ------------------------------------------------------------------------ the residual step between sub-layers
if triton is not None:

    @triton.jit
    def _residual_norm_kernel(h_ptr, y_ptr, g_ptr, w_ptr, res_ptr, out_ptr, eps, D: tl.constexpr,
                              HAS_Y: tl.constexpr, HAS_NORM: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        # One whole row per program: h + y * gate in fp32 (launched without FMA contraction, so the product
        # rounds before the sum as eager's two ops do), written once; RMSNorm of it from the same registers,
        # rounded to the compute dtype.
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < D
        h = tl.load(h_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
        if HAS_Y:
            y = tl.load(y_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + c, mask=m, other=0.0).to(tl.float32)
            h = h + y * g
            tl.store(res_ptr + row * D + c, h, mask=m)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / D + eps)
            x = h * rstd * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * D + c, rnd_store(x, RND).to(out_ptr.dtype.element_ty), mask=m)


def fused_residual_norm(h: torch.Tensor, y: torch.Tensor | None, gate: torch.Tensor | None, norm, dtype: torch.dtype):
    """`video_blocks.residual_norm` in one Triton pass over whole rows: the residual read once and written once, the
    normed input written once in the compute dtype (eager: up to five passes)."""
    require_kernels("the decoder's fused residual + RMSNorm")
    if h.dtype != torch.float32 or h.ndim != 3:
        raise ValueError(f"the decoder's residual is fp32 (batch, tokens, width), got {h.dtype} {list(h.shape)}")
    if y is not None and y.shape != h.shape:
        raise ValueError(f"a sub-layer output {list(y.shape)} does not match the residual {list(h.shape)}")
    h = h.contiguous()
    d = h.shape[-1]
    res = torch.empty_like(h) if y is not None else h
    out = torch.empty(h.shape, device=h.device, dtype=dtype) if norm is not None else None
    if h.numel():
        _residual_norm_kernel[(h.numel() // d,)](
            h, h if y is None else y.contiguous(), h if gate is None else gate.contiguous(),
            h if norm is None else norm.weight, res, h if out is None else out,
            0.0 if norm is None else norm_eps(norm, torch.float32), D=d, HAS_Y=y is not None,
            HAS_NORM=norm is not None, RND=round_code(dtype), BLOCK=triton.next_power_of_2(d), num_warps=8,
            enable_fp_fusion=False)
    return res, out


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
    fused_residual_norm: bool = False
    linear: str = "dense"
    linear_why: str = "dense: the decode dtype's GEMMs (H3_VAE_LINEAR=fp8 opts into FP8)"

    def report(self) -> dict:
        impl = {True: "triton", False: "pytorch-reference"}
        return {"device": self.device_name, "attention": {"chosen": self.chosen, "why": self.why},
                "qk_prep": impl[self.fused_qk_prep], "swiglu": impl[self.fused_swiglu],
                "residual_norm": impl[self.fused_residual_norm],
                "linear": {"format": self.linear, "why": self.linear_why}, "exact": self.linear == "dense"}


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
    plan = VaePlan(describe_device(device), backend, chosen, why, qk, act, fused_residual_norm=act)
    if settings.vae_linear == "fp8":
        require_cuda("H3_VAE_LINEAR=fp8", device, minimum=(9, 0),
                     why="rowwise-scaled FP8 GEMMs (torch._scaled_mm) need Hopper or newer")
        if dtype != torch.float16:
            raise KernelUnavailable(f"H3_VAE_LINEAR=fp8 is for the fp16 decode; this VAE decodes in "
                                    f"{str(dtype).removeprefix('torch.')} (the exact path: set H3_VAE_LINEAR=dense, or "
                                    f"decode in float16)")
        plan.linear = "fp8"
        plan.linear_why = ("requested (approximate): the decoder blocks' linears as FP8 e4m3 weights with per-channel "
                           "scales x per-token FP8 activations, biases added in the GEMM")
    return plan


# The block linears a decoder block runs, by their module names (the int8_convrot file quantizes the same ones).
DECODER_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")


def fp8_converted(decoder) -> bool:
    """Whether the decoder's block linears are FP8 already (the conversion cannot be undone: the weights were
    rounded)."""
    from .linear_fp8 import Fp8Linear

    return any(isinstance(m, Fp8Linear) for m in decoder.transformer_blocks.modules())


def fp8_decoder_linears(decoder, fused_swiglu: bool, use_triton: bool = True) -> dict[str, int]:
    """Swap every decoder block's linears for Fp8Linear (from its dense weight; a stored int8 layer dequantized
    exactly first) in place: q, k and v take one quantized input, and with `fused_swiglu` the SwiGLU hands the down
    projection its FP8 rows. Idempotent (a block already converted is left as it is). Returns the layers by source."""
    from .linear_fp8 import Fp8Linear, quantize_activation, swiglu_quantize_fp8
    from .stored_linear import StoredLinear

    sources: dict[str, int] = {}
    for block in decoder.transformer_blocks:
        for name in DECODER_LINEARS:
            linear = block.get_submodule(name)
            if not isinstance(linear, Fp8Linear):
                stored = linear.label if isinstance(linear, StoredLinear) else None
                linear = Fp8Linear.from_linear(linear.to_linear() if stored else linear, use_triton)
                if stored:
                    linear.source = f"{stored} codes dequantized exactly, quantized per output channel"
                block.set_submodule(name, linear)
            sources[linear.source] = sources.get(linear.source, 0) + 1
        block.attn.quantize_input = lambda x, t=use_triton: quantize_activation(x, t)
        if fused_swiglu:
            block.ff.net[0].activation = swiglu_quantize_fp8
    return sources
