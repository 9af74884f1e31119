"""The work behind the nodes: ComfyUI types in, the engine's stages, ComfyUI types out.

Every stage is the engine's own (h3_model/engine): components are loaded by its `component_loader`, the
prompt is encoded, keyframes and references are prepared and VAE-encoded, the sampler runs and the VAEs
decode through an `Engine` over the components ComfyUI holds for us. The nodes only split those stages
over the graph; a test checks the node graph against `h3-spark generate`'s pipeline bit for bit.
"""

from __future__ import annotations

import glob
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import H3Error, InputError
from ..h3_model import geometry
from ..h3_model.engine.engine import Engine
from ..h3_model.engine.job_attention import running
from ..h3_model.controlnet.tower import attached
from ..h3_model.engine.shared_dit import kernels_line, use_kernels, use_loras
from ..h3_model.pipeline.scheduler import CONDITION_AUDIO_T, CONDITION_VIDEO_T
from ..h3_model.text.prompt import check_prompt
from ..kernels.settings import DEFAULT_TILE_BATCH
from . import host, payload
from . import patcher as patchers
from . import vae as vaes

log = logging.getLogger("h3_spark")
OPTIONS = "h3_spark"  # key of our settings in model_options["transformer_options"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VAE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
PARTITIONS = {"auto": None, "ref2va": "ref2va", "t2va/fl2va": "t2va"}


# ------------------------------------------------------------------------------------------ handles
@dataclass
class TextEncoderHandle:
    """H3_TEXT_ENCODER: our TextEncoder and the ModelPatcher that moves its weights."""

    encoder: object
    patcher: object

    def ready(self):
        # ComfyUI places it (resident, or its decoder layers streamed) and sets the encoder's `.device`.
        patchers.load_text_encoder(self.patcher, self.encoder)
        return self.encoder


@dataclass
class VAEHandle:
    """H3_VAE: the video and audio VAEs, each under its own ModelPatcher, which ComfyUI loads for one stage at a
    time with that stage's working memory declared (nodes/vae.py)."""

    video: object
    audio: object
    video_patcher: object
    audio_patcher: object
    tile_size: int | None = 256
    tile_batch: int = DEFAULT_TILE_BATCH  # the most tiles per decoder call (H3_VAE_TILE_BATCH); free memory can cut it

    def encode_video(self, refs: list, encode) -> list:
        """`encode(engine, ref)` for each PreparedReference with pixels, the video VAE loaded for the largest."""
        if not refs:
            return []
        return self._stage(self.video_patcher, vaes.encode_work(self.video, [r.pixels for r in refs], self.tile_size),
                           Engine.of(vae=self.video), refs, encode)

    def encode_audio(self, refs: list, encode) -> list:
        """`encode(engine, ref)` for each PreparedReference with audio, the audio VAE loaded for them."""
        if not refs:
            return []
        return self._stage(self.audio_patcher, vaes.audio_work(self.audio), Engine.of(audio_vae=self.audio), refs,
                           encode)

    def decode_video(self, latents: torch.Tensor) -> torch.Tensor:
        return vaes.decode_video(self.video_patcher, self.video, latents, self.tile_size, self.tile_batch)

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        return self._stage(self.audio_patcher, vaes.audio_work(self.audio), Engine.of(audio_vae=self.audio),
                           [latents], lambda engine, z: engine.decode_audio(z))[0]

    @staticmethod
    def _stage(patcher, work, engine, items: list, run) -> list:
        vaes.load(patcher, work)
        return vaes.guarded(work, lambda: [run(engine, item) for item in items])


# ------------------------------------------------------------------------------------------ loaders
def detect_partition(path: Path, choice: str) -> str:
    """"ref2va" or "t2va" (which also runs FL2VA): the choice, or what the path's layout or name says."""
    if choice not in PARTITIONS:
        raise InputError(f"partition must be one of {', '.join(PARTITIONS)}, got {choice!r}")
    if PARTITIONS[choice] is not None:
        return PARTITIONS[choice]
    if path.is_dir():
        from ..h3_model.engine.paths import MODE_FOLDERS, ComponentPaths

        modes = ComponentPaths(models=path).mode_folders()  # today's download: model_index.json says
        if len(modes) > 1:
            raise InputError(f"{path.name} holds both {MODE_FOLDERS['t2va']}/ (t2va/fl2va) and "
                             f"{MODE_FOLDERS['ref2va']}/ (ref2va); choose the partition")
        if modes:
            return next(iter(modes))
        has_ref, has_t2va = (path / "transformer_ref").is_dir(), (path / "transformer").is_dir()
        if has_ref and has_t2va:
            raise InputError(f"{path.name} holds both transformer/ (t2va/fl2va) and transformer_ref/ (ref2va); "
                             "choose the partition")
        if has_ref or path.name == "transformer_ref":
            return "ref2va"
        if has_t2va or path.name == "transformer":
            return "t2va"
    # The name's whole tokens (checkpoint/published.py); both partitions' words, or neither, is a question for
    # the user: the partitions share one architecture, so a wrong guess would run the wrong weights silently.
    from ..h3_model.checkpoint.published import partition_from_name

    named = partition_from_name(path.name)
    if named is not None:
        return named
    raise InputError(f"cannot tell whether {path.name} is the ref2va or the t2va/fl2va partition; choose it")


def load_model(path: Path, partition: str, weight_dtype: str, linear: str, attention: str):
    """H3_MODEL: the DiT under ComfyUI's model management, with our kernel choices in its options."""
    from ..h3_model.checkpoint import linear_format
    from ..h3_model.engine.loading import LoadOptions, component_loader
    from ..h3_model.engine.paths import ComponentPaths
    from ..kernels.attention import resolve_attention
    from ..kernels.dispatch import resolve_linear
    from ..kernels.settings import KernelSettings

    part = detect_partition(path, partition)
    released = ComponentPaths(models=path) if path.is_dir() else None
    if released is not None and released.layout() == "per-mode":
        # Today's download (FL2VA/, Ref2VA/ or one of them): the partition's transformer/ inside it.
        key = "dit" if part == "t2va" else "dit_ref"
        found = released.resolve(key)
        if found is None:
            raise InputError(f"{path.name} holds no DiT for the {part} partition ({released.folder_hint(key)})")
        path = found
    if weight_dtype not in DTYPES:
        raise InputError(f"weight_dtype must be one of {', '.join(DTYPES)}, got {weight_dtype!r}")
    settings = KernelSettings.from_env().replace(attention=attention, linear=linear)
    if settings.nvfp4_static_scales:  # never ignored silently: the nodes have no static-scales path
        raise InputError(f"H3_NVFP4_STATIC_SCALES={settings.nvfp4_static_scales} is set, but the ComfyUI nodes do "
                         "not take static NVFP4 scales (they run dynamic ones); unset it for ComfyUI")
    fmt = linear_format(path, part)
    # Fail here, before reading 60 GB, when this GPU cannot run the asked-for linears or attention.
    device = host.compute_device()
    resolve_linear(settings, device, fmt)
    resolve_attention(settings.attention, device, settings)
    options = LoadOptions(device=str(host.offload_device()), dtype=DTYPES[weight_dtype], kernels=None)
    dit = component_loader("dit" if part == "t2va" else "dit_ref", path, options)()
    model = host.make_held("dit", dit, patcher_class=patchers.dit_patcher_class)
    model.model_options.setdefault("transformer_options", {})[OPTIONS] = {
        "partition": part, "attention": attention, "linear": linear, "loras": [],
        "source": str(path)}
    return model


def load_text_encoder(path: Path, tokenizer: Path | None, dtype: str, layer: int | None = None) -> TextEncoderHandle:
    from ..h3_model.engine.loading import LoadOptions, component_loader
    from ..h3_model.text.encoder import DEFAULT_LAYER

    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    options = LoadOptions(device=str(host.offload_device()), dtype=DTYPES[dtype],
                          text_layer=DEFAULT_LAYER if layer is None else layer, kernels=None)
    encoder = component_loader("text_encoder", path, options, tokenizer)()
    return TextEncoderHandle(encoder, host.make_held("text_encoder", encoder.model, owner=encoder,
                                                     patcher_class=patchers.text_patcher_class))


def load_vaes(video_path: Path, audio_path: Path, decode_dtype: str, tile_size: int) -> VAEHandle:
    from ..h3_model.engine.loading import LoadOptions, component_loader
    from ..h3_model.vae.video_config import DEFAULT_TILE_MIN_OVERLAP
    from ..h3_model.vae.video_tiling import check_tiling
    from ..kernels.settings import vae_tile_batch

    if decode_dtype not in VAE_DTYPES:
        raise InputError(f"decode_dtype must be one of {', '.join(VAE_DTYPES)}, got {decode_dtype!r}")
    check_vae_slots(video_path, audio_path)
    devices = host.vae_devices()
    options = LoadOptions(device=str(devices[1]), vae_dtype=VAE_DTYPES[decode_dtype], kernels=None)
    video = component_loader("vae", video_path, options)()
    # Checked here, not at the first decode, which comes after the whole sampling.
    check_tiling(tile_size, DEFAULT_TILE_MIN_OVERLAP, video.config.spatial_ratio)
    video.tile_batch = vae_tile_batch()
    audio = component_loader("audio_vae", audio_path, options)()
    held = [host.make_held(kind, module, patcher_class=vaes.vae_patcher_class, devices=devices)
            for kind, module in (("vae", video), ("audio_vae", audio))]
    return VAEHandle(video, audio, *held, tile_size or None, video.tile_batch)


def check_vae_slots(video_path: Path, audio_path: Path) -> None:
    """Both VAEs sit in models/vae and both slots list them all: a swap is named here, before either loads."""
    from ..h3_model.vae.kind import AUDIO, VIDEO, vae_kind

    if vae_kind(video_path) == AUDIO:
        raise InputError(f"{video_path.name}: this is the audio VAE, in the video slot (vae_name); pick it as "
                         "audio_vae_name and the video VAE as vae_name")
    if vae_kind(audio_path) == VIDEO:
        raise InputError(f"{audio_path.name}: this is the video VAE, in the audio slot (audio_vae_name); pick it as "
                         "vae_name and the audio VAE as audio_vae_name")


# ------------------------------------------------------------------------------------------ the ControlNet
@dataclass
class ControlNetHandle:
    """H3_CONTROLNET: an H3 Fun ControlNet Union file, checked from its header; its tower is read in the DiT's dtype
    the first time a run needs it (a quantized file's layers kept as stored) and waits on the CPU between runs."""

    path: Path
    config: object
    towers: dict

    def tower(self, dit):
        from ..h3_model.checkpoint.controlnet import load_tower

        self.config.check_fits(dit.config, "the H3 ControlNet")
        if dit.dtype_ not in self.towers:
            self.towers[dit.dtype_] = load_tower(self.path, dit.config, dtype=dit.dtype_, device="cpu")
        return self.towers[dit.dtype_]


def load_controlnet(path: Path) -> ControlNetHandle:
    from ..h3_model.checkpoint.controlnet import ControlNetFile

    with ControlNetFile(path) as f:
        f.check()
        config = f.config
    log.info("h3-spark controlnet: %s, %d blocks after layers %s", config.version, config.blocks, list(config.places))
    return ControlNetHandle(Path(path), config, {})


def apply_controlnet(conditioning, controlnet, vae: VAEHandle, latent, strength: float, start: float, end: float,
                     control_video=None, mask=None, source_video=None) -> list:
    """The conditioning with a control for the H3 Sampler: the control video (IMAGE) and / or an inpaint MASK (1 =
    make anew) with its source video, fitted to the LATENT's canvas and length and VAE-encoded now. Strength 0, or
    neither a control video nor a mask, leaves the conditioning as it is (as ComfyUI's own apply node does)."""
    from ..h3_model.controlnet.hint import ControlRequest, hint_latents
    from ..h3_model.media.refs import PreparedReference

    if strength == 0 or (control_video is None and mask is None):
        return conditioning
    control = ControlRequest(video=None if control_video is None else frames_u8(control_video, "the control video"),
                             mask=None if mask is None else torch.as_tensor(mask).float().cpu(),
                             source=None if source_video is None or mask is None
                             else frames_u8(source_video, "the inpaint source video"),
                             strength=float(strength), start=float(start), end=float(end))
    control.validate()
    video, _ = payload.unpack_latent(latent)
    shape = (int(video.shape[2]), int(video.shape[3]), int(video.shape[4]))
    frames = payload.frames_of(shape[0])
    height, width = shape[1] * geometry.VAE_SPATIAL, shape[2] * geometry.VAE_SPATIAL
    control.check_canvas(width, height)

    def encode(pixels):
        latent, = vae.encode_video([PreparedReference("video", pixels=pixels)],
                                   lambda engine, r: engine.encode_reference(r, tile_size=vae.tile_size).latent)
        return latent

    hint = hint_latents(control, encode, frames, width, height, shape, post_norm_fill=controlnet.config.post_norm_fill,
                        latent_channels=vae.video.config.latent_channels, hint_channels=controlnet.config.hint_channels)
    (embeds, extras), = conditioning
    block = {"controlnet": controlnet, "hint": hint, "strength": control.strength,
             "window": (control.start, control.end)}
    return [[embeds, {**extras, payload.CONTROL: block}]]


def _control_injection(conditioning, dit, cond, shift_video: float, device):
    """The conditioning's control as the DiT's hook for this run (the tower moved to `device`), or None."""
    from ..h3_model.controlnet.hint import hint_rows
    from ..h3_model.controlnet.tower import ControlInjection

    block = conditioning[0][1].get(payload.CONTROL)
    if block is None:
        return None
    tower = block["controlnet"].tower(dit)
    want = (cond.latent_frames, cond.latent_height, cond.latent_width)
    if tuple(block["hint"].shape[2:]) != want:
        raise InputError(f"the control was made for latents {list(block['hint'].shape[2:])}, this LATENT is "
                         f"{list(want)}: apply the ControlNet with the LATENT you sample")
    tower.to(device)
    return ControlInjection(tower, hint_rows(block["hint"], dit.config.patch_size), block["strength"],
                            block["window"], shift_video)


# ------------------------------------------------------------------------------------------ ComfyUI media
def image_u8(image: torch.Tensor, what: str) -> torch.Tensor:
    """ComfyUI IMAGE (B, H, W, C) float [0, 1] -> uint8 (H, W, 3) of its first frame."""
    return frames_u8(image, what)[0]


def frames_u8(image: torch.Tensor, what: str) -> torch.Tensor:
    """ComfyUI IMAGE (B, H, W, C) float [0, 1] -> uint8 (B, H, W, 3)."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] < 3 or image.shape[0] < 1:
        raise InputError(f"{what} must be a ComfyUI IMAGE (frames, height, width, channels)")
    return (image[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def waveform(audio, what: str) -> tuple[torch.Tensor, int]:
    """ComfyUI AUDIO {"waveform": (B, C, N), "sample_rate"} -> ((C, N) float, rate) of its first item."""
    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise InputError(f"{what} must be a ComfyUI AUDIO ({{'waveform', 'sample_rate'}})")
    wave = audio["waveform"]
    if wave.ndim != 3 or wave.shape[0] < 1:
        raise InputError(f"{what}: the waveform must be (batch, channels, samples), got {tuple(wave.shape)}")
    return wave[0].float().cpu(), int(audio["sample_rate"])


# ------------------------------------------------------------------------------------------ conditioning
def _canvas(width: int, height: int, length: int, mode: str = "t2va") -> int:
    geometry.check_canvas(width, height)
    frames = geometry.snap_frames(length)
    if frames == geometry.STILL_FRAMES and mode != "t2va":
        raise InputError(f"length 1 is a still image, made by H3 Text to Video; {mode} makes clips of 124..345 "
                         "frames")
    if frames != length:
        # Said, not done quietly: the clip comes out longer than asked.
        log.warning("h3-spark: length %d snaps up to %d frames (%.2f s): H3 makes 17n+5 frames", length, frames,
                    frames / geometry.FPS)
    return frames


def _text(te: TextEncoderHandle, mode: str, prompt: str, keyframes=(),
          references=()) -> tuple[torch.Tensor, torch.Tensor]:
    _use_embeddings(te, prompt)
    # ComfyUI's own H3 nodes read a <Picture i> with no reference behind it as plain words (their multiframe
    # template names its guide stills so); ours read it so too, and say it, so those graphs run as they are.
    plain = _unnamed_labels(mode, prompt, keyframes, references)
    if plain:
        log.warning("h3-spark: the prompt names %s with no %s behind it: read as plain text, as ComfyUI's own nodes "
                    "read it (guide pictures are not shown to the text encoder)", ", ".join(plain),
                    "keyframe" if mode == "fl2va" else "reference")
    encoded = Engine.of(text_encoder=te.ready()).encode_text(mode, prompt, keyframes, references, unnamed="text")
    return encoded.embeds.cpu(), encoded.tags.cpu()


def _unnamed_labels(mode: str, prompt: str, keyframes, references) -> list[str]:
    from ..h3_model.media.refs import prompt_references
    from ..h3_model.text.prompt import check_mentions, labelled

    if mode == "ref2va":
        return check_mentions(mode, prompt, **labelled(prompt_references(list(references))), unnamed="text")
    return check_mentions(mode, prompt, images=len(list(keyframes)) if mode == "fl2va" else 0, unnamed="text")


def _use_embeddings(te: TextEncoderHandle, prompt: str) -> None:
    """`embedding:NAME` in the prompt: read from ComfyUI's embeddings folders, each one the prompt names found and
    checked from its header before the text encoder is placed (its width once it encodes)."""
    from ..h3_model.text.embeddings import EmbeddingLibrary, names_in, no_library_message

    builder = te.encoder.prompts
    if not names_in(prompt):
        return
    folders = host.embedding_folders()
    if not folders:
        raise InputError(no_library_message(prompt))
    library = EmbeddingLibrary(folders)
    library.check_prompt(prompt, getattr(builder, "text_width", None))
    builder.embeddings = library


def _empty(vae: VAEHandle | None, width: int, height: int, frames: int) -> dict:
    if vae is not None:
        video_c, audio_c = vae.video.config.latent_channels, vae.audio.config.latent_channels
    else:
        # No VAE on a T2VA node: the released model's latent widths (ComfyUI's empty latent uses them too).
        video_c, audio_c = 24, 32
    return payload.empty_latent(width, height, frames, video_c, audio_c)


def t2va(te: TextEncoderHandle, prompt: str, width: int, height: int, length: int):
    check_prompt("t2va", prompt)
    frames = _canvas(width, height, length)
    embeds, tags = _text(te, "t2va", prompt)
    return payload.make_conditioning(embeds, tags), _empty(None, width, height, frames)


def fl2va(te: TextEncoderHandle, vae: VAEHandle, prompt: str, width: int, height: int, length: int,
          first_frame=None, last_frame=None):
    from ..h3_model.media.refs import PreparedReference, prepare_keyframes

    check_prompt("fl2va", prompt)
    frames = _canvas(width, height, length, "fl2va")
    first = None if first_frame is None else image_u8(first_frame, "first_frame")
    last = None if last_frame is None else image_u8(last_frame, "last_frame")
    keyframes, anchors, width, height = prepare_keyframes(first, last, width, height)
    embeds, tags = _text(te, "fl2va", prompt, keyframes)
    latents = vae.encode_video([PreparedReference("image", pixels=frame) for frame in keyframes],
                               lambda engine, ref: engine.encode_keyframe(ref.pixels, tile_size=vae.tile_size))
    blocks = [{"resolved_frame_index": 0 if anchor == "first" else frames - 1, "latent": latent}
              for anchor, latent in zip(anchors, latents)]
    return (payload.make_conditioning(embeds, tags, keyframes=blocks),
            _empty(vae, width, height, frames))


def ref2va(te: TextEncoderHandle, vae: VAEHandle, prompt: str, width: int, height: int, length: int,
           reference_size: str, images: list, videos: list, audios: list, video_fps: float):
    """`images`: IMAGE list; `videos`: (IMAGE frames, AUDIO soundtrack or None) list; `audios`: AUDIO list.

    References enter in that order (images, then videos, then audio), as ComfyUI's native node orders them.
    """
    from ..h3_model.media.refs import AudioReference, ImageReference, VideoReference, prepare_references

    check_prompt("ref2va", prompt)
    frames = _canvas(width, height, length, "ref2va")
    refs = [ImageReference(image_u8(img, f"reference image {i + 1}")) for i, img in enumerate(images)]
    for i, (clip, sound) in enumerate(videos):
        wave, rate = waveform(sound, f"soundtrack of reference video {i + 1}") if sound is not None else (None, 32000)
        refs.append(VideoReference(frames_u8(clip, f"reference video {i + 1}"), fps=float(video_fps), audio=wave,
                                   sample_rate=rate))
    for i, sound in enumerate(audios):
        wave, rate = waveform(sound, f"reference audio {i + 1}")
        refs.append(AudioReference(wave, sample_rate=rate))
    prepared = prepare_references(refs, width=width, height=height, frames=frames, policy=reference_size)

    embeds, tags = _text(te, "ref2va", prompt, references=prepared)
    latents, sounds = _encode_references(vae, prepared)
    blocks = []
    for p in prepared:
        block: dict = {"kind": p.kind}
        if p.pixels is not None:
            z = next(latents)
            block.update(latent=z, latent_t=int(z.shape[2]), latent_h=int(z.shape[3]), latent_w=int(z.shape[4]))
        if p.audio is not None:
            a = payload.audio_to_comfy(next(sounds))
            block.update(audio_latent=a, ref_audio_t=int(a.shape[3]))
            if p.kind == "video":
                block["kind"] = "video_audio"
        blocks.append(block)
    return payload.make_conditioning(embeds, tags, refs=blocks), _empty(vae, width, height, frames)


def add_guide(conditioning, latent, vae: VAEHandle, frame_idx: int, image=None, audio=None,
              guide_strength: float = CONDITION_VIDEO_T, audio_guide_strength: float = CONDITION_AUDIO_T):
    """A still (one IMAGE frame), a clip (5 or more frames, cut to the longest 17k+5 as ComfyUI's AddGuide cuts
    them) and/or a sound pinned at `frame_idx` (negative: from the end) of the LATENT's clip, appended to the
    conditioning's guides (`minimax_keyframes`, which the H3 sampler and ComfyUI's own read alike), on any H3
    conditioning (text, keyframes or references). A sound longer than what remains of the clip after the frame
    is cropped there, as ComfyUI's AddGuide crops it (a logged note). Every check is made before anything is
    encoded (compose/guides.check_guides, the one pass the CLI and the service make too). A strength
    other than the released level sets the conditioning's (ComfyUI's names, one value for all its conditions); at
    the released level the conditioning keeps what it says."""
    from ..h3_model.compose.guides import Guide, check_guides, prepare_guides
    from ..h3_model.media.refs import PreparedReference

    if image is None and audio is None:
        raise InputError("H3 Add Guide needs an image (a still or a clip) or an audio input")
    video, _ = payload.unpack_latent(latent)
    frames = payload.frames_of(int(video.shape[2]))
    height, width = int(video.shape[3]) * geometry.VAE_SPATIAL, int(video.shape[4]) * geometry.VAE_SPATIAL
    guides = []
    if image is not None:
        pixels = frames_u8(image, "the guide image")
        if pixels.shape[0] < geometry.VAE_LATENTS_PER_CHUNK:
            guides.append(Guide("image", frame_idx, image=pixels[0]))
        else:
            guides.append(Guide("clip", frame_idx, clip=pixels[:geometry.snap_frames_down(int(pixels.shape[0]))]))
    if audio is not None:
        wave, rate = waveform(audio, "the guide audio")
        guides.append(Guide("audio", frame_idx, audio=wave, sample_rate=rate))
    for note in check_guides(guides, frames=frames, width=width, height=height):
        log.warning("H3 Add Guide: %s", note)
    prepared = prepare_guides(guides, frames=frames, width=width, height=height)
    block: dict = {"resolved_frame_index": prepared[0].frame}
    for p in prepared:
        if p.pixels is not None:
            block["latent"], = vae.encode_video([p], lambda engine, g: engine.encode_reference(PreparedReference(
                "image" if g.pixels.ndim == 3 else "video", pixels=g.pixels), tile_size=vae.tile_size).latent)
        else:
            sound, = vae.encode_audio([p], lambda engine, g: engine.encode_reference(
                PreparedReference("audio", audio=g.audio)).audio)
            block["audio_latent"] = payload.audio_to_comfy(p.keep(sound))
    (embeds, extras), = conditioning
    extras = {**extras, payload.KEYFRAMES: [*(extras.get(payload.KEYFRAMES) or []), block]}
    for key, level, released in ((payload.VISUAL_LEVEL, guide_strength, CONDITION_VIDEO_T),
                                 (payload.AUDIO_LEVEL, audio_guide_strength, CONDITION_AUDIO_T)):
        if level != released:
            extras[key] = float(level)
    return [[embeds, extras]], latent


def extend_video(conditioning, latent, vae: VAEHandle, images, audio=None, history_frames: int = 22):
    """The next window of a clip: the conditioning goes on from the clip's last frames, as `generate --seconds`
    windows do (compose/film.py). Its history is the `history_frames` frames before the clip's last frame, with
    the whole audio latents of sound under them, placed before the target on the time axis; the last frame is
    its first-frame guide, so the new clip's frame 0 repeats it (H3 Join Video drops it)."""
    from ..h3_model.compose.film import history_of
    from ..h3_model.compose.windows import check_history_frames, frame_sample
    from ..h3_model.media.refs import PreparedReference, resample_audio

    check_history_frames(history_frames)
    video, _ = payload.unpack_latent(latent)
    height, width = int(video.shape[3]) * geometry.VAE_SPATIAL, int(video.shape[4]) * geometry.VAE_SPATIAL
    clip = frames_u8(images, "the clip to extend")
    if tuple(clip.shape[1:3]) != (height, width):
        raise InputError(f"the clip to extend is {clip.shape[2]}x{clip.shape[1]}, the new latent {width}x{height}: a "
                         "clip is continued at its own size")
    wave = None
    if audio is not None:
        wave, rate = waveform(audio, "the clip's audio")
        if wave.shape[0] == 1:
            wave = wave.expand(2, -1)
        wave = wave[:2].float() if rate == geometry.AUDIO_SAMPLE_RATE else resample_audio(
            wave[:2].float(), rate, geometry.AUDIO_SAMPLE_RATE)
    # The last frame's first sample: the new clip's frame 0 starts there.
    past, last = history_of(clip, wave, frame_sample(int(clip.shape[0]) - 1), history_frames)
    history, sound = past.pixels, past.audio
    tile = vae.tile_size
    pictures = vae.encode_video([PreparedReference("video", pixels=history), PreparedReference("image", pixels=last)],
                                lambda engine, ref: engine.encode_reference(ref, tile_size=tile).latent)
    block = {"latent": pictures[0], "audio_latent": None}
    if sound is not None:
        encoded, = vae.encode_audio([PreparedReference("audio", audio=sound)],
                                    lambda engine, ref: engine.encode_reference(ref).audio)
        block["audio_latent"] = payload.audio_to_comfy(encoded)
    (embeds, extras), = conditioning
    if extras.get(payload.REFS):
        raise InputError("H3 Extend Video goes on from text-to-video conditioning (H3 Text to Video), not references")
    guide = {"resolved_frame_index": 0, "latent": pictures[1]}
    extras = {**extras, payload.HISTORY: block, payload.KEYFRAMES: [guide, *(extras.get(payload.KEYFRAMES) or [])]}
    return [[embeds, extras]], latent


def join_video(images_a, audio_a, images_b, audio_b, overlap: int = 1):
    """Clip a, then clip b without its first `overlap` frames (the frame an extension repeats), and their sound
    cut on one grid (frame g starts at sample round(g x 4000 / 3)), so the joined sound is exactly as long as
    the joined picture."""
    from ..h3_model.compose.windows import frame_sample
    from ..h3_model.media.refs import resample_audio

    a, b = frames_u8(images_a, "the first clip"), frames_u8(images_b, "the second clip")
    if tuple(a.shape[1:3]) != tuple(b.shape[1:3]):
        raise InputError(f"the clips are {a.shape[2]}x{a.shape[1]} and {b.shape[2]}x{b.shape[1]}; joined clips "
                         "share one size")
    if not 0 <= overlap < b.shape[0]:
        raise InputError(f"overlap must be 0..{b.shape[0] - 1} (the second clip's frames), got {overlap}")
    first, start = int(a.shape[0]), int(a.shape[0]) - overlap  # the film frame of b's frame 0

    def stereo_32k(audio, what: str, samples: int) -> torch.Tensor:
        if audio is None:
            return torch.zeros(2, samples)
        wave, rate = waveform(audio, what)
        wave = (wave.expand(2, -1) if wave.shape[0] == 1 else wave[:2]).float()
        if rate != geometry.AUDIO_SAMPLE_RATE:
            wave = resample_audio(wave, rate, geometry.AUDIO_SAMPLE_RATE)
        return torch.nn.functional.pad(wave, (0, max(0, samples - wave.shape[1])))

    sound_a = stereo_32k(audio_a, "the first clip's audio", frame_sample(first))[:, :frame_sample(first)]
    end = start + int(b.shape[0])
    sound_b = stereo_32k(audio_b, "the second clip's audio", frame_sample(end) - frame_sample(start))
    sound_b = sound_b[:, frame_sample(first) - frame_sample(start):frame_sample(end) - frame_sample(start)]
    frames = torch.cat([a, b[overlap:]]).float() / 255
    return frames, {"waveform": torch.cat([sound_a, sound_b], dim=1)[None], "sample_rate": geometry.AUDIO_SAMPLE_RATE}


def _encode_references(vae: VAEHandle, prepared: list):
    """The references' video latents, then their audio latents (iterators, in reference order): each VAE loaded
    once, for all the references that need it, one stage after the other."""
    from ..h3_model.media.refs import PreparedReference

    tile = vae.tile_size
    latents = vae.encode_video([p for p in prepared if p.pixels is not None], lambda engine, p: engine.encode_reference(
        PreparedReference(p.kind, pixels=p.pixels), tile_size=tile).latent)
    sounds = vae.encode_audio([p for p in prepared if p.audio is not None], lambda engine, p: engine.encode_reference(
        PreparedReference(p.kind, audio=p.audio)).audio)
    return iter(latents), iter(sounds)


# ------------------------------------------------------------------------------------------ model options
def options(model) -> dict:
    opts = model.model_options.get("transformer_options", {}).get(OPTIONS)
    if opts is None:
        raise InputError("this MODEL was not loaded by H3 Model Loader")
    return opts


def dit_of(model):
    dit = host.held_inner(model, "dit")
    if dit is None:
        raise InputError("the H3 sampler runs models from H3 Model Loader; for ComfyUI's native MiniMax H3 model "
                         "use SamplerCustomAdvanced (H3 Attention Patch works on both)")
    return dit


def with_options(model, **changes):
    """A clone of MODEL whose h3-spark options carry `changes` (the original stays as it was)."""
    clone = model.clone()
    to = dict(clone.model_options.get("transformer_options", {}))
    to[OPTIONS] = {**options(model), **changes}
    clone.model_options["transformer_options"] = to
    return clone


def add_lora(model, path: Path, strength: float):
    dit_of(model)
    if not path.is_file():
        raise InputError(f"{path}: no such LoRA file")
    return with_options(model, loras=[*options(model)["loras"], (str(path), float(strength))])


# ------------------------------------------------------------------------------------------ sampling
def sample(model, conditioning, latent, seed: int, steps: int, shift_video: float, shift_audio: float,
           step_cache=None, recipes: str = "", sampler: str = "euler", scheduler: str = "h3") -> dict:
    """LATENT (video + audio) from a MODEL, one CONDITIONING and an H3 LATENT; `steps` model evaluations.

    The input latent gives the canvas and the length only (its shape); generation always starts from the
    seed's noise, as the released pipeline does, so an empty latent of any channel width will do.
    `step_cache` is None or (mode, threshold or None, start, end, subsample) for h3_model.step_cache.
    `recipes`: engine.recipes names separated by ';' (empty: none); turbo replaces `steps` and the shifts.
    `sampler` / `scheduler`: the step rule and the grid (pipeline/solvers.py, scheduler.py); a recipe that sets
    them takes the defaults' place, and refuses other values.
    """
    from ..h3_model.pipeline.generation import build_layout
    from ..h3_model.pipeline.sampler import Cancelled, SamplingRequest
    from ..h3_model.pipeline.scheduler import DEFAULT_SCHEDULER, JointSchedule, check_scheduler
    from ..h3_model.pipeline.solvers import DEFAULT_SAMPLER, check_sampler, make_solver

    check_sampler(sampler)
    check_scheduler(scheduler)
    dit = dit_of(model)
    opts = options(model)
    cond = payload.read_conditions(conditioning, latent)
    need = "ref2va" if cond.mode == "ref2va" else "t2va"
    if opts["partition"] != need:
        have = "ref2va" if opts["partition"] == "ref2va" else "t2va/fl2va"
        raise InputError(f"this conditioning is {cond.mode} but the model is the {have} partition; load the "
                         f"{'ref2va' if need == 'ref2va' else 't2va/fl2va'} checkpoint for it")
    c = dit.config
    if cond.embeds.shape[-1] != c.text_dim:
        raise InputError(f"the text embeddings are {cond.embeds.shape[-1]} wide but this DiT reads {c.text_dim}: "
                         "text encoder and model do not belong together")
    if not 1 <= steps <= 1000 or not 0 <= seed < 2 ** 63:
        raise InputError(f"steps must be 1..1000 and seed 0..2^63-1, got {steps} and {seed}")
    from ..h3_model.engine.recipes import check_recipe_mode, pdd_heads, recipe_sampling, sparse_schedule

    chosen = _recipes(recipes, step_cache is not None, opts)
    check_recipe_mode(chosen, cond.mode)
    run = recipe_sampling(chosen, steps)
    sampler, scheduler = _recipe_choice(run, sampler, scheduler, DEFAULT_SAMPLER, DEFAULT_SCHEDULER)
    if run.evaluations is not None:
        log.info("h3-spark recipe %s replaces steps %d and shifts %g/%g with %d and %g/%g", run.grid_from, steps,
                 shift_video, shift_audio, run.evaluations, run.video_shift, run.audio_shift)
        steps, shift_video, shift_audio = run.evaluations, run.video_shift, run.audio_shift
    dims = (cond.latent_frames, cond.latent_height, cond.latent_width, cond.audio_latents)
    lay = build_layout(cond.mode, cond.tags, cond.blocks, cond.anchors, dims, c.patch_size)
    # `steps` counts model evaluations, as ComfyUI's samplers do; the grid has one more point (the final 0).
    schedule = JointSchedule.from_scheduler(scheduler, steps + 1, shift_video, shift_audio)
    if run.sigmas is not None:  # a recipe's trained rungs (fasth3-8step), not a uniform grid
        schedule = JointSchedule.explicit(run.sigmas, run.audio_sigmas)
    make_solver(sampler, schedule)  # refused here, before the DiT is placed

    cache = run.step_cache
    if step_cache is not None:
        from ..h3_model.pipeline.step_cache import make_step_cache

        cache = make_step_cache(*step_cache, evaluations=len(schedule))

    from ..h3_model.engine.memory import activation_bytes
    use_loras(dit, opts["loras"])
    head_schedule = pdd_heads(chosen, dit)  # recipe pdd: the head bank the LoRA set just brought
    # Kernels first (converted once, block by block if the DiT waits in host memory), then ComfyUI places the
    # DiT for this request: resident, or streamed where its memory does not reach.
    report, attention = use_kernels(dit, opts["attention"], opts["linear"], host.compute_device())
    device = patchers.load_dit(model, activation_bytes(c, lay.sequence_length, dit.dtype_))
    line = kernels_line(dit, report)
    if line is not None:
        log.info("h3-spark kernels: %s", line)
    progress = host.Progress(len(schedule))
    on_step = _step_reporter(progress, c, cond)
    interrupt = host.InterruptFlag()
    request = SamplingRequest(lay, cond.embeds, cond.latent_frames, cond.latent_height, cond.latent_width,
                              cond.audio_latents, cond.condition_latents, cond.audio_condition_rows)
    if cond.visual_level is not None:
        request.condition_video_t = cond.visual_level
    if cond.audio_level is not None:
        request.condition_audio_t = cond.audio_level
    control = _control_injection(conditioning, dit, cond, shift_video, device)
    with running(dit, attention), attached(dit, control):
        # Inside the switch: the schedule stays dense with the attention this run resolved.
        attention_schedule = sparse_schedule(chosen, dit, device, _settings(opts))
        try:
            result = Engine.of(device=device).sample(dit, request, schedule, int(seed), device=device,
                                                     on_step=on_step, cancel=interrupt,
                                                     step_cache=cache, attention_schedule=attention_schedule,
                                                     head_schedule=head_schedule, sampler=sampler)
        except Cancelled as exc:
            interrupt.raise_interrupted(exc)
        finally:
            if control is not None:  # the tower waits on the CPU between runs
                control.tower.to("cpu")
    if control is not None:
        log.info("h3-spark controlnet: ran in %d of %d evaluations", control.evaluations, len(schedule))
    if cache is not None:
        # An approximate run says so: which steps were computed and which reused.
        log.info("h3-spark step cache: %s", cache.report())
    return payload.pack_latent(result.video_latents, payload.audio_to_comfy(result.audio_latents))


def _recipe_choice(run, sampler: str, scheduler: str, default_sampler: str, default_scheduler: str):
    """The sampler and scheduler a run uses: a recipe's where it sets them (in place of the node's defaults; another
    value is refused, as the CLI refuses --sampler / --scheduler with such a recipe), else the node's."""
    from ..h3_model.pipeline.scheduler import DEFAULT_SCHEDULER

    if run.evaluations is not None:
        grid = run.scheduler or DEFAULT_SCHEDULER
        allowed = (default_scheduler,) if run.sigmas is not None else tuple(dict.fromkeys((default_scheduler, grid)))
        if scheduler not in allowed:
            what = "its trained rungs" if run.sigmas is not None else grid
            raise InputError(f"recipe {run.grid_from} samples its own grid ({what}), not scheduler {scheduler}: set "
                             f"the sampler node's scheduler to {' or '.join(allowed)}")
        scheduler = grid
    if run.sampler is not None:
        if sampler not in (default_sampler, run.sampler):
            raise InputError(f"recipe {run.grid_from} samples with {run.sampler}, not {sampler}: set the sampler "
                             f"node's sampler_name to {default_sampler} or {run.sampler}")
        if sampler != run.sampler:
            log.info("h3-spark recipe %s samples with %s on %s", run.grid_from, run.sampler, scheduler)
        sampler = run.sampler
    return sampler, scheduler


def _step_reporter(progress, config, cond):
    """Each step moves ComfyUI's progress bar and, when ComfyUI shows previews, sends a picture of the clip:
    decoded by the tiny decoder when models/vae_approx holds taeh3.safetensors, else a latent projection."""
    if not host.previews_wanted() or progress.bar is None:
        return lambda s: progress.update(s.index + 1)
    from ..h3_model.pipeline.preview import decoded_preview, latent_frames, preview_image

    tiny = host.tiny_preview_decoder(config.in_channels)

    def report(s) -> None:
        image = None
        if s.denoised is not None:
            latents = latent_frames(s.denoised(), config.in_channels, cond.latent_frames, cond.latent_height,
                                    cond.latent_width, config.patch_size)
            image = decoded_preview(tiny, latents) if tiny is not None else preview_image(latents, host.PREVIEW_SIZE)
        progress.update(s.index + 1, image)

    return report


def _settings(opts: dict):
    from ..kernels.settings import KernelSettings

    return KernelSettings.from_env().replace(attention=opts["attention"], linear=opts["linear"])


def _recipes(text: str, step_cache: bool, opts: dict) -> list:
    """The sampler node's recipes (`;`-separated), checked before anything runs, and said in the log."""
    from ..h3_model.engine.recipes import check_pdd_loras, check_recipes, parse_recipes

    chosen = parse_recipes([t for t in (text or "").split(";") if t.strip()])
    if not chosen and opts["loras"]:
        check_pdd_loras(chosen, opts["loras"])  # a PDD LoRA's bank needs recipe pdd: said before any merge
    if chosen:
        check_recipes(chosen, host.compute_device(), _settings(opts), step_cache=step_cache,
                      cache_fix="set the sampler's cache to off", loras=opts["loras"])
        log.info("h3-spark recipes (approximate): %s",
                 "; ".join(", ".join(f"{k}={v}" for k, v in r.describe().items()) for r in chosen))
    return chosen


# ------------------------------------------------------------------------------------------ decode, save
def decode(vae: VAEHandle, latent) -> tuple[torch.Tensor, dict]:
    """LATENT -> (IMAGE (F, H, W, 3) float [0, 1], AUDIO {"waveform": (1, 2, N), "sample_rate": 32000})."""
    video, audio = payload.unpack_latent(latent)
    if video.shape[1] != vae.video.config.latent_channels:
        raise InputError(f"the latent has {video.shape[1]} channels, the video VAE {vae.video.config.latent_channels}")
    # One VAE at a time, each loaded for its own decode: the audio VAE's load must not push out the video VAE
    # between the video VAE's load and its decode.
    # uint8 like the pipeline and the CLI, so a saved video holds the same frames whichever front door made it.
    frames = vae.decode_video(video.float())
    if video.shape[2] == 1:
        # A still (text to image): one IMAGE frame. Its two audio latents are not decoded (the audio VAE is not
        # loaded); the AUDIO output is the frame's length of silence, so a wired audio input still gets a sound.
        from ..h3_model.compose.windows import frame_sample

        wave = torch.zeros(2, frame_sample(1))
    else:
        wave = vae.decode_audio(payload.audio_from_comfy(audio.float()))
    return frames.float() / 255.0, {"waveform": wave[None], "sample_rate": geometry.AUDIO_SAMPLE_RATE}


def output_path(prefix: str, suffix: str = ".mp4") -> tuple[Path, str]:
    """A new file for `prefix` inside ComfyUI's output folder, and its subfolder; refuses to leave the folder."""
    root = host.output_directory().resolve()
    if not prefix or Path(prefix).is_absolute():
        raise InputError(f"filename_prefix must be a relative name inside the output folder, got {prefix!r}")
    folder = (root / Path(prefix).parent).resolve()
    if folder != root and root not in folder.parents:
        raise InputError(f"filename_prefix {prefix!r} points outside the output folder")
    base = Path(prefix).name
    if not base or base in (".", ".."):
        raise InputError(f"filename_prefix {prefix!r} has no file name")
    folder.mkdir(parents=True, exist_ok=True)
    taken = {p.name for p in folder.glob(f"{glob.escape(base)}_*{suffix}")}  # [, ], * and ? are literal
    counter = 1
    while f"{base}_{counter:05d}_{suffix}" in taken:
        counter += 1
    return folder / f"{base}_{counter:05d}_{suffix}", str(folder.relative_to(root)) if folder != root else ""


def save_video(images: torch.Tensor, audio, prefix: str, fps: int, crf: int) -> dict:
    from ..h3_model.media.refs import stereo

    frames = frames_u8(images, "images")
    sound = None
    if audio is not None:
        wave, rate = waveform(audio, "audio")
        sound = stereo(wave, rate, frames.shape[0] / fps, "audio")
    path, subfolder = output_path(prefix)
    Engine.mux(path, frames, sound, fps=int(fps), crf=int(crf))
    return {"filename": path.name, "subfolder": subfolder, "type": "output"}


# ------------------------------------------------------------------------------------------ attention patch
class ComfyAttentionOverride:
    """`transformer_options["optimized_attention_override"]` running one of our backends.

    ComfyUI calls it as `override(func, q, k, v, heads, mask=None, ..., skip_reshape=...,
    skip_output_reshape=..., transformer_options=..., _inside_attn_wrapper=True)` (attention.py's
    `wrap_attn`). H3 passes q/k/v as (B, heads, S, D) with skip_reshape=True and wants (B, S, heads*D);
    our backends take and return (B, S, heads, D). The backend is selected as for our own DiT (the
    registry's `resolve_attention` for the heads it is given), once per device, dtype and head size.
    """

    def __init__(self, name: str, settings):
        self.name = name
        self.settings = settings
        self._backends: dict = {}

    def __deepcopy__(self, memo):
        # ComfyUI deep-copies model_options on every clone; resolved backends hold modules, so start afresh.
        return ComfyAttentionOverride(self.name, self.settings)

    def backend(self, device, dtype: torch.dtype, head_dim: int):
        from ..kernels.attention import resolve_attention

        key = (str(device), dtype, head_dim)
        if key not in self._backends:
            self._backends[key] = resolve_attention(self.name, device, self.settings, dtype=dtype,
                                                    head_dim=head_dim)[0]
        return self._backends[key]

    def __call__(self, func, q, k, v, heads, mask=None, *args, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        if mask is not None:
            # H3 never masks; a masked call means another model, which our unmasked kernels would get wrong.
            raise H3Error(f"the h3-spark attention patch ({self.name}) takes unmasked attention only; this model "
                          "passes a mask, so leave it unpatched")
        if skip_reshape:
            b, _, s, d = q.shape
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:
            b, s, inner = q.shape
            d = inner // heads
            q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, d) for t in (q, k, v))
        out = self.backend(q.device, q.dtype, d)(q, k, v)
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.reshape(b, out.shape[1], heads * d)


def _resolve_backend(model, backend: str):
    """The backend resolved now, on the compute device, so an unavailable one fails at the patch node."""
    from ..kernels.attention import resolve_attention
    from ..kernels.settings import KernelSettings

    settings = KernelSettings.from_env().replace(attention=backend)
    device = getattr(model, "load_device", None) or host.compute_device()
    resolve_attention(backend, device, settings)
    return settings


def patch_attention(model, backend: str):
    """H3_MODEL -> H3_MODEL running `backend` (through the model options)."""
    if host.held_inner(model, "dit") is None:
        raise InputError("H3 Attention Patch takes an h3-spark H3_MODEL; for ComfyUI's native MiniMax H3 MODEL use "
                         "H3 Attention Patch (native model)")
    _resolve_backend(model, backend)
    return with_options(model, attention=backend)


def patch_native_attention(model, backend: str):
    """ComfyUI's native MiniMax H3 MODEL -> MODEL running `backend` through the attention override."""
    if host.held_inner(model, "dit") is not None:
        raise InputError("H3 Attention Patch (native model) takes ComfyUI's native MiniMax H3 MODEL; an h3-spark "
                         "H3_MODEL takes H3 Attention Patch")
    diffusion = getattr(getattr(model, "model", None), "diffusion_model", None)
    if diffusion is None or type(diffusion).__module__.split(".")[:3] != ["comfy", "ldm", "minimax"]:
        got = type(diffusion).__name__ if diffusion is not None else type(model).__name__
        raise InputError(f"H3 Attention Patch (native model) takes ComfyUI's native MiniMax H3 MODEL "
                         f"(comfy.ldm.minimax), got {got}")
    settings = _resolve_backend(model, backend)
    clone = model.clone()
    to = dict(clone.model_options.get("transformer_options", {}))
    to["optimized_attention_override"] = ComfyAttentionOverride(backend, settings)
    clone.model_options["transformer_options"] = to
    return clone
