"""Rectified-flow schedules (the schedulers) and the Euler step, in H3's convention.

t = 1 - sigma and t = 1 is clean. The DiT predicts a data-ward velocity v, so x0 = x_t + sigma * v
and an Euler step is x_next = r * x_t + (1 - r) * x0 with r = sigma_next / sigma. Video and audio
share the grid size but use different shifts (12 and 3), so audio is always less noisy.

Schedulers (`SCHEDULERS`; `JointSchedule.from_scheduler` builds any of them), each giving the video sigmas for
`points` grid points (points - 1 evaluations, the final 0 included):
- h3: our own grid, the released pipeline's: linspace(1, 0, points) shifted (`sigmas`); the audio grid is the
  same linspace at the audio shift. The default; its results are unchanged by the other schedulers' arrival.
- simple, beta, normal: ComfyUI's schedulers of the same names over its flow table (`sigma_table`): the 1000
  sigmas shift(k / 1000), k = 1..1000, at the video shift (ComfyUI's ModelSamplingDiscreteFlow, which its
  ModelSamplingAV extends for H3). For E = points - 1 evaluations:
  - simple: table entry 1000 - floor(i * 1000 / E) (1-based) for i = 0..E-1, then 0;
  - beta: the entries at rint(999 * F^-1(1 - i / E)) for F the Beta(0.6, 0.6) distribution function, a
    repeated entry dropped (so beta may give fewer evaluations than asked), then 0;
  - normal: E timesteps evenly spaced from 1000 * sigma_max to 1000 * sigma_min, each turned into a sigma by
    the shift again (ComfyUI's flow `timestep(sigma)` is 1000 * sigma, not the inverse of its
    `sigma(t) = shift(t / 1000)`, and `normal` goes through both), then 0 (unless that last sigma is within
    1e-5 of 0, when E + 1 timesteps are taken instead and no 0 is added).
  Their audio sigmas follow the video ones in closed form, as ComfyUI's H3 model derives them: the video
  sigma taken back to the unshifted clock and shifted by the audio shift (`reshift`).
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
    _check_shift(shift)
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


SCHEDULERS = ("h3", "simple", "beta", "normal")
DEFAULT_SCHEDULER = "h3"
SCHEDULER_HELP = {
    "h3": "our grid, the released pipeline's: linspace(1, 0, steps) shifted per stream (the default)",
    "simple": "ComfyUI's simple: evenly spaced entries of its 1000-entry shifted flow table",
    "beta": "ComfyUI's beta: table entries at the Beta(0.6, 0.6) quantiles (denser at both ends)",
    "normal": "ComfyUI's normal: timesteps evenly spaced between the table's ends, shifted again",
}
TABLE_SIZE = 1000  # ComfyUI's flow table: shift(k / 1000), k = 1..1000
BETA_ALPHA = BETA_BETA = 0.6


def check_scheduler(name) -> str:
    """`name` if it is a scheduler, else one line listing them."""
    if name not in SCHEDULERS:
        raise InputError(f"unknown scheduler {name!r}; the schedulers are {', '.join(SCHEDULERS)}")
    return name


def schedulers_help() -> str:
    return "; ".join(f"{name}: {text}" for name, text in SCHEDULER_HELP.items())


def shift_sigma(base, shift: float):
    """The flow shift of an unshifted sigma (float or fp64 tensor): shift * b / (1 + (shift - 1) * b)."""
    return shift * base / (1 + (shift - 1) * base)


def reshift(sigma, from_shift: float, to_shift: float):
    """A sigma shifted by `from_shift` taken back to the unshifted clock and shifted by `to_shift` (how the
    audio sigma follows the video one)."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return shift_sigma(base, to_shift)


def sigma_table(shift: float) -> torch.Tensor:
    """ComfyUI's flow table at `shift`: TABLE_SIZE sigmas shift(k / TABLE_SIZE), k = 1..TABLE_SIZE, ascending,
    computed in fp64 and held in fp32 (as the table is)."""
    base = torch.arange(1, TABLE_SIZE + 1, dtype=torch.float64) / TABLE_SIZE
    return shift_sigma(base, shift).float()


def scheduler_sigmas(name: str, evaluations: int, shift: float) -> torch.Tensor:
    """The video sigmas of scheduler `name` (simple, beta or normal) for `evaluations` steps at `shift`, fp32,
    ending at 0 (but for normal at a shift so small that its last sigma is within 1e-5 of 0, as in ComfyUI)."""
    check_scheduler(name)
    if name == "h3":
        raise InputError("scheduler h3 is our own grid (sigmas(points, shift)), not one of the table's")
    if evaluations < 1:
        raise InputError(f"steps must be at least 2 (grid points including the final 0), got {evaluations + 1}")
    _check_shift(shift)
    table = sigma_table(shift)
    if name == "simple":
        stride = TABLE_SIZE / evaluations
        picked = [float(table[TABLE_SIZE - 1 - int(i * stride)]) for i in range(evaluations)] + [0.0]
    elif name == "beta":
        picked = [float(table[i]) for i in _beta_indices(evaluations)] + [0.0]
    else:
        picked = _normal_sigmas(table, evaluations, shift)
    return torch.tensor(picked, dtype=torch.float32)


def _beta_indices(evaluations: int) -> list[int]:
    """Table indices at the Beta(0.6, 0.6) quantiles of 1 - i / E, rounded half to even, repeats dropped."""
    import numpy

    try:
        from scipy.stats import beta
    except ImportError:  # a dependency (pyproject, requirements.txt): missing only from a broken install
        raise InputError("scheduler beta needs scipy (its Beta quantile function): pip install scipy") from None
    quantiles = 1 - numpy.linspace(0, 1, evaluations, endpoint=False)
    picked = numpy.rint(beta.ppf(quantiles, BETA_ALPHA, BETA_BETA) * (TABLE_SIZE - 1)).astype(int).tolist()
    return [t for k, t in enumerate(picked) if k == 0 or t != picked[k - 1]]


def _normal_sigmas(table: torch.Tensor, evaluations: int, shift: float) -> list[float]:
    top, bottom = float(table[-1]) * TABLE_SIZE, float(table[0]) * TABLE_SIZE
    count, zero = evaluations, True
    if abs(float(shift_sigma(bottom / TABLE_SIZE, shift))) <= 1e-5:
        count, zero = evaluations + 1, False
    times = torch.linspace(top, bottom, count, dtype=torch.float64) / TABLE_SIZE
    return shift_sigma(times, shift).tolist() + ([0.0] if zero else [])


def _check_shift(shift: float) -> None:
    if not math.isfinite(shift) or shift <= 0:  # NaN passes `<= 0` and makes every sigma NaN
        raise InputError(f"shift must be a positive finite number, got {shift}")


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
    """Video and audio schedules with the same number of points, stepped together.

    `audio_scale`: rho(sigma_video) / rho(sigma_audio) with rho(s) = s / (1 - s), the same at every point when
    the audio sigmas follow the video ones by a change of shift (video shift / audio shift); the sampler
    res_multistep carries the audio on the video schedule with it (solvers.py). None: not such a pair."""

    video: Schedule
    audio: Schedule
    audio_scale: float | None = None

    @classmethod
    def create(cls, steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT) -> "JointSchedule":
        video, audio = Schedule.shifted(steps, video_shift), Schedule.shifted(steps, audio_shift)
        if len(video) != len(audio):
            # Only possible when fp32 collapses grid points differently for the two shifts.
            raise InputError(
                f"{steps} steps give {len(video)} video and {len(audio)} audio evaluations; choose another step count"
            )
        return cls(video, audio, video_shift / audio_shift)

    @classmethod
    def from_scheduler(cls, name: str, steps: int, video_shift: float = VIDEO_SHIFT,
                       audio_shift: float = AUDIO_SHIFT) -> "JointSchedule":
        """Scheduler `name` over `steps` grid points (steps - 1 evaluations asked for): h3's two grids, or a
        table scheduler's video sigmas with the audio sigmas that follow them."""
        if check_scheduler(name) == "h3":
            return cls.create(steps, video_shift, audio_shift)
        _check_shift(audio_shift)
        video = scheduler_sigmas(name, int(steps) - 1, video_shift)
        audio = reshift(video.double(), video_shift, audio_shift).float()  # reshift(0) is exactly 0
        return cls(Schedule(video), Schedule(audio), video_shift / audio_shift)

    @classmethod
    def explicit(cls, video_sigmas, audio_sigmas=None) -> "JointSchedule":
        """Explicit sigmas (custom_sigmas each); the audio's are the video's when not given."""
        video = Schedule(custom_sigmas(video_sigmas))
        audio = Schedule(custom_sigmas(audio_sigmas if audio_sigmas is not None else video_sigmas))
        if len(video) != len(audio):
            raise InputError(f"sigmas give {len(video)} video and {len(audio)} audio evaluations; they must match")
        return cls(video, audio, _scale_of(video.sigmas, audio.sigmas))

    def __len__(self) -> int:
        return len(self.video)

    def step_timesteps(self, index: int) -> tuple[float, float]:
        return float(self.video.timesteps[index]), float(self.audio.timesteps[index])


# How far (absolute, in sigma) an explicit pair's audio sigma may lie from the one its video sigma gives under the
# pair's scale and still be taken for one change of shift: a few fp32 roundings of a sigma.
SCALE_TOLERANCE = 1e-6


def _scale_of(video: torch.Tensor, audio: torch.Tensor) -> float | None:
    """rho(video) / rho(audio), rho(s) = s / (1 - s), when one number maps every video sigma onto its audio sigma
    (audio = rho_v / (scale + rho_v)) within SCALE_TOLERANCE, else None. The scale is read at the point furthest
    from both ends (the ratio of fp32 sigmas near 1 or 0 is the least certain)."""
    v, a = video.double(), audio.double()
    if bool(((v <= 0) != (a <= 0)).any()) or bool(((v >= 1) != (a >= 1)).any()):
        return None  # one stream clean or pure noise where the other is not: no change of shift does that
    inside = (v > 0) & (v < 1)
    if not bool(inside.any()):
        return 1.0  # only the ends: any scale steps the same
    rho_v, rho_a = v[inside] / (1 - v[inside]), a[inside] / (1 - a[inside])
    margin = torch.minimum(v[inside] * (1 - v[inside]), a[inside] * (1 - a[inside]))
    k = int(margin.argmax())
    scale = float(rho_v[k] / rho_a[k])
    predicted = rho_v / (scale + rho_v)
    return scale if float((predicted - a[inside]).abs().max()) <= SCALE_TOLERANCE else None
