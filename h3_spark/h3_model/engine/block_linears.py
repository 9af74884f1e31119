"""The DiT's block linears swapped for low-bit ones: the engine's surgery on its own model, with the modules that
`kernels/dispatch.make_linear` builds (kernels/ decides and builds, the engine installs)."""

from __future__ import annotations

import contextlib

from torch import nn

from ...kernels.dispatch import BLOCK_LINEARS, WeightSource, check_linears, make_linear
from ...kernels.nvfp4_static import nvfp4_linears
from ...kernels.stored_linear import StoredLinear


def convert_linears(model: nn.Module, fmt: str, weight_source: WeightSource | None = None,
                    use_triton: bool = True) -> dict:
    """Replace the block linears by `fmt` modules; returns counts by weight source."""
    sources: dict[str, int] = {}
    scope = getattr(model, "block_scope", None)  # a streamed block is on the device only inside its scope
    for i, blk in enumerate(model.transformer_blocks):
        with scope(i) if scope is not None else contextlib.nullcontext():
            _convert_block(i, blk, fmt, weight_source, use_triton, sources)
    return sources


def _convert_block(i: int, blk: nn.Module, fmt: str, weight_source: WeightSource | None, use_triton: bool,
                   sources: dict[str, int]) -> None:
    for name in BLOCK_LINEARS:
        parent_name, _, attr = name.rpartition(".")
        parent = blk.get_submodule(parent_name)
        old = getattr(parent, attr) if not attr.isdigit() else parent[int(attr)]
        # A StoredLinear brings its own codes; the weight source serves layers loaded dequantized.
        wanted = weight_source is not None and not isinstance(old, StoredLinear)
        stored = weight_source(f"transformer_blocks.{i}.{name}") if wanted else None
        new = make_linear(fmt, old, stored, use_triton)
        if attr.isdigit():
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
        sources[new.source] = sources.get(new.source, 0) + 1


def emulate_nvfp4(model: nn.Module, weight_source=None) -> dict:
    """Replace the block linears by NVFP4 linears that run the reference emulation on any device (a file's
    stored NVFP4 codes where the model has them, else its weights quantized); returns counts by source."""
    check_linears(model, "nvfp4")
    origin = getattr(model, "checkpoint_origin", None)
    stored = None
    if weight_source is None and origin is not None:
        weight_source = stored = origin.stored_linears(model, "nvfp4")
    try:
        sources = convert_linears(model, "nvfp4", weight_source, use_triton=False)
    finally:
        if stored is not None:
            stored.close()
    for m in nvfp4_linears(model).values():
        m.emulate = True
    return sources
