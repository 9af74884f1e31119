"""GGML block quantizers in PyTorch: a tensor's rows -> GGUF blocks, uint8 [rows, row_bytes], on its device.

Why ours: gguf-py quantizes on the CPU in NumPy (a full-size DiT takes about an hour) and has quantizers for the
legacy blocks of 32 only. These run where the tensor is (a GPU quantizes a full-size DiT in minutes), row chunk
by row chunk (`CHUNK_VALUES` values at a time: a row's blocks depend on that row only, so chunking changes no
byte, and the fp32 temporaries stay a few times one chunk).

Two kinds of type (`QUANTIZABLE`):
- Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 (`EXACT`): bit for bit `gguf.quants.quantize` (tests/test_gguf_quantize.py
  compares them on random rows). Every value is computed in fp32 with gguf's operations in gguf's order, each a
  separate torch op (so a separate IEEE rounding: nothing is fused into an FMA), the divisions true ones (never
  a multiplication by a reciprocal), the block's extreme by first index (argmax, as NumPy's), Q8_0's codes
  rounded half away from zero and the other types' truncated after adding gguf's offset, scales rounded to fp16
  to nearest even.
- Q6_K, Q5_K, Q4_K, Q3_K, Q2_K (`K_QUANTS`): a straightforward quantizer of our own. llama.cpp's (a search over
  candidate scales, per-type weighting) cannot be matched bit for bit and is not tried: per sub-block, the
  affine types (Q2_K, Q4_K, Q5_K) take min(x, 0) and max(x) and the symmetric ones (Q3_K, Q6_K) map the
  largest-magnitude value to the most negative code (Q4_0's rule); the sub-block scales (and mins) are
  quantized to the type's integer width against the super-block's fp16 d (and dmin), which their largest fills;
  the codes are then rounded (to nearest, ties to even) against those stored scales and clamped to the type's
  range. `k_codes` returns those integers; a reader of the bytes (gguf's NumPy dequantizer, our codec) computes
  d * scale * q - dmin * min from them (tests: bit for bit, and the round-trip errors in the test's table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import InputError

EXACT = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
K_QUANTS = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K")
QUANTIZABLE = EXACT + K_QUANTS
CHUNK_VALUES = 1 << 23  # 8 Mi values a chunk: 32 MiB of fp32, a few such temporaries
QK_K = 256


# --------------------------------------------------------------------- packing (the codec's fields, inverted)
def _pack_planes(codes: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., count * n] field-major codes (all elements' field 0, then field 1, ...) -> uint8 [..., n] with
    field i at bits width * i (the inverse of gguf_codec._planes)."""
    fields = codes.to(torch.uint8).reshape(*codes.shape[:-1], count, codes.shape[-1] // count)
    out = fields[..., 0, :].clone()
    for i in range(1, count):
        out |= fields[..., i, :] << (width * i)
    return out


def _pack_interleaved(codes: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n * count] element-major codes (each byte's fields next to each other) -> uint8 [..., n]."""
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // count, count).transpose(-1, -2)
    return _pack_planes(grouped.reshape(codes.shape), width, count)


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 [B, 1] -> its two little-endian bytes, uint8 [B, 2]."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d (a true division: one IEEE rounding, on every device), 0 where d is 0 (gguf's np.where)."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d).div_(safe))


def _div(x: torch.Tensor, n: float) -> torch.Tensor:
    """x / n as a true division on every device: CUDA turns a division by a Python number into a multiplication
    by its reciprocal (one more rounding than NumPy's x / n), a division by a tensor it does not."""
    return x / torch.full_like(x, n)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (C's roundf; `a - floor(a)` is exact in fp32, so the test is too).
    In place on temporaries: a full-size tensor's chunk is passed over a few times, never copied more."""
    a = x.abs()
    whole = a.floor()
    return whole.add_(a.sub_(whole).ge_(0.5)).copysign_(x)


def _signed_extreme(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's largest-magnitude value with its sign, the first such value on a tie ([B, 1])."""
    return blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))


# --------------------------------------------------------------------- blocks of 32 (gguf's quantizers)
# Each: fp32 [B, 32] -> uint8 [B, type_size].
def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = _div(x.abs().amax(dim=-1, keepdim=True), 127)
    q = _round_half_away(x * _reciprocal(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1)


def _offset_codes(x: torch.Tensor, scale: torch.Tensor, offset: float, top: int) -> torch.Tensor:
    """trunc(x * (1 / scale) + offset), clamped to [0, top] (gguf's legacy code rule; x already shifted)."""
    return (x * _reciprocal(scale) + offset).trunc().clamp_(0, top).to(torch.uint8)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _div(_signed_extreme(x), -8)
    q = _offset_codes(x, d, 8.5, 15)
    return torch.cat([_f16_bytes(d), _pack_planes(q, 4, 2)], dim=-1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    low = x.amin(dim=-1, keepdim=True)
    d = _div(x.amax(dim=-1, keepdim=True) - low, 15)
    q = _offset_codes(x - low, d, 0.5, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_planes(q, 4, 2)], dim=-1)


def _five_bits(q: torch.Tensor) -> list[torch.Tensor]:
    """5-bit codes [B, 32] -> their fifth bits (4 bytes: bit j of the little-endian uint32 is code j's) and
    their low nibbles (16 bytes, low then high halves)."""
    return [_pack_interleaved(q >> 4, 1, 8), _pack_planes(q & 0x0F, 4, 2)]


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _div(_signed_extreme(x), -16)
    q = _offset_codes(x, d, 16.5, 31)
    return torch.cat([_f16_bytes(d), *_five_bits(q)], dim=-1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    low = x.amin(dim=-1, keepdim=True)
    d = _div(x.amax(dim=-1, keepdim=True) - low, 31)
    q = _offset_codes(x - low, d, 0.5, 31)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), *_five_bits(q)], dim=-1)


# --------------------------------------------------------------------- K-quants (our quantizer)
@dataclass(frozen=True)
class KCodes:
    """One K-quant super-block's integers, what its bytes hold. The value of element j of sub-block s is
    (float(d) * scales[s]) * q[s, j] - float(dmin) * mins[s] (no dmin/mins term for Q3_K and Q6_K)."""

    d: torch.Tensor  # fp16 [B, 1]
    scales: torch.Tensor  # int32 [B, S]
    q: torch.Tensor  # int32 [B, S, L]
    dmin: torch.Tensor | None = None  # fp16 [B, 1]
    mins: torch.Tensor | None = None  # int32 [B, S]


@dataclass(frozen=True)
class _KSpec:
    sub: int  # values per sub-block
    q_range: tuple[int, int]  # the codes' range
    scale_range: tuple[int, int]  # the stored sub-block scales' (and mins') range
    affine: bool  # codes from the sub-block's min (with dmin and mins) or symmetric


_K: dict[str, _KSpec] = {
    "Q2_K": _KSpec(16, (0, 3), (0, 15), True),
    "Q3_K": _KSpec(16, (-4, 3), (-32, 31), False),
    "Q4_K": _KSpec(32, (0, 15), (0, 63), True),
    "Q5_K": _KSpec(32, (0, 31), (0, 63), True),
    "Q6_K": _KSpec(16, (-32, 31), (-128, 127), False),
}


def _super_scale(amount: torch.Tensor, top: int) -> torch.Tensor:
    """The super-block's fp16 scale that makes its largest sub-block `amount` (>= 0) the integer `top`."""
    return (amount.amax(dim=-1, keepdim=True) / top).to(torch.float16)


def _integers(values: torch.Tensor, d16: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """values / d rounded (ties to even) and clamped to `bounds`; 0 where d is 0."""
    return (values * _reciprocal(d16.float())).round_().clamp_(*bounds)


def _k_codes(x: torch.Tensor, type_name: str) -> KCodes:
    spec = _K[type_name]
    blocks = x.reshape(x.shape[0], QK_K // spec.sub, spec.sub)
    q_lo, q_hi = spec.q_range
    top = spec.scale_range[1]
    if spec.affine:
        low = blocks.amin(dim=-1).clamp(max=0)
        sub_scale = (blocks.amax(dim=-1) - low) / q_hi
        d, dmin = _super_scale(sub_scale, top), _super_scale(-low, top)
        scales, mins = _integers(sub_scale, d, spec.scale_range), _integers(-low, dmin, spec.scale_range)
        # The codes are taken against the scales as stored, which is what a reader multiplies them by.
        step = (d.float() * scales).unsqueeze(-1)
        offset = (dmin.float() * mins).unsqueeze(-1)
        q = ((blocks + offset) * _reciprocal(step)).round_().clamp_(q_lo, q_hi)
        return KCodes(d, scales.int(), q.int(), dmin, mins.int())
    # Symmetric: the sub-block's largest magnitude becomes the code q_lo (negative), its sign carried by the
    # sub-block scale, which is signed.
    sub_scale = _signed_extreme(blocks).squeeze(-1) / q_lo
    d = _super_scale(sub_scale.abs(), top)
    scales = _integers(sub_scale, d, spec.scale_range)
    step = (d.float() * scales).unsqueeze(-1)
    q = (blocks * _reciprocal(step)).round_().clamp_(q_lo, q_hi)
    return KCodes(d, scales.int(), q.int())


def _k_scale_bytes(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: 8 6-bit scales and 8 6-bit mins -> 12 bytes (bytes 0..3: scales 0..3 with the top 2 bits of
    scales 4..7 above them; 4..7: the same for the mins; 8..11: low nibbles of scales 4..7 | of mins 4..7 << 4)."""
    s, m = scales.to(torch.uint8), mins.to(torch.uint8)
    first = s[:, :4] | ((s[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (s[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return torch.cat([first, second, third], dim=-1)


def _pack_k(c: KCodes, type_name: str) -> torch.Tensor:
    n = c.q.shape[0]
    q = c.q.reshape(n, QK_K)
    if type_name == "Q2_K":
        # scales [16] (scale | min << 4), qs [64] (2-bit, per 128 values four planes of 32), d, dmin
        scales = (c.scales | (c.mins << 4)).to(torch.uint8)
        qs = _pack_planes(q.reshape(n, 2, 128), 2, 4).reshape(n, 64)
        return torch.cat([scales, qs, _f16_bytes(c.d), _f16_bytes(c.dmin)], dim=-1)
    if type_name == "Q3_K":
        # hmask [32] (bit 2 of q + 4, eight planes of 32), qs [64] (its low 2 bits), scales [12], d
        u = q + 4
        hmask = _pack_planes(u >> 2, 1, 8)
        qs = _pack_planes((u & 3).reshape(n, 2, 128), 2, 4).reshape(n, 64)
        s = c.scales + 32
        scales = torch.cat([_pack_planes(s & 0x0F, 4, 2), _pack_planes(s >> 4, 2, 4)], dim=-1)
        return torch.cat([hmask, qs, scales, _f16_bytes(c.d)], dim=-1)
    if type_name in ("Q4_K", "Q5_K"):
        # d, dmin, scales [12], (Q5_K: qh [32], bit 4 in eight planes of 32), qs [128] (nibbles, per 64 values)
        head = [_f16_bytes(c.d), _f16_bytes(c.dmin), _k_scale_bytes(c.scales, c.mins)]
        if type_name == "Q5_K":
            head.append(_pack_planes(q >> 4, 1, 8))
        qs = _pack_planes((q & 0x0F).reshape(n, 4, 64), 4, 2).reshape(n, 128)
        return torch.cat([*head, qs], dim=-1)
    # Q6_K: ql [128] (low nibbles, per 128 values two planes of 64), qh [64] (high 2 bits, four planes of 32),
    # scales [16] (int8), d
    u = (q + 32).reshape(n, 2, 128)
    ql = _pack_planes(u & 0x0F, 4, 2).reshape(n, 128)
    qh = _pack_planes(u >> 4, 2, 4).reshape(n, 64)
    scales = c.scales.to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh, scales, _f16_bytes(c.d)], dim=-1)


# --------------------------------------------------------------------- entry points
_LEGACY: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (34, _q8_0), "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q5_0": (22, _q5_0), "Q5_1": (24, _q5_1)}
_K_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def block_of(type_name: str, where: str = "tensor") -> tuple[int, int]:
    """(values, bytes) of one block of a type quantized here."""
    if type_name in _LEGACY:
        return 32, _LEGACY[type_name][0]
    if type_name in _K_BYTES:
        return QK_K, _K_BYTES[type_name]
    raise InputError(f"{where}: GGML type {type_name!r} is not one h3-spark quantizes "
                     f"({', '.join(QUANTIZABLE)})")


def _rows(x: torch.Tensor, type_name: str, where: str) -> tuple[torch.Tensor, int, int]:
    block, size = block_of(type_name, where)
    if not x.is_floating_point():
        raise InputError(f"{where}: quantizing needs floating-point values, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % block:
        width = x.shape[-1] if x.dim() else "no"
        raise InputError(f"{where}: a row of {width} values is not whole {type_name} blocks of {block}")
    k = x.shape[-1]
    return x.detach().reshape(-1, k), k // block, size


def _chunks(rows: torch.Tensor, chunk_values: int):
    step = max(1, chunk_values // rows.shape[1])
    for a in range(0, rows.shape[0], step):
        yield a, rows[a:a + step].float()


def _check_scales(scales: list[torch.Tensor], part: torch.Tensor, type_name: str, where: str) -> None:
    """Every fp16 scale (and min) finite, else a one-line error. A NaN or inf value reaches its block's scale
    (the extremes propagate it), so checking the scales, a 16th to a 128th of the values, checks the values too;
    the slow look at the values happens only to word the error."""
    if all(bool(torch.isfinite(s).all()) for s in scales):
        return
    if not torch.isfinite(part).all():
        raise InputError(f"{where}: holds non-finite values (NaN or inf), which no GGML block stores")
    raise InputError(f"{where}: values up to {part.abs().max().item():.4g} are too large for {type_name}: a block "
                     "scale overflows fp16 (65504 at most)")


def _legacy_scales(blocks: torch.Tensor, type_name: str) -> list[torch.Tensor]:
    """The fp16 d (and m, for the types with a min) of packed blocks of 32."""
    fields = (0, 2) if type_name in ("Q4_1", "Q5_1") else (0,)
    return [blocks[:, f:f + 2].contiguous().view(torch.float16) for f in fields]


def quantize(x: torch.Tensor, type_name: str, *, where: str = "tensor",
             chunk_values: int = CHUNK_VALUES) -> torch.Tensor:
    """`x`'s rows (its last dim) as GGML `type_name` blocks: uint8 [rows, row_bytes] on x's device."""
    rows, blocks_per_row, size = _rows(x, type_name, where)
    out = torch.empty(rows.shape[0], blocks_per_row * size, dtype=torch.uint8, device=rows.device)
    for a, part in _chunks(rows, chunk_values):
        n = part.shape[0]
        if type_name in _LEGACY:
            data = _LEGACY[type_name][1](part.reshape(n * blocks_per_row, 32))
            _check_scales(_legacy_scales(data, type_name), part, type_name, where)
        else:
            codes = _k_codes(part.reshape(n * blocks_per_row, QK_K), type_name)
            _check_scales([c for c in (codes.d, codes.dmin) if c is not None], part, type_name, where)
            data = _pack_k(codes, type_name)
        out[a:a + n] = data.reshape(n, blocks_per_row * size)
    return out


def k_codes(x: torch.Tensor, type_name: str, *, where: str = "tensor") -> KCodes:
    """The integers `quantize` stores for a K-quant, per super-block of 256 values (rows' blocks in order)."""
    if type_name not in K_QUANTS:
        raise InputError(f"{where}: k_codes is for the K-quants ({', '.join(K_QUANTS)}), not {type_name!r}")
    rows, _, _ = _rows(x, type_name, where)
    part = rows.float()
    codes = _k_codes(part.reshape(-1, QK_K), type_name)
    _check_scales([c for c in (codes.d, codes.dmin) if c is not None], part, type_name, where)
    return codes
