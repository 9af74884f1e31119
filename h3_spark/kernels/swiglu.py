"""Fused SwiGLU activation: value * silu(gate) read straight from the fused [value; gate] up-projection.

Eager PyTorch chunks the (S, 2F) up-projection output into two strided views, runs SiLU (one pass, one
(S, F) result) and multiplies (another pass): three reads and two writes of (S, F). The kernel reads
each half once and writes the product once. It rounds where eager does (SiLU's result, then the
product) so bf16 outputs equal the reference bit for bit but for the last bit of exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import (div_by, require_kernels, rnd, rnd_store, round_code, store_e4m3, tl,  # noqa: F401  (kernels)
                      triton)

BLOCK = 1024


def reference_swiglu(up: torch.Tensor) -> torch.Tensor:
    """value * silu(gate) for up = [value | gate] along the last dimension (the DiT's own formula)."""
    value, gate = up.chunk(2, dim=-1)
    return value * F.silu(gate)


if triton is not None:

    @triton.jit
    def _swiglu_kernel(up_ptr, out_ptr, n, HALF: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = idx < n
        row = idx // HALF
        col = idx % HALF
        value = tl.load(up_ptr + row * (2 * HALF) + col, mask=m, other=0.0).to(tl.float32)
        gate = tl.load(up_ptr + row * (2 * HALF) + HALF + col, mask=m, other=0.0).to(tl.float32)
        act = rnd(gate / (1.0 + tl.exp(-gate)), RND)
        tl.store(out_ptr + idx, rnd_store(value * act, RND).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_fp8_kernel(up_ptr, q_ptr, s_ptr, HALF: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        # One whole row per program: the product rounded to the activation dtype (as fused_swiglu writes
        # it), its absmax, then e4m3 codes with the row's scale (as quantize_rows would make them).
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < HALF
        value = tl.load(up_ptr + row * (2 * HALF) + c, mask=m, other=0.0).to(tl.float32)
        gate = tl.load(up_ptr + row * (2 * HALF) + HALF + c, mask=m, other=0.0).to(tl.float32)
        prod = rnd(value * rnd(gate / (1.0 + tl.exp(-gate)), RND), RND)
        scale = tl.maximum(tl.max(tl.where(m, tl.abs(prod), 0.0), axis=0), 1e-12) / 448.0
        tl.store(s_ptr + row, scale)
        q = tl.minimum(tl.maximum(div_by(prod, scale, tl.math.div_rn(1.0, scale)), -448.0), 448.0)
        tl.store(q_ptr + row * HALF + c, store_e4m3(q), mask=m)


def fused_swiglu(up: torch.Tensor) -> torch.Tensor:
    """The fused kernel; same contract as `reference_swiglu`."""
    require_kernels("the fused SwiGLU")
    if up.shape[-1] % 2:
        raise ValueError(f"a fused [value; gate] projection has an even width, got {up.shape[-1]}")
    up = up.contiguous()
    half = up.shape[-1] // 2
    out = torch.empty(*up.shape[:-1], half, dtype=up.dtype, device=up.device)
    n = out.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](up, out, n, HALF=half, RND=round_code(up.dtype), BLOCK=BLOCK)
    return out


def swiglu_rows_fp8(up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, 2F) fused up-projection -> (e4m3 (M, F), fp32 (M, 1) scales) of `reference_swiglu(up)` quantized
    per row, in one pass; equal to quantize_rows(fused_swiglu(up))."""
    require_kernels("the fused SwiGLU")
    if up.ndim != 2 or up.shape[-1] % 2:
        raise ValueError(f"expected (rows, 2 * ffn) with an even width, got {list(up.shape)}")
    up = up.contiguous()
    m, half = up.shape[0], up.shape[1] // 2
    q = torch.empty(m, half, device=up.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, 1, device=up.device, dtype=torch.float32)
    if m:
        block = triton.next_power_of_2(half)
        _swiglu_fp8_kernel[(m,)](up, q, s, HALF=half, RND=round_code(up.dtype), BLOCK=block,
                                 num_warps=16 if block >= 8192 else 8)
    return q, s
