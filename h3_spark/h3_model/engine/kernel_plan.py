"""`apply_kernels`: install the kernels a plan chose on a loaded H3DiT, and report what really runs.

The kernels decide (kernels/dispatch.py: `plan_kernels`, every choice resolved and checked before anything
changes) and build (the FP8 / NVFP4 linears, the fused passes); here, above them, the DiT's modules are
changed: its attention and Q/K preparation, its modulation, its MLPs' activation, its block linears (and, for
H3_LINEAR=w4a8, every asym_w4a8_int8 layer); and
the video VAE decoder's attention and fused passes (`apply_vae_kernels`, from kernels/vae.py's plan).

Rules (docs/architecture.md, "Fail closed"): a requested backend or format that cannot run here raises
KernelUnavailable; `auto` may choose and says what it chose and why; approximate paths (FP8/NVFP4 linears,
low-bit or sparse attention) are opt-in. H3_LINEAR=auto is bf16 (exact) except on Blackwell with an NVFP4
checkpoint, where the checkpoint's own FP4 weights run natively.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.capability import triton_interpreting, triton_ready
from ...kernels.dispatch import KernelPlan, WeightSource, exactness, nvfp4_fusions, plan_kernels
from .block_linears import convert_linears
from ...kernels.settings import KernelSettings
from .job_attention import install_attention


def apply_kernels(model: nn.Module, settings: KernelSettings | None = None, *,
                  weight_source: WeightSource | None = None, checkpoint_format: str | None = None,
                  device: torch.device | str | None = None) -> dict:
    """Configure attention, Q/K preparation, modulation and linears of a loaded H3DiT; return the report.

    weight_source(name) may return a layer's stored quantized tensors ({"format": "nvfp4" | "fp8_scaled",
    "weight", "weight_scale", ["weight_scale_2"]}) so FP8/NVFP4 linears start from the checkpoint's codes
    rather than from the dequantized bf16 weight; a model loaded by `load_dit` from a quantized file gets
    its stored codes this way without one. checkpoint_format ("nvfp4" or "bf16") feeds H3_LINEAR=auto;
    by default it is the loaded file's. `device`: where the model will run, when its blocks wait in host
    memory (a VRAM budget: the model's `block_scope(i)` brings block i to the device while its linears are
    converted).
    """
    # Everything is resolved first: a failure leaves the model untouched.
    plan = plan_kernels(model, settings, checkpoint_format, device)
    report: dict = {"device": plan.device_name, "settings": plan.settings.to_dict()}
    install_attention(model, plan.attention, plan.qk_prep)
    model.modulation_cls = plan.modulation
    mod_report = {**plan.modulation_report, "swiglu": _install_activation(model, plan)}
    linear_report = {"format": plan.linear, "why": plan.linear_why, "exact": plan.linear == "bf16",
                     "weight_dtype": plan.weight_dtype}
    if plan.linear != "bf16":
        _install_linears(model, plan, weight_source, linear_report, mod_report)
    report["attention"] = plan.attention_report()
    report["qk_prep"] = plan.qk_report
    report["modulation"] = mod_report
    report["linear"] = linear_report
    report.update(exactness(report))
    report["triton_interpreter"] = triton_interpreting()
    report["capability"] = plan.capability
    return report


def _install_activation(model: nn.Module, plan: KernelPlan) -> str:
    """The fused SwiGLU travels with the fused modulation (auto on a Triton GPU, or exact): both are exact to
    bf16 rounding and both are Triton elementwise passes. Returns which runs."""
    from ...kernels.swiglu import fused_swiglu

    fused_act = fused_swiglu if plan.modulation_report.get("impl") == "triton" else None
    for blk in [*model.transformer_blocks, *model.token_refiner.refiner_blocks]:
        blk.ff.activation = fused_act
    return "triton" if fused_act is not None else "pytorch-reference"


def _install_linears(model: nn.Module, plan: KernelPlan, weight_source: WeightSource | None, linear_report: dict,
                     mod_report: dict) -> None:
    """The block linears as `plan.linear` modules (from the file's stored codes where it has them), and the
    producers that hand them quantized inputs."""
    fmt, settings = plan.linear, plan.settings
    use_triton = triton_ready(plan.device)
    if fmt == "w4a8":
        # A w4a8 layer carries its own codes; the file's other layers keep their path (no weight source).
        linear_report["sources"] = convert_linears(model, fmt, None, use_triton)
        linear_report["activation_quantizer"] = (
            "triton: the ConvRot rotation and per-token int8 in one pass (kernels/rotate_quantize.py)" if use_triton
            else "pytorch: per-token int8 after the ConvRot rotation (kernels/rotate_quantize.py's reference)")
        return
    origin = getattr(model, "checkpoint_origin", None)
    stored = None
    if weight_source is None and origin is not None:
        weight_source = stored = origin.stored_linears(model, fmt)
    try:
        linear_report["sources"] = convert_linears(model, fmt, weight_source, use_triton)
    finally:
        if stored is not None:
            stored.close()
    if stored is not None:
        linear_report["checkpoint_codes"] = stored.describe()
    linear_report["activation_quantizer"] = "triton" if use_triton else "pytorch-reference"
    swiglu_impl = mod_report["swiglu"]
    if fmt == "nvfp4":
        linear_report.update(nvfp4_fusions(settings, plan.modulation, plan.modulation_report))
        if linear_report["swiglu_nvfp4_fusion"]:
            from ...kernels.nvfp4 import Nvfp4SwiGLU

            for blk in model.transformer_blocks:
                blk.ff = Nvfp4SwiGLU.wrap(blk.ff)
            # The text refiner keeps its bf16 linears, hence the activation chosen before.
            mod_report.update(swiglu="nvfp4-fused", swiglu_text_refiner=swiglu_impl)
    if fmt == "fp8" and swiglu_impl == "triton":
        # Same values as letting each Fp8Linear quantize its input, in fewer passes: q, k and v share
        # one quantized input, and the SwiGLU kernel writes e4m3 rows itself.
        from ...kernels.linear_fp8 import Fp8RowModulation, Fp8SwiGLU

        model.modulation_cls = Fp8RowModulation
        for blk in model.transformer_blocks:
            blk.ff = Fp8SwiGLU.wrap(blk.ff)
        linear_report["activation_quantizer"] = "triton: one quantized input for q, k and v; SwiGLU writes e4m3 rows"


def apply_vae_kernels(vae, settings: KernelSettings | None = None, attention: str | None = None) -> dict:
    """Set the video VAE decoder's attention backend and fused passes (kernels/vae.py's plan); return what runs
    and why. `attention`: an exact backend for the decoder (benchmarks compare them); by default `auto`'s exact
    choice for its dtype, whatever H3_ATTENTION asks of the DiT."""
    from ...kernels.swiglu import fused_swiglu
    from ...kernels.capability import KernelUnavailable
    from ...kernels.vae import (fp8_converted, fp8_decoder_linears, fused_decoder_qk_prep, fused_residual_norm,
                                plan_vae_kernels)

    plan = plan_vae_kernels(vae, settings, attention)
    if plan.linear == "dense" and fp8_converted(vae.decoder):
        raise KernelUnavailable("the video VAE decoder's linears were already converted to FP8 (H3_VAE_LINEAR=fp8); "
                                "reload the VAE to decode with dense ones")
    vae.attention = plan.attention
    for block in vae.decoder.transformer_blocks:
        block.attn.qk_prep = fused_decoder_qk_prep if plan.fused_qk_prep else None
        block.ff.net[0].activation = fused_swiglu if plan.fused_swiglu else None
        block.residual_norm = fused_residual_norm if plan.fused_residual_norm else None
    report = plan.report()
    if plan.linear == "fp8":
        report["linear"]["sources"] = fp8_decoder_linears(vae.decoder, plan.fused_swiglu)
    return report
