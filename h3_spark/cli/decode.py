"""`h3-spark decode`: saved latents -> mp4 (H.264 24 fps + AAC stereo); one latent frame (a still) -> PNG.

The latents file is safetensors with
  video_latents  (1, C, T, h, w)  float, required
  audio_latents  (2, C, Ta)       float, optional (needs --audio-vae)
both *normalised*, i.e. in the DiT's space exactly as the sampler leaves them; each VAE's
latents_mean/latents_std are applied here, at decode. A file may say so in its safetensors
metadata as {"latents": "normalized"}; any other value there is refused rather than guessed at.

Defaults for --vae-dtype and --vae-tile-size come from H3_VAE_DTYPE and H3_VAE_TILE_SIZE when set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..h3_model.engine.vae_flags import DEFAULT_TILE_SIZE, DTYPES, vae_options

LOGLEVELS = ("quiet", "panic", "fatal", "error", "warning", "info", "verbose", "debug", "trace")
DEFAULT_DTYPE = "float16"


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name, help="decode saved latents into an mp4",
        description="Decode normalised video (and audio) latents with the H3 VAEs and write an mp4.",
    )
    parser.add_argument("latents", help="safetensors with video_latents (1,C,T,h,w) [and audio_latents (2,C,Ta)]")
    parser.add_argument("--vae", required=True, help="video VAE: diffusers vae/ folder, its parent, or a ComfyUI file")
    parser.add_argument("--audio-vae", help="audio VAE: diffusers audio_vae/ folder, its parent, or a ComfyUI file")
    parser.add_argument("--out", required=True, help="output .mp4")
    parser.add_argument("--vae-dtype", choices=DTYPES, default=None,
                        help=f"decoder precision (env H3_VAE_DTYPE, default {DEFAULT_DTYPE}; float32 is exact)")
    parser.add_argument("--vae-tile-size", type=int, default=None,
                        help=f"spatial tile in pixels, 0 = untiled (env H3_VAE_TILE_SIZE, default {DEFAULT_TILE_SIZE})")
    parser.add_argument("--ffmpeg-loglevel", choices=LOGLEVELS, default=None, help="let FFmpeg log at this level")
    parser.add_argument("--device", default="auto", help="torch device (default: cuda if available, else cpu)")
    return parser


@dataclass(frozen=True)
class Settings:
    vae_dtype: str
    tile_size: int
    device: str


def resolve_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Flags win over the environment, the environment over the defaults."""
    dtype, tile = vae_options(args.vae_dtype, args.vae_tile_size, DEFAULT_DTYPE, environ)
    return Settings(dtype, tile, _device(args.device))


def _device(name: str) -> str:
    import torch

    from ..errors import InputError

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r} was asked for, but this machine has no CUDA GPU; use --device cpu")
    return str(device)


def read_latents(path: str | os.PathLike) -> dict[str, Any]:
    """video_latents (and audio_latents if present) from a latents file, shape-checked."""
    from safetensors import safe_open

    from ..errors import InputError

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such latents file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in ("video_latents", "audio_latents") if k in handle.keys()}
    except Exception as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc})") from None
    space = metadata.get("latents", "normalized")
    if space != "normalized":
        raise InputError(f"{path}: metadata says latents are {space!r}; decode expects normalised latents")
    video = tensors.get("video_latents")
    if video is None:
        raise InputError(f"{path}: no video_latents tensor")
    if video.ndim != 5 or video.shape[0] != 1 or not video.is_floating_point():
        raise InputError(f"{path}: video_latents must be float (1, C, T, h, w), got {tuple(video.shape)} {video.dtype}")
    audio = tensors.get("audio_latents")
    if audio is not None and (audio.ndim != 3 or audio.shape[0] != 2 or not audio.is_floating_point()):
        raise InputError(f"{path}: audio_latents must be float (2, C, Ta), got {tuple(audio.shape)} {audio.dtype}")
    return {"video": video, "audio": audio}


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import InputError
    from ..h3_model.media import files as media
    from ..h3_model.vae import loading as vae_loading
    from ..h3_model.vae import video_config
    from ..kernels.settings import KernelSettings, vae_tile_batch
    from ..h3_model.engine.kernel_plan import apply_vae_kernels

    settings = resolve_settings(args)
    tile_batch = vae_tile_batch()
    latents = read_latents(args.latents)
    still = latents["video"].shape[2] == 1  # one latent frame: a picture (its audio latents are not decoded)
    if latents["audio"] is not None and not args.audio_vae and not still:
        raise InputError(f"{args.latents} has audio_latents; pass --audio-vae to decode them")
    out = Path(args.out)
    if still and out.suffix.lower() != ".png":
        raise InputError(f"{out}: {args.latents} holds one latent frame (a still); the output must be a .png file")
    if not still and out.suffix.lower() != ".mp4":
        raise InputError(f"{out}: the output must be an .mp4 file")
    seconds: dict[str, float] = {}

    clock = time.perf_counter()
    vae = vae_loading.load_video_vae(args.vae, device=settings.device,
                                     decode_dtype=video_config.DECODE_DTYPES[settings.vae_dtype])
    seconds["load_vae"] = time.perf_counter() - clock
    vae.tile_batch = tile_batch
    kernels = apply_vae_kernels(vae, KernelSettings.from_env())
    video = latents["video"]
    if video.shape[1] != vae.config.latent_channels:
        raise InputError(f"video_latents have {video.shape[1]} channels, "
                         f"the video VAE takes {vae.config.latent_channels}")
    clock = time.perf_counter()
    frames = vae.decode_to_buffer(vae.denormalize(video.to(settings.device)), tile_size=settings.tile_size or None)[0]
    seconds["decode_video"] = time.perf_counter() - clock
    del vae
    if settings.device.startswith("cuda"):
        torch.cuda.empty_cache()

    wav, sample_rate = None, media.SAMPLE_RATE
    if still:
        clock = time.perf_counter()
        media.write_png(out, frames[0])
        seconds["write"] = time.perf_counter() - clock
        print(json.dumps({"command": "decode", "out": str(out), "frames": 1, "height": int(frames.shape[1]),
                          "width": int(frames.shape[2]), "vae_dtype": settings.vae_dtype,
                          "vae_tile_size": settings.tile_size, "device": settings.device, "vae_kernels": kernels,
                          "seconds": {k: round(v, 3) for k, v in seconds.items()}}))
        return 0
    if latents["audio"] is not None:
        clock = time.perf_counter()
        audio_vae = vae_loading.load_audio_vae(args.audio_vae, device=settings.device)
        if latents["audio"].shape[1] != audio_vae.config.latent_channels:
            raise InputError(f"audio_latents have {latents['audio'].shape[1]} channels, the audio VAE takes "
                             f"{audio_vae.config.latent_channels}")
        wav = audio_vae.decode_stereo(latents["audio"].to(settings.device)).cpu()
        sample_rate = audio_vae.config.sampling_rate
        seconds["decode_audio"] = time.perf_counter() - clock
        del audio_vae

    clock = time.perf_counter()
    media.write_mp4(out, frames, wav, fps=media.FPS, sample_rate=sample_rate, loglevel=args.ffmpeg_loglevel)
    seconds["write"] = time.perf_counter() - clock
    summary = {
        "command": "decode", "out": str(out), "frames": int(frames.shape[0]), "height": int(frames.shape[1]),
        "width": int(frames.shape[2]), "fps": media.FPS,
        "audio_samples": 0 if wav is None else min(int(wav.shape[1]), round(frames.shape[0] / media.FPS * sample_rate)),
        "sample_rate": sample_rate, "vae_dtype": settings.vae_dtype, "vae_tile_size": settings.tile_size,
        "device": settings.device, "vae_kernels": kernels, "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }
    print(json.dumps(summary))
    return 0
