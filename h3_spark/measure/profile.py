"""Where one warm forward spends its GPU time: CUDA kernels grouped by kind, from torch.profiler.

The groups are coarse on purpose (GEMMs, attention, our Triton passes, the rest) so a result says at a
glance whether a forward is GEMM-, attention- or elementwise-bound; the top kernels are kept by name.
"""

from __future__ import annotations

from typing import Callable

import torch

# Our Triton kernels under the names the profiler reports (each kernel function's own name; a test checks
# that every `*_kernel` in h3_spark.kernels is listed).
OUR_KERNELS = frozenset(("_norm_modulate_kernel", "_modulate_kernel", "_gated_add_kernel", "_add_norm_kernel",
                         "_swiglu_kernel", "_swiglu_fp8_kernel", "_qk_prep_kernel", "_key_sum_kernel",
                         "_quantize_rows_kernel", "_nvfp4_kernel", "_fine_kernel", "_fine_tma_kernel",
                         "_pool_kernel", "_gguf_dequantize_kernel", "_rotate_quantize_kernel", "_scale_int32_kernel",
                         "_residual_norm_kernel"))
# The others, checked in order: the first group whose pattern occurs in the lower-cased kernel name wins.
GROUPS = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul", "_mm_")),
    ("copy / index", ("copy", "index", "gather", "scatter", "cat")),
    ("elementwise / reduce", ("elementwise", "reduce", "vectorized", "unrolled")),
)


def kernel_group(name: str) -> str:
    if name in OUR_KERNELS:
        return "triton (ours)"
    low = name.lower()
    for group, patterns in GROUPS:
        if any(p in low for p in patterns):
            return group
    return "other"


def profile_call(fn: Callable[[], object], device: str, top: int = 25) -> dict:
    """Profile one call of `fn` (already warm): total CUDA ms, ms per group, the `top` kernels."""
    if not device.startswith("cuda"):
        raise ValueError("profiling reports CUDA kernel time: run it on a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us() / 1e3
        entry[1] += 1
    return summarize(kernels, top)


def summarize(kernels: dict[str, list[float]], top: int) -> dict:
    """{name: [ms, calls]} -> totals per group (ms, share) and the slowest kernels."""
    total = sum(ms for ms, _ in kernels.values())
    groups: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "cuda_ms_total": total,
        "groups": {g: {"ms": ms, "share": ms / total if total else 0.0}
                   for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:160], "ms": ms, "calls": calls, "group": kernel_group(name)}
                        for name, (ms, calls) in ranked],
    }
