"""`StoredLinear`: a linear layer that keeps its weight in the form the checkpoint stores it.

A quantized layer read from a file (int8 / int8_convrot, fp8_scaled, NVFP4, each optionally with AWQ's
`pre_quant_scale`) is held as its stored bytes: codes and scales as buffers, from the memory-mapped file to
the GPU (and through block streaming, which packs whatever tensors a block holds). Right before its GEMM the
weight is dequantized into a scratch buffer shared by every StoredLinear of the thread and device, then
`F.linear` runs on it. The dequantization is `stored_codec`'s, the same the load-time readers run, so the
output is bit-identical to that of an `nn.Linear` loaded from the same file on the same device.

What it costs, and why it is worth it: an int8 block holds half the bytes of a bf16 one (NVFP4 about a
quarter), while its dequantization is a memory-bound pass over the weight (~2 ms a block
for int8 against ~40 ms of block compute at S = 19,540; ConvRot adds one fp32 GEMM with K = 256 per row).
The low-bit GEMMs (`Fp8Linear`, `Nvfp4Linear`) start from `stored_tensors()` instead, where asked for.

Like `Fp8Linear`, `weight` is the stored codes and `out_dtype` the compute dtype; `dequantized()` gives the
weight as a new tensor (LoRA merges, tests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import stored_codec as codec
from .formats import FORMATS, LayerParams

# What `format` may be (the stored formats kernels/formats declares) and the report label of each.
LABELS = {name: fmt.label for name, fmt in FORMATS.items()}


@dataclass
class StoredForm:
    """One linear's weight as a reader hands it over: the stored tensors cut to this linear's rows.

    tensors: "weight" (fp8 / int8 codes [N, K], or NVFP4 uint8 [>= N, K_pad / 2]), "weight_scale" (fp8: scalar;
    int8: scalar or [N, 1]; NVFP4: plain e4m3 [>= N, K_pad / 16], see `stored_codec.plain_nvfp4_scales`),
    "weight_scale_2" (NVFP4 global), optional "pre_quant_scale" [K]; the 4-bit formats as their format modules
    declare them (convrot_w4a4: packed int8 [N, K / 2] and a scale per row; asym_w4a8_int8: packed codes,
    "weight_s_rel", "weight_s_channel", optional "weight_codebook" [16] and "weight_correction" held as [N, groups])."""

    format: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    convrot_group: int | None = None
    # The stored rows are [a; b] and the model's [b; a] (ComfyUI's fc1 is [gate; value], ours [value; gate]):
    # the halves are swapped as they are dequantized, so the codes stay views of the file.
    swap_halves: bool = False
    # format "gguf": the GGML block type's name ("Q4_K", "Q8_0", ...); "weight" is then the raw blocks, uint8
    # [N, bytes per row] (kernels/gguf_codec.py).
    gguf_type: str | None = None
    # asym_w4a8_int8: the input columns that share a scale (the declaration's group_size).
    group_size: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _Scratch(threading.local):
    """Per thread: device -> (buffer, the StoredLinear whose weight it holds). Two threads (a service's job and
    a ComfyUI prompt) never share a buffer, and within a thread the GEMMs run one after another on one stream,
    so a buffer is overwritten only after the GEMM that read it was issued before the write."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.owner: dict[str, object] = {}


_SCRATCH = _Scratch()


def release_scratch() -> int:
    """Free this thread's scratch buffers (between stages, or when a model is unloaded); returns the bytes freed."""
    freed = sum(b.numel() * b.element_size() for b in _SCRATCH.buffers.values())
    _SCRATCH.buffers.clear()
    _SCRATCH.owner.clear()
    return freed


def scratch_bytes(module: nn.Module) -> int:
    """The scratch a model's StoredLinears need on their device: the largest dequantized weight, plus the fp32
    temporaries of one row chunk (codes as fp32 and the rotated copy)."""
    return max((layer_scratch_bytes(*m.shape, m.out_dtype, m.format) for m in module.modules()
                if isinstance(m, StoredLinear)), default=0)


def layer_scratch_bytes(n: int, k: int, out_dtype: torch.dtype, fmt: str) -> int:
    """The scratch one stored (n, k) layer of format `fmt` needs, dequantized into `out_dtype`."""
    size = torch.empty(0, dtype=out_dtype).element_size()
    # GGUF's lookup-table types (IQ4) hold ~9 bytes a value per chunk, the others at most 8.
    temporaries = (3 if fmt == "gguf" else 2) * min(n, codec.CHUNK_ROWS) * k * 4
    return n * k * size + temporaries


class StoredLinear(nn.Module):
    def __init__(self, form: StoredForm, out_dtype: torch.dtype, bias: torch.Tensor | None = None):
        super().__init__()
        if form.format not in LABELS:
            raise ValueError(f"StoredLinear holds {', '.join(LABELS)} weights, not {form.format!r}")
        self.format = form.format
        self.shape = tuple(form.shape)
        self.out_features, self.in_features = self.shape
        self.convrot_group = form.convrot_group
        self.swap_halves = form.swap_halves
        self.gguf_type = form.gguf_type
        self.group_size = form.group_size
        if self.format == "gguf" and not self.gguf_type:
            raise ValueError("a gguf StoredForm names its GGML block type (gguf_type)")
        if self.swap_halves and self.out_features % 2:
            raise ValueError(f"cannot swap the halves of {self.out_features} rows")
        self.out_dtype = out_dtype
        # AWQ's smoothing is folded in after any format's dequantization (`pre_quant_into`), so it is held whatever
        # the format (the readers let only the formats that declare it carry one).
        for name in dict.fromkeys(self._format.parts + ("pre_quant_scale",)):
            if name in form.tensors:
                self.register_buffer(name, form.tensors[name])
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
        self.source = f"{LABELS[self.format]} codes as stored, dequantized at use"

    @property
    def _format(self):
        return FORMATS[self.format]

    @property
    def _params(self) -> LayerParams:
        return LayerParams(self.convrot_group, self.gguf_type, self.group_size)

    @property
    def label(self) -> str:
        return self._format.label_for(self._params)

    def _held(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._format.parts if getattr(self, name, None) is not None}

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, stored {self.label}, computes in {self.out_dtype}"

    # ------------------------------------------------------------------ values
    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        if self.swap_halves:
            half = self.out_features // 2
            self._dequantize_rows(out[half:], 0, half)
            self._dequantize_rows(out[:half], half, self.out_features)
        else:
            self._dequantize_rows(out, 0, self.out_features)
        return out

    def _dequantize_rows(self, out: torch.Tensor, start: int, end: int) -> None:
        """Stored rows start:end into `out`."""
        self._format.dequantize_rows(out, self._held(), start, end, self._params)
        if getattr(self, "pre_quant_scale", None) is not None:
            codec.pre_quant_into(out, self.pre_quant_scale)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical weight as a new tensor in the compute dtype (or `dtype`, cast from it)."""
        out = self.dequantize_into(torch.empty(self.shape, dtype=self.out_dtype, device=self.weight.device))
        return out if dtype is None or dtype == self.out_dtype else out.to(dtype)

    def to_linear(self) -> nn.Linear:
        """An nn.Linear holding this layer's exact dequantized weight (and its bias): what a LoRA merges into and
        the low-bit quantizers start from."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.dequantized(), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def _jit_weight(self) -> torch.Tensor:
        device = self.weight.device
        key = f"{device}:{self.out_dtype}"
        numel = self.out_features * self.in_features
        buffer = _SCRATCH.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            _SCRATCH.buffers.pop(key, None)  # the old one goes before the larger one is made
            buffer = _SCRATCH.buffers[key] = torch.empty(numel, dtype=self.out_dtype, device=device)
            _SCRATCH.owner.pop(key, None)
        weight = buffer[:numel].view(self.shape)
        # The MLP's row chunks call the same linear several times in a row: dequantize once for them.
        if _SCRATCH.owner.get(key) is not self:
            self.dequantize_into(weight)
            _SCRATCH.owner[key] = self
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._jit_weight(), self.bias)

    def _apply(self, fn, recurse=True):
        # Moving the codes (to a device, into a streaming slot) leaves whatever scratch says it holds this layer
        # valid only on the old device; forgetting ownership is always safe.
        for key in [k for k, v in _SCRATCH.owner.items() if v is self]:
            del _SCRATCH.owner[key]
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ for the low-bit linears
    def stored_tensors(self, linear: str | None = None) -> dict | None:
        """What `kernels.dispatch` makes an FP8 or NVFP4 linear from: {"format": "fp8_scaled" | "nvfp4", ...} as a
        checkpoint stores it (NVFP4 block scales blocked again, rows padded to 16), or None where the format's codes
        serve no low-bit GEMM here (int8, GGUF), or not `linear` (an H3_LINEAR format) when it is named, or the layer
        carries AWQ's pre_quant_scale (its codes encode W / s): those are quantized from the dequantized weight."""
        fmt = self._format
        if getattr(self, "pre_quant_scale", None) is not None or fmt.linear_codes is None:
            return None
        if linear is not None and linear not in fmt.fast_linears:
            return None
        return fmt.linear_codes(self._held(), self.out_features, self.swap_halves)
