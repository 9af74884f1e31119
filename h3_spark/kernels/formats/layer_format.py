"""What a stored weight format declares, once: the one record every reader, `StoredLinear` and the kernels'
dispatch consult (`kernels/formats/__init__.py` collects them).

A format is a layer's weight stored as codes and scales (ComfyUI's `comfy_quant` formats, GGUF's GGML blocks).
Its declaration says which tensors a layer of it carries, checks them against the logical weight [N, K] from
dtypes and shapes alone (one-line errors naming the layer), dequantizes a range of its rows (the functions of
`stored_codec` / `gguf_codec`, the same at load and at use), names it, and says which fast linears
(`H3_LINEAR` fp8 / nvfp4) can start from its codes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import CheckpointError



@dataclass(frozen=True)
class LayerParams:
    """What a layer's declaration adds to its format: the ConvRot group (rotated formats), the GGML block type, or
    the quantization group (input columns that share a scale: asym_w4a8_int8's `group_size`)."""

    convrot_group: int | None = None
    gguf_type: str | None = None
    group_size: int | None = None


@dataclass(frozen=True)
class LayerFormat:
    name: str  # the stored name: comfy_quant's "format" (QuantSpec.format), StoredForm.format
    label: str  # the user-facing name (make-checkpoint --format, inspect, reports)
    # The tensors that hold the weight, "weight" first, in the order a StoredLinear registers them.
    parts: tuple[str, ...]
    # (tensors as the file stores them, logical [N, K], params, layer name) -> None; raises CheckpointError.
    check: Callable[[dict, tuple[int, int], LayerParams, str], None]
    # (out [rows, K], tensors as held, first row, end row, params): the stored rows start:end dequantized into out.
    dequantize_rows: Callable[[torch.Tensor, dict, int, int, LayerParams], None]
    # File tensors -> the form a StoredLinear holds (NVFP4: block scales in plain row-major order).
    held: Callable[[dict], dict] = lambda tensors: tensors
    convrot_label: str | None = None  # the label with ConvRot; None where ConvRot is not defined for the format
    # The format is rotated whatever its declaration says (its comfy_quant names the group size alone).
    always_rotated: bool = False
    # Logical weight columns per stored column (NVFP4 packs two values a byte).
    values_per_column: int = 1
    # What the fast linears call its codes ("fp8_scaled", "nvfp4"), the H3_LINEAR formats that start from them, and
    # (held tensors, rows, swap halves) -> the codes as those linears take them.
    codes: str | None = None
    fast_linears: tuple[str, ...] = ()
    linear_codes: Callable[[dict, int, bool], dict] | None = None
    # Tensors a layer may carry that the weight does not need: the activation scale ComfyUI's own low-bit GEMMs
    # read (ours compute activations in the model dtype).
    unused: tuple[str, ...] = ("input_scale",)
    # Parts every row shares (a codebook): a reader cutting a layer into row ranges (QKV) keeps them whole.
    shared: tuple[str, ...] = ()
    # The quantization group a declaration that names none gets; None where the format has no such group.
    default_group: int | None = None

    @property
    def tensors(self) -> frozenset[str]:
        """What a layer of this format may carry besides `weight` and `bias`."""
        return frozenset(self.parts[1:]) | frozenset(self.unused)

    def label_for(self, params: LayerParams) -> str:
        if params.gguf_type:
            return f"{self.label} {params.gguf_type}"
        if params.convrot_group:
            return self.convrot_label
        return self.label

    def validate(self, tensors: dict, shape: tuple[int, int], params: LayerParams, layer: str) -> None:
        """The stored tensors can hold the logical weight [N, K]: the format's checks, and AWQ's pre_quant_scale
        (one value per input column, whatever the format: it is folded in after dequantization)."""
        self.check(tensors, shape, params, layer)
        pre = tensors.get("pre_quant_scale")
        if pre is not None and pre.numel() != shape[1]:
            raise CheckpointError(f"{layer}: pre_quant_scale has {pre.numel()} values for {shape[1]} inputs")

    def dequantize(self, tensors: dict, shape: tuple[int, int], dtype: torch.dtype, params: LayerParams,
                   layer: str) -> torch.Tensor:
        """A layer's stored tensors (as the file stores them) -> its logical weight [N, K] in `dtype`."""
        self.validate(tensors, shape, params, layer)
        held = self.held(tensors)
        out = torch.empty(shape, dtype=dtype, device=tensors["weight"].device)
        self.dequantize_rows(out, held, 0, shape[0], params)
        return out


# --------------------------------------------------------------------- checks the formats share
def single_value(tensors: dict, name: str, layer: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise CheckpointError(f"{layer}: missing {name}")
    if t.numel() != 1:
        raise CheckpointError(f"{layer}.{name} must be a single value, got shape {list(t.shape)}")
    return t


def same_shape(layer: str, weight: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(weight.shape) != tuple(shape):
        raise CheckpointError(f"{layer}: stored weight is {list(weight.shape)}, the model needs {list(shape)}")


def swapped(rows: torch.Tensor, swap: bool) -> torch.Tensor:
    """Row halves [a; b] -> [b; a] where the stored order is the other one (ComfyUI's fc1); a new tensor then."""
    if not swap:
        return rows
    half = rows.shape[0] // 2
    return torch.cat([rows[half:], rows[:half]])
