"""The activations of W4A8Linear's integer GEMM: each token rotated by ConvRot per group of G columns and quantized
to int8 with one scale a token, in one Triton pass (`rotate_quantize`) beside its PyTorch definition
(`reference_rotate_quantize`).

The reference makes an fp32 copy of the activations, a batched matmul with the normalised Hadamard matrix, an
amax, a division, a rounding and a cast: six passes over the activations in plain PyTorch, which cost 73 ms a DiT
block on an H100 against 31.7 ms for the integer GEMMs themselves (at 7a49051, `benchmarks/w4a8_linear_gpu.py`).
The kernel reads each tile of rows twice (the first read finds the row's absmax, the second quantizes), forms the
rotation as tensor-core dots with a ±1 matrix made in registers, and writes only the int8 codes and the scales.

The ±1 matrix of size G = 4^n is the n-fold Kronecker power of ConvRot's base
((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1)), so entry (i, j) is -1 for an odd number of
base-4 digit pairs of i and j that sum to 3; the normalisation 1 / sqrt(G) = 2^-n is exact. With bf16 or fp16
activations each product is exact in fp32, so the kernel differs from the reference only by the order of the fp32
sums: a code can move by one where a value sits on a rounding boundary (tests: ≥ 99.9 % of codes equal, the rest
±1, scales within 1e-6).
"""

from __future__ import annotations

import math

import torch

from ._triton import INTERPRETED, div_by, require_kernels, rint, tl, triton  # noqa: F401  (used in the kernel)
from .stored_codec import hadamard

# A token's absmax below this still gets a finite scale (its codes are then zero).
_TINY = torch.finfo(torch.float32).tiny
BLOCK_ROWS = 64
# The rotation's dots run on T x T tiles of the ±1 matrix (a group of 256 is 4 x 4 of them).
MAX_TILE = 64


def reference_rotate_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> (int8 codes (M, K), fp32 scales (M, 1)): rotated = x @ H per group of `group` columns
    (H the normalised ConvRot Hadamard matrix), scale = the row's absmax / 127, codes = round-half-even of
    rotated / scale."""
    m, k = x.shape
    rotated = torch.matmul(x.float().reshape(m, k // group, group), hadamard(group, x.device)).reshape(m, k)
    scale = (rotated.abs().amax(dim=1, keepdim=True) / 127).clamp(min=_TINY)
    return (rotated / scale).round().clamp(-127, 127).to(torch.int8), scale


def fused_group(group: int) -> bool:
    """Whether the kernel takes this ConvRot group: tensor-core dots need tiles of at least 16."""
    return group >= 16


if triton is not None:

    @triton.jit
    def _signs(rows, cols, DIGITS: tl.constexpr):
        """The ±1 ConvRot matrix at (rows[:, None], cols[None, :]), as fp32."""
        odd = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.int32)
        for d in tl.static_range(DIGITS):
            pair = ((rows[:, None] >> (2 * d)) & 3) + ((cols[None, :] >> (2 * d)) & 3)
            odd = odd ^ (pair == 3).to(tl.int32)
        return 1.0 - 2.0 * odd.to(tl.float32)

    @triton.jit
    def _rotated_tile(x_ptr, rows, rmask, sx, g0, n0, G: tl.constexpr, T: tl.constexpr, DIGITS: tl.constexpr,
                      NORM: tl.constexpr, UPCAST: tl.constexpr):
        """Columns g0 + n0 .. g0 + n0 + T of the rotated rows (fp32): the group's T-column slices of x times the
        matching T x T tiles of the ±1 matrix, scaled by 1 / sqrt(G). UPCAST: the dot in fp32 (the CPU
        interpreter has no bf16 dot; the products are exact either way)."""
        t = tl.arange(0, T)
        acc = tl.zeros([rows.shape[0], T], dtype=tl.float32)
        # Loops, not unrolled: unrolled, a 256 group's 16 dots asked 528 KB of shared memory on the H100 (Triton 3.6).
        for k0 in range(0, G, T):
            x = tl.load(x_ptr + rows[:, None] * sx + (g0 + k0 + t)[None, :], mask=rmask[:, None], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
            h = _signs(k0 + t, n0 + t, DIGITS).to(x.dtype)
            acc += tl.dot(x, h, input_precision="ieee")
        return acc * NORM

    @triton.jit
    def _rotate_quantize_kernel(x_ptr, q_ptr, s_ptr, M, sx, sq, K: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
                                DIGITS: tl.constexpr, NORM: tl.constexpr, BM: tl.constexpr, UPCAST: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rmask = rows < M
        t = tl.arange(0, T)
        amax = tl.zeros([BM], dtype=tl.float32)
        for g0 in range(0, K, G):
            for n0 in range(0, G, T):
                v = _rotated_tile(x_ptr, rows, rmask, sx, g0, n0, G, T, DIGITS, NORM, UPCAST)
                amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        scale = tl.maximum(amax / 127.0, 1.1754943508222875e-38)
        tl.store(s_ptr + rows, scale, mask=rmask)
        inv = tl.math.div_rn(1.0, scale)
        for g0 in range(0, K, G):
            for n0 in range(0, G, T):
                v = _rotated_tile(x_ptr, rows, rmask, sx, g0, n0, G, T, DIGITS, NORM, UPCAST)
                q = tl.minimum(tl.maximum(rint(div_by(v, scale[:, None], inv[:, None])), -127.0), 127.0)
                tl.store(q_ptr + rows[:, None] * sq + (g0 + n0 + t)[None, :], q.to(tl.int8), mask=rmask[:, None])


def rotate_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference_rotate_quantize` (fp32, bf16 or fp16 activations, read in their own dtype)."""
    require_kernels("the W4A8 activation quantizer")
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"expected (rows, K) fp32/bf16/fp16 activations, got {x.dtype} {list(x.shape)}")
    m, k = x.shape
    digits = round(math.log(group, 4))
    if not fused_group(group) or 4 ** digits != group or k % group:
        raise ValueError(f"the fused W4A8 quantizer takes a ConvRot group that is a power of 4 of at least 16 and "
                         f"divides K; got group {group} for K = {k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    codes = torch.empty(m, k, device=x.device, dtype=torch.int8)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        tile = min(group, MAX_TILE)
        _rotate_quantize_kernel[(triton.cdiv(m, BLOCK_ROWS),)](
            x, codes, scale, m, x.stride(0), codes.stride(0), K=k, G=group, T=tile, DIGITS=digits,
            NORM=1.0 / 2 ** digits, BM=BLOCK_ROWS, UPCAST=INTERPRETED, num_warps=4)
    return codes, scale
