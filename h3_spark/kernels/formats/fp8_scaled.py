"""fp8_scaled: e4m3 (or e5m2) codes [N, K] x one fp32 `weight_scale` per tensor (ComfyUI's `float8_e4m3fn` /
`float8_e5m2`; the legacy scaled-fp8 files declare e4m3 by their `scaled_fp8` marker). Dequantized by
`stored_codec.fp8_into`; the FP8 linears take the codes as they are."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import stored_codec as codec
from .layer_format import LayerFormat, LayerParams, same_shape, single_value, swapped


def _codes(weight: torch.Tensor, name: str) -> torch.Tensor:
    return weight.view(codec.FP8_FORMATS[name]) if weight.dtype == torch.uint8 else weight


def _declare(name: str, label: str) -> LayerFormat:
    fp8 = codec.FP8_FORMATS[name]

    def check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
        weight = tensors["weight"]
        if weight.dtype not in (fp8, torch.uint8):
            raise CheckpointError(f"{layer}: {name} layer stores its weight as {weight.dtype}")
        single_value(tensors, "weight_scale", layer)
        same_shape(layer, weight, shape)

    def dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
        codec.fp8_into(out, _codes(held["weight"], name)[start:end], held["weight_scale"])

    def linear_codes(held: dict, rows: int, swap: bool) -> dict:
        codes = swapped(held["weight"].view(torch.uint8), swap)
        return {"format": "fp8_scaled", "weight": codes.view(fp8), "weight_scale": held["weight_scale"]}

    return LayerFormat(name, label, ("weight", "weight_scale"), check, dequantize_rows, codes="fp8_scaled",
                       fast_linears=("fp8",), linear_codes=linear_codes)


DECLARED = (_declare("float8_e4m3fn", "fp8_scaled"), _declare("float8_e5m2", "fp8_e5m2_scaled"))
