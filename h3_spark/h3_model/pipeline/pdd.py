"""PDD's per-step head weights: which of the bank's heads a sampling step spans, and how much of it each covers.

A PDD bank has one head per interval of a fine grid: `count` (32) equal intervals of the unshifted clock,
shifted like the sampler's grid (sigma' = s*b / (1 + (s-1)*b), video s = 12, audio s = 3), so head j was
trained for sigma in [g(j+1), g(j)] with g(j) = shift(1 - j / count). A step from sigma_a down to sigma_b uses
head j with weight overlap([sigma_b, sigma_a], [g(j+1), g(j)]) / (sigma_a - sigma_b): the mean of the heads it
spans, weighted by the stretch of sigma (= of t = 1 - sigma) each covers; the weights of a step sum to 1.
The trained 8-step grid (the plain grid of 9 points at the same shifts) lands on every fourth boundary, so each
of its steps spans 4 whole intervals; any other grid gets the same rule with partial overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dit.head_bank import HeadMix
from .scheduler import JointSchedule

# The published banks (checkpoint/pdd.py: 32 heads per modality) were trained at the release's shifts.
PDD_VIDEO_SHIFT = 12.0
PDD_AUDIO_SHIFT = 3.0
# A step's end within this of an interval boundary is that boundary: the sampler's fp32 grid and the fp64
# boundaries differ by ~1e-7 at the same point, which must not give a neighbouring head a sliver of weight.
# The closest two boundaries of the published grids are 2.7e-3 apart.
SNAP = 1e-6


def interval_boundaries(count: int, shift: float) -> list[float]:
    """g(0) = 1 > g(1) > ... > g(count) = 0: the sigmas that bound the bank's intervals, in fp64."""
    base = torch.linspace(1.0, 0.0, count + 1, dtype=torch.float64)
    return (shift * base / (1 + (shift - 1) * base)).tolist()


def interval_weights(sigma_from: float, sigma_to: float, boundaries: list[float]) -> tuple[float, ...]:
    """Each interval's share of the step sigma_from -> sigma_to (sigma_from > sigma_to): overlap / step length."""
    top, bottom = _snap(sigma_from, boundaries), _snap(sigma_to, boundaries)
    span = top - bottom
    return tuple(max(0.0, min(top, hi) - max(bottom, lo)) / span for hi, lo in zip(boundaries, boundaries[1:]))


def _snap(sigma: float, boundaries: list[float]) -> float:
    nearest = min(boundaries, key=lambda g: abs(g - sigma))
    return nearest if abs(nearest - sigma) <= SNAP else float(sigma)


@dataclass(frozen=True)
class PddHeads:
    """The head schedule of a `count`-head bank trained at these shifts: `mixes(schedule)` gives each step's
    HeadMix for whatever grid the run samples (the sampler asks once per run)."""

    count: int
    video_shift: float = PDD_VIDEO_SHIFT
    audio_shift: float = PDD_AUDIO_SHIFT

    def mixes(self, schedule: JointSchedule) -> list[HeadMix]:
        video = interval_boundaries(self.count, self.video_shift)
        audio = interval_boundaries(self.count, self.audio_shift)
        v, a = schedule.video.sigmas.tolist(), schedule.audio.sigmas.tolist()
        return [HeadMix(interval_weights(v[i], v[i + 1], video), interval_weights(a[i], a[i + 1], audio))
                for i in range(len(schedule))]
