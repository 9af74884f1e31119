"""The stored forms of quantized weights, turned back into values row chunk by row chunk.

One definition of each format's dequantization serves two callers, through the format's declaration
(`kernels/formats/`): the checkpoint readers (a whole layer at load, `checkpoint/quant.py`) and `StoredLinear`
(just in time, into a reusable scratch, before every GEMM).
Both run these very functions, so a layer dequantized at use holds the bits it would have held had it been
dequantized at load on the same device: the exact path stays exact to the file.

Work is done `CHUNK_ROWS` output rows at a time. Every format's value of a row depends on that row's codes
and scales only (ConvRot rotates each row's groups of input columns), so chunking changes no value; it
bounds the fp32 temporaries to a chunk instead of a whole fc1 (0.6 GB at full size).

Formats (as ComfyUI's `comfy_quant` layers store them):
- fp8 (`float8_e4m3fn` / `float8_e5m2`): code x per-tensor scale, both cast to the output dtype first (the
  order comfy-kitchen's eager kernel uses);
- int8 (`int8_tensorwise`, optionally ConvRot): code x fp32 scale (scalar or per row) in fp32; with ConvRot the
  group rotation is undone first on the integer codes, exactly (W = W_rot @ H per group, H symmetric and
  orthogonal: `_unrotated`), so the one rounding is the final scaling's;
- NVFP4: E2M1 value x (global x block scale), in the output dtype, from plain (row-major) block scales;
- the 4-bit ConvRot formats (`convrot_w4a4`, `asym_w4a8_int8`): in comfy-kitchen's eager order, dtype step by
  dtype step, so each value is the one its eager dequantization gives on the same device (ComfyUI's own loads
  hold those bits): scaled in fp32, the rotation undone by a float GEMM (fp32 for convrot_w4a4, the output
  dtype for asym_w4a8_int8), which rounds as it goes. Unlike int8_convrot's exact path, these values are not
  the correctly rounded product, and a GPU's GEMM may round them differently from a CPU's;
- AWQ `pre_quant_scale` (smoothing per input column): folded into the dequantized weight in fp32.
"""

from __future__ import annotations

import math

import torch

from ..errors import CheckpointError
from . import nvfp4_codec as nvfp4

CHUNK_ROWS = 4096
FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


# --------------------------------------------------------------------- Hadamard (ConvRot)
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised regular Hadamard matrix of a power-of-4 size, fp32 (symmetric, orthogonal), kept per
    device so a GPU dequantization does not copy it from the host on every call."""
    if size < 4 or 4 ** round(math.log(size, 4)) != size:
        raise CheckpointError(f"ConvRot group size must be a power of 4 (4, 16, 64, 256, ...), got {size}")
    key = (size, str(torch.device(device)))
    h = _HADAMARD.get(key)
    if h is None:
        base = torch.tensor(_H4, dtype=torch.float32)
        h = base
        while h.shape[0] < size:
            h = torch.kron(h, base)
        h = (h / math.sqrt(size)).to(device)
        _HADAMARD[key] = h
    return h


def rotate_groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """W -> W @ H^T applied to each group of `group` input columns, a GEMM in W's own dtype (H's entries, +-2^-n,
    are exact in every float dtype). It is its own inverse."""
    n, k = weight.shape
    if k % group:
        raise CheckpointError(f"ConvRot group size {group} does not divide the {k} input columns")
    h = hadamard(group, weight.device).to(weight.dtype)
    return torch.matmul(weight.reshape(n, k // group, group), h.T).reshape(n, k)


# --------------------------------------------------------------------- per format, into `out`
def _chunks(rows: int):
    for start in range(0, rows, CHUNK_ROWS):
        yield start, min(rows, start + CHUNK_ROWS)


def fp8_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float().reshape(()).to(out.dtype)
    for a, b in _chunks(out.shape[0]):
        torch.mul(codes[a:b].to(out.dtype), scale, out=out[a:b])
    return out


def int8_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, convrot_group: int | None) -> torch.Tensor:
    per_row = scale.numel() > 1
    scale = scale.float().reshape(-1, 1) if per_row else scale.float().reshape(())
    if convrot_group:
        # 1 / sqrt(group) is a power of two: folding it into the scale changes no bit of the product.
        scale = scale * (1.0 / math.sqrt(convrot_group))
    for a, b in _chunks(out.shape[0]):
        rows = scale[a:b] if per_row else scale
        values = _unrotated(codes[a:b], convrot_group) if convrot_group else codes[a:b]
        # One pass: the product is computed in fp32 (the inputs' common type) and rounded once as it is stored.
        torch.mul(values, rows, out=out[a:b])
    return out


_SIGNS: dict[tuple[int, str], torch.Tensor] = {}


def hadamard_signs(size: int, device: torch.device | str) -> torch.Tensor:
    """The unnormalised (+-1) Hadamard matrix: int8 on a GPU (for the integer GEMM), fp32 elsewhere."""
    device = torch.device(device)
    key = (size, str(device))
    h = _SIGNS.get(key)
    if h is None:
        signs = torch.round(hadamard(size) * math.sqrt(size))
        h = _SIGNS[key] = signs.to(torch.int8 if device.type == "cuda" else torch.float32).to(device)
    return h


def _unrotated(codes: torch.Tensor, group: int) -> torch.Tensor:
    """int8 codes [R, K] -> (codes @ H+-) per group of `group` columns (int32 or fp32), EXACT: products of int8 codes and +-1
    summed over a group stay below 2^24, so every sum is an integer computed without rounding, whatever the order
    (an int8 tensor-core GEMM on a GPU, fp32 elsewhere). The weight is then this sum x row scale / sqrt(group) (a
    power of two): one rounding in all, the same bits on every device. A dense fp32 (codes x scale) @ H rounds at
    every step instead, costs an fp32 GEMM with K = group per weight (7.9 ms a full-size block on the H200, 18 % of
    a 960x544 forward), and differs between devices."""
    r, k = codes.shape
    if k % group:
        raise CheckpointError(f"ConvRot group size {group} does not divide the {k} input columns")
    h = hadamard_signs(group, codes.device)
    flat = codes.reshape(r * k // group, group)
    # cuBLASLt's int8 GEMM wants more than 16 rows and dims divisible by 8 (the released group is 256).
    if codes.device.type == "cuda" and flat.shape[0] > 16 and group % 8 == 0:
        sums = torch._int_mm(flat, h.t())  # int32; H is symmetric, the integer GEMM takes it column-major
    else:
        sums = flat.float() @ h.to(torch.float32)
    return sums.reshape(r, k)


def chunk_rows(k: int) -> int:
    """Rows of a 4-bit layer dequantized at a time: its fp32 temporaries (~4 a value) stay near 64 MB whatever K."""
    return max(1, min(CHUNK_ROWS, (1 << 24) // k))


def int4_convrot_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """convrot_w4a4 rows: signed codes [R, K] x fp32 row scale [R], rotated back, in comfy-kitchen's eager order
    (its bits on the same device): the product in fp32, the fp32 GEMM with H^T, one cast to out's dtype."""
    values = codes.float() * scale.float().reshape(-1, 1)
    out.copy_(rotate_groups(values, group))
    return out


def w4a8_grid(codes: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None,
              group_size: int) -> torch.Tensor:
    """asym_w4a8_int8 rows on the int8 grid the W4A8 GEMM reads: each 4-bit code's level (the codebook's entry, or
    code - 8) x its group's relative scale, in fp32, rounded half to even and clamped to [-127, 127]."""
    r, k = codes.shape
    levels = codebook.float()[codes.long()] if codebook is not None else codes.float() - 8.0
    scaled = levels.reshape(r, k // group_size, group_size) * s_rel.float().unsqueeze(-1)
    return scaled.reshape(r, k).round().clamp_(-127, 127).to(torch.int8)


def w4a8_into(out: torch.Tensor, grid: torch.Tensor, s_channel: torch.Tensor, correction: torch.Tensor | None,
              group_size: int, convrot_group: int) -> torch.Tensor:
    """asym_w4a8_int8 rows from their int8 grid [R, K], in comfy-kitchen's eager order (its bits on the same
    device): x the channel scale in fp32, + the asymmetric variant's correction [R, K / group_size] (a second
    rounding, as there), cast to out's dtype, and the rotation undone by a GEMM in out's dtype."""
    r, k = grid.shape
    values = grid.float().reshape(r, k // group_size, group_size) * s_channel.float().reshape(r, 1, 1)
    if correction is not None:
        values = values + correction.float().unsqueeze(-1)
    out.copy_(rotate_groups(values.reshape(r, k).to(out.dtype), convrot_group))
    return out


def nvfp4_into(out: torch.Tensor, packed: torch.Tensor, plain_scales: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """`packed` uint8 [>= N, K_pad / 2], `plain_scales` e4m3 [>= N, K_pad / 16] (row-major, not blocked)."""
    n, k = out.shape
    g = global_scale.float().reshape(()).to(out.dtype)
    blocks = packed.shape[1] * 2 // nvfp4.BLOCK
    for a, b in _chunks(n):
        values = nvfp4.decode_codes(nvfp4.unpack_codes(packed[a:b]), out.dtype)
        total = g * plain_scales[a:b].to(out.dtype)
        full = (values.reshape(b - a, blocks, nvfp4.BLOCK) * total[..., None]).reshape(b - a, blocks * nvfp4.BLOCK)
        out[a:b].copy_(full[:, :k])
    return out


def pre_quant_into(out: torch.Tensor, pre_quant_scale: torch.Tensor) -> torch.Tensor:
    """x (W s)^T = (x s) W^T: AWQ's smoothing folded into the weight, per input column, in fp32."""
    if pre_quant_scale.numel() != out.shape[1]:
        raise CheckpointError(f"pre_quant_scale has {pre_quant_scale.numel()} values for {out.shape[1]} inputs")
    s = pre_quant_scale.float().reshape(1, -1)
    for a, b in _chunks(out.shape[0]):
        out[a:b].copy_(out[a:b].float() * s)
    return out


def plain_nvfp4_scales(blocked: torch.Tensor, packed_rows: int, packed_cols: int) -> torch.Tensor:
    """A stored NVFP4 layer's blocked block scales -> plain [packed_rows, K_pad / 16] e4m3 (same bytes, row-major:
    a row chunk of them is then a slice)."""
    if blocked.dtype == torch.uint8:
        blocked = blocked.view(torch.float8_e4m3fn)
    if blocked.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"NVFP4 block scales must be float8_e4m3fn, got {blocked.dtype}")
    return nvfp4.unswizzle_scales(blocked, packed_rows, packed_cols * 2 // nvfp4.BLOCK)
