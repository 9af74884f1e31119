"""The DiT's block linears swapped for low-bit ones: the engine's surgery on its own model, with the modules that
`kernels/dispatch.make_linear` builds (kernels/ decides and builds, the engine installs)."""

from __future__ import annotations

import contextlib

from torch import nn

from ...kernels.dispatch import BLOCK_LINEARS, WeightSource, check_linears, is_w4a8, linear_path, make_linear
from ...kernels.nvfp4_static import nvfp4_linears
from ...kernels.stored_linear import StoredLinear


def convert_linears(model: nn.Module, fmt: str, weight_source: WeightSource | None = None,
                    use_triton: bool = True) -> dict:
    """Replace the block linears by `fmt` modules; returns counts by weight source. For "w4a8" every asym_w4a8_int8
    layer of the DiT is replaced (a block's or not) and any other layer keeps its path, counted by it."""
    sources: dict[str, int] = {}
    scope = getattr(model, "block_scope", None)  # a streamed block is on the device only inside its scope
    for i, blk in enumerate(model.transformer_blocks):
        with scope(i) if scope is not None else contextlib.nullcontext():
            _convert_block(i, blk, fmt, weight_source, use_triton, sources)
    if fmt == "w4a8":
        _convert_other_w4a8(model, sources, use_triton)
    return sources


def _convert_other_w4a8(model: nn.Module, sources: dict[str, int], use_triton: bool) -> None:
    """The asym_w4a8_int8 layers outside the blocks (a file may quantize more than the block linears)."""
    outside = [n for n, m in model.named_modules() if is_w4a8(m) and not n.startswith("transformer_blocks.")]
    for name in outside:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = make_linear("w4a8", parent.get_submodule(attr), None, use_triton)
        if attr.isdigit():
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
        sources[new.source] = sources.get(new.source, 0) + 1


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
        path = linear_path(new)
        sources[path] = sources.get(path, 0) + 1


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
