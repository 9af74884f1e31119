"""References and keyframes, normalised the way the released model saw them.

All pixels are uint8 RGB, (H, W, 3) for an image and (F, H, W, 3) for a video; waveforms are
float32 (channels, samples). Resizing uses Pillow's LANCZOS, as the reference pipeline does.
- Image references: resized by policy (`match`, `max` or `diffusers`, see geometry.reference_size).
- Video references: resampled to 24 fps by dropping/duplicating whole frames, truncated to the
  generated length and put on the canvas that their own aspect ratio resolves to; a soundtrack is
  truncated to the generated duration. They need at least 13 frames at 24 fps, the fewest that give
  Qwen one vision block (2 fps, pairs of frames). For the VAE they are snapped *down* to 17n+5 frames
  with n >= 1, as the reference pipeline snaps them: one shorter than 22 frames goes whole and the VAE
  pads it with its last frame (13-17 frames encode to 2 latent frames, 18-21 to 7).
- Audio references: stereo at 32 kHz, truncated to the generated duration.
- FL2VA keyframes: the first is stretched onto the canvas, the last is cover-cropped (scaled to
  cover, centred) so it never distorts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import InputError
from .. import geometry
from ..dit.layout import AudioBlock, ImageBlock, VideoBlock, check_references
from ..text.prompt import QWEN_TEMPORAL_PATCH, VIDEO_SAMPLE_FPS, shortest_video
from .resample import resample


@dataclass
class ImageReference:
    image: torch.Tensor  # uint8 (H, W, 3)
    kind: str = field(default="image", init=False)


@dataclass
class VideoReference:
    frames: torch.Tensor  # uint8 (F, H, W, 3)
    fps: float = float(geometry.FPS)
    audio: torch.Tensor | None = None  # float (channels, samples) at `sample_rate`
    sample_rate: int = geometry.AUDIO_SAMPLE_RATE
    kind: str = field(default="video", init=False)


@dataclass
class AudioReference:
    audio: torch.Tensor  # float (channels, samples) at `sample_rate`
    sample_rate: int = geometry.AUDIO_SAMPLE_RATE
    kind: str = field(default="audio", init=False)


Reference = ImageReference | VideoReference | AudioReference


@dataclass
class PreparedReference:
    """A reference ready for the encoders: pixels for the VAE and Qwen, stereo 32 kHz audio."""

    kind: str
    pixels: torch.Tensor | None = None  # uint8 (H, W, 3) image or (F, H, W, 3) video, VAE-ready size and length
    audio: torch.Tensor | None = None  # float32 (2, samples) at 32 kHz
    # A video's frames for Qwen: all of them up to the generation's length, where the VAE takes 17n+5.
    prompt_pixels: torch.Tensor | None = None

    def content_hash(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(self.kind.encode())
        for t in (self.pixels, self.audio):
            if t is not None:
                h.update(str(tuple(t.shape)).encode())
                h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


REFERENCE_KINDS = ("image", "video", "audio")


def load_reference(kind: str, path, *, frames: int | None = None, max_pixels: int | None = None) -> Reference:
    """A reference read from a file: image, video (with its soundtrack when it has one) or audio.

    `frames` (the generation's frame count at 24 fps) bounds what is decoded to what the generation
    uses; `max_pixels` refuses larger images and video frames before decoding them."""
    from . import files as media

    seconds = None if frames is None else frames / geometry.FPS
    if kind == "image":
        return ImageReference(media.read_image(path, max_pixels=max_pixels))
    # Soundtracks stay at the file's own rate here: `stereo` cuts them to the generation's length there and
    # then resamples once, as the reference pipeline does.
    if kind == "audio":
        clip = media.read_audio_clip(path, max_seconds=seconds)
        return AudioReference(clip.audio, sample_rate=clip.sample_rate)
    if kind == "video":
        clip = media.read_video(path, fps=geometry.FPS, max_frames=frames, max_pixels=max_pixels, sample_rate=None)
        rate = clip.sample_rate if clip.audio is not None else geometry.AUDIO_SAMPLE_RATE
        return VideoReference(clip.frames, fps=float(clip.fps), audio=clip.audio, sample_rate=rate)
    raise InputError(f"a reference kind must be one of {', '.join(REFERENCE_KINDS)}, got {kind!r}")


def check_image(image: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise InputError(f"{what} must be a uint8 (H, W, 3) RGB tensor")
    if min(image.shape[:2]) < 1:
        raise InputError(f"{what} is empty")
    return image


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """LANCZOS resize of one uint8 (H, W, 3) image; a no-op at the same size."""
    from PIL import Image

    if tuple(image.shape[:2]) == (height, width):
        return image
    out = Image.fromarray(image.numpy()).resize((width, height), Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(out).copy())


def cover_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Scale to cover (height, width) keeping the aspect, then crop the centre."""
    from PIL import Image

    src_h, src_w = image.shape[:2]
    scale = max(width / src_w, height / src_h)
    rw, rh = max(width, round(src_w * scale)), max(height, round(src_h * scale))
    left, top = max(0, (rw - width) // 2), max(0, (rh - height) // 2)
    resized = Image.fromarray(image.numpy()).resize((rw, rh), Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(resized.crop((left, top, left + width, top + height))).copy())


def resample_fps(frames: torch.Tensor, fps: float, target: float = geometry.FPS) -> torch.Tensor:
    """Constant-rate resample by dropping/duplicating whole frames (like ffmpeg's fps filter)."""
    if fps <= 0:
        raise InputError(f"a reference video needs a positive frame rate, got {fps}")
    if fps == target:
        return frames
    scale = target / fps
    n = frames.shape[0]
    slots = np.floor(np.arange(n) * scale + 0.5).astype(np.int64)
    counts = np.diff(slots, append=math.floor(n * scale + 0.5))
    return frames[torch.from_numpy(np.repeat(np.arange(n), counts))]


def resample_audio(audio: torch.Tensor, rate: int, target: int) -> torch.Tensor:
    """float (C, N) mono or stereo at `rate` -> float32 (C, M) at `target`, with the reference pipeline's
    windowed-sinc filter (h3_model/resample.py)."""
    if audio.shape[0] not in (1, 2):
        raise InputError(f"audio must be mono or stereo, got {audio.shape[0]} channels")
    return resample(audio, rate, target)


def stereo(audio: torch.Tensor, sample_rate: int, max_seconds: float, what: str) -> torch.Tensor:
    """(channels, samples) -> float32 stereo at 32 kHz, truncated (at the source rate) to max_seconds."""
    audio = torch.as_tensor(audio)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] < 1:
        raise InputError(f"{what} must be a (channels, samples) mono or stereo waveform, got {tuple(audio.shape)}")
    audio = audio.float()[:, : int(max_seconds * sample_rate)]
    if audio.shape[0] == 1:
        audio = audio.expand(2, -1).contiguous()
    if sample_rate != geometry.AUDIO_SAMPLE_RATE:
        audio = resample_audio(audio, sample_rate, geometry.AUDIO_SAMPLE_RATE)
    return audio


def prepare_references(refs: list[Reference], *, width: int, height: int, frames: int,
                       policy: str = "match") -> list[PreparedReference]:
    """Normalise Ref2VA references for a (width x height, frames) generation, in request order."""
    seconds = frames / geometry.FPS
    check_references([_block_stub(r) for r in refs])
    out = []
    for i, ref in enumerate(refs):
        what = f"reference {i + 1} ({getattr(ref, 'kind', type(ref).__name__)})"
        if isinstance(ref, ImageReference):
            img = check_image(ref.image, what)
            try:
                h, w = geometry.reference_size(policy, img.shape[1], img.shape[0], width, height)
            except InputError as exc:
                raise InputError(f"{what}: {exc}") from None
            out.append(PreparedReference("image", pixels=resize(img, h, w)))
        elif isinstance(ref, VideoReference):
            out.append(_prepare_video(ref, frames, seconds, what))
        elif isinstance(ref, AudioReference):
            out.append(PreparedReference("audio", audio=stereo(ref.audio, ref.sample_rate, seconds, what)))
        else:
            raise InputError(f"{what}: unsupported reference type {type(ref).__name__}")
    return out


def _prepare_video(ref: VideoReference, frames: int, seconds: float, what: str) -> PreparedReference:
    video = ref.frames
    if not isinstance(video, torch.Tensor) or video.dtype != torch.uint8 or video.ndim != 4 or video.shape[-1] != 3:
        raise InputError(f"{what} must be uint8 (F, H, W, 3) frames")
    video = resample_fps(video, ref.fps)[:frames]
    # Checked here, before any resizing or encoding, for the released Qwen3-VL; the presentation checks the
    # loaded processor's own patch again.
    shortest = shortest_video()
    if video.shape[0] < shortest:
        raise InputError(f"{what} has {video.shape[0]} frames at 24 fps; a video reference needs at least "
                         f"{shortest} ({shortest / geometry.FPS:.2f} s): the text encoder reads it at "
                         f"{VIDEO_SAMPLE_FPS} fps, {QWEN_TEMPORAL_PATCH} sampled frames per vision block")
    h, w = geometry.resolve_canvas(video.shape[2], video.shape[1])
    video = torch.stack([resize(f, h, w) for f in video]) if tuple(video.shape[1:3]) != (h, w) else video
    audio = None if ref.audio is None else stereo(ref.audio, ref.sample_rate, seconds, f"{what} soundtrack")
    return PreparedReference("video", pixels=video[:vae_frame_count(video.shape[0])], audio=audio,
                             prompt_pixels=video)


def vae_frame_count(count: int) -> int:
    """How many of a video reference's `count` frames the VAE encodes; Qwen always sees all of them.

    Snapped down to 17n+5 so that the VAE needs no padding, but with n >= 1, as the reference pipeline
    snaps: a clip of 13..21 frames goes whole and the VAE repeats its last frame up to a chunk. Snapping
    18..21 frames to 5 would give 2 latent frames where the reference has 7; for 13..17 the causal
    encoder's 2 kept latent frames see only the first 5 frames either way.
    """
    chunks = max(1, (count - geometry.VAE_LATENTS_PER_CHUNK) // geometry.VAE_FRAMES_PER_CHUNK)
    return min(count, chunks * geometry.VAE_FRAMES_PER_CHUNK + geometry.VAE_LATENTS_PER_CHUNK)


def prompt_references(prepared: list[PreparedReference]) -> list:
    """What the prompt presentation needs of prepared references: pixels for images and videos, a label for audio."""
    from ..text.prompt import AudioRef, ImageRef, VideoRef

    return [ImageRef(p.pixels) if p.kind == "image" else VideoRef(
        p.pixels if p.prompt_pixels is None else p.prompt_pixels, has_soundtrack=p.audio is not None)
        if p.kind == "video" else AudioRef() for p in prepared]


def _block_stub(ref) -> object:
    # Only the kinds matter for the limit checks; geometry comes later from the encoded latents.
    if isinstance(ref, ImageReference):
        return ImageBlock(1, 1)
    if isinstance(ref, VideoReference):
        return VideoBlock(1, 1, 1, 0)
    if isinstance(ref, AudioReference):
        return AudioBlock(1)
    raise InputError(f"unsupported reference type {type(ref).__name__}")


def prepare_keyframes(first: torch.Tensor | None, last: torch.Tensor | None, width: int | None,
                      height: int | None) -> tuple[list[torch.Tensor], tuple[str, ...], int, int]:
    """FL2VA keyframes -> (images at the canvas, anchors, width, height); the canvas follows the first given."""
    given = [(a, check_image(img, f"the {a} keyframe")) for a, img in (("first", first), ("last", last))
             if img is not None]
    if not given:
        raise InputError("FL2VA needs a first and/or a last keyframe")
    if (width is None) != (height is None):
        raise InputError("width and height go together, or neither")
    if width is None:
        anchor_img = given[0][1]
        height, width = geometry.resolve_canvas(anchor_img.shape[1], anchor_img.shape[0])
    images = [resize(img, height, width) if i == 0 else cover_crop(img, height, width)
              for i, (_, img) in enumerate(given)]
    return images, tuple(a for a, _ in given), width, height
