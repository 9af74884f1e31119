"""Run one job on the resident models: read its media, generate, write the mp4, classify the outcome.

With several GPUs (serve --gpus N, lockstep.py) rank 0 first sends the job's message to the other
ranks; every rank then builds the same request with `prepare_job` and runs the same generation.

Out-of-memory (torch.cuda.OutOfMemoryError, MemoryError) fails the job and then frees what the failed
job held (the exception's frames keep its tensors alive, so the cache is emptied only after the
exception is gone); the models stay resident and the next job runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import traceback
from typing import Callable

import torch

from ..errors import H3Error, InputError
from ..h3_model import geometry
from ..h3_model.engine.engine import Engine
from ..h3_model.engine.job_attention import AttentionChoice
from ..h3_model.media import files as media
from ..h3_model.media.refs import load_reference
from ..h3_model.pipeline.checks import check_request
from ..h3_model.pipeline.generation import GenerationRequest, Progress
from ..h3_model.pipeline.sampler import Cancelled
from ..h3_model.pipeline.step_cache import make_step_cache
from ..kernels.dispatch import attention_counts, exactness
from .jobs import Job
from .logs import make_log
from .lockstep import Leader, Lockstep, LockstepCancel, fingerprint
from .outputs import OutputFolder
from .validation import Limits


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def job_message(job: Job, *, mlp_chunks: int, vae_tile_size: int | None, limits: Limits) -> dict:
    """Everything a rank needs to build the job's GenerationRequest (picklable: it is broadcast)."""
    p = job.payload
    return {"id": job.id, "request": job.request, "references": list(p.get("references", [])),
            "first_frame": p.get("first_frame"), "last_frame": p.get("last_frame"),
            "guides": list(p.get("guides", [])), "continue": p.get("continue"), "repaint": p.get("repaint"),
            "mask": p.get("mask"), "control": dict(p.get("control") or {}),
            "max_film_frames": round(limits.max_film_seconds * geometry.FPS),
            "mlp_chunks": mlp_chunks,
            "vae_tile_size": vae_tile_size, "max_image_pixels": limits.max_image_pixels,
            "max_video_frame_pixels": limits.max_video_frame_pixels}


def _read_inputs(message: dict) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
    """References and keyframes, decoded no further than the job uses and refused past the pixel limits."""
    frames = geometry.snap_frames(message["request"].frames)
    refs = [load_reference(kind, path, frames=frames,
                           max_pixels=message["max_video_frame_pixels" if kind == "video" else "max_image_pixels"])
            for kind, path in message["references"]]
    first, last = (media.read_image(message[k], max_pixels=message["max_image_pixels"]) if message[k] else None
                   for k in ("first_frame", "last_frame"))
    return refs, first, last


def _read_guides(message: dict, frames: int) -> list:
    """The job's guides read from their files, decoded no further than the clip (a sound a second further: what
    runs past the clip's end is cropped once encoded, as ComfyUI crops it, and noted)."""
    from ..h3_model.compose.guides import Guide

    guides = []
    for kind, path, frame in message.get("guides", []):
        if kind == "image":
            guides.append(Guide("image", frame, image=media.read_image(path, max_pixels=message["max_image_pixels"])))
        elif kind == "clip":
            clip = media.read_video(path, fps=geometry.FPS, max_frames=frames, with_audio=False,
                                    max_pixels=message["max_video_frame_pixels"])
            guides.append(Guide("clip", frame, clip=clip.frames))
        else:
            sound = media.read_audio_clip(path, max_seconds=frames / geometry.FPS + 1.0)
            guides.append(Guide("audio", frame, audio=sound.audio, sample_rate=sound.sample_rate))
    return guides


def _read_repaint(message: dict):
    """(Source, NoiseMask) of a repaint job, or (None, None): its clip (no more than one generation's frames) and
    what to make anew."""
    from ..h3_model.compose.masks import Source, repaint_mask
    from ..h3_model.compose.windows import MAX_WINDOW_FRAMES

    if not message.get("repaint"):
        return None, None
    req = message["request"]
    clip = media.read_video(message["repaint"], fps=geometry.FPS, max_frames=MAX_WINDOW_FRAMES,
                            max_pixels=message["max_video_frame_pixels"], sample_rate=geometry.AUDIO_SAMPLE_RATE)
    frames, height, width = (int(n) for n in clip.frames.shape[:3])
    region = None
    if message.get("mask"):
        region = media.read_image(message["mask"], max_pixels=message["max_image_pixels"])
    return Source(clip.frames, clip.audio), repaint_mask(frames, height, width, region, req.regenerate_seconds,
                                                         f"the mask {req.mask!r}")


def _read_control(message: dict):
    """The job's ControlRequest (its videos decoded no further than the clip), or None."""
    req = message["request"]
    if req.control is None:
        return None
    from ..h3_model.controlnet.hint import ControlRequest

    files, frames = message.get("control") or {}, geometry.snap_frames(req.frames)

    def video(key):
        if key not in files:
            return None
        return media.read_video(files[key], fps=geometry.FPS, max_frames=frames, with_audio=False,
                                max_pixels=message["max_video_frame_pixels"]).frames

    mask = None
    if "inpaint_mask" in files:
        path = files["inpaint_mask"]
        pixels = (media.read_image(path, max_pixels=message["max_image_pixels"])
                  if path.suffix.lower() in media.IMAGE_SUFFIXES else video("inpaint_mask"))
        mask = pixels.float().mean(-1) / 255.0
    c = req.control
    return ControlRequest(video=video("video"), mask=mask, source=video("inpaint_source"), strength=c["strength"],
                          start=c["range"][0], end=c["range"][1])


def read_continued(message: dict):
    """The clip a film job goes on from (at most the service's longest film), or None: the frames the film is
    conditioned on and its sound; the frames before them are read again as the output is written."""
    from ..h3_model.compose.film import ContinuedClip
    from ..h3_model.compose.windows import DEFAULT_HISTORY_FRAMES

    if not message.get("continue"):
        return None
    tail = media.read_video_tail(message["continue"], DEFAULT_HISTORY_FRAMES + 1, fps=geometry.FPS,
                                 max_frames=message["max_film_frames"], max_pixels=message["max_video_frame_pixels"],
                                 sample_rate=geometry.AUDIO_SAMPLE_RATE)
    return ContinuedClip.from_tail(tail)


def build_generation(message: dict) -> GenerationRequest:
    """The job's GenerationRequest, its inputs read and its step cache made; the same on every rank."""
    req = message["request"]
    references, first, last = _read_inputs(message)
    generation = GenerationRequest(
        mode=req.mode, prompt=req.prompt, references=references, first_frame=first, last_frame=last,
        width=req.width, height=req.height, frames=req.frames, steps=req.steps, seed=req.seed,
        mlp_chunks=message["mlp_chunks"], vae_tile_size=message["vae_tile_size"],
        guides=_read_guides(message, geometry.snap_frames(req.frames)), guide_strength=req.guide_strength,
        audio_guide_strength=req.audio_guide_strength, decoder=req.decoder, sampler=req.sampler,
        scheduler=req.scheduler, control=_read_control(message), **dict(zip(("source", "mask"), _read_repaint(message))))
    if not req.is_film:  # a film's guides are checked by window, once it is planned (generate_job)
        check_request(generation)
    if req.cache.mode != "off":
        c = req.cache
        generation.step_cache = make_step_cache(c.mode, c.threshold, c.start_percent, c.end_percent,
                                                c.subsample_factor, evaluations=req.evaluations)
    return generation


def generate_job(models: Engine, generation: GenerationRequest, req, *, progress=None, cancel=None,
                 on_frames=None, on_window=None, continued=None):
    """One generation, or a film's windows one after another (compose/), after the clip it `continued` (at that
    clip's canvas): the result holds the audio, and for a film no frames (they went to `on_frames`) but its
    windows in `info`."""
    if not req.is_film:
        return models.generate(generation, on_progress=progress, cancel=cancel, on_frames=on_frames)
    from ..h3_model.compose.film import Shot, plan_request, render_film

    film = plan_request([Shot(prompt, frames) for frames, prompt in req.shots], generation.guides,
                        width=generation.width, height=generation.height, continued=continued)
    base = dataclasses.replace(generation, width=film.width, height=film.height, guides=[], step_cache=None)
    notes = check_request(base, film)  # before the first window, not at the window that holds a bad guide
    c = req.cache
    fresh = None if c.mode == "off" else (lambda: make_step_cache(c.mode, c.threshold, c.start_percent, c.end_percent,
                                                                  c.subsample_factor, evaluations=req.evaluations))
    result = render_film(lambda r: models.generate(r, on_progress=progress, cancel=cancel), base, film,
                         on_frames=on_frames or (lambda frames: None), fresh_step_cache=fresh, on_window=on_window)
    if notes:
        result.info["notes"] = notes
    return result


def dit_key(mode: str) -> str:
    return "dit_ref" if mode == "ref2va" else "dit"


def prepare_job(models: Engine, message: dict, lockstep: Lockstep | None, stack: contextlib.ExitStack,
                attention: AttentionChoice | None = None) -> tuple[GenerationRequest, dict]:
    """Build the request and switch to the job's attention backend (switched back when `stack` closes):
    `attention`, resolved when the job was accepted, or (the other ranks) the request's, resolved here.

    Under lockstep every rank then agrees before generating: if any rank failed here, or read other
    bytes, every rank raises, so none enters a collective that the others skip.
    """
    req = message["request"]
    error, generation, used = None, None, None
    try:
        generation = build_generation(message)
        choice = attention if attention is not None else req.attention
        used = stack.enter_context(models.job_attention(dit_key(req.mode), choice))
        if req.recipes:
            from ..h3_model.engine.recipes import apply_recipes

            # After the switch: the sparse recipe stays dense with the job's own attention.
            generation = apply_recipes(req.recipes, generation, getattr(models.components, dit_key(req.mode)),
                                       models.device, models.settings)
    except Exception as exc:  # noqa: BLE001 - re-raised below (by agree under lockstep)
        if lockstep is None:
            raise
        error = exc
    if lockstep is not None:
        lockstep.agree(error, None if error else fingerprint(generation), f"prepare job {message['id']}")
    return generation, used


class JobRunner:
    def __init__(self, models: Engine, outputs: OutputFolder,
                 log: Callable[[str], None] = lambda message: None, *, vae_tile_size: int | None = 256,
                 mlp_chunks: int = 1, leader: Leader | None = None, limits: Limits | None = None):
        self.models, self.outputs, self.log = models, outputs, log
        self.vae_tile_size, self.mlp_chunks = vae_tile_size, mlp_chunks
        self.limits = limits or Limits()
        self.leader = leader  # several GPUs: rank 0's side of lockstep.py

    def __call__(self, job: Job) -> tuple[str, str | None]:
        out_of_memory = None
        try:
            self._run(job)
            return "done", None
        except Cancelled as exc:
            return "cancelled", str(exc)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            out_of_memory = f"out of memory during {job.progress.get('stage', '?')}: {type(exc).__name__}: {exc}"
        except H3Error as exc:
            return "failed", str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug, but one job's bug must not stop the service
            self.log("job %s failed:\n%s" % (job.id, traceback.format_exc()))
            return "failed", f"internal error: {type(exc).__name__}: {exc}"
        # Outside the except block: the exception and its frames (holding the job's tensors) are gone.
        free_memory()
        self.log(f"job {job.id}: {out_of_memory}; memory freed, the service goes on")
        return "failed", out_of_memory

    def _run(self, job: Job) -> None:
        message = job_message(job, mlp_chunks=self.mlp_chunks, vae_tile_size=self.vae_tile_size, limits=self.limits)
        if self.leader is None:
            return self._generate_and_write(job, message, None)
        # The whole job under the leader's lock: its messages and collectives keep one order on every rank.
        with self.leader.lock:
            if self.leader.closed:
                raise H3Error("the service is shutting down")
            self.leader.lockstep.send(message)
            return self._generate_and_write(job, message, self.leader.lockstep)

    def _generate_and_write(self, job: Job, message: dict, lockstep: Lockstep | None) -> None:
        req = job.request
        t0 = time.perf_counter()
        job.progress = {"stage": "read_inputs", "step": 0, "total": 0}

        def progress(p: Progress) -> None:
            job.progress = {"stage": p.stage, "step": p.step, "total": p.total}
            if p.latents is not None:
                # The latents only (one small host copy a step); the picture is made when someone asks for it.
                job.preview_latents = p.latents()

        key = dit_key(req.mode)
        with contextlib.ExitStack() as stack:
            generation, used = prepare_job(self.models, message, lockstep, stack, job.payload.get("attention"))
            read_inputs = time.perf_counter() - t0
            kernels = self.models.kernel_reports[key]
            job.backends = {**used, "linear": kernels["linear"], "modulation": kernels["modulation"]}
            cancel = job.cancel if lockstep is None else LockstepCancel(job.cancel)
            # Frames are encoded while later windows decode; "mux" is what is left after the decode.
            stream = stack.enter_context(self.outputs.mp4_stream(job.payload["output_path"], job.id,
                                                                 overwrite=req.overwrite))
            dit = getattr(self.models.components, key)
            calls_before = attention_counts(dit)
            result = generate_job(self.models, generation, req, progress=progress, cancel=cancel,
                                  on_frames=stream.add, continued=read_continued(message), on_window=lambda w, entry: self.log(
                                      f"job {job.id}: window {w.index + 1} kept film frames {entry['film_frames'][0]}.."
                                      f"{entry['film_frames'][1]} in {entry['seconds']:.2f} s"))
            # This job's share of the backend's counters (calls it ran on a fallback kernel, ...).
            job.backends["attention"] = {**job.backends["attention"],
                                         **{k: v - calls_before.get(k, 0) for k, v in attention_counts(dit).items()}}
            # The decode does not stop midway; a cancel that came during it still keeps the file unpublished.
            # Rank 0's own flag: only this rank writes, and a collective here would have no partner.
            if job.cancel.is_set():
                raise Cancelled("cancelled while decoding; no output was written")
            job.progress = {"stage": "write_output", "step": 0, "total": 0}
            t1 = time.perf_counter()
            stream.finish(result.audio)
            mux = time.perf_counter() - t1
        path = job.payload["output_path"]
        cache = generation.step_cache
        if req.is_film:  # its windows' own timings are in info["windows"]
            timings = {"read_inputs": read_inputs, "film": time.perf_counter() - t0 - read_inputs - mux, "mux": mux}
            info = {"width": result.info["width"], "height": result.info["height"], "frames": result.frames,
                    "audio_samples": int(result.audio.shape[1]), "windows": result.info["windows"],
                    "decoder": req.decoder, **({"notes": result.info["notes"]} if "notes" in result.info else {})}
        else:
            timings = {"read_inputs": read_inputs, **result.timings, "mux": mux}
            info = {k: v for k, v in result.info.items() if k not in ("step_cache", "step_seconds")}
            info["step_seconds"] = [round(s, 4) for s in result.info.get("step_seconds", [])]
        # Everything that is not the exact path, as apply_kernels reports it, plus this job's own choices.
        reused = cache is not None and (cache.reused or req.is_film)  # a film's windows had caches of their own
        job.backends.update(exactness(job.backends, (["step_cache"] if reused else [])
                                      + [f"recipe {r['name']}" for r in generation.recipes]
                                      + (["decoder taeh3"] if req.decoder == "taeh3" else [])))
        job.step_cache = result.info.get("step_cache", {"mode": req.cache.mode} if req.is_film else {"mode": "off"})
        job.timings, job.info, job.output = timings, info, str(path)
        job.progress = {"stage": "done", "step": 0, "total": 0}
        self.log(f"[perf] job {job.id} mode={req.mode} {info.get('width')}x{info.get('height')}x{info.get('frames')} "
                 f"steps={req.steps} attention={job.backends['attention'].get('backend')} "
                 f"linear={kernels['linear']['format']} cache={req.cache.mode} "
                 + " ".join(f"{k}={v:.2f}s" for k, v in timings.items()))


stderr_log = make_log("text")
