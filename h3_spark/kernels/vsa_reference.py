"""Video Sparse Attention (VSA) over H3's packed sequence, in plain PyTorch: the reference the kernel is held to.

FastVideo's FastH3 students (DMD2 distillations of H3) were trained with this attention in every DiT block:
1. tile the packed sequence: each run of rows before the target video (the text, condition video rows, audio;
   `layout.segments_before_video`) is cut into tiles of `tile` rows, the last one shorter, so that no tile
   mixes two runs; the target video is cut into 3-D tiles of latent patches (4x4x4 for 64-row tiles), the
   tiles at its far edges smaller;
2. pool: the mean of q, k and v over each tile (fp32);
3. coarse attention: softmax(q_tile . k_tile / sqrt(D)) over all tiles;
4. selection per query tile: the top-k video key tiles by that coarse score, k = ceil((1 - sparsity) x video
   tiles) (at least 1); every non-video key tile is always kept, and the non-video query tiles keep every tile,
   so text and audio rows attend densely (FastVideo's default "exempt" mode);
5. fine attention: each query row attends to the rows of its tile's selected key tiles only;
6. the coarse output of each tile (its pooled values weighted by the coarse attention) is broadcast to the
   tile's rows, multiplied by the block's learned gate (`attn.to_gate_compress` of the attention input, one
   value per row, head and channel) and added.
At sparsity 0 every tile is selected and step 5 is the dense attention; a zero gate leaves step 5 alone.
Inference only (no gradients are kept). The Triton kernel of step 5 is in vsa.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError

# Rows per tile -> the 3-D tile of latent patches (t, h, w) it covers in the target video (FastVideo's shapes:
# 64 is what FastH3 was trained with; 128 and 256 are its other geometries).
TILE_SHAPES: dict[int, tuple[int, int, int]] = {64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8)}
# Query rows per chunk of the reference's fine attention: bounds its (B, H, chunk, S) fp32 scores.
QUERY_CHUNK = 1024


@dataclass(frozen=True)
class TileMap:
    """Where every packed row goes among the tiles: prefix tiles first, in row order, then the video tiles in
    (t, h, w) tile order, each tile's rows in (t, h, w) order within it."""

    tile: int  # rows of a full tile
    sizes: torch.Tensor  # (n,) int64: rows each tile holds (1..tile)
    row_tile: torch.Tensor  # (S,) int64: the tile of each packed row
    slot: torch.Tensor  # (S,) int64: the row's place in a padded buffer of n x tile rows
    num_prefix_tiles: int
    rows: torch.Tensor  # (n, tile) int32: the packed row in each place of each tile, -1 in the padding

    @property
    def num_tiles(self) -> int:
        return int(self.sizes.numel())

    @property
    def num_video_tiles(self) -> int:
        return self.num_tiles - self.num_prefix_tiles

    @property
    def sequence_length(self) -> int:
        return int(self.row_tile.numel())

    def to(self, device) -> "TileMap":
        return TileMap(self.tile, self.sizes.to(device), self.row_tile.to(device), self.slot.to(device),
                       self.num_prefix_tiles, self.rows.to(device))


def tile_shape(tile: int) -> tuple[int, int, int]:
    if tile not in TILE_SHAPES:
        raise InputError(f"VSA tiles hold {', '.join(map(str, TILE_SHAPES))} rows, not {tile}")
    return TILE_SHAPES[tile]


def tile_map(prefix_segments: tuple[int, ...], video_shape: tuple[int, int, int], tile: int = 64) -> TileMap:
    """The tiling of a packed sequence of `prefix_segments` rows (in order) followed by a target video of
    `video_shape` = (frames, rows, columns) latent patches, frame-major then row-major."""
    tt, th, tw = tile_shape(tile)
    t, h, w = (int(x) for x in video_shape)
    if min(t, h, w) < 1 or any(int(s) < 0 for s in prefix_segments):
        raise InputError(f"cannot tile a video of {video_shape} patches after segments {prefix_segments}")
    sizes, row_tile = [], []
    for segment in (int(s) for s in prefix_segments if int(s) > 0):
        full, rest = divmod(segment, tile)
        parts = [tile] * full + ([rest] if rest else [])
        for size in parts:
            row_tile.append(torch.full((size,), len(sizes), dtype=torch.long))
            sizes.append(size)
    num_prefix = len(sizes)
    prefix_rows = sum(sizes)

    # Video: pad the patch grid up to whole tiles, mark the padding, and read it tile by tile.
    nt, nh, nw = -(-t // tt), -(-h // th), -(-w // tw)
    grid = torch.full((nt * tt, nh * th, nw * tw), -1, dtype=torch.long)
    grid[:t, :h, :w] = torch.arange(t * h * w).reshape(t, h, w)
    by_tile = grid.reshape(nt, tt, nh, th, nw, tw).permute(0, 2, 4, 1, 3, 5).reshape(nt * nh * nw, tile)
    valid = by_tile >= 0
    video_sizes = valid.sum(1)
    rank = valid.cumsum(1) - 1  # a row's place among its tile's rows (the padding is skipped)
    video_tile = torch.arange(by_tile.shape[0])[:, None].expand_as(by_tile)
    order = by_tile[valid]  # video rows in tiled order
    video_row_tile = torch.empty(t * h * w, dtype=torch.long)
    video_row_tile[order] = video_tile[valid] + num_prefix
    video_rank = torch.empty(t * h * w, dtype=torch.long)
    video_rank[order] = rank[valid]

    all_sizes = torch.cat([torch.tensor(sizes, dtype=torch.long), video_sizes])
    prefix_tile = torch.cat(row_tile) if row_tile else torch.zeros(0, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), all_sizes.cumsum(0)[:-1]])
    prefix_rank = torch.arange(prefix_rows) - starts[prefix_tile]
    row_tiles = torch.cat([prefix_tile, video_row_tile])
    slots = row_tiles * tile + torch.cat([prefix_rank, video_rank])
    rows = torch.full((len(all_sizes) * tile,), -1, dtype=torch.int32)
    rows[slots] = torch.arange(len(row_tiles), dtype=torch.int32)
    return TileMap(tile, all_sizes, row_tiles, slots, num_prefix, rows.view(-1, tile))


def video_tiles_kept(sparsity: float, num_video_tiles: int) -> int:
    """Video key tiles each query tile keeps: ceil((1 - sparsity) x tiles), at least 1 (FastVideo's rule)."""
    return max(1, min(math.ceil((1.0 - sparsity) * num_video_tiles), num_video_tiles))


def pooled(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """Mean of x (B, S, H, D) over each tile's rows, fp32: (B, H, n, D)."""
    b, _, h, d = x.shape
    sums = x.new_zeros((b, tiles.num_tiles, h, d), dtype=torch.float32).index_add_(1, tiles.row_tile, x.float())
    return (sums / tiles.sizes.to(torch.float32)[None, :, None, None]).transpose(1, 2)


def coarse_scores(q: torch.Tensor, k: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """Scaled dot products of the pooled queries and keys, fp32: (B, H, n, n)."""
    return pooled(q, tiles) @ pooled(k, tiles).transpose(-1, -2) / math.sqrt(q.shape[-1])


def select_tiles(scores: torch.Tensor, num_prefix_tiles: int, sparsity: float) -> torch.Tensor:
    """Which key tiles each query tile attends to (B, H, n, n) bool: the top video tiles by coarse score, every
    prefix tile, and everything for a prefix query tile."""
    n = scores.shape[-1]
    num_video = n - num_prefix_tiles
    keep = video_tiles_kept(sparsity, num_video) if num_video else 0
    if keep == num_video:
        return torch.ones_like(scores, dtype=torch.bool)
    top = scores[..., num_prefix_tiles:].topk(keep, dim=-1).indices + num_prefix_tiles
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    mask[..., :num_prefix_tiles] = True
    mask[:, :, :num_prefix_tiles, :] = True
    return mask


def fine_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   tiles: TileMap) -> torch.Tensor:
    """Each row's attention over the rows of its tile's selected key tiles, fp32 math, in v's dtype."""
    b, s, h, d = q.shape
    out = torch.empty(b, s, h, d, dtype=torch.float32, device=q.device)
    kf, vf = k.float(), v.float()
    for start in range(0, s, QUERY_CHUNK):
        rows = slice(start, min(start + QUERY_CHUNK, s))
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, rows].float(), kf) / math.sqrt(d)
        allowed = mask[:, :, tiles.row_tile[rows]][..., tiles.row_tile]  # (B, H, chunk, S)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[:, rows] = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(v.dtype)


def add_gated_coarse(fine: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, gate: torch.Tensor | None,
                     tiles: TileMap) -> torch.Tensor:
    """fine + gate x (the tile's coarse output, broadcast to its rows), in the output's dtype, added into `fine`
    in place (the same two roundings as out of place, without two more (B, S, H, D) temporaries: at S = 104,222
    the whole render runs within a few GB of the card); fine alone without a gate. `values`: the pooled v
    (B, H, n, D)."""
    if gate is None:
        return fine
    coarse = scores.softmax(-1) @ values  # (B, H, n, D) fp32
    rows = coarse.transpose(1, 2).to(fine.dtype)[:, tiles.row_tile]  # (B, S, H, D)
    return fine.add_(rows.mul_(gate.to(fine.dtype)))


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None,
                 tiles: TileMap) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise InputError("VSA takes q, k and v as tensors; FP8-quantized heads (attention fa3_fp8) cannot run it")
    if q.shape != k.shape or q.shape[:3] != v.shape[:3] or q.ndim != 4:
        raise InputError(f"VSA takes q, k, v of one (B, S, H, D) shape, got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if q.shape[1] != tiles.sequence_length:
        raise InputError(f"the VSA tiles were made for {tiles.sequence_length} rows, this attention has {q.shape[1]}")
    if gate is not None and gate.shape != v.shape:
        raise InputError(f"the VSA gate must be shaped like v {list(v.shape)}, got {list(gate.shape)}")


@torch.no_grad()
def vsa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, tiles: TileMap,
                  sparsity: float) -> torch.Tensor:
    """VSA of (B, S, H, D) q, k, v in packed row order, with the block's gate (B, S, H, D) or None."""
    check_inputs(q, k, v, gate, tiles)
    tiles = tiles.to(q.device)
    scores = coarse_scores(q, k, tiles)
    mask = select_tiles(scores, tiles.num_prefix_tiles, sparsity)
    values = pooled(v, tiles) if gate is not None else None
    return add_gated_coarse(fine_reference(q, k, v, mask, tiles), scores, values, gate, tiles)
