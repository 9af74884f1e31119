"""Where the video VAE cuts its work: spatial tiles with blended overlaps, and temporal windows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import InputError
from .video_config import VideoVAEConfig

# --------------------------------------------------------------------------------------------
# Spatial tiling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileAxis:
    """Tile starts, sizes and the overlaps between neighbours along one axis, in one unit."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    overlaps: tuple[int, ...]

    def scaled(self, divisor: int) -> "TileAxis":
        return TileAxis(*(tuple(v // divisor for v in part) for part in (self.starts, self.sizes, self.overlaps)))


def split_tiles(length: int, tile: int, min_overlap: int, step: int) -> TileAxis:
    """Fewest `tile`-wide tiles covering `length` with overlaps >= min_overlap; the slack widens
    the overlaps in `step` increments round robin so tiles end exactly at `length`."""
    if tile >= length:
        return TileAxis((0,), (length,), ())
    count = math.ceil(length / tile)
    while tile * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile * count - min_overlap * (count - 1) - length
    for i in range(slack // step):
        overlaps[i % (count - 1)] += step
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return TileAxis(tuple(starts), (tile,) * count, tuple(overlaps))


def blend_edge_(a_tail: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` slices of a linearly into the first ones of b, in place on b."""
    extent = min(a_tail.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    shape = [1] * b.ndim
    shape[dim] = extent
    ramp = (torch.arange(extent, device=b.device, dtype=b.dtype) / extent).view(shape)
    head = b.narrow(dim, 0, extent)
    head.copy_(a_tail.narrow(dim, a_tail.shape[dim] - extent, extent) * (1 - ramp) + head * ramp)
    return b


def stitch_tiles(tile_fn: Callable[[int, int], torch.Tensor], ys: TileAxis, xs: TileAxis) -> torch.Tensor:
    """Blend tiles (..., h, w) from `tile_fn(row, col)` into one (..., H, W) tensor, one at a time.

    A tile blends with the *raw* tile above and the *raw* tile to its left (not their blended
    versions), then loses its bottom/right overlap to the next tile. Only those raw edge strips
    are kept between tiles, never a whole row of tiles. `tile_fn` must return fresh tensors: they
    are blended in place.
    """
    out = None
    above: list[torch.Tensor | None] = [None] * len(xs.starts)
    for i, y0 in enumerate(ys.starts):
        below: list[torch.Tensor | None] = [None] * len(xs.starts)
        left = None
        last_row = i == len(ys.starts) - 1
        for j, x0 in enumerate(xs.starts):
            last_col = j == len(xs.starts) - 1
            tile = tile_fn(i, j)
            height = tile.shape[-2] - (0 if last_row else ys.overlaps[i])
            width = tile.shape[-1] - (0 if last_col else xs.overlaps[j])
            left_of_next = None if last_col else tile[..., width:].clone()
            if not last_row:
                below[j] = tile[..., height:, :].clone()
            if i > 0:
                blend_edge_(above[j], tile, ys.overlaps[i - 1], dim=-2)
            if j > 0:
                blend_edge_(left, tile, xs.overlaps[j - 1], dim=-1)
            left = left_of_next
            if out is None:
                out = tile.new_empty(*tile.shape[:-2], ys.starts[-1] + ys.sizes[-1], xs.starts[-1] + xs.sizes[-1])
            out[..., y0:y0 + height, x0:x0 + width] = tile[..., :height, :width]
        above = below
    return out




def check_tiling(tile_size: int | None, min_overlap: int, ratio: int) -> None:
    if not tile_size:
        return
    if tile_size % ratio or min_overlap % ratio or tile_size <= min_overlap:
        raise InputError(f"tile size {tile_size} px must be a multiple of {ratio} and larger than the "
                         f"{min_overlap} px minimum overlap (0 disables tiling)")


# --------------------------------------------------------------------------------------------
# Temporal plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemporalPlan:
    """How a latent video of `num_latent_frames` is cut into decoder windows."""

    pad_tokens: int
    num_chunks: int
    window: int          # latent frames per decoder call
    main: slice          # pixel frames of a window emitted as the chunk
    tail: slice | None   # pixel frames cross-faded into the next chunk's head
    num_frames: int      # pixel frames after the padding is cut off


def temporal_plan(cfg: VideoVAEConfig, num_latent_frames: int) -> TemporalPlan:
    step, drop, rt = cfg.tokens_chunk_size, cfg.token_drop, cfg.temporal_ratio
    if num_latent_frames == 1:
        # A still: its one latent frame alone through the decoder, keeping the frame a video's first latent frame
        # keeps (frame_pre_padding of its temporal_ratio frames: the last, 3 of 4, in the released geometry, as
        # ComfyUI's single-image decode keeps). Not the first frame of a longer decode: the decoder attends across
        # a window's latent frames, so that frame also depends on the frames after it.
        pre = cfg.frame_pre_padding
        return TemporalPlan(0, 1, 1, slice(pre, pre + 1), None, 1)
    pad = (-(num_latent_frames + drop)) % step
    chunks = (num_latent_frames + drop + pad) // step - int(drop > 0)
    if chunks < 1:
        raise InputError(f"video latents need at least {step - drop + 1} frames to decode, got {num_latent_frames}")
    window = step + cfg.token_overlap
    window_frames = window * rt
    chunk_frames = step * rt
    pre = cfg.frame_pre_padding
    main = slice(pre, min(chunk_frames, window_frames))
    tail = slice(chunk_frames + pre, min(2 * chunk_frames, window_frames)) if drop > 0 else None
    emitted = chunks * (main.stop - main.start) + (tail.stop - tail.start if tail else 0)
    # A padded latent frame adds temporal_ratio pixel frames, except one that closes an encoder
    # clip, which only covers clip_length % temporal_ratio frames.
    intra = cfg.clip_length % rt
    pad_frames = sum(intra if intra and (num_latent_frames + k) % step == 0 else rt for k in range(pad))
    return TemporalPlan(pad, chunks, window, main, tail, emitted - pad_frames)


def decoded_num_frames(cfg: VideoVAEConfig, num_latent_frames: int) -> int:
    return temporal_plan(cfg, num_latent_frames).num_frames


def encoded_num_frames(cfg: VideoVAEConfig, num_frames: int) -> int:
    """Latent frames `encode` returns for `num_frames` pixel frames."""
    if num_frames == 1:
        return 1
    clips = math.ceil(num_frames / cfg.clip_length)
    per_clip = cfg.clip_length
    for factor in cfg.temporal_downsample_factors:
        per_clip = (per_clip - 1) // factor + 1
    return clips * per_clip - cfg.token_drop
