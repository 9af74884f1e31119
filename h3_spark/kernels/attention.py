"""Attention backends. Each takes q, k, v as (batch, seq, heads, head_dim) and returns the same shape.

`sdpa` is the plain-PyTorch reference every other backend is compared against; `math_reference` is the
fp32 formula the tests use. `resolve_attention(name, device, settings)` turns an H3_ATTENTION name into
a callable and the name of what will really run (`auto` picks the fastest exact backend here). A
backend that cannot run raises KernelUnavailable (an H3Error) at resolve time, naming what is missing
and how to get it; nothing falls back silently.

Backends (H200 figures at H3's S = 20,480; docs/perf-notes.md has the measurements):
- sdpa: PyTorch's default SDPA dispatch (exact).
- cudnn_sdpa: SDPA forced onto cuDNN attention, no fallback (exact; 19.2-19.7 ms at H3's S = 20,480).
- fa3: FlashAttention-3 forward, Hopper only (exact; 17.2 ms). Package `fa3-fwd` (module
  `fa3_fwd_interface`) or an upstream flash-attention/hopper build (module `flash_attn_interface`).
- fa3_fp8: FlashAttention-3 with FP8 e4m3 Q/K/V and per-(batch, head) descales (approximate; 13.1 ms).
  Takes `QuantizedHeads` from the fused Q/K preparation (qk_prep.py) or quantizes bf16 Q/K itself.
- sage2 / sage2-quality: SageAttention >= 2 (approximate): `sageattn` (INT8 QK, FP8 PV with FP32
  accumulation on sm_90) / `sageattn_qk_int8_pv_fp16_cuda` with per-thread INT8 QK and FP16 PV, FP32
  accumulation (its most accurate kernel).
- ck_int8: comfy-kitchen `int8_attention` (INT8 Q/K/V with its own Hadamard; approximate).
- sol_attn: comfy-kitchen Sol-Attn sparse attention (approximate), H3_SOL_* settings.
- kj_head_sliced: another backend run over slices of heads, which bounds the memory of backends that
  materialise per-head scores.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from .capability import (HOPPER, KernelUnavailable, as_device, capability, describe_device, package_version,
                         require_cuda, require_module, version_tuple)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Backends whose output is the exact attention (up to the kernel's own bf16/fp32 rounding).
EXACT_BACKENDS = ("sdpa", "cudnn_sdpa", "fa3")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full bidirectional attention, no mask, PyTorch's default SDPA dispatch."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def math_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in fp32, for tests."""
    scale = q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)


def cudnn_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA restricted to the cuDNN kernel: PyTorch raises rather than switching kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        try:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        except RuntimeError as exc:
            if "No available kernel" not in str(exc):
                raise
            raise KernelUnavailable(
                f"cudnn_sdpa cannot run q {list(q.shape)} {q.dtype} on {describe_device(q.device)}: cuDNN "
                f"attention takes fp16/bf16 CUDA tensors (head_dim <= 128 on most GPUs); run the model in bf16 "
                f"or choose H3_ATTENTION=sdpa") from exc
    return out.transpose(1, 2)


# Backends that are plain functions and need no resolution (kept under this historical name).
BACKENDS: dict[str, AttentionFn] = {"sdpa": sdpa, "cudnn_sdpa": cudnn_sdpa}


class Backend:
    """A resolved attention backend: callable, with a name and what it reports."""

    name = "?"
    exact = False

    def __call__(self, q, k, v):  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def describe(self) -> dict:
        d = {"backend": self.name, "exact": self.exact}
        if getattr(self, "auto_reason", None):
            d["chosen_by_auto"] = self.auto_reason
        return d


class FunctionBackend(Backend):
    def __init__(self, name: str, fn: AttentionFn, exact: bool, note: str = ""):
        self.name, self.fn, self.exact, self.note = name, fn, exact, note

    def __call__(self, q, k, v):
        return self.fn(q, k, v)

    def describe(self) -> dict:
        d = super().describe()
        if self.note:
            d["note"] = self.note
        return d


# ------------------------------------------------------------------------------------------ FlashAttention-3
FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")
FA3_HOW = ("install the forward-only wheel with `pip install fa3-fwd` (cp39-abi3 manylinux x86_64/aarch64, "
           "built for torch 2.10+), or build flash-attention's hopper/ folder (module flash_attn_interface)")


class FA3ImportFailed(KernelUnavailable):
    """FlashAttention-3 is installed but its module raises on import (e.g. a build for another torch or CUDA)."""


def fa3_module():
    """The importable FlashAttention-3 interface module, or KernelUnavailable (FA3ImportFailed when a module
    is there but does not import: that needs a rebuild, not an install)."""
    missing, broken = [], []
    for name in FA3_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only the module itself being absent means "not installed"; a missing dependency is a broken install.
            if exc.name == name:
                missing.append(f"{name}: {exc}")
            else:
                broken.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a compiled extension for another torch/CUDA fails in many ways
            broken.append(f"{name}: {type(exc).__name__}: {exc}")
    if broken:
        raise FA3ImportFailed(f"FlashAttention-3 is installed but failed to import ({'; '.join(broken)}); reinstall "
                              f"or rebuild it for this torch and CUDA ({FA3_HOW})")
    raise KernelUnavailable(f"FlashAttention-3 is not installed ({'; '.join(missing)}); {FA3_HOW}")


# (FA3 module, dtype, head size, device) -> whether that build has the kernel (FA3Backend.supports).
_FA3_SUPPORT: dict[tuple, bool] = {}


def _fa3_out(result):
    # Some FA3 builds return (out, softmax_lse); the forward-only wheel returns out.
    return result[0] if isinstance(result, tuple) else result


class FA3Backend(Backend):
    name = "fa3"
    exact = True

    def __init__(self, module):
        self.module = module
        self.fn = module.flash_attn_func

    def __call__(self, q, k, v):
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise KernelUnavailable(f"fa3 takes bf16 (or fp16) q/k/v, got {q.dtype}; run the model in bf16")
        try:
            return _fa3_out(self.fn(q, k, v, causal=False))
        except RuntimeError as exc:
            if "does not support" not in str(exc):
                raise
            raise KernelUnavailable(f"this FlashAttention-3 build ({self.module.__name__}) cannot run {q.dtype} "
                                    f"heads of size {q.shape[-1]}: {exc}") from exc

    def supports(self, dtype: torch.dtype, head_dim: int, device) -> bool:
        """Whether this build has kernels for `dtype` and `head_dim` (wheels ship subsets), by one tiny call
        per build, dtype, head size and device for the life of the process."""
        key = (self.module, dtype, head_dim, str(as_device(device)))
        if key not in _FA3_SUPPORT:
            x = torch.randn(1, 128, 1, head_dim, device=device).to(dtype)
            try:
                self(x, x, x)
                _FA3_SUPPORT[key] = True
            except KernelUnavailable:
                _FA3_SUPPORT[key] = False
        return _FA3_SUPPORT[key]

    def describe(self) -> dict:
        return {**super().describe(), "module": self.module.__name__}


class FA3FP8Backend(Backend):
    """FP8 e4m3 FlashAttention-3 with one descale per (batch, head) for each of Q, K and V."""

    name = "fa3_fp8"
    exact = False

    def __init__(self, module, use_triton: bool):
        self.module = module
        self.fn = module.flash_attn_func
        self.use_triton = use_triton
        self.prequantized_calls = 0
        self.quantized_here_calls = 0

    def _quantize(self, x, norm=False):
        from .qk_prep import QuantizedHeads, prepare_heads, reference_prepare_heads

        if isinstance(x, QuantizedHeads):
            if x.dtype != torch.float8_e4m3fn or x.block:
                raise KernelUnavailable("fa3_fp8 takes float8_e4m3fn heads with one scale per (batch, head); "
                                        "set H3_QK_GRANULARITY=per_head or per_head_bound")
            return x
        fn = prepare_heads if self.use_triton else reference_prepare_heads
        return fn(x, None, 0.0, None, norm=False, fmt="fp8", granularity="per_head")

    def __call__(self, q, k, v):
        from .qk_prep import QuantizedHeads

        if isinstance(q, QuantizedHeads) and isinstance(k, QuantizedHeads):
            self.prequantized_calls += 1
        else:
            self.quantized_here_calls += 1
        out_dtype = v.dtype
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise KernelUnavailable(f"fa3_fp8 runs bf16 models; v is {out_dtype}")
        q8, k8, v8 = self._quantize(q), self._quantize(k), self._quantize(v)
        out = _fa3_out(self.fn(q8.data, k8.data, v8.data, causal=False, q_descale=q8.scale.contiguous(),
                               k_descale=k8.scale.contiguous(), v_descale=v8.scale.contiguous()))
        return out.to(out_dtype)

    def describe(self) -> dict:
        return {**super().describe(), "module": self.module.__name__,
                "quantizer": "triton" if self.use_triton else "pytorch-reference",
                "calls_with_prequantized_qk": self.prequantized_calls,
                "calls_quantizing_qk_here": self.quantized_here_calls}


# ------------------------------------------------------------------------------------------ SageAttention 2
SAGE_HOW = ("SageAttention 2 is not on PyPI (the latest there is 1.0.6, a Triton-only version 1); build it "
            "from github.com/thu-ml/SageAttention on a machine with nvcc (`pip install --no-build-isolation .`)")


class SageBackend(Backend):
    exact = False

    def __init__(self, name: str, module, version: str):
        self.name, self.module, self.version = name, module, version
        if name == "sage2":
            self.fn = lambda q, k, v: module.sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
        else:
            self.fn = lambda q, k, v: module.sageattn_qk_int8_pv_fp16_cuda(
                q, k, v, tensor_layout="NHD", is_causal=False, qk_quant_gran="per_thread", pv_accum_dtype="fp32")

    def __call__(self, q, k, v):
        return self.fn(q, k, v)

    def describe(self) -> dict:
        return {**super().describe(), "sageattention": self.version}


def _resolve_sage(name: str, device) -> Backend:
    cap = require_cuda(name, device, minimum=(8, 0), why="SageAttention's CUDA kernels")
    module = require_module(name, "sageattention", SAGE_HOW)
    version = package_version("sageattention") or getattr(module, "__version__", None)
    if version is None or version_tuple(version) < (2,):
        raise KernelUnavailable(f"{name} needs sageattention >= 2, found {version or 'an unknown version'}; "
                                f"{SAGE_HOW}")
    core = getattr(module, "core", None)
    needed = ("SM90_ENABLED" if cap == HOPPER else "SM89_ENABLED" if cap == (8, 9) else "SM80_ENABLED") \
        if name == "sage2" else "SM80_ENABLED"
    if core is not None and getattr(core, needed, True) is False:
        raise KernelUnavailable(f"{name}: the installed sageattention {version} was built without the "
                                f"{needed[:4].lower()} kernels this GPU ({describe_device(device)}) needs; "
                                f"rebuild it on this machine")
    return SageBackend(name, module, version)


# ------------------------------------------------------------------------------------------ comfy-kitchen
CK_HOW = "install it with `pip install comfy-kitchen` (the CUDA extension ships in the Linux/Windows wheels)"


class CKInt8Backend(Backend):
    name = "ck_int8"
    exact = False

    def __init__(self, ck):
        self.ck = ck

    def __call__(self, q, k, v):
        out = self.ck.int8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    def describe(self) -> dict:
        return {**super().describe(), "comfy_kitchen": package_version("comfy-kitchen")}


class SolBackend(Backend):
    """comfy-kitchen Sol-Attn; sequences below H3_SOL_MIN_TOKENS run on H3_SOL_FALLBACK (counted)."""

    name = "sol_attn"
    exact = False

    def __init__(self, ck, sol, fallback: Backend, extra: dict):
        self.ck, self.sol, self.fallback, self.extra = ck, sol, fallback, extra
        self.sparse_calls = 0
        self.short_calls = 0
        self.unsupported_calls = 0

    def __call__(self, q, k, v):
        s = q.shape[1]
        if s < self.sol.min_tokens:
            self.short_calls += 1
            return self.fallback(q, k, v)
        if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] != 128:
            if self.sol.strict:
                raise KernelUnavailable(f"sol_attn takes bf16/fp16 heads of 128 channels, got {q.dtype} "
                                        f"{list(q.shape)} (H3_SOL_STRICT=0 would route such calls to "
                                        f"H3_SOL_FALLBACK={self.sol.fallback})")
            self.unsupported_calls += 1
            return self.fallback(q, k, v)
        self.sparse_calls += 1
        topk = self.sol.topk_ratio if self.sol.thresh_type == "topk" else 0.0
        return self.ck.sol_attn(q.contiguous(), k.contiguous(), v.contiguous(), tau=self.sol.tau,
                                topk_ratio=topk, **self.extra)

    def describe(self) -> dict:
        s = self.sol
        return {**super().describe(), "tau": s.tau, "thresh_type": s.thresh_type,
                "topk_ratio": s.topk_ratio if s.thresh_type == "topk" else None, "min_tokens": s.min_tokens,
                "int8_qk": s.int8_qk, "int8_pv": s.int8_pv, "strict": s.strict,
                "fallback": self.fallback.describe(), "sparse_calls": self.sparse_calls,
                "short_calls_on_fallback": self.short_calls,
                "unsupported_calls_on_fallback": self.unsupported_calls}


def _resolve_sol(device, settings, dtype: torch.dtype | None = None, head_dim: int | None = None) -> Backend:
    require_cuda("sol_attn", device, minimum=(8, 0), why="comfy-kitchen's Sol-Attn CUDA kernels")
    ck = require_module("sol_attn", "comfy_kitchen", CK_HOW)
    if not ck.sol_attn_is_available(as_device(device)):
        raise KernelUnavailable(f"sol_attn: comfy-kitchen {package_version('comfy-kitchen')} reports its Sol-Attn "
                                f"kernels unavailable on {describe_device(device)} (CUDA extension not loaded?)")
    sol = settings.sol
    params = inspect.signature(ck.sol_attn).parameters
    extra = {}
    for var, key, value in (("H3_SOL_INT8_QK", "int8_qk", sol.int8_qk), ("H3_SOL_INT8_PV", "int8_pv", sol.int8_pv)):
        if value == "auto":
            continue
        if key not in params:
            raise KernelUnavailable(
                f"{var}={value}: the installed comfy-kitchen {package_version('comfy-kitchen')} sol_attn has no "
                f"`{key}` switch (its precision is fixed by the kernel); leave {var} unset (auto)")
        extra[key] = value == "on"
    # Short calls (and, without strict, unsupported heads) run here: it must take the model's heads too.
    fallback, _ = resolve_attention(sol.fallback, device, settings, dtype=dtype, head_dim=head_dim)
    return SolBackend(ck, sol, fallback, extra)


def _resolve_ck_int8(device) -> Backend:
    require_cuda("ck_int8", device, minimum=(7, 5), why="comfy-kitchen's INT8 attention kernel")
    ck = require_module("ck_int8", "comfy_kitchen", CK_HOW)
    if not ck.int8_attention_is_available(as_device(device)):
        raise KernelUnavailable(f"ck_int8: comfy-kitchen {package_version('comfy-kitchen')} reports int8_attention "
                                f"unavailable on {describe_device(device)} (CUDA extension not loaded?)")
    return CKInt8Backend(ck)


# ------------------------------------------------------------------------------------------ head slicing
class HeadSlicedBackend(Backend):
    name = "kj_head_sliced"

    def __init__(self, inner: Backend, size: int):
        self.inner, self.size = inner, size
        self.exact = inner.exact

    def __call__(self, q, k, v):
        heads = v.shape[2]
        out = None
        for start in range(0, heads, self.size):
            end = min(start + self.size, heads)
            part = self.inner(_heads(q, start, end), _heads(k, start, end), v[:, :, start:end])
            if out is None:
                out = torch.empty(*v.shape[:2], heads, part.shape[-1], dtype=part.dtype, device=part.device)
            out[:, :, start:end] = part
        return out

    def describe(self) -> dict:
        return {**super().describe(), "heads_per_slice": self.size, "inner": self.inner.describe()}


def _heads(x, start: int, end: int):
    if isinstance(x, torch.Tensor):
        return x[:, :, start:end]
    return x.slice_heads(start, end)


# ------------------------------------------------------------------------------------------ resolution
HALF = (torch.bfloat16, torch.float16)


def auto_choice(device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> tuple[str, str]:
    """The fastest exact backend on `device` that has kernels for `dtype` heads of `head_dim` (when given),
    and why. FlashAttention-3 and cuDNN attention take bf16/fp16 only, and a FlashAttention-3 build may
    ship a subset of those (the fa3-fwd wheel has no fp16 kernels): it is asked with one tiny call."""
    cap = capability(device)
    if cap is None:
        return "sdpa", f"{describe_device(device)}: PyTorch SDPA"
    if dtype is not None and dtype not in HALF:
        return "sdpa", f"{dtype} heads: PyTorch SDPA (FlashAttention-3 and cuDNN attention take bf16/fp16)"
    why_not_fa3 = "no FlashAttention-3 installed"
    if cap == HOPPER:
        try:
            module = fa3_module()
            if dtype is None or FA3Backend(module).supports(dtype, head_dim or 128, device):
                return "fa3", f"Hopper GPU with FlashAttention-3 ({module.__name__}): the fastest exact kernel measured"
            why_not_fa3 = f"this FlashAttention-3 build has no {dtype} kernel for head size {head_dim or 128}"
        except FA3ImportFailed as exc:
            why_not_fa3 = str(exc)
        except KernelUnavailable:
            pass
    if cap >= (8, 0) and torch.backends.cudnn.is_available():
        why = why_not_fa3 if cap == HOPPER else f"sm_{cap[0]}{cap[1]} (FlashAttention-3 is Hopper only)"
        return "cudnn_sdpa", f"cuDNN attention: {why}"
    return "sdpa", f"{describe_device(device)}: no cuDNN attention, PyTorch SDPA"


def _check_dtype(backend: "Backend", name: str, device, dtype: torch.dtype | None, head_dim: int | None) -> None:
    """Fail at set-up, not at the first forward, when a requested backend has no kernel for the model's heads."""
    if dtype is None or name not in ("cudnn_sdpa", "fa3", "fa3_fp8"):
        return
    if dtype not in HALF:
        raise KernelUnavailable(f"{name} takes bf16/fp16 heads and this model computes in {dtype}; run it in bf16 "
                                f"or choose sdpa")
    if name == "fa3_fp8" and dtype != torch.bfloat16:
        raise KernelUnavailable(f"fa3_fp8 runs bf16 models; this one computes in {dtype}")
    if name == "fa3" and not backend.supports(dtype, head_dim or 128, device):
        raise KernelUnavailable(f"this FlashAttention-3 build ({backend.module.__name__}) has no {dtype} kernel for "
                                f"head size {head_dim or 128}; choose cudnn_sdpa or sdpa, or auto")


def resolve_attention(name: str, device, settings=None, *, dtype: torch.dtype | None = None,
                      head_dim: int | None = None) -> tuple[Backend, str]:
    """(callable backend, name of what runs) for an H3_ATTENTION value on `device`.

    Raises KernelUnavailable when the backend cannot run here, or, with `dtype` (and `head_dim`) of the
    model's heads, cannot run them. `auto` resolves to an exact backend and the returned name says which;
    the callable's `describe()` adds why.
    """
    from .settings import ATTENTION_BACKENDS, KernelSettings, SettingsError

    settings = settings or KernelSettings()
    if name not in ATTENTION_BACKENDS:
        raise SettingsError(f"unknown attention backend {name!r}; use one of: {', '.join(ATTENTION_BACKENDS)}")
    device = as_device(device)
    if name == "auto":
        chosen, why = auto_choice(device, dtype, head_dim)
        backend, _ = resolve_attention(chosen, device, settings)
        backend.auto_reason = why
        return backend, chosen
    if name == "sdpa":
        return FunctionBackend("sdpa", sdpa, True), name
    if name == "cudnn_sdpa":
        require_cuda("cudnn_sdpa", device, minimum=(8, 0), why="cuDNN fused attention")
        if not torch.backends.cudnn.is_available():
            raise KernelUnavailable("cudnn_sdpa needs cuDNN, which this PyTorch build does not load; install a CUDA "
                                    "build of torch (it bundles nvidia-cudnn)")
        backend = FunctionBackend("cudnn_sdpa", cudnn_sdpa, True)
        _check_dtype(backend, name, device, dtype, head_dim)
        return backend, name
    if name in ("fa3", "fa3_fp8"):
        require_cuda(name, device, exactly=HOPPER, why="FlashAttention-3 kernels are built for Hopper only")
        module = fa3_module()
        if name == "fa3":
            backend = FA3Backend(module)
        else:
            from ._triton import triton

            backend = FA3FP8Backend(module, use_triton=triton is not None)
        _check_dtype(backend, name, device, dtype, head_dim)
        return backend, name
    if name in ("sage2", "sage2-quality"):
        backend = _resolve_sage(name, device)
    elif name == "ck_int8":
        backend = _resolve_ck_int8(device)
    elif name == "sol_attn":
        backend = _resolve_sol(device, settings, dtype, head_dim)
    if name in ("sage2", "sage2-quality", "ck_int8", "sol_attn"):
        # Their kernels take half-precision heads (ck_int8 would hand an fp32 model bf16 back); sol_attn
        # without strict routes other heads to its fallback, resolved above for the same heads.
        if dtype is not None and dtype not in HALF and (name != "sol_attn" or settings.sol.strict):
            raise KernelUnavailable(f"{name} takes bf16/fp16 heads and this model computes in {dtype}; run it in "
                                    "bf16 or choose sdpa" + (" (or H3_SOL_STRICT=0)" if name == "sol_attn" else ""))
        return backend, name
    # kj_head_sliced
    inner, inner_name = resolve_attention(settings.head_slice_backend, device, settings, dtype=dtype,
                                          head_dim=head_dim)
    return HeadSlicedBackend(inner, settings.head_slice_size), f"kj_head_sliced({inner_name})"
