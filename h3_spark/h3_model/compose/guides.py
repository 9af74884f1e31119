"""Guides: a still, a clip or a sound pinned at any frame of the clip being generated.

A guide is conditioning, not a replaced frame: its latents become condition rows after the text (video rows
noise-augmented and held at t = 0.999 like FL2VA's keyframes, audio rows clean), whose rotary time is the
target's at the guide's frame (text length + 5/3 x frame on the continuous axis) and whose spatial grid is the
target's. So a guide must be at the target's canvas: stills and clips are cover-cropped to it. FL2VA's first
and last keyframes are the same mechanism at frames 0 and -1 (`dit/layout.py`).

Frame indices count from 0; a negative one counts from the end (-1 is the last frame). A clip is 17k+5 frames
(5, 22, 39, ...: what the video VAE encodes without padding) and must fit before the end. A sound keeps at most
the audio latents that remain of the clip after its frame (the target's less 5/3 a frame, rounded up: ComfyUI's
count); a longer one is cropped there, with a note, as ComfyUI's AddGuide crops it.

Guides go with every mode. In Ref2VA their rows follow the text, before the references, and their time starts
where the references' spans end (the target's own origin; `dit/layout.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import InputError
from .. import geometry
from ..dit.layout import guide_audio_room
from ..media.refs import check_image, cover_crop, resample_fps, stereo

AUDIO_SAMPLES_PER_LATENT = geometry.AUDIO_SAMPLE_RATE // geometry.AUDIO_LATENTS_PER_SECOND
GUIDE_KINDS = ("image", "clip", "audio")
MAX_GUIDES = 16


@dataclass
class Guide:
    """A guide as asked for: `image` uint8 (H, W, 3); `clip` uint8 (F, H, W, 3) at `fps`; `audio` float
    (channels, samples) at `sample_rate`."""

    kind: str
    frame: int
    image: torch.Tensor | None = None
    clip: torch.Tensor | None = None
    fps: float = float(geometry.FPS)
    audio: torch.Tensor | None = None
    sample_rate: int = geometry.AUDIO_SAMPLE_RATE

    def describe(self) -> str:
        return f"{self.kind} guide at frame {self.frame}"


@dataclass
class PreparedGuide:
    """A guide at the canvas, its frame resolved: `pixels` uint8 (H, W, 3) or (F, H, W, 3); `audio` float32
    stereo (2, samples) at 32 kHz."""

    kind: str
    frame: int
    pixels: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    # A sound: the most audio latents it keeps once encoded (what remains of the clip after its frame); the note
    # that says it was cropped to them, or None.
    max_audio_latents: int | None = None
    note: str | None = None

    def keep(self, latents: torch.Tensor) -> torch.Tensor:
        """A sound's encoded latents (..., T) cut to the count it keeps (ComfyUI crops the encoded latents, not
        the waveform)."""
        return latents if self.max_audio_latents is None else latents[..., :self.max_audio_latents]

    @property
    def frames(self) -> int:
        """Pixel frames the guide covers (a sound covers none)."""
        if self.pixels is None:
            return 0
        return 1 if self.pixels.ndim == 3 else int(self.pixels.shape[0])


def resolve_frame(index: int, frames: int, what: str) -> int:
    """A guide's frame in [0, frames): negative indices count from the end."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise InputError(f"{what}: the frame index must be an integer, got {index!r}")
    resolved = frames + index if index < 0 else index
    if not 0 <= resolved < frames:
        raise InputError(f"{what}: frame {index} is outside the {frames}-frame clip (use 0..{frames - 1}, or "
                         f"-1..-{frames} from the end)")
    return resolved


def check_clip_length(count: int, what: str) -> None:
    if count < geometry.VAE_LATENTS_PER_CHUNK or (count - geometry.VAE_LATENTS_PER_CHUNK) % geometry.VAE_FRAMES_PER_CHUNK:
        below = geometry.snap_frames_down(count) if count >= geometry.VAE_LATENTS_PER_CHUNK else None
        hint = f" (the nearest shorter is {below})" if below else ""
        raise InputError(f"{what} has {count} frames at 24 fps; a clip guide is 17k+5 frames (5, 22, 39, ...){hint}")


def remaining_audio_latents(frame: int, frames: int) -> int:
    """Audio latents of the clip from `frame` on: what a sound guide there keeps at most (dit/layout.py)."""
    return guide_audio_room(frame, geometry.audio_latent_frames(frames))


# How far a guide's aspect may stray from the canvas's: cover-cropping keeps at least this share of each side.
MAX_CROP_RATIO = 4.0


def check_fits(src_height: int, src_width: int, height: int, width: int, what: str) -> None:
    """A picture that cover-cropping can fit to the canvas: its aspect within 4x of the canvas's (a 1x4000 strip
    would be scaled to millions of pixels across and keep a sliver of itself)."""
    ratio = (src_width / src_height) / (width / height)
    if not 1 / MAX_CROP_RATIO <= ratio <= MAX_CROP_RATIO:
        kept = 100 / max(ratio, 1 / ratio)
        raise InputError(f"{what} is {src_width}x{src_height}: cover-cropped to the {width}x{height} canvas it would "
                         f"keep {kept:.1f}% of its {'width' if ratio > 1 else 'height'}; its aspect must be within "
                         f"{MAX_CROP_RATIO:g}x of the canvas's")


def _checked(guide: Guide, frames: int, width: int, height: int, what: str) -> PreparedGuide:
    """A guide checked against a (width x height, frames) clip, its frame resolved, its clip at 24 fps and its
    sound stereo at 32 kHz with the latents it keeps; its pictures not yet cropped to the canvas."""
    if guide.kind not in GUIDE_KINDS:
        raise InputError(f"{what}: a guide is one of {', '.join(GUIDE_KINDS)}, got {guide.kind!r}")
    frame = resolve_frame(guide.frame, frames, what)
    if guide.kind == "image":
        image = check_image(guide.image, what)
        check_fits(int(image.shape[0]), int(image.shape[1]), height, width, what)
        return PreparedGuide("image", frame, pixels=image)
    if guide.kind == "clip":
        clip = guide.clip
        if not isinstance(clip, torch.Tensor) or clip.dtype != torch.uint8 or clip.ndim != 4 or clip.shape[-1] != 3:
            raise InputError(f"{what} must be uint8 (F, H, W, 3) frames")
        check_fits(int(clip.shape[1]), int(clip.shape[2]), height, width, what)
        clip = resample_fps(clip, guide.fps)
        check_clip_length(int(clip.shape[0]), what)
        if frame + clip.shape[0] > frames:
            raise InputError(f"{what}: its {clip.shape[0]} frames from frame {frame} run past the clip's end "
                             f"({frames} frames); anchor it at {frames - clip.shape[0]} or earlier")
        return PreparedGuide("clip", frame, pixels=clip)
    if guide.audio is None:
        raise InputError(f"{what} needs a (channels, samples) waveform")
    raw = torch.as_tensor(guide.audio)
    audio = stereo(raw, guide.sample_rate, raw.shape[-1] / guide.sample_rate if raw.ndim == 2 else 0, what)
    # The audio VAE makes one latent per 800 samples (the last one zero-padded); those past the clip's end go.
    latents = -(-audio.shape[1] // AUDIO_SAMPLES_PER_LATENT)
    room = remaining_audio_latents(frame, frames)  # at least 1 at every frame of the clip
    note = None
    if latents > room:
        note = (f"{what}: {audio.shape[1] / geometry.AUDIO_SAMPLE_RATE:.3f} s of sound from frame {frame} runs past "
                f"the clip's end; cropped to the {room} audio latents ({room / geometry.AUDIO_LATENTS_PER_SECOND:.3f}"
                f" s) that remain")
    return PreparedGuide("audio", frame, audio=audio, max_audio_latents=room, note=note)


def _whats(guides: list[Guide]) -> list[str]:
    if len(guides) > MAX_GUIDES:
        raise InputError(f"at most {MAX_GUIDES} guides, got {len(guides)}")
    return [f"guide {i + 1} ({getattr(g, 'kind', '?')})" for i, g in enumerate(guides)]


def check_guides(guides: list[Guide], *, frames: int, width: int, height: int) -> list[str]:
    """Every refusal guides allow against a (width x height, frames) clip, made without encoding or cropping
    them (the pre-flight checks call this before any weight is read); the notes of what they keep changed."""
    notes = [_checked(g, frames, width, height, what).note for g, what in zip(guides, _whats(guides))]
    return [n for n in notes if n]


def prepare_guides(guides: list[Guide], *, frames: int, width: int, height: int) -> list[PreparedGuide]:
    """Guides at the canvas of a (width x height, frames) generation, in request order."""
    out = []
    for g, what in zip(guides, _whats(guides)):
        p = _checked(g, frames, width, height, what)
        if p.kind == "image":
            p.pixels = cover_crop(p.pixels, height, width)
        elif p.kind == "clip":
            p.pixels = torch.stack([cover_crop(f, height, width) for f in p.pixels])
        out.append(p)
    return out


@dataclass
class History:
    """What a target goes on from: `pixels` uint8 (F, H, W, 3), F = 17k+5 frames at the target's canvas, and the
    sound under them, `audio` float32 stereo (2, samples) at 32 kHz, a whole number of audio latents (800
    samples each) that ends where the frames end (None for silence)."""

    pixels: torch.Tensor
    audio: torch.Tensor | None = None


def prepare_history(history: History, *, width: int, height: int) -> History:
    """A history checked against the canvas (it is the target's own past: it is never resized)."""
    pixels = history.pixels
    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8 or pixels.ndim != 4 or pixels.shape[-1] != 3:
        raise InputError("the history must be uint8 (F, H, W, 3) frames")
    check_clip_length(int(pixels.shape[0]), "the history")
    if tuple(pixels.shape[1:3]) != (height, width):
        raise InputError(f"the history is {pixels.shape[2]}x{pixels.shape[1]}, the canvas {width}x{height}: a clip "
                         "is continued at its own size")
    audio = history.audio
    if audio is not None:
        if not isinstance(audio, torch.Tensor) or audio.ndim != 2 or audio.shape[0] != 2:
            raise InputError("the history's sound must be a stereo (2, samples) waveform at 32 kHz")
        most = int(geometry.AUDIO_LATENTS_PER_SECOND * pixels.shape[0] / geometry.FPS)
        if audio.shape[1] % AUDIO_SAMPLES_PER_LATENT or not 0 < audio.shape[1] // AUDIO_SAMPLES_PER_LATENT <= most:
            raise InputError(f"the history's sound must be 1..{most} whole audio latents ({AUDIO_SAMPLES_PER_LATENT} "
                             f"samples each), got {audio.shape[1]} samples")
    return History(pixels, None if audio is None else audio.float())
