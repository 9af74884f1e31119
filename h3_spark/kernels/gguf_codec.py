"""GGML block quantizations (GGUF files) turned back into values, in PyTorch, row chunk by row chunk.

A GGUF tensor is read keeping its raw blocks, uint8 [N, row_bytes] (each row of K values is K / block_size
blocks of type_size bytes); `StoredLinear` (format "gguf") dequantizes it just in time into its scratch with
`dequantize_into`. Every value is computed in fp32 with the very operations, in the very order, of gguf-py's
NumPy dequantizer (`gguf.quants`, the reference ComfyUI-GGUF and diffusers port), each multiplication and
addition a separate IEEE fp32 rounding, so the result, cast to the output dtype, is bit for bit
`gguf.quants.dequantize(raw, type)` cast the same way (tests/test_gguf_codec.py checks every type). This is
vectorized torch (byte fields sliced at their offsets, bit fields by shifts and masks, fp16 scales by
`.view(torch.float16)`), device-agnostic. On a CUDA GPU the legacy blocks, the K-quants and IQ4_NL / IQ4_XS go
through fused Triton kernels instead (kernels/gguf_triton.py: a block decoded in registers, each value written
once, the same values bit for bit); `dequantizer(type, device)` says which path a call takes.

Work is done `CHUNK_ROWS` rows at a time: a row's values depend on its own blocks only, so chunking changes
no value, and it bounds the temporaries to a few bytes per value of one chunk (one fp32 copy, the code fields,
and for the codebook types an int32 index; ~9 bytes a value for IQ4): within the three fp32 chunk copies of
`stored_codec.CHUNK_ROWS` rows that `stored_linear.scratch_bytes` budgets for a GGUF layer.

Types (`SUPPORTED`): the legacy blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), the K-quants'
super-blocks of 256 (Q2_K ... Q6_K), the i-quants of 256 (IQ4_XS, and the lattice-grid IQ3_XXS, IQ3_S,
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, whose grids and sign table are gguf's own, taken from the package at
run time as data), and F16 / BF16 / F32 passed through. Not supported: the ternary TQ1_0 / TQ2_0, MXFP4 /
NVFP4, and Q8_1 / Q8_K (llama.cpp's activation blocks, which gguf does not dequantize).

Which published H3 files need which types. A file's name is a mix, not one type: most tensors at its base
type, some at higher ones (llama.cpp's quantize rules, which city96's ComfyUI-GGUF tools drive; the _M / _L
mixes reach Q5_K / Q6_K, IQ3_XS is IQ3_XXS with IQ3_S), and the 1-D tensors (norms, biases) F32 / F16 / BF16.
- unsloth/MiniMax-H3-GGUF (card: huggingface.co/unsloth/minimax-h3-gguf): the pruned fl2va / ref2va DiTs at
  the same rungs (Q2_K, UD-Q2_K_XL the smallest shown, Q3_K_*, Q4_K_*, Q5_0, Q6_K, Q8_0) and the Qwen3-VL text
  encoder (Q2_K_M / Q4_K_M): Q2_K ... Q6_K, Q5_0, Q8_0. Its card lists no per-tensor types; unsloth's dynamic
  (UD) mixes of other models use more than K-quants: in unsloth/Qwen3.8-Flash-Next-GGUF UD-Q4_K_XL stores
  Q4_K / Q5_K / Q5_1 / Q8_0 and UD-IQ4_XS stores IQ3_S / IQ4_XS / IQ4_NL / Q8_0 (per-tensor listing in
  Niko1221/Strata docs/QUANTS.md). So a UD-*_K_XL file needs the K-quants and legacy types, a UD-IQ* one
  the i-quants.
- Hub GGUF listings of the pruned 20B `minimax_h3` DiT (huggingface.co/Kutches/minmax, duplicated as
  Rob1221rib/minmax) carry UD-IQ2_XXS, UD-IQ3_XXS, IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_XS and IQ4_XS files beside the
  K-quants: IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S / IQ4_XS / IQ4_NL.
- realrebelai/MiniMax-H3_GGUFs (Q3_K_M, Q4_K_M), joeygambino/MiniMax-H3(-curve)-GGUF (Q8_0, Q5_1, Q4_0),
  LSDJesus/MiniMax-H3-Image-GGUF (Q6_K, Q4_K, Q3_K, a Q2_K / Q3_K / Q4_K mix); audio.cpp's files at Q4_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import CheckpointError
from .gguf_tables import IQ4_VALUES

CHUNK_ROWS = 4096
QK_K = 256  # the K-quants' and i-quants' super-block


# --------------------------------------------------------------------- byte and bit fields
def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at `offset` of every block, as fp32 [B, 1] (exact). The two bytes are copied out first:
    a field at an odd multiple of 2 in a block of an odd number of halfwords cannot be viewed in place."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _f16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int tensor [B] of 16-bit patterns -> fp32 [B, 1]."""
    pair = torch.stack([bits & 0xFF, (bits >> 8) & 0xFF], dim=-1).to(torch.uint8)
    return pair.contiguous().view(torch.float16).float()


def _uint(fields: torch.Tensor) -> torch.Tensor:
    """Little-endian unsigned integers from their bytes on the last dim (2 or 4 of them), int64 (GGUF is
    little-endian; composing the bytes, not viewing them, needs no alignment and keeps the top bit unsigned)."""
    fields = fields.to(torch.int64)
    value = fields[..., 0]
    for i in range(1, fields.shape[-1]):
        value = value | (fields[..., i] << (8 * i))
    return value


def _split(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n] -> [..., count, n]: field i of each element is (x >> width * i) & (2^width - 1). The nibbles
    (4, 2), the 2-bit crumbs (2, 4) and the bits (1, 8) of the GGML layouts, in their order."""
    mask = (1 << width) - 1
    return torch.stack([(x >> (width * i)) & mask for i in range(count)], dim=-2)


def _interleaved(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n] -> [..., n * count] with the fields of each element next to each other (element-major)."""
    return _split(x, width, count).transpose(-1, -2).reshape(*x.shape[:-1], x.shape[-1] * count)


def _planes(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n] -> [..., count * n]: all elements' field 0, then all field 1, ... (field-major)."""
    return _split(x, width, count).reshape(*x.shape[:-1], count * x.shape[-1])


# --------------------------------------------------------------------- lookup tables
_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A codebook on `device`, made once per device: "iq4" (fp32 [16]), "ksigns" (uint8 [128]: 7 sign bits and
    their parity as the 8th), or an i-quant's lattice grid (fp32 [entries, 4 or 8]) as gguf defines it."""
    key = (name, str(device))
    table = _TABLES.get(key)
    if table is None:
        if name == "iq4":
            table = torch.tensor(IQ4_VALUES, dtype=torch.float32)
        else:
            try:  # the grids are gguf's data; only the i-quants need the package
                from gguf import quants
            except ImportError as exc:
                raise CheckpointError(f"GGML i-quants need the gguf package (pip install 'gguf>=0.10'): {exc}") from exc
            if name == "ksigns":
                table = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
            else:
                cls = getattr(quants, name)
                cls.init_grid()
                table = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())
        table = _TABLES[key] = table.to(device)
    return table


def _grid(name: str, index: torch.Tensor) -> torch.Tensor:
    """Grid rows of `name` at `index` [...] -> fp32 [..., row width] (a new tensor, safe to scale in place)."""
    return _table(name, index.device)[index.to(torch.int32)]


def _signs(sign_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] of sign masks -> int8 [..., n, 8] of +-1 (bit j set: value j negative). Multiplying by an
    int8 +-1 is the fp32 product by +-1.0 that gguf computes, without an fp32 temporary."""
    bits = _interleaved(sign_bytes, 1, 8).reshape(*sign_bytes.shape, 8)
    return (1 - 2 * bits.to(torch.int8)).to(torch.int8)


def _ksigns(words: torch.Tensor) -> torch.Tensor:
    """int64 [..., G] words holding four 7-bit sign indices in bits 0..27 -> int8 +-1 [..., G, 4, 8]."""
    index = torch.stack([(words >> (7 * i)) & 0x7F for i in range(4)], dim=-1)
    return _signs(_table("ksigns", words.device)[index.to(torch.int32)])


# --------------------------------------------------------------------- blocks of 32
# Each decoder: uint8 [B, type_size] -> fp32 [B, block_size], in gguf's operation order.
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return q.mul_(_f16(b, 0))


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] codes: the 16 low nibbles, then the 16 high ones (the blocks-of-32 layout)."""
    return _planes(qs, 4, 2)


def _fifth_bit(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The 32 high bits of Q5_0 / Q5_1: bit j of the little-endian uint32 at `offset`, as uint8 [B, 32]."""
    return _interleaved(b[:, offset:offset + 4], 1, 8)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = (_low_high(b[:, 2:18]).to(torch.int8) - 8).float()
    return q.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _low_high(b[:, 4:20]).float()
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))  # d * q, then + m: two roundings, as gguf's


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = ((_low_high(b[:, 6:22]) | (_fifth_bit(b, 2) << 4)).to(torch.int8) - 16).float()
    return q.mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_low_high(b[:, 8:24]) | (_fifth_bit(b, 4) << 4)).float()
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _table("iq4", b.device)[_low_high(b[:, 2:18]).to(torch.int32)]
    return q.mul_(_f16(b, 0))


# --------------------------------------------------------------------- K-quants (super-blocks of 256)
def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales [0:16] (low nibble: scale, high: min, per 16 values), qs [16:80] (2-bit), d [80], dmin [82]
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _planes(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, QK_K)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes -> 16 signed 6-bit scales, fp32: low 4 bits from the nibbles of bytes 0..7
    (low nibbles first), high 2 bits from the crumbs of bytes 8..11 (crumb-major)."""
    low = _planes(s[:, 0:8], 4, 2)
    high = _planes(s[:, 8:12], 2, 4)
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask [0:32] (high bit, inverted), qs [32:96] (low 2 bits), scales [96:108], d [108]
    n = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    low = _planes(b[:, 32:96].reshape(n, 2, 32), 2, 4).reshape(n, QK_K)
    high = _planes(b[:, 0:32], 1, 8) ^ 1  # a set bit means no -4 offset
    q = (low.to(torch.int8) - (high << 2).to(torch.int8)).float().reshape(n, 16, 16)
    return q.mul_(dl).reshape(n, QK_K)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins (uint8): entries 0..3 are the low 6 bits of
    bytes 0..3 (scales) and 4..7 (mins); entries 4..7 take their low 4 bits from the nibbles of bytes 8..11 and
    their high 2 bits from the top of bytes 0..3 / 4..7."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: codes q [B, 8, 32] -> (d * scale) * q - dmin * min per sub-block of 32."""
    n = b.shape[0]
    scale, minimum = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * scale.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * minimum.float()).reshape(n, 8, 1)
    return q.float().mul_(d).sub_(dm).reshape(n, QK_K)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 128] bytes -> [B, 8, 32] codes: per 32 bytes, their low nibbles (one sub-block), then the high ones."""
    n = qs.shape[0]
    return _planes(qs.reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d [0], dmin [2], scales [4:16], qs [16:144]
    return _k_affine(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d [0], dmin [2], scales [4:16], qh [16:48] (bit j of byte l: value 32 j + l), qs [48:176]
    n = b.shape[0]
    high = _planes(b[:, 16:48], 1, 8).reshape(n, 8, 32)
    return _k_affine(b, _k_nibbles(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql [0:128] (low 4 bits), qh [128:192] (high 2 bits), scales [192:208] (int8, per 16), d [208]
    n = b.shape[0]
    low = _planes(b[:, 0:128].reshape(n, 2, 64), 4, 2).reshape(n, QK_K)
    high = _planes(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, QK_K)
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    return q.mul_(d).reshape(n, QK_K)


# --------------------------------------------------------------------- i-quants (super-blocks of 256)
def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d [0], scales_h [2:4] (uint16, 2 bits per sub-block), scales_l [4:8] (nibbles), qs [8:136]
    n = b.shape[0]
    high = _split(_uint(b[:, 2:4]).unsqueeze(-1), 2, 8).reshape(n, 8)
    low = _interleaved(b[:, 4:8], 4, 2).to(torch.int64)
    dl = (_f16(b, 0) * ((low | (high << 4)) - 32).float()).reshape(n, 8, 1)
    codes = _planes(b[:, 8:136].reshape(n, 8, 16), 4, 2).reshape(n, 8, 32)
    return _table("iq4", b.device)[codes.to(torch.int32)].mul_(dl).reshape(n, QK_K)


def _half_step_scale(d: torch.Tensor, nibble: torch.Tensor, factor: float) -> torch.Tensor:
    """d * (0.5 + s) * factor, left to right, as gguf rounds it (IQ2_* use 0.25, IQ3_XXS 0.5)."""
    return d * (nibble.float() + 0.5) * factor


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    # d [0]; per sub-block of 32: 4 grid indices (bytes), then a uint32 of 4 x 7 sign bits and a 4-bit scale
    n = b.shape[0]
    qs = b[:, 2:66].reshape(n, 8, 8)
    words = _uint(qs[:, :, 4:8])
    db = _half_step_scale(_f16(b, 0), words >> 28, 0.25).reshape(n, 8, 1, 1)
    values = _grid("IQ2_XXS", qs[:, :, 0:4]).mul_(db)
    return values.mul_(_ksigns(words)).reshape(n, QK_K)


def _nibble_scales(s: torch.Tensor) -> torch.Tensor:
    """Bytes [B, m] -> [B, 2 m]: the low then the high nibble of each byte (the IQ2_XS / IQ2_S / IQ3_S scales)."""
    return _interleaved(s, 4, 2)


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    # d [0], qs [2:66] (uint16: 9-bit grid index, 7-bit sign index), scales [66:74] (per 16 values)
    n = b.shape[0]
    qs = _uint(b[:, 2:66].reshape(n, 32, 2))
    db = _half_step_scale(_f16(b, 0), _nibble_scales(b[:, 66:74]), 0.25).reshape(n, 16, 1, 1)
    values = _grid("IQ2_XS", qs & 511).reshape(n, 16, 2, 8).mul_(db)
    signs = _signs(_table("ksigns", b.device)[(qs >> 9).to(torch.int32)])
    return values.mul_(signs.reshape(n, 16, 2, 8)).reshape(n, QK_K)


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    # d [0], qs [2:34] (low 8 index bits), signs [34:66] (bit masks), qh [66:74] (2 high bits each), scales [74:82]
    n = b.shape[0]
    index = b[:, 2:34].to(torch.int32) | (_interleaved(b[:, 66:74], 2, 4).to(torch.int32) << 8)
    db = _half_step_scale(_f16(b, 0), _nibble_scales(b[:, 74:82]), 0.25).reshape(n, 16, 1, 1)
    values = _grid("IQ2_S", index).reshape(n, 16, 2, 8).mul_(db)
    return values.mul_(_signs(b[:, 34:66]).reshape(n, 16, 2, 8)).reshape(n, QK_K)


def _iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    # d [0], qs [2:66] (grid indices, 4 values each), then per sub-block of 32 a uint32 like IQ2_XXS's second
    n = b.shape[0]
    words = _uint(b[:, 66:98].reshape(n, 8, 4))
    db = _half_step_scale(_f16(b, 0), words >> 28, 0.5).reshape(n, 8, 1, 1)
    values = _grid("IQ3_XXS", b[:, 2:66]).reshape(n, 8, 4, 8).mul_(db)
    return values.mul_(_ksigns(words)).reshape(n, QK_K)


def _iq3_s(b: torch.Tensor) -> torch.Tensor:
    # d [0], qs [2:66] (low 8 index bits), qh [66:74] (9th bits), signs [74:106], scales [106:110] (per 32)
    n = b.shape[0]
    index = b[:, 2:66].to(torch.int32) | (_interleaved(b[:, 66:74], 1, 8).to(torch.int32) << 8)
    odd = _nibble_scales(b[:, 106:110]).float() * 2 + 1  # 1 + 2 s: a small integer, exact
    db = (_f16(b, 0) * odd).reshape(n, 8, 1, 1)
    values = _grid("IQ3_S", index).reshape(n, 8, 4, 8).mul_(db)
    return values.mul_(_signs(b[:, 74:106]).reshape(n, 8, 4, 8)).reshape(n, QK_K)


_IQ1_DELTA = 0.125


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    # d [0], qs [2:34] (low 8 index bits), qh [34:50] (uint16 per 32 values: 4 x 3 index bits, 3-bit scale, sign
    # of the delta)
    n = b.shape[0]
    qh = _uint(b[:, 34:50].reshape(n, 8, 2))
    dl = (_f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().reshape(n, 8, 1, 1)
    index = b[:, 2:34].to(torch.int64) | (_interleaved(qh, 3, 4) << 8)
    values = _grid("IQ1_S", index).reshape(n, 8, 4, 8)
    return values.add_(delta).mul_(dl).reshape(n, QK_K)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    # qs [0:32] (low 8 index bits), qh [32:48] (per 8 values a nibble: 3 index bits, delta sign), scales [48:56]
    # (4 uint16: 3-bit scales in bits 0..11, and the fp16 d spread over their top nibbles)
    n = b.shape[0]
    words = _uint(b[:, 48:56].reshape(n, 4, 2))
    top = (words & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)
    d = _f16_from_bits(top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3])
    scales = _interleaved(words, 3, 4)  # [B, 16], the low 12 bits of each word
    dl = (d * (2 * scales + 1).float()).reshape(n, 8, 2, 1, 1)
    nibbles = _interleaved(b[:, 32:48], 4, 2)  # [B, 32], one per 8 values
    index = b[:, 0:32].to(torch.int32) | ((nibbles & 7).to(torch.int32) << 8)
    delta = torch.where((nibbles & 8) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().reshape(n, 8, 2, 2, 1)
    values = _grid("IQ1_M", index).reshape(n, 8, 2, 2, 8)
    return values.add_(delta).mul_(dl).reshape(n, QK_K)


# --------------------------------------------------------------------- plain floats
def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def decode(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(dtype).float()

    return decode


# --------------------------------------------------------------------- the table and the entry points
@dataclass(frozen=True)
class _Type:
    block: int  # values per block
    size: int  # bytes per block
    decode: Callable[[torch.Tensor], torch.Tensor]


_TYPES: dict[str, _Type] = {
    "F32": _Type(1, 4, _plain(torch.float32)),
    "F16": _Type(1, 2, _plain(torch.float16)),
    "BF16": _Type(1, 2, _plain(torch.bfloat16)),
    "Q8_0": _Type(32, 34, _q8_0),
    "Q4_0": _Type(32, 18, _q4_0),
    "Q4_1": _Type(32, 20, _q4_1),
    "Q5_0": _Type(32, 22, _q5_0),
    "Q5_1": _Type(32, 24, _q5_1),
    "Q2_K": _Type(QK_K, 84, _q2_k),
    "Q3_K": _Type(QK_K, 110, _q3_k),
    "Q4_K": _Type(QK_K, 144, _q4_k),
    "Q5_K": _Type(QK_K, 176, _q5_k),
    "Q6_K": _Type(QK_K, 210, _q6_k),
    "IQ4_NL": _Type(32, 18, _iq4_nl),
    "IQ4_XS": _Type(QK_K, 136, _iq4_xs),
    "IQ3_S": _Type(QK_K, 110, _iq3_s),
    "IQ3_XXS": _Type(QK_K, 98, _iq3_xxs),
    "IQ2_S": _Type(QK_K, 82, _iq2_s),
    "IQ2_XS": _Type(QK_K, 74, _iq2_xs),
    "IQ2_XXS": _Type(QK_K, 66, _iq2_xxs),
    "IQ1_M": _Type(QK_K, 56, _iq1_m),
    "IQ1_S": _Type(QK_K, 50, _iq1_s),
}
SUPPORTED = tuple(_TYPES)


def _spec(type_name: str, where: str) -> _Type:
    spec = _TYPES.get(type_name)
    if spec is None:
        raise CheckpointError(f"{where}: GGML type {type_name} is not supported (supported: {', '.join(SUPPORTED)})")
    return spec


def block_size(type_name: str) -> int:
    """Values per block of a supported GGML type (1 for the plain floats)."""
    return _spec(type_name, "GGUF tensor").block


def row_bytes(type_name: str, k: int, where: str = "GGUF tensor") -> int:
    """Bytes of one row of `k` values."""
    spec = _spec(type_name, where)
    if k % spec.block:
        raise CheckpointError(f"{where}: {k} values per row is not a multiple of the {type_name} block of {spec.block}")
    return k // spec.block * spec.size


def check(type_name: str, shape, nbytes: int, where: str) -> None:
    """Raise CheckpointError (one line naming `where`) unless `nbytes` stored bytes hold a `shape` tensor
    (rows on the last dim) of `type_name` blocks."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise CheckpointError(f"{where}: a {type_name} tensor needs at least one dimension")
    rows = 1
    for s in shape[:-1]:
        rows *= s
    expected = rows * row_bytes(type_name, shape[-1], where)
    if nbytes != expected:
        raise CheckpointError(f"{where}: {nbytes} bytes stored, but {type_name} {list(shape)} takes {expected}")


def dequantizer(type_name: str, device) -> str:
    """Which code `dequantize_into` runs for `type_name` blocks on `device`: "triton" (the fused kernels, on a
    CUDA device for the types they have, when Triton is installed) or "torch" (this module, everything else).
    Both give the same values; a report names the path that ran, and a kernel's error is raised, not retried."""
    if torch.device(device).type == "cuda":
        from . import gguf_triton

        if gguf_triton.triton is not None and type_name in gguf_triton.TYPES:
            return "triton"
    return "torch"


def dequantize_into(out: torch.Tensor, raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """GGML blocks `raw` (uint8 [N, row_bytes], on out's device) -> `out` [N, K] (fp32 / bf16 / fp16): the fp32
    values gguf's NumPy dequantizer gives, cast to out's dtype."""
    if out.dim() != 2 or raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[0] != out.shape[0]:
        raise CheckpointError(f"GGUF {type_name} blocks must be uint8 [N, bytes per row] for an [N, K] output, "
                              f"got {raw.dtype} {list(raw.shape)} for {list(out.shape)}")
    check(type_name, out.shape, raw.numel(), "GGUF tensor")
    if raw.device != out.device:
        raise CheckpointError(f"GGUF {type_name} blocks on {raw.device} cannot be dequantized into {out.device}")
    if dequantizer(type_name, out.device) == "triton":
        from . import gguf_triton

        return gguf_triton.dequantize_into(out, raw, type_name)
    spec = _TYPES[type_name]
    n, k = out.shape
    for a in range(0, n, CHUNK_ROWS):
        b = min(n, a + CHUNK_ROWS)
        blocks = raw[a:b].reshape((b - a) * (k // spec.block), spec.size)
        out[a:b].copy_(spec.decode(blocks).reshape(b - a, k))
    return out
