"""Write a DiT as a GGUF file laid out as the published H3 GGUFs are, streamed tensor by tensor.

The published files are conversions of Comfy-Org's bf16 single files (unsloth/MiniMax-H3-GGUF was made with
stable-diffusion.cpp's converter from `minimax_h3_{fl2va,ref2va}_pruned_bf16.safetensors`; city96's
ComfyUI-GGUF tools/convert.py keeps the same names): ComfyUI's tensor names and layout (fused stacked QKV,
[gate; value] fc1, `rope.inv_freq`, the curve table in the pruned layout), so the tensors here are
`comfy_layout.comfy_groups`' bf16 file's, each converted as it is written. Storage, as those files keep it:
- 1-D tensors (norm gains, biases, the RoPE buffer) and `adaln_t_table`: F32 (ComfyUI-GGUF keeps 1-D tensors
  and the table F32; unsloth's conversion pins the norms F32: a quantized norm scale destroys the output);
- `video_patch_proj` / `audio_patch_proj` weights: F32 (unsloth pins them: their 96- and 32-value rows);
- every other 2-D weight: the asked-for type where its rows are whole blocks of it, else F16 (ComfyUI-GGUF's
  fallback when a tensor cannot take the type).
`general.architecture` is `minimax_h3` (ComfyUI-GGUF's convert template); the `h3_spark` key says who made it.

Quantization is ours (gguf_quantize.py, on the tensor's device: `--device cuda` quantizes there):
`writable_types()` is F32 / F16 / BF16, the legacy blocks Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 (bit for bit gguf-py's
NumPy quantizers) and the K-quants Q6_K, Q5_K, Q4_K, Q3_K, Q2_K (our own straightforward quantizer: a file
llama.cpp's quantizer would write differently, in the same format). A file is one type throughout (no _S / _M
mixes for the DiT). The i-quants are written by llama.cpp's quantizer (they need an importance matrix); asking
for one here is refused with the writable list.

Streaming: GGUF puts every tensor's info (name, dims, type, offset) before the data, so the plan (shapes and
types, nothing drawn) is written first, then each layer is drawn, converted (on its device, row chunk by row
chunk) and appended, one at a time: a full-size file never sits in RAM.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ...errors import CheckpointError, InputError
from .gguf_quantize import QUANTIZABLE, quantize
from .gguf_source import PLAIN, gguf_module
from .writer import Group

GGUF_PREFIX = "gguf:"
ARCHITECTURE = "minimax_h3"
PLAIN_TYPES = PLAIN
_F32_LAYERS = ("video_patch_proj.", "audio_patch_proj.")
_FALLBACK = "F16"


def writable_types() -> tuple[str, ...]:
    """The GGML types a GGUF DiT can be written in here: those gguf_quantize.py makes, and the plain floats."""
    return PLAIN_TYPES + QUANTIZABLE


def gguf_type_of(fmt: str) -> str:
    """"gguf:Q8_0" -> "Q8_0", or InputError naming the writable types."""
    if not fmt.startswith(GGUF_PREFIX):
        raise InputError(f"{fmt!r} is not a GGUF format (gguf:<TYPE>)")
    name = fmt[len(GGUF_PREFIX):].upper()
    writable = writable_types()
    if name in writable:
        return name
    gguf = gguf_module()
    listing = ", ".join(GGUF_PREFIX + t for t in writable)
    if name not in gguf.GGMLQuantizationType.__members__:
        raise InputError(f"--format {fmt}: {name} is not a GGML type; writable: {listing}")
    raise InputError(f"--format {fmt}: h3-spark does not quantize {name} (llama.cpp's quantizer writes the i-quants, "
                     f"from an importance matrix); writable: {listing}")


def stored_type(name: str, shape: tuple[int, ...], requested: str) -> str:
    """The GGML type one DiT tensor is stored in (see the module docstring)."""
    if len(shape) != 2 or name == "adaln_t_table" or name.startswith(_F32_LAYERS):
        return "F32"
    if requested in PLAIN_TYPES:
        return requested
    gguf = gguf_module()
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[requested]][0]
    return requested if shape[-1] % block == 0 else _FALLBACK


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # in the file
    shape: tuple[int, ...]  # PyTorch order
    gguf_type: str
    source: str = ""  # the group's name for it, where the file renames it (llama.cpp's text encoder names)

    @property
    def key(self) -> str:
        return self.source or self.name

    @property
    def nbytes(self) -> int:
        gguf = gguf_module()
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.gguf_type]]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


def plan(groups: list[Group], requested: str) -> list[tuple[Group, list[PlannedTensor]]]:
    """Each writer group with its tensors' GGUF types (header facts only: nothing is drawn)."""
    return [(g, [PlannedTensor(name, tuple(shape), stored_type(name, tuple(shape), requested))
                 for name, _, shape in g.entries]) for g in groups]


def _add_info(writer, t: PlannedTensor) -> None:
    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[t.gguf_type]
    if t.gguf_type in ("F32", "F16"):
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if t.gguf_type == "F32" else np.float16),
                               t.nbytes)
        return
    # Blocks (and BF16, which gguf hands over as bytes) are described by their byte shape and the raw type.
    row_bytes = t.nbytes // max(math.prod(t.shape[:-1]), 1)
    writer.add_tensor_info(t.name, (*t.shape[:-1], row_bytes), np.dtype(np.uint8), t.nbytes, raw_dtype=qtype)


def encode(tensor: torch.Tensor, gguf_type: str, name: str = "tensor") -> np.ndarray:
    """A tensor's bytes in `gguf_type`, converted on its device (blocks by gguf_quantize, row chunk by row
    chunk), then brought to the host."""
    tensor = tensor.detach()
    if gguf_type == "F32":
        return tensor.float().contiguous().cpu().numpy()
    if gguf_type == "F16":
        return tensor.to(torch.float16).contiguous().cpu().numpy()
    if gguf_type == "BF16":
        return tensor.to(torch.bfloat16).contiguous().view(torch.uint8).cpu().numpy()
    blocks = quantize(tensor, gguf_type, where=name)
    return blocks.cpu().numpy().reshape(*tensor.shape[:-1], blocks.shape[-1])


def write_gguf(path: str | Path, groups: list[Group], gguf_type: str, info: dict[str, str],
               progress: Callable[[int, int], None] | None = None) -> int:
    """Write the groups as a GGUF DiT in `gguf_type`; returns the file size. The file appears under its name
    only once complete."""
    gguf = gguf_module()

    def metadata(writer) -> None:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{gguf_type}", None)
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.add_string("h3_spark", json.dumps(info))

    return write_planned(path, plan(groups, gguf_type), ARCHITECTURE, metadata, progress)


def write_planned(path: str | Path, planned: list[tuple[Group, list[PlannedTensor]]], architecture: str,
                  metadata: Callable[[object], None], progress: Callable[[int, int], None] | None = None) -> int:
    """Write planned tensors as a GGUF file: `metadata(writer)` adds the key/values, then every tensor's info,
    then each group is drawn in turn and its tensors encoded and appended (one group in memory at a time).
    Returns the file size; the file appears under its name only once complete."""
    gguf = gguf_module()
    path = Path(path)
    total = sum(t.nbytes for _, ts in planned for t in ts)
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, architecture)
    try:
        metadata(writer)
        for _, tensors in planned:
            for t in tensors:
                _add_info(writer, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for group, tensors in planned:
            if not tensors:
                continue
            made = group.make()
            for t in tensors:
                data = encode(made.pop(t.key), t.gguf_type, t.name)
                if data.nbytes != t.nbytes:
                    raise CheckpointError(f"internal: {t.name} encodes to {data.nbytes} bytes, planned {t.nbytes}")
                writer.write_tensor_data(data)
                done += data.nbytes
            del made
            if progress is not None:
                progress(done, total)
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size
