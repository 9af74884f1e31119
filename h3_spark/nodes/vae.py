"""The H3 VAEs under ComfyUI's model management, loaded the way ComfyUI loads its own VAE.

ComfyUI's VAE declares what each decode and encode needs beside its weights: it calls
`load_models_gpu([patcher], memory_required=...)`, and ComfyUI unloads or partially unloads the other models
(our DiT and text encoder through nodes/patcher.py) until the weights and that memory fit. Ours do the same.
A stage's working memory is the decode's memory plan (`decode_memory_estimate`, h3_model/vae/video.py) or the
encode bound below; `memory_required` is what the stage would like (the decode at H3_VAE_TILE_BATCH tiles per
decoder call) and `minimum_memory_required` the least it runs in (one tile per call). Once the VAE is loaded
the decode takes as many tiles per call as the free memory holds, as ComfyUI's VAE sizes its batch from free
memory; tiles per call change only the kernels' rounding, where the tile size would change the frames.

Our VAEs have no per-layer weight casting (comfy.ops), so their patcher loads and unloads them whole: a VAE
split between two devices fails in its first layer. Loaded, a VAE stays on the GPU as any ComfyUI model
does, until a load needs the room (the sampler's DiT), `unload_all_models` or "Free model and node cache"
sends it back to the offload device. A stage that does not fit even at its least, or that runs out of memory
all the same (a decode retries at one tile per call first), fails with one line naming the memory it needs
and what lowers it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..h3_model.engine.memory import gb, tensor_bytes
from . import host

log = logging.getLogger("h3_spark")
WORK = "_h3_vae_work"  # the Work of the stage being loaded, on the held module, for the patcher's room check
# The encoder's peak beside its padded input, in widest activations (one level's channels x frames x tile):
# 8.0 to 8.4 measured on an H200 (random full-size weights, torch 2.11: one 960x544 or 1344x768 image, 22
# and 124 frames at 960x544 and 1344x768, 256 and 128 px tiles and untiled); 9 leaves a margin over that.
ENCODE_ACTIVATIONS = 9
CPU_VAE = "or start ComfyUI with --cpu-vae (slow)"  # the way out of every stage's fixes, said last


@dataclass(frozen=True)
class Work:
    """GPU bytes a VAE stage needs beside its weights: what it would like, the least it runs in, and what
    lowers them (said when even the least does not fit)."""

    what: str
    wanted: int
    least: int
    fix: str  # what the user can change, comma-separated; the message ends it with CPU_VAE


NO_WORK = Work("the H3 VAE", 0, 0, "free GPU memory held outside ComfyUI")


# ------------------------------------------------------------------------------------------ what stages need
def decode_work(video, latent_shape, tile_size: int | None, tile_batch: int) -> Work:
    """The video decode's working memory from its memory plan: at `tile_batch` tiles per call, and at one."""
    _, _, frames, height, width = latent_shape
    fix = "lower tile_size on H3 VAE Loader (smaller tiles change the frames slightly)"
    if video.decode_dtype == torch.float32:
        fix += ", set its decode_dtype to float16"
    return Work("the H3 video VAE decode", decode_bytes(video, (frames, height, width), tile_size, tile_batch),
                decode_bytes(video, (frames, height, width), tile_size, 1), fix + ", decode a smaller canvas")


def decode_bytes(video, latent_size: tuple[int, int, int], tile_size: int | None, tile_batch: int) -> int:
    from ..kernels.stored_linear import scratch_bytes

    # A quantized decoder (ComfyUI's int8_convrot file) dequantizes each linear at use into a shared scratch.
    return _decode_bytes(video.config, *latent_size, video.decode_dtype, tile_size, tile_batch) + scratch_bytes(video)


@functools.lru_cache(maxsize=256)
def _decode_bytes(config, frames, height, width, dtype, tile_size, tile_batch) -> int:
    # Cached: the plan builds the VAE on the meta device to count its weights, a tenth of a second a call.
    from ..h3_model.vae.video import decode_memory_estimate

    plan = decode_memory_estimate(config, frames, height, width, decode_dtype=dtype, tile_size=tile_size,
                                  tile_batch=tile_batch)
    return plan["transient"] + plan["window"]


def encode_work(video, pixels: list[torch.Tensor], tile_size: int | None) -> Work:
    """The encode of the largest of these uint8 images (H, W, 3) and videos (F, H, W, 3)."""
    need = max(encode_bytes(video.config, *(tuple(p.shape[:-1]) if p.ndim == 4 else (1, *p.shape[:2])),
                            tile_size) for p in pixels)
    return Work("the H3 video VAE encode", need, need, "lower tile_size on H3 VAE Loader (smaller tiles change "
                "the latents slightly), use smaller or shorter images and videos")


def encode_bytes(config, frames: int, height: int, width: int, tile_size: int | None) -> int:
    """A bound on one image's or video's encode beside the weights.

    The encode moves the fp32 pixels to the device and pads a video to whole clips (both copies live during the
    concatenation), then encodes clip by clip and tile by tile: its peak is the padded pixels and
    ENCODE_ACTIVATIONS times the widest activation of one tile's clip.
    """
    pixels = config.in_channels * height * width * 4
    clip = 1 if frames == 1 else config.clip_length
    padded = math.ceil(frames / clip) * clip
    tile_h, tile_w = (min(tile_size, height), min(tile_size, width)) if tile_size else (height, width)
    widest = 4 * max(c * t * h * w for c, t, h, w in _levels(config, clip, tile_h, tile_w))
    concatenating = pixels * (frames + padded) if padded > frames else 0
    return max(concatenating, pixels * padded + ENCODE_ACTIVATIONS * widest)


def _levels(config, frames: int, height: int, width: int):
    """(channels, frames, height, width) at which each encoder level's resnets run."""
    for channels, spatial, temporal in zip(config.block_out_channels, config.spatial_downsample_factors,
                                           config.temporal_downsample_factors):
        yield channels, frames, height, width
        frames = frames if frames == 1 else (frames - 1) // temporal + 1  # causal stride: the first frame stays
        height, width = -(-height // spatial), -(-width // spatial)


def audio_work(audio) -> Work:
    from ..h3_model.engine.memory import vae_stage_bytes

    # The engine's guess for the audio VAE's stage (its weights and as much again), less the weights.
    need = vae_stage_bytes(None, audio) - tensor_bytes(audio)
    return Work("the H3 audio VAE", need, need, "free GPU memory held outside ComfyUI, lower --reserve-vram")


# ------------------------------------------------------------------------------------------ loading
def load(patcher, work: Work):
    """Have ComfyUI load `patcher`'s VAE, whole, for a stage that needs `work` beside it; returns the device it
    runs on. Outside ComfyUI the VAE goes to the compute device."""
    mm = host.optional_module("comfy.model_management")
    if isinstance(patcher, host.LocalModel) or mm is None:
        return host.load_for_compute(patcher)
    setattr(patcher.model, WORK, work)
    margin = _margin(mm)
    mm.load_models_gpu([patcher], memory_required=work.wanted + margin,
                       minimum_memory_required=work.least + margin, force_full_load=True)
    return patcher.load_device


def _margin(mm) -> int:
    # ComfyUI's own allowance beside a stage (its inference minimum less --reserve-vram, 0.8 GB): our plans are
    # tight (a decode at one tile per call peaked 0.5 % above its plan, weights included), and the allocator rounds.
    return int(mm.minimum_inference_memory() - mm.extra_reserved_memory())


def _kept(mm, work: Work) -> int:
    """What must stay free beside the weights for `work`'s least: as ComfyUI computes `minimum_memory_required`."""
    return work.least + int(mm.minimum_inference_memory())


def tile_batch(patcher, video, latent_shape, tile_size: int | None, most: int) -> int:
    """Tiles per decoder call: the most, up to `most`, whose working memory fits what is free now beside the
    loaded weights; an error naming the memory when not even one tile does."""
    mm = host.optional_module("comfy.model_management")
    device = torch.device(patcher.load_device)
    if isinstance(patcher, host.LocalModel) or mm is None or device.type == "cpu":
        return most
    size = tuple(latent_shape[2:])
    free = mm.get_free_memory(device)
    room = free - int(mm.minimum_inference_memory())
    if decode_bytes(video, size, tile_size, 1) > room:
        # Loaded earlier, it was not checked by this load; its own weights count as what it has.
        work = getattr(patcher.model, WORK, NO_WORK)
        raise InputError(no_room(work, patcher.model_size(), free + patcher.loaded_size(), mm, device))
    low, high = 1, most  # the largest batch that fits: the plan grows with the batch
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if decode_bytes(video, size, tile_size, middle) <= room else (low, middle - 1)
    return low


def no_room(work: Work, weights: int, free: int, mm, device) -> str:
    return (f"{work.what} needs {gb(weights)} for its weights and {gb(work.least)} to work in, beside ComfyUI's "
            f"reserve of {gb(int(mm.minimum_inference_memory()))} (--reserve-vram included), but {device} has "
            f"{gb(max(free, 0))} free with the other models unloaded: {work.fix}, {CPU_VAE}")


def _same_device(a, b) -> bool:
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_room(patcher, mm, device) -> None:
    """Called once ComfyUI has freed what it could: the stage's one-line error when the whole VAE and the least
    its stage runs in do not fit."""
    if torch.device(device).type == "cpu":
        return
    work = getattr(patcher.model, WORK, NO_WORK)
    weights = patcher.model_size() - (patcher.loaded_size() if _same_device(patcher.model.device, device) else 0)
    free = mm.get_free_memory(device)
    if free - weights < _kept(mm, work):
        raise InputError(no_room(work, weights, free, mm, device))


def _move(patcher, device) -> None:
    """The whole VAE to `device`, with the fields ComfyUI's own load leaves (what is loaded, no lowvram)."""
    try:
        patcher.model.to(device)
    except torch.cuda.OutOfMemoryError:
        patcher.model.to(patcher.offload_device)
        _bookkeep(patcher, patcher.offload_device)
        work = getattr(patcher.model, WORK, NO_WORK)
        mm = host.optional_module("comfy.model_management")
        raise InputError(no_room(work, patcher.model_size(), mm.get_free_memory(device), mm, device)) from None
    _bookkeep(patcher, device)


def _bookkeep(patcher, device) -> None:
    patcher.model.device = torch.device(device)
    loaded = _same_device(device, patcher.load_device)
    patcher.model.model_loaded_weight_memory = patcher.model_size() if loaded else 0
    patcher.model.model_lowvram = False


@functools.cache
def vae_patcher_class():
    """A ModelPatcher that loads and unloads a VAE whole (ComfyUI must be importable)."""
    base = host.optional_module("comfy.model_patcher").ModelPatcher
    mm = host.optional_module("comfy.model_management")

    class H3VAEPatcher(base):
        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            # ComfyUI's share (`extra_memory`, 0.1 bytes with --novram) is not ours to take in part: the VAE
            # loads whole, or the stage says why it cannot.
            if self.loaded_size() >= self.model_size() and _same_device(self.model.device, device_to):
                return 0
            _check_room(self, mm, device_to)
            before = self.loaded_size()
            _move(self, device_to)
            return self.loaded_size() - before

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            _check_room(self, mm, device_to)
            _move(self, device_to)

        def partially_unload(self, device_to, memory_to_free=0):
            # All of it: what stayed would be a VAE split between devices.
            before = self.loaded_size()
            _move(self, device_to)
            return before - self.loaded_size()

    return H3VAEPatcher


# ------------------------------------------------------------------------------------------ running a stage
def guarded(work: Work, run):
    """`run()`, with CUDA running out of memory said in one line instead of a traceback."""
    try:
        return run()
    except torch.cuda.OutOfMemoryError:
        pass  # raised after the handler, so the tensors its traceback holds are freed first
    _empty_cache()
    raise InputError(f"{work.what} ran out of GPU memory (planned {gb(work.least)} beside the weights): "
                     f"{work.fix}, {CPU_VAE}")


def _empty_cache() -> None:
    mm = host.optional_module("comfy.model_management")
    if mm is not None and hasattr(mm, "soft_empty_cache"):
        mm.soft_empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def tiles_per_call(video, batch: int):
    """The video VAE decodes `batch` tiles per decoder call inside the block, its own setting after."""
    kept = video.tile_batch
    video.tile_batch = batch
    try:
        yield
    finally:
        video.tile_batch = kept


def decode_video(patcher, video, latents: torch.Tensor, tile_size: int | None, most: int) -> torch.Tensor:
    """Normalised video latents -> uint8 frames (F, H, W, 3): the VAE loaded for this decode, as many tiles per
    decoder call as the free memory holds, one per call again if CUDA runs out all the same."""
    from ..h3_model.engine.engine import Engine
    from ..kernels.settings import KernelSettings
    from ..h3_model.engine.kernel_plan import apply_vae_kernels

    load(patcher, decode_work(video, latents.shape, tile_size, most))
    # Set where it now sits (ComfyUI moves it between devices): fastest exact attention, fused passes on a GPU.
    log.debug("h3-spark video VAE kernels: %s", apply_vae_kernels(video, KernelSettings.from_env()))
    batch = tile_batch(patcher, video, latents.shape, tile_size, most)
    engine = Engine.of(vae=video)
    if batch > 1:
        try:
            with tiles_per_call(video, batch):
                return engine.decode_video(latents, tile_size)
        except torch.cuda.OutOfMemoryError:
            log.warning("h3-spark: the video decode ran out of GPU memory at %d tiles per call; one per call", batch)
        _empty_cache()
    with tiles_per_call(video, 1):
        return guarded(decode_work(video, latents.shape, tile_size, 1), lambda: engine.decode_video(latents,
                                                                                                    tile_size))
