"""Triton, when installed, and the small device helpers our kernels share.

Kernels are defined at module level (Triton resolves helper functions through module globals), under
`if triton is not None`, so that a CPU-only install without Triton still imports every module.
TRITON_INTERPRET=1 (the CPU tests) must be set before the first kernel module is imported.
"""

from __future__ import annotations

import torch

from .capability import triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch references still work
    triton = None
    tl = None

rnd = rint = round_bf16 = round_f16 = round_e4m3 = None  # device helpers, defined below when Triton is installed
div_by = store_e4m3 = rnd_store = None


def require_kernels(what: str = "this fused kernel") -> None:
    if triton is None:
        from .capability import KernelUnavailable

        raise KernelUnavailable(f"{what} needs Triton, which is not installed; `pip install triton` (Linux), "
                                f"or switch the fusion off to use the PyTorch reference")

# Which dtype a kernel rounds its intermediate results to, mirroring eager PyTorch: 0 = none (fp32).
ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def round_code(dtype: torch.dtype) -> int:
    if dtype not in ROUND_CODES:
        raise ValueError(f"fused kernels take float32, bfloat16 or float16 activations, got {dtype}")
    return ROUND_CODES[dtype]


# Rounding helpers come in two builds. On a GPU a conversion instruction (cvt.rn) rounds to nearest even in
# one step; the bit-twiddling versions cost ~5 integer operations per value, which made our elementwise
# kernels ALU-bound (docs/perf-notes.md, third session). Triton's CPU interpreter truncates fp32 -> bf16
# casts and cannot run PTX, so under it (the CPU tests) the bit versions stand in; they give the same values.
# ROCm builds of Triton take no PTX either: they get the bit versions too.
INTERPRETED = triton is not None and triton_interpreting()
PTX = triton is not None and not INTERPRETED and torch.version.hip is None

if PTX:

    @triton.jit
    def round_bf16(v):
        """fp32 -> nearest-even bf16 value, kept in fp32. In PTX: a cast pair written in Triton
        (fp32 -> bf16 -> fp32) was folded away by the compiler on the H200, losing the rounding.
        (Two values per cvt.rn.bf16x2.f32 measured slower on the H200: norm + modulate 0.16 -> 0.21 ms.)"""
        bits = tl.inline_asm_elementwise(
            "{ .reg .b16 h, z; cvt.rn.bf16.f32 h, $1; mov.b16 z, 0; mov.b32 $0, {z, h}; }",
            "=r,f", [v], dtype=tl.uint32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_f16(v):
        """fp32 -> nearest-even fp16 value, kept in fp32 (PTX, for the reason above)."""
        return tl.inline_asm_elementwise("{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.f32.f16 $0, h; }",
                                         "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def round_e4m3(v):
        """fp32 (already within +-448) -> nearest-even float8 e4m3fn value, kept in fp32."""
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)

elif triton is not None:

    @triton.jit
    def round_bf16(v):
        """fp32 -> nearest-even bf16 value, kept in fp32, on the bits (the interpreter truncates casts)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def round_f16(v):
        return v.to(tl.float16).to(tl.float32)

    @triton.jit
    def round_e4m3(v):
        """fp32 (already within +-448) -> nearest-even float8 e4m3fn value, kept in fp32; the final cast
        to tl.float8e4nv is then exact in the interpreter."""
        bits = v.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # below 2^-6 e4m3 is subnormal with a fixed spacing of 2^-9
        sub = rint(v * 512.0) / 512.0
        sub = tl.where(sub == 0.0, v * 0.0, sub)  # keep the sign of zero, as a cast does
        return tl.where(tl.abs(v) < 0.015625, sub, normal)

if triton is not None:

    @triton.jit
    def rnd(v, RND: tl.constexpr):
        """Round fp32 values to the activation dtype (nearest even) and back, as an eager op's output would be."""
        if RND == 1:
            return round_bf16(v)
        elif RND == 2:
            return round_f16(v)
        else:
            return v

    @triton.jit
    def rint(v):
        """Round half to even for |v| < 2^22: adding 1.5 * 2^23 leaves the integer part in the mantissa."""
        return (v + 12582912.0) - 12582912.0


# `rnd` for a value stored next in the activation dtype and not used again. With PTX the store's own cast
# rounds to nearest even (cvt.rn), so rounding first converts twice: dropping it took norm + modulate
# 0.18 -> 0.16 ms and the residual + norm pass 0.31 -> 0.26 ms on the H200 (docs/perf-notes.md, sixth
# session). The interpreter truncates that cast, and ROCm's is not checked here, so there it rounds.
if PTX:

    @triton.jit
    def rnd_store(v, RND: tl.constexpr):
        return v

elif triton is not None:

    @triton.jit
    def rnd_store(v, RND: tl.constexpr):
        return rnd(v, RND)


# Dividing many values by one scale (the FP8 / INT8 quantizers): `div_by(x, d, inv)` with inv = div_rn(1, d)
# made once. The IEEE division (div_rn) is a dozen instructions per value with a branch to a slow path and
# made the SwiGLU-to-e4m3 pass instruction-bound (SASS: 1,432 -> 1,088 instructions for its 32 values per
# thread). With PTX: q = x * inv is within an ulp of x / d, the residual x - q * d is exact in one fma,
# and one more fma with the correctly rounded reciprocal gives the correctly rounded quotient (Markstein's
# correction) for quotients in the normal range: the same bits as div_rn (GPU test against torch's
# division). A quotient in the subnormal range is below e4m3's and int8's smallest step, so its code is the
# same. The interpreter keeps div_rn (its fma is not known to be fused). `store_e4m3` is the e4m3 cast
# with nearest-even rounding in one conversion (the interpreter rounds on the bits first, as before).
if PTX:

    @triton.jit
    def div_by(x, d, inv):
        q = x * inv
        return tl.fma(tl.fma(-q, d, x), inv, q)

    @triton.jit
    def store_e4m3(q):
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")

elif triton is not None:

    @triton.jit
    def div_by(x, d, inv):
        return tl.math.div_rn(x, d)

    @triton.jit
    def store_e4m3(q):
        return round_e4m3(q).to(tl.float8e4nv)
