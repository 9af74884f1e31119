"""The samplers (ComfyUI's word for a step rule): euler and res_multistep, stepping video and audio together.

`make_solver(name, schedule)` gives a fresh solver for one run; the sampling loop (sampler.py) hands it each
evaluation's velocities with `step(i, video_velocity, video_rows, audio_velocity, audio_rows)`. Every step
reads the clean estimate x0 = x + (1 - t) * v, t the timestep the model saw (as Schedule.step does).

- euler: Schedule.step on each stream, x' = r x + (1 - r) x0 with r = sigma' / sigma: today's sampler, bit for
  bit (the default).
- res_multistep: ComfyUI's deterministic second-order exponential multistep (k_diffusion's `res_multistep` at
  eta 0, after arXiv 2308.02157). With lambda = -log(sigma) (ComfyUI takes -log sigma for flow models too),
  h = lambda' - lambda and c2 = (lambda_prev - lambda) / h (negative: the previous point is behind),
      x' = (sigma' / sigma) x + h (b1 x0 + b2 x0_prev),
      b1 = phi1(-h) - phi2(-h) / c2, b2 = phi2(-h) / c2, phi1(z) = (e^z - 1) / z, phi2(z) = (phi1(z) - 1) / z;
  the first step and a step to sigma' = 0 are Euler steps.

The audio rows. ComfyUI's sampler knows one sigma list, the video's. Its H3 model (Comfy-Org/ComfyUI
`comfy/model_sampling.py` ModelSamplingAV: `audio_scale` = shift / audio_shift; `comfy/model_base.py`
MiniMaxH3: `process_latent_in` / `process_latent_out` multiply / divide the audio part of the packed latent by
`model_sampling.audio_scale`, and `extra_conds` passes it on as the payload's `audio_scale`;
`comfy/ldm/minimax/model.py` MiniMaxH3Model.forward) carries the audio as y = (sigma_v / sigma_a) x_a, with
sigma_a = time_shift_sigma(sigma_v, shift_video, shift_audio) read from transformer_options'
`minimax_h3_sigma_shift_video` / `_audio`: forward() multiplies y by sigma_a / sigma_v before the network and
turns the audio velocity u_a back into the carried one, (1 - k) x_a + (1 + (k - 1) sigma_a) u_a with
k = audio_scale. Worked out, that is exactly: y is an ordinary flow latent on the video sigmas whose clean
target is k * x0_a (rho(sigma_v) / rho(sigma_a) = k at every sigma, rho(s) = s / (1 - s)), so the sampler's
denoised for the audio is k * x0_a, and the end divides by k.
- For euler this carry changes nothing: an Euler step of y on the video sigmas, taken back to x_a, is the Euler
  step of x_a on its own sigmas (the coefficient of x0_a, k sigma_a' / sigma_v' - k sigma_a' / sigma_v, is
  1 - sigma_a' / sigma_a because k sigma_a / sigma_v = 1 + (k - 1) sigma_a). So euler steps each stream on its
  own sigmas, as it always did.
- For res_multistep it does not: the exponential weights h, b1, b2 come from the video sigmas and the carried
  variable. So the audio takes the video's step in the carried variable, written for x_a:
      x_a' = (sigma_a' / sigma_a) x_a + (k sigma_a' / sigma_v') h (b1 x0_a + b2 x0_a_prev),
  h, b1, b2 the video's; the video's own step is the same line with sigma_a = sigma_v and k = 1. k is the
  schedule's `audio_scale` (video shift / audio shift); explicit sigmas whose audio does not follow the video by
  one change of shift have none, and res_multistep refuses them.
"""

from __future__ import annotations

import math

import torch

from ...errors import InputError
from .scheduler import JointSchedule, Schedule

SAMPLERS = ("euler", "res_multistep")
DEFAULT_SAMPLER = "euler"
SAMPLER_HELP = {
    "euler": "first order, one evaluation per step (the default, the released pipeline's)",
    "res_multistep": "ComfyUI's second-order exponential multistep: Euler's cost, the previous step's estimate "
                     "reused (the Comfy templates' sampler)",
}


def check_sampler(name) -> str:
    """`name` if it is a sampler, else one line listing them."""
    if name not in SAMPLERS:
        raise InputError(f"unknown sampler {name!r}; the samplers are {', '.join(SAMPLERS)}")
    return name


def samplers_help() -> str:
    return "; ".join(f"{name}: {text}" for name, text in SAMPLER_HELP.items())


def make_solver(name: str, schedule: JointSchedule) -> "Euler | ResMultistep":
    """A fresh solver of sampler `name` for one run over `schedule` (a solver keeps the run's history)."""
    if check_sampler(name) == "euler":
        return Euler(schedule)
    if schedule.audio_scale is None:
        raise InputError("sampler res_multistep steps the audio on the video sigmas, which needs audio sigmas that "
                         "follow the video ones by one change of shift; these explicit sigmas do not: use sampler "
                         "euler, or give audio sigmas of that form")
    return ResMultistep(schedule)


def clean_estimate(schedule: Schedule, index: int, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """x0 = x + (1 - t) v in fp32, t the timestep the model saw at `index`."""
    t = schedule.timesteps[index].to(sample.device, torch.float32)
    return sample.float() + (1 - t) * velocity.float()


class Euler:
    """Each stream on its own sigmas (Schedule.step); keeps no history."""

    name = "euler"

    def __init__(self, schedule: JointSchedule):
        self.schedule = schedule

    def step(self, i: int, video_velocity, video, audio_velocity, audio):
        return (self.schedule.video.step(i, video_velocity, video),
                self.schedule.audio.step(i, audio_velocity, audio))


class ResMultistep:
    """res_multistep at eta 0: the previous step's clean estimates are its history."""

    name = "res_multistep"

    def __init__(self, schedule: JointSchedule):
        self.schedule = schedule
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None

    def step(self, i: int, video_velocity, video, audio_velocity, audio):
        s = self.schedule
        if not 0 <= i < len(s):
            raise InputError(f"step {i} is outside a {len(s)}-step schedule")
        x0 = (clean_estimate(s.video, i, video_velocity, video), clean_estimate(s.audio, i, audio_velocity, audio))
        sigma_v, sigma_v_next = float(s.video.sigmas[i]), float(s.video.sigmas[i + 1])
        if self.previous is None or sigma_v_next == 0.0:
            out = (s.video.step(i, video_velocity, video), s.audio.step(i, audio_velocity, audio))
        else:
            h, b1, b2 = res_weights(float(s.video.sigmas[i - 1]), sigma_v, sigma_v_next)
            sigma_a, sigma_a_next = float(s.audio.sigmas[i]), float(s.audio.sigmas[i + 1])
            out = (_combine(video, sigma_v_next / sigma_v, h, b1, b2, x0[0], self.previous[0]),
                   _combine(audio, sigma_a_next / sigma_a, s.audio_scale * sigma_a_next / sigma_v_next * h, b1, b2,
                            x0[1], self.previous[1]))
        self.previous = x0
        return out


def res_weights(sigma_prev: float, sigma: float, sigma_next: float) -> tuple[float, float, float]:
    """(h, b1, b2) of a res_multistep step from `sigma` to `sigma_next` after one from `sigma_prev`, in fp64."""
    h = math.log(sigma / sigma_next)
    c2 = math.log(sigma / sigma_prev) / h
    phi1 = math.expm1(-h) / -h
    phi2 = (phi1 - 1.0) / -h
    return h, phi1 - phi2 / c2, phi2 / c2


def _combine(x: torch.Tensor, decay: float, weight: float, b1: float, b2: float, x0: torch.Tensor,
             x0_previous: torch.Tensor) -> torch.Tensor:
    """decay * x + weight * (b1 x0 + b2 x0_previous), in fp32, returned in x's dtype."""
    return (decay * x.float() + weight * (b1 * x0 + b2 * x0_previous)).to(x.dtype)
