"""One DiT forward on stored inputs, for parity hunts.

Inputs and outputs use diffusers' forward argument names, so a trace can be replayed through
the reference model unchanged, and a reference trace through ours.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ...errors import InputError

INPUT_KEYS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
              "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")
INDEX_KEYS = ("timestep_indices", "token_tags", "video_indices", "audio_indices", "text_indices")
FLOAT_KEYS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "position_ids")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_inputs(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such inputs file")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None
    missing = [k for k in INPUT_KEYS if k not in tensors]
    if missing:
        raise InputError(f"{path}: missing input tensors: {', '.join(missing)}")
    for key in INDEX_KEYS:
        if tensors[key].is_floating_point() or tensors[key].dtype == torch.bool:
            raise InputError(f"{path}: {key} must be an integer tensor, got {tensors[key].dtype}")
        tensors[key] = tensors[key].long()
    for key in FLOAT_KEYS:
        if not tensors[key].is_floating_point():
            raise InputError(f"{path}: {key} must be a floating-point tensor, got {tensors[key].dtype}")
    return tensors


def check_against_config(inputs: dict[str, torch.Tensor], config) -> None:
    """Name the config field a mismatched input disagrees with, before any compute."""
    checks = (("hidden_states", config.video_patch_dim, "in_channels x patch"),
              ("audio_hidden_states", config.audio_in_channels, "audio_in_channels"),
              ("encoder_hidden_states", config.text_dim, "text_dim"))
    for key, width, field in checks:
        t = inputs[key]
        if t.ndim != 3:
            raise InputError(f"{key} must be (batch, rows, channels), got shape {list(t.shape)}")
        if t.shape[-1] != width:
            raise InputError(f"{key} has {t.shape[-1]} channels but the checkpoint's config expects {width} ({field})")


def run_trace(model, inputs: dict[str, torch.Tensor], device: str) -> tuple[dict[str, torch.Tensor], float]:
    check_against_config(inputs, model.config)
    args = {k: inputs[k].to(device) for k in INPUT_KEYS}
    start = time.perf_counter()
    with torch.inference_mode():
        video, audio = model(**args)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"sample": video.float().cpu().contiguous(), "audio_sample": audio.float().cpu().contiguous()}, \
        time.perf_counter() - start
