"""GGML block dequantization (kernels/gguf_codec.py) against gguf's NumPy dequantizer.

Oracle: `gguf.quants.dequantize` (gguf-py, the package the GGUF readers install; written against 0.19.0).
Budget: bit for bit (torch.equal) in fp32, and in bf16 / fp16 through the same cast of gguf's fp32, for every
supported type, on blocks gguf quantizes itself where it has a quantizer (the legacy types and the plain
floats) and on random valid blocks for all (random quant bits, random finite fp16 scale fields: every
exponent, subnormals included), at two or three blocks per row and at 64 x 1024, across row-chunk boundaries.
Known answers worked out by hand pin Q8_0's and Q4_K's layouts independently of gguf, and a corrupted block
must change exactly its own values.
"""

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from h3_spark.errors import CheckpointError
from h3_spark.kernels import gguf_codec
from h3_spark.kernels.stored_linear import StoredForm, StoredLinear

# Where each type keeps its fp16 scales (byte offsets in a block); IQ1_M spreads its d over four nibbles.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_S": (0,), "IQ2_XS": (0,), "IQ2_XXS": (0,),
               "IQ1_S": (0,), "IQ1_M": (), "F16": (), "BF16": (), "F32": ()}
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf has these quantizers
REQUIRED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32",
            "IQ4_NL", "IQ4_XS"}


def _qtype(name):
    return GGMLQuantizationType[name]


def _sizes(name):
    return GGML_QUANT_SIZES[_qtype(name)]


def _finite_f16(rng, n):
    """n fp16 values with random bit patterns, Inf / NaN patterns folded onto finite ones."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
    return bits.view(np.float16)


def random_blocks(name, n_blocks, rng):
    """Random valid blocks, uint8 [n_blocks, type_size]: every quant bit random, every fp16 field finite."""
    _, size = _sizes(name)
    if name == "F32":
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if name == "BF16":
        top = (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return top.view(np.uint8).reshape(n_blocks, 2)
    if name == "F16":
        return _finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        blocks[:, offset:offset + 2] = _finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":  # d's bits 4 i .. 4 i + 3 are the top nibble of scale word i (bytes 48..55)
        d = _finite_f16(rng, n_blocks).view(np.uint16)
        words = blocks[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    return blocks


def random_raw(name, rows, k, rng):
    block, _ = _sizes(name)
    return random_blocks(name, rows * k // block, rng).reshape(rows, -1)


def gguf_values(raw, name):
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, _qtype(name))))


def ours(raw, name, k, dtype=torch.float32):
    out = torch.empty(raw.shape[0], k, dtype=dtype)
    return gguf_codec.dequantize_into(out, torch.from_numpy(raw), name)


def assert_exact(raw, name, k):
    ref = gguf_values(raw, name).reshape(raw.shape[0], k)
    got = ours(raw, name, k)
    assert torch.equal(got, ref), f"{name}: {(got != ref).sum().item()} of {ref.numel()} fp32 values differ"
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(ours(raw, name, k, dtype), ref.to(dtype)), f"{name} in {dtype}"


def _row_lengths(name):
    block, _ = _sizes(name)
    return [2 * block, 3 * block] if block > 1 else [2 * 32, 3 * 32]


# --------------------------------------------------------------------------------------------- the table
def test_types_and_sizes_are_ggmls():
    assert REQUIRED <= set(gguf_codec.SUPPORTED)
    for name in gguf_codec.SUPPORTED:
        block, size = _sizes(name)
        assert gguf_codec.block_size(name) == block
        assert gguf_codec.row_bytes(name, 4 * block) == 4 * size, name


# --------------------------------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("name", gguf_codec.SUPPORTED)
def test_random_blocks_bit_exact_across_chunks(name, monkeypatch):
    rng = np.random.default_rng(sum(map(ord, name)))
    monkeypatch.setattr(gguf_codec, "CHUNK_ROWS", 3)  # 7 rows: chunks of 3, 3 and 1
    for k in _row_lengths(name):
        assert_exact(random_raw(name, 7, k, rng), name, k)


@pytest.mark.parametrize("name", gguf_codec.SUPPORTED)
def test_random_blocks_bit_exact_64x1024(name):
    rng = np.random.default_rng(1 + sum(map(ord, name)))
    assert_exact(random_raw(name, 64, 1024, rng), name, 1024)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_gguf_quantized_weights_bit_exact(name, monkeypatch):
    rng = np.random.default_rng(2 + sum(map(ord, name)))
    monkeypatch.setattr(gguf_codec, "CHUNK_ROWS", 2)
    for rows, k in [(5, 64), (3, 96), (64, 1024)]:
        # Rows of very different magnitudes, and an all-zero block (scale 0).
        weights = (rng.standard_normal((rows, k)) * np.exp(rng.uniform(-6, 3, (rows, 1)))).astype(np.float32)
        weights[0, :32] = 0
        raw = np.ascontiguousarray(quants.quantize(weights, _qtype(name))).view(np.uint8).reshape(rows, -1)
        assert_exact(raw, name, k)


def test_rows_are_independent():
    rng = np.random.default_rng(3)
    raw = random_raw("Q4_K", 6, 512, rng)
    whole = ours(raw, "Q4_K", 512)
    for r in range(6):
        assert torch.equal(ours(raw[r:r + 1], "Q4_K", 512), whole[r:r + 1])


@pytest.mark.parametrize("name", gguf_codec.SUPPORTED)
def test_a_corrupted_block_changes_its_values_only(name):
    """The comparisons above would pass for a codec that ignored its input if gguf did too: replacing one block
    must change that block's values, and no other."""
    rng = np.random.default_rng(4 + sum(map(ord, name)))
    block, _ = _sizes(name)
    k = 3 * block if block > 1 else 96
    raw = random_raw(name, 4, k, rng)
    before = ours(raw, name, k)
    bad = raw.copy()
    per_row = raw.shape[1] // (k // block)
    bad[2, per_row:2 * per_row] = random_blocks(name, 1, rng)[0]  # row 2, block 1
    after = ours(bad, name, k)
    span = slice(block, 2 * block)
    assert not torch.equal(after[2, span], before[2, span])
    after[2, span] = before[2, span]
    assert torch.equal(after, before)
    assert torch.equal(ours(bad, name, k), gguf_values(bad, name).reshape(4, k))


# --------------------------------------------------------------------------------------------- known answers
def test_q8_0_known_answer():
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8),
                            np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    got = ours(block.reshape(1, 34), "Q8_0", 32)
    assert torch.equal(got[0], torch.arange(-16, 16, dtype=torch.float32) * 0.5)


def test_q4_k_known_answer():
    """d = 1, dmin = 0.5, sub-block j of 32 has scale j + 1 and min j, every byte of codes 0x21 (low nibble 1 for
    the first sub-block of each 32 bytes, high nibble 2 for the second): value = (j + 1) * q - 0.5 * j."""
    sc, mn = np.arange(1, 9), np.arange(8)
    scales = np.concatenate([sc[:4], mn[:4], sc[4:] | (mn[4:] << 4)]).astype(np.uint8)
    block = np.concatenate([np.array([1.0, 0.5], np.float16).view(np.uint8), scales, np.full(128, 0x21, np.uint8)])
    got = ours(block.reshape(1, 144), "Q4_K", 256)[0].reshape(8, 32)
    q = torch.tensor([1.0, 2.0] * 4)
    expected = (torch.arange(1.0, 9.0) * q - 0.5 * torch.arange(8.0))[:, None].expand(8, 32)
    assert torch.equal(got, expected)


# --------------------------------------------------------------------------------------------- StoredLinear
def test_stored_linear_holds_gguf_blocks():
    rng = np.random.default_rng(5)
    raw = random_raw("Q6_K", 8, 512, rng)
    ref = gguf_values(raw, "Q6_K").reshape(8, 512)
    form = StoredForm(format="gguf", shape=(8, 512), tensors={"weight": torch.from_numpy(raw)}, gguf_type="Q6_K")
    assert torch.equal(StoredLinear(form, torch.float32).dequantized(), ref)
    swapped = StoredForm(format="gguf", shape=(8, 512), tensors={"weight": torch.from_numpy(raw)},
                         gguf_type="Q6_K", swap_halves=True)
    assert torch.equal(StoredLinear(swapped, torch.bfloat16).dequantized(),
                       torch.cat([ref[4:], ref[:4]]).to(torch.bfloat16))


# --------------------------------------------------------------------------------------------- errors
def test_unsupported_types_are_named():
    for name in ("TQ2_0", "MXFP4", "Q9_9"):
        with pytest.raises(CheckpointError) as err:
            gguf_codec.check(name, (16, 256), 1000, "blk.0.attn.to_q.weight")
        message = str(err.value)
        assert message.startswith(f"blk.0.attn.to_q.weight: GGML type {name} is not supported (supported: F32, ")
        assert "Q4_K" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="GGML type TQ1_0 is not supported"):
        gguf_codec.row_bytes("TQ1_0", 256)


def test_wrong_byte_count_is_named():
    with pytest.raises(CheckpointError) as err:
        gguf_codec.check("Q4_K", (16, 512), 100, "blk.3.ffn.fc2.weight")
    assert str(err.value) == "blk.3.ffn.fc2.weight: 100 bytes stored, but Q4_K [16, 512] takes 4608"
    gguf_codec.check("Q4_K", (16, 512), 4608, "blk.3.ffn.fc2.weight")
    gguf_codec.check("Q8_0", (2, 3, 64), 6 * 68, "conv")  # rows on the last dim, any leading shape


def test_row_length_not_a_multiple_of_the_block_is_named():
    with pytest.raises(CheckpointError) as err:
        gguf_codec.check("Q4_K", (4, 300), 4 * 144, "txt.blk.1.attn_k.weight")
    assert str(err.value) == ("txt.blk.1.attn_k.weight: 300 values per row is not a multiple of the Q4_K block "
                              "of 256")


def test_dequantize_into_checks_its_inputs():
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="136 bytes stored, but Q8_0 \\[4, 64\\] takes 272"):
        gguf_codec.dequantize_into(torch.empty(4, 64), raw, "Q8_0")  # 64 values a row need 68 bytes
    with pytest.raises(CheckpointError, match="uint8"):
        gguf_codec.dequantize_into(torch.empty(4, 32), raw.to(torch.int16), "Q8_0")
    with pytest.raises(CheckpointError, match="not supported"):
        gguf_codec.dequantize_into(torch.empty(4, 32), raw, "IQ5_K")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [t for t in gguf_codec.SUPPORTED])
def test_cuda_dequantization_is_ggufs_bit_for_bit(name):
    """On a GPU (the Triton kernels for the types they have, the torch codec for the rest): every type's random
    valid blocks give gguf's values exactly (fp32, and the
    bf16 / fp16 casts of them), in the row chunks StoredLinear dequantizes into on the device."""
    rng = np.random.default_rng(17)
    k = _row_lengths(name)[-1]
    raw = random_raw(name, 96, k, rng)
    ref = gguf_values(raw, name).reshape(96, k)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(96, k, dtype=dtype, device="cuda")
        gguf_codec.dequantize_into(out, torch.from_numpy(raw).cuda(), name)
        assert torch.equal(out.cpu(), ref.to(dtype)), f"{name} in {dtype}"
