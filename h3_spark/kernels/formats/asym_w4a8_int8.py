"""asym_w4a8_int8 ("w4a8" in file names): comfy-kitchen's grouped W4A8 weights (AsymW4A8Int8Layout), always
ConvRot-rotated (`convrot_groupsize`, 256 as published), then quantized per group of `group_size` input columns
(16 as published; at least 4, dividing 16 or a multiple of it; K a multiple of 16).

Stored: `weight` int8 [N, K / 2], unsigned 4-bit codes (0..15) two a byte, the low nibble the even column;
`weight_s_rel` [N, K / group_size] (e4m3 as published, or fp32), each group's scale relative to its row's;
`weight_s_channel` fp32 [N]. One declaration, three variants, told apart by the tensors a layer carries:
- codebook (the published default): `weight_codebook` fp32 [16], a code's level is its entry;
- symmetric: no codebook, a code's level is code - 8;
- asymmetric: levels code - 8 and `weight_correction` [K / group_size, N] (the original dtype), added to each
  group after the channel scale (the group's minimum and offset).
A code decodes to the int8 grid the W4A8 GEMM reads, round(level x s_rel) clamped to [-127, 127]
(`stored_codec.w4a8_grid`), then x s_channel (+ correction) with the rotation undone (`stored_codec.w4a8_into`), in
comfy-kitchen's eager order so a layer holds ComfyUI's bits. comfy-kitchen also reads 6-bit codes (3K / 4 bytes a
row, "W6A8") under this name; those are refused here by their width."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import stored_codec as codec
from .layer_format import LayerFormat, LayerParams

NAME = "asym_w4a8_int8"
PARTS = ("weight", "weight_s_rel", "weight_s_channel", "weight_codebook", "weight_correction")
S_REL_DTYPES = (torch.float8_e4m3fn, torch.float32)


def variant(tensors) -> str:
    """"codebook", "symmetric" or "asymmetric", from the names of the tensors a layer carries."""
    if "weight_codebook" in tensors:
        return "codebook"
    return "asymmetric" if "weight_correction" in tensors else "symmetric"


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """int8 [R, K / 2] of two nibbles -> uint8 codes [R, K] in 0..15, the low nibble first."""
    raw = packed.view(torch.uint8)
    return torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)


def check_group(group: int | None, where: str) -> int:
    if group is None or group < 4 or (16 % group and group % 16):
        raise CheckpointError(f"{where}: {NAME} group_size must be at least 4 and divide 16 or be a multiple of 16, "
                              f"got {group}")
    return group


def _need(tensors: dict, name: str, layer: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{layer}: {NAME} layer lacks {name}")
    return t


def _check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
    (n, k), weight = shape, tensors["weight"]
    g = check_group(params.group_size, layer)
    if weight.dtype not in (torch.int8, torch.uint8) or weight.ndim != 2 or tuple(weight.shape) != (n, k // 2) or k % 2:
        six_bit = weight.ndim == 2 and weight.shape[0] == n and weight.shape[1] * 8 == k * 6
        raise CheckpointError(f"{layer}: {NAME} weight must be int8 [{n}, {k // 2}] (two 4-bit codes a byte) for the "
                              f"model's [{n}, {k}], got {weight.dtype} {list(weight.shape)}"
                              + (" (3K/4 bytes a row: 6-bit W6A8 codes, not read)" if six_bit else ""))
    if k % 16:
        raise CheckpointError(f"{layer}: {NAME} needs a multiple of 16 input columns, the model's weight has {k}")
    if k % g:
        raise CheckpointError(f"{layer}: {NAME} group_size {g} does not divide the {k} input columns")
    if k % params.convrot_group:
        raise CheckpointError(f"{layer}: ConvRot group size {params.convrot_group} does not divide the {k} input "
                              "columns")
    s_rel = _need(tensors, "weight_s_rel", layer)
    if s_rel.dtype not in S_REL_DTYPES or tuple(s_rel.shape) != (n, k // g):
        raise CheckpointError(f"{layer}: {NAME} weight_s_rel is {s_rel.dtype} {list(s_rel.shape)}; group_size {g} "
                              f"over {k} input columns takes float8_e4m3fn or float32 [{n}, {k // g}]")
    for name, want in (("weight_s_channel", (n,)), ("weight_codebook", (16,)), ("weight_correction", (k // g, n))):
        t = tensors.get(name) if name != "weight_s_channel" else _need(tensors, name, layer)
        if t is not None and (not t.is_floating_point() or t.element_size() < 2 or tuple(t.shape) != want):
            raise CheckpointError(f"{layer}: {NAME} {name} is {t.dtype} {list(t.shape)}; expected a float "
                                  f"{list(want)}")


def _held(tensors: dict) -> dict:
    """The correction [K / group_size, N] as a view by rows, [N, K / group_size], so a row range is a slice."""
    if "weight_correction" not in tensors:
        return tensors
    return {**tensors, "weight_correction": tensors["weight_correction"].t()}


def grid_rows(held: dict, start: int, end: int, group_size: int) -> torch.Tensor:
    """Stored rows start:end on the int8 grid (what the W4A8 GEMM multiplies), int8 [end - start, K]."""
    return codec.w4a8_grid(unpack_codes(held["weight"][start:end]), held["weight_s_rel"][start:end],
                           held.get("weight_codebook"), group_size)


def _dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
    channel, correction = held["weight_s_channel"].reshape(-1), held.get("weight_correction")
    step = codec.chunk_rows(out.shape[1])
    for a in range(start, end, step):
        b = min(end, a + step)
        codec.w4a8_into(out[a - start:b - start], grid_rows(held, a, b, params.group_size), channel[a:b],
                        None if correction is None else correction[a:b], params.group_size, params.convrot_group)


DECLARED = (LayerFormat(NAME, "w4a8", PARTS, _check, _dequantize_rows, held=_held, convrot_label="w4a8",
                        always_rotated=True, values_per_column=2, unused=(), shared=("weight_codebook",),
                        default_group=16),)
