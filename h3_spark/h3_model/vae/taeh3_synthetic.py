"""A random-weight TAEH3 file under the published names, for tests, demos and the draft-decoder benchmark.

madebyollin/taehv's `taeh3.safetensors` holds 128 fp16 tensors: the decoder `tiny_decoder.py` reads (64 tensors,
`decoder.<index>...`) and the encoder that makes latents from frames (64, `encoder.<index>...`), which h3-spark
does not run. The encoder's shapes are TAEHV's as it builds them for H3 (the inverse of the decoder: frames
unshuffled 2x2 into 12 channels, three stages of a time pool, a stride-2 conv and three memory blocks at width 64,
time pooled x2, x2, x1 for the decoder's x1, x2, x2 growth, then a conv to the latent channels); that is read off
the design, not off the file, and only fills the file: no reader here depends on it.

Values: convs N(0, 1/fan_in), biases N(0, 0.02), each tensor from its own seeded stream (vae/synthetic.py's), so
one seed is one model. `tiny` reads the demo video VAE's 4 latent channels, `full` the released 24.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import InputError
from .synthetic import random_tensor
from .tiny_decoder import TinyVideoDecoder

LATENT_CHANNELS = {"tiny": 4, "full": 24}
ENCODER_WIDTH = 64
TIME_POOLS = (2, 2, 1)


def _memory_block(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for i, n_in in ((0, 2 * width), (2, width), (4, width)):
        out[f"{prefix}.conv.{i}.weight"] = (width, n_in, 3, 3)
        out[f"{prefix}.conv.{i}.bias"] = (width,)
    return out


def encoder_shapes(latent_channels: int, patch: int = 2) -> dict[str, tuple[int, ...]]:
    w = ENCODER_WIDTH
    shapes = {"encoder.0.weight": (w, 3 * patch * patch, 3, 3), "encoder.0.bias": (w,)}
    index = 2
    for pool in TIME_POOLS:
        shapes[f"encoder.{index}.conv.weight"] = (w, w * pool, 1, 1)
        shapes[f"encoder.{index + 1}.weight"] = (w, w, 3, 3)
        for block in range(3):
            shapes.update(_memory_block(f"encoder.{index + 2 + block}", w))
        index += 5
    shapes[f"encoder.{index}.weight"] = (latent_channels, w, 3, 3)
    shapes[f"encoder.{index}.bias"] = (latent_channels,)
    return shapes


def taeh3_shapes(latent_channels: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a TAEH3 file: the encoder's, then the decoder's (this package's decoder names them)."""
    with torch.device("meta"):
        decoder = TinyVideoDecoder(latent_channels)
    return {**encoder_shapes(latent_channels),
            **{f"decoder.{k}": tuple(v.shape) for k, v in decoder.decoder.state_dict().items()}}


def write_taeh3(out: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """The file (fp16, as published); returns its path."""
    from safetensors.torch import save_file

    if preset not in LATENT_CHANNELS:
        raise InputError(f"TAEH3 preset must be one of {', '.join(LATENT_CHANNELS)}, got {preset!r}")
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a TAEH3 file is one .safetensors file (taeh3.safetensors)")
    tensors = {name: random_tensor(name, shape, seed).to(torch.float16)
               for name, shape in taeh3_shapes(LATENT_CHANNELS[preset]).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {"maker": "h3-spark make-checkpoint", "component": "taeh3", "preset": preset, "seed": str(seed)}
    save_file(tensors, str(out), metadata={"h3_spark": json.dumps(info)})
    return out
