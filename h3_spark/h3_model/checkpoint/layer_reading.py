"""A checkpoint's quantized layers, read the same way for every model: the DiT reader (`dit_reader.py`) and the
text encoder's single-file reader (`text/single_file.py`) group their files' tensors into layers (suffix ->
stored key) under their own names, then declare and read each layer here.

- `add_key`: ComfyUI's legacy scaled-fp8 names (`scale_weight`, `scale_input`) are read as today's
  (`weight_scale`, `input_scale`), and the layer remembers it was named the legacy way (`_legacy`);
- `declare`: each layer's format from its `.comfy_quant` marker, the header metadata or the legacy
  `scaled_fp8` marker, by one rule (`quant.declare_layers`: ComfyUI's, the marker's two values meaning
  full-precision matrix multiplication);
- `gguf_specs`: in a GGUF, a layer's format is its weight's GGML type, and a layer with scale tensors or an
  integer tensor is a quantization outside GGUF's types, refused;
- `dequantized` / `held`: a quantized layer's stored tensors (the format's parts, as kernels/formats declares
  them) read on the target device, checked, and dequantized or kept in the form a StoredLinear holds.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...errors import CheckpointError
from .gguf_source import INTEGER, GgufSpec, codec_keeps, gguf_spec
from .quant import (LEGACY_MARKER, STORED_PARTS, QuantSpec, check_stored, declare_layers, dequantize,
                    fold_pre_quant_scale, held_tensors)

LEGACY_RENAME = {"scale_weight": "weight_scale", "scale_input": "input_scale"}
# A layer's keys that name no stored tensor of its weight: the marker, and where the legacy name came from.
_NOT_PARTS = ("comfy_quant", "_legacy", "bias")


def add_key(keys: dict[str, str], suffix: str, stored_key: str) -> None:
    """Record a layer's stored tensor under its suffix, a legacy scaled-fp8 name under today's."""
    keys[LEGACY_RENAME.get(suffix, suffix)] = stored_key
    if suffix in LEGACY_RENAME:
        keys.setdefault("_legacy", stored_key)


def declare(source, layers: dict[str, dict[str, str]], prefix: str, marker_key: str | None,
            ignore: Callable[[str], bool] = lambda name: False) -> dict[str, QuantSpec]:
    """QuantSpec of every quantized layer of a safetensors source (see quant.declare_layers); `marker_key` is the
    stored key of the legacy `scaled_fp8` marker, None when the file has none."""
    numel = source.entry(marker_key).numel if marker_key else 0
    return declare_layers(layers, source.read_small, source.metadata, prefix, marker_key, numel, ignore=ignore)


def check_declared(source, spec: QuantSpec, keys: dict[str, str], shape: tuple[int, int], layer: str) -> None:
    """The loader's per-layer check (`held`, `dequantized`: dtypes, shapes, scale sizes) from the header alone:
    the stored tensors as meta tensors of their dtype and shape, no byte read; errors name the file."""
    from .safetensors_header import DTYPES

    stored = {}
    for suffix in STORED_PARTS:
        if suffix in keys:
            entry = source.entry(keys[suffix])
            dtype = DTYPES.get(entry.dtype, (None, 0))[0]
            if dtype is None:  # a dtype this torch lacks: the read itself refuses it
                return
            stored[suffix] = torch.empty(entry.shape, dtype=dtype, device="meta")
    try:
        check_stored(spec, stored, shape, layer)
    except CheckpointError as exc:
        raise CheckpointError(f"{source.header_of(keys['weight']).path}: {exc}") from None


def marker_key(source, stored: dict[str, str]) -> str | None:
    """The legacy `scaled_fp8` marker's stored key: under the model's prefix, or bare."""
    if LEGACY_MARKER in stored:
        return stored[LEGACY_MARKER]
    return LEGACY_MARKER if LEGACY_MARKER in source else None


def gguf_specs(source, layers: dict[str, dict[str, str]], keys: list[str], what: str) -> dict[str, GgufSpec]:
    """GgufSpec of every GGML-block layer; `keys` the stored tensors of the model (all checked for integers),
    `what` the model ("DiT", "text encoder") for the errors. GGML blocks carry their own scales: a layer with scale
    tensors or markers, or an integer tensor, is a quantization outside GGUF's types (audio.cpp's experimental
    ConvRot dit_int8.gguf stores int8 weights beside scales) and is refused rather than read as plain numbers."""
    where = source.path
    for keys_of in layers.values():
        extra = sorted(s for s in keys_of if s not in ("weight", "bias"))
        if extra:
            raise CheckpointError(f"{where}: {keys_of[extra[0]]} is not a GGUF {what} tensor: GGML blocks carry their "
                                  "own scales (a quantization outside GGUF's types is not read)")
    for key in keys:
        dtype = source.entry(key).dtype
        if dtype in INTEGER:
            raise CheckpointError(f"{where}: {key} is an {dtype} tensor; a GGUF {what} stores floats or GGML blocks")
    specs = {}
    for name, keys_of in layers.items():
        if "weight" in keys_of and source.entry(keys_of["weight"]).quantized:
            specs[name] = gguf_spec(source.entry(keys_of["weight"]))
    return specs


def keeps_codes(source, spec: QuantSpec | None, keys: dict[str, str]) -> bool:
    """Whether a quantized layer can be handed over as its stored codes (for a StoredLinear): any declared format;
    a GGUF layer when it is a 2-D weight whose rows are the model's (not ComfyUI-GGUF's reshaped form) in a type
    the codec dequantizes at use (the others are dequantized at load)."""
    if spec is None:
        return False
    if not isinstance(spec, GgufSpec):
        return True
    entry = source.entry(keys["weight"])
    return len(entry.shape) == 2 and not entry.reshaped and codec_keeps(entry.gguf_type)


def _parts(source, keys: dict[str, str], device: torch.device) -> dict[str, torch.Tensor]:
    return {s: source.get(keys[s]).to(device) for s in STORED_PARTS if s in keys}


def dequantized(source, spec: QuantSpec, keys: dict[str, str], shape: tuple[int, int], dtype: torch.dtype,
                device: torch.device, layer: str) -> torch.Tensor:
    """A quantized layer's logical weight [N, K] in `dtype`, dequantized where it will live (a full-size
    int8_convrot layer takes ~8 s on a CPU); errors name the file."""
    stored = _parts(source, keys, device)
    try:
        weight = dequantize(spec, stored, shape, dtype, layer)
    except CheckpointError as exc:
        raise CheckpointError(f"{source.header_of(keys['weight']).path}: {exc}") from None
    if "pre_quant_scale" in stored:
        weight = fold_pre_quant_scale(weight, stored["pre_quant_scale"])
    return weight


def held(source, spec: QuantSpec, keys: dict[str, str], shape: tuple[int, int], device: torch.device,
         layer: str) -> dict[str, torch.Tensor]:
    """A quantized layer's stored tensors on `device`, checked against the logical weight [N, K], in the form a
    StoredLinear holds them (views of the memory-mapped file on the CPU); errors name the file."""
    stored = _parts(source, keys, device)
    try:
        check_stored(spec, stored, shape, layer)
    except CheckpointError as exc:
        raise CheckpointError(f"{source.header_of(keys['weight']).path}: {exc}") from None
    return held_tensors(spec, stored)
