"""The denoising loop: one DiT forward per step over the packed sequence, the sampler's step (solvers.py: euler,
the default, or res_multistep) on the target rows.

Noise is drawn from the request's generator in a fixed, documented order, so a seed reproduces
a generation exactly:
  1. one draw per visual condition (keyframe or image/video reference), in packed order, shaped
     like its latent; the condition is mixed with it at t = 0.999 and held there;
  2. the target video noise as a (1, C, T, H/16, W/16) fp32 tensor, then patchified;
  3. the target audio noise directly in row layout (2 * T_audio, C_audio), channel-major.
Conditioning rows (visual at 0.999, reference audio clean) are never updated. Target rows a noise mask keeps
(the layout's `held_video` / `held_audio`) are held the same way at the given clip's latents, mixed with their
own target noise (no extra draw), and come out as those latents exactly.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import H3Error, InputError
from ..dit.layout import Layout, patchify, unpatchify
from .scheduler import CONDITION_AUDIO_T, CONDITION_VIDEO_T, JointSchedule
from .solvers import DEFAULT_SAMPLER, make_solver


class Cancelled(H3Error):
    """The caller cancelled the generation."""


@dataclass
class SamplingRequest:
    layout: Layout
    prompt_embeds: torch.Tensor  # (1, L, text_dim), any dtype
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    # Normalised VAE latents of the visual conditions, packed order, each (1, C, F, h, w).
    condition_latents: list[torch.Tensor] = field(default_factory=list)
    # Normalised audio rows of the references (each (2 * T, C_audio), channel-major), packed order.
    audio_condition_rows: list[torch.Tensor] = field(default_factory=list)
    # Noise masks: the given clip's target rows (patchified video latents, audio rows), read where the layout
    # holds rows.
    source_video_rows: torch.Tensor | None = None
    source_audio_rows: torch.Tensor | None = None
    # The level visual conditions (keyframes, guides, references, a history, kept rows) are held at: 0.999 as
    # released; lower mixes in more noise and loosens their hold (ComfyUI's minimax_visual_cond_noise_aug).
    condition_video_t: float = CONDITION_VIDEO_T
    # The level audio conditions (guides, references, a history's sound, kept rows) are held at: 1.0 (clean) as
    # released; lower mixes in noise drawn from the seed + 1 stream (ComfyUI's minimax_audio_cond_noise_aug).
    condition_audio_t: float = CONDITION_AUDIO_T


@dataclass
class StepInfo:
    index: int
    total: int
    t_video: float
    t_audio: float
    seconds: float
    # The video rows' clean-latent estimate after this step (x - sigma * v), computed only when called: what a
    # live preview shows.
    denoised: Callable[[], torch.Tensor] | None = None


@dataclass
class SamplingResult:
    video_latents: torch.Tensor  # (1, C, T, h, w) fp32, normalised
    audio_latents: torch.Tensor  # (2, C_audio, T_audio) fp32, normalised
    step_seconds: list[float]


def condition_rows(conditions: list[torch.Tensor], generator: torch.Generator, patch,
                   level: float = CONDITION_VIDEO_T) -> torch.Tensor | None:
    """Noise each visual condition to t = `level` (0.999) with its own draw and patchify it."""
    rows = []
    for cond in conditions:
        noise = torch.randn(cond.shape, generator=generator, dtype=torch.float32)
        t = torch.tensor(level, dtype=torch.float32)
        rows.append(patchify(t * cond.float().cpu() + (1.0 - t) * noise, patch))
    return torch.cat(rows) if rows else None


def audio_condition_rows(rows: list[torch.Tensor], generator: torch.Generator, level: float) -> list[torch.Tensor]:
    """The audio conditions at t = `level`: as given at 1.0, else mixed with noise from a stream of their own
    (the sampling seed + 1), so the video's draws are the same whatever the audio's level."""
    if level >= 1.0 or not rows:
        return rows
    audio_generator = torch.Generator().manual_seed(generator.initial_seed() + 1)
    t = torch.tensor(level, dtype=torch.float32)
    return [t * r.float().cpu() + (1.0 - t) * torch.randn(r.shape, generator=audio_generator, dtype=torch.float32)
            for r in rows]


def initial_noise(req: SamplingRequest, generator: torch.Generator, video_channels: int, audio_channels: int,
                  patch) -> tuple[torch.Tensor, torch.Tensor]:
    video = torch.randn((1, video_channels, req.latent_frames, req.latent_height, req.latent_width),
                        generator=generator, dtype=torch.float32)
    audio = torch.randn((2 * req.audio_latents, audio_channels), generator=generator, dtype=torch.float32)
    return patchify(video, patch), audio


def schedule_timestep_values(layout: Layout, schedule: JointSchedule, condition_video_t: float = CONDITION_VIDEO_T,
                             condition_audio_t: float = CONDITION_AUDIO_T) -> set[float]:
    """Every distinct timestep any step of this schedule feeds the model (for AdaLN precompute)."""
    values: set[float] = set()
    for i in range(len(schedule)):
        tv, ta = schedule.step_timesteps(i)
        values.update(layout.row_timesteps(tv, ta, max(tv, condition_video_t), max(ta, condition_audio_t))[0].tolist())
    return values


@torch.no_grad()
def sample(dit, req: SamplingRequest, schedule: JointSchedule, generator: torch.Generator, *,
           device: str | torch.device = "cpu", on_step: Callable[[StepInfo], None] | None = None,
           cancel: threading.Event | None = None, mlp_chunks: int = 1, step_cache=None,
           release_adaln: bool = False, attention_schedule=None, head_schedule=None,
           sampler: str = DEFAULT_SAMPLER) -> SamplingResult:
    """Run the loop; `generator` must be a CPU generator (noise is drawn on the CPU, then moved). `sampler`: the
    step rule (solvers.SAMPLERS).

    `attention_schedule` (`at(step, block) -> attention`) chooses the attention per evaluation and block for
    this run only (a recipe's sparse attention). `head_schedule` (`mixes(schedule) -> [HeadMix]`, recipe pdd's
    pdd.PddHeads) gives each evaluation its mix of the DiT's head bank; a DiT with a bank samples only with one."""
    head_mixes = _head_mixes(dit, head_schedule, schedule)
    solver = make_solver(sampler, schedule)  # refused before any noise is drawn
    if hasattr(attention_schedule, "for_layout"):
        # An attention that tiles the packed sequence (recipe fasth3's VSA) is made for this request's layout.
        attention_schedule = attention_schedule.for_layout(req.layout, (req.latent_frames, req.latent_height,
                                                                        req.latent_width))
    previous = getattr(dit, "attention_schedule", None)
    if attention_schedule is not None:
        dit.attention_schedule = attention_schedule  # set on the model itself: the forward reads it there
    try:
        return _sample(dit, req, schedule, generator, device, on_step, cancel, mlp_chunks, step_cache, release_adaln,
                       head_mixes, solver)
    finally:
        if attention_schedule is not None:
            dit.attention_schedule, dit.sampling_step = previous, None


def _head_mixes(dit, head_schedule, schedule: JointSchedule) -> list | None:
    """Each step's head mix, or None for the DiT's own heads; a bank and a schedule come together or not at all."""
    bank = getattr(dit, "head_bank", None)
    if head_schedule is None:
        if bank is not None:
            # The PDD trunk with the plain heads samples noise: fail instead of handing it back.
            raise InputError(f"the DiT carries a PDD head bank ({bank.origin or 'from a LoRA'}): sample it with "
                             "recipe pdd, or load it without that LoRA")
        return None
    if bank is None:
        raise InputError("recipe pdd samples with a PDD LoRA's head bank, and the DiT has none: load the PDD file "
                         "as a LoRA")
    if head_schedule.count != bank.count:
        raise H3Error(f"the head schedule is for {head_schedule.count} heads but the DiT's bank holds {bank.count}")
    return head_schedule.mixes(schedule)


def _sample(dit, req, schedule, generator, device, on_step, cancel, mlp_chunks, step_cache,
            release_adaln, head_mixes=None, solver=None) -> SamplingResult:
    solver = solver if solver is not None else make_solver(DEFAULT_SAMPLER, schedule)
    c = dit.config
    lay = req.layout
    cond = condition_rows(req.condition_latents, generator, c.patch_size, req.condition_video_t)
    video_noise, audio_noise = initial_noise(req, generator, c.in_channels, c.audio_in_channels, c.patch_size)
    held_v, held_a = _held(lay, req, video_noise, audio_noise)
    n_cv, n_ca = lay.num_condition_video_rows, lay.num_condition_audio_rows
    video = torch.cat([cond, video_noise]) if cond is not None else video_noise
    audio_conditions = audio_condition_rows(req.audio_condition_rows, generator, req.condition_audio_t)
    audio = torch.cat(audio_conditions + [audio_noise]) if audio_conditions else audio_noise
    if video.shape[0] != lay.video_indices.numel() or audio.shape[0] != lay.audio_indices.numel():
        raise H3Error(
            f"the layout reserves {lay.video_indices.numel()} video and {lay.audio_indices.numel()} audio rows but the "
            f"conditions and target give {video.shape[0]} and {audio.shape[0]}: canvas and conditioning disagree"
        )
    video, audio = video.to(device), audio.float().to(device)
    held_v = None if held_v is None else held_v.to(device)
    held_a = None if held_a is None else held_a.to(device)
    structure = {k: getattr(lay, k).to(device) for k in ("token_tags", "video_indices", "audio_indices", "text_indices")}
    position_ids = lay.position_ids.to(device)
    target_video = torch.arange(n_cv, video.shape[0], device=device)
    target_audio = torch.arange(n_ca, audio.shape[0], device=device)
    text = dit.encode_text(req.prompt_embeds.to(device), mlp_chunks)  # once: independent of t
    # AdaLN tables for every timestep of this schedule, in one batch; optionally the AdaLN weights
    # (39 % of the DiT) are then dropped, which only a one-shot generation can afford.
    if not getattr(dit, "adaln_released", False):
        # Only this schedule's tables are kept (~10 MB per timestep value at full size), so a resident model
        # serving many schedules does not accumulate them.
        dit.clear_modulation_cache()
        dit.precompute_modulation(schedule_timestep_values(lay, schedule, req.condition_video_t, req.condition_audio_t))
        if release_adaln:
            dit.release_adaln()

    step_seconds = []
    for i in range(len(schedule)):
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"cancelled before step {i + 1} of {len(schedule)}")
        start = time.perf_counter()
        tv, ta = schedule.step_timesteps(i)
        heads = {} if head_mixes is None else {"head_mix": head_mixes[i]}
        ts, tidx = lay.row_timesteps(tv, ta, max(tv, req.condition_video_t), max(ta, req.condition_audio_t))

        def forward(**extra):
            return dit(video[None], audio[None], None, ts.to(device), tidx.to(device), position_ids=position_ids,
                       text_embeds=text, output_video_rows=target_video, output_audio_rows=target_audio,
                       mlp_chunks=mlp_chunks, step_callback=_block_cancel(cancel, i, len(schedule)), **structure,
                       **heads, **extra)

        if getattr(dit, "attention_schedule", None) is not None:
            dit.sampling_step = i

        if step_cache is not None:
            v_vel, a_vel = step_cache.velocities(i, video[n_cv:], audio[n_ca:], forward)
        else:
            v_vel, a_vel = forward()
        stepped_v, stepped_a = solver.step(i, v_vel[0].float(), video[n_cv:], a_vel[0].float(), audio[n_ca:])
        if held_v is not None:
            stepped_v[held_v] = video[n_cv:][held_v]
        if held_a is not None:
            stepped_a[held_a] = audio[n_ca:][held_a]
        video[n_cv:], audio[n_ca:] = stepped_v, stepped_a
        if str(device).startswith("cuda"):
            torch.cuda.synchronize(device)
        step_seconds.append(time.perf_counter() - start)
        if on_step is not None:
            sigma_next = float(schedule.video.sigmas[i + 1])
            denoised = (lambda v=v_vel[0], s=sigma_next: video[n_cv:].float() - s * v.float())
            on_step(StepInfo(i, len(schedule), tv, ta, step_seconds[-1], denoised))

    video_rows, audio_rows = video[n_cv:].cpu(), audio[n_ca:].cpu()
    if held_v is not None:  # kept rows come out as the clip's own latents, not their 0.999 mix
        video_rows[held_v.cpu()] = req.source_video_rows.float()[held_v.cpu()]
    if held_a is not None:
        audio_rows[held_a.cpu()] = req.source_audio_rows.float()[held_a.cpu()]
    video_latents = unpatchify(video_rows, c.in_channels, req.latent_frames, req.latent_height,
                               req.latent_width, c.patch_size)
    audio_latents = audio_rows.reshape(2, req.audio_latents, c.audio_in_channels).permute(0, 2, 1).contiguous()
    return SamplingResult(video_latents.contiguous(), audio_latents, step_seconds)


def _held(lay: Layout, req: SamplingRequest, video_noise: torch.Tensor, audio_noise: torch.Tensor):
    """The noise masks' kept rows, set in the initial noise in place: the clip's latents mixed with the row's own
    noise at the conditions' levels (video 0.999, audio 1.0: clean, as released). (None, None) without masks."""
    held_v = held_a = None
    if lay.held_video is not None:
        src = _source(req.source_video_rows, video_noise, "video")
        held_v = lay.held_video
        t = torch.tensor(req.condition_video_t, dtype=torch.float32)
        video_noise[held_v] = t * src[held_v] + (1.0 - t) * video_noise[held_v]
    if lay.held_audio is not None:
        src = _source(req.source_audio_rows, audio_noise, "audio")
        held_a = lay.held_audio
        if req.condition_audio_t >= 1.0:
            audio_noise[held_a] = src[held_a]
        else:
            t = torch.tensor(req.condition_audio_t, dtype=torch.float32)
            audio_noise[held_a] = t * src[held_a] + (1.0 - t) * audio_noise[held_a]
    return held_v, held_a


def _source(rows: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
    if rows is None or tuple(rows.shape) != tuple(like.shape):
        raise H3Error(f"a {what} noise mask needs the clip's {tuple(like.shape)} target rows, got "
                      f"{None if rows is None else tuple(rows.shape)}")
    return rows.float().cpu()


def _block_cancel(cancel: threading.Event | None, step: int, total: int):
    # Checked between blocks so a cancel lands within one block (~1/50 of a step), not a whole step.
    if cancel is None:
        return None

    def check(block: int) -> None:
        if cancel.is_set():
            raise Cancelled(f"cancelled during step {step + 1} of {total} (block {block + 1})")

    return check
