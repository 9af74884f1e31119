"""The generation pipeline: prompt + references -> video frames + stereo audio.

Stages, each timed: text encode (Qwen3-VL), reference encode (video/audio VAE), sampling (DiT +
flow-matching schedule), video decode, audio decode. Muxing to mp4 is the front door's job
(media.write_mp4). Models are held by `Components` and stay resident between requests; a stage
never reloads weights. Identical references are VAE-encoded once per `Pipeline` (content hash);
identical presentations are text-encoded once (the text encoder's token-hash cache).

Noise: a request's seed drives one CPU generator; draws happen in the order sampler.py documents.
Visual conditions use their own fresh generator seeded 42 (the released recipe), so a reference
encodes to the same latents in every request.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import H3Error, InputError
from .. import geometry
from ..compose.guides import Guide, History, PreparedGuide, prepare_guides, prepare_history
from ..compose.masks import NoiseMask, Source
from ..controlnet.tower import attached
from ..dit.layout import (AudioBlock, GuideBlock, HistoryBlock, ImageBlock, Layout, VideoBlock, build_ref2va,
                          build_t2va)
from ..media.refs import PreparedReference, Reference, prepare_keyframes, prepare_references, prompt_references
from ..text.prompt import check_mentions, check_prompt
from .checks import request_canvas
from .sampler import SamplingRequest, StepInfo, sample
from .scheduler import AUDIO_SHIFT, DEFAULT_SCHEDULER, VIDEO_SHIFT, JointSchedule, check_scheduler
from .solvers import DEFAULT_SAMPLER, check_sampler

MODES = ("t2va", "fl2va", "ref2va")
# The video decoders a request may choose: the full video VAE, or TAEH3 (vae/tiny_decoder.py), a draft of the same
# frames from the tiny temporal decoder, which an engine holds only once it has loaded one (Engine.load_taeh3).
DECODERS = ("vae", "taeh3")
MAX_STEPS = 1000
DEFAULT_ENCODE_TILE = 256  # pixels; encode_condition's own default


@dataclass
class Components:
    """Resident models. `dit` runs T2VA/FL2VA, `dit_ref` runs Ref2VA (the two released partitions)."""

    text_encoder: object | None = None
    dit: object | None = None
    dit_ref: object | None = None
    vae: object | None = None
    audio_vae: object | None = None
    device: str = "cpu"
    # (video, audio) flow shifts by DiT ("dit", "dit_ref"), as the model folder gives them (model_index.json's
    # sigma_shift_scales); a DiT without an entry samples with the released 12 and 3.
    shifts: dict = field(default_factory=dict)
    # The H3 Fun ControlNet's tower (controlnet/tower.py), loaded by Engine.load_controlnet; requests with a
    # `control` need it.
    controlnet: object | None = None

    def shifts_for(self, mode: str) -> tuple[float, float]:
        return self.shifts.get("dit_ref" if mode == "ref2va" else "dit", (VIDEO_SHIFT, AUDIO_SHIFT))

    def dit_for(self, mode: str):
        model = self.dit_ref if mode == "ref2va" else self.dit
        if model is None:
            which = "the ref2va partition (transformer_ref)" if mode == "ref2va" else "the t2va/fl2va partition"
            raise H3Error(f"{mode} needs {which}, which is not loaded")
        return model


@dataclass
class GenerationRequest:
    mode: str
    prompt: str  # may be empty for fl2va and ref2va (see prompt.check_prompt)
    references: list[Reference] = field(default_factory=list)
    first_frame: torch.Tensor | None = None  # uint8 (H, W, 3), FL2VA
    last_frame: torch.Tensor | None = None
    # Stills, clips and sounds pinned at any frame (every mode; compose/guides.py), after the keyframes.
    guides: list[Guide] = field(default_factory=list)
    # What came before (a film's previous window, a continued clip; t2va): conditions the target, which goes on
    # where it ends (compose/guides.History).
    history: History | None = None
    # Noise masks (t2va): keep the parts of `source` that `mask` does not mark, make the rest anew; the source
    # sets the canvas and the length (compose/masks.py).
    source: Source | None = None
    mask: NoiseMask | None = None
    # How tightly visual conditions hold (keyframes, guides, references, a history, kept rows): the level they
    # are held at, in (0, 1]; None: 0.999 as released (pipeline/sampler.py).
    guide_strength: float | None = None
    audio_guide_strength: float | None = None
    width: int | None = None
    height: int | None = None
    # 17k+5 (124..345), or 1: a still (text to image: one latent frame, decoded by the video VAE alone).
    frames: int = geometry.DEFAULT_FRAMES
    steps: int = 50  # sigma grid points including the final 0: steps - 1 model evaluations
    seed: int = 0
    # None: the model's (Components.shifts_for: the folder's model_index.json, else 12 and 3).
    video_shift: float | None = None
    audio_shift: float | None = None
    sigmas: list[float] | None = None
    audio_sigmas: list[float] | None = None
    # The step rule (solvers.SAMPLERS) and the sigma grid (scheduler.SCHEDULERS); None: euler on our h3 grid, the
    # released pipeline's. A recipe may set them (engine/recipes.py); explicit sigmas take no scheduler.
    sampler: str | None = None
    scheduler: str | None = None
    reference_policy: str = "match"
    mlp_chunks: int = 1
    vae_tile_size: int | None = 256
    step_cache: object | None = None
    # Set by engine.recipes.apply_recipes: the sparse recipe's attention per evaluation and block, and what the
    # outputs say of the recipes used.
    attention_schedule: object | None = None
    # Set by apply_recipes for recipe pdd: each evaluation's mix of the DiT's head bank (pipeline/pdd.py).
    head_schedule: object | None = None
    recipes: list[dict] = field(default_factory=list)
    decoder: str = "vae"  # one of DECODERS
    # A control video and / or inpaint mask for the ControlNet (controlnet/hint.ControlRequest).
    control: object | None = None

    @property
    def still(self) -> bool:
        """One frame: a picture, not a clip (no soundtrack is decoded)."""
        return self.frames == geometry.STILL_FRAMES

    def _check_still(self) -> None:
        """A still is text to image: t2va with none of what places or keeps frames of a clip."""
        extras = [name for name, given in (("keyframes or references", self.mode != "t2va"),
                                           ("guides", bool(self.guides)), ("a history", self.history is not None),
                                           ("a noise mask", self.source is not None),
                                           ("decoder taeh3", self.decoder == "taeh3")) if given]
        if extras:
            raise InputError(f"a still (1 frame) is text to image, t2va only: it takes no {', '.join(extras)}")

    def _reference_counts(self) -> tuple[int, int, int]:
        """(images, videos, audio labels) as the presentation will number them (keyframes are pictures)."""
        if self.mode == "fl2va":
            return int(self.first_frame is not None) + int(self.last_frame is not None), 0, 0
        kinds = [getattr(r, "kind", None) for r in self.references]
        soundtracks = sum(1 for r in self.references if getattr(r, "kind", None) == "video"
                          and getattr(r, "audio", None) is not None)
        return kinds.count("image"), kinds.count("video"), kinds.count("audio") + soundtracks

    def _take_source_canvas(self) -> None:
        frames = self.source.frames
        if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise InputError("the clip to repaint must be uint8 (F, H, W, 3) frames")
        height, width = int(frames.shape[1]), int(frames.shape[2])
        if self.width is not None and (self.width, self.height) != (width, height):
            raise InputError(f"the clip to repaint is {width}x{height}, the request {self.width}x{self.height}: it "
                             "is repainted at its own size")
        count = int(frames.shape[0])
        if count < 124 or count > 345 or (count - geometry.VAE_LATENTS_PER_CHUNK) % geometry.VAE_FRAMES_PER_CHUNK:
            raise InputError(f"the clip to repaint has {frames.shape[0]} frames; it must be 17k+5 (124..345)")
        self.width, self.height, self.frames = width, height, int(frames.shape[0])

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.decoder not in DECODERS:
            raise InputError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.sampler is not None:
            check_sampler(self.sampler)
        if self.scheduler is not None:
            check_scheduler(self.scheduler)
        check_prompt(self.mode, self.prompt)
        if self.sigmas is None and not 2 <= self.steps <= MAX_STEPS:
            raise InputError(f"steps must be between 2 and {MAX_STEPS}, got {self.steps}")
        if self.mode == "ref2va" and not self.references:
            raise InputError("ref2va needs at least one reference")
        if self.mode != "ref2va" and self.references:
            raise InputError(f"{self.mode} takes no references; use ref2va")
        if self.mode == "fl2va" and self.first_frame is None and self.last_frame is None:
            raise InputError("fl2va needs a first and/or a last keyframe")
        if self.mode != "fl2va" and (self.first_frame is not None or self.last_frame is not None):
            raise InputError(f"{self.mode} takes no keyframes; use fl2va")
        if self.mode != "t2va" and self.history is not None:
            raise InputError(f"{self.mode} takes no history; a film's windows and a continued clip are t2va")
        if (self.source is None) != (self.mask is None):
            raise InputError("a noise mask and the clip it masks go together (source and mask)")
        if self.source is not None and self.mode != "t2va":
            raise InputError(f"{self.mode} takes no noise mask; repainting a clip is t2va")
        if self.source is not None:
            self._take_source_canvas()
        for name, level, released in (("guide strength", self.guide_strength, "0.999"),
                                      ("audio guide strength", self.audio_guide_strength, "1.0")):
            if level is not None and not (isinstance(level, (int, float)) and not isinstance(level, bool)
                                          and 0 < level <= 1):
                raise InputError(f"{name} is the level conditions are held at, in (0, 1] ({released} as released), "
                                 f"got {level!r}")
        check_mentions(self.mode, self.prompt, *self._reference_counts())
        if (self.width is None) != (self.height is None):
            raise InputError("width and height go together, or neither")
        if self.width is not None:
            geometry.check_canvas(self.width, self.height)
        geometry.snap_frames(self.frames)
        if self.still:
            self._check_still()
        if self.mlp_chunks < 1:
            raise InputError(f"mlp_chunks must be at least 1, got {self.mlp_chunks}")
        if not 0 <= self.seed < 2 ** 63:
            raise InputError(f"seed must be in [0, 2^63), got {self.seed}")
        schedule_of(self)  # now, not after the text encode that comes before its first use
        if self.control is not None:
            self.control.validate()


@dataclass
class Progress:
    stage: str
    step: int = 0
    total: int = 0
    seconds: float = 0.0
    # During sampling: the clean-video estimate after this step as (C, T, H, W) latents, computed when called
    # (previews; pipeline/preview.py).
    latents: Callable[[], torch.Tensor] | None = None


@dataclass
class GenerationResult:
    video: torch.Tensor  # uint8 (F, H, W, 3); one frame for a still
    audio: torch.Tensor  # float32 (2, samples) at 32 kHz; (2, 0) for a still (its audio stream is not decoded)
    video_latents: torch.Tensor  # normalised (1, C, T, h, w)
    audio_latents: torch.Tensor  # normalised (2, C, T_audio)
    timings: dict[str, float]
    info: dict

    @property
    def fps(self) -> int:
        return geometry.FPS

    @property
    def sample_rate(self) -> int:
        return geometry.AUDIO_SAMPLE_RATE


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key], True
        value = make()
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)
        return value, False


class Pipeline:
    def __init__(self, components: Components, *, cache_size: int = 32, offload_text_encoder: bool = False,
                 decode: bool = True, decode_group=None, release_adaln: bool = False):
        self.c = components
        # One-shot front doors may drop the AdaLN weights once the schedule's tables exist (exact; frees 39 %
        # of the DiT); a resident service must keep them for other step counts.
        self.release_adaln = release_adaln
        self.decode = decode
        # TAEH3 (vae/tiny_decoder.py), for the requests that choose decoder "taeh3" (drafts); None until loaded.
        self.taeh3 = None
        # Under sequence parallelism every rank samples in lockstep; the video decode's windows are then
        # shared out over the ranks (bit-identical to one process).
        self.decode_group = decode_group
        self._reference_cache = _LRU(cache_size)
        self._lock = threading.Lock()
        # Offloading frees the GPU for the DiT when both do not fit; resident is faster for a service.
        self.offload_text_encoder = offload_text_encoder
        # Called with (dit, packed rows, mlp_chunks) before sampling: a VRAM budget refuses what it cannot hold.
        self.memory_check: Callable | None = None
        # A context that holds a component on the device for one stage (a VRAM budget parks the VAEs in host
        # memory between their stages); by default they never move.
        self.visit: Callable = _stay

    # ------------------------------------------------------------------ public
    def clear_caches(self) -> None:
        """Forget encoded prompts and references, so the next request pays for encoding them again."""
        self._reference_cache.clear()
        te = self.c.text_encoder
        if te is not None and hasattr(te, "clear_cache"):
            te.clear_cache()

    def generate(self, req: GenerationRequest, *, on_progress: Callable[[Progress], None] | None = None,
                 cancel: threading.Event | None = None,
                 on_frames: Callable[[torch.Tensor], None] | None = None) -> GenerationResult:
        """`on_frames` receives the decoded video chunk by chunk, (n, H, W, 3) uint8 in order, while later
        chunks are still decoding (e.g. `media.Mp4Stream.add`); the result holds every frame as well."""
        req.validate()
        with self._lock:  # one GPU job at a time per pipeline
            return self._generate(req, on_progress or (lambda p: None), cancel, on_frames)

    # ------------------------------------------------------------------ the whole generation
    def _generate(self, req: GenerationRequest, report, cancel, on_frames=None) -> GenerationResult:
        timings: dict[str, float] = {}
        info: dict = {"mode": req.mode, "seed": req.seed, "decoder": req.decoder}
        dit = self.c.dit_for(req.mode)
        if self.decode and req.decoder == "taeh3":  # refused now, not at the decode after the sampling
            self._loaded_taeh3()
        if self.decode and self.c.vae is not None:  # checked here, not at the decode after the sampling
            from ..vae.video_config import DEFAULT_TILE_MIN_OVERLAP
            from ..vae.video_tiling import check_tiling

            check_tiling(req.vae_tile_size, DEFAULT_TILE_MIN_OVERLAP, self.c.vae.config.spatial_ratio)
        canvas = self.prepare(req)
        info.update(width=canvas.width, height=canvas.height, frames=canvas.frames)
        notes = [g.note for g in canvas.guides if g.note]
        if notes:  # what was taken with a change (a sound guide cropped to the clip)
            info["notes"] = notes

        t0 = time.perf_counter()
        report(Progress("text_encode"))
        text = self.encode_text(req.mode, req.prompt, canvas.keyframes, canvas.references)
        timings["text_encode"] = time.perf_counter() - t0
        info["text_tokens"], info["prompt_cache_hit"] = int(text.tags.numel()), text.cached

        t0 = time.perf_counter()
        report(Progress("reference_encode", 0, len(canvas.keyframes) + len(canvas.guides) + len(canvas.references)))
        conditions, audio_rows, blocks, hits = self.encode_conditions(canvas.keyframes, canvas.references,
                                                                      canvas.guides, canvas.history)
        timings["reference_encode"] = time.perf_counter() - t0
        info["reference_cache_hits"] = hits

        dims = self.latent_dims(canvas.frames, canvas.width, canvas.height)
        lay = build_layout(req.mode, text.tags, blocks, canvas.anchors, dims, dit.config.patch_size)
        source_rows = (None, None)
        if req.source is not None:
            lay, source_rows = self.hold(lay, req.source, req.mask, dims, dit.config.patch_size)
            info["kept_rows"] = {"video": int(lay.held_video.sum()), "audio": int(lay.held_audio.sum())}
        info["sequence_length"] = lay.sequence_length
        if self.memory_check is not None:
            self.memory_check(dit, lay.sequence_length, req.mlp_chunks)
        shifts = self.c.shifts_for(req.mode)
        schedule = schedule_of(req, shifts)
        info["evaluations"] = len(schedule)
        info["sampler"], info["scheduler"] = sampler_of(req), scheduler_of(req)
        if req.sigmas is None:
            info["video_shift"], info["audio_shift"] = _given(req.video_shift, shifts[0]), _given(req.audio_shift,
                                                                                                   shifts[1])

        control = None
        if req.control is not None:
            t0 = time.perf_counter()
            report(Progress("control_encode"))
            video_shift = shifts[0] if req.video_shift is None else req.video_shift
            control = self.control_injection(req.control, canvas, dims, dit, video_shift)
            timings["control_encode"] = time.perf_counter() - t0
            c = self.c.controlnet.config
            info["control"] = {"version": c.version, "blocks": c.blocks, "places": list(c.places),
                               "strength": control.strength, "window": list(control.window),
                               "video": req.control.video is not None, "inpaint": req.control.mask is not None}
            stream = self.c.controlnet.block_stream  # under a VRAM budget (engine/placement.place_tower)
            info["control"]["streamed_blocks"] = 0 if stream is None else len(stream.order)

        t0 = time.perf_counter()
        report(Progress("sampling", 0, len(schedule)))

        from .preview import latent_frames

        def on_step(s: StepInfo) -> None:
            latents = None
            if s.denoised is not None:
                latents = (lambda s=s: latent_frames(s.denoised(), dit.config.in_channels, *dims[:3],
                                                     dit.config.patch_size))
            report(Progress("sampling", s.index + 1, s.total, s.seconds, latents))

        # Static NVFP4 activation scales (engine/static_scales.py) cover the shapes they were calibrated on; any
        # other request runs dynamic scales, and says so.
        static = getattr(dit, "nvfp4_static_scales", None)
        scope = contextlib.nullcontext()
        if static is not None:
            scope, info["nvfp4_static_scales"] = static.for_request(req.mode, canvas.width, canvas.height,
                                                                    canvas.frames, len(schedule))
        try:
            with scope:
                sampling = SamplingRequest(lay, text.embeds, *dims, conditions, audio_rows, *source_rows)
                if req.guide_strength is not None:
                    sampling.condition_video_t = float(req.guide_strength)
                    info["guide_strength"] = float(req.guide_strength)
                if req.audio_guide_strength is not None:
                    sampling.condition_audio_t = float(req.audio_guide_strength)
                    info["audio_guide_strength"] = float(req.audio_guide_strength)
                with attached(dit, control):
                    result = self.sample(dit, sampling, schedule,
                                         req.seed, on_step=on_step, cancel=cancel, mlp_chunks=req.mlp_chunks,
                                         step_cache=req.step_cache, attention_schedule=req.attention_schedule,
                                         head_schedule=req.head_schedule, sampler=sampler_of(req))
        finally:  # read (and reset) even when cancelled, so the next request counts only its own
            saturation = static.saturation() if static is not None else None
        if static is not None:
            info["nvfp4_static_scales"].update(saturation)
        if control is not None:
            info["control"]["evaluations"] = control.evaluations
        timings["sampling"] = time.perf_counter() - t0
        info["step_seconds"] = result.step_seconds
        if req.recipes:
            info["recipes"] = list(req.recipes)
        if req.step_cache is not None and hasattr(req.step_cache, "report"):
            info["step_cache"] = req.step_cache.report()

        _check_cancel(cancel, "before decoding")
        if not self.decode:
            empty = torch.empty(0, 0, 0, 3, dtype=torch.uint8)
            return GenerationResult(empty, torch.empty(2, 0), result.video_latents, result.audio_latents, timings, info)
        t0 = time.perf_counter()
        report(Progress("video_decode"))
        video = self.decode_video(result.video_latents, req.vae_tile_size, on_frames, decoder=req.decoder)
        timings["video_decode"] = time.perf_counter() - t0
        if req.still:
            # The DiT sampled the frame's two audio latents beside it (as ComfyUI's one-frame latent has them);
            # a picture has no soundtrack, so the audio VAE is neither needed nor run.
            info["still"] = True
            return GenerationResult(video, torch.empty(2, 0), result.video_latents, result.audio_latents, timings,
                                    info)
        t0 = time.perf_counter()
        report(Progress("audio_decode"))
        audio = self.decode_audio(result.audio_latents)
        timings["audio_decode"] = time.perf_counter() - t0
        return GenerationResult(video, audio, result.video_latents, result.audio_latents, timings, info)

    # ------------------------------------------------------------------ stages, in the order they run
    def prepare(self, req: GenerationRequest) -> Canvas:
        """The canvas, the keyframes (FL2VA) and the prepared references (Ref2VA) of a request."""
        width, height, frames = request_canvas(req)
        keyframes, anchors, prepared = [], (), []
        if req.mode == "fl2va":
            keyframes, anchors, width, height = prepare_keyframes(req.first_frame, req.last_frame, width, height)
        if req.mode == "ref2va":
            prepared = prepare_references(req.references, width=width, height=height, frames=frames,
                                          policy=req.reference_policy)
        guides = prepare_guides(req.guides, frames=frames, width=width, height=height)
        history = None if req.history is None else prepare_history(req.history, width=width, height=height)
        return Canvas(width, height, frames, keyframes, tuple(anchors), prepared, guides, history)

    def encode_text(self, mode: str, prompt: str, keyframes=(), references=(), unnamed: str = "refuse") -> TextEncoding:
        """The prompt as the DiT reads it: Qwen3-VL hidden states of the mode's presentation, and token tags.
        `unnamed`: how a `<Picture i>` with no reference behind it is read (text/prompt.check_mentions)."""
        te = self._need(self.c.text_encoder, "the text encoder")
        builder = te.prompts
        if mode == "t2va":
            presentation = builder.t2va(prompt, unnamed)
        elif mode == "fl2va":
            presentation = builder.fl2va(prompt, list(keyframes), unnamed)
        else:
            presentation = builder.ref2va(prompt, prompt_references(list(references)), unnamed)
        hits = te.cache_hits
        encoded = te.encode(presentation)  # the encoder caches by token hash
        if self.offload_text_encoder:
            te.offload()
        return TextEncoding(encoded.embeds, encoded.tags, te.cache_hits > hits)

    def encode_keyframe(self, frame: torch.Tensor,
                        tile_size: int | None = DEFAULT_ENCODE_TILE) -> tuple[torch.Tensor, bool]:
        """A keyframe's conditioning latents (1, C, 1, h, w), and whether they came from the cache."""
        from ..vae.video import encode_condition

        vae = self._need(self.c.vae, "the video VAE")

        def encode():
            with self.visit(vae):
                return encode_condition(vae, frame, tile_size=tile_size)

        return self._reference_cache.get_or(
            ("keyframe", PreparedReference("image", pixels=frame).content_hash(), tile_size), encode)

    def encode_reference(self, p: PreparedReference,
                         tile_size: int | None = DEFAULT_ENCODE_TILE) -> tuple[EncodedReference, int]:
        """A prepared reference's video latents (1, C, T, h, w) and audio latents (2, C, T), each where it has
        them, and how many of the two came from the cache."""
        from ..vae.video import encode_condition

        latent = audio = None
        hits = 0
        if p.pixels is not None:
            vae = self._need(self.c.vae, "the video VAE")

            def encode_video():
                with self.visit(vae):
                    return encode_condition(vae, p.pixels, tile_size=tile_size)

            latent, hit = self._reference_cache.get_or(
                ("video", PreparedReference(p.kind, pixels=p.pixels).content_hash(), tile_size), encode_video)
            hits += hit
        if p.audio is not None:
            audio_vae = self._need(self.c.audio_vae, "the audio VAE")

            def encode_audio():
                with self.visit(audio_vae):
                    return audio_vae.encode_stereo(p.audio).float().cpu()

            audio, hit = self._reference_cache.get_or(
                ("audio", PreparedReference("audio", audio=p.audio).content_hash()), encode_audio)
            hits += hit
        return EncodedReference(p.kind, latent, audio), hits

    def encode_conditions(self, keyframes: list[torch.Tensor], prepared: list[PreparedReference],
                          guides: list[PreparedGuide] = (), history: History | None = None):
        """Visual conditions (normalised latents) and condition audio rows in packed order, plus layout blocks
        (a history's and the guides' blocks; the references' for Ref2VA)."""
        conditions, audio_rows, blocks, hits = [], [], [], 0
        if history is not None:
            encoded, hit = self.encode_reference(PreparedReference("video", pixels=history.pixels,
                                                                   audio=history.audio))
            hits += hit
            conditions.append(encoded.latent)
            audio_latents = 0
            if encoded.audio is not None:
                audio_rows.append(audio_rows_of(encoded.audio))
                audio_latents = int(encoded.audio.shape[-1])
            blocks.append(HistoryBlock(int(encoded.latent.shape[2]), audio_latents))
        for frame in keyframes:
            latent, hit = self.encode_keyframe(frame)
            conditions.append(latent)
            hits += hit
        for guide in guides:
            kind = "audio" if guide.pixels is None else "image" if guide.pixels.ndim == 3 else "video"
            encoded, hit = self.encode_reference(PreparedReference(kind, pixels=guide.pixels, audio=guide.audio))
            hits += hit
            latent_frames = audio_latents = 0
            if encoded.latent is not None:
                conditions.append(encoded.latent)
                latent_frames = int(encoded.latent.shape[2])
            if encoded.audio is not None:
                sound = guide.keep(encoded.audio)
                audio_rows.append(audio_rows_of(sound))
                audio_latents = int(sound.shape[-1])
            blocks.append(GuideBlock(guide.frame, latent_frames, audio_latents))
        for p in prepared:
            encoded, hit = self.encode_reference(p)
            hits += hit
            if encoded.latent is not None:
                conditions.append(encoded.latent)
            if encoded.audio is not None:
                audio_rows.append(audio_rows_of(encoded.audio))
            blocks.append(encoded.block())
        return conditions, audio_rows, blocks, hits

    def hold(self, lay: Layout, source: Source, mask: NoiseMask, dims, patch):
        """The layout with the noise mask's kept rows, and the clip's target rows (video, audio) they hold."""
        from ..compose import masks
        from ..dit.layout import patchify
        from ..vae.video import encode_condition

        vae = self._need(self.c.vae, "the video VAE")
        with self.visit(vae):
            latents = encode_condition(vae, source.frames, tile_size=DEFAULT_ENCODE_TILE)
        video_rows = patchify(latents.float(), patch)
        samples = dims[3] * masks.AUDIO_SAMPLES_PER_LATENT
        sound = torch.zeros(2, samples) if source.audio is None else source.audio.float()[:, :samples]
        sound = torch.nn.functional.pad(sound, (0, samples - sound.shape[1]))
        audio_vae = self._need(self.c.audio_vae, "the audio VAE")
        with self.visit(audio_vae):
            audio_rows = audio_rows_of(audio_vae.encode_stereo(sound).float().cpu())
        frames, height, width = source.frames.shape[:3]
        keep_v = torch.ones(video_rows.shape[0], dtype=torch.bool) if mask.video is None else ~masks.video_rows(
            mask.video, frames, height, width, height // dims[1] * patch[1])
        keep_a = torch.ones(audio_rows.shape[0], dtype=torch.bool) if mask.audio is None else ~masks.audio_rows(
            mask.audio, dims[3])
        return lay.holding(keep_v, keep_a), (video_rows, audio_rows)

    def control_injection(self, control, canvas, dims, dit, video_shift: float):
        """The request's control for the ControlNet: its hint encoded on the target's latent grid (VAE), strength and
        window (as sigmas of this video shift)."""
        from ..controlnet.hint import hint_latents, hint_rows
        from ..controlnet.tower import ControlInjection
        from ..vae.video import encode_condition

        tower = self.c.controlnet
        if tower is None:
            raise InputError("a control video or inpaint mask needs a ControlNet: load one (--controlnet)")
        tower.config.check_fits(dit.config)
        control.check_canvas(canvas.width, canvas.height)
        vae = self._need(self.c.vae, "the video VAE")

        def encode(frames: torch.Tensor) -> torch.Tensor:
            with self.visit(vae):
                return encode_condition(vae, frames, tile_size=DEFAULT_ENCODE_TILE)

        latents = hint_latents(control, encode, canvas.frames, canvas.width, canvas.height, dims[:3],
                               post_norm_fill=tower.config.post_norm_fill, latent_channels=dit.config.in_channels,
                               hint_channels=tower.config.hint_channels)
        return ControlInjection(tower, hint_rows(latents, dit.config.patch_size), control.strength,
                                (control.start, control.end), video_shift)

    def latent_dims(self, frames: int, width: int, height: int) -> tuple[int, int, int, int]:
        """(video latent frames, latent height, latent width, audio latent frames) of a canvas."""
        ratio = self.c.vae.config.spatial_ratio if self.c.vae is not None else geometry.VAE_SPATIAL
        return (geometry.video_latent_frames(frames), height // ratio, width // ratio,
                geometry.audio_latent_frames(frames))

    def sample(self, dit, request: SamplingRequest, schedule: JointSchedule, seed: int, *, on_step=None,
               cancel=None, mlp_chunks: int = 1, step_cache=None, device=None, attention_schedule=None,
               head_schedule=None, sampler: str = DEFAULT_SAMPLER):
        """The seeded flow-matching loop (sampler.py): final normalised video and audio latents."""
        return sample(dit, request, schedule, torch.Generator().manual_seed(int(seed)),
                      device=self.c.device if device is None else device, on_step=on_step, cancel=cancel,
                      mlp_chunks=mlp_chunks, step_cache=step_cache, release_adaln=self.release_adaln,
                      attention_schedule=attention_schedule, head_schedule=head_schedule, sampler=sampler)

    def decode_video(self, latents: torch.Tensor, tile_size: int | None = 256,
                     on_frames: Callable[[torch.Tensor], None] | None = None, decoder: str = "vae") -> torch.Tensor:
        """Normalised video latents (1, C, T, h, w) -> uint8 frames (F, H, W, 3). `decoder` "taeh3": TAEH3's draft
        of them (as many frames and as large as the VAE's, decoded and streamed to `on_frames` a few latent frames
        at a time)."""
        if decoder not in DECODERS:
            raise InputError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
        vae = self._need(self.c.vae, "the video VAE")
        if decoder == "taeh3":
            from ..vae.tiny_decoder import decode_draft

            return decode_draft(latents, self._loaded_taeh3(), vae.config, on_frames=on_frames)
        with self.visit(vae):
            return vae.decode_to_buffer(vae.denormalize(latents), tile_size=tile_size, group=self.decode_group,
                                        on_frames=None if on_frames is None else
                                        (lambda chunk: on_frames(chunk[0])))[0]

    def _loaded_taeh3(self):
        if self.taeh3 is None:
            raise InputError("no TAEH3 decoder is loaded: decoder taeh3 needs the tiny temporal decoder's file "
                             "(madebyollin/taehv's taeh3.safetensors) given at load (--taeh3 PATH)")
        return self.taeh3

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised audio latents (2, C, T) -> stereo float32 (2, samples) at 32 kHz on the CPU."""
        audio_vae = self._need(self.c.audio_vae, "the audio VAE")
        with self.visit(audio_vae):
            return audio_vae.decode_stereo(latents).float().cpu()

    @staticmethod
    def _need(component, what: str):
        if component is None:
            raise H3Error(f"{what} is not loaded")
        return component


@dataclass
class Canvas:
    width: int
    height: int
    frames: int
    keyframes: list  # uint8 (H, W, 3) each, FL2VA
    anchors: tuple  # "first" / "last" per keyframe
    references: list  # PreparedReference, Ref2VA
    guides: list = field(default_factory=list)  # PreparedGuide
    history: History | None = None  # at the canvas, t2va


@dataclass
class TextEncoding:
    embeds: torch.Tensor
    tags: torch.Tensor
    cached: bool


@dataclass
class EncodedReference:
    kind: str  # image | video | audio
    latent: torch.Tensor | None  # (1, C, T, h, w) normalised
    audio: torch.Tensor | None  # (2, C, T) normalised

    def block(self):
        """The reference's block in the packed layout."""
        audio_latents = 0 if self.audio is None else int(self.audio.shape[-1])
        if self.kind == "image":
            return ImageBlock(*self.latent.shape[-2:])
        if self.kind == "video":
            return VideoBlock(self.latent.shape[2], *self.latent.shape[-2:], audio_latents)
        return AudioBlock(audio_latents)


def build_layout(mode: str, tags: torch.Tensor, blocks: list, anchors: tuple, dims: tuple[int, int, int, int],
                 patch) -> Layout:
    """The packed sequence of one generation: text, a history, keyframe anchors and guides, references (Ref2VA),
    target audio, target video."""
    guides = tuple(b for b in blocks if isinstance(b, GuideBlock))
    if mode == "ref2va":
        return build_ref2va(tags, [b for b in blocks if not isinstance(b, GuideBlock)], *dims, patch, guides=guides)
    history = [b for b in blocks if isinstance(b, HistoryBlock)]
    return build_t2va(tags, *dims, patch, keyframes=anchors, guides=guides, history=history[0] if history else None)


def _stay(component):
    return contextlib.nullcontext(component)


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def sampler_of(req: GenerationRequest) -> str:
    return DEFAULT_SAMPLER if req.sampler is None else req.sampler


def scheduler_of(req: GenerationRequest) -> str | None:
    """The request's scheduler; None for explicit sigmas (they are the grid)."""
    if req.sigmas is not None:
        return None
    return DEFAULT_SCHEDULER if req.scheduler is None else req.scheduler


def schedule_of(req: GenerationRequest, shifts: tuple[float, float] = (VIDEO_SHIFT, AUDIO_SHIFT)) -> JointSchedule:
    """The request's joint sigma schedule: its scheduler's grids (the request's shifts, else the model's `shifts`),
    or its explicit sigmas. A sampler that cannot step it (res_multistep on explicit sigmas whose audio does not
    follow the video by one change of shift) is refused here, before anything loads."""
    if req.sigmas is None:
        if req.audio_sigmas is not None:
            raise InputError("audio_sigmas needs sigmas too")
        schedule = JointSchedule.from_scheduler(scheduler_of(req), req.steps, _given(req.video_shift, shifts[0]),
                                                _given(req.audio_shift, shifts[1]))
    else:
        if req.scheduler is not None:
            raise InputError(f"scheduler {req.scheduler} makes a grid, and explicit sigmas are the grid: give one "
                             "of the two")
        schedule = JointSchedule.explicit(req.sigmas, req.audio_sigmas)
    from .solvers import make_solver

    make_solver(sampler_of(req), schedule)
    return schedule


def audio_rows_of(latents: torch.Tensor) -> torch.Tensor:
    """Normalised audio latents (2, C, T) -> the rows (2 * T, C) the sampler packs, channel-major."""
    return latents.transpose(1, 2).reshape(-1, latents.shape[1]).contiguous()


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    from .sampler import Cancelled

    if cancel is not None and cancel.is_set():
        raise Cancelled(f"cancelled {where}")
