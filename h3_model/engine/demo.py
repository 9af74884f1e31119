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
from ..vae import video_config

DEMO_VERSION = "2"
TEXT_HIDDEN = 32
TEXT_LAYERS = 4
TEXT_READ_LAYER = 2  # the demo reads hidden_states[2] the way the released model reads [50]
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<d>", "</d>"]
MERGES = [("Ġ", "a"), ("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "r"), ("<", "P"), ("Ġ", "s"), ("e", "c")]
DIT_CONFIG = dataclasses.replace(TINY, text_dim=TEXT_HIDDEN)
# The released geometry: 16x spatial, 4x temporal (the stock tiny VAE is 4x spatial, which front doors that
# assume the released 16x latent grid, like ComfyUI's, cannot take).
DEMO_VAE = dataclasses.replace(video_config.TINY, block_out_channels=(8, 8, 16, 16), spatial_downsample_factors=(2,) * 4,
                               temporal_downsample_factors=(2, 2, 1, 1))
DEMO_PROMPT = "A paper boat drifts down a rain gutter while thunder rolls in the distance."


def make_tokenizer():
    """Byte-level BPE over the 256 byte symbols plus a few merges and Qwen3-VL's special tokens."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2TokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for pair in MERGES:
        vocab["".join(pair)] = len(vocab)
    tok = Qwen2TokenizerFast(vocab=vocab, merges=MERGES)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tok


def make_processor(tokenizer, patch_size: int = 4, image_pixels: tuple[int, int] = (64, 64 * 64),
                   video_pixels: tuple[int, int] = (64, 48 * 48 * 4)):
    """transformers' Qwen3-VL processors; the demo's 4-pixel patch makes few tokens from small images,
    the released geometry is a 16-pixel patch (32 px per merged vision token)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = dict(patch_size=patch_size, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                  image_std=[0.5] * 3)
    images = Qwen2VLImageProcessor(size={"shortest_edge": image_pixels[0], "longest_edge": image_pixels[1]}, **common)
    videos = Qwen3VLVideoProcessor(size={"shortest_edge": video_pixels[0], "longest_edge": video_pixels[1]}, **common)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos)


TINY_TEXT = dict(hidden_size=TEXT_HIDDEN, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                  "mrope_interleaved": True})
TINY_VISION = dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=TEXT_HIDDEN, num_position_embeddings=16,
                   deepstack_visual_indexes=[0, 1])


def text_config(tokenizer, layers: int = TEXT_LAYERS, text: dict | None = None, vision: dict | None = None,
                vocab_size: int | None = None):
    """A Qwen3-VL config whose special-token ids are this tokenizer's; `text`/`vision` give the sizes
    (the tiny demo's by default)."""
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    text = dict(text or TINY_TEXT, vocab_size=vocab_size or len(tokenizer), num_hidden_layers=layers)
    return Qwen3VLConfig(text_config=text, vision_config=dict(vision or TINY_VISION), image_token_id=ids[0],
                         video_token_id=ids[1], vision_start_token_id=ids[2], vision_end_token_id=ids[3])


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


def write_text_encoder(folder: Path, seed: int = 0) -> Path:
    from ..text.torchvision_compat import ensure_importable

    ensure_importable()  # before transformers imports torchvision
    from transformers import Qwen3VLForConditionalGeneration
    tok = make_tokenizer()
    model = Qwen3VLForConditionalGeneration(text_config(tok)).eval()
    randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
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
# workflow (workflows/h3-spark-demo-t2va.json) names these.
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
