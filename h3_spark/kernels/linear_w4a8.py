"""`W4A8Linear`: an asym_w4a8_int8 layer run as an integer GEMM, int8 weights x int8 activations (opt-in); also an
int8_convrot layer (`from_int8_convrot`: its codes are such a grid already; the video VAE benchmark's opt-in column).

The layer's codes decode once to their int8 grid G [N, K] (`formats.asym_w4a8_int8.grid_rows`), the values the
file's weight is W = rotate(G x s_channel) of, per ConvRot group. Since the rotation is orthogonal and symmetric,
x W^T = (x H) (G x s_channel)^T per group: the activation is rotated (fp32), quantized per token to int8
(scale = row amax / 127, rounded half to even; `rotate_quantize.py`, one Triton pass on a GPU with Triton, its
PyTorch reference elsewhere), multiplied by G^T in int32 (`torch._int_mm`: exact), and scaled
by x_scale x s_channel. What it costs in accuracy is the activation's int8 rounding alone (the weight is the
file's grid, unchanged): measured 0.77 % relative L2 against the dequantize-then-matmul reference
(`w4a8_reference`) on N(0, 1) activations in fp32, budget 1.5 % (tests/test_linear_w4a8.py). On an H100 a block's six
linears at 37,966 rows take 71.8 ms with the fused quantizer (105.3 with the PyTorch one) against dense bf16's
42.5 ms: the integer GEMMs alone (31.8 ms) beat bf16, but with the quantizer (13.9 ms) they already do not, and
the int32 epilogue added ~26 ms in PyTorch (`receipts/h100/w4a8-linear-5276138.json`; since then one Triton pass
with the quantizer's flag, `int_epilogue.py`, not measured). So it stays opt-in: a memory format on Hopper, not a
faster one.

The asymmetric variant's correction is a per-group offset the integer GEMM cannot carry: such a layer is refused,
as is any layer of another format (no silent fallback). `H3_LINEAR=w4a8` installs it for every asym_w4a8_int8 layer
of a DiT kept as stored (`kernels.dispatch.check_w4a8_linears` refuses what it cannot run before the model changes).
On CUDA cuBLASLt's int8 GEMM wants more than 16 rows and N, K multiples of 8: fewer rows are padded with zeros
(their outputs dropped), N not a multiple of 8 is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .capability import KernelUnavailable
from .formats.asym_w4a8_int8 import NAME, grid_rows
from .formats.layer_format import swapped
from .int_epilogue import reference_scale_int32, scale_int32
from .rotate_quantize import fused_group, reference_rotate_quantize, rotate_quantize
from .stored_linear import StoredLinear

_MIN_CUDA_ROWS = 17


def w4a8_reference(x: torch.Tensor, layer: StoredLinear) -> torch.Tensor:
    """What the integer GEMM stands in for: the layer's exact dequantized weight, then a float GEMM."""
    return F.linear(x, layer.dequantized(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


class W4A8Linear(nn.Module):
    def __init__(self, grid: torch.Tensor, s_channel: torch.Tensor, convrot_group: int, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, use_triton: bool = False):
        super().__init__()
        n, k = grid.shape
        if grid.dtype != torch.int8 or s_channel.numel() != n or k % convrot_group:
            raise ValueError(f"W4A8Linear takes an int8 grid [N, K] with one channel scale a row and K a multiple of "
                             f"the ConvRot group; got {grid.dtype} {list(grid.shape)}, {s_channel.numel()} scales, "
                             f"group {convrot_group}")
        if grid.is_cuda and n % 8:
            raise KernelUnavailable(f"W4A8Linear: cuBLASLt's int8 GEMM needs N a multiple of 8, this layer has {n}")
        self.out_features, self.in_features = n, k
        self.convrot_group = convrot_group
        self.out_dtype = out_dtype
        # Named `weight` as the other linears' codes are: the kernels find a model's device and dtype through it.
        self.register_buffer("weight", grid.contiguous())
        self.register_buffer("s_channel", s_channel.float().reshape(1, n))
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        # The fused quantizer takes ConvRot groups of 16 and more (the published files' are 256).
        self.use_triton = use_triton and fused_group(convrot_group)
        self.source = f"asym_w4a8_int8 codes on their int8 grid x per-token int8 activations ({self._quantizer})"

    @property
    def _quantizer(self) -> str:
        return ("rotated, quantized and scaled by triton" if self.use_triton
                else "rotated, quantized and scaled by pytorch")

    @classmethod
    def from_stored(cls, layer: StoredLinear, use_triton: bool = False) -> "W4A8Linear":
        """From a StoredLinear holding an asym_w4a8_int8 layer (codebook or symmetric variant)."""
        if layer.format != NAME:
            raise KernelUnavailable(f"W4A8Linear runs asym_w4a8_int8 layers, not {layer.label} ones")
        held = layer._held()
        if "weight_correction" in held:
            raise KernelUnavailable("W4A8Linear: an asymmetric w4a8 layer adds a correction per group after the "
                                    "channel scale, which the integer GEMM cannot carry; run it in bf16")
        grid = swapped(grid_rows(held, 0, layer.out_features, layer.group_size), layer.swap_halves)
        channel = swapped(held["weight_s_channel"].reshape(-1), layer.swap_halves)
        return cls(grid, channel, layer.convrot_group, layer.bias, layer.out_dtype, use_triton)

    @classmethod
    def from_int8_convrot(cls, layer: StoredLinear, use_triton: bool = False) -> "W4A8Linear":
        """From a StoredLinear holding an int8_convrot layer: its codes are the int8 grid already and its row scale
        the channel scale (W = rotate(codes x scale), the same algebra), so the same integer GEMM runs it (what
        ComfyUI's own int8 linears do). Plain int8 (no rotation) is refused: its codes are not rotated."""
        if layer.format != "int8_tensorwise" or not layer.convrot_group:
            raise KernelUnavailable(f"W4A8Linear.from_int8_convrot runs int8_convrot layers, not {layer.label} ones")
        held = layer._held()
        scale = held["weight_scale"].float().reshape(-1).expand(layer.out_features)
        grid = swapped(held["weight"], layer.swap_halves)
        layer_out = cls(grid, swapped(scale, layer.swap_halves), layer.convrot_group, layer.bias, layer.out_dtype,
                        use_triton)
        layer_out.source = f"int8_convrot codes x per-token int8 activations ({layer_out._quantizer})"
        return layer_out

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8 grid x int8 activations, out {self.out_dtype}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k, g = x.shape[:-1], self.in_features, self.convrot_group
        rows = x.reshape(-1, k)
        m = rows.shape[0]
        # x W^T = (x H) (G s)^T group by group: H is symmetric, so rotating the activation is x @ H.
        quantize = rotate_quantize if self.use_triton else reference_rotate_quantize
        codes, x_scale = quantize(rows, g)
        if codes.is_cuda and m < _MIN_CUDA_ROWS:
            codes = torch.cat([codes, codes.new_zeros(_MIN_CUDA_ROWS - m, k)])
        acc = torch._int_mm(codes, self.weight.t())[:m]
        scale = scale_int32 if self.use_triton else reference_scale_int32
        return scale(acc, x_scale, self.s_channel, self.bias, self.out_dtype).reshape(*lead, self.out_features)
