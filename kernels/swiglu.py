"""Fused SwiGLU activation: value * silu(gate) read straight from the fused [value; gate] up-projection.

Eager PyTorch chunks the (S, 2F) up-projection output into two strided views, runs SiLU (one pass, one
(S, F) result) and multiplies (another pass): three reads and two writes of (S, F). The kernel reads
each half once and writes the product once. It rounds where eager does (SiLU's result, then the
product) so bf16 outputs equal the reference bit for bit but for the last bit of exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import require_kernels, rnd, round_code, tl, triton  # noqa: F401  (rnd: used in the kernel)

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
        tl.store(out_ptr + idx, rnd(value * act, RND).to(out_ptr.dtype.element_ty), mask=m)


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
