"""The built-in demo: tiny synthetic models in the released folder layout, made on the spot.

Real H3 weights are ~130 GB and cannot be fetched here, so `h3-spark generate --demo` writes a
model folder with the real names and formats but tiny random weights (DiT, video VAE, audio VAE
and a 4-layer Qwen3-VL with a byte-level tokenizer) and runs the real loaders and pipeline on it.
The output is noise with noise for sound: it proves the machinery, not the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from ..dit.config import TINY
from ..text.stand_in import (MERGES, SPECIAL_TOKENS, TEXT_HIDDEN, TEXT_LAYERS, TEXT_READ_LAYER,  # noqa: F401
                             TINY_TEXT, TINY_VISION, make_processor, make_tokenizer, text_config)
from ..vae import video_config

DEMO_VERSION = "2"
DIT_CONFIG = dataclasses.replace(TINY, text_dim=TEXT_HIDDEN)
# The released geometry: 16x spatial, 4x temporal (the stock tiny VAE is 4x spatial, which front doors that
# assume the released 16x latent grid, like ComfyUI's, cannot take).
DEMO_VAE = dataclasses.replace(video_config.TINY, block_out_channels=(8, 8, 16, 16), spatial_downsample_factors=(2,) * 4,
                               temporal_downsample_factors=(2, 2, 1, 1))
DEMO_PROMPT = "A paper boat drifts down a rain gutter while thunder rolls in the distance."


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, norms included (never zeros): weights ~ N(0, 1/fan_in), norms ~ 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(noise / math.sqrt(math.prod(p.shape[1:]) if p.ndim > 1 else 1))


def write_text_encoder(folder: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A tiny random Qwen3-VL folder with its tokenizer and processor; `max_shard_size` ("100KB") splits the weights
    into shards listed by model.safetensors.index.json, as the released text encoder's 14 are."""
    from ..text.torchvision_compat import ensure_importable

    ensure_importable()  # before transformers imports torchvision
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    tok = make_tokenizer()
    model = Qwen3VLForConditionalGeneration(text_config(tok)).eval()
    randomize(model, seed)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    # transformers draws a progress bar for its shards of a few MB: noise, and `comfyui-demo --quiet` must be
    # quiet. The setting is process-wide, so it is put back.
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder, safe_serialization=True, **shards)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    make_processor(tok).save_pretrained(folder)
    return folder


def build_demo_models(root: Path, seed: int = 0, log=lambda message: None) -> Path:
    """The demo model folder (reused when it is complete and of this demo version)."""
    from ..checkpoint.make import make_dit_checkpoint
    from ..vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    root = Path(root)
    stamp = root / "h3-spark-demo.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("version") == DEMO_VERSION:
        return root
    root.mkdir(parents=True, exist_ok=True)
    log(f"writing tiny synthetic demo models to {root}")
    make_dit_checkpoint(root / "transformer", DIT_CONFIG, "bf16", "diffusers", seed=seed)
    make_dit_checkpoint(root / "transformer_ref", DIT_CONFIG, "bf16", "diffusers", seed=seed + 1)
    write_vae_checkpoint(root / "vae", DEMO_VAE, "diffusers", seed)
    write_audio_vae_checkpoint(root / "audio_vae", "tiny", "diffusers", seed)
    write_text_encoder(root / "text_encoder", seed)
    stamp.write_text(json.dumps({"version": DEMO_VERSION, "seed": seed,
                                 "note": "tiny random weights with the real names and formats"}) + "\n")
    return root


def default_demo_dir() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h3-spark" / f"demo-v{DEMO_VERSION}"


# ------------------------------------------------------------------------------------------ ComfyUI's model folders
# Where the ComfyUI demo puts each component (ComfyUI's model folder key, the name its lists show); the demo
# workflow (workflows/api/h3-spark-demo-t2va.json and its UI graph) names these.
COMFY_FOLDERS = {"transformer": ("diffusion_models", "h3-demo-t2va"),
                 "transformer_ref": ("diffusion_models", "h3-demo-ref2va"),
                 "text_encoder": ("text_encoders", "h3-demo-qwen3vl"),
                 "vae": ("vae", "h3-demo-video-vae"),
                 "audio_vae": ("vae", "h3-demo-audio-vae")}


def install_comfyui_demo(models_dir: Path, seed: int = 0, log=lambda message: None) -> dict[str, Path]:
    """The tiny demo set under a ComfyUI models folder, in the sub-folders the h3-spark loaders list
    (`models/diffusion_models/h3-demo-t2va/`, ...). Copies, not links: the loaders refuse a folder that resolves
    outside its model folder. Existing demo folders are replaced; anything else there is left alone."""
    import shutil

    models_dir = Path(models_dir)
    if not models_dir.is_dir():
        from ...errors import InputError

        raise InputError(f"{models_dir}: no such folder (give ComfyUI's models folder, e.g. ComfyUI/models)")
    with _scratch() as tmp:
        demo = build_demo_models(Path(tmp) / "demo", seed, log)
        written = {}
        for part, (folder, name) in COMFY_FOLDERS.items():
            target = models_dir / folder / name
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(demo / part, target)
            written[part] = target
            log(f"wrote {target}")
    return written


def _scratch():
    import tempfile

    return tempfile.TemporaryDirectory(prefix="h3-spark-demo-")
