"""GGML blocks dequantized by fused Triton kernels on a CUDA GPU: each program decodes a few blocks in
registers and writes every value once, in the output dtype.

Values are bit for bit those of the torch codec (kernels/gguf_codec.py, itself bit for bit gguf's NumPy
dequantizer): every value is computed in fp32 with the same operations (products commute, so only which
products and sums are formed, and their nesting, matters), each multiplication and addition its own IEEE
rounding: kernels launch with `enable_fp_fusion=False`, which keeps Triton from contracting `a * b - c` into
one fused multiply-add (one rounding instead of two). fp16 scale fields are decoded exactly (two bytes, one
uint16, bitcast to fp16, widened to fp32), as are the integer codes. The fp32 value is rounded to the output
dtype once, at the store (nearest even, as torch's cast of the codec's fp32 result).

Layout: one program per BLOCKS consecutive blocks of the tensor (rows of K / 32 or K / 256 blocks, rows at any
stride), a tile [BLOCKS, 32] for the blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) and [BLOCKS, 16, 16]
for the super-blocks of 256 (Q2_K ... Q6_K, IQ4_XS; one row per sub-block of 16, so a sub-block's scale bytes
are read once per sub-block, the fp16 fields once per block). Each value reads its code bits straight from
its byte (neighbouring values read neighbouring bytes, so the loads coalesce); a block's values are stored
contiguously. One kernel for both families, the type a compile-time constant. The byte layouts are those
documented by the codec's decoders; the `value e = ...` comments say how a value's index e in its block picks
its bits.

The other GGML types (the lattice i-quants, the plain floats) and tensors off CUDA go through the torch codec;
`gguf_codec.dequantizer(type, device)` says which path a call takes.
"""

from __future__ import annotations

import torch

from ._triton import require_kernels, rnd_store, round_code, tl, triton
from .gguf_tables import IQ4_VALUES

# GGML type -> (its code within its family, bytes per block): blocks of 32 values, super-blocks of 256
_LEGACY = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20), "Q5_0": (3, 22), "Q5_1": (4, 24), "IQ4_NL": (5, 18)}
_SUPER = {"Q2_K": (0, 84), "Q3_K": (1, 110), "Q4_K": (2, 144), "Q5_K": (3, 176), "Q6_K": (4, 210),
          "IQ4_XS": (5, 136)}
TYPES = tuple(_LEGACY) + tuple(_SUPER)
# Blocks per program: 64 x 32 or 8 x 256 values, 16 per thread with 4 warps.
LEGACY_BLOCKS = 64
SUPER_BLOCKS = 8

if triton is not None:

    @triton.jit
    def _byte(p, m):
        """The bytes at p (uint8 pointers), as int32; 0 where masked."""
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _signed(b):
        """int32 of a byte 0..255 read as int8."""
        return (b ^ 0x80) - 0x80

    @triton.jit
    def _f16(p, m):
        """The little-endian fp16 field at p, exactly as fp32."""
        bits = _byte(p, m) | (_byte(p + 1, m) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    # ------------------------------------------------------------------ blocks of 32 (e = 0..31)
    @triton.jit
    def _nibble(p, e, m):
        # 16 bytes of codes at p: value e < 16 is byte e's low nibble, value 16 + e its high one
        return (_byte(p + e % 16, m) >> (4 * (e // 16))) & 0xF

    @triton.jit
    def _fifth_bit(p, e, m):
        # the little-endian uint32 at p holds value e's fifth bit as its bit e
        return (_byte(p + e // 8, m) >> (e % 8)) & 1

    @triton.jit
    def _legacy_values(p, e, m, table, KIND: tl.constexpr):
        """fp32 [B, 32] values of the blocks starting at p [B, 1]."""
        if KIND == 0:  # Q8_0: d [0], int8 codes [2:34]
            v = _signed(_byte(p + 2 + e, m)).to(tl.float32) * _f16(p, m)
        elif KIND == 1:  # Q4_0: d [0], codes [2:18]
            v = (_nibble(p + 2, e, m) - 8).to(tl.float32) * _f16(p, m)
        elif KIND == 2:  # Q4_1: d [0], m [2], codes [4:20]; d * q, then + m
            v = _nibble(p + 4, e, m).to(tl.float32) * _f16(p, m) + _f16(p + 2, m)
        elif KIND == 3:  # Q5_0: d [0], fifth bits [2:6], codes [6:22]
            q = _nibble(p + 6, e, m) | (_fifth_bit(p + 2, e, m) << 4)
            v = (q - 16).to(tl.float32) * _f16(p, m)
        elif KIND == 4:  # Q5_1: d [0], m [2], fifth bits [4:8], codes [8:24]
            q = _nibble(p + 8, e, m) | (_fifth_bit(p + 4, e, m) << 4)
            v = q.to(tl.float32) * _f16(p, m) + _f16(p + 2, m)
        else:  # IQ4_NL: d [0], codebook indices [2:18]
            v = tl.load(table + _nibble(p + 2, e, m)) * _f16(p, m)
        return v

    # ------------------------------------------------------------------ super-blocks of 256 (e = 0..255, i = e // 16)
    @triton.jit
    def _crumb(p, e, m):
        # 64 bytes at p in two halves of 32: value e = 128 h + 32 s + l is bits 2s..2s+1 of byte 32 h + l
        return (_byte(p + 32 * (e // 128) + e % 32, m) >> (2 * ((e // 32) % 4))) & 3

    @triton.jit
    def _k_nibble(p, e, m):
        # 128 bytes at p: value e = 64 c + 32 t + l is nibble t of byte 32 c + l
        return (_byte(p + 32 * (e // 64) + e % 32, m) >> (4 * ((e // 32) % 2))) & 0xF

    @triton.jit
    def _plane_bit(p, e, m):
        # 32 bytes at p: value e = 32 b + l is bit b of byte l
        return (_byte(p + e % 32, m) >> (e // 32)) & 1

    @triton.jit
    def _k_affine(p, i, m, q):
        """Q4_K / Q5_K: (d * scale_j) * q - dmin * min_j for sub-block j = i // 2 of 32 values; d [0],
        dmin [2], 6-bit scales and mins packed in the 12 bytes [4:16]: j < 4 takes the low 6 bits of bytes
        j (scale) and 4 + j (min); j >= 4 takes its low 4 bits from the nibbles of byte 8 + j % 4 and its
        high 2 bits from the top of bytes j % 4 (scale) and 4 + j % 4 (min)."""
        j = i // 2
        a = _byte(p + 4 + j % 4, m)
        b = _byte(p + 8 + j % 4, m)
        c = _byte(p + 12 + j % 4, m)
        scale = tl.where(j < 4, a & 0x3F, (c & 0xF) | ((a >> 2) & 0x30))
        low_min = tl.where(j < 4, b & 0x3F, (c >> 4) | ((b >> 2) & 0x30))
        d = _f16(p, m) * scale.to(tl.float32)
        dm = _f16(p + 2, m) * low_min.to(tl.float32)
        return d * q.to(tl.float32) - dm

    @triton.jit
    def _super_values(p, e, i, m, table, KIND: tl.constexpr):
        """fp32 [B, 16, 16] values of the super-blocks starting at p [B, 1, 1]: value e = 16 i + l, i [1, 16, 1]
        its sub-block of 16 (scales are read once per sub-block, not per value)."""
        if KIND == 0:  # Q2_K: scales [0:16] (low nibble scale, high min, per 16), codes [16:80], d [80], dmin [82]
            s = _byte(p + i, m)
            dl = _f16(p + 80, m) * (s & 0xF).to(tl.float32)
            ml = _f16(p + 82, m) * (s >> 4).to(tl.float32)
            v = dl * _crumb(p + 16, e, m).to(tl.float32) - ml
        elif KIND == 1:  # Q3_K: high bits [0:32] (set: no -4), low 2 bits [32:96], scales [96:108], d [108]
            q = _crumb(p + 32, e, m) - 4 * (_plane_bit(p, e, m) ^ 1)
            # 6-bit scale per sub-block i: low 4 bits are nibble i // 8 of byte i % 8, high 2 bits are crumb
            # i // 4 of byte 8 + i % 4
            low = (_byte(p + 96 + i % 8, m) >> (4 * (i // 8))) & 0xF
            high = (_byte(p + 104 + i % 4, m) >> (2 * (i // 4))) & 3
            dl = _f16(p + 108, m) * ((low | (high << 4)) - 32).to(tl.float32)
            v = dl * q.to(tl.float32)
        elif KIND == 2:  # Q4_K: d [0], dmin [2], scales [4:16], codes [16:144]
            v = _k_affine(p, i, m, _k_nibble(p + 16, e, m))
        elif KIND == 3:  # Q5_K: as Q4_K, fifth bits [16:48], codes [48:176]
            v = _k_affine(p, i, m, _k_nibble(p + 48, e, m) | (_plane_bit(p + 16, e, m) << 4))
        elif KIND == 4:  # Q6_K: low 4 bits [0:128], high 2 bits [128:192], int8 scales [192:208] per 16, d [208]
            # low 4 bits: value e = 128 h + 64 t + l (l < 64) is nibble t of byte 64 h + l
            low = (_byte(p + 64 * (e // 128) + e % 64, m) >> (4 * ((e // 64) % 2))) & 0xF
            q = (low | (_crumb(p + 128, e, m) << 4)) - 32
            dl = _f16(p + 208, m) * _signed(_byte(p + 192 + i, m)).to(tl.float32)
            v = dl * q.to(tl.float32)
        else:  # IQ4_XS: d [0], scale high bits [2:4] (uint16, 2 bits per 32), low nibbles [4:8], indices [8:136]
            j = i // 2  # sub-blocks of 32
            high = ((_byte(p + 2, m) | (_byte(p + 3, m) << 8)) >> (2 * j)) & 3
            low = (_byte(p + 4 + j // 2, m) >> (4 * (j % 2))) & 0xF
            dl = _f16(p, m) * ((low | (high << 4)) - 32).to(tl.float32)
            # value e = 32 j + 16 t + l is nibble t of byte 16 j + l
            code = (_byte(p + 8 + 16 * j + e % 16, m) >> (4 * ((e // 16) % 2))) & 0xF
            v = tl.load(table + code) * dl
        return v

    # ------------------------------------------------------------------ the kernel
    @triton.jit
    def _gguf_dequantize_kernel(raw, out, table, n_blocks, per_row, raw_stride, out_stride,
                           SUPER: tl.constexpr, KIND: tl.constexpr, SIZE: tl.constexpr, VALUES: tl.constexpr,
                           BLOCKS: tl.constexpr, RND: tl.constexpr):
        # block numbers [B] in int32 (a 64-bit division costs several times a 32-bit one), byte offsets in int64
        g = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        if SUPER:  # tiles [B, 16, 16]: value e = 16 i + l of sub-block i
            g = g[:, None, None]
            i = tl.arange(0, 16)[None, :, None]
            e = i * 16 + tl.arange(0, 16)[None, None, :]
        else:  # tiles [B, 32]
            g = g[:, None]
            e = tl.arange(0, VALUES)[None, :]
        m = g < n_blocks
        row = (g // per_row).to(tl.int64)
        col = (g % per_row).to(tl.int64)
        p = raw + row * raw_stride + col * SIZE
        if SUPER:
            v = _super_values(p, e, i, m, table, KIND)
        else:
            v = _legacy_values(p, e, m, table, KIND)
        dst = out + row * out_stride + col * VALUES + e
        tl.store(dst, rnd_store(v, RND).to(out.dtype.element_ty), mask=m)


_IQ4_TABLES: dict[str, torch.Tensor] = {}


def _iq4_table(device: torch.device) -> torch.Tensor:
    table = _IQ4_TABLES.get(str(device))
    if table is None:
        table = _IQ4_TABLES[str(device)] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)
    return table


def launch_plan(type_name: str) -> dict:
    """The kernel's compile-time constants for `type_name` (not RND, which the output dtype sets)."""
    if type_name in _LEGACY:
        (kind, size), values, blocks, is_super = _LEGACY[type_name], 32, LEGACY_BLOCKS, False
    elif type_name in _SUPER:
        (kind, size), values, blocks, is_super = _SUPER[type_name], 256, SUPER_BLOCKS, True
    else:
        raise ValueError(f"the GGUF Triton kernel has no {type_name} (it has {', '.join(TYPES)})")
    return {"SUPER": is_super, "KIND": kind, "SIZE": size, "VALUES": values, "BLOCKS": blocks}


# No contraction of a product and a sum into one FMA: gguf rounds each (tests/test_gguf_triton.py compiles
# the kernel for sm_90 and looks for fma in the PTX).
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


def dequantize_into(out: torch.Tensor, raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """GGML blocks `raw` (uint8 [N, row_bytes], rows at any stride, bytes contiguous) -> `out` [N, K] (fp32 /
    bf16 / fp16, contiguous within rows), with the codec's values. Shapes are the caller's to check
    (gguf_codec.dequantize_into does); this raises only for what the kernel itself cannot take."""
    require_kernels("the GGUF dequantization kernel")
    plan = launch_plan(type_name)
    n, k = out.shape
    if raw.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"GGUF {type_name}: blocks and output need contiguous rows, got strides "
                         f"{raw.stride()} and {out.stride()}")
    n_blocks = n * (k // plan["VALUES"])
    if n_blocks >= 2 ** 31:
        raise ValueError(f"GGUF {type_name}: {n_blocks} blocks in one call, more than the kernel counts (2^31 - 1)")
    if n_blocks:
        grid = (triton.cdiv(n_blocks, plan["BLOCKS"]),)
        _gguf_dequantize_kernel[grid](raw, out, _iq4_table(out.device), n_blocks, k // plan["VALUES"], raw.stride(0),
                                 out.stride(0), **plan, RND=round_code(out.dtype), **LAUNCH_OPTIONS)
    return out
