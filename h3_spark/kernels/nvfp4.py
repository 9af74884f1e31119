"""NVFP4 linears for Blackwell: FP4 weights x FP4 activations through comfy-kitchen's `scaled_mm_nvfp4`
(cuBLASLt block-scaled FP4, compute capability >= 10.0; it fails on Hopper: cuBLASLt refuses the call there).

Our part is the activation side, one Triton pass per producer:
- plain: quantize a bf16 (M, K) activation;
- SwiGLU (H3_SWIGLU_NVFP4_FUSION): `value * silu(gate)` of the fc1 output, quantized for fc2, so the
  (M, 14336) bf16 intermediate is never written;
- RMSNorm + AdaLN (H3_RMS_ADALN_NVFP4_FUSION): the block's norm + per-row modulation quantized once for
  the q/k/v projections (and once for fc1), instead of writing bf16 and quantizing it per linear.
Each producer rounds exactly as the eager op it replaces, then quantizes with comfy-kitchen's layout
(the layout `nvfp4_codec` documents): E2M1 codes, even element in the high nibble, one e4m3 scale per 16 values in the
cuBLAS 128x4 blocked layout, one fp32 global scale = amax / (448 * 6) taken over the whole activation
(a first pass of the same kernel). `reference_quantize_nvfp4` is the plain-PyTorch definition; the
tests compare both with comfy-kitchen's eager quantizer byte for byte.

Nothing here runs on Hopper: the FP4 GEMM needs Blackwell, so on an H200 H3_LINEAR=nvfp4 is an error
and NVFP4 checkpoints are dequantized (bf16) or converted (fp8) at load instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._triton import require_kernels, rnd, round_code, round_e4m3, tl, triton  # noqa: F401
from .modulation import FusedRowModulation
from .nvfp4_codec import (decode_codes, dequantize, pack_codes, round_to_e2m1, swizzle_scales, unpack_codes,
                          unswizzle_scales)
from .qk_prep import norm_eps
from .references import RowModulation, SwiGLU

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
CHUNK = 256  # values per inner step: 16 scale blocks


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Nvfp4Activation:
    """A quantized activation: packed (M, K/2) uint8, blocked e4m3 scales, fp32 global scale; `shape` is the
    logical (..., K) shape it stands for, so model code that only reads `.shape` passes it through."""

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        # Activations have any number of rows (weights are padded to 16), so decode here with the
        # checkpoint module's layout helpers rather than its weight dequantizer.
        m, k = self.packed.shape[0], self.packed.shape[1] * 2
        values = decode_codes(unpack_codes(self.packed), torch.float32)
        scales = unswizzle_scales(self.block_scales, m, k // BLOCK).float() * self.global_scale.float()
        out = (values.reshape(m, k // BLOCK, BLOCK) * scales[..., None]).reshape(m, k)
        return out.to(dtype).reshape(self.shape)


def global_scale_for(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / (E4M3_MAX * E2M1_MAX)).reshape(())


def reference_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) with K % 16 == 0 -> (packed uint8 (M, K/2), blocked e4m3 scales (roundup(M,128), roundup(K/16,4)))."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"NVFP4 activations need K divisible by {BLOCK}, got {k}")
    g = global_scale.float().reshape(())
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    s = (blocks.abs().amax(dim=-1) / E2M1_MAX / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = g * s.float()
    zero = total == 0
    scaled = blocks / torch.where(zero, torch.ones_like(total), total)[..., None]
    scaled = torch.where(zero[..., None], torch.zeros_like(scaled), scaled).clamp(-E2M1_MAX, E2M1_MAX)
    return pack_codes(round_to_e2m1(scaled.reshape(m, k))), swizzle_scales(s)


def saturated_blocks(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """How many 16-value blocks of an (M, K) activation a global scale cannot represent: their e4m3 block scale
    clamps at 448 (and their values at +-6 times it), as NVFP4 quantization saturates. Zero when the global
    scale came from this activation's own amax."""
    m, k = x.shape
    g = global_scale.float().reshape(())
    return (x.float().reshape(m, k // BLOCK, BLOCK).abs().amax(dim=-1) / E2M1_MAX / g > E4M3_MAX).sum()


@dataclass
class StaticInput:
    """A layer's static activation global scale (fp32, 0-d, on the layer's device) and its saturation counter
    (int32, 1 element, same device; added to on the device, read only when a report asks, so no call waits)."""

    scale: torch.Tensor
    saturated: torch.Tensor

    @classmethod
    def of(cls, global_scale: float, device) -> "StaticInput":
        return cls(torch.tensor(global_scale, dtype=torch.float32, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))


def reference_activation(x: torch.Tensor, static: StaticInput | None = None) -> Nvfp4Activation:
    """The plain-PyTorch NVFP4 encoding of a (..., K) activation: the global scale is its amax / (448 * 6)
    (the reduction the Triton path runs as a first pass), or the static one, whose saturated blocks are
    counted."""
    x2 = x.reshape(-1, x.shape[-1])
    if static is None:
        g = global_scale_for(x2.float().abs().amax().clamp_min(1e-30))
    else:
        g = static.scale.float().reshape(())
        static.saturated += saturated_blocks(x2, g).to(torch.int32)
    packed, scales = reference_quantize_nvfp4(x2, g)
    return Nvfp4Activation(packed, scales, g, x.shape)


def reference_swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    value, gate = fc1_out.chunk(2, dim=-1)
    return value * torch.nn.functional.silu(gate)


if triton is not None:

    @triton.jit
    def _produce(x_ptr, w_ptr, a_ptr, b_ptr, row, r, c, m, rstd, sx, tab_stride, F,
                 PRODUCER: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr):
        # The value an eager producer would have written at columns c of this row, in fp32.
        if PRODUCER == 1:
            val = tl.load(x_ptr + row * sx + c, mask=m, other=0.0).to(tl.float32)
            gate = tl.load(x_ptr + row * sx + F + c, mask=m, other=0.0).to(tl.float32)
            silu = rnd(gate / (1.0 + tl.exp(-gate)), RND)
            v = rnd(val * silu, RND)
        else:
            v = tl.load(x_ptr + row * sx + c, mask=m, other=0.0).to(tl.float32)
            if PRODUCER == 2:
                v = v * rstd
                if HAS_W:
                    v = v * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
                v = rnd(v, RND)
                sc = tl.load(b_ptr + r * tab_stride + c, mask=m, other=0.0).to(tl.float32)
                sh = tl.load(a_ptr + r * tab_stride + c, mask=m, other=0.0).to(tl.float32)
                v = rnd(rnd(v * rnd(1.0 + sc, RND), RND) + sh, RND)
        return v

    @triton.jit
    def _nvfp4_kernel(x_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, amax_ptr, g_ptr, q_ptr, s_ptr, sat_ptr,
                      S, sx, tab_stride, eps, N_SCALE_COLS,
                      K: tl.constexpr, PRODUCER: tl.constexpr, STAGE: tl.constexpr, HAS_W: tl.constexpr,
                      RND: tl.constexpr, CHUNK: tl.constexpr, COUNT: tl.constexpr):
        # One program per row. STAGE 0: absmax of the produced row into amax_ptr (atomic); STAGE 1: encode.
        # COUNT (a static global scale): the row's blocks whose scale clamps at 448 are added to sat_ptr.
        # PRODUCER 0: x itself; 1: SwiGLU of [value | gate] (K = ffn width, x has 2K columns);
        # 2: RMSNorm (weight w) + modulation with table rows a = shift, b = scale picked by rows[row % S].
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        rstd = 1.0
        r = 0
        if PRODUCER == 2:
            r = tl.load(rows_ptr + row % S).to(tl.int64)
            acc = tl.zeros([CHUNK], dtype=tl.float32)
            for off in range(0, K, CHUNK):
                c = off + cols
                x = tl.load(x_ptr + row * sx + c, mask=c < K, other=0.0).to(tl.float32)
                acc += x * x
            rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / K + eps)
        if STAGE == 0:
            amax = tl.zeros([CHUNK], dtype=tl.float32)
            for off in range(0, K, CHUNK):
                c = off + cols
                v = _produce(x_ptr, w_ptr, a_ptr, b_ptr, row, r, c, c < K, rstd, sx, tab_stride, K,
                             PRODUCER, HAS_W, RND)
                amax = tl.maximum(amax, tl.abs(v))
            tl.atomic_max(amax_ptr, tl.max(amax, axis=0))
        else:
            g = tl.load(g_ptr)
            j = tl.arange(0, CHUNK // 16)
            over = tl.zeros([CHUNK // 16], dtype=tl.int32)
            for off in range(0, K, CHUNK):
                c = off + cols
                m = c < K
                v = _produce(x_ptr, w_ptr, a_ptr, b_ptr, row, r, c, m, rstd, sx, tab_stride, K,
                             PRODUCER, HAS_W, RND)
                vb = tl.reshape(v, (CHUNK // 16, 16))
                s = tl.max(tl.abs(vb), axis=1) / 6.0 / g
                if COUNT:
                    over += ((s > 448.0) & (off // 16 + j < N_SCALE_COLS)).to(tl.int32)
                s = round_e4m3(tl.minimum(s, 448.0))
                total = g * s
                zero = total == 0.0
                scaled = tl.math.div_rn(vb, tl.where(zero, 1.0, total)[:, None])
                scaled = tl.where(zero[:, None], 0.0, scaled)
                scaled = tl.minimum(tl.maximum(scaled, -6.0), 6.0)
                mag = tl.abs(scaled)
                # E2M1 magnitude index, nearest with ties to the even index (midpoints of {0,.5,1,1.5,2,3,4,6})
                idx = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32) \
                    + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32) \
                    + (mag > 5.0).to(tl.int32)
                code = idx | ((scaled.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << 3)
                pairs = tl.reshape(code, (CHUNK // 2, 2))
                even, odd = tl.split(pairs)
                byte = ((even << 4) | odd).to(tl.uint8)
                pc = off // 2 + tl.arange(0, CHUNK // 2)
                tl.store(q_ptr + row * (K // 2) + pc, byte, mask=pc < K // 2)
                # blocked (cuBLAS 128x4) position of scale (row, block column)
                bc = off // 16 + j
                tile = (row // 128) * ((N_SCALE_COLS + 3) // 4) + bc // 4
                pos = tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + (bc % 4)
                tl.store(s_ptr + pos, s.to(tl.float8e4nv), mask=bc * 16 < K)
            if COUNT:
                tl.atomic_add(sat_ptr, tl.sum(over, axis=0))


def _encode(x: torch.Tensor, producer: int, k: int, rows_total: int, *, w=None, a=None, b=None, rows=None,
            s_len: int = 1, tab_stride: int = 0, eps: float = 0.0, static: StaticInput | None = None):
    require_kernels("the NVFP4 activation quantizer")
    if k % BLOCK:
        raise ValueError(f"NVFP4 activations need K divisible by {BLOCK}, got {k}")
    dev = x.device
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    idx = rows if rows is not None else torch.zeros(1, device=dev, dtype=torch.int32)
    common = dict(K=k, PRODUCER=producer, HAS_W=w is not None, RND=round_code(x.dtype), CHUNK=CHUNK, num_warps=4)
    args = (x, w if w is not None else dummy, a if a is not None else dummy, b if b is not None else dummy, idx)
    if static is None:
        # The per-call amax reduction a static scale removes: one more pass over the produced rows.
        amax = torch.zeros(1, device=dev, dtype=torch.float32)
        _nvfp4_kernel[(rows_total,)](*args, amax, dummy, dummy, dummy, dummy, s_len, x.stride(0), tab_stride, eps, 1,
                                     STAGE=0, COUNT=False, **common)
        global_scale, saturated = global_scale_for(amax.clamp_min(1e-30)), dummy
    else:
        global_scale, saturated = static.scale, static.saturated
    g = global_scale.float().reshape(1).contiguous()
    n_scale_cols = k // BLOCK
    packed = torch.empty(rows_total, k // 2, device=dev, dtype=torch.uint8)
    scales = torch.zeros(roundup(rows_total, 128), roundup(n_scale_cols, 4), device=dev, dtype=torch.float8_e4m3fn)
    _nvfp4_kernel[(rows_total,)](*args, dummy, g, packed, scales, saturated, s_len, x.stride(0), tab_stride, eps,
                                 n_scale_cols, STAGE=1, COUNT=static is not None, **common)
    return packed, scales, g.reshape(())


def quantize_nvfp4(x: torch.Tensor, static: StaticInput | None = None) -> Nvfp4Activation:
    """Quantize a (..., K) activation; the global scale is its amax / (448 * 6), or the static one."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    packed, scales, g = _encode(x2, 0, x2.shape[1], x2.shape[0], static=static)
    return Nvfp4Activation(packed, scales, g, x.shape)


def swiglu_quantize_nvfp4(fc1_out: torch.Tensor, static: StaticInput | None = None) -> Nvfp4Activation:
    """value * silu(gate) of an fc1 output [value | gate], encoded for fc2 without writing it in bf16."""
    x2 = fc1_out.reshape(-1, fc1_out.shape[-1]).contiguous()
    f = x2.shape[1] // 2
    packed, scales, g = _encode(x2, 1, f, x2.shape[0], static=static)
    return Nvfp4Activation(packed, scales, g, torch.Size((*fc1_out.shape[:-1], f)))


def rms_adaln_quantize_nvfp4(x: torch.Tensor, norm: nn.RMSNorm, shift: torch.Tensor, scale: torch.Tensor,
                             rows: torch.Tensor, static: StaticInput | None = None) -> Nvfp4Activation:
    """RMSNorm(x) * (1 + scale[rows]) + shift[rows], encoded for the next GEMM without writing it in bf16."""
    x = x.contiguous()
    bsz, s, d = x.shape
    if shift.stride(-1) != 1 or scale.stride(-1) != 1 or shift.stride(0) != scale.stride(0):
        shift, scale = shift.contiguous(), scale.contiguous()
    eps = norm_eps(norm, x.dtype)
    packed, scales, g = _encode(x.view(bsz * s, d), 2, d, bsz * s, w=norm.weight, a=shift, b=scale,
                                rows=rows, s_len=s, tab_stride=shift.stride(0), eps=eps, static=static)
    return Nvfp4Activation(packed, scales, g, x.shape)


def nvfp4_linear_reference(a: Nvfp4Activation, packed_w: torch.Tensor, scales_w: torch.Tensor,
                           global_w: torch.Tensor, n: int, out_dtype=torch.bfloat16) -> torch.Tensor:
    """What the FP4 GEMM computes, in fp32: dequantized activation times dequantized weight."""
    k = a.shape[-1]
    w = dequantize(packed_w, scales_w, global_w, (n, k), torch.float32)
    out = a.dequantize(torch.float32).reshape(-1, k) @ w.t()
    return out.to(out_dtype).reshape(*a.shape[:-1], n)


class Nvfp4Linear(nn.Module):
    """Bias-free linear on Blackwell: NVFP4 weight (comfy layout) x NVFP4 activation, scaled_mm_nvfp4."""

    def __init__(self, packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
                 shape: tuple[int, int], out_dtype: torch.dtype, source: str):
        super().__init__()
        n, k = shape
        if n % 16 or k % 32:
            raise ValueError(f"the FP4 GEMM needs N % 16 == 0 and K % 32 == 0, got {n}x{k}")
        self.out_features, self.in_features = n, k
        self.register_buffer("weight", packed)
        self.register_buffer("weight_scale", block_scales)
        self.register_buffer("weight_scale_2", global_scale.float().reshape(()))
        self.out_dtype, self.source = out_dtype, source
        # `emulate`: the reference quantizer and an fp32 GEMM of both dequantized operands (what the FP4 tensor
        # cores compute up to accumulation order), on any device: calibration and the promotion gate run so.
        self.emulate = False
        # A static activation global scale (nvfp4_static.py) replaces the per-call amax reduction while
        # `static_on`; a request outside the calibrated shapes turns it off for its duration.
        self.static: StaticInput | None = None
        self.static_on = True

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Nvfp4Linear":
        w = linear.weight.detach()
        g = global_scale_for(w.abs().amax())
        packed, scales = reference_quantize_nvfp4(w, g)
        return cls(packed, scales, g, tuple(w.shape), w.dtype, "bf16 weight quantized to NVFP4")

    @classmethod
    def from_nvfp4(cls, packed, block_scales, global_scale, shape, out_dtype) -> "Nvfp4Linear":
        if block_scales.dtype == torch.uint8:
            block_scales = block_scales.view(torch.float8_e4m3fn)
        return cls(packed, block_scales, global_scale, shape, out_dtype, "NVFP4 checkpoint, used as stored")

    def input_static(self) -> StaticInput | None:
        """The static scale this call's input is encoded with; None: the input's own amax."""
        return self.static if self.static_on else None

    def forward(self, x) -> torch.Tensor:
        if self.emulate:
            a = x if isinstance(x, Nvfp4Activation) else reference_activation(x, self.input_static())
            return nvfp4_linear_reference(a, self.weight, self.weight_scale, self.weight_scale_2, self.out_features,
                                          self.out_dtype)
        import comfy_kitchen as ck

        a = x if isinstance(x, Nvfp4Activation) else quantize_nvfp4(x, self.input_static())
        out = ck.scaled_mm_nvfp4(a.packed, self.weight, a.global_scale, self.weight_scale_2, a.block_scales,
                                 self.weight_scale, out_dtype=self.out_dtype)
        return out.reshape(*a.shape[:-1], self.out_features)


class Nvfp4SwiGLU(SwiGLU):
    """SwiGLU whose fc1 -> SwiGLU -> fc2 path hands fc2 an NVFP4 activation made in one pass."""

    # No forward of its own: SwiGLU.forward refuses mlp_chunks > 1 on an Nvfp4Activation with an InputError,
    # which the front doors report as the user's error rather than an internal one.
    def _rows(self, x):
        return self.net[2](swiglu_quantize_nvfp4(self.net[0].proj(x), self.net[2].input_static()))


class Nvfp4RowModulation(FusedRowModulation):
    """norm_modulate returns the NVFP4-encoded activation (for NVFP4 q/k/v and fc1); the gated residual
    stays the exact fused kernel."""

    # The gated residual and the NVFP4 norm_modulate stay two passes (the one-pass kernel writes the model
    # dtype, not NVFP4).
    add_norm_modulate = RowModulation.add_norm_modulate

    def norm_modulate(self, norm, x, shift, scale):
        # The norm's consumer (to_q for norm1: q, k and v read this one encoding; fc1 for norm2) holds the
        # static scale; nvfp4_static.install leaves its `input_static` on the norm.
        static_of = getattr(norm, "nvfp4_static_of", None)
        static = static_of() if static_of is not None else None
        return rms_adaln_quantize_nvfp4(x, norm, shift, scale, self._row_index(x.device), static)
