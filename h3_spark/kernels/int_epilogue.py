"""The end of W4A8Linear's integer GEMM: its int32 products scaled per token and per output channel, the bias
added, stored in the output dtype, in one Triton pass (`scale_int32`) beside its PyTorch definition
(`reference_scale_int32`).

The reference is five passes over the (M, N) product: int32 to fp32, x the token scales, x the channel scales,
+ the bias, to the output dtype. At 37,966 rows they cost about 26 ms a DiT block on an H100 beside 31.8 ms of
integer GEMMs (`receipts/h100/w4a8-linear-5276138.json`). The kernel reads the int32 once and writes the output
once. It multiplies in the reference's order in fp32 and rounds to the output dtype to nearest even as the
reference's cast does: under the interpreter the same bits (tests). A GPU compiler may contract the last multiply
and the bias add into one fused multiply-add, which can move an output by that fp32 rounding before its own.
"""

from __future__ import annotations

import torch

from ._triton import require_kernels, rnd_store, round_code, tl, triton  # noqa: F401  (used in the kernel)

BLOCK_M, BLOCK_N = 64, 128


def reference_scale_int32(acc: torch.Tensor, x_scale: torch.Tensor, s_channel: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, N) int32 products -> (acc x x_scale (M, 1) x s_channel (1, N) + bias) in `out_dtype`, in fp32."""
    out = acc.float() * x_scale * s_channel
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


if triton is not None:

    @triton.jit
    def _scale_int32_kernel(acc_ptr, xs_ptr, s_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr,
                            RND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask, cmask = rows < M, cols < N
        mask = rmask[:, None] & cmask[None, :]
        at = rows[:, None] * N + cols[None, :]
        acc = tl.load(acc_ptr + at, mask=mask, other=0).to(tl.float32)
        xs = tl.load(xs_ptr + rows, mask=rmask, other=0.0)
        s = tl.load(s_ptr + cols, mask=cmask, other=0.0)
        out = acc * xs[:, None] * s[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        # The store's cast rounds to nearest even on a GPU; the interpreter truncates it, so there rnd_store rounds.
        tl.store(out_ptr + at, rnd_store(out, RND).to(out_ptr.dtype.element_ty), mask=mask)


def scale_int32(acc: torch.Tensor, x_scale: torch.Tensor, s_channel: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Triton version of `reference_scale_int32`: contiguous int32 (M, N), fp32 token scales (M, 1), fp32 channel
    scales (1, N) or (N,), a bias (N,) of any float dtype or None."""
    require_kernels("the W4A8 epilogue")
    m, n = acc.shape if acc.ndim == 2 else (-1, -1)
    if acc.dtype != torch.int32 or acc.ndim != 2 or not acc.is_contiguous():
        raise ValueError(f"expected contiguous int32 (rows, N) products, got {acc.dtype} {list(acc.shape)}")
    if x_scale.numel() != m or s_channel.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"scales and bias must match the {m} x {n} products: {x_scale.numel()} token scales, "
                         f"{s_channel.numel()} channel scales, {None if bias is None else bias.numel()} bias values")
    out = torch.empty(m, n, device=acc.device, dtype=out_dtype)
    if m and n:
        xs, s = x_scale.float().reshape(m).contiguous(), s_channel.float().reshape(n).contiguous()
        b = bias.contiguous() if bias is not None else s  # unread without a bias
        _scale_int32_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
            acc, xs, s, b, out, m, n, HAS_BIAS=bias is not None, RND=round_code(out_dtype), BM=BLOCK_M, BN=BLOCK_N,
            num_warps=4)
    return out
