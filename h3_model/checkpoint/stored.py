"""A block linear's weight as the checkpoint stores it, for the FP8 and NVFP4 linears.

Loading dequantizes every layer into the model dtype. An FP8 or NVFP4 linear made from that copy
re-quantizes a rounded value: e4m3 codes times a per-tensor scale, rounded to bf16, are no longer on
an e4m3 grid, and NVFP4 values lose their block structure. `StoredLinears` hands
`kernels.dispatch.apply_kernels` the stored codes instead, cut to the model's linear, for every layer
whose weight is still the one loaded from them; a layer changed since (a merged LoRA) is quantized
from its current weight, and the report counts both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quant import dequantize

# What kernels.dispatch calls the stored formats it can start from.
_KIND = {"float8_e4m3fn": "fp8_scaled", "float8_e5m2": "fp8_scaled", "nvfp4": "nvfp4"}


@dataclass(frozen=True)
class CheckpointOrigin:
    """Where a loaded DiT came from, kept on the model (`checkpoint_origin`) for its stored codes."""

    path: str
    partition: str | None
    qkv_layout: str
    formats: tuple[str, ...]  # the stored quantization formats (QuantSpec.format), sorted

    @property
    def linear_format(self) -> str:
        """What H3_LINEAR=auto hears about this checkpoint: "nvfp4" when any layer is NVFP4, else "bf16"."""
        return "nvfp4" if "nvfp4" in self.formats else "bf16"


class StoredLinears:
    """A `weight_source` for `apply_kernels`: name -> the layer's stored codes, or None.

    Each layer's codes are dequantized and compared with the model's weight before they are handed out, so
    what the low-bit linear holds is exactly what the model held; the checkpoint is opened on the first
    call and stays open (memory-mapped) until `close`.
    """

    def __init__(self, model: nn.Module, origin: CheckpointOrigin):
        self.model, self.origin = model, origin
        self._reader = None
        self.used = 0
        self.changed: list[str] = []
        self.unavailable: str | None = None

    def __call__(self, name: str) -> dict | None:
        reader = self._open()
        if reader is None:
            return None
        weight = self.model.get_submodule(name).weight
        found = reader.stored_linear(name, weight.device)
        if found is None:
            return None
        spec, tensors = found
        if not torch.equal(dequantize(spec, tensors, tuple(weight.shape), weight.dtype, name), weight.detach()):
            self.changed.append(name)
            return None
        self.used += 1
        return {"format": _KIND[spec.format], **tensors}

    def _open(self):
        from . import open_dit
        from ..errors import CheckpointError

        if self._reader is None and self.unavailable is None:
            try:
                self._reader = open_dit(self.origin.path, partition=self.origin.partition,
                                        qkv_layout=self.origin.qkv_layout)
            except (CheckpointError, OSError) as exc:
                # The low-bit linears are still made, from the loaded weights; the report says why.
                self.unavailable = f"the checkpoint cannot be read again: {exc}"
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.source.close()
            self._reader = None

    def describe(self) -> dict:
        out = {"checkpoint": self.origin.path, "layers_from_stored_codes": self.used,
               "layers_changed_since_load": len(self.changed)}
        if self.changed:
            out["changed_examples"] = self.changed[:3]
            out["changed_note"] = "quantized from the current weight (a merged LoRA changes a layer's weight)"
        if self.unavailable:
            out["unavailable"] = self.unavailable
        return out
