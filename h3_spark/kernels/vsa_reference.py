"""Video Sparse Attention (VSA) over H3's packed sequence, in plain PyTorch: the reference the kernel is held to.

FastVideo's FastH3 students (DMD2 distillations of H3) were trained with this attention in every DiT block:
1. tile the packed sequence: each run of rows before the target video (the text, condition video rows, audio;
   `layout.segments_before_video`) is cut into tiles of `tile` rows, the last one shorter, so that no tile
   mixes two runs (the dense "sink" tiles); the target video is cut into 3-D tiles of latent patches (4x4x4
   for 64-row tiles), the tiles at its far edges smaller. In a window that goes on from a history, the
   history's video and its guides' (`VideoRun`s, on the target's patch grid) are cut into 3-D tiles of their
   own the same way: the context tiles;
2. pool: the mean of q, k and v over each tile (fp32);
3. coarse attention: softmax(q_tile . k_tile / sqrt(D)) over all tiles;
4. selection per query tile: the top-k video key tiles (context and target alike) by that coarse score,
   k = ceil((1 - sparsity) x target tiles) (at least 1; FastVideo's rule, counted on the target so that context
   tiles take places in a query tile's budget rather than adding to it; a k that keeps the whole target keeps
   every tile); every dense key tile is always kept, and the dense query tiles keep every tile, so text, audio
   and references attend densely (FastVideo's default "exempt" mode); a context query tile selects as a target
   one does;
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
class VideoRun:
    """A run of `frames` latent frames of video rows before the target, on the target's own (rows, columns)
    patch grid, frame-major then row-major: a window's history or one of its guides. Tiled in 3-D like the
    target, its tiles are selected like the target's instead of attending densely. `follows`: its frames come
    right after the first run's in time (a film's first-frame guide after its history), so the two are tiled as
    one video, whose 4-frame slabs may span both."""

    frames: int
    follows: bool = False


@dataclass(frozen=True)
class TileMap:
    """Where every packed row goes among the tiles: the dense (prefix) tiles first, in row order, then the
    tiles of the video runs before the target (`VideoRun`: the context tiles), run by run, then the target's,
    each run's tiles in (t, h, w) tile order and each tile's rows in (t, h, w) order within it."""

    tile: int  # rows of a full tile
    sizes: torch.Tensor  # (n,) int64: rows each tile holds (1..tile)
    row_tile: torch.Tensor  # (S,) int64: the tile of each packed row
    slot: torch.Tensor  # (S,) int64: the row's place in a padded buffer of n x tile rows
    num_prefix_tiles: int
    rows: torch.Tensor  # (n, tile) int32: the packed row in each place of each tile, -1 in the padding
    num_context_tiles: int = 0  # the video runs' tiles before the target's (selected like the target's)
    padding: torch.Tensor | None = None  # (p,) int64: the padded buffer's places no row goes to (from `rows`)

    def __post_init__(self) -> None:
        if self.padding is None:  # derived once, where the map is built (on the host: no device sync later)
            object.__setattr__(self, "padding", (self.rows.flatten() < 0).nonzero().flatten())

    @property
    def num_tiles(self) -> int:
        return int(self.sizes.numel())

    @property
    def num_video_tiles(self) -> int:
        """Every tile the selection chooses among: the context tiles and the target's."""
        return self.num_tiles - self.num_prefix_tiles

    @property
    def num_target_tiles(self) -> int:
        return self.num_video_tiles - self.num_context_tiles

    @property
    def sequence_length(self) -> int:
        return int(self.row_tile.numel())

    def to(self, device) -> "TileMap":
        return TileMap(self.tile, self.sizes.to(device), self.row_tile.to(device), self.slot.to(device),
                       self.num_prefix_tiles, self.rows.to(device), self.num_context_tiles,
                       None if self.padding is None else self.padding.to(device))


def tile_shape(tile: int) -> tuple[int, int, int]:
    if tile not in TILE_SHAPES:
        raise InputError(f"VSA tiles hold {', '.join(map(str, TILE_SHAPES))} rows, not {tile}")
    return TILE_SHAPES[tile]


def _run_tiles(start: int, size: int, tile: int) -> torch.Tensor:
    """A dense run of `size` rows from packed row `start` cut into tiles of `tile` rows, the last one shorter:
    (tiles, tile) packed rows, -1 in the padding."""
    places = torch.arange(-(-size // tile) * tile)
    return torch.where(places < size, places + start, -1).view(-1, tile)


def _cube_tiles(video: torch.Tensor, tile: int) -> torch.Tensor:
    """A video given as the packed row of each of its (frames, rows, columns) patches, cut into 3-D tiles (the
    tiles at its far edges smaller), in (t, h, w) tile order: (tiles, tile) packed rows, each tile's real rows
    first in (t, h, w) order, -1 in the padding after them."""
    tt, th, tw = tile_shape(tile)
    t, h, w = video.shape
    nt, nh, nw = -(-t // tt), -(-h // th), -(-w // tw)
    grid = torch.full((nt * tt, nh * th, nw * tw), -1, dtype=torch.long)
    grid[:t, :h, :w] = video
    by_tile = grid.reshape(nt, tt, nh, th, nw, tw).permute(0, 2, 4, 1, 3, 5).reshape(nt * nh * nw, tile)
    real_first = torch.argsort((by_tile < 0).to(torch.uint8), dim=1, stable=True)
    return by_tile.gather(1, real_first)


def tile_map(prefix_segments: tuple, video_shape: tuple[int, int, int], tile: int = 64) -> TileMap:
    """The tiling of a packed sequence of `prefix_segments` (in row order: a number of rows, a dense run, or a
    `VideoRun`) followed by a target video of `video_shape` = (frames, rows, columns) latent patches,
    frame-major then row-major. A dense run is cut into tiles of `tile` rows, the last one shorter, so that no
    tile mixes two runs; a video run and the target into 3-D tiles (4x4x4 patches for 64-row tiles)."""
    tile_shape(tile)
    t, h, w = (int(x) for x in video_shape)
    lengths = [int(s.frames if isinstance(s, VideoRun) else s) for s in prefix_segments]
    if min(t, h, w) < 1 or any(n < 0 for n in lengths):
        raise InputError(f"cannot tile a video of {video_shape} patches after segments {prefix_segments}")
    dense, videos, start = [], [], 0  # videos: each context video's frames (a list of (f, h, w) row grids)
    for segment in prefix_segments:
        if isinstance(segment, VideoRun):
            size = int(segment.frames) * h * w
            frames = (torch.arange(size) + start).view(-1, h, w)
            if segment.follows and videos:
                videos[0].append(frames)
            elif size:
                videos.append([frames])
        else:
            size = int(segment)
            if size:
                dense.append(_run_tiles(start, size, tile))
        start += size
    context = [_cube_tiles(torch.cat(parts), tile) for parts in videos]
    target = (torch.arange(t * h * w) + start).view(t, h, w)
    parts = dense + context + [_cube_tiles(target, tile)]
    rows = torch.cat(parts)
    flat = rows.flatten()
    real = flat >= 0
    slots = torch.empty(start + t * h * w, dtype=torch.long)
    slots[flat[real]] = torch.arange(flat.numel())[real]
    return TileMap(tile, real.view_as(rows).sum(1), slots // tile, slots, sum(len(p) for p in dense),
                   rows.to(torch.int32), sum(len(p) for p in context))


def video_tiles_kept(sparsity: float, num_video_tiles: int) -> int:
    """Video key tiles each query tile keeps: ceil((1 - sparsity) x tiles), at least 1 (FastVideo's rule)."""
    return max(1, min(math.ceil((1.0 - sparsity) * num_video_tiles), num_video_tiles))


def tiles_selected(sparsity: float, num_video_tiles: int, num_context_tiles: int = 0) -> int:
    """Video key tiles each query tile keeps among `num_video_tiles` (the context tiles and the target's): the
    target's budget, `video_tiles_kept` of the target tiles, so that a window with a history or guides as
    context tiles keeps as many key tiles per query tile as a window without them; a budget that keeps the
    whole target (sparsity 0) keeps every tile, the dense attention."""
    if not num_video_tiles:
        return 0
    target = num_video_tiles - num_context_tiles
    keep = video_tiles_kept(sparsity, target)
    return num_video_tiles if keep == target else keep


def pooled(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """Mean of x (B, S, H, D) over each tile's rows, fp32: (B, H, n, D)."""
    b, _, h, d = x.shape
    sums = x.new_zeros((b, tiles.num_tiles, h, d), dtype=torch.float32).index_add_(1, tiles.row_tile, x.float())
    return (sums / tiles.sizes.to(torch.float32)[None, :, None, None]).transpose(1, 2)


def coarse_scores(q: torch.Tensor, k: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """Scaled dot products of the pooled queries and keys, fp32: (B, H, n, n)."""
    return pooled(q, tiles) @ pooled(k, tiles).transpose(-1, -2) / math.sqrt(q.shape[-1])


def select_tiles(scores: torch.Tensor, num_prefix_tiles: int, sparsity: float,
                 num_context_tiles: int = 0) -> torch.Tensor:
    """Which key tiles each query tile attends to (B, H, n, n) bool: the top video tiles (context and target
    alike, `tiles_selected` of them) by coarse score, every prefix tile, and everything for a prefix query
    tile."""
    n = scores.shape[-1]
    num_video = n - num_prefix_tiles
    keep = tiles_selected(sparsity, num_video, num_context_tiles)
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
    mask = select_tiles(scores, tiles.num_prefix_tiles, sparsity, tiles.num_context_tiles)
    values = pooled(v, tiles) if gate is not None else None
    return add_gated_coarse(fine_reference(q, k, v, mask, tiles), scores, values, gate, tiles)
