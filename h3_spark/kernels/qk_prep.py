"""Q/K preparation for attention: per-head RMSNorm + split-half RoPE, optionally K smoothing, a block
Hadamard rotation and FP8/INT8 quantization, in one Triton kernel per tensor (plus its reference).

Why each step:
- RMSNorm + RoPE are H3's own math (`dit.reference_qk_prep`). Unquantized, the kernel rounds after every
  operation exactly where the eager reference does, so the bf16 output matches it (up to the order of
  the fp32 sum of squares) and it can replace the reference for every exact backend.
- K smoothing subtracts the per-head mean key (over the sequence) from every key. Each score row then
  shifts by one constant, which softmax ignores, and the keys' quantization range shrinks.
- A block Hadamard H (orthonormal, H H^T = I) applied to both Q and K leaves Q K^T unchanged and
  spreads per-channel outliers across the block before quantization (H3's late blocks carry
  such outliers).
- Quantization: FP8 e4m3 (for FlashAttention-3 FP8, which takes one descale per batch and head) or
  INT8, with one scale per head (over the whole sequence) or per block of `BLOCK_TOKENS` tokens.
- `per_head_bound` (FP8 only) takes each head's scale from an upper bound of its values instead of their
  measured maximum: RMSNorm leaves a row with L2 norm <= max|w| sqrt(D), RoPE and the Hadamard keep it, the
  smoothing adds at most |mean key|, and no element exceeds its row's norm. That saves the pass that finds
  the maximum (one of two for Q, one of three for K). FP8 is a floating-point format, so a scale a few times
  too large leaves its relative error unchanged (only values over 2^14 times smaller than the bound fall
  into e4m3's subnormals); an integer grid would lose precision, hence FP8 only.

`prepare_heads` is the Triton kernel, `reference_prepare_heads` the plain-PyTorch reference with the
same signature; `FusedQKPrep` plugs either into `H3DiT.qk_prep`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._triton import (INTERPRETED, div_by, require_kernels, rint, rnd, rnd_store, round_bf16,  # noqa: F401  (kernels)
                      round_code, store_e4m3, tl, triton)

BLOCK_TOKENS = 64
NUM_WARPS = 8
# Launch shape of the passes that rotate: of 32/64/128 tokens x 2/4/8 warps on the H200 (S = 19,540, FP8 K
# with smoothing), 64 x 4 was among the fastest in each of three runs (1.77-2.08 ms; 64 x 8: 1.98-2.55 ms);
# reading a stored bf16 +-1 matrix instead of making it in registers measured the same and is not kept.
HADAMARD_TILE_TOKENS = 64
HADAMARD_WARPS = 4
# 128-wide heads rotate in two 16-wide steps (`_rotate`); of 16/32/64/128 tokens x 4/8 warps, 32 x 4 was fastest
# (0.48 ms for the FP8 K write pass at S = 19,540; 64 x 8: 0.53, 16 x 4: 0.53, 64 x 4: 0.69).
KRONECKER_TILE_TOKENS = 32
# The exact pass (model dtype out, no rotation): up to 8 heads per program share the RoPE rows they read, in
# tiles of 32 tokens x 4 warps. The experiment kernel (benchmarks/experiments/table_rows_experiment.py, H200, S = 19,540,
# 56 heads) took 0.237 ms per tensor against production's 0.289, bit-identical; shipped, the whole exact t2va
# forward went 1.981 -> 1.977 s (A/B in one lease, receipts/h200/ab-qk-heads/).
EXACT_TILE_TOKENS = 32
EXACT_WARPS = 4
EXACT_HEADS = 8
# The K smoothing's mean: each program sums KEY_SUM_TILES tiles of 16 tokens of one head (4 warps; ptxas:
# 223 registers, no spills; 32 tokens spilled).
KEY_SUM_TILE_TOKENS = 16
KEY_SUM_TILES = 16
KEY_SUM_WARPS = 4
QMAX = {"fp8": 448.0, "int8": 127.0}
QDTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
FORMATS = (None, "fp8", "int8")
GRANULARITIES = ("per_head", "per_head_bound", "per_block")
# Covers the roundings to bf16 between the norm and the rotation (each at most 2^-9 relative, four of them
# on a value's way, plus bf16 RoPE tables): the bound stays a bound, and the kernel clamps at qmax anyway.
BOUND_MARGIN = 1.0 + 2.0 ** -5
# An all-zero head still needs a finite scale; its codes are zero whatever the scale.
_MIN_AMAX = 1e-20


@dataclass(frozen=True)
class QuantizedHeads:
    """Quantized (B, S, H, D) heads; value = data * scale.

    scale is fp32, (B, H) for per-head scales or (B, H, ceil(S / block)) for per-block scales.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = self.data.float()
        if self.block:
            s = self.scale.repeat_interleave(self.block, dim=-1)[..., : x.shape[1]]  # (B, H, S)
            x = x * s.permute(0, 2, 1)[..., None]
        else:
            x = x * self.scale[:, None, :, None]
        return x.to(dtype)

    def slice_heads(self, start: int, end: int) -> "QuantizedHeads":
        return QuantizedHeads(self.data[:, :, start:end], self.scale[:, start:end], self.block)


def _check_hadamard(dim: int, block: int) -> None:
    if block <= 0 or block & (block - 1) or dim % block:
        raise ValueError(f"Hadamard block {block} must be a power of two dividing the head size {dim}")


def hadamard_matrix(dim: int, block: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Block-diagonal orthonormal Sylvester Hadamard: `block` x `block` blocks along a `dim` axis."""
    _check_hadamard(dim, block)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(block)
    return torch.block_diag(*([h] * (dim // block))).to(device=device, dtype=dtype)


def _check(x: torch.Tensor, fmt, granularity: str, hadamard: int, norm: bool) -> None:
    if x.ndim != 4:
        raise ValueError(f"expected (batch, seq, heads, head_dim), got {list(x.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "per_head_bound" and fmt is not None:
        if fmt != "fp8":
            raise ValueError(f"per_head_bound scales are for fp8 (a floating-point format) only; {fmt} codes lose "
                             f"precision under a loose scale: use per_head or per_block")
        if not norm:
            raise ValueError("per_head_bound scales need the RMSNorm (it bounds each row's norm); "
                             "use per_head without it")
    if hadamard:
        _check_hadamard(x.shape[-1], hadamard)


@functools.lru_cache(maxsize=8)
def _fp32_inv_sqrt(block: int) -> float:
    """1/sqrt(block) as the fp32 entry of `hadamard_matrix` holds it."""
    return float(torch.tensor(1.0 / math.sqrt(block)).float())


def bound_scale(weight: torch.Tensor | None, d: int, mean: torch.Tensor | None, batch: int, heads: int,
                device) -> torch.Tensor:
    """(batch, heads) FP8 scales from the bound on |value| (module docstring): max|w| sqrt(D), times the
    rounding margin, plus each head's |mean key| ((batch, heads, D) or None) when keys are smoothed."""
    wmax = weight.detach().float().abs().amax() if weight is not None else torch.ones((), device=device)
    bound = (wmax * (BOUND_MARGIN * math.sqrt(d))).expand(batch, heads)
    if mean is not None:
        bound = bound + torch.linalg.vector_norm(mean.float(), dim=-1)
    return (bound.clamp_min(_MIN_AMAX) / QMAX["fp8"]).contiguous()


def norm_eps(norm: torch.nn.RMSNorm, dtype: torch.dtype) -> float:
    """The eps nn.RMSNorm uses (None means the dtype's machine epsilon)."""
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(dtype).eps)


# ----------------------------------------------------------------------------------------- reference
def reference_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        rope: tuple[torch.Tensor, torch.Tensor] | None, norm: bool = True) -> torch.Tensor:
    """Per-head RMSNorm (fp32 math, one rounding) then split-half RoPE on the first R channels, rounding to
    x's dtype after every product and sum as eager PyTorch does."""
    dt = x.dtype
    y = x
    if norm:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        y = y.to(dt)
    if rope is None:
        return y
    cos, sin = (t.to(dt)[None, :, None, :] for t in rope)
    r = cos.shape[-1]
    half = r // 2
    rot = y[..., :r]
    partner = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + partner * sin, y[..., r:]], dim=-1)


def _quantize_reference(y: torch.Tensor, fmt: str, granularity: str,
                        bound: torch.Tensor | None = None) -> QuantizedHeads:
    b, s, h, d = y.shape
    qmax = QMAX[fmt]
    if granularity != "per_block":
        if bound is None:
            amax = y.abs().amax(dim=(1, 3))  # (B, H)
            scale = amax.clamp_min(_MIN_AMAX) / qmax
        else:
            scale = bound
        q = y / scale[:, None, :, None]
        block = 0
    else:
        n = -(-s // BLOCK_TOKENS)
        pad = n * BLOCK_TOKENS - s
        yp = torch.nn.functional.pad(y, (0, 0, 0, 0, 0, pad)).view(b, n, BLOCK_TOKENS, h, d)
        amax = yp.abs().amax(dim=(2, 4)).permute(0, 2, 1)  # (B, H, n)
        scale = amax.clamp_min(_MIN_AMAX) / qmax
        q = (yp / scale.permute(0, 2, 1)[:, :, None, :, None]).reshape(b, n * BLOCK_TOKENS, h, d)[:, :s]
        block = BLOCK_TOKENS
    if fmt == "fp8":
        data = q.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    else:
        data = torch.round(q).clamp(-qmax, qmax).to(torch.int8)  # round half to even, like the kernel
    return QuantizedHeads(data, scale.float().contiguous(), block)


def reference_prepare_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                            rope: tuple[torch.Tensor, torch.Tensor] | None, *, norm: bool = True,
                            smooth: bool = False, hadamard: int = 0, fmt: str | None = None,
                            granularity: str = "per_head") -> torch.Tensor | QuantizedHeads:
    """Plain-PyTorch reference of `prepare_heads` (same arguments, same result up to fp32 summation order)."""
    _check(x, fmt, granularity, hadamard, norm)
    y = reference_norm_rope(x, weight, eps, rope, norm)
    if not (smooth or hadamard or fmt):
        return y
    yf = y.float()
    mean = None
    if smooth:
        mean = yf.mean(dim=1, keepdim=True)
        yf = yf - mean
    if hadamard:
        yf = yf @ hadamard_matrix(x.shape[-1], hadamard, device=x.device)
    if fmt is None:
        return yf.to(x.dtype)
    bound = None
    if granularity == "per_head_bound":
        b, _, h, d = x.shape
        bound = bound_scale(weight, d, None if mean is None else mean[:, 0], b, h, x.device)
    return _quantize_reference(yf, fmt, granularity, bound)


# ----------------------------------------------------------------------------------------- Triton kernel
if triton is not None:

    @triton.jit
    def _hadamard_signs(BLOCK_D: tl.constexpr, HB: tl.constexpr):
        # The block-diagonal Sylvester Hadamard scaled to +-1 (0 off the blocks), made in registers: entry
        # (i, j) is (-1)^popcount(i & j & (HB - 1)) inside a block. Exact in bf16, and no matrix to read.
        i = tl.arange(0, BLOCK_D)
        v = i[:, None] & i[None, :] & (HB - 1)
        v = v ^ (v >> 8)
        v = v ^ (v >> 4)
        v = v ^ (v >> 2)
        v = v ^ (v >> 1)
        same = ((i[:, None] ^ i[None, :]) & ~(HB - 1)) == 0
        return tl.where(same, tl.where((v & 1) == 0, 1.0, -1.0), 0.0).to(tl.bfloat16)

    @triton.jit
    def _times_signs(t, hm, SPLIT: tl.constexpr):
        # t @ hm in fp32, hm exact (+-1 or 0) in bf16. SPLIT (GPUs): t as two bf16 parts (hi + lo carries 16
        # significant bits, more than the tf32 a plain fp32 dot would use) on the bf16 tensor cores. One bf16
        # part alone measured no faster on the H200 and moved 6 % of the FP8 codes. The CPU interpreter gets
        # bf16 dots wrong and takes the fp32 dot (exact there) instead.
        if SPLIT:
            hi = round_bf16(t)
            acc = tl.dot(hi.to(tl.bfloat16), hm, out_dtype=tl.float32)
            return tl.dot((t - hi).to(tl.bfloat16), hm, acc, out_dtype=tl.float32)
        return tl.dot(t, hm.to(tl.float32), out_dtype=tl.float32)

    @triton.jit
    def _rotate(y, norm_scale, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr,
                KRONECKER: tl.constexpr, SPLIT: tl.constexpr):
        # y @ H in fp32. KRONECKER (128-wide heads): Sylvester H128 = H8 (x) H16 (entry (i, j) is
        # (-1)^popcount(i & j), and the low 4 and high 3 bits of i & j count apart), so H16 acts on each
        # 16-channel group, then H8 across the groups as 16-wide dots on pairs of regrouped rows. 16x16
        # matrices instead of one 128x128: 0.48 vs 0.70 ms for the FP8 K pass on the H200 (fewer registers
        # and less shared memory, so more programs in flight). Smaller blocks use the low bits of the
        # second step (block-diagonal signs).
        if KRONECKER:
            t = _times_signs(tl.reshape(y, (BLOCK_S * 8, 16)), _hadamard_signs(16, 16), SPLIT)
            if HB > 16:
                # rows (token, j0 // 2), columns (j0 % 2) * 8 + group: the group index is now innermost
                t = tl.reshape(tl.permute(tl.reshape(t, (BLOCK_S, 8, 16)), (0, 2, 1)), (BLOCK_S * 8, 16))
                t = _times_signs(t, _hadamard_signs(16, HB // 16), SPLIT)
                t = tl.permute(tl.reshape(t, (BLOCK_S, 16, 8)), (0, 2, 1))
            t = tl.reshape(t, (BLOCK_S, BLOCK_D))
        else:
            t = _times_signs(y, _hadamard_signs(BLOCK_D, HB), SPLIT)
        return t * norm_scale

    @triton.jit
    def _gain(w_ptr, d, dmask, R, NORM: tl.constexpr, ROPE: tl.constexpr):
        # What every token of a program shares: the norm gain, in channel and in RoPE-partner order.
        w = 0.0
        wp = 0.0
        sign = 0.0
        rot = d < 0
        partner = d
        if NORM:
            w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        if ROPE:
            half = R // 2
            partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
            if NORM:
                wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
            rot = d < R
            sign = tl.where(d < half, -1.0, 1.0)
        return w, wp, sign, rot, partner

    @triton.jit
    def _rope_rows(cos_ptr, sin_ptr, rows, rmask, d, rot, scs, ROPE: tl.constexpr, TABLES_ROUNDED: tl.constexpr,
                   RND: tl.constexpr):
        # The tile's tokens' cos / sin rows (every head of the tile shares them).
        c = 0.0
        sn = 0.0
        if ROPE:
            tmask = rmask[:, None] & rot[None, :]
            c = tl.load(cos_ptr + rows[:, None] * scs + d[None, :], mask=tmask, other=1.0).to(tl.float32)
            sn = tl.load(sin_ptr + rows[:, None] * scs + d[None, :], mask=tmask, other=0.0).to(tl.float32)
            if not TABLES_ROUNDED:  # fp32 tables for a bf16/fp16 model: round them as eager does
                c = rnd(c, RND)
                sn = rnd(sn, RND)
        return c, sn

    @triton.jit
    def _norm_rope(base, rows, d, m, sxs, w, wp, c, sn, sign, rot, partner, eps, D, NORM: tl.constexpr,
                   ROPE: tl.constexpr, RND: tl.constexpr):
        # One head of a tile: RMSNorm, then RoPE on the first R channels, rounding where eager does.
        x = tl.load(base + rows[:, None] * sxs + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = x
        if NORM:
            rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
            y = rnd(x * rstd[:, None] * w[None, :], RND)
        if ROPE:
            yp = tl.load(base + rows[:, None] * sxs + partner[None, :], mask=m, other=0.0).to(tl.float32)
            if NORM:
                yp = rnd(yp * rstd[:, None] * wp[None, :], RND)
            # eager: rot * cos + cat(-x2, x1) * sin, each product and the sum rounded to x's dtype
            a = rnd(y * c, RND)
            p = rnd((yp * sign[None, :]) * sn, RND)
            y = tl.where(rot[None, :], rnd(a + p, RND), y)
        return y

    @triton.jit
    def _qk_prep_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, mean_ptr, scale_ptr, out_ptr, part_ptr,
                        S, H, D, R, N_TILES, eps, had_scale, sxb, sxs, sxh, sob, sos, soh, scs,
                        STAGE: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, SMOOTH: tl.constexpr,
                        HADAMARD: tl.constexpr, FMT: tl.constexpr, PER_BLOCK: tl.constexpr, RND: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_DOT: tl.constexpr,
                        TABLES_ROUNDED: tl.constexpr, KRONECKER: tl.constexpr, HEADS: tl.constexpr):
        # One program = BLOCK_S tokens of HEADS heads of one batch row, one head after the other: the RoPE
        # rows and the norm gain are loaded once for all of them. STAGE 1 = partial absmax (for per-head
        # scales), 2 = write the output (the smoothing mean has its own kernel, `_key_sum_kernel`). Each stage
        # recomputes the norm + RoPE from the raw input: re-reading bf16 costs what storing an intermediate would.
        # Head groups vary fastest across programs: programs in flight together share their tokens' RoPE
        # rows (from cache) and read neighbouring memory.
        pid_g = tl.program_id(0)
        pid_s = tl.program_id(1)
        groups = H // HEADS
        b = pid_g // groups
        h0 = (pid_g % groups) * HEADS
        rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        rmask = rows < S
        dmask = d < D
        m = rmask[:, None] & dmask[None, :]
        w, wp, sign, rot, partner = _gain(w_ptr, d, dmask, R, NORM, ROPE)
        c, sn = _rope_rows(cos_ptr, sin_ptr, rows, rmask, d, rot, scs, ROPE, TABLES_ROUNDED, RND)
        for j in range(HEADS):
            h = h0 + j
            pid_bh = b * H + h
            y = _norm_rope(x_ptr + b * sxb + h * sxh, rows, d, m, sxs, w, wp, c, sn, sign, rot, partner, eps, D,
                           NORM, ROPE, RND)
            if SMOOTH:
                mu = tl.load(mean_ptr + pid_bh * BLOCK_D + d, mask=dmask, other=0.0)
                y = y - mu[None, :]
            y = tl.where(m, y, 0.0)
            if HADAMARD:
                y = _rotate(y, had_scale, BLOCK_S, BLOCK_D, HADAMARD, KRONECKER, SPLIT_DOT)
            optr = out_ptr + b * sob + h * soh + rows[:, None] * sos + d[None, :]
            if FMT == 0:
                if STAGE == 2:
                    tl.store(optr, rnd_store(y, RND).to(out_ptr.dtype.element_ty), mask=m)
            else:
                amax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)
                if STAGE == 1:
                    tl.store(part_ptr + pid_bh * N_TILES + pid_s, amax)
                else:
                    if FMT == 1:
                        qmax = 448.0
                    else:
                        qmax = 127.0
                    if PER_BLOCK:
                        scale = tl.maximum(amax, 1e-20) / qmax
                        tl.store(scale_ptr + pid_bh * N_TILES + pid_s, scale)
                    else:
                        scale = tl.load(scale_ptr + pid_bh)
                    q = div_by(y, scale, tl.math.div_rn(1.0, scale))
                    q = tl.minimum(tl.maximum(q, -qmax), qmax)
                    if FMT == 1:
                        tl.store(optr, store_e4m3(q), mask=m)
                    else:
                        tl.store(optr, rint(q).to(tl.int8), mask=m)

    @triton.jit
    def _key_sum_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, part_ptr, S, H, D, R, N_PARTS, eps, sxb, sxs, sxh, scs,
                        NORM: tl.constexpr, ROPE: tl.constexpr, RND: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr, TABLES_ROUNDED: tl.constexpr, TILES: tl.constexpr):
        # The smoothing mean's partial sums: TILES consecutive tiles of one head per program, added up in
        # registers, one partial row stored. (One program per tile stored 611 x 56 partial rows at S = 19,540
        # and reduced across warps once per tile.) Heads vary fastest across programs, as in the main kernel.
        pid_bh = tl.program_id(0)
        pid_p = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        w, wp, sign, rot, partner = _gain(w_ptr, d, dmask, R, NORM, ROPE)
        acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        for t in range(TILES):
            rows = (pid_p * TILES + t) * BLOCK_S + tl.arange(0, BLOCK_S)
            rmask = rows < S
            m = rmask[:, None] & dmask[None, :]
            c, sn = _rope_rows(cos_ptr, sin_ptr, rows, rmask, d, rot, scs, ROPE, TABLES_ROUNDED, RND)
            y = _norm_rope(x_ptr + b * sxb + h * sxh, rows, d, m, sxs, w, wp, c, sn, sign, rot, partner, eps, D,
                           NORM, ROPE, RND)
            acc += tl.where(m, y, 0.0)
        tl.store(part_ptr + (pid_bh * N_PARTS + pid_p) * BLOCK_D + d, tl.sum(acc, axis=0))


def heads_per_program(heads: int) -> int:
    """The exact pass's head group: the largest divisor of `heads` up to EXACT_HEADS."""
    return max(g for g in range(1, EXACT_HEADS + 1) if heads % g == 0)


def prepare_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  rope: tuple[torch.Tensor, torch.Tensor] | None, *, norm: bool = True, smooth: bool = False,
                  hadamard: int = 0, fmt: str | None = None,
                  granularity: str = "per_head") -> torch.Tensor | QuantizedHeads:
    """The fused kernel; see `reference_prepare_heads` for the math. x is (B, S, H, D) with unit last stride."""
    require_kernels("the fused Q/K preparation")
    _check(x, fmt, granularity, hadamard, norm)
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, s, h, d = x.shape
    block_d = triton.next_power_of_2(d)
    if hadamard and block_d != d:
        raise ValueError(f"the Hadamard rotation needs a power-of-two head size, got {d}")
    # Per-block scales fix the tile at BLOCK_TOKENS; the rotation's tile and warps are launch choices.
    kronecker = hadamard >= 16 and block_d == 128
    tile = BLOCK_TOKENS
    if hadamard and granularity != "per_block":
        tile = KRONECKER_TILE_TOKENS if kronecker else HADAMARD_TILE_TOKENS
    warps = HADAMARD_WARPS if hadamard else NUM_WARPS
    group = 1
    if fmt is None and not hadamard and not smooth:
        tile, warps, group = EXACT_TILE_TOKENS, EXACT_WARPS, heads_per_program(h)
    n_tiles = triton.cdiv(s, tile)
    dev = x.device
    kernel = _qk_prep_kernel
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    w = weight if (norm and weight is not None) else torch.ones(d, device=dev, dtype=torch.float32)
    if rope is not None:
        # Tables in x's dtype are read as they are (the kernel rounds fp32 ones to it: same values, twice the bytes).
        cos, sin = (t.contiguous() if t.dtype == x.dtype else t.float().contiguous() for t in rope)
        r = cos.shape[-1]
        if cos.shape[0] != s or r > d or r % 2:
            raise ValueError(f"RoPE tables {list(cos.shape)} do not fit {s} tokens of head size {d}")
    else:
        cos = sin = dummy
        r = 0
    grid = (b * h // group, n_tiles)
    had_scale = _fp32_inv_sqrt(hadamard) if hadamard else 1.0

    def launch(stage, out, part, mean, scale, fmt_code, per_block):
        so = out.stride() if out.ndim == 4 else (0, 0, 0, 1)
        kernel[grid](x, w, cos, sin, mean, scale, out, part, s, h, d, r, n_tiles, float(eps), had_scale,
                     x.stride(0), x.stride(1), x.stride(2), so[0], so[1], so[2], r,
                     STAGE=stage, NORM=norm, ROPE=rope is not None, SMOOTH=smooth and mean is not dummy,
                     HADAMARD=hadamard, FMT=fmt_code, PER_BLOCK=per_block, BLOCK_S=tile,
                     RND=round_code(x.dtype), BLOCK_D=block_d, SPLIT_DOT=not INTERPRETED,
                     TABLES_ROUNDED=cos.dtype == x.dtype, KRONECKER=kronecker, HEADS=group, num_warps=warps)

    mean = dummy
    if smooth:
        mean = _key_mean(x, w, cos, sin, r, eps, block_d, norm)
    if fmt is None:
        out = torch.empty(b, s, h, d, device=dev, dtype=x.dtype)
        launch(2, out, dummy, mean, dummy, 0, False)
        return out
    fmt_code = 1 if fmt == "fp8" else 2
    out = torch.empty(b, s, h, d, device=dev, dtype=QDTYPE[fmt])
    if granularity == "per_head_bound":
        scale = bound_scale(weight, d, mean.view(b, h, block_d)[..., :d] if smooth else None, b, h, dev)
        launch(2, out, dummy, mean, scale, fmt_code, False)
        return QuantizedHeads(out, scale, 0)
    if granularity == "per_head":
        part = torch.empty(b * h, n_tiles, device=dev, dtype=torch.float32)
        launch(1, out, part, mean, dummy, fmt_code, False)
        scale = (part.amax(dim=1).clamp_min(_MIN_AMAX) / QMAX[fmt]).contiguous()
        launch(2, out, dummy, mean, scale, fmt_code, False)
        return QuantizedHeads(out, scale.view(b, h), 0)
    scale = torch.empty(b * h, n_tiles, device=dev, dtype=torch.float32)
    launch(2, out, dummy, mean, scale, fmt_code, True)
    return QuantizedHeads(out, scale.view(b, h, n_tiles), BLOCK_TOKENS)


def _key_mean(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, eps: float,
              block_d: int, norm: bool) -> torch.Tensor:
    """(B * H, block_d) fp32 mean over the sequence of the (normed, RoPE'd) keys (`_key_sum_kernel`)."""
    b, s, h, d = x.shape
    n_parts = triton.cdiv(triton.cdiv(s, KEY_SUM_TILE_TOKENS), KEY_SUM_TILES)
    part = torch.empty(b * h, n_parts, block_d, device=x.device, dtype=torch.float32)
    _key_sum_kernel[(b * h, n_parts)](x, w, cos, sin, part, s, h, d, r, n_parts, float(eps), x.stride(0), x.stride(1),
                                      x.stride(2), r, NORM=norm, ROPE=r > 0, RND=round_code(x.dtype),
                                      BLOCK_S=KEY_SUM_TILE_TOKENS, BLOCK_D=block_d,
                                      TABLES_ROUNDED=cos.dtype == x.dtype, TILES=KEY_SUM_TILES,
                                      num_warps=KEY_SUM_WARPS)
    return (part.sum(dim=1) / s).contiguous()

# ----------------------------------------------------------------------------------------- the hook
class FusedQKPrep:
    """`H3DiT.qk_prep` hook: Q and K each prepared in one pass (Triton) or by the reference.

    fmt None returns tensors in the model dtype (for exact backends, and for Sage with `hadamard`);
    "fp8"/"int8" return `QuantizedHeads` for a backend that takes pre-quantized Q/K (fa3_fp8).
    """

    def __init__(self, fmt: str | None = None, smooth_k: bool = False, hadamard: int = 0,
                 granularity: str = "per_head", use_triton: bool = True):
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.smooth_k, self.hadamard = fmt, smooth_k, hadamard
        self.granularity, self.use_triton = granularity, use_triton
        # (cos, sin, dtype, tables rounded to dtype): the last RoPE pair handed to the kernel
        self._rope_cache: tuple | None = None

    def __call__(self, attn, q: torch.Tensor, k: torch.Tensor, rope):
        fn = prepare_heads if self.use_triton else reference_prepare_heads
        if self.use_triton:
            rope = self._tables(rope, q.dtype)
        opts = dict(hadamard=self.hadamard, fmt=self.fmt, granularity=self.granularity)
        qp = fn(q, attn.norm_q.weight, norm_eps(attn.norm_q, q.dtype), rope, **opts)
        kp = fn(k, attn.norm_k.weight, norm_eps(attn.norm_k, k.dtype), rope, smooth=self.smooth_k, **opts)
        return qp, kp

    def _tables(self, rope, dtype: torch.dtype):
        """The RoPE tables rounded to the activation dtype, as the kernel would round them, made once per table
        pair (the DiT reuses one pair for every block): half the bytes each call reads."""
        if rope is None or rope[0].dtype == dtype:
            return rope
        cached = self._rope_cache
        if cached is None or cached[0] is not rope[0] or cached[1] is not rope[1] or cached[2] != dtype:
            cached = self._rope_cache = (rope[0], rope[1], dtype, (rope[0].to(dtype), rope[1].to(dtype)))
        return cached[3]

    @property
    def exact(self) -> bool:
        return self.fmt is None and not self.smooth_k and not self.hadamard

    def describe(self) -> dict:
        return {"impl": "triton" if self.use_triton else "pytorch-reference", "format": self.fmt or "model dtype",
                "k_smoothing": self.smooth_k, "hadamard_block": self.hadamard,
                "scales": self.granularity if self.fmt else None, "exact": self.exact}
