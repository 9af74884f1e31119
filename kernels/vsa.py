"""Video Sparse Attention (VSA) for FastH3: the block-sparse fine attention as a Triton kernel, and the backend.

The method and its PyTorch reference are in vsa_reference.py. Here the fine step runs as one flash-attention
style kernel over a padded tile buffer: program (query block of 64 rows, batch x head) walks the key tiles its
query tile selected (a compacted index list per query tile, from the boolean tile mask), 64 key rows at a time,
with an online softmax in fp32; the padding rows of a short tile are masked out of the keys. Q.K and P.V are
tensor-core products in the heads' dtype (fp32 accumulation; fp32 heads in IEEE fp32). Tiles of 128 or 256
rows are walked as 2 or 4 blocks of 64, so one kernel serves every tile size the recipe offers.
Pooling, the coarse scores, the top-k selection and the gated coarse branch are a few small PyTorch ops on
(B, H, tiles, tiles) tensors: they cost little next to the fine attention.

`VsaAttention` is what a DiT block's attention schedule hands the block (engine/recipes.py, recipe fasth3): it
`reads_gate`, so the block passes its `attn.to_gate_compress` output along with q, k and v (dit/model.py).
"""

from __future__ import annotations

import math

import torch

from ._triton import INTERPRETED, rnd, round_code, tl, triton  # noqa: F401  (rnd: used in the kernel)
from .attention import Backend
from .capability import require_triton
from .vsa_reference import TileMap, add_gated_coarse, check_inputs, select_tiles, tile_map, vsa_reference

__all__ = ["VsaAttention", "block_sparse_fine", "vsa_attention", "tile_map", "vsa_reference"]

BLOCK = 64  # rows of a query or key block: a 64-row tile is one block, larger tiles several
LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _block_sparse_fine_kernel(q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, num_ptr, size_ptr,
                                  stride_b, stride_s, stride_h,
                                  idx_stride_b, idx_stride_h, idx_stride_q,
                                  num_stride_b, num_stride_h,
                                  heads, qk_scale,
                                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                                  BLOCK: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                                  RND: tl.constexpr):
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        q_tile = (block * BLOCK) // TILE
        rows = block * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < HEAD_DIM
        base = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        q = tl.load(q_ptr + base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                    mask=col_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        selected = tl.load(num_ptr + b * num_stride_b + h * num_stride_h + q_tile)
        idx_row = idx_ptr + b.to(tl.int64) * idx_stride_b + h.to(tl.int64) * idx_stride_h + q_tile * idx_stride_q
        # The first selected tile's first block holds at least one real row, so the running maximum is finite
        # from the first block on and a later block that is all padding adds exactly nothing.
        for j in range(0, selected):
            k_tile = tl.load(idx_row + j)
            size = tl.load(size_ptr + k_tile)
            for sub in tl.static_range(TILE // BLOCK):
                within = sub * BLOCK + tl.arange(0, BLOCK)
                keys = k_tile.to(tl.int64) * TILE + within
                offsets = base + keys[:, None] * stride_s + cols[None, :]
                k = tl.load(k_ptr + offsets, mask=col_ok[None, :], other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where((within < size)[None, :], s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + offsets, mask=col_ok[None, :], other=0.0)
                if UPCAST:  # P rounded to the heads' dtype, as the half-precision P.V product on a GPU takes it
                    pv = tl.dot(rnd(p, RND), v.to(tl.float32), input_precision="ieee")
                elif IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=col_ok[None, :])


def _padded(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """x (B, S, H, D) in packed order -> (B, n x tile, H, D) tile by tile, zeros in the padding."""
    b, _, h, d = x.shape
    out = x.new_zeros(b, tiles.num_tiles * tiles.tile, h, d)
    return out.index_copy_(1, tiles.slot, x.contiguous())


def _pooled(xp: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """vsa_reference.pooled from the padded buffer (its padding is zero): summed in fp32 without an fp32 copy of
    the heads, (B, H, n, D)."""
    b, _, h, d = xp.shape
    sums = xp.view(b, tiles.num_tiles, tiles.tile, h, d).sum(2, dtype=torch.float32)
    return (sums / tiles.sizes.to(torch.float32)[None, :, None, None]).transpose(1, 2)


def block_sparse_fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      tiles: TileMap) -> torch.Tensor:
    """The fine step of VSA (vsa_reference.fine_reference) with the Triton kernel: each row attends to the rows
    of its tile's selected key tiles; fp32 accumulation, output in v's dtype, packed row order."""
    padded = _padded(q, tiles), _padded(k, tiles), _padded(v.to(q.dtype), tiles)
    return _fine(*padded, mask, tiles).to(v.dtype)


def _fine(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    require_triton("the VSA block-sparse kernel", qp.device)
    b, _, h, d = qp.shape
    out = torch.empty_like(qp)
    # Selected key tiles first, in tile order, then the rest (never read: `num` says how many count).
    num = mask.sum(-1, dtype=torch.int32).contiguous()
    idx = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32).contiguous()
    sizes = tiles.sizes.to(torch.int32).contiguous()
    grid = (tiles.num_tiles * tiles.tile // BLOCK, b * h)
    # Triton's CPU interpreter multiplies bf16/fp16 blocks as integers: there the kernel computes in fp32.
    upcast = INTERPRETED and qp.dtype != torch.float32
    _block_sparse_fine_kernel[grid](
        qp, kp, vp, out, idx, num, sizes,
        qp.stride(0), qp.stride(1), qp.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2),
        num.stride(0), num.stride(1),
        h, LOG2E / math.sqrt(d),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), TILE=tiles.tile, BLOCK=BLOCK,
        IEEE=qp.dtype == torch.float32 or upcast, UPCAST=upcast, RND=round_code(qp.dtype), num_warps=4,
        num_stages=2)
    return out[:, tiles.slot]


@torch.no_grad()
def vsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, tiles: TileMap,
                  sparsity: float) -> torch.Tensor:
    """VSA with the Triton fine kernel: the steps of vsa_reference.vsa_reference, pooled from the padded tile
    buffers the kernel reads (one copy of each of q, k, v)."""
    check_inputs(q, k, v, gate, tiles)
    qp, kp, vp = _padded(q, tiles), _padded(k, tiles), _padded(v.to(q.dtype), tiles)
    scores = _pooled(qp, tiles) @ _pooled(kp, tiles).transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = select_tiles(scores, tiles.num_prefix_tiles, sparsity)
    values = _pooled(vp, tiles) if gate is not None else None
    fine = _fine(qp, kp, vp, mask, tiles)
    del qp, kp, vp  # three (B, n x tile, H, D) buffers gone before the gated branch allocates its rows
    return add_gated_coarse(fine.to(v.dtype), scores, values, gate, tiles)


class VsaAttention(Backend):
    """VSA over one request's packed sequence (its `TileMap`) at `sparsity`, as a block's attention. `fine` is
    "triton" (the kernel; CUDA, or Triton's interpreter) or "pytorch" (the reference: a CPU run)."""

    name = "vsa"
    exact = False
    reads_gate = True

    def __init__(self, tiles: TileMap, sparsity: float, fine: str):
        if fine not in ("triton", "pytorch"):
            raise ValueError(f"VSA's fine step runs on triton or pytorch, not {fine!r}")
        self.tiles, self.sparsity, self.fine = tiles, float(sparsity), fine
        self._on: dict[torch.device, TileMap] = {}
        self.calls = 0
        self.gated_calls = 0

    def __call__(self, q, k, v, gate=None):
        tiles = self._on.get(q.device)
        if tiles is None:
            tiles = self._on[q.device] = self.tiles.to(q.device)
        self.calls += 1
        self.gated_calls += gate is not None
        run = vsa_attention if self.fine == "triton" else vsa_reference
        return run(q, k, v, gate, tiles, self.sparsity)

    def describe(self) -> dict:
        return {**super().describe(), "sparsity": self.sparsity, "tile": self.tiles.tile, "fine": self.fine,
                "tiles": self.tiles.num_tiles, "video_tiles": self.tiles.num_video_tiles, "calls": self.calls,
                "calls_with_gate": self.gated_calls}
