"""Attention backends. Each takes q, k, v as (batch, seq, heads, head_dim) and returns the same shape.

`sdpa` is the plain-PyTorch reference every other backend is compared against; `math_reference` is the
fp32 formula the tests use. Every backend is declared once in `SPECS` (its limits, what it needs and
its constructor); the names the settings accept, the exact ones, auto's order and the Q/K preparation
each takes derive from it. `resolve_attention(name, device, settings)` turns an H3_ATTENTION name into
a callable and the name of what will really run (`auto` picks the fastest exact backend here and says
why it refused each faster one). A backend that cannot run raises KernelUnavailable (an H3Error) at
resolve time, naming what is missing and how to get it; nothing falls back silently.

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
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from .capability import (HOPPER, KernelUnavailable, NotInstalled, SettingsError, as_device, capability,
                         describe_device, package_version, require_cuda, require_module, version_tuple)

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

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

    @property
    def runs(self) -> str:
        """What runs, as a report names it (a wrapper names what it wraps)."""
        return self.name

    def describe(self) -> dict:
        d = {"backend": self.name, "exact": self.exact}
        if getattr(self, "auto_reason", None):
            d["chosen_by_auto"] = self.auto_reason
        if getattr(self, "auto_refused", None):
            d["refused_by_auto"] = dict(self.auto_refused)
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
    raise NotInstalled(f"FlashAttention-3 is not installed ({'; '.join(missing)}); {FA3_HOW}")


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


def _load_sage(spec: "BackendSpec", device):
    """sageattention >= 2 with the kernels this GPU needs (`sage2` picks its kernel by GPU generation)."""
    cap = capability(device)
    module = require_module(spec.name, "sageattention", spec.install)
    version = package_version("sageattention") or getattr(module, "__version__", None)
    if version is None or version_tuple(version) < (2,):
        raise KernelUnavailable(f"{spec.name} needs sageattention >= 2, found {version or 'an unknown version'}; "
                                f"{SAGE_HOW}")
    core = getattr(module, "core", None)
    needed = ("SM90_ENABLED" if cap == HOPPER else "SM89_ENABLED" if cap == (8, 9) else "SM80_ENABLED") \
        if spec.name == "sage2" else "SM80_ENABLED"
    if core is not None and getattr(core, needed, True) is False:
        raise KernelUnavailable(f"{spec.name}: the installed sageattention {version} was built without the "
                                f"{needed[:4].lower()} kernels this GPU ({describe_device(device)}) needs; "
                                f"rebuild it on this machine")
    return module, version


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


@dataclass(frozen=True)
class SolSettings:
    """comfy-kitchen Sol-Attn (sparse attention) knobs; see kernels/README.md for their meaning."""

    tau: float = 1.3
    min_tokens: int = 4096
    thresh_type: str = "diag"
    topk_ratio: float = 0.1
    int8_qk: str = "auto"
    int8_pv: str = "auto"
    fallback: str = "sage2"
    strict: bool = True


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


def _load_comfy_kitchen(spec: "BackendSpec", device):
    ck = require_module(spec.name, "comfy_kitchen", spec.install)
    probe, kernels = {"sol_attn": ("sol_attn_is_available", "its Sol-Attn kernels"),
                      "ck_int8": ("int8_attention_is_available", "int8_attention")}[spec.name]
    if not getattr(ck, probe)(as_device(device)):
        raise KernelUnavailable(f"{spec.name}: comfy-kitchen {package_version('comfy-kitchen')} reports {kernels} "
                                f"unavailable on {describe_device(device)} (CUDA extension not loaded?)")
    return ck


def _build_sol(ck, device, settings, dtype, head_dim) -> Backend:
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

    @property
    def runs(self) -> str:
        return f"kj_head_sliced({self.inner.runs})"

    def describe(self) -> dict:
        return {**super().describe(), "heads_per_slice": self.size, "inner": self.inner.describe()}


def _heads(x, start: int, end: int):
    if isinstance(x, torch.Tensor):
        return x[:, :, start:end]
    return x.slice_heads(start, end)


# ------------------------------------------------------------------------------------------ the registry
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BackendSpec:
    """One H3_ATTENTION backend, declared once: what it computes, where it runs, what it needs, how it is built.

    `gpu`: the lowest and highest compute capability it has kernels for: one generation (both the same) or
    every one from the lowest (highest None); None: any device, the CPU too.
    `dtypes` / `head_dims`: the heads it takes (empty: any); a FlashAttention-3 build may ship fewer, which
    `kernel_gap` asks the loaded build. `load(spec, device)` imports what it needs (KernelUnavailable naming
    it and `install` when it cannot); `build(loaded, device, settings, dtype, head_dim)` makes the callable.
    `qk_heads`: what the fused Q/K preparation hands it: "plain" bf16 heads, "rotated" bf16 heads rotated for
    its own quantizer (Sage smooths and quantizes itself), "fp8" heads quantized per (batch, head).
    `auto_rank`: its place in `auto`'s order, fastest first (None: auto never picks it, being approximate).
    """

    name: str
    exact: bool | None  # None: as exact as the backend it runs (kj_head_sliced)
    summary: str
    build: Callable
    load: Callable | None = None
    gpu: tuple[tuple[int, int], tuple[int, int] | None] | None = None
    gpu_why: str = ""
    dtypes: tuple[torch.dtype, ...] = ()
    head_dims: tuple[int, ...] = ()
    needs: str = ""
    install: str = ""
    qk_heads: str = "plain"
    auto_rank: int | None = None
    kernel_gap: Callable | None = None  # (loaded backend, dtype, head_dim, device) -> None or what is missing
    strict: Callable = lambda settings: True  # whether heads outside its limits are refused (else routed on)
    dtype_hint: str = ""
    chosen_why: Callable | None = None  # (backend, why the next faster one was refused) -> why auto chose it


def _load_cudnn(spec: "BackendSpec", device):
    if not torch.backends.cudnn.is_available():
        raise NotInstalled(f"cudnn_sdpa needs cuDNN, which this PyTorch build does not load; install {spec.install}")


def _load_fa3(spec: "BackendSpec", device):
    return fa3_module()


def _build_fa3_fp8(module, device, settings, dtype, head_dim) -> Backend:
    from ._triton import triton

    return FA3FP8Backend(module, use_triton=triton is not None)


def _fa3_gap(backend: FA3Backend, dtype: torch.dtype, head_dim: int | None, device) -> str | None:
    if backend.supports(dtype, head_dim or 128, device):
        return None
    return f"this FlashAttention-3 build has no {dtype} kernel for head size {head_dim or 128}"


def _build_head_sliced(loaded, device, settings, dtype, head_dim) -> Backend:
    inner, _ = resolve_attention(settings.head_slice_backend, device, settings, dtype=dtype, head_dim=head_dim)
    return HeadSlicedBackend(inner, settings.head_slice_size)


SPECS: tuple[BackendSpec, ...] = (
    BackendSpec("sdpa", True, "PyTorch's default SDPA dispatch", auto_rank=3,
                chosen_why=lambda backend, faster: f"{faster}: PyTorch SDPA",
                build=lambda loaded, *_: FunctionBackend("sdpa", sdpa, True)),
    BackendSpec("cudnn_sdpa", True, "SDPA forced onto cuDNN attention, no fallback", auto_rank=2,
                chosen_why=lambda backend, faster: f"cuDNN attention: {faster}",
                gpu=((8, 0), None), gpu_why="cuDNN fused attention", dtypes=HALF, needs="cuDNN",
                install="a CUDA build of torch (it bundles nvidia-cudnn)", load=_load_cudnn,
                build=lambda loaded, *_: FunctionBackend("cudnn_sdpa", cudnn_sdpa, True)),
    BackendSpec("fa3", True, "FlashAttention-3 forward", auto_rank=1, gpu=(HOPPER, HOPPER),
                gpu_why="FlashAttention-3 kernels are built for Hopper only", dtypes=HALF, needs="FlashAttention-3",
                install=FA3_HOW, load=_load_fa3, build=lambda module, *_: FA3Backend(module), kernel_gap=_fa3_gap,
                chosen_why=lambda backend, faster: f"Hopper GPU with FlashAttention-3 ({backend.module.__name__}): "
                                                   "the fastest exact kernel measured"),
    BackendSpec("fa3_fp8", False, "FlashAttention-3 on FP8 e4m3 Q/K/V, one descale per (batch, head)",
                gpu=(HOPPER, HOPPER), gpu_why="FlashAttention-3 kernels are built for Hopper only",
                dtypes=(torch.bfloat16,), needs="FlashAttention-3", install=FA3_HOW, qk_heads="fp8",
                load=_load_fa3, build=_build_fa3_fp8),
    *(BackendSpec(name, False, summary, gpu=((8, 0), None), gpu_why="SageAttention's CUDA kernels", dtypes=HALF,
                  needs="sageattention >= 2", install=SAGE_HOW, qk_heads="rotated", load=_load_sage,
                  build=lambda loaded, *_, name=name: SageBackend(name, *loaded))
      for name, summary in (("sage2", "SageAttention 2: INT8 QK, FP8 PV"),
                            ("sage2-quality", "SageAttention 2: per-thread INT8 QK, FP16 PV, FP32 accumulation"))),
    BackendSpec("ck_int8", False, "comfy-kitchen INT8 Q/K/V attention with its own Hadamard", gpu=((7, 5), None),
                gpu_why="comfy-kitchen's INT8 attention kernel", dtypes=HALF, needs="comfy-kitchen", install=CK_HOW,
                load=_load_comfy_kitchen, build=lambda ck, *_: CKInt8Backend(ck)),
    BackendSpec("sol_attn", False, "comfy-kitchen Sol-Attn sparse attention (H3_SOL_*)", gpu=((8, 0), None),
                gpu_why="comfy-kitchen's Sol-Attn CUDA kernels", dtypes=HALF, head_dims=(128,),
                needs="comfy-kitchen", install=CK_HOW, load=_load_comfy_kitchen, build=_build_sol,
                strict=lambda settings: settings.sol.strict, dtype_hint=" (or H3_SOL_STRICT=0)"),
    BackendSpec("kj_head_sliced", None, "another backend (H3_HEAD_SLICE_BACKEND) run over slices of heads",
                build=_build_head_sliced),
)
REGISTRY: dict[str, BackendSpec] = {spec.name: spec for spec in SPECS}

ATTENTION_BACKENDS = ("auto", *REGISTRY)
# Backends whose output is the exact attention (up to the kernel's own bf16/fp32 rounding).
EXACT_BACKENDS = tuple(spec.name for spec in SPECS if spec.exact)
# What auto tries, fastest first.
AUTO_ORDER = tuple(s.name for s in sorted((s for s in SPECS if s.auto_rank is not None), key=lambda s: s.auto_rank))
# Backends that wrap another take a plain one; Sol-Attn's fallback also runs its short sequences.
HEAD_SLICE_INNER = tuple(b for b in ATTENTION_BACKENDS if b != "kj_head_sliced")
SOL_FALLBACKS = tuple(b for b in HEAD_SLICE_INNER if b != "sol_attn")
# Backends whose fused Q/K preparation writes FP8 heads (no other kernel reads them).
QUANTIZED_HEADS = tuple(spec.name for spec in SPECS if spec.qk_heads == "fp8")
HEAD_SLICE_BACKEND, HEAD_SLICE_SIZE = "auto", 8
# resolve_attention without settings: the defaults of the knobs the backends read (KernelSettings' own).
_DEFAULTS = SimpleNamespace(sol=SolSettings(), head_slice_backend=HEAD_SLICE_BACKEND, head_slice_size=HEAD_SLICE_SIZE)


def attention_help() -> str:
    """Every backend name with what it is, exact or approximate, for a front door's help text."""
    def entry(spec: BackendSpec) -> str:
        exact = {True: "exact", False: "approximate", None: "as exact as the backend it runs"}[spec.exact]
        return f"{spec.name}: {spec.summary} ({exact})"

    return "; ".join(["auto: the fastest exact backend here, saying why it passed over faster ones",
                      *map(entry, SPECS)])


def backend_spec(name: str) -> BackendSpec:
    """The registered backend `name`, or SettingsError listing the names."""
    if name not in REGISTRY:
        raise SettingsError(f"unknown attention backend {name!r}; use one of: {', '.join(ATTENTION_BACKENDS)}")
    return REGISTRY[name]


def _refused(exc: KernelUnavailable, reason: str | None = None) -> KernelUnavailable:
    """`exc` with the short form of why it rules its backend out, for auto's report (the message stays whole)."""
    exc.reason = reason or str(exc)
    return exc


def _check_gpu(spec: BackendSpec, device) -> None:
    if spec.gpu is None:
        return
    low, high = spec.gpu
    try:
        require_cuda(spec.name, device, **({"exactly": low} if low == high else {"minimum": low}), why=spec.gpu_why)
    except KernelUnavailable as exc:
        raise _refused(exc, describe_device(device) if capability(device) is None else None)


def _load(spec: BackendSpec, device):
    if spec.load is None:
        return None
    try:
        return spec.load(spec, device)
    except KernelUnavailable as exc:
        raise _refused(exc, f"no {spec.needs} installed" if isinstance(exc, NotInstalled) else None)


def _check_heads(spec: BackendSpec, settings, dtype, head_dim) -> None:
    """The model's heads against the declared limits."""
    if dtype is None or not spec.strict(settings):
        return
    if spec.dtypes and dtype not in HALF and set(spec.dtypes) <= set(HALF):
        raise _refused(KernelUnavailable(f"{spec.name} takes bf16/fp16 heads and this model computes in {dtype}; run "
                                         f"it in bf16 or choose sdpa{spec.dtype_hint}"), f"{dtype} heads")
    if spec.dtypes and dtype not in spec.dtypes:
        raise _refused(KernelUnavailable(f"{spec.name} runs bf16 models; this one computes in {dtype}"),
                       f"{dtype} heads")
    if spec.head_dims and head_dim is not None and head_dim not in spec.head_dims:
        raise _refused(KernelUnavailable(f"{spec.name} takes heads of {' or '.join(map(str, spec.head_dims))} "
                                         f"channels and this model's have {head_dim}; choose sdpa{spec.dtype_hint}"),
                       f"heads of {head_dim} channels")


def _check_build(spec: BackendSpec, backend: Backend, device, dtype, head_dim) -> None:
    """The model's heads against what the installed build has kernels for (a wheel may ship a subset)."""
    gap = spec.kernel_gap(backend, dtype, head_dim, device) if spec.kernel_gap and dtype is not None else None
    if gap is not None:
        detail = gap.replace("build", f"build ({backend.module.__name__})", 1)
        raise _refused(KernelUnavailable(f"{detail}; choose cudnn_sdpa or sdpa, or auto"), gap)


def _resolve_spec(spec: BackendSpec, device, settings, dtype, head_dim) -> Backend:
    """Every check in the order a user can act on: the GPU, the model's heads, the install, the installed build."""
    _check_gpu(spec, device)
    _check_heads(spec, settings, dtype, head_dim)
    backend = spec.build(_load(spec, device), device, settings, dtype, head_dim)
    _check_build(spec, backend, device, dtype, head_dim)
    return backend


def auto_choice(device, dtype: torch.dtype | None = None, head_dim: int | None = None,
                settings=None) -> tuple[Backend, str, dict[str, str]]:
    """The fastest exact backend on `device` with kernels for `dtype` heads of `head_dim` (when given), resolved;
    why it was chosen; and for each faster one why it was refused (a FlashAttention-3 build may ship a subset
    of its dtypes: the fa3-fwd wheel has no fp16 kernels, which one tiny call finds out)."""
    device = as_device(device)
    settings = settings or _DEFAULTS
    refused: dict[str, KernelUnavailable] = {}
    for name in AUTO_ORDER:
        spec = REGISTRY[name]
        try:
            backend = _resolve_spec(spec, device, settings, dtype, head_dim)
        except KernelUnavailable as exc:
            if name == AUTO_ORDER[-1]:  # the last resort refused too: say why every candidate was
                refused[name] = exc
                raise KernelUnavailable("auto found no exact attention backend: "
                                        + "; ".join(f"{n}: {e}" for n, e in refused.items())) from None
            refused[name] = exc
            continue
        faster = getattr(list(refused.values())[-1], "reason", None) if refused else None
        return backend, spec.chosen_why(backend, faster), {n: str(e) for n, e in refused.items()}


def auto_line(attention: dict) -> str:
    """A report's attention entry as one line: what auto chose and why, and why each faster backend was refused."""
    line = f"auto chose {attention.get('chosen')} ({attention.get('chosen_by_auto')})"
    return "; ".join([line, *(f"{n}: {why}" for n, why in attention.get("refused_by_auto", {}).items())])


def resolve_attention(name: str, device, settings=None, *, dtype: torch.dtype | None = None,
                      head_dim: int | None = None) -> tuple[Backend, str]:
    """(callable backend, name of what runs) for an H3_ATTENTION value on `device`.

    Raises KernelUnavailable when the backend cannot run here, or, with `dtype` (and `head_dim`) of the
    model's heads, cannot run them. `auto` resolves to an exact backend and the returned name says which;
    the callable's `describe()` adds why, and why each faster backend was refused.
    """
    spec = REGISTRY.get(name) if name != "auto" else None
    if spec is None and name != "auto":
        backend_spec(name)  # raises, naming the backends
    settings = settings or _DEFAULTS
    device = as_device(device)
    if name == "auto":
        backend, why, refused = auto_choice(device, dtype, head_dim, settings)
        backend.auto_reason, backend.auto_refused = why, refused
        return backend, backend.runs
    backend = _resolve_spec(spec, device, settings, dtype, head_dim)
    return backend, backend.runs
