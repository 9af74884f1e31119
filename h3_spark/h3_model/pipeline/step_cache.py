"""Step caches: skip DiT forwards whose output can be estimated from an earlier step. Opt-in, approximate.

The sampler hands a cache `velocities(i, video_rows, audio_rows, forward)` once per evaluation, in order;
`forward()` runs the DiT. A cache either calls it ("computed") or returns an estimate ("reused"), and
`report()` lists which steps were which, so every output that used a cache says so.

Modes (`make_step_cache`):
- off: always computes; bit-identical to running without a cache (tests hold it to that).
- easycache: keeps the velocity *change* of the last computed step, delta = v - x (output minus input,
  per row), and reuses it as v = x_i + delta while the CUMULATIVE relative input change since that
  step (the sum of the per-step changes) stays under `threshold` (after EasyCache, Zhou et al. 2025;
  without its output-rate weighting).
- h3_cache: keeps the last computed velocity itself and reuses it whenever the CURRENT step's relative
  input change is under `threshold`. In flow matching the exact velocity (noise - data) is constant
  along a straight path, so holding v is the zero-order estimate; a per-step test reacts to the
  schedule's large early/late moves without a budget that drifts over many small steps.
- first_block: decides inside each forward after the DiT's first block (FirstBlockCache below); the
  embeddings, the first block and the heads always run.

Shared knobs:
- start/end percent: only evaluation i with start <= i / evaluations < end may be reused; outside the
  window every step is computed (and refreshes the cache). A step is reused only after some step was
  computed, so the first evaluation always runs.
- subsample factor s: the change is measured on rows[::s] of each modality (cheaper, GPU-syncing
  reductions on fewer rows); the estimate itself always covers every row.
The relative change is ||x_i - x_{i-1}|| / ||x_{i-1}|| on the measured rows, the larger of the video and
audio values: one forward makes both, so both must be quiet for a reuse (the audio stream is the one
users report artefacts in first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import InputError

MODES = ("off", "easycache", "h3_cache", "first_block")
# Defaults are conservative starting points, not measured quality budgets: each run's report says
# how many steps were reused, and the benchmarks measure the error per model and schedule. first_block's
# 0.08 is the threshold NVIDIA's Sol-Engine publishes for H3.
DEFAULT_THRESHOLD = {"off": 0.0, "easycache": 0.1, "h3_cache": 0.03, "first_block": 0.08}
DEFAULT_START_PERCENT = 0.2
DEFAULT_END_PERCENT = 0.9
DEFAULT_SUBSAMPLE = 1
MAX_SUBSAMPLE = 1024

Forward = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass(frozen=True)
class CacheOptions:
    mode: str = "off"
    threshold: float = 0.0
    start_percent: float = DEFAULT_START_PERCENT
    end_percent: float = DEFAULT_END_PERCENT
    subsample_factor: int = DEFAULT_SUBSAMPLE

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"cache mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (
                self.threshold >= 0 and self.threshold != float("inf")):
            raise InputError(f"cache threshold must be a finite number >= 0, got {self.threshold!r}")
        for name in ("start_percent", "end_percent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise InputError(f"cache {name.replace('_', ' ')} must lie in [0, 1], got {value!r}")
        if self.start_percent > self.end_percent:
            raise InputError(f"cache start percent {self.start_percent} is after end percent {self.end_percent}")
        s = self.subsample_factor
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_SUBSAMPLE:
            raise InputError(f"cache subsample factor must be an integer in 1..{MAX_SUBSAMPLE}, got {s!r}")


class StepCache:
    """Bookkeeping shared by every mode: the window, the change measurement and the report."""

    mode = "off"

    def __init__(self, options: CacheOptions, evaluations: int):
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 1:
            raise InputError(f"a step cache needs the number of DiT evaluations (>= 1), got {evaluations!r}")
        self.options = options
        self.evaluations = evaluations
        self.computed: list[int] = []
        self.reused: list[int] = []
        self.changes: dict[int, float] = {}
        self._previous: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next = 0

    # ------------------------------------------------------------------ protocol
    def velocities(self, i: int, video_rows: torch.Tensor, audio_rows: torch.Tensor,
                   forward: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        self._advance(i)
        if self.mode == "off":
            # Nothing measured either: off must cost nothing and change nothing.
            self.computed.append(i)
            return forward()
        change = self._measure(video_rows, audio_rows)
        if change is not None:
            self.changes[i] = change
        if change is not None and self._may_reuse(i) and self._decide(change):
            self.reused.append(i)
            return self._estimate(video_rows, audio_rows)
        out = forward()
        self.computed.append(i)
        self._store(video_rows, audio_rows, out)
        return out

    def report(self) -> dict:
        o = self.options
        return {"mode": self.mode, "threshold": o.threshold, "start_percent": o.start_percent,
                "end_percent": o.end_percent, "subsample_factor": o.subsample_factor,
                "evaluations": self.evaluations, "computed": list(self.computed), "reused": list(self.reused),
                "approximate": bool(self.reused),
                # JSON has no infinity: a change from an all-zero input (no scale) shows as null.
                "relative_changes": {str(k): (round(v, 6) if math.isfinite(v) else None)
                                     for k, v in self.changes.items()}}

    # ------------------------------------------------------------------ shared pieces
    def _advance(self, i: int) -> None:
        if i != self._next or i >= self.evaluations:
            # A cache's state belongs to one run; a reordered or longer loop would reuse stale velocities.
            raise InputError(f"step cache called for evaluation {i}, expected {self._next} of {self.evaluations}: "
                             f"use a fresh cache per generation, sized to its schedule")
        self._next += 1

    def in_window(self, i: int) -> bool:
        fraction = i / self.evaluations
        return self.options.start_percent <= fraction < self.options.end_percent

    def _may_reuse(self, i: int) -> bool:
        return self.computed != [] and self.in_window(i)

    def _measure(self, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> float | None:
        """Relative change of the inputs since the previous evaluation (None at the first one)."""
        s = self.options.subsample_factor
        current = (video_rows[::s].detach().float().clone(), audio_rows[::s].detach().float().clone())
        previous, self._previous = self._previous, current
        if previous is None:
            return None
        change = 0.0
        for now, before in zip(current, previous, strict=True):
            if now.numel() == 0:
                continue
            # A zero reference means there is no scale to be relative to: treat any change as total.
            scale = before.norm().item()
            diff = (now - before).norm().item()
            change = max(change, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
        return change

    # ------------------------------------------------------------------ per mode (off never gets here)
    def _decide(self, change: float) -> bool:
        raise NotImplementedError

    def _store(self, video_rows, audio_rows, out) -> None:
        raise NotImplementedError

    def _estimate(self, video_rows, audio_rows):
        raise NotImplementedError


class EasyCache(StepCache):
    mode = "easycache"

    def __init__(self, options: CacheOptions, evaluations: int):
        super().__init__(options, evaluations)
        self._delta: tuple[torch.Tensor, torch.Tensor] | None = None
        self._accumulated = 0.0

    def _decide(self, change: float) -> bool:
        self._accumulated += change
        return self._accumulated < self.options.threshold

    def _store(self, video_rows, audio_rows, out) -> None:
        v, a = out
        # delta = output - input, kept in fp32: the estimate adds it to the next step's fp32 latents.
        self._delta = (v[0].detach().float() - video_rows.detach().float(),
                       a[0].detach().float() - audio_rows.detach().float())
        self._accumulated = 0.0

    def _estimate(self, video_rows, audio_rows):
        dv, da = self._delta
        return (video_rows.float() + dv)[None], (audio_rows.float() + da)[None]


class H3Cache(StepCache):
    mode = "h3_cache"

    def __init__(self, options: CacheOptions, evaluations: int):
        super().__init__(options, evaluations)
        self._velocity: tuple[torch.Tensor, torch.Tensor] | None = None

    def _decide(self, change: float) -> bool:
        return change < self.options.threshold

    def _store(self, video_rows, audio_rows, out) -> None:
        # A copy: the DiT may hand back a buffer that its next forward overwrites.
        self._velocity = tuple(t.detach().float().clone() for t in out)

    def _estimate(self, video_rows, audio_rows):
        return self._velocity


class FirstBlockCache(StepCache):
    """Decides inside the forward: the DiT runs its first block, hands this cache the block's residual (output
    minus input), and skips the other blocks when that residual moved less than `threshold` since the last
    computed step (mean absolute change over the mean absolute value); their residual from that step is then
    added instead. Each step still runs the embeddings, the first block and the heads."""

    mode = "first_block"

    def __init__(self, options: CacheOptions, evaluations: int):
        super().__init__(options, evaluations)
        self._first: torch.Tensor | None = None  # the first block's residual at the last computed step
        self._rest: torch.Tensor | None = None  # the other blocks' residual at that step
        self._step = -1
        self._reusing = False

    def velocities(self, i: int, video_rows: torch.Tensor, audio_rows: torch.Tensor,
                   forward: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        self._advance(i)
        self._step, self._reusing = i, False
        out = forward(block_cache=self)
        (self.reused if self._reusing else self.computed).append(i)
        return out

    # ------------------------------------------------------------------ called by the DiT's forward
    def after_first_block(self, residual: torch.Tensor,
                          mean_abs: Callable[[torch.Tensor], float]) -> torch.Tensor | None:
        """The other blocks' residual to add (reuse), or None: run them. `mean_abs` (the forward's: dit/parallel.py)
        averages a residual's absolute values over the whole sequence; a forward split over ranks holds some rows
        of it and answers the all-ranks mean, so every rank measures the same change and decides alike."""
        if self._first is not None and self._rest is not None and self.in_window(self._step):
            scale = mean_abs(self._first)
            diff = mean_abs(residual.float() - self._first.float())
            change = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            self.changes[self._step] = change
            if change < self.options.threshold:
                self._reusing = True
                return self._rest
        self._first = residual.detach().clone()
        return None

    def store_rest(self, residual: torch.Tensor) -> None:
        self._rest = residual.detach().clone()


_CLASSES = {"off": StepCache, "easycache": EasyCache, "h3_cache": H3Cache, "first_block": FirstBlockCache}


def make_step_cache(mode: str = "off", threshold: float | None = None, start: float = DEFAULT_START_PERCENT,
                    end: float = DEFAULT_END_PERCENT, subsample: int = DEFAULT_SUBSAMPLE, *,
                    evaluations: int) -> StepCache:
    """A fresh cache for one generation of `evaluations` DiT forwards (= steps - 1, len(JointSchedule)).

    threshold None takes the mode's default. Raises InputError for any value out of range.
    """
    if mode not in MODES:
        raise InputError(f"cache mode must be one of {', '.join(MODES)}, got {mode!r}")
    options = CacheOptions(mode, DEFAULT_THRESHOLD[mode] if threshold is None else threshold, start, end, subsample)
    return _CLASSES[mode](options, evaluations)
