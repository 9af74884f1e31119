"""Rendering a film window by window: each window a generation, its kept frames streamed out as they decode.

A window that goes on from the one before is a T2VA generation with
- a history: the 22 (by default) film frames before the previous window's last kept frame, VAE-encoded, placed
  before the target on the time axis, with the sound under them (whole audio latents ending where they end);
- a first-frame guide: that last kept frame itself, so the window's frame 0 repeats it and is trimmed.
Its sound goes on from the history's. What a window keeps is the plan's (`windows.py`): frames and samples on
one film grid, so the output's sound is exactly as long as its picture. Only one window's frames are held at a
time (plus the tail the next one needs); the sound of the whole film is kept (15 MB a minute) and muxed at the
end. The windows' latents are not carried across: the next window re-encodes the decoded tail.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ...errors import InputError
from .. import geometry
from ..media.refs import resample_fps
from .guides import AUDIO_SAMPLES_PER_LATENT, Guide, History, check_clip_length, resolve_frame
from .windows import DEFAULT_HISTORY_FRAMES, FilmPlan, Window, frame_sample, plan_film


@dataclass
class Shot:
    prompt: str
    frames: int


@dataclass
class ContinuedClip:
    """A clip the film goes on from: its frames (uint8 (F, H, W, 3) at 24 fps) and sound (float32 (2, samples)
    at 32 kHz, or None). A clip read from a file need not be held whole: `frames` is then its tail (what the
    film is conditioned on), `length` the whole clip's frame count and `head()` yields the frames before the tail,
    a few at a time, when the output is written (`from_tail`)."""

    frames: torch.Tensor
    audio: torch.Tensor | None = None
    length: int | None = None  # None: `frames` is the whole clip
    head: Callable[[], Iterator[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        held = int(self.frames.shape[0])
        if self.length is not None and (self.length < held or (self.length > held) != (self.head is not None)):
            raise InputError(f"a continued clip of {self.length} frames holds its last {held}: the frames before "
                             "them come from head(), given exactly when there are some")

    @property
    def total_frames(self) -> int:
        return int(self.frames.shape[0]) if self.length is None else self.length

    @classmethod
    def from_tail(cls, tail) -> "ContinuedClip":
        """A clip from `media.files.read_video_tail`'s VideoTail: its tail held, the rest read again as it is
        written."""
        held = int(tail.frames.shape[0])
        return cls(tail.frames, tail.audio, tail.total_frames, tail.head if tail.total_frames > held else None)


@dataclass
class Film:
    """A film request planned before any weight loads: its windows, its shots (a prompt and a length each), the
    guides by window, the clip it goes on from (or None) and the canvas (a continued clip's own)."""

    plan: FilmPlan
    shots: list[Shot]
    guides: dict[int, list[Guide]]
    continued: ContinuedClip | None
    width: int | None
    height: int | None
    history_frames: int = DEFAULT_HISTORY_FRAMES


def plan_request(shots: list[Shot], guides: list[Guide], *, width: int | None, height: int | None,
                 continued: ContinuedClip | None = None, history_frames: int = DEFAULT_HISTORY_FRAMES,
                 what: str = "the clip to continue") -> Film:
    """The film a request asks for: shots planned into windows after the `continued` clip, which sets the canvas
    (a request that names another is refused: a clip is continued at its own size), and its guides given to the
    windows that keep their frames."""
    if continued is not None:
        h, w = (int(n) for n in continued.frames.shape[1:3])
        if width is not None and (width, height) != (w, h):
            raise InputError(f"{what} is {w}x{h}; the request asks for {width}x{height}: a clip is continued at its "
                             "own size")
        width, height = w, h
    plan = plan_film([s.frames for s in shots], history=history_frames,
                     continues=0 if continued is None else continued.total_frames)
    if continued is not None and continued.frames.shape[0] < min(history_frames + 1, continued.total_frames):
        raise InputError(f"{what}: the film goes on from its last {history_frames + 1} frames, and only its last "
                         f"{continued.frames.shape[0]} were read")
    return Film(plan, shots, assign_guides(plan, guides), continued, width, height, history_frames)


def history_of(tail: torch.Tensor, sound: torch.Tensor | None, end_sample: int,
               history_frames: int) -> tuple[History, torch.Tensor]:
    """What a clip that goes on from `tail` (uint8 (F, H, W, 3), its last frame last) is conditioned on: the
    `history_frames` frames before the last frame, with the whole audio latents of `sound` (stereo at 32 kHz)
    that end at `end_sample`, the last frame's first sample; and the last frame, its first-frame guide."""
    if tail.shape[0] < history_frames + 1:
        raise InputError(f"going on from a clip takes its last frame and {history_frames} before it; it has "
                         f"{tail.shape[0]} frames")
    audio = None
    if sound is not None:
        samples = geometry.AUDIO_LATENTS_PER_SECOND * history_frames // geometry.FPS * AUDIO_SAMPLES_PER_LATENT
        if not samples <= end_sample <= sound.shape[1]:
            raise InputError(f"the clip's sound has {sound.shape[1]} samples; the history needs the {samples} "
                             f"before sample {end_sample}")
        audio = sound[:, end_sample - samples:end_sample].contiguous()
    return History(tail[-history_frames - 1:-1].contiguous(), audio), tail[-1]


@dataclass
class FilmResult:
    audio: torch.Tensor  # float32 (2, samples) at 32 kHz: the whole film's, the continued clip's first
    frames: int
    info: dict = field(default_factory=dict)


class _Tail:
    """The film's last frames: what the next window goes on from (its last frame and the history before it)."""

    def __init__(self, keep_frames: int):
        self.keep_frames = keep_frames
        self.frames: torch.Tensor | None = None

    def add(self, frames: torch.Tensor) -> None:
        joined = frames if self.frames is None else torch.cat([self.frames, frames])
        self.frames = joined[-self.keep_frames:].clone()

    def clear(self) -> None:
        self.frames = None


def assign_guides(plan: FilmPlan, guides: list[Guide]) -> dict[int, list[Guide]]:
    """Each guide of the film's new part (its frame counted in it, negative from its end) given to the window
    that keeps that frame, at the window's own frame; a clip must lie within what one window keeps."""
    out: dict[int, list[Guide]] = {}
    for i, guide in enumerate(guides):
        what = f"guide {i + 1} ({guide.kind})"
        film_frame = plan.first_frame + resolve_frame(guide.frame, plan.total_frames, what)
        length = 1
        if guide.kind == "clip" and isinstance(guide.clip, torch.Tensor) and guide.clip.ndim == 4:
            length = int(resample_fps(guide.clip, guide.fps).shape[0])
            check_clip_length(length, what)
        window = next(w for w in plan.windows if w.start + w.keep_from <= film_frame < w.start + w.keep_to)
        local = film_frame - window.start
        if local + length > window.keep_to:
            raise InputError(f"{what}: its {length} frames from frame {film_frame - plan.first_frame} cross a window "
                             f"boundary (window {window.index + 1} keeps film frames "
                             f"{window.start + window.keep_from - plan.first_frame}.."
                             f"{window.start + window.keep_to - plan.first_frame}); anchor it inside one window")
        out.setdefault(window.index, []).append(dataclasses.replace(guide, frame=local))
    return out


def _window_request(base, window: Window, prompt: str, tail: _Tail, sound: list[torch.Tensor], history_frames: int,
                    guides: list[Guide], step_cache):
    """Window `window`'s T2VA request. One that goes on from the film gets its history (the frames before the
    film's last, with the whole audio latents of sound that end at the last frame's start) and the last frame
    as its first-frame guide, before the film's own guides for its frames."""
    request = dataclasses.replace(base, prompt=prompt, frames=window.frames, seed=base.seed + window.index,
                                  guides=list(guides), history=None, step_cache=step_cache)
    if not window.carries:
        return request
    if tail.frames is None:
        raise InputError(f"window {window.index} goes on from the film, which has no frames before it")
    # The last frame's first sample: the window's frame 0 starts there.
    request.history, last = history_of(tail.frames, torch.cat(sound, dim=1), frame_sample(window.start),
                                       history_frames)
    request.guides = [Guide("image", 0, image=last)] + list(guides)
    return request


def render_film(generate: Callable, base, film: Film, *, on_frames: Callable[[torch.Tensor], None],
                fresh_step_cache: Callable | None = None,
                on_window: Callable[[Window, dict], None] | None = None) -> FilmResult:
    """Render `film` with `generate(request) -> GenerationResult` (a pipeline's or an engine's), `base` a T2VA
    request whose canvas, steps, seed (window i uses seed + i) and recipes every window takes. Kept frames go
    to `on_frames` in film order; `fresh_step_cache()`: a step cache for each window (a cache's state belongs to
    one generation)."""
    plan, shots, continued, history_frames = film.plan, film.shots, film.continued, film.history_frames
    if base.mode != "t2va":
        raise InputError(f"a film is made of t2va windows, got mode {base.mode!r}")
    if base.guides or base.history is not None:
        raise InputError("a film's guides go by window (assign_guides), and its history comes from the film")
    if len(shots) != len({w.shot for w in plan.windows}):
        raise InputError(f"the plan has {len({w.shot for w in plan.windows})} shots, the film {len(shots)}")
    tail = _Tail(history_frames + 1)
    sound: list[torch.Tensor] = []  # the film's, on its sample grid: frame g starts at frame_sample(g)
    info = {"windows": [], "plan": plan.describe(), "width": film.width, "height": film.height}
    if continued is not None:
        if continued.total_frames != plan.first_frame:
            raise InputError(f"the plan continues {plan.first_frame} frames, the clip has {continued.total_frames}")
        if continued.head is not None:  # the clip's frames before its tail, read again as they are written
            for chunk in continued.head():
                on_frames(chunk)
        on_frames(continued.frames)
        clip_samples = frame_sample(continued.total_frames)
        audio = continued.audio if continued.audio is not None else torch.zeros(2, clip_samples)
        sound.append(_fit(audio.float(), clip_samples))
        tail.add(continued.frames)
    for window in plan.windows:
        if window.index and window.shot != plan.windows[window.index - 1].shot:
            tail.clear()
        started = time.perf_counter()
        request = _window_request(base, window, shots[window.shot].prompt, tail, sound, history_frames,
                                  film.guides.get(window.index, []),
                                  fresh_step_cache() if fresh_step_cache is not None else None)
        result = generate(request)
        frames = result.video[window.keep_from:window.keep_to]
        a, b = window.audio_keep
        audio = result.audio[:, a:b]
        if audio.shape[1] != b - a:
            raise InputError(f"window {window.index} decoded {result.audio.shape[1]} samples; the plan keeps "
                             f"{a}..{b}")
        on_frames(frames)
        sound.append(audio)
        tail.add(frames)
        entry = {**window.describe(), "seconds": round(time.perf_counter() - started, 3),
                 "timings": {k: round(v, 3) for k, v in result.timings.items()}}
        if "step_cache" in result.info:
            entry["step_cache"] = result.info["step_cache"]
        if torch.cuda.is_available():  # flat across windows: a film holds one window at a time
            entry["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            torch.cuda.reset_peak_memory_stats()
        info["windows"].append(entry)
        if on_window is not None:
            on_window(window, entry)
        del result, frames
    total = (0 if continued is None else continued.total_frames) + plan.total_frames
    return FilmResult(torch.cat(sound, dim=1), total, info)


def _fit(audio: torch.Tensor, samples: int) -> torch.Tensor:
    """A continued clip's sound cut or padded with silence to its frames' length, so the film's stays on grid."""
    if audio.shape[1] >= samples:
        return audio[:, :samples]
    return torch.cat([audio, audio.new_zeros(2, samples - audio.shape[1])], dim=1)
