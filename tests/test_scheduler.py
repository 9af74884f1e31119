"""Sampler schedule and Euler step against diffusers' MiniMaxH3Scheduler."""

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from h3_spark.errors import InputError
from h3_spark.h3_model.pipeline.scheduler import JointSchedule, Schedule, custom_sigmas, sigmas


@pytest.mark.parametrize("steps", [2, 3, 5, 9, 21, 50, 200])
@pytest.mark.parametrize("shift", [12.0, 3.0, 6.0, 1.0])
def test_sigmas_match_diffusers(steps, shift):
    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(steps)
    ours = Schedule.shifted(steps, shift)
    assert torch.equal(ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert len(ours) == ref.num_inference_steps


def test_released_grid_values():
    video, audio = sigmas(50, 12.0), sigmas(50, 3.0)
    assert video[1].item() == pytest.approx(0.99827, abs=1e-5) and video[-2].item() == pytest.approx(0.2, abs=1e-6)
    assert audio[1].item() == pytest.approx(0.99310, abs=1e-5) and audio[-2].item() == pytest.approx(0.05882, abs=1e-5)
    joint = JointSchedule.create(50)
    assert len(joint) == 49
    tv, ta = joint.step_timesteps(10)
    assert ta > tv  # audio is always less noisy than video


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_loop_matches_diffusers(dtype):
    gen = torch.Generator().manual_seed(0)
    ref = MiniMaxH3Scheduler(shift=12.0)
    ref.set_timesteps(9)
    ours = Schedule.shifted(9, 12.0)
    x_ref = torch.randn(40, 16, generator=gen).to(dtype)
    x_ours = x_ref.clone()
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(40, 16, generator=gen)
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        x_ours = ours.step(i, v, x_ours)
        assert torch.equal(x_ours, x_ref)
    assert x_ours.dtype == dtype


def test_custom_sigmas_verbatim():
    s = custom_sigmas([1.0, 0.75, 0.5, 0.0])
    ref = MiniMaxH3Scheduler()
    ref.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.0])
    assert torch.equal(s, ref.sigmas)


@pytest.mark.parametrize("call,message", [
    (lambda: sigmas(1, 12.0), "steps must be at least 2"),
    (lambda: sigmas(10, 0.0), "shift must be a positive finite number, got 0.0"),
    (lambda: sigmas(10, float("nan")), "shift must be a positive finite number, got nan"),
    (lambda: sigmas(10, float("inf")), "shift must be a positive finite number, got inf"),
    (lambda: custom_sigmas([3.0, 1.0, 0.0]), r"sigmas must lie in \[0, 1\], got 3 first"),
    (lambda: custom_sigmas([1.0, 1.0, 0.0]), "strictly decreasing"),
    (lambda: custom_sigmas([1.0, 0.5]), "ending at 0"),
    (lambda: Schedule.shifted(5, 3.0).step(4, torch.randn(2), torch.randn(2)), "outside a 4-step schedule"),
])
def test_schedule_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()
