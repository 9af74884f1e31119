"""NVFP4 weights as ComfyUI stores them (comfy-kitchen's layout), in plain PyTorch.

Layout facts (comfy-kitchen's NVFP4 tensors, which ComfyUI's nvfp4 checkpoints store):
- values: E2M1 codes (sign bit + 3-bit index into {0, .5, 1, 1.5, 2, 3, 4, 6}), two per byte along
  K, the EVEN element in the HIGH nibble; the matrix is zero-padded to multiples of 16 both ways,
  so `weight` is uint8 [roundup(N, 16), roundup(K, 16) / 2];
- block scales: one float8_e4m3fn per 16 consecutive K elements, padded to
  [roundup(rows, 128), roundup(K / 16, 4)] and stored in cuBLAS' 128x4 "blocked" tile order;
- `weight_scale_2`: one fp32 global decode scale.
Dequantized value = e2m1 x block_scale x global. The order of the two multiplications and the
dtype they run in follow comfy-kitchen's eager dequantizer, so a CPU load gives the very bits
ComfyUI computes.
"""

from __future__ import annotations

import math

import torch

from ..errors import CheckpointError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a tie rounds to the even code index (RNE).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def roundup(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def packed_shape(rows: int, cols: int) -> tuple[int, int]:
    """Stored `weight` shape for a logical [rows, cols] matrix."""
    return roundup(rows, BLOCK), roundup(cols, BLOCK) // 2


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Stored `weight_scale` shape (blocked layout) for a logical [rows, cols] matrix."""
    return roundup(roundup(rows, BLOCK), 128), roundup(roundup(cols, BLOCK) // BLOCK, 4)


def stored_mismatch(weight_shape: tuple[int, ...], scale_numel: int, rows: int, cols: int) -> str | None:
    """Why stored tensors of these sizes cannot hold a logical [rows, cols] weight; None if they can.

    Header facts only, so a wrong-sized layer is refused before minutes of loading, not during it.
    """
    want = packed_shape(rows, cols)
    if tuple(weight_shape) != want:
        return f"NVFP4 weight is {list(weight_shape)}, a logical {rows}x{cols} weight packs to {list(want)}"
    need = math.prod(scale_shape(rows, cols))
    if scale_numel != need:
        return (f"NVFP4 block scales hold {scale_numel} values, a logical {rows}x{cols} weight needs {need} "
                f"({list(scale_shape(rows, cols))} in the 128x4 blocked layout)")
    return None


def e2m1_values(dtype: torch.dtype, device=None) -> torch.Tensor:
    """The 16 code values (codes 8..15 are the negatives, 8 being -0)."""
    mags = torch.tensor(_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def decode_codes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes -> their values in `dtype`. A lookup by int32 index: a full-size fc1 has 154 M codes, whose
    int64 indices alone would take 1.2 GB of the device the layer is dequantized on."""
    table = e2m1_values(dtype, codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C/2] -> codes uint8 [R, C]; the high nibble is the even column."""
    hi = packed >> 4
    lo = packed & 0x0F
    return torch.stack([hi, lo], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [R, C] -> uint8 [R, C/2] with the even column in the high nibble."""
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)


def _blocked_index(rows: int, cols: int, device=None) -> torch.Tensor:
    """Flat position, in the blocked layout, of each (row, block-column) scale of a [rows, cols] grid.

    Tiles of 128 rows x 4 columns (512 bytes) are laid out row-tile major; inside a tile, scale
    (r, c) sits at (r mod 32) * 16 + (r div 32) * 4 + c.
    """
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :]
    tiles_per_row = roundup(cols, 4) // 4
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def unswizzle_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Blocked-layout scales -> plain [rows, cols] (rows = padded weight rows, cols = K_pad / 16)."""
    need = roundup(rows, 128) * roundup(cols, 4)
    if blocked.numel() != need:
        raise CheckpointError(f"NVFP4 block scales hold {blocked.numel()} values; a {rows}x{cols} scale grid "
                              f"in the 128x4 blocked layout needs {need}")
    return blocked.reshape(-1)[_blocked_index(rows, cols, blocked.device)]


def swizzle_scales(plain: torch.Tensor) -> torch.Tensor:
    """Plain [rows, cols] scales -> the 2-D blocked tensor [roundup(rows, 128), roundup(cols, 4)] (zero-padded)."""
    rows, cols = plain.shape
    prow, pcol = roundup(rows, 128), roundup(cols, 4)
    flat = torch.zeros(prow * pcol, dtype=plain.dtype, device=plain.device)
    flat[_blocked_index(rows, cols, plain.device).reshape(-1)] = plain.reshape(-1)
    return flat.reshape(prow, pcol)


def dequantize(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
               shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Stored NVFP4 tensors -> the logical [N, K] weight in `dtype`."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise CheckpointError(f"NVFP4 weight must be uint8 2-D, got {packed.dtype} {list(packed.shape)}")
    n, k = shape
    if tuple(packed.shape) != packed_shape(n, k):
        raise CheckpointError(f"NVFP4 weight is {list(packed.shape)}, a logical {n}x{k} weight packs to "
                              f"{list(packed_shape(n, k))}")
    if block_scales.dtype == torch.uint8:
        block_scales = block_scales.view(torch.float8_e4m3fn)
    if block_scales.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"NVFP4 block scales must be float8_e4m3fn, got {block_scales.dtype}")
    rows, cols = packed.shape[0], packed.shape[1] * 2
    codes = unpack_codes(packed)
    values = decode_codes(codes, dtype)
    scales = unswizzle_scales(block_scales, rows, cols // BLOCK)
    total = global_scale.reshape(()).to(dtype) * scales.to(dtype)
    out = (values.reshape(rows, cols // BLOCK, BLOCK) * total[..., None]).reshape(rows, cols)
    return out[:n, :k]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already scaled into [-6, 6] -> E2M1 codes (round to nearest, ties to even)."""
    mag = x.abs()
    index = torch.zeros_like(mag, dtype=torch.uint8)
    for i, mid in enumerate(_MIDPOINTS):
        # Between codes i and i+1 a tie goes to whichever index is even.
        index += (mag > mid) if i % 2 == 0 else (mag >= mid)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def global_scale_for(weight: torch.Tensor) -> torch.Tensor:
    """amax / (448 * 6): the largest block scale then lands on e4m3's maximum."""
    return (weight.abs().amax().to(torch.float32) / (E4M3_MAX * E2M1_MAX)).reshape(())


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None,
             rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logical [N, K] weight -> (packed uint8, blocked e4m3 block scales, fp32 global scale).

    Rows are independent once the global scale is known, so they are encoded `rows_per_chunk` at
    a time (bounded temporaries on a 28672 x 5376 weight); the small scale grid is swizzled last.
    """
    if weight.ndim != 2:
        raise CheckpointError(f"NVFP4 quantizes 2-D weights, got {list(weight.shape)}")
    g = global_scale_for(weight) if global_scale is None else global_scale.reshape(()).to(torch.float32)
    n, k = weight.shape
    rows, cols = roundup(n, BLOCK), roundup(k, BLOCK)
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(rows, cols // BLOCK, dtype=torch.float8_e4m3fn, device=weight.device)
    for start in range(0, rows, rows_per_chunk):
        stop = min(start + rows_per_chunk, rows)
        x = weight[start:min(stop, n)]
        if x.shape != (stop - start, cols):
            x = torch.nn.functional.pad(x, (0, cols - k, 0, (stop - start) - x.shape[0]))
        packed[start:stop], scales[start:stop] = _encode_rows(x, g)
    return packed, swizzle_scales(scales), g


def _encode_rows(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded rows [R, C] -> (packed codes [R, C/2], e4m3 block scales [R, C/16]) for global scale g."""
    r, c = x.shape
    blocks = x.reshape(r, c // BLOCK, BLOCK)
    block_scale = blocks.abs().amax(dim=-1).to(torch.float32) / E2M1_MAX
    s = (block_scale / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    total = g * s.to(torch.float32)
    zero = total == 0
    scaled = blocks.float() / torch.where(zero, torch.ones_like(total), total)[..., None]
    scaled = torch.where(zero[..., None], torch.zeros_like(scaled), scaled).clamp(-E2M1_MAX, E2M1_MAX)
    return pack_codes(round_to_e2m1(scaled.reshape(r, c))), s
