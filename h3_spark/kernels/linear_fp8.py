"""FP8 e4m3 linears for Hopper: per-output-channel weight scales, per-token dynamic activation scales,
`torch._scaled_mm` with rowwise scales (measured 1.7-1.8x the bf16 GEMM rate at H3's shapes on an H200; docs/perf-notes.md).

Approximate: the weight is rounded to e4m3 once at load (from bf16, from an fp8_scaled checkpoint, or from
an NVFP4 checkpoint dequantized exactly first), and every activation row is rounded to e4m3 per call.
`fp8_linear_reference` is the plain-PyTorch definition of what the GEMM computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._triton import div_by, require_kernels, store_e4m3, tl, triton  # noqa: F401  (used in the kernel)
from .modulation import FusedRowModulation
from .references import SwiGLU

E4M3_MAX = 448.0
# An all-zero row still gets a finite scale; its codes are zero whatever the scale.
_MIN_AMAX = 1e-12
CHUNK = 1024
# The widest SwiGLU half the one-pass FP8 SwiGLU kernel keeps in registers (H3: 14,336).
SWIGLU_MAX_HALF = 16384


@dataclass(frozen=True)
class Fp8Rows:
    """An activation quantized per token: e4m3 (M, K) codes, fp32 (M, 1) scales, value = code * scale.
    `shape` is the logical (..., K) shape it stands for, so model code that only reads `.shape` passes it
    on; the fused modulation and SwiGLU make one so that the linears after them skip their own quantizer
    (q, k and v then share one)."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype).reshape(self.shape)

    def seq_slice(self, start: int, end: int) -> "Fp8Rows":
        """Tokens start:end of every batch row of a (B, S, K) activation (for the MLP's row chunks)."""
        b, s, k = self.shape
        pick = lambda t: t.view(b, s, -1)[:, start:end].reshape(-1, t.shape[-1])  # noqa: E731
        return Fp8Rows(pick(self.data), pick(self.scale), torch.Size((b, end - start, k)))


def quantize_activation(x: torch.Tensor, use_triton: bool = True) -> Fp8Rows:
    x2 = x.reshape(-1, x.shape[-1])
    data, scale = quantize_rows(x2) if use_triton else reference_quantize_rows(x2)
    return Fp8Rows(data, scale, x.shape)


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (e4m3 (M, K), fp32 scale (M, 1)) with value = code * scale, scale = row absmax / 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = amax.clamp_min(_MIN_AMAX) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, sx, sq, K: tl.constexpr, CHUNK: tl.constexpr):
        # One program per row: absmax over K (first read), then scale and round (second read, from L2).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for off in range(0, K, CHUNK):
            c = off + cols
            x = tl.load(x_ptr + row * sx + c, mask=c < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(s_ptr + row, scale)
        inv = tl.math.div_rn(1.0, scale)
        for off in range(0, K, CHUNK):
            c = off + cols
            x = tl.load(x_ptr + row * sx + c, mask=c < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(div_by(x, scale, inv), -448.0), 448.0)
            tl.store(q_ptr + row * sq + c, store_e4m3(q), mask=c < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference_quantize_rows` (same result; one kernel, two reads of x)."""
    require_kernels("the FP8 activation quantizer")
    if x.ndim != 2:
        raise ValueError(f"expected (rows, K), got {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, x.stride(0), q.stride(0), K=k, CHUNK=CHUNK, num_warps=4)
    return q, s


def quantize_weight(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (e4m3 (N, K), fp32 per-output-channel scale (N,)).

    pow2 rounds each scale up to a power of two: an NVFP4 weight (e2m1 code x e4m3 block scale) divided by a
    power of two keeps its significant bits, so fewer elements round.
    """
    amax = w.abs().amax(dim=1).float().clamp_min(_MIN_AMAX)
    scale = amax / E4M3_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear_reference(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                         out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What Fp8Linear computes, in fp32 PyTorch: per-token e4m3 activations times the e4m3 weight, plus the bias."""
    shape = x.shape
    xq, sx = reference_quantize_rows(x.reshape(-1, shape[-1]))
    w = weight_fp8.float() * weight_scale.float()[:, None]
    out = (xq.float() * sx) @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype).reshape(*shape[:-1], weight_fp8.shape[0])


class Fp8Linear(nn.Module):
    """Drop-in for an nn.Linear: e4m3 weight with per-output-channel scales, rowwise _scaled_mm; a bias (the video
    VAE decoder's linears have one) is kept in the output dtype and added in the GEMM's epilogue."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
                 source: str, use_triton: bool = True, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight_fp8.shape
        if weight_fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Linear weights must be float8_e4m3fn, got {weight_fp8.dtype}")
        if n % 16 or k % 16:
            raise ValueError(f"FP8 GEMMs need both weight dims divisible by 16, got {n}x{k}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", weight_fp8.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, n).contiguous())
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"Fp8Linear's bias must have {n} entries, got {list(bias.shape)}")
        self.register_buffer("bias", None if bias is None else bias.detach().to(out_dtype).contiguous())
        self.out_dtype, self.source, self.use_triton = out_dtype, source, use_triton

    @classmethod
    def from_linear(cls, linear: nn.Linear, use_triton: bool = True) -> "Fp8Linear":
        weight = linear.weight.detach()
        q, s = quantize_weight(weight)
        what = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype,
                                                                   str(weight.dtype).removeprefix("torch."))
        return cls(q, s, weight.dtype, f"{what} weight quantized per output channel", use_triton, linear.bias)

    @classmethod
    def from_fp8_scaled(cls, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
                        use_triton: bool = True) -> "Fp8Linear":
        """An fp8_scaled checkpoint layer (per-tensor scale): e4m3 codes are kept as they are (exact)."""
        scale = weight_scale.float().reshape(())
        if weight.dtype == torch.float8_e4m3fn:
            return cls(weight, scale.expand(weight.shape[0]).clone(), out_dtype,
                       "fp8_scaled checkpoint codes, unchanged", use_triton)
        # e5m2 (or anything else): dequantize exactly in fp32, then quantize per channel.
        q, s = quantize_weight(weight.float() * scale)
        return cls(q, s, out_dtype, f"fp8_scaled {weight.dtype} checkpoint requantized to e4m3", use_triton)

    @classmethod
    def from_nvfp4(cls, packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
                   shape: tuple[int, int], out_dtype: torch.dtype, use_triton: bool = True) -> "Fp8Linear":
        """An NVFP4 checkpoint layer: exact fp32 dequantization, then e4m3 with power-of-two channel scales."""
        from .nvfp4_codec import dequantize

        w = dequantize(packed, block_scales, global_scale, shape, torch.float32)
        q, s = quantize_weight(w, pow2=True)
        return cls(q, s, out_dtype, "NVFP4 checkpoint dequantized, requantized to e4m3 (pow2 scales)", use_triton)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale.reshape(-1, 1)).to(dtype)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        a = x if isinstance(x, Fp8Rows) else quantize_activation(x, self.use_triton)
        if a.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear takes {self.in_features} features, got {list(a.shape)}")
        out = torch._scaled_mm(a.data, self.weight.t(), scale_a=a.scale, scale_b=self.weight_scale, bias=self.bias,
                               out_dtype=self.out_dtype)
        return out.reshape(*a.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, source={self.source}"


# ------------------------------------------------------------------------------------------ fused producers
class Fp8RowModulation(FusedRowModulation):
    """The fused modulation handing the FP8 q/k/v and FFN-up linears their e4m3 activation: quantized once
    per norm (the same values each Fp8Linear would make), so q, k and v share one quantization instead of
    three. (Quantizing inside the modulation pass itself measured slower on the H200: perf-notes.)"""

    def norm_modulate(self, norm, x, shift, scale):
        return quantize_activation(super().norm_modulate(norm, x, shift, scale))

    def add_norm_modulate(self, residual, gate, y, norm, shift, scale):
        new_residual, rows = super().add_norm_modulate(residual, gate, y, norm, shift, scale)
        return new_residual, quantize_activation(rows)


class Fp8SwiGLU(SwiGLU):
    """SwiGLU whose activation leaves in e4m3 with per-token scales for the FP8 down-projection."""

    @staticmethod
    def _tokens(x, start: int, end: int):
        return x.seq_slice(start, end) if isinstance(x, Fp8Rows) else x[:, start:end]

    def _rows(self, x):
        return self.net[2](swiglu_quantize_fp8(self.net[0].proj(x)))


def swiglu_quantize_fp8(up: torch.Tensor) -> Fp8Rows:
    """value * silu(gate) of the fused up-projection, rounded as `reference_swiglu` rounds it, then
    quantized per token as `Fp8Linear` would: one pass (whole rows up to SWIGLU_MAX_HALF wide)."""
    from .swiglu import fused_swiglu, swiglu_rows_fp8

    half = up.shape[-1] // 2
    if half > SWIGLU_MAX_HALF:
        return quantize_activation(fused_swiglu(up))
    data, scale = swiglu_rows_fp8(up.reshape(-1, up.shape[-1]))
    return Fp8Rows(data, scale, torch.Size((*up.shape[:-1], half)))
