"""H3 checkpoints: read any published DiT layout and format, inspect headers, write test files.

Entry points:
- `load_dit(path, ...)`: an `H3DiT` from a diffusers folder or file, a ComfyUI file (full or
  pruned, bf16 / fp8_scaled / NVFP4 / int8_convrot), streamed tensor by tensor;
- `read_dit_config(path)`: the `DiTConfig` such a checkpoint describes, from headers only;
- `open_dit(path)`: the `DitReader` behind both, for tools that want the plan or the stream;
- `StoredLinears`: a loaded model's FP8/NVFP4 codes as stored, for the low-bit linears.
LoRA files are read and merged into a loaded DiT by `lora.py`; `make.py`, `released.py` and `synthetic.py`
write random-weight checkpoints under the real names for tests, demos and benchmarks (`fasth3.py`, `pdd.py` and
`turbo.py` the FastH3 DiTs, PDD and Turbo LoRAs); `published.py` reads what a published file's name says that its
tensors cannot (partition, FastH3 V2 or OmniRef, a Turbo LoRA's steps).
safetensors and GGUF only (gguf_source.py): pickle files are refused, data is memory-mapped.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..dit.config import DiTConfig
from .dit_reader import DitReader
from .source import CheckpointSource, open_source
from .stored import CheckpointOrigin, StoredLinears, linear_format_of

ORIGINAL_DIT_CLASS = "MiniMaxH3DiTModel"
__all__ = ["load_dit", "read_dit_config", "open_dit", "linear_format", "DitReader", "CheckpointSource", "open_source",
           "CheckpointOrigin", "StoredLinears"]


def open_dit(path: str | Path, *, partition: str | None = None, qkv_layout: str = "auto") -> DitReader:
    """Headers of a DiT checkpoint, its config and its tensor plan (no weights read yet)."""
    source = open_source(path, partition=partition)
    return DitReader(source, qkv_layout=resolve_qkv_layout(source, qkv_layout))


def resolve_qkv_layout(source: CheckpointSource, qkv_layout: str) -> str:
    """"auto": interleaved for MiniMaxAI's own transformer/ folders (config.json names MiniMaxH3DiTModel, the
    original trainer's class, whose fused qkv rows go head by head), stacked for every other file."""
    if qkv_layout != "auto":
        return qkv_layout
    if source.config_path is None:
        return "stacked"
    import json

    try:
        name = json.loads(source.config_path.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return "stacked"
    return "interleaved" if name == ORIGINAL_DIT_CLASS else "stacked"


def read_dit_config(path: str | Path, *, partition: str | None = None) -> DiTConfig:
    return open_dit(path, partition=partition).config


def load_dit(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             partition: str | None = None, qkv_layout: str = "auto", stored: bool = False):
    """Build the H3DiT a checkpoint describes and stream its weights in.

    `qkv_layout` matters only for original-named files: "stacked" (Comfy-Org files) or "interleaved"
    (MiniMaxAI's original shards); the tensors cannot tell them apart, so "auto" (the default) asks the
    folder's config.json (`resolve_qkv_layout`) and takes stacked for a lone file.
    Quantized layers are dequantized on `device`, to the dtype their parameter has (`dtype`, or
    fp32 for the fp32 islands); with `stored` they stay as the file stores them instead (`StoredLinear`:
    codes and scales, views of the memory-mapped file on the CPU, dequantized at use to the same bits).
    """
    from ..dit.model import H3DiT

    reader = open_dit(path, partition=partition, qkv_layout=qkv_layout)
    reader.check()
    model = H3DiT(reader.config, dtype=dtype, device="meta")
    try:
        model.load_state(reader.tensors(dtype, device, stored=stored), device=torch.device(device))
    finally:
        reader.source.close()
    # The FP8/NVFP4 linears start from the stored codes (stored.StoredLinears), so the model says where it came from.
    model.checkpoint_origin = CheckpointOrigin(str(path), partition, reader.qkv_layout, stored_formats(reader),
                                              reader.note)
    return model.eval()


def stored_formats(reader: DitReader) -> tuple[str, ...]:
    """The quantization formats (QuantSpec.format) a DiT checkpoint's layers are stored in, sorted."""
    return tuple(sorted({spec.format for spec in reader.quantized_layers().values()}))


def linear_format(path: str | Path, partition: str | None = None) -> str:
    """What H3_LINEAR=auto hears about a checkpoint, from its headers: "nvfp4" when any layer is NVFP4."""
    reader = open_dit(path, partition=partition)
    try:
        return linear_format_of(stored_formats(reader))
    finally:
        reader.source.close()
