"""convrot_w4a4 ("int4_convrot" in file names): ComfyUI core's 4-bit ConvRot weights (comfy-kitchen's
TensorCoreConvRotW4A4Layout). The weight is rotated by ConvRot per group of `convrot_groupsize` input columns
(W @ H^T, H the normalised regular Hadamard matrix of `stored_codec.hadamard`), then quantized per row, symmetric:
codes in [-7, 7] (the nibble holds -8 too), scale = row absmax / 7. Stored: `weight` int8 [N, K / 2], two
two's-complement nibbles a byte, the low nibble the even column; `weight_scale` fp32 [N], one per row.

Dequantized by `stored_codec.int4_convrot_into` in comfy-kitchen's eager order (code x scale in fp32, the fp32
rotation GEMM, one cast), so a layer holds the bits ComfyUI's own dequantization gives it, a row chunk at a time.
No fast linear here takes int4 codes."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import stored_codec as codec
from .layer_format import LayerFormat, LayerParams


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8 [R, K / 2] of two nibbles -> int8 codes [R, K] in [-8, 7], the low nibble first."""
    wide = packed.to(torch.int16)
    low, high = ((wide & 0xF) ^ 8) - 8, (((wide >> 4) & 0xF) ^ 8) - 8
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def _check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
    weight, (n, k) = tensors["weight"], shape
    if weight.dtype not in (torch.int8, torch.uint8) or tuple(weight.shape) != (n, k // 2) or k % 2:
        raise CheckpointError(f"{layer}: convrot_w4a4 weight must be int8 [{n}, {k // 2}] (two 4-bit codes a byte) "
                              f"for the model's [{n}, {k}], got {weight.dtype} {list(weight.shape)}")
    scale = tensors.get("weight_scale")
    if scale is None:
        raise CheckpointError(f"{layer}: convrot_w4a4 layer lacks weight_scale")
    if scale.numel() != n:
        raise CheckpointError(f"{layer}: convrot_w4a4 weight_scale has {scale.numel()} values; expected one per "
                              f"row ({n})")
    if k % params.convrot_group:
        raise CheckpointError(f"{layer}: ConvRot group size {params.convrot_group} does not divide the {k} input "
                              "columns")


def _dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
    packed, scale = held["weight"].view(torch.int8), held["weight_scale"].reshape(-1)
    # Unpacked a chunk at a time: the codes of a whole fc1 as fp32 would be a temporary of 4 x N x K bytes.
    step = codec.chunk_rows(out.shape[1])
    for a in range(start, end, step):
        b = min(end, a + step)
        codec.int4_convrot_into(out[a - start:b - start], unpack_codes(packed[a:b]), scale[a:b], params.convrot_group)


DECLARED = (LayerFormat("convrot_w4a4", "int4_convrot", ("weight", "weight_scale"), _check, _dequantize_rows,
                        convrot_label="int4_convrot", always_rotated=True, values_per_column=2, unused=()),)
