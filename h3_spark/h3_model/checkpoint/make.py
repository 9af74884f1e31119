"""Make a random-weight DiT checkpoint in any published layout and format (streamed to disk).

The weights are those of `synthetic.random_state(config, seed)`; the pruned layout stores the
curve fit of that same model (pruned.py), so the files one seed makes all describe one model.
Formats: the safetensors ones (comfy_layout.FORMATS) and `gguf:<TYPE>`, a `.gguf` file of ComfyUI's
layout and names as the published GGUFs hold them (gguf_writer.py: the bf16 file's tensors, converted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from ..dit.config import DiTConfig
from .comfy_layout import FORMATS, comfy_groups, comfy_metadata, diffusers_config_json, diffusers_groups
from .dit_reader import expected_shapes
from .gguf_writer import GGUF_PREFIX, gguf_type_of, write_gguf
from .pruned import CurveFit, fit_curve
from .synthetic import random_param
from .writer import write_groups

LAYOUTS = ("comfy", "comfy-pruned", "diffusers", "released")
# Curve table size per preset: the published files use [1025, 8]; the tiny one keeps 33 points.
CURVE_DEFAULTS = {"full": (1025, 8), "tiny": (33, 4)}


@dataclass
class MadeCheckpoint:
    path: Path  # the .safetensors file
    config: DiTConfig  # of the stored model (curve form for comfy-pruned)
    bytes: int
    curve_residual: float | None


def curve_fit_for(config: DiTConfig, seed: int, grid: int, rank: int, device: str = "cpu") -> CurveFit:
    shapes = expected_shapes(config)
    # The time embedder is small: drawn on `device` (same stream as the file's other tensors), fitted on the CPU.
    te = {n: random_param(n, s, seed, device).cpu() for n, s in shapes.items() if n.startswith("time_embedder.")}
    return fit_curve(te, config, grid, rank)


def pruned_config(config: DiTConfig, grid: int, rank: int) -> DiTConfig:
    return DiTConfig(**{**config.to_dict(), "adaln_curve_grid": grid, "time_embed_dim": rank})


def make_dit_checkpoint(out: str | Path, config: DiTConfig, fmt: str, layout: str, *, seed: int = 0,
                        quantize_refiner: bool = False, curve: tuple[int, int] | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        device: str = "cpu", quantize_gates: bool = False) -> MadeCheckpoint:
    """Write the checkpoint. `config` is the full-AdaLN model; `curve` = (grid, rank) for comfy-pruned;
    `quantize_gates`: a FastH3 model's VSA gates stored in `fmt` as well (comfy layouts).

    `device` draws and quantizes each tensor there (a GPU makes a full-size file in minutes rather than an
    hour); only the finished tensor goes to the host, one at a time. The random stream is the device's."""
    if fmt.startswith(GGUF_PREFIX):
        if quantize_gates:
            raise InputError("--quantize-gates is for the comfy_quant formats; a GGUF stores every 2-D weight whose "
                             "rows its blocks fit, the VSA gates included")
        return _make_gguf(Path(out), config, fmt, layout, seed, quantize_refiner, curve, progress, device)
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if quantize_gates and (not config.gate_compress or not layout.startswith("comfy")):
        raise InputError("quantized VSA gates are a FastH3 model's, in a comfy layout")
    if layout not in LAYOUTS:
        raise InputError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if config.curve_form:
        raise InputError("make-checkpoint starts from a full-AdaLN config; ask for --layout comfy-pruned instead")
    out = Path(out)
    shapes = expected_shapes(config)

    def get(name: str) -> torch.Tensor:
        return random_param(name, shapes[name], seed, device)

    info = {"maker": "h3-spark make-checkpoint", "seed": str(seed), "format": fmt, "layout": layout}
    if layout == "released":
        from .released import write_released_dit

        if fmt != "bf16":
            raise InputError(f"MiniMaxAI's transformer/ folder holds bf16 weights only; use --layout comfy for {fmt}")
        if out.suffix == ".safetensors":
            raise InputError(f"{out}: the released layout is a folder (config.json + shards + index); give a "
                             "folder path")
        size = write_released_dit(out, config, seed)
        return MadeCheckpoint(out, config, size, None)
    if layout == "diffusers":
        if fmt != "bf16":
            raise InputError(f"the diffusers layout holds bf16 weights only (diffusers reads no comfy_quant); "
                             f"use --layout comfy for {fmt}")
        if out.suffix == ".safetensors":
            raise InputError(f"{out}: the diffusers layout is a folder (config.json + weights); give a folder path")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(diffusers_config_json(config))
        path = out / "diffusion_pytorch_model.safetensors"
        size = write_groups(path, diffusers_groups(config, get), {"format": "pt", "h3_spark": json.dumps(info)},
                            progress)
        return MadeCheckpoint(path, config, size, None)

    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a ComfyUI checkpoint is one file; give a path ending in .safetensors")
    fit = None
    stored = config
    if layout == "comfy-pruned":
        grid, rank = curve
        fit = curve_fit_for(config, seed, grid, rank, device)
        stored = pruned_config(config, grid, rank)
        info["curve_residual"] = f"{fit.residual:.3e}"
    groups = comfy_groups(stored, get, fmt, fit=fit, quantize_refiner=quantize_refiner, quantize_gates=quantize_gates)
    size = write_groups(out, groups, comfy_metadata(stored, {"h3_spark": json.dumps(info)}), progress)
    return MadeCheckpoint(out, stored, size, None if fit is None else fit.residual)


def _make_gguf(out: Path, config: DiTConfig, fmt: str, layout: str, seed: int, quantize_refiner: bool,
               curve: tuple[int, int] | None, progress, device: str) -> MadeCheckpoint:
    """A GGUF DiT: ComfyUI's single-file layout (full or pruned), every tensor converted from the bf16 file's."""
    gguf_type = gguf_type_of(fmt)
    if layout not in ("comfy", "comfy-pruned"):
        raise InputError(f"a GGUF DiT is a conversion of ComfyUI's single file: --layout comfy or comfy-pruned, "
                         f"not {layout}")
    if quantize_refiner:
        raise InputError("--quantize-refiner applies to the comfy_quant formats; a GGUF stores every 2-D weight "
                         "whose rows its blocks fit, the refiner's included")
    if config.curve_form:
        raise InputError("make-checkpoint starts from a full-AdaLN config; ask for --layout comfy-pruned instead")
    if out.suffix.lower() != ".gguf":
        raise InputError(f"{out}: a GGUF DiT is one file; give a path ending in .gguf")
    shapes = expected_shapes(config)

    def get(name: str) -> torch.Tensor:
        return random_param(name, shapes[name], seed, device)

    fit, stored = None, config
    info = {"maker": "h3-spark make-checkpoint", "seed": str(seed), "format": fmt, "layout": layout}
    if layout == "comfy-pruned":
        grid, rank = curve
        fit = curve_fit_for(config, seed, grid, rank, device)
        stored = pruned_config(config, grid, rank)
        info["curve_residual"] = f"{fit.residual:.3e}"
    size = write_gguf(out, comfy_groups(stored, get, "bf16", fit=fit), gguf_type, info, progress)
    return MadeCheckpoint(out, stored, size, None if fit is None else fit.residual)
