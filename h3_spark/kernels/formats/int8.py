"""int8 and int8_convrot (ComfyUI's `int8_tensorwise`, `convrot: true` for the latter): int8 codes [N, K] x an fp32
`weight_scale`, one value or one per row. With ConvRot the stored weight is W @ H^T per group of
`convrot_groupsize` input columns (`stored_codec.hadamard`); `stored_codec.int8_into` undoes it on the codes.
No low-bit GEMM here takes int8 codes: the fast linears quantize the dequantized weight."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import stored_codec as codec
from .layer_format import LayerFormat, LayerParams, same_shape


def _check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
    weight = tensors["weight"]
    if weight.dtype != torch.int8:
        raise CheckpointError(f"{layer}: int8 layer stores its weight as {weight.dtype}")
    same_shape(layer, weight, shape)
    scale = tensors.get("weight_scale")
    if scale is None:
        raise CheckpointError(f"{layer}: int8 layer lacks weight_scale")
    if scale.numel() not in (1, shape[0]):
        raise CheckpointError(f"{layer}: int8 weight_scale has {scale.numel()} values; expected 1 or {shape[0]}")
    if params.convrot_group and shape[1] % params.convrot_group:
        raise CheckpointError(f"{layer}: ConvRot group size {params.convrot_group} does not divide the "
                              f"{shape[1]} input columns")


def _dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
    scale = held["weight_scale"]
    if scale.numel() > 1:
        scale = scale[start:end]
    codec.int8_into(out, held["weight"][start:end], scale, params.convrot_group)


DECLARED = (LayerFormat("int8_tensorwise", "int8", ("weight", "weight_scale"), _check, _dequantize_rows,
                        convrot_label="int8_convrot", unused=()),)
