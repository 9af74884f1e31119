"""Rectified-flow schedule and Euler step, in H3's convention.

t = 1 - sigma and t = 1 is clean. The DiT predicts a data-ward velocity v, so x0 = x_t + sigma * v
and an Euler step is x_next = r * x_t + (1 - r) * x0 with r = sigma_next / sigma. Video and audio
share the grid size but use different shifts (12 and 3), so audio is always less noisy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import InputError

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
# Visual conditioning rows are held at this level ("keyframe noise augmentation"); reference
# audio rows are clean.
CONDITION_VIDEO_T = 0.999
CONDITION_AUDIO_T = 1.0


def sigmas(num_points: int, shift: float) -> torch.Tensor:
    """Shifted sigma grid of `num_points` values from 1 to 0 (terminal 0 included), fp32 on the CPU.

    Built on the CPU in fp32 so the schedule does not depend on the device; consecutive equal
    values that the shift produces in fp32 near sigma = 1 are collapsed.
    """
    if num_points < 2:
        raise InputError(f"steps must be at least 2 (grid points including the final 0), got {num_points}")
    if not math.isfinite(shift) or shift <= 0:  # NaN passes `<= 0` and makes every sigma NaN
        raise InputError(f"shift must be a positive finite number, got {shift}")
    base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    shifted = shift * base / (1 + (shift - 1) * base)
    return torch.unique_consecutive(shifted)


def custom_sigmas(values) -> torch.Tensor:
    """An explicit schedule, used verbatim: strictly decreasing and ending at 0."""
    s = torch.as_tensor(values, dtype=torch.float32).flatten().cpu()
    if s.numel() < 2 or not bool((s[1:] < s[:-1]).all()) or s[-1].item() != 0.0:
        raise InputError("sigmas must hold at least two strictly decreasing values ending at 0")
    if s[0].item() > 1.0:  # the model's timestep is 1 - sigma: above 1 it would see negative times
        raise InputError(f"sigmas must lie in [0, 1], got {s[0].item():g} first")
    return s


@dataclass
class Schedule:
    """One stream's sigma grid; `timesteps` are what the model sees (one per evaluation)."""

    sigmas: torch.Tensor

    @classmethod
    def shifted(cls, num_points: int, shift: float) -> "Schedule":
        return cls(sigmas(num_points, shift))

    @property
    def timesteps(self) -> torch.Tensor:
        return 1.0 - self.sigmas[:-1]

    def __len__(self) -> int:
        return int(self.sigmas.numel()) - 1

    def step(self, index: int, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Euler step `index` (0-based), evaluated in fp32, returned in the sample's dtype."""
        if not 0 <= index < len(self):
            raise InputError(f"step {index} is outside a {len(self)}-step schedule")
        # x0 uses the sigma recovered from the timestep the model saw, while the blend ratio uses
        # the grid: below sigma 0.5 the fp32 round trip 1 - (1 - sigma) is not exact.
        t = self.timesteps[index].to(sample.device, sample.dtype)
        x0 = sample + (1 - t) * velocity
        compute = torch.float32 if sample.dtype in (torch.float16, torch.bfloat16) else sample.dtype
        sigma = self.sigmas[index].to(sample.device, compute)
        sigma_next = self.sigmas[index + 1].to(sample.device, compute)
        ratio = sigma_next / sigma
        return (ratio * sample.to(compute) + (1.0 - ratio) * x0.to(compute)).to(sample.dtype)


@dataclass
class JointSchedule:
    """Video and audio schedules with the same number of points, stepped together."""

    video: Schedule
    audio: Schedule

    @classmethod
    def create(cls, steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT) -> "JointSchedule":
        video, audio = Schedule.shifted(steps, video_shift), Schedule.shifted(steps, audio_shift)
        if len(video) != len(audio):
            # Only possible when fp32 collapses grid points differently for the two shifts.
            raise InputError(
                f"{steps} steps give {len(video)} video and {len(audio)} audio evaluations; choose another step count"
            )
        return cls(video, audio)

    def __len__(self) -> int:
        return len(self.video)

    def step_timesteps(self, index: int) -> tuple[float, float]:
        return float(self.video.timesteps[index]), float(self.audio.timesteps[index])
