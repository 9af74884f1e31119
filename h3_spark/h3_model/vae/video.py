"""The H3 video VAE: a causal 3-D CNN encoder and a non-causal ViT decoder.

Conventions (the released model's, as in diffusers' `AutoencoderKLMiniMaxH3`):

- Pixels are ImageNet-normalised RGB over a [0, 1] base: `(x / 255 - mean) / std` with mean
  (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225). `decode` returns that same space;
  `decode_to_buffer` reverts it, clamps to [0, 1] and stores uint8 or fp16 frames.
- Latents have `latent_channels` (24) channels. The DiT works on *normalised* latents,
  `(z - latents_mean) / latents_std`; `encode`/`decode` work on raw ones. `normalize_latents` and
  `denormalize_latents` convert between the two.
- Time: `clip_length` (17) pixel frames are encoded at a time into 5 latent frames, and
  `token_drop` (3) trailing latent frames are dropped once, so 17n+5 frames give 5n+2 latent
  frames. A single frame gives one latent frame through the exact 2-D shortcut (see `encode`), and
  one latent frame decodes alone to one picture (a still: `temporal_plan`'s one-frame window). Decoding runs 7-latent-frame windows every 5 latent frames, drops 3 leading pixel frames of
  each window and cross-fades 5 frames between windows, which inverts that geometry.
- Space: 16x. Tiling is on by default for encode and decode (256 px tiles, overlaps of at least
  64 px widened in 16 px steps round robin, linear blends), because the released frames are the
  tiled ones; untiled output differs.
- Precision: the encoder, the 1x1x1 convs, the decoder's input projection, register tokens,
  norms, residual scales and residual stream are always fp32. The decoder's attention/FFN
  linears and output projection run in the decode dtype: fp16 by default, fp32 for the exact
  path that matches the oracle.
- The module's state_dict keys are diffusers' keys, so a diffusers `vae/` folder loads as is.

Peak memory of a 124-frame 960x544 decode (37 latent frames, 34x60 latent grid, full config,
fp16 decode, uint8 output, 256 px tiles, all 15 tiles of a window in one decoder call, a
flash/memory-efficient attention kernel), computed by `decode_memory_estimate` (a test keeps these
figures equal to its output):

    weights (fp32 encoder + 1x1 convs, fp16 decoder)        5,569,131,744 B  (5.19 GiB)
    largest transient of one call (15 tiles of 1797 tokens,  2,560,782,336 B  (2.38 GiB)
      and the decoded tiles waiting to be stitched)
    window: fp32 canvas (22 kept frames), previous tail,      283,029,504 B  (0.26 GiB)
      stitching strips, uint8 chunk
    device peak                                             8,412,943,584 B  (7.84 GiB)
    host output buffer, uint8 (1, 124, 544, 960, 3)           194,273,280 B  (0.18 GiB)

Measured against that (random full-size weights, one H200, torch 2.11, 2026-11-29,
benchmarks/vae_decode_gpu.py): one tile per call peaked at 6,036,039,168 B allocated (computed
6,006,732,000) and took 3.45 s in fp16 (25.8 s in fp32); 15 tiles per call peaked at 7.98 GB
(computed 8.41) and took 3.17 s, the frames within one uint8 step of one tile per call;
encoding the same 124 frames took 7.6 s at 6.4 GB above the weights, and one 2048x3648 image
1.0 s through the 2-D shortcut against 1.45 s through the 3-D path.

The whole video exists only once, in the host buffer; nothing holds a full-video fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InputError
from ...kernels.attention import sdpa
from ...kernels.linear_fp8 import Fp8Linear
from ...kernels.settings import DEFAULT_TILE_BATCH, check_tile_batch
from ...kernels.stored_linear import StoredLinear
from .video_blocks import AttentionFn, Decoder, Encoder
from .video_config import (DECODE_DTYPES, DEFAULT_TILE_MIN_OVERLAP, DEFAULT_TILE_SIZE, FULL, IMAGENET_MEAN,
                           IMAGENET_STD, VideoVAEConfig)
from .video_tiling import blend_edge_, check_tiling, decoded_num_frames, split_tiles, stitch_tiles, temporal_plan

# --------------------------------------------------------------------------------------------
# Posterior, normalisation, pixels
# --------------------------------------------------------------------------------------------


@dataclass
class VideoPosterior:
    """Diagonal Gaussian over raw latents; logvar is clamped to [-30, 20] as in the reference."""

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> "VideoPosterior":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean, logvar.clamp(-30.0, 20.0))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None) -> torch.Tensor:
        """mean + std * noise, the noise drawn on the generator's device and then moved."""
        return self.mean + self.std * _noise_like(self.mean, generator)


def _noise_like(ref: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else ref.device
    noise = torch.randn(ref.shape, generator=generator, device=device, dtype=ref.dtype)
    return noise.to(ref.device)


def _channel_view(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    shape = [1, -1] + [1] * (like.ndim - 2)
    return torch.tensor(values, dtype=torch.float32, device=like.device).view(shape)


def normalize_latents(z: torch.Tensor, cfg: VideoVAEConfig) -> torch.Tensor:
    """Raw VAE latents -> the DiT's normalised space: (z - mean) / std per channel."""
    return (z.float() - _channel_view(cfg.latents_mean, z)) / _channel_view(cfg.latents_std, z)


def denormalize_latents(z: torch.Tensor, cfg: VideoVAEConfig) -> torch.Tensor:
    """The DiT's normalised latents -> raw VAE latents: z * std + mean per channel."""
    return z.float() * _channel_view(cfg.latents_std, z) + _channel_view(cfg.latents_mean, z)


def frames_to_vae_input(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (F, H, W, 3) or (H, W, 3) frames -> ImageNet-normalised fp32 (1, 3, F, H, W)."""
    if frames.dtype != torch.uint8 or frames.ndim not in (3, 4) or frames.shape[-1] != 3:
        raise InputError(f"frames must be uint8 (F, H, W, 3) or (H, W, 3), got {tuple(frames.shape)} {frames.dtype}")
    if frames.ndim == 3:
        frames = frames[None]
    x = frames.permute(3, 0, 1, 2)[None].float() / 255.0
    return (x - _channel_view(IMAGENET_MEAN, x)) / _channel_view(IMAGENET_STD, x)


def vae_output_to_unit(x: torch.Tensor) -> torch.Tensor:
    """Decoder output (ImageNet space) -> fp32 RGB in [0, 1]."""
    return _to_unit_(x.float().clone())


def _to_unit_(x: torch.Tensor) -> torch.Tensor:
    # In place: a decoded chunk is the size of the video's largest temporaries.
    return x.mul_(_channel_view(IMAGENET_STD, x)).add_(_channel_view(IMAGENET_MEAN, x)).clamp_(0.0, 1.0)


# --------------------------------------------------------------------------------------------
# The VAE
# --------------------------------------------------------------------------------------------


def param_dtype(name: str, decode_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a parameter: only the decoder's block linears and output projection
    follow the decode dtype; everything numerically sensitive stays fp32."""
    in_block_linear = name.startswith("decoder.transformer_blocks.") and (".attn." in name or ".ff." in name)
    return decode_dtype if in_block_linear or name.startswith("decoder.proj_out.") else torch.float32


class VideoVAE(nn.Module):
    def __init__(self, config: VideoVAEConfig = FULL) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv3d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(config.latent_channels, config.latent_channels, 1)
        self.decoder = Decoder(config)
        self.attention: AttentionFn = sdpa
        # Tiles per decoder call when a decode does not say; front doors set it (H3_VAE_TILE_BATCH).
        self.tile_batch = DEFAULT_TILE_BATCH

    @property
    def decode_dtype(self) -> torch.dtype:
        return self.decoder.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def set_decode_dtype(self, dtype: torch.dtype) -> "VideoVAE":
        if dtype not in DECODE_DTYPES.values():
            raise InputError(f"video VAE decode dtype must be float16 or float32, got {dtype}")
        fp8 = next((m for m in self.decoder.transformer_blocks.modules() if isinstance(m, Fp8Linear)), None)
        if fp8 is not None and dtype != fp8.out_dtype:
            raise InputError(f"this VAE's decoder linears are FP8 (H3_VAE_LINEAR=fp8) computing in "
                             f"{str(fp8.out_dtype).removeprefix('torch.')}; load it again to decode in "
                             f"{str(dtype).removeprefix('torch.')}")
        for name, param in self.named_parameters():
            param.data = param.data.to(param_dtype(name, dtype))
        # Quantized decoder linears keep their codes; only the dtype they are dequantized into follows.
        for module in self.decoder.transformer_blocks.modules():
            if isinstance(module, StoredLinear):
                module.out_dtype = dtype
        return self

    # ---- latent normalisation ------------------------------------------------------------

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        return normalize_latents(z, self.config)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        return denormalize_latents(z, self.config)

    # ---- encode --------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, x: torch.Tensor, *, tile_size: int | None = DEFAULT_TILE_SIZE,
               tile_min_overlap: int = DEFAULT_TILE_MIN_OVERLAP, single_frame_2d: bool = True) -> VideoPosterior:
        """ImageNet-normalised (B, 3, F, H, W) -> posterior over raw (B, C, F', H/r, W/r) latents.

        F == 1 takes the exact 2-D shortcut unless `single_frame_2d` is False (kept for the test
        that proves the shortcut). Other F are encoded in clip_length chunks, the last one padded
        by repeating the last frame, and token_drop trailing latent frames are dropped: the last clip is
        encoded from its first `tail_clip_frames` only, which give exactly the latents kept.
        """
        cfg = self.config
        self._check_pixels(x)
        check_tiling(tile_size, tile_min_overlap, cfg.spatial_ratio)
        x = x.to(device=self.device, dtype=torch.float32)
        if x.shape[2] == 1:
            frame = x[:, :, 0] if single_frame_2d else x
            moments = self._encode_tiled(frame, tile_size, tile_min_overlap)
            return VideoPosterior.from_moments(moments if moments.ndim == 5 else moments[:, :, None])
        clip, tail = cfg.clip_length, cfg.tail_clip_frames
        last = (x.shape[2] - 1) // clip * clip  # the last clip's first frame
        clips = [x[:, :, s:s + clip] for s in range(0, last, clip)]
        # The last clip is encoded from the frames its kept latents see (its first `tail`, the last frame repeated
        # where it has fewer): the latents token_drop would drop are never made, and with them the padding's work
        # (a 22-frame history encodes 17 + 5 frames, not 2 x 17).
        end = x[:, :, last:last + tail]
        if end.shape[2] < tail:
            end = torch.cat([end, end[:, :, -1:].expand(-1, -1, tail - end.shape[2], -1, -1)], dim=2)
        clips.append(end)
        moments = torch.cat([self._encode_tiled(c, tile_size, tile_min_overlap) for c in clips], dim=2)
        if tail == clip and cfg.token_drop:
            moments = moments[:, :, : moments.shape[2] - cfg.token_drop]
        return VideoPosterior.from_moments(moments)

    def _check_pixels(self, x: torch.Tensor) -> None:
        cfg = self.config
        if x.ndim != 5 or x.shape[1] != cfg.in_channels or not x.is_floating_point():
            raise InputError(f"video VAE encode expects float (B, {cfg.in_channels}, F, H, W) ImageNet-normalised "
                             f"pixels, got {tuple(x.shape)} {x.dtype}")
        r = cfg.spatial_ratio
        if x.shape[-2] % r or x.shape[-1] % r or x.shape[2] < 1:
            raise InputError(f"video VAE encode needs H and W divisible by {r} and at least one frame, "
                             f"got {x.shape[2]} frames of {x.shape[-2]}x{x.shape[-1]}")

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(x)
        if moments.ndim == 4:
            return F.conv2d(moments, self.quant_conv.weight[:, :, 0], self.quant_conv.bias)
        return self.quant_conv(moments)

    def _encode_tiled(self, x: torch.Tensor, tile_size: int | None, min_overlap: int) -> torch.Tensor:
        r = self.config.spatial_ratio
        if not tile_size:
            return self._encode_clip(x)
        ys = split_tiles(x.shape[-2], tile_size, min_overlap, r)
        xs = split_tiles(x.shape[-1], tile_size, min_overlap, r)

        def tile(i: int, j: int) -> torch.Tensor:
            y0, x0 = ys.starts[i], xs.starts[j]
            return self._encode_clip(x[..., y0:y0 + ys.sizes[i], x0:x0 + xs.sizes[j]])

        return stitch_tiles(tile, ys.scaled(r), xs.scaled(r))

    # ---- decode --------------------------------------------------------------------------

    def _check_latents(self, z: torch.Tensor) -> None:
        cfg = self.config
        if z.ndim != 5 or z.shape[1] != cfg.latent_channels or not z.is_floating_point():
            raise InputError(f"video latents must be float (B, {cfg.latent_channels}, T, h, w), "
                             f"got {tuple(z.shape)} {z.dtype}")

    @torch.no_grad()
    def _decode_window(self, z: torch.Tensor, frames: list[int], tile_size: int | None,
                       min_overlap: int, tile_batch: int = 1) -> torch.Tensor:
        """One decoder window -> fp32 raw pixels of the requested frame indices only.

        `tile_batch` tiles go through the decoder together (stacked on the batch axis); the samples
        do not interact, so only the kernels' rounding can differ from one tile at a time."""
        cfg = self.config
        r = cfg.spatial_ratio
        index = torch.tensor(frames, device=z.device)

        def run(latent: torch.Tensor) -> torch.Tensor:
            pixels = self.decoder(self.post_quant_conv(latent.float()), self.attention)
            return pixels.index_select(2, index).float()

        height, width = z.shape[-2] * r, z.shape[-1] * r
        if not tile_size:
            return run(z)
        ys = split_tiles(height, tile_size, min_overlap, r)
        xs = split_tiles(width, tile_size, min_overlap, r)

        def crop(i: int, j: int) -> torch.Tensor:
            y0, x0 = ys.starts[i] // r, xs.starts[j] // r
            return z[..., y0:y0 + ys.sizes[i] // r, x0:x0 + xs.sizes[j] // r]

        # stitch_tiles asks for the tiles in row-major order: decode the next `tile_batch` at once.
        order = [(i, j) for i in range(len(ys.starts)) for j in range(len(xs.starts))]
        ready: dict[tuple[int, int], torch.Tensor] = {}

        def tile(i: int, j: int) -> torch.Tensor:
            if (i, j) not in ready:
                first = order.index((i, j))
                group = order[first:first + tile_batch]
                pixels = run(torch.cat([crop(*cell) for cell in group]))
                for cell, piece in zip(group, pixels.split(z.shape[0])):
                    ready[cell] = piece
            return ready.pop((i, j))

        return stitch_tiles(tile, ys, xs)

    # Deliberately not decorated with no_grad: torch's generator wrapper would hold the last
    # yielded chunk, and with it the whole previous window canvas, while the next one decodes.
    def iter_decode(self, z: torch.Tensor, *, tile_size: int | None = DEFAULT_TILE_SIZE,
                    tile_min_overlap: int = DEFAULT_TILE_MIN_OVERLAP, tile_batch: int | None = None,
                    group: Any = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Raw latents (B, C, T, h, w) -> (first frame, fp32 ImageNet-space chunk (B, 3, n, H, W))
        in frame order; the chunks tile [0, decoded_num_frames(T)) exactly. Each chunk is fresh
        memory the caller may overwrite in place.

        With a torch.distributed `group`, the decoder windows are shared out among its ranks
        (window i on rank i % world) and broadcast, so every rank yields the same chunks as a
        one-process decode, bit for bit: the windows are independent and the cross-fades run
        in the same order everywhere."""
        self._check_latents(z)
        check_tiling(tile_size, tile_min_overlap, self.config.spatial_ratio)
        tile_batch = self.tile_batch if tile_batch is None else check_tile_batch(tile_batch)
        cfg = self.config
        plan = temporal_plan(cfg, z.shape[2])
        z = z.to(device=self.device, dtype=torch.float32)
        if plan.pad_tokens:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)], dim=2)
        frames = list(range(plan.main.start, plan.main.stop))
        if plan.tail is not None:
            frames += list(range(plan.tail.start, plan.tail.stop))
        main_len = plan.main.stop - plan.main.start

        def window(i: int) -> torch.Tensor:
            start = i * cfg.tokens_chunk_size
            return self._decode_window(z[:, :, start:start + plan.window], frames, tile_size, tile_min_overlap,
                                       tile_batch)

        if group is not None:
            r = cfg.spatial_ratio
            shape = (z.shape[0], cfg.out_channels, len(frames), z.shape[-2] * r, z.shape[-1] * r)
            window = _shared_windows(window, plan.num_chunks, shape, self.device, group)
        written, tail = 0, None
        for i in range(plan.num_chunks):
            pixels = window(i)
            chunk = pixels[:, :, :main_len]
            if tail is not None:
                blend_edge_(tail, chunk, cfg.frame_overlap, dim=2)
            tail = pixels[:, :, main_len:].clone() if plan.tail is not None else None
            written = yield from _emit(chunk, written, plan.num_frames)
            # Unbound before the next window is decoded, or two canvases would coexist.
            del pixels, chunk
        if tail is not None:
            yield from _emit(tail, written, plan.num_frames)

    def decode(self, z: torch.Tensor, **tiling: Any) -> torch.Tensor:
        """Raw latents -> fp32 ImageNet-space video (B, 3, F, H, W), like diffusers' `decode`.

        Holds the whole video in fp32: for tests and short clips. Use `decode_to_buffer` for
        real videos.
        """
        return torch.cat([chunk for _, chunk in self.iter_decode(z, **tiling)], dim=2)

    def decode_to_buffer(self, z: torch.Tensor, *, out: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.uint8,
                         on_frames: Callable[[torch.Tensor], None] | None = None, **tiling: Any) -> torch.Tensor:
        """Raw latents -> RGB frames (B, F, H, W, 3) written chunk by chunk into one host buffer.

        uint8 holds round(255 * rgb); fp16 holds rgb in [0, 1]. `out` may be a preallocated
        (e.g. pinned) buffer of the right shape and dtype. `on_frames` gets each finished chunk of the
        buffer, (B, n, H, W, 3) in frame order, as soon as it is stored (an encoder can start on it while
        the next window decodes); the buffer is not written there again.
        """
        self._check_latents(z)
        shape = self.decoded_shape(z.shape)
        if out is None:
            if out_dtype not in (torch.uint8, torch.float16):
                raise InputError(f"decode buffer dtype must be uint8 or float16, got {out_dtype}")
            out = torch.empty(shape, dtype=out_dtype)
        elif tuple(out.shape) != shape or out.dtype not in (torch.uint8, torch.float16):
            raise InputError(f"decode buffer must be uint8/float16 {shape}, got {tuple(out.shape)} {out.dtype}")
        for start, chunk in self.iter_decode(z, **tiling):
            n = _store_rgb(out, start, chunk)
            if on_frames is not None:
                on_frames(out[:, start:start + n])
            # The chunk is a view of the window canvas; unbound, the canvas is freed before the
            # generator decodes the next window.
            del chunk
        return out

    def decoded_shape(self, latent_shape: Sequence[int]) -> tuple[int, int, int, int, int]:
        b, _, t, h, w = latent_shape
        r = self.config.spatial_ratio
        return (b, decoded_num_frames(self.config, t), h * r, w * r, self.config.out_channels)


def _store_rgb(out: torch.Tensor, start: int, chunk: torch.Tensor) -> int:
    """Store one decoded chunk (B, C, n, H, W) at frame `start`; returns n."""
    rgb = _to_unit_(chunk)
    rgb = rgb.mul_(255.0).round_().to(torch.uint8) if out.dtype == torch.uint8 else rgb.to(out.dtype)
    frames, dest = rgb.permute(0, 2, 3, 4, 1), out[:, start:start + rgb.shape[2]]
    if frames.is_cuda and dest.device.type == "cpu" and not dest.is_pinned():
        # Into pageable memory the driver copies through its own small staging: 0.31 s of a 4.44 s 1344x768x124
        # decode on an H100 (receipts/h100/vae-decode-1344x768x124-profile-5276138.json). Through one page-locked
        # chunk (the host allocator reuses it chunk after chunk) the device copy runs at full speed and the rest
        # is a host memcpy.
        staged = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
        staged.copy_(frames)
        frames = staged
    dest.copy_(frames)
    return rgb.shape[2]


def _shared_windows(window: Callable[[int], torch.Tensor], count: int, shape: tuple[int, ...], device,
                    group) -> Callable[[int], torch.Tensor]:
    """Window i is decoded on rank i % world and broadcast; rounds of `world` windows keep at most
    one round in memory. Every rank must ask for the windows in order 0, 1, 2, ..."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held: dict[int, torch.Tensor] = {}

    def get(i: int) -> torch.Tensor:
        if i not in held:
            first = i - i % world
            mine = first + rank
            own = window(mine) if mine < count else None
            for j in range(first, min(first + world, count)):
                owner = j % world
                buf = own.contiguous() if owner == rank else torch.empty(shape, dtype=torch.float32, device=device)
                dist.broadcast(buf, src=dist.get_global_rank(group, owner) if group is not dist.group.WORLD
                               else owner, group=group)
                held[j] = buf
        return held.pop(i)

    return get


def _emit(chunk: torch.Tensor, written: int, total: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield the part of `chunk` that still fits before `total` frames; returns the new count."""
    keep = min(chunk.shape[2], total - written)
    if keep > 0:
        yield written, chunk[:, :, :keep]
    return written + max(keep, 0)


# The released recipe samples every visual condition under its own generator with this seed, so a reference
# encodes to the same latents in every request.
CONDITION_SEED = 42


@torch.no_grad()
def encode_condition(vae: VideoVAE, frames: torch.Tensor, *, seed: int = CONDITION_SEED,
                     tile_size: int | None = DEFAULT_TILE_SIZE) -> torch.Tensor:
    """Keyframes / image or video references -> normalised conditioning latents (1, C, T, h, w).

    The released recipe: ImageNet-normalise, *sample* the posterior under a fresh CPU generator
    seeded `seed`, round the sample through fp16, normalise with latents_mean/std. fp32 on CPU.
    """
    posterior = vae.encode(frames_to_vae_input(frames), tile_size=tile_size)
    latents = posterior.sample(torch.Generator().manual_seed(seed))
    latents = latents.to(torch.float16).float().cpu()
    return normalize_latents(latents, vae.config)


# --------------------------------------------------------------------------------------------
# Memory arithmetic (what the module docstring quotes)
# --------------------------------------------------------------------------------------------


def parameter_bytes(cfg: VideoVAEConfig, decode_dtype: torch.dtype) -> int:
    with torch.device("meta"):
        model = VideoVAE(cfg)
    itemsize = {torch.float32: 4, torch.float16: 2}
    return sum(p.numel() * itemsize[param_dtype(n, decode_dtype)] for n, p in model.named_parameters())


def decode_memory_estimate(cfg: VideoVAEConfig, num_latent_frames: int, latent_height: int, latent_width: int, *,
                           decode_dtype: torch.dtype = torch.float16, out_dtype: torch.dtype = torch.uint8,
                           tile_size: int | None = DEFAULT_TILE_SIZE,
                           tile_batch: int = DEFAULT_TILE_BATCH) -> dict[str, int]:
    """Bytes held at the peak of `decode_to_buffer` for one video, by term.

    With S tokens per decoder call (window grid + registers + zero token), width D, FFN width I
    and compute-dtype bytes c, the largest transient of one call is the biggest of
      attention: fp32 residual + normed input (fp32 then c) + q/k/v + fp32 QK-norm in/out + RoPE copies
      FFN:       fp32 residual + normed input + fused up projection (S x 2I) + silu(gate) and product (S x I each)
      head:      fp32 residual + LayerNorm (fp32, c) + proj_out output and its unpatchified copy
                 (all window frames) + the kept frames in c and fp32
    attention itself being O(S*D) with a flash or memory-efficient kernel, times the tiles decoded
    together (`tile_batch`, at most the tiles of a window). Alongside it live the
    window's fp32 canvas of kept frames, the previous window's fp32 tail, the stitching state (a
    row of raw bottom strips, the left neighbour's raw strip, the last blended tile); a finished
    chunk is converted in place and only its uint8/fp16 copy is new.
    """
    c = 2 if decode_dtype == torch.float16 else 4
    r, rt = cfg.spatial_ratio, cfg.temporal_ratio
    plan = temporal_plan(cfg, num_latent_frames)
    height, width = latent_height * r, latent_width * r
    tile_h = min(tile_size, height) if tile_size else height
    tile_w = min(tile_size, width) if tile_size else width
    s = plan.window * (tile_h // r) * (tile_w // r) + cfg.decoder_num_register_tokens + 1
    sd, si = s * cfg.decoder_dim, s * cfg.decoder_dim * cfg.decoder_ffn_mult
    main = plan.main.stop - plan.main.start
    tail = (plan.tail.stop - plan.tail.start) if plan.tail else 0
    plane = cfg.out_channels * tile_h * tile_w
    attention = sd * (4 + 4 + c + 3 * c + 2 * 4 + 2 * c)
    ffn = sd * (4 + 4 + c) + 2 * si * c + 2 * si * c
    head = sd * (4 + 4 + c) + 2 * plane * plan.window * rt * c + plane * (main + tail) * (c + 4)
    frame = cfg.out_channels * height * width
    out_item = 1 if out_dtype == torch.uint8 else 2
    columns = len(split_tiles(width, tile_w, DEFAULT_TILE_MIN_OVERLAP, r).starts) if tile_size else 1
    overlap_h = max(split_tiles(height, tile_h, DEFAULT_TILE_MIN_OVERLAP, r).overlaps, default=0)
    overlap_w = max(split_tiles(width, tile_w, DEFAULT_TILE_MIN_OVERLAP, r).overlaps, default=0)
    kept = cfg.out_channels * (main + tail) * 4
    stitching = kept * (columns * overlap_h * tile_w + tile_h * overlap_w + tile_h * tile_w)
    window = frame * (main + 2 * tail) * 4 + 2 * frame * main * out_item + stitching
    weights = parameter_bytes(cfg, decode_dtype)
    rows = len(split_tiles(height, tile_h, DEFAULT_TILE_MIN_OVERLAP, r).starts) if tile_size else 1
    batch = min(tile_batch, rows * columns)
    # The batch's other decoded tiles wait, fp32 and of the kept frames, until stitching takes them.
    waiting = (batch - 1) * plane * (main + tail) * 4
    transient = batch * max(attention, ffn, head) + waiting
    return {"weights": weights, "transient": transient, "window": window,
            "device_peak": weights + transient + window,
            "host_buffer": frame * plan.num_frames * out_item}
