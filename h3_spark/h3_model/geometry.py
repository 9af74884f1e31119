"""Request geometry: canvas, frame counts and latent sizes.

The VAE encodes 17-frame chunks into 5 latent frames (plus 2 extra at the start), so clip
lengths are 17n+5 pixel frames = 5n+2 latent frames; the audio VAE makes 40 latents/s.
"""

from __future__ import annotations

import math

from ..errors import InputError

FPS = 24
AUDIO_SAMPLE_RATE = 32000
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
VAE_SPATIAL = 16
VAE_FRAMES_PER_CHUNK = 17
VAE_LATENTS_PER_CHUNK = 5
CANVAS_MULTIPLE = 32  # VAE 16 x patch 2
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
MIN_ASPECT = 1 / 4
MAX_ASPECT = 4.0
MIN_SECONDS = 5.0
MAX_SECONDS = 15.0
DEFAULT_FRAMES = 124
# A still (text to image): one pixel frame, one latent frame. The one length off the 17k+5 grid; its audio
# stream is the minimal one a frame covers (audio_latent_frames(1) == 2 latents), sampled and never decoded.
STILL_FRAMES = 1


def _check_aspect(width: float, height: float) -> float:
    if width <= 0 or height <= 0:
        raise InputError(f"aspect ratio must be positive, got {width}:{height}")
    ratio = width / height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise InputError(f"aspect ratio {width}:{height} ({ratio:.3g}) is outside 1:4 .. 4:1")
    return ratio


def resolve_canvas(aspect_width: float = 16, aspect_height: float = 9, *, short_edge: int = CANVAS_SHORT_EDGE,
                   max_pixels: int = CANVAS_MAX_PIXELS, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int]:
    """(height, width) of the canvas for an aspect ratio: short edge first, then the area cap, then rounding."""
    ratio = _check_aspect(aspect_width, aspect_height)
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = math.sqrt(max_pixels / area)
        width, height = width * scale, height * scale
    # Python's round() is round-half-even, like the reference.
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def nearest_canvas(width: int, height: int, *, multiple: int = CANVAS_MULTIPLE,
                   max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of the canvas nearest a wanted one: each side rounded to the multiple, then scaled down
    (rounding down) until it fits the pixel limit. What an error names as the size to ask for instead."""
    w, h = max(multiple, round(width / multiple) * multiple), max(multiple, round(height / multiple) * multiple)
    if max_pixels is not None and w * h > max_pixels:
        scale = math.sqrt(max_pixels / (w * h))
        w = max(multiple, math.floor(w * scale / multiple) * multiple)
        h = max(multiple, math.floor(h * scale / multiple) * multiple)
    return w, h


def check_canvas(width: int, height: int, *, multiple: int = CANVAS_MULTIPLE,
                 max_pixels: int | None = None) -> None:
    """Reject an explicit canvas the model cannot generate, naming the nearest one it can."""
    if width % multiple or height % multiple:
        w, h = nearest_canvas(width, height, multiple=multiple, max_pixels=max_pixels)
        raise InputError(f"width and height must be multiples of {multiple}, got {width}x{height} "
                         f"(nearest valid: {w}x{h})")
    _check_aspect(width, height)
    if max_pixels is not None and width * height > max_pixels:
        w, h = nearest_canvas(width, height, multiple=multiple, max_pixels=max_pixels)
        raise InputError(f"canvas {width}x{height} exceeds the {max_pixels} pixel limit (nearest valid: {w}x{h})")


def align_frames(num_frames: int) -> int:
    """Snap a frame count up to the next 17n+5."""
    if num_frames < 1:
        raise InputError(f"frame count must be positive, got {num_frames}")
    rem = (num_frames - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK
    return num_frames if rem == 0 else num_frames + VAE_FRAMES_PER_CHUNK - rem


def snap_frames(num_frames: int, *, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> int:
    """Aligned frame count for a generation request, which must last 5-15 s at 24 fps, or be one frame (a
    still, STILL_FRAMES)."""
    if num_frames == STILL_FRAMES:
        return STILL_FRAMES
    aligned = align_frames(num_frames)
    lo, hi = align_frames(math.ceil(min_seconds * FPS)), int(max_seconds * FPS)
    hi -= (hi - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK
    if not lo <= aligned <= hi:
        nearest = lo if aligned < lo else hi
        raise InputError(
            f"{num_frames} frames snaps to {aligned} ({aligned / FPS:.2f} s); "
            f"H3 generates {lo}..{hi} frames ({min_seconds:g}-{max_seconds:g} s at {FPS} fps; nearest valid: "
            f"{nearest} frames, {nearest / FPS:.2f} s), or 1 frame for a still image"
        )
    return aligned


def snap_frames_down(num_frames: int) -> int:
    """Largest 17n+5 not above num_frames (video references are truncated, never padded)."""
    if num_frames < VAE_LATENTS_PER_CHUNK:
        raise InputError(f"a video needs at least {VAE_LATENTS_PER_CHUNK} frames, got {num_frames}")
    return num_frames - (num_frames - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK


def video_latent_frames(num_frames: int) -> int:
    """5n+2 latent frames for 17n+5 pixel frames; a single frame is one latent frame."""
    if num_frames == 1:
        return 1
    if (num_frames - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK or num_frames < VAE_LATENTS_PER_CHUNK:
        raise InputError(f"frame count must be 17n+5, got {num_frames}")
    return (num_frames - VAE_LATENTS_PER_CHUNK) // VAE_FRAMES_PER_CHUNK * VAE_LATENTS_PER_CHUNK + 2


def audio_latent_frames(num_frames: int, fps: float = FPS) -> int:
    """Audio latents per channel covering num_frames video frames: round(frames / fps * 40)."""
    return int(round(num_frames / fps * AUDIO_LATENTS_PER_SECOND))


def latent_size(height: int, width: int) -> tuple[int, int]:
    return height // VAE_SPATIAL, width // VAE_SPATIAL


REFERENCE_MAX_SHORT_EDGE = 2048
REFERENCE_POLICIES = ("match", "max", "diffusers")


def reference_size(policy: str, src_width: int, src_height: int, canvas_width: int, canvas_height: int,
                   *, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int]:
    """(height, width) an image reference is resized to.

    `match` (ComfyUI's default): scaled down to the generation's pixel area, never up.
    `max`: scaled down to a 2048 px short edge, never up.
    `diffusers`: resized to a 2048 px short edge, upscaling included (diffusers' behaviour).
    The aspect ratio is kept and both sides are rounded to the canvas multiple.
    """
    if src_width <= 0 or src_height <= 0:
        raise InputError(f"reference image size must be positive, got {src_width}x{src_height}")
    # The released pipeline refuses references outside the model's aspect range; under `diffusers` a thin
    # strip would also become enormous (40x1000 -> 2048x51200).
    _check_aspect(src_width, src_height)
    if policy == "match":
        scale = min(1.0, math.sqrt(canvas_width * canvas_height / (src_width * src_height)))
    elif policy == "max":
        scale = min(1.0, REFERENCE_MAX_SHORT_EDGE / min(src_width, src_height))
    elif policy == "diffusers":
        scale = REFERENCE_MAX_SHORT_EDGE / min(src_width, src_height)
    else:
        raise InputError(f"reference size policy must be one of {', '.join(REFERENCE_POLICIES)}, got {policy!r}")
    height = max(multiple, round(src_height * scale / multiple) * multiple)
    width = max(multiple, round(src_width * scale / multiple) * multiple)
    return height, width
