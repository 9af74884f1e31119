"""The data that travels on the graph's wires, in ComfyUI's native MiniMax H3 format.

One format for both node sets, so native and h3-spark nodes mix (docs/comfyui.md, "Wires"):
- CONDITIONING: `[[embeds, extras]]`, embeds = Qwen3-VL hidden state (1, L, D); extras holds
  `minimax_token_tags` (L,) (0 = vision, 1 = text) and `minimax_refs` (blocks of kind image / video /
  video_audio / audio with `latent` (1, C, T, h, w), `audio_latent` (1, C_a, 2, T_a) and their sizes) and / or
  `minimax_keyframes` (`resolved_frame_index`, and `latent` (a still or a 5k+2-frame clip) and/or
  `audio_latent`: FL2VA's first/last frames and AddGuide's guides at any frame, on a Ref2VA conditioning too),
  and ours alone
  `h3_spark_history` (`latent` (1, C, 5k+2, h, w), `audio_latent` or None: the clip a window goes on from,
  placed before the target on the time axis; H3 Extend Video makes it). Latents are normalised.
- LATENT: `{"samples": video+audio}`; inside ComfyUI a `comfy.nested_tensor.NestedTensor((video, audio))`
  with video (B, C, T, H/16, W/16) and audio (B, C_a, 2, T_a) (what native VAEDecode and VAEDecodeAudio
  take), outside ComfyUI the plain tuple (video, audio).
The engine's own layouts: video latents (1, C, T, h, w) (the same), audio latents (2, C_a, T_a), and
audio conditioning rows (2 * T_a, C_a) channel-major (left t0..tN, then right).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..h3_model import geometry
from ..h3_model.dit.layout import AudioBlock, GuideBlock, HistoryBlock, ImageBlock, VideoBlock
from .host import optional_module

TAGS = "minimax_token_tags"
REFS = "minimax_refs"
KEYFRAMES = "minimax_keyframes"
HISTORY = "h3_spark_history"
# The levels a conditioning's visual and audio conditions are held at (ComfyUI's names; packs set them as an
# "anchor strength"): 0.999 and 1.0 as released.
VISUAL_LEVEL = "minimax_visual_cond_noise_aug"
AUDIO_LEVEL = "minimax_audio_cond_noise_aug"


# ------------------------------------------------------------------------------------------ LATENT
def pack_latent(video: torch.Tensor, audio: torch.Tensor) -> dict:
    """LATENT from (1, C, T, h, w) video and (1, C_a, 2, T_a) audio latents."""
    nested = optional_module("comfy.nested_tensor")
    if nested is not None:
        return {"samples": nested.NestedTensor((video, audio))}
    return {"samples": (video, audio)}


def unpack_latent(latent) -> tuple[torch.Tensor, torch.Tensor]:
    """(video (B, C, T, h, w), audio (B, C_a, 2, T_a)) of an H3 audio-video LATENT (ours or native)."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    parts = getattr(samples, "tensors", samples)
    if not isinstance(parts, (tuple, list)) or len(parts) != 2:
        raise InputError("this LATENT is not a MiniMax H3 audio-video latent (video + audio); make it with an "
                         "H3 conditioning node or EmptyMiniMaxH3LatentAV")
    video, audio = parts
    if video.ndim != 5 or audio.ndim != 4 or audio.shape[2] != 2:
        raise InputError(f"an H3 latent holds video (B, C, T, H, W) and audio (B, C, 2, T); got "
                         f"{tuple(video.shape)} and {tuple(audio.shape)}")
    if video.shape[0] != 1 or audio.shape[0] != 1:
        raise InputError(f"H3 generates one video at a time (batch 1); this latent has batch {video.shape[0]}")
    return video, audio


def empty_latent(width: int, height: int, frames: int, video_channels: int, audio_channels: int) -> dict:
    lh, lw = geometry.latent_size(height, width)
    video = torch.zeros(1, video_channels, geometry.video_latent_frames(frames), lh, lw)
    audio = torch.zeros(1, audio_channels, 2, geometry.audio_latent_frames(frames))
    return pack_latent(video, audio)


def frames_of(latent_frames: int) -> int:
    """Pixel frames a latent covers: 17n+5 for 5n+2 latent frames (one frame for one latent frame)."""
    if latent_frames == 1:
        return 1
    if latent_frames < 2 or (latent_frames - 2) % geometry.VAE_LATENTS_PER_CHUNK:
        raise InputError(f"an H3 video latent has 5n+2 frames, got {latent_frames}")
    return (latent_frames - 2) // geometry.VAE_LATENTS_PER_CHUNK * geometry.VAE_FRAMES_PER_CHUNK + \
        geometry.VAE_LATENTS_PER_CHUNK


# ------------------------------------------------------------------------------------------ audio layouts
def audio_to_comfy(audio: torch.Tensor) -> torch.Tensor:
    """Engine (2, C, T) -> ComfyUI (1, C, 2, T)."""
    return audio.permute(1, 0, 2).unsqueeze(0).contiguous()


def audio_from_comfy(audio: torch.Tensor) -> torch.Tensor:
    """ComfyUI (1, C, 2, T) -> engine (2, C, T)."""
    return audio[0].permute(1, 0, 2).contiguous()


def audio_rows(audio: torch.Tensor) -> torch.Tensor:
    """ComfyUI (1, C, 2, T) -> channel-major rows (2 * T, C) as the sampler packs reference audio."""
    return audio[0].float().permute(1, 2, 0).reshape(-1, audio.shape[1]).contiguous()


# ------------------------------------------------------------------------------------------ CONDITIONING
def make_conditioning(embeds: torch.Tensor, tags: torch.Tensor, *, refs: list[dict] | None = None,
                      keyframes: list[dict] | None = None) -> list:
    extras: dict = {TAGS: tags.long().flatten().cpu()}
    if refs:
        extras[REFS] = refs
    if keyframes:
        extras[KEYFRAMES] = keyframes
    return [[embeds, extras]]


@dataclass
class Conditions:
    """What the sampler needs from a CONDITIONING and an H3 LATENT, in the engine's layouts."""

    mode: str
    embeds: torch.Tensor
    tags: torch.Tensor
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    blocks: list = field(default_factory=list)  # guide blocks, then ref2va's reference blocks, packed order
    anchors: tuple[str, ...] = ()  # fl2va keyframe anchors, packed order
    condition_latents: list[torch.Tensor] = field(default_factory=list)
    audio_condition_rows: list[torch.Tensor] = field(default_factory=list)
    visual_level: float | None = None  # None: as released
    audio_level: float | None = None


def read_conditions(conditioning, latent) -> Conditions:
    """Validate a CONDITIONING (ours or native) against an H3 LATENT and convert it for the engine."""
    if not isinstance(conditioning, list) or len(conditioning) != 1 or len(conditioning[0]) != 2:
        raise InputError("the H3 sampler takes one conditioning entry (the output of one H3 conditioning node); "
                         "combined or batched conditioning is not supported")
    embeds, extras = conditioning[0]
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3 or embeds.shape[0] != 1:
        raise InputError(f"H3 conditioning holds text embeddings (1, L, D); got "
                         f"{getattr(embeds, 'shape', type(embeds).__name__)}")
    if TAGS not in extras:
        raise InputError("this conditioning has no minimax_token_tags: it does not come from a MiniMax H3 text "
                         "encoder (use an H3 conditioning node or the native MiniMax H3 nodes)")
    tags = torch.as_tensor(extras[TAGS]).long().flatten().cpu()
    if tags.numel() != embeds.shape[1]:
        raise InputError(f"conditioning has {embeds.shape[1]} embeddings but {tags.numel()} token tags")
    video, audio = unpack_latent(latent)
    refs, keyframes = extras.get(REFS) or [], extras.get(KEYFRAMES) or []
    history = extras.get(HISTORY)
    if history is not None and refs:
        raise InputError("a history (H3 Extend Video) goes with text-to-video conditioning, not with references")
    out = Conditions("ref2va" if refs else "fl2va" if keyframes else "t2va", embeds, tags,
                     int(video.shape[2]), int(video.shape[3]), int(video.shape[4]), int(audio.shape[3]),
                     visual_level=_level(extras, VISUAL_LEVEL), audio_level=_level(extras, AUDIO_LEVEL))
    if history is not None:  # first in packed order: right after the text
        _read_history(history, out, video.shape)
    if refs:
        # AddGuide on a Ref2VA conditioning: its guides (never FL2VA's anchors) come first in packed order, right
        # after the text, then the references (dit/layout.build_ref2va).
        if keyframes:
            _read_guides(keyframes, out, video.shape, frames_of(int(video.shape[2])) - 1)
        _read_refs(refs, out)
    elif keyframes:
        _read_keyframes(keyframes, out, video.shape)
    return out


def _level(extras: dict, key: str) -> float | None:
    level = extras.get(key)
    if level is None:
        return None
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level <= 1:
        raise InputError(f"the conditioning's {key} is the level its conditions are held at, in (0, 1], got {level!r}")
    return float(level)


def _read_history(history: dict, out: Conditions, video_shape) -> None:
    z = _latent(history, "latent", "the history", 5)
    if tuple(z.shape[3:]) != tuple(video_shape[3:]):
        raise InputError(f"the history is at latent size {tuple(z.shape[3:])}, the clip at {tuple(video_shape[3:])}: "
                         "a clip is continued at its own size")
    out.condition_latents.append(z)
    audio_t = 0
    if history.get("audio_latent") is not None:
        a = _latent(history, "audio_latent", "the history", 4)
        out.audio_condition_rows.append(audio_rows(a))
        audio_t = int(a.shape[3])
    out.blocks.append(HistoryBlock(int(z.shape[2]), audio_t))


def _latent(block: dict, key: str, what: str, ndim: int) -> torch.Tensor:
    value = block.get(key)
    if not isinstance(value, torch.Tensor) or value.ndim != ndim or value.shape[0] != 1:
        raise InputError(f"{what}: `{key}` must be a batch-1 tensor of {ndim} dims, got "
                         f"{getattr(value, 'shape', type(value).__name__)}")
    return value.float().cpu()


def _read_refs(refs: list[dict], out: Conditions) -> None:
    for i, block in enumerate(refs):
        kind = block.get("kind")
        what = f"reference {i + 1} ({kind})"
        if kind == "image":
            z = _latent(block, "latent", what, 5)
            out.condition_latents.append(z)
            out.blocks.append(ImageBlock(int(z.shape[3]), int(z.shape[4])))
        elif kind in ("video", "video_audio"):
            z = _latent(block, "latent", what, 5)
            out.condition_latents.append(z)
            audio_t = 0
            if block.get("audio_latent") is not None:
                a = _latent(block, "audio_latent", what, 4)
                out.audio_condition_rows.append(audio_rows(a))
                audio_t = int(a.shape[3])
            out.blocks.append(VideoBlock(int(z.shape[2]), int(z.shape[3]), int(z.shape[4]), audio_t))
        elif kind == "audio":
            a = _latent(block, "audio_latent", what, 4)
            out.audio_condition_rows.append(audio_rows(a))
            out.blocks.append(AudioBlock(int(a.shape[3])))
        else:
            raise InputError(f"{what}: unknown reference kind; H3 takes image, video, video_audio and audio")


def _read_keyframes(keyframes: list[dict], out: Conditions, video_shape) -> None:
    """FL2VA's first/last stills take the released FL2VA layout (anchors, first then last); anything else
    (AddGuide's stills at other frames, clips, sounds) is read as guides in the list's order."""
    last = frames_of(int(video_shape[2])) - 1
    stills = all(kf.get("audio_latent") is None and kf.get("resolved_frame_index") in (0, last)
                 and isinstance(kf.get("latent"), torch.Tensor) and kf["latent"].ndim == 5 and kf["latent"].shape[2] == 1
                 for kf in keyframes)
    if stills:
        _read_anchors(keyframes, out, video_shape, last)
    else:
        _read_guides(keyframes, out, video_shape, last)


def _read_anchors(keyframes: list[dict], out: Conditions, video_shape, last: int) -> None:
    anchored = {}
    for i, kf in enumerate(keyframes):
        index = kf["resolved_frame_index"]
        what = f"keyframe {i + 1} (frame {index})"
        z = _latent(kf, "latent", what, 5)
        if tuple(z.shape[3:]) != tuple(video_shape[3:]):
            raise InputError(f"{what}: a keyframe is one latent frame at the canvas size {tuple(video_shape[3:])}, "
                             f"got {tuple(z.shape[2:])}")
        anchor = "first" if index == 0 else "last"
        if anchor in anchored:
            raise InputError(f"two keyframes anchor the {anchor} frame")
        anchored[anchor] = z
    for anchor in ("first", "last"):
        if anchor in anchored:
            out.anchors += (anchor,)
            out.condition_latents.append(anchored[anchor])


def _read_guides(keyframes: list[dict], out: Conditions, video_shape, last: int) -> None:
    for i, kf in enumerate(keyframes):
        index = kf.get("resolved_frame_index")
        what = f"guide {i + 1} (frame {index})"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= last:
            raise InputError(f"{what}: a guide's resolved_frame_index is a frame of the {last + 1}-frame clip "
                             f"(0..{last})")
        latent_frames = audio_t = 0
        if kf.get("latent") is not None:
            z = _latent(kf, "latent", what, 5)
            if tuple(z.shape[3:]) != tuple(video_shape[3:]):
                raise InputError(f"{what}: a guide is at the canvas size {tuple(video_shape[3:])}, got "
                                 f"{tuple(z.shape[3:])}")
            out.condition_latents.append(z)
            latent_frames = int(z.shape[2])
        if kf.get("audio_latent") is not None:
            a = _latent(kf, "audio_latent", what, 4)
            out.audio_condition_rows.append(audio_rows(a))
            audio_t = int(a.shape[3])
        if not latent_frames and not audio_t:
            raise InputError(f"{what}: a guide holds a `latent`, an `audio_latent` or both")
        out.blocks.append(GuideBlock(index, latent_frames, audio_t))
