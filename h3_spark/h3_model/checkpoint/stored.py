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

from ...kernels.formats import FAST_LINEARS, FORMATS, serving
from .quant import dequantize


@dataclass(frozen=True)
class CheckpointOrigin:
    """Where a loaded DiT came from, kept on the model (`checkpoint_origin`) for its stored codes."""

    path: str
    partition: str | None
    qkv_layout: str
    formats: tuple[str, ...]  # the stored quantization formats (QuantSpec.format), sorted
    note: str | None = None  # what the reader wants said about the file (a GGUF declaring another architecture)

    @property
    def linear_format(self) -> str:
        return linear_format_of(self.formats)

    def stored_linears(self, model: nn.Module, fmt: str) -> "StoredLinears | None":
        """The weight source `apply_kernels` starts `fmt` linears from, or None when the file holds no codes
        they can use (the kernels ask the model's origin, so they need not know the checkpoint readers)."""
        return StoredLinears(model, self, fmt) if StoredLinears.useful(self, fmt) else None


def linear_format_of(formats) -> str:
    """What H3_LINEAR=auto hears about a checkpoint stored in `formats`: "nvfp4" when any layer is NVFP4."""
    return "nvfp4" if "nvfp4" in formats else "bf16"


class StoredLinears:
    """A `weight_source` for `apply_kernels` making `fmt` linears: name -> the layer's stored codes, or None.

    Each layer's codes are dequantized and compared with the model's weight before they are handed out, so
    what the low-bit linear holds is exactly what the model held; the checkpoint is opened on the first
    call and stays open (memory-mapped) until `close`. When the file can no longer give what it gave at
    load (gone, replaced, unreadable), the rest of the layers are quantized from their loaded weights and
    `describe` says why: a half-converted model would be of no use to anyone.
    """

    def __init__(self, model: nn.Module, origin: CheckpointOrigin, fmt: str):
        if fmt not in FAST_LINEARS:
            raise ValueError(f"stored codes serve the {' and '.join(FAST_LINEARS)} linears, not {fmt!r}")
        self.model, self.origin, self.serving = model, origin, serving(fmt)
        self._reader = None
        self.used = 0
        self.changed: list[str] = []
        self.unavailable: str | None = None

    @staticmethod
    def useful(origin: CheckpointOrigin | None, fmt: str) -> bool:
        """Whether a file stored in `origin.formats` has codes that `fmt` linears start from."""
        return origin is not None and any(f in serving(fmt) for f in origin.formats)

    def __call__(self, name: str) -> dict | None:
        from safetensors import SafetensorError

        from ...errors import CheckpointError

        reader = self._open()
        if reader is None:
            return None
        weight = self.model.get_submodule(name).weight
        try:
            stored = reader.stored_code_format(name)
            if stored is None or stored not in self.serving:
                return None
            spec, tensors = reader.stored_linear(name, weight.device)
            if not self._holds(spec, tensors, weight, name):
                self.changed.append(name)
                return None
        except (CheckpointError, SafetensorError, OSError, RuntimeError) as exc:
            self.unavailable = f"the checkpoint no longer gives what was loaded from it ({name}: {exc})"
            self.close()
            return None
        self.used += 1
        return {"format": FORMATS[spec.format].codes, **tensors}

    @staticmethod
    def _holds(spec, tensors: dict, weight: torch.Tensor, name: str) -> bool:
        """The codes dequantize to the model's weight: as loaded in its dtype, or loaded in fp32 and cast since."""
        shape = tuple(weight.shape)
        if torch.equal(dequantize(spec, tensors, shape, weight.dtype, name), weight.detach()):
            return True
        return weight.dtype != torch.float32 and torch.equal(
            dequantize(spec, tensors, shape, torch.float32, name).to(weight.dtype), weight.detach())

    def _open(self):
        from ...errors import CheckpointError
        from . import open_dit

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
