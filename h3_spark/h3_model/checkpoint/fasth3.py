"""FastH3 checkpoints: FastVideo's DMD2 students of H3, the base DiT plus one learned VSA gate per block.

A FastH3 `transformer/` folder is the base model's diffusers layout with `transformer_blocks.N.attn.
to_gate_compress.weight` ([heads x head_dim, hidden], bf16, no bias) in each of the DiT blocks (not the
refiner's), and a config.json without any gate field (diffusers' transformer has none): the reader tells a
FastH3 model by those names (dit_config.has_gates). ComfyUI files name the gate `blocks.N.attn.to_gate_compress`.
The ComfyUI files the FastH3 workflow templates download (FastH3 V2 8-step, `fastvideo_fasth3_8step_v2_pruned_
int8_convrot`; the Ref2VA student OmniRef, `fasth3_omniref_8step_pruned_int8_convrot` and its bf16 twin) are the
pruned ("curve-form") AdaLN layout, their names say, with ComfyUI's gate beside each block's attention (ComfyUI's
model builds `attn.to_gate_compress` as a bias-free linear hidden -> heads x head_dim when the file has it). The
gates' storage in the int8 files is inferred: a reader of the published header lists `to_gate_compress.weight` I8
with a F32 `weight_scale` and a `comfy_quant` marker, i.e. int8_convrot like the block linears; the file sizes do
not settle it (the bf16 twin's 44.2 GB is the pruned bf16 DiT plus bf16 gates, 40.2 + 3.9 GB). Written here as
`comfy-pruned` with `quantize_gates`; the reader takes either storage.

`make_fasth3_checkpoint` writes a random-weight one with non-zero gates, streamed like make-checkpoint's files;
`is_fasth3` says whether a checkpoint is one, from its tensor names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable

from ...errors import InputError
from ..dit.config import DiTConfig
from .dit_config import has_gates
from .make import MadeCheckpoint, make_dit_checkpoint

# Layouts a FastH3 model is published in: FastVideo's diffusers folder; a ComfyUI single file, full or pruned AdaLN.
LAYOUTS = ("diffusers", "comfy", "comfy-pruned")


def fasth3_config(config: DiTConfig) -> DiTConfig:
    """The FastH3 model of a base DiT config: the same sizes with the VSA gates."""
    return dataclasses.replace(config, gate_compress=True)


def is_fasth3(reader_or_keys: "object | Iterable[str]") -> bool:
    """Whether a checkpoint holds FastH3's VSA gates: a `DitReader`, a `CheckpointSource`, or tensor names."""
    source = getattr(reader_or_keys, "source", reader_or_keys)
    keys = getattr(source, "keys", source)
    return has_gates(keys() if callable(keys) else keys)


def make_fasth3_checkpoint(out: str | Path, config: DiTConfig, *, layout: str = "diffusers", fmt: str = "bf16",
                           seed: int = 0, progress: Callable[[int, int], None] | None = None,
                           device: str = "cpu", curve: tuple[int, int] | None = None,
                           quantize_gates: bool = False) -> MadeCheckpoint:
    """Write a random FastH3 checkpoint of the base `config` (e.g. dit.config.preset("tiny") or "full"): a
    diffusers folder `out` (config.json + diffusion_pytorch_model.safetensors) or, with layout "comfy" or
    "comfy-pruned" (`curve` = (grid, rank) of its adaln_t_table), one ComfyUI file `out` (.safetensors; `fmt` as
    make-checkpoint's: bf16, fp8_scaled, nvfp4, int8_convrot; the gates bf16, or in `fmt` too with
    `quantize_gates`, as the published int8_convrot files store them). The weights, gates included, are those of
    synthetic.random_state for `seed`: the gates are non-zero. Streamed tensor by tensor (writer.py), drawn on
    `device`."""
    if layout not in LAYOUTS:
        raise InputError(f"a FastH3 checkpoint is laid out as {', '.join(LAYOUTS)}, not {layout!r}")
    if config.curve_form:
        raise InputError("make a FastH3 checkpoint from a full-AdaLN config; the comfy-pruned layout fits its curve")
    if (layout == "comfy-pruned") != (curve is not None):
        raise InputError("a FastH3 curve table (grid, rank) goes with the comfy-pruned layout, and only there")
    return make_dit_checkpoint(out, fasth3_config(config), fmt, layout, seed=seed, progress=progress, device=device,
                               curve=curve, quantize_gates=quantize_gates)
