"""The packed token sequence of one H3 request.

Row order: `[text | a history | guides (FL2VA's keyframes are guides) | reference blocks | target audio | target
video]`. Reference blocks (Ref2VA) sit on one rotary clock from the text's end; the target, and every guide
(placed on the target's frames), starts where their spans end.
Audio is two channels, channel-major (left t0..tN, then right t0..tN); video rows are 1x2x2
patches, frame-major then row-major. Every row carries a (t, h, w) RoPE coordinate, a modality
tag and, per step, a timestep; rows with equal (timestep, tag) form a few contiguous segments.

The float64 coordinate arithmetic below reproduces the reference bit for bit, including two
different summation orders of the same series (see `_rope_span_pairwise`), because RoPE angles
of tens of thousands of radians amplify last-ulp differences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import InputError
from ..geometry import AUDIO_CHANNELS, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK
from .config import AUDIO_TAG, NUM_MODALITIES, TEXT_TAG, VIDEO_TAG

# One latent frame spans 5/3 rotary units per pixel frame (40 units/s at 24 fps, the audio latent
# rate); a VAE chunk is 1 + 4 + 4 + 4 + 4 pixel frames.
ROPE_FRAME_UNIT = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32.0

MAX_IMAGE_REFS = 9
MAX_VIDEO_REFS = 3
MAX_AUDIO_REFS = 3
MAX_REFS = 12


@dataclass(frozen=True)
class ImageBlock:
    """An image reference: one latent frame at its own latent size."""

    latent_height: int
    latent_width: int
    kind: str = field(default="image", init=False)


@dataclass(frozen=True)
class VideoBlock:
    """A video reference with an optional soundtrack (audio latents per channel, 0 for none)."""

    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int = 0
    kind: str = field(default="video", init=False)


@dataclass(frozen=True)
class AudioBlock:
    """An audio reference: audio latents per channel."""

    audio_latents: int
    kind: str = field(default="audio", init=False)


@dataclass(frozen=True)
class GuideBlock:
    """A guide pinned at pixel frame `frame` of the target: `latent_frames` of video (1 for a still, 5k+2 for a
    17k+5-frame clip, 0 for a sound alone) and `audio_latents` per channel (0 for none)."""

    frame: int
    latent_frames: int = 0
    audio_latents: int = 0
    kind: str = field(default="guide", init=False)


@dataclass(frozen=True)
class HistoryBlock:
    """What came before the target (a longer film's previous window, a continued clip): `latent_frames` (5k+2)
    of video and `audio_latents` per channel, placed before the target on the time axis so that the target
    goes on where the history ends."""

    latent_frames: int
    audio_latents: int = 0
    kind: str = field(default="history", init=False)


@dataclass
class Layout:
    position_ids: torch.Tensor  # (S, 3) float64
    token_tags: torch.Tensor  # (S,) long
    video_indices: torch.Tensor  # conditioning rows first, then target rows
    audio_indices: torch.Tensor  # reference rows first, then target rows
    text_indices: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int
    # Noise masks: target rows held at a given clip's latents (True: kept), by target row; None keeps none.
    held_video: torch.Tensor | None = None
    held_audio: torch.Tensor | None = None
    # A window that goes on from a history: (first row, rows, latent frames, follows) of each condition video
    # block on the target's patch grid, the history's then each guide's, in row order (`follows`: a guide at
    # frame 0, whose frames come right after the history's in time); empty without a history.
    context_video: tuple[tuple[int, int, int, bool], ...] = ()

    @property
    def sequence_length(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def num_text(self) -> int:
        return int(self.text_indices.numel())

    @property
    def target_video_indices(self) -> torch.Tensor:
        return self.video_indices[self.num_condition_video_rows:]

    @property
    def target_audio_indices(self) -> torch.Tensor:
        return self.audio_indices[self.num_condition_audio_rows:]

    def row_timesteps(self, t_video: float, t_audio: float, condition_video_t: float,
                      condition_audio_t: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct sorted timesteps of this step and each row's index into them.

        Text rows follow the video timestep; conditioning rows, and target rows a noise mask keeps, stay at their
        fixed levels.
        """
        rows = torch.full((self.sequence_length,), float(t_video), dtype=torch.float32)
        rows[self.video_indices[: self.num_condition_video_rows]] = condition_video_t
        rows[self.audio_indices[self.num_condition_audio_rows:]] = t_audio
        rows[self.audio_indices[: self.num_condition_audio_rows]] = condition_audio_t
        if self.held_video is not None:
            rows[self.target_video_indices[self.held_video]] = condition_video_t
        if self.held_audio is not None:
            rows[self.target_audio_indices[self.held_audio]] = condition_audio_t
        return torch.unique(rows, sorted=True, return_inverse=True)

    def holding(self, video: torch.Tensor | None, audio: torch.Tensor | None) -> "Layout":
        """This layout with noise masks: `video` / `audio` bool per target row, True where the row is kept."""
        for name, mask, rows in (("video", video, self.target_video_indices),
                                 ("audio", audio, self.target_audio_indices)):
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (rows.numel(),)):
                raise InputError(f"a {name} noise mask is a bool per target row ({rows.numel()}), got "
                                 f"{mask.dtype} {tuple(mask.shape)}")
        return dataclasses.replace(self, held_video=video, held_audio=audio)


def segments_before_video(layout: Layout) -> tuple:
    """The contiguous single-modality runs that precede the target video, in row order: the text, then each run
    of condition video rows (keyframes, reference images and videos) or of audio rows (reference sound, the
    target audio), as row counts. Block-sparse attention tiles each run on its own, so that no tile mixes two of
    them (kernels/vsa_reference.tile_map); the target video, the tail of every layout, is tiled in 3-D. In a
    window that goes on from a history, the history's video block and each guide's (`Layout.context_video`)
    are a `VideoRun` of their latent frames each: on the target's grid, they are tiled in 3-D as the target is,
    the first guide at frame 0 (a film's first-frame guide: the frame the history leads into) with the history."""
    from ...kernels.vsa_reference import VideoRun

    total = layout.sequence_length
    target = layout.target_video_indices
    start = total - target.numel()
    if not torch.equal(target, torch.arange(start, total)):
        raise InputError("the target video rows are not the tail of the packed sequence")
    kind = torch.zeros(total, dtype=torch.long)  # 0 text, 1 video, 2 audio, 3 + i the i-th context block
    kind[layout.video_indices] = 1
    kind[layout.audio_indices] = 2
    frames = {}
    for i, (first, rows, latent_frames, follows) in enumerate(layout.context_video):
        kind[first:first + rows] = 3 + i
        frames[3 + i] = VideoRun(latent_frames, follows)
    labels, runs = torch.unique_consecutive(kind[:start], return_counts=True)
    return tuple(frames.get(int(label), int(n)) for label, n in zip(labels, runs))


def adaln_rows(timestep_indices: torch.Tensor, token_tags: torch.Tensor) -> torch.Tensor:
    """Row of the per-block AdaLN table that each packed row reads."""
    return timestep_indices.long() * NUM_MODALITIES + token_tags.long()


def _spatial_axis(size: int, patch: int, sqrt_area: float) -> np.ndarray:
    # Aspect-normalised axis centred on the unit interval, right end excluded, scaled by 32.
    ratio = size / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, size // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def frame_grid(latent_height: int, latent_width: int, patch: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, w) coordinates of one patchified latent frame, row-major, and its width axis."""
    sqrt_area = float(np.sqrt(latent_height * latent_width))
    h_axis = torch.from_numpy(_spatial_axis(latent_height, patch[1], sqrt_area))
    w_axis = torch.from_numpy(_spatial_axis(latent_width, patch[2], sqrt_area))
    hh = h_axis[:, None].expand(-1, w_axis.numel())
    ww = w_axis[None, :].expand(h_axis.numel(), -1)
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), w_axis


def _latent_frame_spans(num_latent_frames: int) -> list[float]:
    return [ROPE_FRAME_UNIT * ROPE_FRAMES_PER_LATENT[i % len(ROPE_FRAMES_PER_LATENT)] for i in range(num_latent_frames)]


def frame_times(num_latent_frames: int, origin: float) -> torch.Tensor:
    """Rotary time of each latent frame: a running (sequential) sum of the non-uniform spans."""
    spans = torch.tensor(_latent_frame_spans(num_latent_frames), dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _rope_span_pairwise(num_latent_frames: int) -> float:
    # The "last" keyframe anchor uses numpy's pairwise summation of the spans; the sequential sum
    # used for video references differs in the last ulp from 16 latent frames on.
    return float(np.asarray(_latent_frame_spans(num_latent_frames), dtype=np.float64).sum())


def _rope_span_sequential(num_latent_frames: int) -> float:
    total = 0
    for span in _latent_frame_spans(num_latent_frames):
        total += span
    return float(total)


def _fill_audio(pos: torch.Tensor, start: int, audio_latents: int, origin: float, w_axis: torch.Tensor) -> int:
    """Channel-major stereo rows: time from origin, left channel at the first width value, right at the last."""
    rows = audio_latents * AUDIO_CHANNELS
    time = origin + torch.arange(audio_latents, dtype=torch.float64)
    pos[start:start + rows, 0] = time.repeat(AUDIO_CHANNELS)
    pos[start:start + audio_latents, 2] = float(w_axis[0])
    pos[start + audio_latents:start + rows, 2] = float(w_axis[-1])
    return start + rows


def _fill_video(pos: torch.Tensor, start: int, num_frames: int, grid: torch.Tensor, origin: float) -> int:
    rows = num_frames * grid.shape[0]
    pos[start:start + rows, 0] = frame_times(num_frames, origin).repeat_interleave(grid.shape[0])
    pos[start:start + rows, 1:] = grid.repeat(num_frames, 1)
    return start + rows


def _text_positions(text_tags: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    text_tags = torch.as_tensor(text_tags).long().flatten()
    if text_tags.numel() == 0:
        raise InputError("the prompt produced no text tokens")
    bad = set(text_tags.unique().tolist()) - {VIDEO_TAG, TEXT_TAG}
    if bad:
        raise InputError(f"text token tags must be {VIDEO_TAG} (vision) or {TEXT_TAG} (words), got {sorted(bad)}")
    pos = torch.zeros(total, 3, dtype=torch.float64)
    pos[: text_tags.numel(), 0] = torch.arange(text_tags.numel(), dtype=torch.float64)
    return pos, text_tags


def _check_target(latent_frames: int, latent_height: int, latent_width: int, audio_latents: int,
                  patch: tuple[int, int, int]) -> int:
    if latent_frames < 1 or audio_latents < 1:
        raise InputError(f"need at least one latent frame and one audio latent, got {latent_frames} and {audio_latents}")
    if latent_frames % patch[0] or latent_height % patch[1] or latent_width % patch[2] or latent_height < 1 or latent_width < 1:
        raise InputError(f"latent size {latent_frames}x{latent_height}x{latent_width} is not divisible by the patch {patch}")
    return (latent_height // patch[1]) * (latent_width // patch[2])


def _with_target(pos, text_tags, video_parts, audio_parts, cursor: int, origin: float, audio_latents: int,
                 latent_frames: int, grid, w_axis) -> Layout:
    """The target's audio then video rows from `cursor` on, at rotary time `origin`, after the condition rows
    (`video_parts` / `audio_parts`, packed order); the finished layout."""
    video_start = _fill_audio(pos, cursor, audio_latents, origin, w_axis)
    _fill_video(pos, video_start, latent_frames, grid, origin)
    n_cond_video = sum(int(p.numel()) for p in video_parts)
    n_cond_audio = sum(int(p.numel()) for p in audio_parts)
    video_indices = torch.cat(video_parts + [torch.arange(video_start, pos.shape[0])])
    audio_indices = torch.cat(audio_parts + [torch.arange(cursor, video_start)])
    return _finish(pos, text_tags, video_indices, audio_indices, n_cond_video, n_cond_audio)


def _finish(pos, text_tags, video_indices, audio_indices, n_cond_video, n_cond_audio) -> Layout:
    num_text = text_tags.numel()
    tags = torch.empty(pos.shape[0], dtype=torch.long)
    tags[:num_text] = text_tags
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG
    return Layout(pos, tags, video_indices, audio_indices, torch.arange(num_text), n_cond_video, n_cond_audio)


def pixel_frames(latent_frames: int) -> int:
    """Pixel frames of 5n+2 latent frames (17n+5); one latent frame is one picture."""
    if latent_frames == 1:
        return 1
    return (latent_frames - 2) // VAE_LATENTS_PER_CHUNK * VAE_FRAMES_PER_CHUNK + VAE_LATENTS_PER_CHUNK


def guide_time(origin: float, frame: int, target_latent_frames: int, released_last: bool = True) -> float:
    """Rotary time of a guide at pixel frame `frame`: the target's time there, origin + 5/3 x frame on the
    continuous axis. With `released_last`, a still at the last frame takes FL2VA's coordinate for its last
    keyframe (the pairwise sum of the target's latent spans, less one frame): equal in exact arithmetic, it can
    differ in the last ulp, and the released FL2VA pipeline computes it so. Ref2VA has no released pipeline with
    guides: there every frame takes origin + 5/3 x frame, as ComfyUI's layout does."""
    if released_last and frame == pixel_frames(target_latent_frames) - 1:
        return origin + _rope_span_pairwise(target_latent_frames) - ROPE_FRAME_UNIT
    return origin + ROPE_FRAME_UNIT * frame


def guide_audio_room(frame: int, audio_latents: int) -> int:
    """Audio latents a sound guide at pixel frame `frame` keeps at most: the target's `audio_latents` less
    5/3 per frame before it, rounded up (ComfyUI's AddGuide keeps floor(T - 5/3 x frame), the same count), so
    that its last row's time stays before the target's end."""
    return audio_latents - (frame * 5 + 2) // 3


def keyframe_guides(keyframes: tuple[str, ...], latent_frames: int) -> tuple[GuideBlock, ...]:
    """FL2VA's "first" / "last" keyframes as stills guiding frames 0 and the last."""
    for anchor in keyframes:
        if anchor not in ("first", "last"):
            raise InputError(f"a keyframe anchor must be 'first' or 'last', got {anchor!r}")
    if len(keyframes) > 2 or len(set(keyframes)) != len(keyframes):
        raise InputError(f"FL2VA takes a first and/or a last keyframe, got {list(keyframes)}")
    last = pixel_frames(latent_frames) - 1
    return tuple(GuideBlock(0 if anchor == "first" else last, 1) for anchor in keyframes)


def check_guides(guides, latent_frames: int, audio_latents: int) -> None:
    """Each guide inside the target: its frame, its clip's length, its sound after the frame."""
    frames = pixel_frames(latent_frames)
    for i, g in enumerate(guides):
        what = f"guide {i + 1}"
        if not isinstance(g, GuideBlock):
            raise InputError(f"{what} must be a GuideBlock, got {g!r}")
        if not 0 <= g.frame < frames:
            raise InputError(f"{what}: frame {g.frame} is outside the {frames}-frame target")
        if g.latent_frames < 0 or g.audio_latents < 0 or g.latent_frames + g.audio_latents == 0:
            raise InputError(f"{what} needs video or audio latents, got {g.latent_frames} and {g.audio_latents}")
        if g.latent_frames > 1 and (g.latent_frames - 2) % VAE_LATENTS_PER_CHUNK:
            raise InputError(f"{what}: a clip is 5k+2 latent frames, got {g.latent_frames}")
        if g.frame + (pixel_frames(g.latent_frames) if g.latent_frames else 0) > frames:
            raise InputError(f"{what}: its {pixel_frames(g.latent_frames)} frames from frame {g.frame} run past the "
                             f"{frames}-frame target")
        room = guide_audio_room(g.frame, audio_latents)
        if g.audio_latents and g.audio_latents > room:
            raise InputError(f"{what}: {g.audio_latents} audio latents from frame {g.frame} run past the target's "
                             f"{audio_latents} ({max(room, 0)} remain)")


def check_history(history: HistoryBlock) -> None:
    if not isinstance(history, HistoryBlock):
        raise InputError(f"a history must be a HistoryBlock, got {history!r}")
    if history.latent_frames < 2 or (history.latent_frames - 2) % VAE_LATENTS_PER_CHUNK:
        raise InputError(f"a history is 5k+2 latent frames (k >= 1), got {history.latent_frames}")
    if history.audio_latents < 0 or history.audio_latents > _rope_span_sequential(history.latent_frames):
        raise InputError(f"a history's sound must fit its {pixel_frames(history.latent_frames)} frames: at most "
                         f"{int(_rope_span_sequential(history.latent_frames))} audio latents, got "
                         f"{history.audio_latents}")


def build_t2va(text_tags: torch.Tensor, latent_frames: int, latent_height: int, latent_width: int,
               audio_latents: int, patch: tuple[int, int, int] = (1, 2, 2),
               keyframes: tuple[str, ...] = (), guides: tuple[GuideBlock, ...] = (),
               history: HistoryBlock | None = None) -> Layout:
    """T2VA layout, with guides: FL2VA's keyframe anchors ("first", "last", or both in that order) first, then
    `guides` in order. Each guide's video rows, then its audio rows, follow the text.

    With a `history`, its video rows come first after the text, from the text's end on the time axis, and its
    audio rows end one latent before the target's first; the target (and every guide, which is placed on the
    target's frames) starts where the history's frames end."""
    rows_per_frame = _check_target(latent_frames, latent_height, latent_width, audio_latents, patch)
    guides = keyframe_guides(tuple(keyframes), latent_frames) + tuple(guides)
    check_guides(guides, latent_frames, audio_latents)
    if history is not None:
        check_history(history)
    num_text = torch.as_tensor(text_tags).numel()
    n_cond_video = (sum(g.latent_frames for g in guides) + (history.latent_frames if history else 0)) * rows_per_frame
    n_cond_audio = (sum(g.audio_latents for g in guides) + (history.audio_latents if history else 0)) * AUDIO_CHANNELS
    n_audio = audio_latents * AUDIO_CHANNELS
    total = num_text + n_cond_video + n_cond_audio + n_audio + latent_frames * rows_per_frame
    pos, text_tags = _text_positions(text_tags, total)
    grid, w_axis = frame_grid(latent_height, latent_width, patch)

    video_parts, audio_parts, cursor, origin = [], [], num_text, float(num_text)
    if history is not None:
        end = _fill_video(pos, cursor, history.latent_frames, grid, origin)
        video_parts.append(torch.arange(cursor, end))
        cursor = end
        origin += _rope_span_sequential(history.latent_frames)
        if history.audio_latents:
            end = _fill_audio(pos, cursor, history.audio_latents, origin - history.audio_latents, w_axis)
            audio_parts.append(torch.arange(cursor, end))
            cursor = end
    cursor = _fill_guides(pos, cursor, guides, origin, latent_frames, grid, w_axis, video_parts, audio_parts)
    layout = _with_target(pos, text_tags, video_parts, audio_parts, cursor, origin, audio_latents, latent_frames,
                          grid, w_axis)
    if history is None:
        return layout
    # The history's block, then each guide's with video; the first at frame 0 goes on from the history in time.
    frame0 = next((i for i, g in enumerate(g for g in guides if g.latent_frames) if g.frame == 0), None)
    context = tuple((int(p[0]), int(p.numel()), int(p.numel()) // rows_per_frame, i - 1 == frame0)
                    for i, p in enumerate(video_parts))
    return dataclasses.replace(layout, context_video=context)


def _fill_guides(pos, cursor: int, guides, origin: float, latent_frames: int, grid, w_axis, video_parts: list,
                 audio_parts: list, released_last: bool = True) -> int:
    """Each guide's video rows, then its audio rows, from `cursor` on, on the target's grid at its frame's time
    (`guide_time` from the target's `origin`); their indices appended to the parts. Returns the next row."""
    for g in guides:
        t = guide_time(origin, g.frame, latent_frames, released_last)
        if g.latent_frames:
            end = _fill_video(pos, cursor, g.latent_frames, grid, t)
            video_parts.append(torch.arange(cursor, end))
            cursor = end
        if g.audio_latents:
            end = _fill_audio(pos, cursor, g.audio_latents, t, w_axis)
            audio_parts.append(torch.arange(cursor, end))
            cursor = end
    return cursor


def check_references(blocks: list) -> None:
    counts = {"image": 0, "video": 0, "audio": 0}
    for block in blocks:
        if getattr(block, "kind", None) not in counts:
            raise InputError(f"a reference must be an image, a video or an audio block, got {block!r}")
        counts[block.kind] += 1
    if not blocks:
        raise InputError("Ref2VA needs at least one reference")
    limits = {"image": MAX_IMAGE_REFS, "video": MAX_VIDEO_REFS, "audio": MAX_AUDIO_REFS}
    for kind, limit in limits.items():
        if counts[kind] > limit:
            raise InputError(f"at most {limit} {kind} references, got {counts[kind]}")
    if len(blocks) > MAX_REFS:
        raise InputError(f"at most {MAX_REFS} references in total, got {len(blocks)}")
    if counts["image"] == 0 and counts["video"] == 0:
        raise InputError("Ref2VA needs an image or video reference; audio-only references are not supported")


def _reference_span(ref) -> float:
    """Rotary time a reference block takes on the clock before the target: an image one integer slot (not a
    latent frame's span), a sound one unit per latent, a video its frames' spans or its sound's, the longer."""
    if ref.kind == "image":
        return 1.0
    if ref.kind == "audio":
        return float(ref.audio_latents)
    return max(float(ref.audio_latents), _rope_span_sequential(ref.latent_frames))


def build_ref2va(text_tags: torch.Tensor, references: list, latent_frames: int, latent_height: int,
                 latent_width: int, audio_latents: int, patch: tuple[int, int, int] = (1, 2, 2),
                 guides: tuple[GuideBlock, ...] = ()) -> Layout:
    """Ref2VA layout: reference blocks in request order on one rotary clock that starts after the text; the
    target starts where their spans end. `guides` (ComfyUI's AddGuide on a Ref2VA conditioning) are packed
    right after the text, before the references, each at the target's time for its frame (the text, the
    references' spans, then 5/3 x frame) on the target's grid."""
    check_references(references)
    rows_per_frame = _check_target(latent_frames, latent_height, latent_width, audio_latents, patch)
    guides = tuple(guides)
    check_guides(guides, latent_frames, audio_latents)
    num_text = torch.as_tensor(text_tags).numel()
    ref_rows = 0
    for ref in references:
        if ref.kind in ("image", "video"):
            frames = 1 if ref.kind == "image" else ref.latent_frames
            _check_target(frames, ref.latent_height, ref.latent_width, 1, patch)
            ref_rows += frames * (ref.latent_height // patch[1]) * (ref.latent_width // patch[2])
        audio = ref.audio_latents if ref.kind in ("audio", "video") else 0
        if audio < 0 or (ref.kind == "audio" and audio < 1):
            raise InputError(f"an audio reference needs at least one latent, got {audio}")
        ref_rows += audio * AUDIO_CHANNELS
    guide_rows = sum(g.latent_frames * rows_per_frame + g.audio_latents * AUDIO_CHANNELS for g in guides)
    total = num_text + guide_rows + ref_rows + audio_latents * AUDIO_CHANNELS + latent_frames * rows_per_frame
    pos, text_tags = _text_positions(text_tags, total)
    target_grid, target_w = frame_grid(latent_height, latent_width, patch)

    origin = float(num_text)
    for ref in references:
        origin += _reference_span(ref)
    video_parts, audio_parts = [], []
    cursor = _fill_guides(pos, num_text, guides, origin, latent_frames, target_grid, target_w, video_parts,
                          audio_parts, released_last=False)
    clock = float(num_text)
    for ref in references:
        if ref.kind == "image":
            grid, _ = frame_grid(ref.latent_height, ref.latent_width, patch)
            pos[cursor:cursor + grid.shape[0], 0] = clock
            pos[cursor:cursor + grid.shape[0], 1:] = grid
            video_parts.append(torch.arange(cursor, cursor + grid.shape[0]))
            cursor += grid.shape[0]
        elif ref.kind == "audio":
            end = _fill_audio(pos, cursor, ref.audio_latents, clock, target_w)
            audio_parts.append(torch.arange(cursor, end))
            cursor = end
        else:
            grid, w_axis = frame_grid(ref.latent_height, ref.latent_width, patch)
            end = _fill_audio(pos, cursor, ref.audio_latents, clock, w_axis)
            audio_parts.append(torch.arange(cursor, end))
            video_end = _fill_video(pos, end, ref.latent_frames, grid, clock)
            video_parts.append(torch.arange(end, video_end))
            cursor = video_end
        clock += _reference_span(ref)

    return _with_target(pos, text_tags, video_parts, audio_parts, cursor, clock, audio_latents, latent_frames,
                        target_grid, target_w)


def patchify(latents: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """(B, C, T, H, W) latents -> (B * rows, C*pt*ph*pw) rows, frame-major then row-major."""
    b, c, t, h, w = latents.shape
    pt, ph, pw = patch
    if t % pt or h % ph or w % pw:
        raise InputError(f"latents of shape {tuple(latents.shape)} do not divide by the patch {patch}")
    x = latents.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify(rows: torch.Tensor, channels: int, frames: int, height: int, width: int,
               patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """Inverse of `patchify` for one item: (rows, C*pt*ph*pw) -> (1, C, T, H, W)."""
    pt, ph, pw = patch
    x = rows.reshape(1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, frames, height, width)
