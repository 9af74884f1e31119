"""NVFP4, and NVFP4-AWQ (the same with a `pre_quant_scale` per input column): E2M1 codes packed two a byte, uint8
[roundup(N, 16), roundup(K, 16) / 2], e4m3 block scales per 16 values in cuBLAS' blocked order
(`weight_scale`), an fp32 global scale (`weight_scale_2`); layout in `kernels/nvfp4_codec.py`. A StoredLinear
holds the block scales in plain row-major order, so a range of rows is a slice. The NVFP4 linears take the
codes as they are; the FP8 linears re-quantize them exactly (`Fp8Linear.from_nvfp4`). AWQ's codes encode W / s,
which no linear takes: `StoredLinear.linear_codes` gives none for a layer with a pre_quant_scale."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import nvfp4_codec as nvfp4
from .. import stored_codec as codec
from .layer_format import LayerFormat, LayerParams, single_value, swapped


def _check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
    single_value(tensors, "weight_scale_2", layer)
    if "weight_scale" not in tensors:
        raise CheckpointError(f"{layer}: NVFP4 layer lacks weight_scale (block scales)")
    packed, block_scales = tensors["weight"], tensors["weight_scale"]
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        problem = f"NVFP4 weight must be uint8 2-D, got {packed.dtype} {list(packed.shape)}"
    elif block_scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
        problem = f"NVFP4 block scales must be float8_e4m3fn, got {block_scales.dtype}"
    else:
        problem = nvfp4.stored_mismatch(tuple(packed.shape), block_scales.numel(), *shape)
    if problem:
        raise CheckpointError(f"{layer}: {problem}")


def _held(tensors: dict) -> dict:
    plain = codec.plain_nvfp4_scales(tensors["weight_scale"], *tensors["weight"].shape)
    return {**tensors, "weight_scale": plain}


def _dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
    codec.nvfp4_into(out, held["weight"][start:end], held["weight_scale"][start:end], held["weight_scale_2"])


def _linear_codes(held: dict, rows: int, swap: bool) -> dict:
    """The codes cut to the logical rows (halves swapped where asked), padded to 16 rows, block scales blocked."""
    codes = swapped(held["weight"][:rows], swap)
    plain = swapped(held["weight_scale"][:rows].view(torch.uint8), swap)
    pad = nvfp4.roundup(rows, nvfp4.BLOCK) - rows
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
        plain = torch.cat([plain, plain.new_zeros(pad, plain.shape[1])])
    return {"format": "nvfp4", "weight": codes.contiguous(), "weight_scale": nvfp4.swizzle_scales(
        plain.view(torch.float8_e4m3fn)), "weight_scale_2": held["weight_scale_2"]}


DECLARED = (LayerFormat("nvfp4", "nvfp4", ("weight", "weight_scale", "weight_scale_2", "pre_quant_scale"), _check,
                        _dequantize_rows, held=_held, values_per_column=2, codes="nvfp4",
                        fast_linears=("fp8", "nvfp4"), linear_codes=_linear_codes),)
