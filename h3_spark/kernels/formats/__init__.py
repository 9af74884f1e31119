"""The stored weight formats, each declared once in a module of this package (`DECLARED`: its `LayerFormat`s).

The table below is what the checkpoint readers (DiT, text encoder, GGUF), `StoredLinear` and the kernels'
dispatch read: which tensors a layer of a format carries, their checks, the dequantization, the label, which
fast linears start from its codes. A new format is a new module here (and its tests); this package finds it.
Plain bf16 / fp16 / fp32 weights are no format here: they are read as stored.
"""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import CheckpointError
from .layer_format import LayerFormat, LayerParams

_BASE = "layer_format"


def _collect() -> dict[str, LayerFormat]:
    table: dict[str, LayerFormat] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == _BASE:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for fmt in module.DECLARED:
            if fmt.name in table:
                raise RuntimeError(f"stored format {fmt.name!r} is declared twice ({info.name})")
            table[fmt.name] = fmt
    return table


FORMATS: dict[str, LayerFormat] = _collect()


def layer_format(name: str, layer: str | None = None) -> LayerFormat:
    """The declaration of stored format `name`; a CheckpointError naming `layer` for one no module declares."""
    fmt = FORMATS.get(name)
    if fmt is None:
        where = f"{layer}: " if layer else ""
        raise CheckpointError(f"{where}quantization format {name!r} is not supported")
    return fmt


def serving(linear: str) -> tuple[str, ...]:
    """The stored formats whose codes `linear` (an H3_LINEAR format: "fp8", "nvfp4") starts from."""
    return tuple(name for name, fmt in FORMATS.items() if linear in fmt.fast_linears)


FAST_LINEARS = tuple(sorted({linear for fmt in FORMATS.values() for linear in fmt.fast_linears}))

__all__ = ["FAST_LINEARS", "FORMATS", "LayerFormat", "LayerParams", "layer_format", "serving"]
