"""Films longer than one generation: the plan of windows, their overlaps and what each keeps.

H3 makes at most 345 frames (15 s) in one generation. A longer clip is a chain of windows: each later window
is conditioned on the tail of the one before (a history clip placed before its target on the time axis, and
the previous window's last frame as its first-frame guide), so its frame 0 repeats the previous window's last
frame and is trimmed. The last window may make more frames than the film needs (a window is 17k+5 frames and
at least the model's 124-frame floor); the excess at its end is trimmed too.

Sound is cut on one global grid: global frame g starts at sample `frame_sample(g)`, so the kept pieces of all
windows add up to exactly `frame_sample(total_frames)` samples and no seam drifts by a rounding. A shot
starts a new chain: it carries nothing over from the shot before.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ...errors import InputError
from ..geometry import (AUDIO_LATENTS_PER_SECOND, AUDIO_SAMPLE_RATE, FPS, VAE_FRAMES_PER_CHUNK, VAE_LATENTS_PER_CHUNK,
                        align_frames, audio_latent_frames)

MAX_WINDOW_FRAMES = 345  # the longest single generation (15 s at 24 fps, aligned down to 17k+5)
MIN_WINDOW_FRAMES = 124  # the shortest window the plan makes: the model's trained floor (~5 s)
DEFAULT_HISTORY_FRAMES = 22  # tail frames a window is conditioned on, besides its first-frame guide
MAX_HISTORY_FRAMES = 107  # the longest 17k+5 history that leaves a 124-frame window new frames
MAX_FILM_SECONDS = 120.0  # the longest film the CLI and the service plan
AUDIO_SAMPLES_PER_LATENT = AUDIO_SAMPLE_RATE // AUDIO_LATENTS_PER_SECOND


def frame_sample(frame: int) -> int:
    """First audio sample of film frame `frame`: its start time x 32 kHz, rounded to the nearest sample (exact
    arithmetic: frame x 4000 / 3 is never a half)."""
    return round(Fraction(frame * AUDIO_SAMPLE_RATE, FPS))


def window_audio_samples(frames: int) -> int:
    """Samples the audio VAE decodes for a window of `frames` frames (its latents x 800)."""
    return audio_latent_frames(frames) * AUDIO_SAMPLES_PER_LATENT


def check_history_frames(history: int) -> int:
    if history < VAE_LATENTS_PER_CHUNK or (history - VAE_LATENTS_PER_CHUNK) % VAE_FRAMES_PER_CHUNK:
        raise InputError(f"history frames must be 17k+5 (5, 22, 39, ...), got {history}")
    if history > MAX_HISTORY_FRAMES:
        raise InputError(f"history frames must leave the shortest window frames of its own: at most "
                         f"{MAX_HISTORY_FRAMES}, got {history}")
    return history


@dataclass(frozen=True)
class Window:
    """One generation of the plan. Frames are counted from the film's start (`start`) or the window's own
    (`keep_from`, `keep_to`); samples likewise from the window's own audio."""

    index: int  # in the whole plan
    shot: int
    frames: int  # the window generates this many frames (17k+5)
    start: int  # film frame of the window's frame 0
    keep_from: int  # first frame it keeps (1 after a history: frame 0 repeats the previous window's last)
    keep_to: int  # one past the last frame it keeps
    history: int  # tail frames of the previous window it is conditioned on (0: nothing carried)

    @property
    def carries(self) -> bool:
        return self.history > 0

    @property
    def kept_frames(self) -> int:
        return self.keep_to - self.keep_from

    @property
    def trimmed_tail(self) -> int:
        return self.frames - self.keep_to

    @property
    def audio_keep(self) -> tuple[int, int]:
        """The window's own samples [from, to) that the film keeps."""
        origin = frame_sample(self.start)
        return frame_sample(self.start + self.keep_from) - origin, frame_sample(self.start + self.keep_to) - origin

    def describe(self) -> dict:
        return {"window": self.index, "shot": self.shot, "frames": self.frames, "film_frames": [
            self.start + self.keep_from, self.start + self.keep_to], "history_frames": self.history,
            "overlap_trimmed": self.keep_from, "tail_trimmed": self.trimmed_tail,
            "audio_samples_kept": list(self.audio_keep)}


@dataclass(frozen=True)
class FilmPlan:
    windows: tuple[Window, ...]
    total_frames: int  # the frames the windows make (a continued clip's own are not counted)
    first_frame: int = 0  # film frame of the first window's first kept frame (a continued clip's length)

    @property
    def audio_samples(self) -> int:
        return frame_sample(self.first_frame + self.total_frames) - frame_sample(self.first_frame)

    @property
    def seconds(self) -> float:
        return self.total_frames / FPS

    def describe(self) -> dict:
        return {"frames": self.total_frames, "seconds": round(self.seconds, 4), "audio_samples": self.audio_samples,
                "first_frame": self.first_frame, "windows": [w.describe() for w in self.windows]}


def _covers(frames: int, start: int, keep_to: int) -> bool:
    """Whether a window of `frames` frames starting at film frame `start` has the sound of its first `keep_to`."""
    return window_audio_samples(frames) >= frame_sample(start + keep_to) - frame_sample(start)


def _shot_windows(frames: int, first_index: int, shot: int, start: int, history: int,
                  carried_in: bool) -> list[Window]:
    """The windows of one shot of `frames` frames starting at film frame `start`. `carried_in`: its first window
    continues a clip (a file given to --continue), so it too repeats a frame and is conditioned on a history."""
    if frames < 1:
        raise InputError(f"a shot needs at least one frame, got {frames}")
    windows: list[Window] = []
    film_start = start - 1 if carried_in else start  # film frame of the next window's frame 0
    left = frames
    while left:
        keep_from = 1 if carried_in or windows else 0
        # The fewest windows that can still hold what is left: the first adds up to 345 - keep_from frames,
        # every later one 344 (its frame 0 repeats). What is left is spread evenly over them.
        first_room = MAX_WINDOW_FRAMES - keep_from
        count = 1 + -(-max(0, left - first_room) // (MAX_WINDOW_FRAMES - 1))
        share = -(-left // count)
        size = align_frames(max(keep_from + share, MIN_WINDOW_FRAMES))
        if keep_from + left <= size:  # the last window: it keeps what is left and trims its tail
            keep_to = keep_from + left
            while not _covers(size, film_start, keep_to):
                # Its sound is its latents x 800 samples, short of its picture where frames x 5/3 rounds down
                # (56 frames: 93 latents, 74,400 samples for 74,667): the next length covers it.
                size += VAE_FRAMES_PER_CHUNK
        else:  # a window before the last keeps every frame whose sound it has
            keep_to = size if _covers(size, film_start, size) else size - 1
        windows.append(Window(first_index + len(windows), shot, size, film_start, keep_from, keep_to,
                              history if keep_from else 0))
        left -= keep_to - keep_from
        film_start += keep_to - 1  # the next window's frame 0 is this one's last kept frame
    return windows


def plan_film(shot_frames: list[int], *, history: int = DEFAULT_HISTORY_FRAMES, continues: int = 0) -> FilmPlan:
    """Windows for shots of the given lengths in frames, in order. `continues`: the length in frames of a clip
    the film continues (its tail conditions the first window; its own frames come first in the film and are
    not made again), 0 for none."""
    check_history_frames(history)
    if not shot_frames:
        raise InputError("a film needs at least one shot")
    if continues < 0 or 0 < continues < history + 1:
        raise InputError(f"a continued clip needs at least {history + 1} frames (its last frame and {history} "
                         f"before it), got {continues}")
    windows, start = [], continues
    for shot, frames in enumerate(shot_frames):
        made = _shot_windows(frames, len(windows), shot, start, history, bool(continues) and shot == 0)
        windows.extend(made)
        start += frames
    return FilmPlan(tuple(windows), start - continues, continues)


def frames_for_seconds(seconds: float) -> int:
    """Film frames for a length in seconds (24 fps), checked against the longest film planned."""
    if not 0 < seconds <= MAX_FILM_SECONDS:
        raise InputError(f"a film lasts more than 0 and at most {MAX_FILM_SECONDS:g} s, got {seconds:g}")
    return round(seconds * FPS)
