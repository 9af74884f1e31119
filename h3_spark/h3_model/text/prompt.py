"""The prompt presentation: the token stream MiniMax H3's Qwen3-VL conditioner reads.

No chat template and no special tokens: label text and the prompt are tokenized verbatim
(`add_special_tokens=False`), and vision blocks (`<|vision_start|>`, N pads, `<|vision_end|>`) are
spliced in between. Every token carries the DiT's modality tag: vision-block rows are tagged video
(0), words text (1).

- T2VA: the prompt. It must not be empty: it is all Qwen reads (the reference pipeline fails inside
  Qwen on an empty one). Whitespace is a prompt like any other and is kept.
- FL2VA: per keyframe, in packed order (first, then last), `"<Picture i>: "` + an image block; then
  the prompt, which may be empty (the presentation is then the labelled keyframes alone).
- Ref2VA: per reference, in request order, labels numbered per modality: an image gives
  `"<Picture i>: "` + an image block; audio gives `"<Audio j>: "` alone (waveforms never reach
  Qwen); a video gives `"<Audio j>: "` first when it has a soundtrack, then `"<Video k>: "` and, per
  pair of frames sampled at 2 fps, `"<{t:.1f} seconds>"` + a video block. Then the prompt, which may be
  empty.

Media come in already decoded (the pipeline does file I/O and resizing to the canvas or reference
size), as uint8 tensors in channels-last layout:
- an image is (H, W, 3);
- a video is (T, H, W, 3) at 24 fps.
Qwen's own processors then resize them per their min/max pixel settings, as transformers does.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from ...errors import CheckpointError, InputError
from ..dit.config import TEXT_TAG, VIDEO_TAG

FPS = 24  # the rate video references arrive at (the model's own clock)
VIDEO_SAMPLE_FPS = 2  # the rate Qwen reads a video reference at
MAX_KEYFRAMES = 2  # first and last
# Qwen3-VL merges this many sampled video frames into one vision block (the released processor's
# temporal_patch_size). The builder reads the processor's own value; this one lets references be checked
# before a processor is loaded.
QWEN_TEMPORAL_PATCH = 2
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# The id an embedding row's position holds (its input embedding is replaced): Qwen's end-of-text, ComfyUI's pad.
PLACEHOLDER = "<|endoftext|>"
# Argument names of the Qwen3-VL forward that carry vision inputs, in hashing order.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def shortest_video(temporal_patch: int = QWEN_TEMPORAL_PATCH, sample_fps: int = VIDEO_SAMPLE_FPS) -> int:
    """The fewest 24 fps frames a video reference may have: enough for one vision block of sampled frames."""
    return (temporal_patch - 1) * (FPS // sample_fps) + 1


def check_prompt(mode: str, prompt: object) -> None:
    """Refuse a prompt the presentation cannot use, before anything is loaded or encoded.

    Only T2VA needs text: FL2VA and Ref2VA label their keyframes or references in the token stream, so
    their presentation is never empty (the reference pipeline accepts an empty prompt there too).
    """
    if not isinstance(prompt, str):
        raise InputError(f"the prompt must be a string, got {type(prompt).__name__}")
    if mode == "t2va" and not prompt:
        raise InputError("t2va needs a prompt: it is all the text encoder reads (fl2va and ref2va may leave it "
                         "empty, their keyframes or references are labelled in the text)")


_MENTION = re.compile(r"<(Picture|Video|Audio) (\d+)>")
# What a user may write for one: any case, any spacing. The model learned only the exact labels, so a near miss
# would reach it as plain text and the reference would be ignored without a word.
_NEAR_MENTION = re.compile(r"<\s*(picture|video|audio)\s*(\d+)\s*>", re.IGNORECASE)
_KINDS = {"Picture": "image", "Video": "video", "Audio": "audio"}


UNNAMED = ("refuse", "text")


def labelled(references) -> dict[str, int]:
    """How many `<Picture i>`, `<Video k>` and `<Audio j>` labels Ref2VA `references` get (check_mentions' counts):
    a video with a soundtrack gets an `<Audio j>` too."""
    return {"images": sum(isinstance(r, ImageRef) for r in references),
            "videos": sum(isinstance(r, VideoRef) for r in references),
            "audios": sum(isinstance(r, AudioRef) or (isinstance(r, VideoRef) and r.has_soundtrack) for r in references)}


def check_mentions(mode: str, prompt: str, images: int = 0, videos: int = 0, audios: int = 0,
                   unnamed: str = "refuse") -> list[str]:
    """Refuse a prompt that names a reference the request does not give (`<Picture 3>` with one image): the
    model would read a label with nothing behind it and the clip would ignore what the user meant.

    `unnamed` "text" reads such labels as plain text instead and returns them, as ComfyUI's own MiniMax H3 nodes
    do: their graphs name guide stills `<Picture 2..4>` (Comfy-Org's multiframe template), which reach the text
    encoder only as words. The ComfyUI nodes take that reading, so those graphs run as they are; the CLI and the
    service refuse. A near miss (`<picture 1>`) is refused either way.

    `images` counts FL2VA's keyframes too (they are `<Picture i>`); `audios` counts the audio references and
    the videos with a soundtrack (each gets an `<Audio j>` label)."""
    if unnamed not in UNNAMED:
        raise InputError(f"unnamed labels are read as one of {', '.join(UNNAMED)}, got {unnamed!r}")
    given = {"image": images, "video": videos, "audio": audios}
    plain = []
    for near in _NEAR_MENTION.finditer(prompt or ""):
        if not _MENTION.fullmatch(near.group(0)):
            exact = f"<{near.group(1).capitalize()} {int(near.group(2))}>"
            raise InputError(f"the prompt writes {near.group(0)}; the model knows a reference only as {exact} "
                             "(capital letter, one space)")
    for match in _MENTION.finditer(prompt or ""):
        label, number = match.group(1), int(match.group(2))
        kind = _KINDS[label]
        if 1 <= number <= given[kind]:
            continue
        if unnamed == "text":
            plain.append(match.group(0))
            continue
        what = "keyframe" if mode == "fl2va" and kind == "image" else f"{kind} reference"
        if given[kind] == 0:
            have = f"no {what}" + ("" if mode != "t2va" else " (t2va takes none)")
        else:
            have = f"{given[kind]} {what}{'s' if given[kind] != 1 else ''} (<{label} 1>" + (
                f"..<{label} {given[kind]}>)" if given[kind] > 1 else ")")
        raise InputError(f"the prompt names {match.group(0)}, but this request gives {have}")
    return plain


@dataclass(frozen=True, eq=False)
class ImageRef:
    """An image reference: uint8 (H, W, 3), at the size the caller encodes it at."""

    image: torch.Tensor


@dataclass(frozen=True, eq=False)
class VideoRef:
    """A video reference: uint8 frames (T, H, W, 3) at 24 fps; `has_soundtrack` adds its audio label."""

    frames: torch.Tensor
    has_soundtrack: bool = False


@dataclass(frozen=True)
class AudioRef:
    """An audio reference. Only its label reaches Qwen, so it carries no media here."""


Reference = Union[ImageRef, VideoRef, AudioRef]


@dataclass(frozen=True, eq=False)
class Presentation:
    """A tokenized presentation, ready for `TextEncoder.encode`.

    `vision` holds the processor outputs under the Qwen3-VL forward's argument names
    (`pixel_values` / `image_grid_thw` for images, `pixel_values_videos` / `video_grid_thw` for
    videos), in the order their pad runs appear. `token_hash` identifies the ids, tags and vision
    inputs: two presentations with the same hash encode to the same embeddings.
    """

    mode: str
    token_ids: torch.Tensor  # (L,) long
    tags: torch.Tensor  # (L,) long
    vision: dict[str, torch.Tensor]
    token_hash: str
    # Prompt embeddings (text/embeddings.py): (first position, float32 rows (n, width)) in order; their positions
    # hold a placeholder id in `token_ids` and the rows replace those positions' input embeddings.
    spliced: tuple[tuple[int, torch.Tensor], ...] = ()

    def __len__(self) -> int:
        return int(self.token_ids.numel())


def presentation_hash(token_ids: torch.Tensor, tags: torch.Tensor, vision: dict[str, torch.Tensor],
                      spliced: tuple[tuple[int, torch.Tensor], ...] = ()) -> str:
    """sha256 over ids, tags, every vision tensor (name, dtype, shape and bytes) and the spliced embeddings (where,
    and their rows)."""
    h = hashlib.sha256()
    for name, tensor in (("token_ids", token_ids), ("tags", tags)) + tuple(
            (k, vision[k]) for k in VISION_KEYS if k in vision) + tuple(
            (f"spliced@{start}", rows) for start, rows in spliced):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Stream:
    """Token ids and tags accumulated segment by segment."""

    def __init__(self, tokenizer, embeddings=None, width: int | None = None, placeholder: int | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.tags: list[int] = []
        self.spliced: list[tuple[int, torch.Tensor]] = []
        self.embeddings, self.width, self.placeholder = embeddings, width, placeholder

    def text(self, value: str) -> None:
        ids = self.tokenizer(value, add_special_tokens=False)["input_ids"]
        self.ids.extend(ids)
        self.tags.extend([TEXT_TAG] * len(ids))

    def prompt(self, value: str) -> None:
        """The user's prompt: its runs of text, and the rows of each `embedding:NAME` in it (text/embeddings.py)
        at a placeholder id each, tagged text (as ComfyUI's MiniMax H3 encoder tags them)."""
        from .embeddings import EmbeddingRef, no_library_message, split_prompt

        if self.embeddings is None:
            refused = no_library_message(value)
            if refused is not None:
                raise InputError(refused)
            self.text(value)
            return
        for part in split_prompt(value):
            if not isinstance(part, EmbeddingRef):
                self.text(part)
                continue
            rows = self.embeddings.rows(part.name, self.width)
            self.spliced.append((len(self.ids), rows))
            self.ids.extend([self.placeholder] * rows.shape[0])
            self.tags.extend([TEXT_TAG] * rows.shape[0])

    def vision(self, start: int, pad: int, end: int, count: int) -> None:
        self.ids.extend([start] + [pad] * count + [end])
        self.tags.extend([VIDEO_TAG] * (count + 2))


def _check_frames(t: torch.Tensor, what: str, ndim: int) -> None:
    layout = "(H, W, 3)" if ndim == 3 else "(T, H, W, 3)"
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{what} must be a uint8 torch tensor {layout}, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.ndim != ndim or t.shape[-1] != 3 or min(t.shape) < 1:
        raise InputError(f"{what} must be a uint8 tensor {layout} (channels last), got {t.dtype} {list(t.shape)}")


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    # The processors' own conversion of a PIL image or HWC array gives the same CHW uint8 values;
    # handing them CHW with an explicit format avoids guessing the channel axis of small images.
    return t.movedim(-1, -3).contiguous()


class PresentationBuilder:
    """Builds `Presentation`s with a Qwen3-VL tokenizer and processor (transformers objects)."""

    def __init__(self, tokenizer, processor, *, sample_fps: int = VIDEO_SAMPLE_FPS):
        if FPS % sample_fps:
            raise InputError(f"video sample rate {sample_fps} fps must divide the {FPS} fps clock")
        self.tokenizer = tokenizer
        self.processor = processor
        self.stride = FPS // sample_fps  # 24 fps frames between two frames Qwen reads
        self.sample_fps = sample_fps
        ids = tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD])
        unknown = [tok for tok, i in zip((VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), ids)
                   if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise CheckpointError(f"the tokenizer lacks Qwen3-VL's vision tokens {', '.join(unknown)}")
        self.vision_start, self.vision_end, self.image_pad, self.video_pad = ids
        # Prompt embeddings: the folders `embedding:NAME` is found in (an EmbeddingLibrary, set by the front door)
        # and the width they must have (the text encoder's hidden size, set by the encoder). None: a prompt naming
        # an embedding is refused.
        self.embeddings = None
        self.text_width: int | None = None
        self.placeholder = tokenizer.convert_tokens_to_ids(PLACEHOLDER)

    # ------------------------------------------------------------------ modes
    def t2va(self, prompt: str, unnamed: str = "refuse") -> Presentation:
        stream = self._stream("t2va", prompt)
        check_mentions("t2va", prompt, unnamed=unnamed)
        stream.prompt(prompt)
        return self._finish("t2va", stream, {})

    def fl2va(self, prompt: str, keyframes: Sequence[torch.Tensor], unnamed: str = "refuse") -> Presentation:
        """`keyframes` in packed order (first, then last), each uint8 (H, W, 3) at canvas size."""
        stream = self._stream("fl2va", prompt)
        keyframes = list(keyframes)
        if len(keyframes) > MAX_KEYFRAMES:
            raise InputError(f"FL2VA takes at most {MAX_KEYFRAMES} keyframes (first, last), got {len(keyframes)}")
        for i, frame in enumerate(keyframes):
            _check_frames(frame, f"keyframe {i + 1}", 3)
        check_mentions("fl2va", prompt, images=len(keyframes), unnamed=unnamed)
        vision, counts = self._images(keyframes)
        for i, count in enumerate(counts):
            stream.text(f"<Picture {i + 1}>: ")
            stream.vision(self.vision_start, self.image_pad, self.vision_end, count)
        stream.prompt(prompt)
        return self._finish("fl2va", stream, vision)

    def ref2va(self, prompt: str, references: Sequence[Reference], unnamed: str = "refuse") -> Presentation:
        """`references` in request order: `ImageRef`, `VideoRef` and `AudioRef`."""
        stream = self._stream("ref2va", prompt)
        references = list(references)
        for i, ref in enumerate(references):
            _check_reference(ref, i)
        images = [r.image for r in references if isinstance(r, ImageRef)]
        videos = [r.frames for r in references if isinstance(r, VideoRef)]
        check_mentions("ref2va", prompt, **labelled(references), unnamed=unnamed)
        vision, image_counts = self._images(images)
        video_vision, video_blocks = self._videos(videos)
        vision.update(video_vision)
        image_counts, video_blocks = iter(image_counts), iter(video_blocks)
        numbers = {"image": 0, "audio": 0, "video": 0}
        for ref in references:
            if isinstance(ref, AudioRef) or (isinstance(ref, VideoRef) and ref.has_soundtrack):
                numbers["audio"] += 1
                stream.text(f"<Audio {numbers['audio']}>: ")
            if isinstance(ref, ImageRef):
                numbers["image"] += 1
                stream.text(f"<Picture {numbers['image']}>: ")
                stream.vision(self.vision_start, self.image_pad, self.vision_end, next(image_counts))
            elif isinstance(ref, VideoRef):
                numbers["video"] += 1
                stream.text(f"<Video {numbers['video']}>: ")
                timestamps, count = next(video_blocks)
                for t in timestamps:
                    # str.format rounds half to even, as the reference labels do ("<0.2 seconds>").
                    stream.text(f"<{t:.1f} seconds>")
                    stream.vision(self.vision_start, self.video_pad, self.vision_end, count)
        stream.prompt(prompt)
        return self._finish("ref2va", stream, vision)

    # ------------------------------------------------------------------ vision inputs
    def _images(self, images: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Processor outputs for a batch of images, and the vision-token count of each."""
        if not images:
            return {}, []
        proc = self.processor.image_processor
        out = proc(images=[_channels_first(i) for i in images], input_data_format="channels_first",
                   return_tensors="pt")
        grids = out["image_grid_thw"]
        counts = [int(g.prod()) // proc.merge_size ** 2 for g in grids]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grids}, counts

    def sample_video(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """The frames Qwen reads (every `stride`-th) and the timestamp of each merged pair.

        Qwen merges sampled frames in groups of its temporal patch, repeating the last frame when
        the count does not divide; a group is labelled with the mean of its first and last
        timestamps.
        """
        temporal = self.processor.video_processor.temporal_patch_size
        picked = frames[:: self.stride]
        if picked.shape[0] < temporal:
            need = shortest_video(temporal, self.sample_fps)
            raise InputError(f"a video reference is read at {self.sample_fps} fps in groups of {temporal} frames, "
                             f"so it needs at least {need} frames at {FPS} fps; got {frames.shape[0]}")
        times = [i / self.sample_fps for i in range(picked.shape[0])]
        times += [times[-1]] * (-len(times) % temporal)
        blocks = [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]
        return picked, blocks

    def _videos(self, videos: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[list[float], int]]]:
        """Processor outputs for a batch of videos, and per video (block timestamps, tokens per block)."""
        if not videos:
            return {}, []
        sampled = [self.sample_video(v) for v in videos]
        proc = self.processor.video_processor
        out = proc(videos=[_channels_first(frames) for frames, _ in sampled], input_data_format="channels_first",
                   do_sample_frames=False, return_tensors="pt")
        grids = out["video_grid_thw"]
        blocks = []
        for (_, times), grid in zip(sampled, grids):
            if int(grid[0]) != len(times):
                raise InputError(f"the video processor merged a reference into {int(grid[0])} blocks, "
                                 f"but its sampled frames make {len(times)}")
            blocks.append((times, int(grid[1]) * int(grid[2]) // proc.merge_size ** 2))
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": grids}, blocks

    # ------------------------------------------------------------------ helpers
    def _stream(self, mode: str, prompt: str) -> _Stream:
        check_prompt(mode, prompt)
        # Typed into the text they would tokenize as vision markers that no pixels back (Qwen then fails
        # matching features to pads, or embeds a stray pad): the builder alone places them.
        typed = [tok for tok in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD) if tok in prompt]
        if typed:
            raise InputError(f"the prompt contains {', '.join(typed)}: vision markers are placed by h3-spark, "
                             "not typed; refer to references as <Picture i>, <Video k>, <Audio j>")
        return _Stream(self.tokenizer, self.embeddings, self.text_width, self.placeholder)

    def _finish(self, mode: str, stream: _Stream, vision: dict[str, torch.Tensor]) -> Presentation:
        if not stream.ids:
            raise InputError("the presentation is empty: give a prompt (or a keyframe or reference)")
        ids = torch.tensor(stream.ids, dtype=torch.long)
        tags = torch.tensor(stream.tags, dtype=torch.long)
        spliced = tuple(stream.spliced)
        return Presentation(mode, ids, tags, vision, presentation_hash(ids, tags, vision, spliced), spliced)


def _check_reference(ref: object, index: int) -> None:
    if isinstance(ref, ImageRef):
        _check_frames(ref.image, f"reference {index + 1} (image)", 3)
    elif isinstance(ref, VideoRef):
        _check_frames(ref.frames, f"reference {index + 1} (video)", 4)
    elif not isinstance(ref, AudioRef):
        raise InputError(f"reference {index + 1}: unsupported reference kind {type(ref).__name__}; "
                         "use ImageRef, VideoRef or AudioRef")
