"""Noise masks: keep parts of a given clip and make the rest anew (repaint a region, or a span of time).

A mask is given on pixels and samples (1 or True: make anew; 0: keep) and pooled to what the DiT's rows are:
a video row is one 2x2 patch of one latent frame (32 x 32 pixels over the 1 or 4 frames that latent frame
covers), an audio row one 40 Hz latent of one channel (800 samples). A row is made anew when any pixel or
sample under it is, so a repainted region is never narrower than asked. Kept rows are held at the clip's own
latents the way conditions are (video at t = 0.999, sound clean) and come out as the clip's latents exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import InputError
from .. import geometry
from ..dit.layout import ROPE_FRAMES_PER_LATENT

AUDIO_SAMPLES_PER_LATENT = geometry.AUDIO_SAMPLE_RATE // geometry.AUDIO_LATENTS_PER_SECOND


@dataclass
class Source:
    """The clip to keep parts of: `frames` uint8 (F, H, W, 3) at 24 fps, F = 17k+5 at the canvas; `audio` float
    (2, samples) at 32 kHz (None: silence is kept where the sound is kept)."""

    frames: torch.Tensor
    audio: torch.Tensor | None = None


@dataclass
class NoiseMask:
    """Where to make anew: `video` (F, H, W), (H, W) for every frame or (F,) for whole frames; `audio` (samples,)
    at 32 kHz; values in [0, 1], anything above 0 is made anew. None: keep all of it."""

    video: torch.Tensor | None = None
    audio: torch.Tensor | None = None


def latent_frame_spans(latent_frames: int) -> list[tuple[int, int]]:
    """The pixel frames [start, end) each latent frame covers: 1, 4, 4, 4, 4, 1, 4, ... frames."""
    spans, start = [], 0
    for i in range(latent_frames):
        size = ROPE_FRAMES_PER_LATENT[i % len(ROPE_FRAMES_PER_LATENT)]
        spans.append((start, start + size))
        start += size
    return spans


def video_rows(mask: torch.Tensor, frames: int, height: int, width: int, patch: int = 32) -> torch.Tensor:
    """Bool per target video row (latent frame major, then patch rows, row-major): True where it is made anew."""
    mask = torch.as_tensor(mask)
    if mask.ndim == 2:
        mask = mask.expand(frames, *mask.shape)
    elif mask.ndim == 1 and mask.shape[0] == frames:
        mask = mask[:, None, None].expand(frames, height, width)
    if tuple(mask.shape) != (frames, height, width):
        raise InputError(f"a video mask is (frames, height, width) = ({frames}, {height}, {width}), (height, width) "
                         f"or (frames,), got {tuple(mask.shape)}")
    if height % patch or width % patch:
        raise InputError(f"the canvas {width}x{height} is not a whole number of {patch}-pixel patches")
    anew = _in_unit_range(mask.float(), "a video mask") > 0
    spatial = F.max_pool2d(anew.float()[:, None], patch)[:, 0] > 0  # (F, H / patch, W / patch)
    latents = geometry.video_latent_frames(frames)
    per_latent = torch.stack([spatial[a:b].any(0) for a, b in latent_frame_spans(latents)])
    return per_latent.reshape(-1)


def audio_rows(mask: torch.Tensor, audio_latents: int) -> torch.Tensor:
    """Bool per target audio row (left channel's latents, then the right's): True where it is made anew."""
    mask = torch.as_tensor(mask)
    samples = audio_latents * AUDIO_SAMPLES_PER_LATENT
    if mask.ndim != 1 or mask.shape[0] > samples:
        raise InputError(f"an audio mask is one value per sample, at most {samples} for this clip, got "
                         f"{tuple(mask.shape)}")
    anew = _in_unit_range(mask.float(), "an audio mask") > 0
    anew = F.pad(anew.float(), (0, samples - anew.shape[0])).reshape(audio_latents, AUDIO_SAMPLES_PER_LATENT)
    per_latent = anew.amax(1) > 0
    return per_latent.repeat(geometry.AUDIO_CHANNELS)


def _in_unit_range(values: torch.Tensor, what: str) -> torch.Tensor:
    if not torch.isfinite(values).all() or values.min() < 0 or values.max() > 1:
        raise InputError(f"{what} holds values in [0, 1] (1: make anew), got {values.min().item():g}.."
                         f"{values.max().item():g}")
    return values


def time_span_mask(frames: int, start_s: float, end_s: float) -> NoiseMask:
    """Make anew the picture and sound from `start_s` to `end_s` seconds, keep the rest."""
    if not 0 <= start_s < end_s:
        raise InputError(f"a time span runs from a start >= 0 to a later end, got {start_s:g}..{end_s:g} s")
    seconds = frames / geometry.FPS
    if start_s >= seconds:
        raise InputError(f"the span {start_s:g}..{end_s:g} s starts past the clip's end ({seconds:g} s)")
    # Frame f shows [f, f + 1) / 24 s: every frame that overlaps the span is made anew.
    video = torch.zeros(frames)
    video[math.floor(start_s * geometry.FPS):min(frames, math.ceil(end_s * geometry.FPS))] = 1
    samples = geometry.audio_latent_frames(frames) * AUDIO_SAMPLES_PER_LATENT
    audio = torch.zeros(samples)
    audio[math.floor(start_s * geometry.AUDIO_SAMPLE_RATE):min(samples, math.ceil(end_s * geometry.AUDIO_SAMPLE_RATE))] = 1
    return NoiseMask(video, audio)


def repaint_mask(frames: int, height: int, width: int, region: torch.Tensor | None = None,
                 span: tuple[float, float] | None = None, what: str = "the mask") -> NoiseMask:
    """What a repaint makes anew: `region` (a uint8 (H, W, 3) picture, non-black = anew) in every frame, the sound
    kept; or `span` (start, end seconds), picture and sound; or the region within the span."""
    if region is None and span is None:
        raise InputError("a repaint needs what to make anew: a region, a time span or both")
    video = audio = None
    if span is not None:
        timed = time_span_mask(frames, *span)
        video, audio = timed.video[:, None, None].expand(frames, height, width), timed.audio
    if region is not None:
        if tuple(region.shape[:2]) != (height, width):
            raise InputError(f"{what} is {region.shape[1]}x{region.shape[0]}; the clip is {width}x{height}")
        anew = (region.amax(-1) > 0).float()
        video = anew.expand(frames, height, width) if video is None else video * anew
        if audio is None:  # a region of the picture: the sound is kept whole
            audio = torch.zeros(geometry.audio_latent_frames(frames) * AUDIO_SAMPLES_PER_LATENT)
    return NoiseMask(video, audio)
