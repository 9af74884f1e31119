"""The samplers (euler, res_multistep) and schedulers (h3, simple, beta, normal) against ComfyUI and by hand.

ComfyUI oracle (skipped without COMFYUI_DIR, a ComfyUI checkout such as 0.3.64): `comfy.samplers` imports
ComfyUI's model management and `comfy.k_diffusion.sampling` needs torchsde, so the test reads just the functions
it compares with out of those files' source (ast) into a namespace of torch, math, numpy, scipy and tqdm:
simple_scheduler, normal_scheduler, beta_scheduler, ModelSamplingDiscreteFlow (its 1000-entry flow table),
sample_euler and sample_res_multistep. ComfyUI 0.3.64 has no H3 model; the stand-in below carries the audio the
way Comfy-Org/ComfyUI's H3 model does (solvers.py's docstring: the carried audio y = (sigma_v / sigma_a) x_a is a
flow latent on the video sigmas whose denoised is audio_scale * x0_a; the end divides by audio_scale).

Tolerances (fp32 on both sides, different operation orders): sigmas 1e-6 relative (measured <= 1.8e-7 over
every case); trajectories 5e-6 relative L2 of each stream's final latents (measured <= 1.1e-6; the linear
stand-in amplifies rounding over 20 steps). Carrying the audio with the wrong scale (1 instead of 4) misses
ComfyUI's audio by 0.6 to 1.0 relative, so the comparison does see the carry.
"""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.pipeline.generation import GenerationRequest, schedule_of
from h3_spark.h3_model.pipeline.scheduler import (JointSchedule, Schedule, reshift, scheduler_sigmas, sigma_table,
                                                  sigmas)
from h3_spark.h3_model.pipeline.solvers import Euler, ResMultistep, make_solver

SHIFTS = (12.0, 10.0, 3.0)
EVALUATIONS = (4, 8, 20, 30)


# ------------------------------------------------------------------------------------------ a model stand-in
class LinearModel:
    """A fixed random linear velocity per stream, v = W x + t b (data-ward, as the DiT predicts), W small so the
    flow stays tame."""

    def __init__(self, rows: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w = (torch.randn(rows, rows, generator=g, dtype=torch.float64) * (0.4 / math.sqrt(rows)))
        self.b = torch.randn(rows, generator=g, dtype=torch.float64)

    def __call__(self, x: torch.Tensor, t: float) -> torch.Tensor:
        return (self.w.to(x.dtype) @ x.reshape(-1) + t * self.b.to(x.dtype)).reshape(x.shape)


VIDEO_ROWS, AUDIO_ROWS = 24, 10


def _models():
    return LinearModel(VIDEO_ROWS, 1), LinearModel(AUDIO_ROWS, 2)


def _noise(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(VIDEO_ROWS, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(AUDIO_ROWS, generator=g, dtype=torch.float64).to(dtype))


def run_ours(sampler: str, schedule: JointSchedule, dtype=torch.float32):
    """Our solver over the stand-in, each stream at the timestep it sees (1 - its sigma)."""
    video_model, audio_model = _models()
    video, audio = _noise(dtype)
    solver = make_solver(sampler, schedule)
    for i in range(len(schedule)):
        tv, ta = schedule.step_timesteps(i)
        video, audio = solver.step(i, video_model(video, tv), video, audio_model(audio, ta), audio)
    return video, audio


# ------------------------------------------------------------------------------------------ always: by hand
def test_two_res_multistep_steps_by_hand_in_fp64():
    """Step 0 (Euler) and step 1 (second order) of video and audio, worked out in fp64 from the definitions: the
    video by the exponential multistep formula, the audio by carrying it (y = (sigma_v / sigma_a) x_a, denoised
    k * x0_a) through the video's step and back, k = 12 / 3."""
    schedule = JointSchedule.from_scheduler("simple", 4, 12.0, 3.0)  # 3 evaluations
    sv, sa, k = schedule.video.sigmas.double(), schedule.audio.sigmas.double(), 12.0 / 3.0
    video_model, audio_model = _models()
    xv, xa = _noise(torch.float64)
    ours_v, ours_a = xv.float(), xa.float()
    solver = ResMultistep(schedule)
    x0_prev = None
    for i in range(2):
        tv, ta = (1 - schedule.video.sigmas[i]).double(), (1 - schedule.audio.sigmas[i]).double()
        vv, va = video_model(xv, float(tv)), audio_model(xa, float(ta))
        x0v, x0a = xv + (1 - tv) * vv, xa + (1 - ta) * va
        y, dy = xa * sv[i] / sa[i], k * x0a  # the carried audio and its denoised
        if i == 0:  # Euler: x + (sigma' - sigma) (x - x0) / sigma
            xv_next = xv + (sv[1] - sv[0]) * (xv - x0v) / sv[0]
            y_next = y + (sv[1] - sv[0]) * (y - dy) / sv[0]
        else:
            lam = [-math.log(float(s)) for s in sv[:3]]
            h = lam[2] - lam[1]
            c2 = (lam[0] - lam[1]) / h
            phi1 = (math.exp(-h) - 1) / -h
            phi2 = (phi1 - 1) / -h
            b1, b2 = phi1 - phi2 / c2, phi2 / c2
            xv_next = math.exp(-h) * xv + h * (b1 * x0v + b2 * x0_prev[0])
            y_next = math.exp(-h) * y + h * (b1 * dy + b2 * k * x0_prev[1])
        xa_next = y_next * sa[i + 1] / sv[i + 1]
        x0_prev = (x0v, x0a)
        ours_v, ours_a = solver.step(i, video_model(ours_v, float(schedule.video.timesteps[i])), ours_v,
                                     audio_model(ours_a, float(schedule.audio.timesteps[i])), ours_a)
        xv, xa = xv_next, xa_next
        # fp32 against fp64: the step's own rounding, ~1e-7 relative.
        assert _rel(ours_v, xv) < 2e-6 and _rel(ours_a, xa) < 2e-6, i


@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
@pytest.mark.parametrize("scheduler", ["h3", "simple", "beta", "normal"])
def test_a_constant_clean_estimate_is_followed_exactly(sampler, scheduler):
    """x0 the same at every step (v = x0 - noise along the straight path): both samplers land on the straight path
    x = (1 - sigma) x0 + sigma noise in each stream, on its own sigmas. A wrong audio scale in the carry breaks
    this for res_multistep's audio."""
    schedule = JointSchedule.from_scheduler(scheduler, 9, 12.0, 3.0)
    g = torch.Generator().manual_seed(3)
    x0 = (torch.randn(16, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64))
    noise = (torch.randn(16, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64))
    x = list(noise)
    solver = make_solver(sampler, schedule)
    for i in range(len(schedule)):
        velocity = [(x0[s] - x[s]) / sigma for s, sigma in enumerate(_sigma_seen(schedule, i))]
        x = list(solver.step(i, velocity[0], x[0], velocity[1], x[1]))
        for s, stream in enumerate((schedule.video, schedule.audio)):
            sigma = float(stream.sigmas[i + 1])
            assert _rel(x[s], (1 - sigma) * x0[s] + sigma * noise[s]) < 1e-5, (i, s)


def _sigma_seen(schedule, i):
    return float(schedule.video.sigmas[i]), float(schedule.audio.sigmas[i])


def test_res_multistep_starts_with_eulers_step_bit_for_bit():
    schedule = JointSchedule.from_scheduler("simple", 9, 10.0, 3.0)
    video_model, audio_model = _models()
    video, audio = _noise()
    tv, ta = schedule.step_timesteps(0)
    args = (0, video_model(video, tv), video, audio_model(audio, ta), audio)
    euler, res = Euler(schedule).step(*args), ResMultistep(schedule).step(*args)
    assert torch.equal(euler[0], res[0]) and torch.equal(euler[1], res[1])


def test_table_schedulers_land_on_the_table():
    """simple at 8 evaluations takes the table's every 125th entry from the top: 1, shift(0.875), ..., then 0;
    audio follows the video at the audio shift."""
    video = scheduler_sigmas("simple", 8, 10.0)
    base = torch.arange(8, 0, -1, dtype=torch.float64) / 8
    assert torch.allclose(video[:-1].double(), 10 * base / (1 + 9 * base), rtol=1e-6) and video[-1] == 0
    assert torch.equal(video[:-1], sigma_table(10.0)[[999 - 125 * i for i in range(8)]])
    joint = JointSchedule.from_scheduler("simple", 9, 10.0, 3.0)
    assert torch.allclose(joint.audio.sigmas[:-1].double(), 3 * base / (1 + 2 * base), rtol=1e-6)
    assert joint.audio.sigmas[-1] == 0 and joint.audio_scale == pytest.approx(10 / 3)
    beta = scheduler_sigmas("beta", 8, 12.0)
    assert beta[0] == 1.0 and beta[-1] == 0 and bool((beta[1:] < beta[:-1]).all())


def test_h3_scheduler_is_our_grid():
    joint = JointSchedule.from_scheduler("h3", 50, 12.0, 3.0)
    assert torch.equal(joint.video.sigmas, sigmas(50, 12.0)) and torch.equal(joint.audio.sigmas, sigmas(50, 3.0))
    assert joint.audio_scale == 4.0


def test_reshift_inverts():
    s = torch.tensor([1.0, 0.9, 0.5, 0.1, 0.0], dtype=torch.float64)
    assert torch.allclose(reshift(reshift(s, 12.0, 3.0), 3.0, 12.0), s)


# ------------------------------------------------------------------------------------------ refusals
def test_unknown_names_are_refused_in_one_line():
    with pytest.raises(InputError, match=r"^unknown sampler 'dpmpp'; the samplers are euler, res_multistep$"):
        GenerationRequest(mode="t2va", prompt="a", sampler="dpmpp").validate()
    with pytest.raises(InputError, match=r"^unknown scheduler 'karras'; the schedulers are h3, simple, beta, "
                                         r"normal$"):
        GenerationRequest(mode="t2va", prompt="a", scheduler="karras").validate()


def test_a_scheduler_with_explicit_sigmas_is_refused():
    req = GenerationRequest(mode="t2va", prompt="a", scheduler="simple", sigmas=[1.0, 0.5, 0.0])
    with pytest.raises(InputError, match="scheduler simple makes a grid, and explicit sigmas are the grid"):
        req.validate()


def test_res_multistep_refuses_audio_sigmas_off_a_change_of_shift():
    req = GenerationRequest(mode="t2va", prompt="a", sampler="res_multistep", sigmas=[1.0, 0.7, 0.4, 0.0],
                            audio_sigmas=[1.0, 0.2, 0.19, 0.0])
    with pytest.raises(InputError, match="sampler res_multistep steps the audio on the video sigmas"):
        req.validate()
    # Euler steps any pair; res_multistep takes explicit sigmas that share one (the same, or shifted).
    GenerationRequest(mode="t2va", prompt="a", sigmas=[1.0, 0.7, 0.4, 0.0], audio_sigmas=[1.0, 0.2, 0.19, 0.0],
                      ).validate()
    same = schedule_of(GenerationRequest(mode="t2va", prompt="a", sampler="res_multistep", sigmas=[1.0, 0.5, 0.0]))
    assert same.audio_scale == 1.0
    base = [1.0, 0.75, 0.5, 0.25]
    shifted = schedule_of(GenerationRequest(mode="t2va", prompt="a", sampler="res_multistep",
                                            sigmas=[10 * b / (1 + 9 * b) for b in base] + [0.0],
                                            audio_sigmas=[3 * b / (1 + 2 * b) for b in base] + [0.0]))
    assert shifted.audio_scale == pytest.approx(10 / 3, rel=1e-5)


def test_schedule_of_reads_the_scheduler():
    req = GenerationRequest(mode="t2va", prompt="a", steps=9, scheduler="beta", video_shift=10.0, audio_shift=3.0)
    assert torch.equal(schedule_of(req).video.sigmas, scheduler_sigmas("beta", 8, 10.0))
    default = schedule_of(GenerationRequest(mode="t2va", prompt="a", steps=9))
    assert torch.equal(default.video.sigmas, Schedule.shifted(9, 12.0).sigmas)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------ ComfyUI as oracle
COMFY_DIR = os.environ.get("COMFYUI_DIR")
comfy = pytest.mark.skipif(not COMFY_DIR, reason="set COMFYUI_DIR (a ComfyUI checkout) to compare with ComfyUI")


def _load(relative: str, names: tuple[str, ...], namespace: dict) -> dict:
    """The named top-level functions and classes of one ComfyUI source file, executed in `namespace`."""
    path = Path(COMFY_DIR) / relative
    tree = ast.parse(path.read_text(), str(path))
    picked = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    missing = set(names) - {node.name for node in picked}
    assert not missing, f"{relative} has no {sorted(missing)}"
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def oracle() -> SimpleNamespace:
    import numpy
    import scipy.stats  # noqa: F401 - beta_scheduler reads scipy.stats
    import scipy
    from tqdm.auto import trange

    ns = {"torch": torch, "math": math, "numpy": numpy, "scipy": scipy, "trange": trange, "nn": torch.nn}
    _load("comfy/k_diffusion/utils.py", ("append_dims",), ns)
    ns["utils"] = SimpleNamespace(append_dims=ns["append_dims"])
    _load("comfy/model_sampling.py", ("time_snr_shift", "ModelSamplingDiscreteFlow"), ns)
    _load("comfy/samplers.py", ("simple_scheduler", "normal_scheduler", "beta_scheduler"), ns)
    _load("comfy/k_diffusion/sampling.py", ("to_d", "get_ancestral_step", "default_noise_sampler", "sample_euler",
                                            "res_multistep", "sample_res_multistep"), ns)
    return SimpleNamespace(**ns)


def _comfy_table(oracle, shift: float):
    sampling = oracle.ModelSamplingDiscreteFlow()
    sampling.set_parameters(shift=shift)
    return sampling


@comfy
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("evaluations", EVALUATIONS)
@pytest.mark.parametrize("name", ["simple", "beta", "normal"])
def test_schedulers_match_comfyui(oracle, name, evaluations, shift):
    theirs = getattr(oracle, f"{name}_scheduler")(_comfy_table(oracle, shift), evaluations)
    ours = scheduler_sigmas(name, evaluations, shift)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


@comfy
def test_the_flow_table_matches_comfyui(oracle):
    for shift in SHIFTS:
        torch.testing.assert_close(sigma_table(shift), _comfy_table(oracle, shift).sigmas.float(), rtol=2e-7, atol=0)


def _comfy_run(oracle, sampler: str, video_sigmas: torch.Tensor, video_shift: float, audio_shift: float):
    """ComfyUI's sampler over the packed [video | carried audio] latent, with the stand-in as its H3 model."""
    video_model, audio_model = _models()
    scale = video_shift / audio_shift

    def model(x, sigma, **_):
        sigma_v = float(sigma[0])
        sigma_a = float(reshift(torch.tensor(sigma_v, dtype=torch.float64), video_shift, audio_shift))
        video, carried = x[0, :VIDEO_ROWS], x[0, VIDEO_ROWS:]
        audio = carried * (sigma_a / sigma_v)
        x0_video = video + sigma_v * video_model(video, 1 - sigma_v)
        x0_audio = audio + sigma_a * audio_model(audio, 1 - sigma_a)
        return torch.cat([x0_video, scale * x0_audio])[None]

    video, audio = _noise()
    x = torch.cat([video, audio])[None]  # noise at sigma 1: the carried audio is the audio's own noise
    run = oracle.sample_euler if sampler == "euler" else oracle.sample_res_multistep
    out = run(model, x, video_sigmas, disable=True)[0]
    return out[:VIDEO_ROWS], out[VIDEO_ROWS:] / scale


@comfy
@pytest.mark.parametrize("sampler", ["euler", "res_multistep"])
@pytest.mark.parametrize("name", ["simple", "beta", "normal"])
@pytest.mark.parametrize("shifts", [(12.0, 3.0), (10.0, 3.0)])
@pytest.mark.parametrize("evaluations", [8, 20])
def test_trajectories_match_comfyui(oracle, sampler, name, shifts, evaluations):
    comfy_sigmas = getattr(oracle, f"{name}_scheduler")(_comfy_table(oracle, shifts[0]), evaluations)
    theirs = _comfy_run(oracle, sampler, comfy_sigmas, *shifts)
    ours = run_ours(sampler, JointSchedule.from_scheduler(name, evaluations + 1, *shifts))
    assert _rel(ours[0], theirs[0]) < 5e-6 and _rel(ours[1], theirs[1]) < 5e-6


# ------------------------------------------------------------------------------------------ with the engine
@pytest.mark.slow
def test_res_multistep_runs_with_a_step_cache(tiny_t2va_engine):
    """A step cache hands the sampler velocities, computed or reused; res_multistep steps either: cache off is the
    plain run bit for bit, and a cache that reuses every step after the first still lands on finite latents that
    say which steps were reused."""
    import dataclasses

    from h3_spark.h3_model.pipeline.step_cache import make_step_cache

    req = GenerationRequest(mode="t2va", prompt="a fox", width=64, height=64, steps=5, seed=3,
                            sampler="res_multistep", scheduler="simple")
    plain = tiny_t2va_engine.generate(req)
    assert (plain.info["sampler"], plain.info["scheduler"], plain.info["evaluations"]) == ("res_multistep", "simple", 4)
    off = tiny_t2va_engine.generate(dataclasses.replace(req, step_cache=make_step_cache("off", evaluations=4)))
    assert torch.equal(off.video_latents, plain.video_latents) and torch.equal(off.audio_latents, plain.audio_latents)
    cache = make_step_cache("h3_cache", 10.0, 0.0, 1.0, evaluations=4)
    cached = tiny_t2va_engine.generate(dataclasses.replace(req, step_cache=cache))
    assert cached.info["step_cache"]["reused"] == [1, 2, 3]
    assert torch.isfinite(cached.video_latents).all() and not torch.equal(cached.video_latents, plain.video_latents)


@pytest.mark.slow
def test_a_films_windows_sample_with_the_requests_sampler(tiny_t2va_engine, monkeypatch):
    """Every window of a film is the request again (compose/film.py replaces its canvas, prompt and history): each
    samples with its sampler on its scheduler."""
    from h3_spark.h3_model.compose.film import Film, Shot, render_film
    from h3_spark.h3_model.compose.windows import plan_film
    from h3_spark.h3_model.pipeline.generation import Pipeline

    seen = []
    original = Pipeline.sample
    monkeypatch.setattr(Pipeline, "sample", lambda self, *a, **k: seen.append((len(a[2]), k["sampler"])) or
                        original(self, *a, **k))
    base = GenerationRequest(mode="t2va", prompt="a fox", width=64, height=64, steps=3, seed=1,
                             sampler="res_multistep", scheduler="normal")
    result = render_film(tiny_t2va_engine.generate, base, Film(plan_film([400]), [Shot("a fox", 400)], {}, None,
                                                                64, 64), on_frames=lambda frames: None)
    assert len(result.info["windows"]) == 2 and seen == [(2, "res_multistep")] * 2


def test_res_multistep_takes_fasth3_8steps_rungs():
    """The rungs recipe gives explicit video and audio sigmas, one base at two shifts: res_multistep finds their
    audio scale (10 / 3) in them."""
    from h3_spark.h3_model.engine.recipes import FASTH3_GRIDS

    grid = FASTH3_GRIDS["fasth3-8step"]
    schedule = JointSchedule.explicit(grid.sigmas(10.0), grid.sigmas(3.0))
    assert schedule.audio_scale == pytest.approx(10 / 3, rel=1e-5)
    assert isinstance(make_solver("res_multistep", schedule), ResMultistep)
