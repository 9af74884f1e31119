"""The kernel choices for a loaded H3DiT from one KernelSettings (`plan_kernels`, the `resolve_*` it is made
of), the low-bit linear that replaces a block linear (`make_linear`), and what the report says of them.

The engine installs a plan (h3_model/engine/kernel_plan.py: `apply_kernels`); front doors (CLI, bench,
serve, nodes) parse the settings once and print or store the returned report: every approximate path and
every `auto` decision is named there.

Rules (docs/architecture.md, "Fail closed"): a requested backend or format that cannot run here raises KernelUnavailable;
`auto` may choose and says what it chose and why; approximate paths (FP8/NVFP4 linears, low-bit or sparse
attention, W4A8 integer GEMMs) are opt-in. H3_LINEAR=auto is bf16 (exact) except on Blackwell with an NVFP4
checkpoint, where the checkpoint's own FP4 weights run natively; it never chooses w4a8 (its speed on Hopper is
unmeasured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .attention import backend_spec, resolve_attention
from .capability import (KernelUnavailable, as_device, capability, describe_device, is_blackwell, require_cuda,
                         require_module, require_triton, triton_interpreting, triton_ready)
from .references import RowModulation
from .settings import KernelSettings
from .stored_linear import StoredLinear

# What the block linears may be before H3_LINEAR converts them: loaded dense, or kept in the file's stored form.
LINEAR_TYPES = (nn.Linear, StoredLinear)

# The four GEMMs of every block, as the six modules that hold them (q, k, v are one GEMM's three slices).
BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
WeightSource = Callable[[str], "dict[str, torch.Tensor] | None"]


def model_device(model: nn.Module) -> torch.device:
    return model.transformer_blocks[0].attn.to_out[0].weight.device


def model_heads(model: nn.Module) -> dict:
    """The dtype and size of a loaded H3DiT's attention heads, as `resolve_attention` takes them."""
    out = model.transformer_blocks[0].attn.to_out[0]
    # An FP8/NVFP4 linear stores e4m3/uint8 weights but computes in (and returns) its out_dtype.
    return {"dtype": getattr(out, "out_dtype", out.weight.dtype), "head_dim": model.config.attention_head_dim}


def attention_counts(model: nn.Module) -> dict[str, int]:
    """The attention backend's call counters as they stand now (calls that fell back to another kernel,
    calls that quantized Q/K themselves): the report made at set-up shows them before any call."""
    backend = getattr(model, "attention", None)
    described = backend.describe() if hasattr(backend, "describe") else {}
    return {k: v for k, v in described.items() if "calls" in k and isinstance(v, int) and not isinstance(v, bool)}


# ------------------------------------------------------------------------------------------ Q/K preparation
def resolve_qk_prep(settings: KernelSettings, backend_name: str, device):
    """(hook or None, report) for the Q/K preparation that goes with an attention backend (its registered
    `qk_heads`: FP8 heads, heads rotated for its own quantizer, or plain ones)."""
    from .qk_prep import FusedQKPrep

    heads = backend_spec(backend_name).qk_heads
    mode = settings.q_rms_rope_int8_fusion
    if mode == "off":
        note = (f"reference norm + RoPE; {backend_name} quantizes Q/K per head itself (no smoothing, no rotation)"
                if heads == "fp8" else "reference norm + RoPE")
        return None, {"impl": "pytorch-reference", "exact": True, "note": note}
    if heads == "fp8":
        hook = FusedQKPrep("fp8", settings.qk_smooth_k, settings.qk_hadamard, settings.qk_granularity,
                           triton_ready(device))
    elif heads == "rotated":
        # Sage quantizes Q/K itself and smooths K itself; it does not rotate, so the rotation happens here.
        hook = FusedQKPrep(None, False, settings.qk_hadamard, "per_head", triton_ready(device))
    else:
        if not triton_ready(device):
            return None, {"impl": "pytorch-reference", "exact": True,
                          "note": f"auto: no Triton GPU kernel on {describe_device(device)}"}
        hook = FusedQKPrep(None, False, 0, "per_head", True)
    report = hook.describe()
    if not hook.use_triton:
        report["note"] = f"auto: Triton unavailable on {describe_device(device)}, same math in PyTorch"
    return hook, report


# ------------------------------------------------------------------------------------------ modulation
def resolve_modulation(settings: KernelSettings, device, nvfp4_linears: bool):
    mode = settings.modulation_fusion
    if mode == "off":
        return RowModulation, {"impl": "pytorch-reference", "exact": True}
    ready = triton_ready(device)
    if mode == "exact" and not ready:
        require_triton("H3_MODULATION_FUSION=exact", device)  # raises with the reason
    if not ready:
        return RowModulation, {"impl": "pytorch-reference", "exact": True,
                               "note": f"auto: no Triton GPU kernel on {describe_device(device)}"}
    if nvfp4_linears and settings.rms_adaln_nvfp4_fusion == "auto":
        from .nvfp4 import Nvfp4RowModulation

        return Nvfp4RowModulation, {"impl": "triton", "exact": False,
                                    "note": "RMSNorm + AdaLN written as NVFP4 for the q/k/v and fc1 GEMMs "
                                            "(H3_RMS_ADALN_NVFP4_FUSION); gated residual fused, exact"}
    from .modulation import FusedRowModulation

    return FusedRowModulation, {"impl": "triton", "exact": True,
                                "tolerance": "modulate and gated_add bit-identical; norm_modulate within 1 ulp"}


def nvfp4_fusions(settings: KernelSettings, mod_cls: type, mod_report: dict) -> dict:
    """With NVFP4 linears: whether each NVFP4 producer fusion runs, and why those that do not are off."""
    from .nvfp4 import Nvfp4RowModulation

    swiglu_on = settings.swiglu_nvfp4_fusion == "auto"
    rms_on = mod_cls is Nvfp4RowModulation
    off = {}
    if not swiglu_on:
        off["swiglu_nvfp4_fusion"] = "H3_SWIGLU_NVFP4_FUSION=off: fc2 quantizes the bf16 SwiGLU output itself"
    if not rms_on:
        off["rms_adaln_nvfp4_fusion"] = (f"{_rms_adaln_off_cause(settings, mod_report)}: q/k/v and fc1 quantize the "
                                         "bf16 norm output themselves")
    return {"swiglu_nvfp4_fusion": swiglu_on, "rms_adaln_nvfp4_fusion": rms_on, "nvfp4_fusions_off": off}


def _rms_adaln_off_cause(settings: KernelSettings, mod_report: dict) -> str:
    if settings.rms_adaln_nvfp4_fusion == "off":
        return "H3_RMS_ADALN_NVFP4_FUSION=off"
    if settings.modulation_fusion == "off":
        return ("H3_MODULATION_FUSION=off, and this fusion is a form of the fused modulation "
                "(H3_MODULATION_FUSION=auto turns it on)")
    return mod_report.get("note", "the fused modulation does not run")


# ------------------------------------------------------------------------------------------ linears
def resolve_linear(settings: KernelSettings, device, checkpoint_format: str) -> tuple[str, str]:
    """(format, why) for H3_LINEAR; raises when the requested format cannot run here."""
    fmt = settings.linear
    if fmt == "auto":
        if checkpoint_format == "nvfp4" and is_blackwell(device):
            try:
                _require_nvfp4(device)
                return "nvfp4", ("auto: Blackwell GPU and an NVFP4 checkpoint run FP4 x FP4 GEMMs (the report's "
                                 "sources say which layers kept their stored codes)")
            except KernelUnavailable as exc:
                return "bf16", f"auto: NVFP4 GEMM unavailable ({exc}); exact bf16"
        return "bf16", "auto: exact bf16 (FP8, NVFP4 and W4A8 linears are opt-in via H3_LINEAR)"
    if fmt == "fp8":
        require_cuda("H3_LINEAR=fp8", device, minimum=(9, 0),
                     why="rowwise-scaled FP8 GEMMs (torch._scaled_mm) need Hopper or newer")
        return "fp8", ("requested: FP8 e4m3 weights (per-channel scales, or a file's stored per-tensor ones) x "
                       "per-token FP8 activations")
    if fmt == "nvfp4":
        _require_nvfp4(device)
        return "nvfp4", "requested: NVFP4 weights x NVFP4 activations (comfy-kitchen scaled_mm_nvfp4)"
    if fmt == "w4a8":
        _require_int_mm(device)
        return "w4a8", ("requested: a w4a8 file's layers as their int8 grid x per-token int8 activations "
                        "(torch._int_mm); layers of other formats keep their own path")
    return "bf16", "requested: exact, model dtype"


def _require_int_mm(device) -> None:
    """torch's int8 GEMM runs on this device: asked with one tiny call, so a device it cannot serve is refused when
    the kernels are set up rather than at the first forward."""
    device = as_device(device)
    if device.type not in ("cpu", "cuda"):
        raise KernelUnavailable(f"H3_LINEAR=w4a8 needs the CPU or a CUDA GPU (torch._int_mm); this run is on "
                                f"{describe_device(device)}")
    try:
        # cuBLASLt's int8 GEMM takes more than 16 rows and dims that are multiples of 8.
        torch._int_mm(torch.ones(32, 32, dtype=torch.int8, device=device),
                      torch.ones(32, 32, dtype=torch.int8, device=device))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KernelUnavailable(f"H3_LINEAR=w4a8: torch._int_mm does not run on {describe_device(device)} "
                                f"({first})") from None


def _require_nvfp4(device) -> None:
    require_cuda("H3_LINEAR=nvfp4", device, minimum=(10, 0),
                 why="FP4 tensor cores (comfy-kitchen scaled_mm_nvfp4 uses cuBLASLt block-scaled FP4); on Hopper "
                     "use H3_LINEAR=fp8 or bf16, NVFP4 checkpoints are converted at load")
    ck = require_module("H3_LINEAR=nvfp4", "comfy_kitchen", "install it with `pip install comfy-kitchen`")
    if not hasattr(ck, "scaled_mm_nvfp4"):
        raise KernelUnavailable("H3_LINEAR=nvfp4: the installed comfy-kitchen has no scaled_mm_nvfp4; upgrade it")
    require_triton("the NVFP4 activation quantizer", device)


def make_linear(fmt: str, linear: nn.Module, stored: dict | None, use_triton: bool) -> nn.Module:
    """The `fmt` ("fp8" / "nvfp4" / "w4a8") module that replaces block linear `linear`: from `stored` codes where
    given (or its own, where its format declares them for `fmt`), else from its weight. "w4a8" replaces only an
    asym_w4a8_int8 layer kept as stored and returns any other linear as it is (its own path)."""
    from .linear_fp8 import Fp8Linear
    from .nvfp4 import Nvfp4Linear

    if not isinstance(linear, LINEAR_TYPES):
        raise KernelUnavailable(f"the block linears were already converted ({type(linear).__name__}); reload the "
                                f"model to change H3_LINEAR")
    if fmt == "w4a8":
        if is_w4a8(linear):
            from .linear_w4a8 import W4A8Linear

            return W4A8Linear.from_stored(linear, use_triton)
        return linear
    if isinstance(linear, StoredLinear):
        # Its own codes where its format declares that `fmt` linears start from them; else its exact dequantized
        # weight (an fp8_scaled layer's codes are no NVFP4 values).
        stored = linear.stored_tensors(fmt)
        dtype, shape = linear.out_dtype, linear.shape
        if stored is None:
            linear = linear.to_linear()
    else:
        dtype, shape = linear.weight.dtype, tuple(linear.weight.shape)
    kind = (stored or {}).get("format")
    if fmt == "fp8":
        if kind == "nvfp4":
            return Fp8Linear.from_nvfp4(stored["weight"], stored["weight_scale"], stored["weight_scale_2"], shape,
                                        dtype, use_triton)
        if kind == "fp8_scaled":
            return Fp8Linear.from_fp8_scaled(stored["weight"], stored["weight_scale"], dtype, use_triton)
        return Fp8Linear.from_linear(linear, use_triton)
    if kind == "nvfp4":
        return Nvfp4Linear.from_nvfp4(stored["weight"], stored["weight_scale"], stored["weight_scale_2"], shape,
                                      dtype)
    return Nvfp4Linear.from_linear(linear)


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The block linears by their model names (transformer_blocks.{i}.attn.to_q, ...)."""
    return {f"transformer_blocks.{i}.{name}": blk.get_submodule(name)
            for i, blk in enumerate(model.transformer_blocks) for name in BLOCK_LINEARS}


def is_w4a8(module: nn.Module) -> bool:
    """An asym_w4a8_int8 layer kept as the file stores it: what H3_LINEAR=w4a8 runs as an integer GEMM."""
    from .formats.asym_w4a8_int8 import NAME

    return isinstance(module, StoredLinear) and module.format == NAME


def linear_path(module: nn.Module) -> str:
    """How a linear computes, in the words the report counts layers by (`source`; a dense layer its dtype)."""
    source = getattr(module, "source", None)
    return source if isinstance(source, str) else f"{str(module.weight.dtype).removeprefix('torch.')} dense weights"


def w4a8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The DiT's asym_w4a8_int8 layers kept as stored, by their model names (blocks and any other layer)."""
    return {name: m for name, m in model.named_modules() if is_w4a8(m)}


def check_w4a8_linears(model: nn.Module, device) -> None:
    """Refuse, before anything changes, a model H3_LINEAR=w4a8 cannot run: no asym_w4a8_int8 layer kept as stored,
    one of the asymmetric variant (its per-group correction has no place in an integer GEMM), or one whose output
    features cuBLASLt's int8 GEMM does not take."""
    from .formats.asym_w4a8_int8 import variant

    converted = [n for n, m in block_linears(model).items() if not isinstance(m, LINEAR_TYPES)]
    if converted:
        kind = type(model.get_submodule(converted[0])).__name__
        raise KernelUnavailable(f"the block linears were already converted ({kind}); reload the model to apply "
                                "H3_LINEAR again")
    layers = w4a8_layers(model)
    if not layers:
        paths = sorted({linear_path(m) for m in block_linears(model).values()})
        raise KernelUnavailable("H3_LINEAR=w4a8 runs a w4a8 (asym_w4a8_int8) checkpoint's layers kept as stored, and "
                                f"this DiT has none (its block linears: {'; '.join(paths)}); load a w4a8 file with "
                                "its stored weights, or use H3_LINEAR=bf16")
    for name, m in layers.items():
        if variant(m._held()) == "asymmetric":
            raise KernelUnavailable(f"H3_LINEAR=w4a8: {name} is an asymmetric w4a8 layer, whose correction per group "
                                    "after the channel scale the integer GEMM cannot carry; use H3_LINEAR=bf16")
        if as_device(device).type == "cuda" and m.out_features % 8:
            raise KernelUnavailable(f"H3_LINEAR=w4a8: {name} has {m.out_features} output features; cuBLASLt's int8 "
                                    "GEMM needs a multiple of 8")


def check_linears(model: nn.Module, fmt: str) -> None:
    """Refuse, before anything changes, a model whose block linears `fmt` cannot replace: already converted
    (the bf16 weights are gone), a bias, or GEMM dims the low-bit kernels do not take. (w4a8 is
    `check_w4a8_linears`, which needs the device.)"""
    found = block_linears(model)
    if fmt == "bf16":
        converted = [n for n, m in found.items() if not isinstance(m, LINEAR_TYPES)]
        if converted:
            kind = type(found[converted[0]]).__name__
            raise KernelUnavailable(f"the block linears already run as {kind}; reload the model for exact bf16 "
                                    "linears")
        return
    n_div, k_div = (16, 16) if fmt == "fp8" else (16, 32)
    for name, m in found.items():
        if not isinstance(m, LINEAR_TYPES):
            raise KernelUnavailable(f"the block linears were already converted ({type(m).__name__}); reload the "
                                    "model to apply H3_LINEAR again")
        n, k = m.shape if isinstance(m, StoredLinear) else m.weight.shape
        if m.bias is not None or n % n_div or k % k_div:
            raise KernelUnavailable(f"H3_LINEAR={fmt} needs bias-free block linears with out features divisible "
                                    f"by {n_div} and in features by {k_div}; {name} is {n}x{k}"
                                    + (" with a bias" if m.bias is not None else ""))


def exactness(report: dict, also: list[str] | tuple[str, ...] = ()) -> dict:
    """A kernel report's "approximate_paths" (those of attention, Q/K preparation, modulation and linears
    that are not exact, then `also`: a run's own approximations) and "exact"."""
    approximate = [k for k in ("attention", "qk_prep", "modulation", "linear")
                   if not report.get(k, {}).get("exact", True)] + list(also)
    return {"approximate_paths": approximate, "exact": not approximate}


# ------------------------------------------------------------------------------------------ the plan
@dataclass
class KernelPlan:
    """Every kernel choice for one loaded H3DiT, resolved and checked before anything of the model changes
    (h3_model/engine/kernel_plan.py installs it)."""

    device: torch.device
    device_name: str  # describe_device's, and the GPU's compute capability (None: no CUDA GPU), for the report
    capability: tuple[int, int] | None
    settings: KernelSettings
    checkpoint_format: str
    attention: object
    chosen: str
    qk_prep: object
    qk_report: dict
    modulation: type
    modulation_report: dict
    linear: str
    linear_why: str
    weight_dtype: str

    def attention_report(self) -> dict:
        return {"requested": self.settings.attention, "chosen": self.chosen, **self.attention.describe()}


def plan_kernels(model: nn.Module, settings: KernelSettings | None = None, checkpoint_format: str | None = None,
                 device: torch.device | str | None = None) -> KernelPlan:
    """Resolve attention, Q/K preparation, modulation and linears for `model` on `device` (default: where its
    blocks are); KernelUnavailable, before anything changes, when one cannot run. checkpoint_format ("nvfp4" or
    "bf16") feeds H3_LINEAR=auto; by default it is the loaded file's."""
    settings = settings or KernelSettings()
    origin = getattr(model, "checkpoint_origin", None)
    if checkpoint_format is None:
        checkpoint_format = origin.linear_format if origin is not None else "bf16"
    device = as_device(device if device is not None else model_device(model))
    heads = model_heads(model)
    backend, chosen = resolve_attention(settings.attention, device, settings, **heads)
    inner = getattr(backend, "inner", backend)
    linear_fmt, linear_why = resolve_linear(settings, device, checkpoint_format)
    if linear_fmt == "w4a8":
        check_w4a8_linears(model, device)
    else:
        check_linears(model, linear_fmt)
    qk_hook, qk_report = resolve_qk_prep(settings, inner.name, device)
    mod_cls, mod_report = resolve_modulation(settings, device, linear_fmt == "nvfp4")
    return KernelPlan(device, describe_device(device), capability(device), settings, checkpoint_format, backend, chosen, qk_hook, qk_report, mod_cls, mod_report,
                      linear_fmt, linear_why, str(heads["dtype"]))
