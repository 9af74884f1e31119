"""Video Sparse Attention (VSA) for FastH3: pooling and the block-sparse fine attention as Triton kernels, and
the backend.

The method and its PyTorch reference are in vsa_reference.py. q, k and v arrive in packed row order; a 64-row
video tile is a 4x4x4 brick of patches scattered over that order, and `TileMap.rows` names each tile's rows.
- `_pool_kernel`: the fp32 mean of each tile's rows, gathered through `TileMap.rows`, (B, H, n, D), for the
  coarse scores and values.
- `_fine_tma_kernel` (sm_90 and later): k and v are first copied in tile order (zeros in the padding), then
  each program (query block of 64 rows, batch x head) gathers its q rows once and reads 64-row boxes of k and v
  by TMA, one K and one V box a step over the key tiles its query tile selected (a compacted list per query
  tile), with an online softmax in fp32; a short tile's padding is masked in its last box only.
- `_fine_kernel` (other GPUs, Triton's interpreter): the same walk gathering the rows in packed order (no
  copies), KEYS rows a step.
Both: Q.K and P.V are tensor-core products in the heads' dtype (fp32 accumulation; fp32 heads in IEEE fp32);
tiles of 64, 128 and 256 rows; the output is stored in packed order, and with a gate the epilogue adds the
gated coarse branch with the two roundings the reference's eager ops make.
The coarse scores, the top-k selection and the coarse output are small PyTorch ops on (B, H, tiles, tiles).

`VsaAttention` is what a DiT block's attention schedule hands the block (engine/recipes.py, recipe fasth3): it
`reads_gate`, so the block passes its `attn.to_gate_compress` output along with q, k and v (dit/model.py).
"""

from __future__ import annotations

import math

import torch

from ._triton import INTERPRETED, rnd, round_code, tl, triton  # noqa: F401  (rnd: used in the kernel)
from .attention import Backend
from .capability import capability, require_triton
from .vsa_reference import TileMap, VideoRun, check_inputs, tile_map, tiles_selected, vsa_reference

__all__ = ["VideoRun", "VsaAttention", "block_sparse_fine", "vsa_attention", "tile_map", "vsa_reference"]

BLOCK = 64  # rows of a query or key block: a 64-row tile is one block, larger tiles several
LOG2E = 1.4426950408889634
# Launch shapes of the fine kernel, from the sweeps on the H200 (benchmarks/vsa_attention_gpu.py --sweep,
# receipts/h200/fasth3/). On sm_90 and later the TMA kernel over tile-ordered copies (the copies included, it
# took 17.2 ms where the gather walk took 20.9 at S = 37,966, sparsity 0.9; 5 stages of K and V boxes; q gathered
# in place since: 19.55 ms a whole VSA call against 20.96 on the H100, receipts/h100/vsa-attention-q-in-place-
# a602637.json). Elsewhere,
# and in Triton's interpreter, the gather walk (`keys`: key rows a step; 128 or 256 measured slower on the H200;
# its launch shape there is not measured on older GPUs). Measured slower on the H100 and not kept
# (receipts/h100/vsa-attention-sweep-a5b26cb.json): two key boxes a step under one softmax rescale, a branch-free
# padding bias, P.V accumulated in its product, 8 warps, and 2-4 stages (two blocks an SM).
TMA_LAUNCH = {"keys": 64, "tma": True, "num_warps": 4, "num_stages": 5}
GATHER_LAUNCH = {"keys": 64, "num_warps": 4, "num_stages": 1}


def fine_launch(device, head_dim: int = 128) -> dict:
    """The fine kernel's launch on `device`: TMA where the GPU has it (sm_90+) and a head is one box (a power of
    two of at least 16 channels), the gather walk elsewhere."""
    cap = capability(device)
    tma = cap is not None and cap >= (9, 0) and not INTERPRETED and torch.version.hip is None
    return TMA_LAUNCH if tma and head_dim >= 16 and head_dim & (head_dim - 1) == 0 else GATHER_LAUNCH


if triton is not None:

    @triton.jit
    def _pool_kernel(x_ptr, rows_ptr, size_ptr, out_ptr, stride_b, stride_s, stride_h, heads, num_tiles,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
        tile = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < HEAD_DIM
        base = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        for sub in tl.static_range(TILE // BLOCK):
            rows = tl.load(rows_ptr + tile * TILE + sub * BLOCK + tl.arange(0, BLOCK))
            x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                        mask=(rows >= 0)[:, None] & col_ok[None, :], other=0.0)
            total += tl.sum(x.to(tl.float32), 0)
        size = tl.load(size_ptr + tile).to(tl.float32)
        tl.store(out_ptr + (bh.to(tl.int64) * num_tiles + tile) * HEAD_DIM + cols, total / size, mask=col_ok)

    @triton.jit
    def _scores(q, k, IEEE: tl.constexpr):
        """Q.K^T of a query block and a key block: tensor cores in the heads' dtype, IEEE fp32 for fp32 heads."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return s

    @triton.jit
    def _weighted_values(p, v, IEEE: tl.constexpr, UPCAST: tl.constexpr, RND: tl.constexpr):
        """P.V with P in the heads' dtype (UPCAST, the interpreter: P rounded as the GPU's product takes it)."""
        if UPCAST:
            pv = tl.dot(rnd(p, RND), v.to(tl.float32), input_precision="ieee")
        elif IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return pv

    @triton.jit
    def _store_rows(out, o_ptr, g_ptr, c_ptr, q_rows, row_ok, cols, col_ok, bh, bq, hq, q_tile, num_tiles,
                    so_b, so_s, so_h, sg_b, sg_s, sg_h, HEAD_DIM: tl.constexpr, GATED: tl.constexpr,
                    RND: tl.constexpr):
        """The fine output of a query block stored to its packed rows (int64 `q_rows`, `row_ok` masks padding),
        with the gated coarse branch added when GATED: fine.to(dtype) + (coarse.to(dtype) * gate).to(dtype),
        rounded once more, as the reference's eager ops make it."""
        if GATED:
            coarse = tl.load(c_ptr + (bh.to(tl.int64) * num_tiles + q_tile) * HEAD_DIM + cols, mask=col_ok,
                             other=0.0)
            gate = tl.load(g_ptr + bq * sg_b + hq * sg_h + q_rows[:, None] * sg_s + cols[None, :], mask=row_ok,
                           other=0.0)
            gate = rnd(gate.to(tl.float32), RND)  # the reference takes the gate in the output's dtype
            out = rnd(out, RND) + rnd(rnd(coarse, RND)[None, :] * gate, RND)
        tl.store(o_ptr + bq * so_b + hq * so_h + q_rows[:, None] * so_s + cols[None, :],
                 rnd(out, RND).to(o_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _fine_kernel(q_ptr, k_ptr, v_ptr, o_ptr, g_ptr, c_ptr, rows_ptr, idx_ptr, num_ptr,
                     sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h, sg_b, sg_s, sg_h,
                     idx_stride_b, idx_stride_h, idx_stride_q, num_stride_b, num_stride_h,
                     heads, num_tiles, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
                     KEYS: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                     RND: tl.constexpr):
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        q_tile = (block * BLOCK) // TILE
        q_rows = tl.load(rows_ptr + block * BLOCK + tl.arange(0, BLOCK))
        q_ok = q_rows >= 0
        q_rows = q_rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < HEAD_DIM
        bq = b.to(tl.int64)
        hq = h.to(tl.int64)
        q = tl.load(q_ptr + bq * sq_b + hq * sq_h + q_rows[:, None] * sq_s + cols[None, :],
                    mask=q_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + bq * sk_b + hq * sk_h
        v_base = v_ptr + bq * sv_b + hq * sv_h
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
        selected = tl.load(num_ptr + b * num_stride_b + h * num_stride_h + q_tile)
        idx_row = idx_ptr + bq * idx_stride_b + hq * idx_stride_h + q_tile * idx_stride_q
        # The selected tiles' rows as one stream of selected x TILE key rows, KEYS of them per step: a step may
        # span several 64-row tiles (fewer, larger tensor-core products and softmax passes per key) or part of
        # a larger one. The first step holds the first selected tile's first row, which is real (a tile's real
        # rows come first), so the running maximum is finite from the first step on and a later step that is
        # all padding adds exactly nothing.
        stream = tl.arange(0, KEYS)
        for start in range(0, selected * TILE, KEYS):
            place = start + stream
            live = place < selected * TILE
            k_tile = tl.load(idx_row + place // TILE, mask=live, other=0)
            k_rows = tl.load(rows_ptr + k_tile * TILE + place % TILE, mask=live, other=-1)
            k_ok = k_rows >= 0
            k_off = k_rows.to(tl.int64)[:, None]
            k = tl.load(k_base + k_off * sk_s + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.where(k_ok[None, :], _scores(q, k, IEEE) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + k_off * sv_s + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + _weighted_values(p, v, IEEE, UPCAST, RND)
            m_i = m_new
        _store_rows(acc / l_i[:, None], o_ptr, g_ptr, c_ptr, q_rows, q_ok[:, None] & col_ok[None, :], cols, col_ok,
                    bh, bq, hq, q_tile, num_tiles, so_b, so_s, so_h, sg_b, sg_s, sg_h, HEAD_DIM, GATED, RND)

    @triton.jit
    def _fine_tma_kernel(q_ptr, k_desc, v_desc, o_ptr, g_ptr, c_ptr, rows_ptr, size_ptr, idx_ptr, num_ptr,
                         sq_b, sq_s, sq_h, so_b, so_s, so_h, sg_b, sg_s, sg_h,
                         idx_stride_b, idx_stride_h, idx_stride_q, num_stride_b, num_stride_h,
                         heads, num_tiles, qk_scale,
                         HEAD_DIM: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, RND: tl.constexpr):
        """The fine step over tile-ordered copies of k and v read by TMA: (B x n x TILE, H x D) 2-D views,
        BLOCK x D boxes at (row of the tile, head's column). q is read once a program, gathered from its packed
        rows (zeros in the padding, as a copy would hold): a tile-ordered copy of it cost 1.0 of a VSA call's
        20.8 ms on the H100 (receipts/h100/vsa-attention-sweep-a5b26cb.json) for one read."""
        block = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // heads
        h = bh % heads
        q_tile = (block * BLOCK) // TILE
        row0 = b * num_tiles * TILE
        col = h * HEAD_DIM
        bq = b.to(tl.int64)
        hq = h.to(tl.int64)
        q_rows = tl.load(rows_ptr + block * BLOCK + tl.arange(0, BLOCK))
        q_ok = (q_rows >= 0)[:, None]
        q_rows = q_rows.to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + bq * sq_b + hq * sq_h + q_rows[:, None] * sq_s + cols[None, :], mask=q_ok, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
        selected = tl.load(num_ptr + b * num_stride_b + h * num_stride_h + q_tile)
        idx_row = idx_ptr + bq * idx_stride_b + hq * idx_stride_h + q_tile * idx_stride_q
        # One BLOCK-row box of K and V per step, a larger tile's boxes as consecutive steps (unrolling them
        # multiplied the pipeline's shared memory by TILE // BLOCK: 256-row tiles did not fit on the H200).
        for j in range(0, selected * (TILE // BLOCK)):
            k_tile = tl.load(idx_row + j // (TILE // BLOCK))
            sub = j % (TILE // BLOCK)
            size = tl.load(size_ptr + k_tile)
            within = sub * BLOCK + tl.arange(0, BLOCK)
            r = row0 + k_tile * TILE + sub * BLOCK
            k = k_desc.load([r, col])
            if UPCAST:
                k = k.to(tl.float32)
            s = _scores(q, k, IEEE)
            if (sub + 1) * BLOCK > size:  # only a short tile's last box has padding to mask
                s = tl.where((within < size)[None, :], s, float("-inf"))
            # The running maximum in scaled units: the scale rides in one fused multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v_desc.load([r, col])
            acc = acc * alpha[:, None] + _weighted_values(p, v, IEEE, UPCAST, RND)
            m_i = m_new
        _store_rows(acc / l_i[:, None], o_ptr, g_ptr, c_ptr, q_rows, q_ok, cols, cols < HEAD_DIM, bh, bq, hq, q_tile,
                    num_tiles, so_b, so_s, so_h, sg_b, sg_s, sg_h, HEAD_DIM, GATED, RND)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x with unit channel stride (the kernels read each head's D channels as one run)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _pooled(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """vsa_reference.pooled with the Triton kernel: the fp32 mean of each tile's rows, (B, H, n, D)."""
    require_triton("the VSA pooling kernel", x.device)
    x = _heads(x)
    b, _, h, d = x.shape
    out = torch.empty(b, h, tiles.num_tiles, d, dtype=torch.float32, device=x.device)
    _pool_kernel[(tiles.num_tiles, b * h)](
        x, tiles.rows, tiles.sizes, out, x.stride(0), x.stride(1), x.stride(2), h, tiles.num_tiles,
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), TILE=tiles.tile, BLOCK=BLOCK, num_warps=4)
    return out


def tile_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, H, n, n) selection as the kernel walks it: each query tile's selected key tiles first, in tile
    order (the rest after them is never read), and how many there are."""
    num = mask.sum(-1, dtype=torch.int32).contiguous()
    idx = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32).contiguous()
    return idx, num


def selected_lists(scores: torch.Tensor, num_prefix_tiles: int, sparsity: float, num_context_tiles: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """vsa_reference.select_tiles as the kernel's lists, without the (B, H, n, n) mask: every prefix key tile,
    then a video query tile's top video tiles (context and target alike) in tile order; a prefix query tile
    keeps all n."""
    b, h, n, _ = scores.shape
    num_video = n - num_prefix_tiles
    keep = tiles_selected(sparsity, num_video, num_context_tiles)
    every = torch.arange(n, dtype=torch.int32, device=scores.device).expand(b, h, n, n)
    if keep == num_video:
        return every.contiguous(), torch.full((b, h, n), n, dtype=torch.int32, device=scores.device)
    top = scores[..., num_prefix_tiles:, num_prefix_tiles:].topk(keep, dim=-1).indices
    top = top.sort(dim=-1).values.to(torch.int32) + num_prefix_tiles
    prefix = every[:, :, num_prefix_tiles:, :num_prefix_tiles]
    video_rows = torch.cat([prefix, top, every[:, :, num_prefix_tiles:, : num_video - keep]], dim=-1)
    idx = torch.cat([every[:, :, :num_prefix_tiles], video_rows], dim=2).contiguous()
    num = torch.full((b, h, n), num_prefix_tiles + keep, dtype=torch.int32, device=scores.device)
    num[:, :, :num_prefix_tiles] = n
    return idx, num


def _fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, num: torch.Tensor,
          tiles: TileMap, gate: torch.Tensor | None = None, coarse: torch.Tensor | None = None,
          launch: dict | None = None) -> torch.Tensor:
    """The fine kernel over packed q, k, v (B, S, H, D) of one dtype; with `gate` (B, S, H, D) the gated
    coarse branch (`coarse`: (B, H, n, D) fp32, each tile's coarse output) is added in its epilogue."""
    require_triton("the VSA block-sparse kernel", q.device)
    q, k, v = _heads(q), _heads(k), _heads(v)
    b, _, h, d = q.shape
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)
    gated = gate is not None
    g = _heads(gate) if gated else q
    c = coarse.contiguous() if gated else q
    grid = (tiles.num_tiles * tiles.tile // BLOCK, b * h)
    # Triton's CPU interpreter multiplies bf16/fp16 blocks as integers: there the kernel computes in fp32.
    upcast = INTERPRETED and q.dtype != torch.float32
    launch = dict(launch or fine_launch(q.device, d))
    keys = launch.pop("keys")
    if launch.pop("tma", False):
        _fine_tma(q, k, v, out, g, c, idx, num, tiles, gated, upcast, launch)
        return out
    _fine_kernel[grid](
        q, k, v, out, g, c, tiles.rows, idx, num,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2), num.stride(0), num.stride(1),
        h, tiles.num_tiles, LOG2E / math.sqrt(d),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), TILE=tiles.tile, BLOCK=BLOCK, KEYS=keys,
        GATED=gated, IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast, RND=round_code(v.dtype), **launch)
    return out


def _tile_ordered(x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """x (B, S, H, D) in packed order -> (B x n x tile, H x D) tile by tile, zeros in the padding."""
    b, _, h, d = x.shape
    return tile_ordered_into(x.new_empty(b, tiles.num_tiles * tiles.tile, h, d), x, tiles)


def tile_ordered_into(out: torch.Tensor, x: torch.Tensor, tiles: TileMap) -> torch.Tensor:
    """`_tile_ordered` into `out` (B, n x tile, H, D), whatever it held: the padding's few places are zeroed and
    every row is copied once (zero-filling the whole buffer first wrote it twice: a third of the copies' traffic).
    The padding must be finite: V's padded rows meet probabilities of zero in the fine step."""
    b, _, h, d = x.shape
    out.index_fill_(1, tiles.padding, 0)
    return out.index_copy_(1, tiles.slot, x).view(b * tiles.num_tiles * tiles.tile, h * d)


def _fine_tma(q, k, v, out, g, c, idx, num, tiles, gated, upcast, launch) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, _, h, d = q.shape
    descs = [TensorDescriptor.from_tensor(_tile_ordered(x, tiles), [BLOCK, d]) for x in (k, v)]
    grid = (tiles.num_tiles * tiles.tile // BLOCK, b * h)
    _fine_tma_kernel[grid](
        q, *descs, out, g, c, tiles.rows, tiles.sizes.to(torch.int32), idx, num,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2), g.stride(0), g.stride(1), g.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2), num.stride(0), num.stride(1),
        h, tiles.num_tiles, LOG2E / math.sqrt(d),
        HEAD_DIM=d, TILE=tiles.tile, BLOCK=BLOCK, GATED=gated, IEEE=q.dtype == torch.float32 or upcast,
        UPCAST=upcast, RND=round_code(v.dtype), **launch)


def block_sparse_fine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      tiles: TileMap) -> torch.Tensor:
    """The fine step of VSA (vsa_reference.fine_reference) with the Triton kernel: each row attends to the rows
    of its tile's selected key tiles; fp32 accumulation, output in v's dtype, packed row order."""
    return _fine(q, k, v.to(q.dtype), *tile_lists(mask), tiles).to(v.dtype)


@torch.no_grad()
def vsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, tiles: TileMap,
                  sparsity: float) -> torch.Tensor:
    """VSA with the Triton kernels: the steps of vsa_reference.vsa_reference, the gated coarse branch added in
    the fine kernel's epilogue."""
    check_inputs(q, k, v, gate, tiles)
    v = v.to(q.dtype)
    scores = _pooled(q, tiles) @ _pooled(k, tiles).transpose(-1, -2) / math.sqrt(q.shape[-1])
    idx, num = selected_lists(scores, tiles.num_prefix_tiles, sparsity, tiles.num_context_tiles)
    coarse = scores.softmax(-1) @ _pooled(v, tiles) if gate is not None else None
    return _fine(q, k, v, idx, num, tiles, gate, coarse)


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
        self.kernel: str | None = None  # which fine kernel ran last: "tma" or "gather" (triton), "reference"
        self.calls = 0
        self.gated_calls = 0

    def __call__(self, q, k, v, gate=None):
        tiles = self._on.get(q.device)
        if tiles is None:
            tiles = self._on[q.device] = self.tiles.to(q.device)
        self.calls += 1
        self.gated_calls += gate is not None
        if self.fine == "triton":
            self.kernel = "tma" if fine_launch(q.device, q.shape[-1]).get("tma") else "gather"
            return vsa_attention(q, k, v, gate, tiles, self.sparsity)
        self.kernel = "reference"
        return vsa_reference(q, k, v, gate, tiles, self.sparsity)

    def _context(self) -> dict:
        """The context tiles (a history's, guides') where the request has them: absent otherwise, so a first
        window's description is what it was."""
        return {"context_tiles": self.tiles.num_context_tiles} if self.tiles.num_context_tiles else {}

    def describe(self) -> dict:
        return {**super().describe(), "sparsity": self.sparsity, "tile": self.tiles.tile, "fine": self.fine,
                "fine_kernel": self.kernel, "tiles": self.tiles.num_tiles,
                "video_tiles": self.tiles.num_video_tiles, **self._context(), "calls": self.calls,
                "calls_with_gate": self.gated_calls}
