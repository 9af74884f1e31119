"""gguf: a linear stored as GGML blocks, uint8 [N, bytes per row], its block type (Q4_K, Q8_0, ...) given by the
file per tensor (`LayerParams.gguf_type`). The blocks carry their own scales, so the layer has no other tensor.
Dequantized by `kernels/gguf_codec.py`; no fast linear takes GGML blocks."""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from .. import gguf_codec
from .layer_format import LayerFormat, LayerParams


def _check(tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
    raw = tensors["weight"]
    if raw.dtype != torch.uint8 or raw.ndim != 2 or raw.shape[0] != shape[0]:
        raise CheckpointError(f"{layer}: GGUF {params.gguf_type} blocks must be uint8 [{shape[0]}, bytes per row], "
                              f"got {raw.dtype} {list(raw.shape)}")
    gguf_codec.check(params.gguf_type, shape, raw.numel(), layer)


def _dequantize_rows(out: torch.Tensor, held: dict, start: int, end: int, params: LayerParams) -> None:
    gguf_codec.dequantize_into(out, held["weight"][start:end], params.gguf_type)


DECLARED = (LayerFormat("gguf", "gguf", ("weight",), _check, _dequantize_rows, unused=()),)
