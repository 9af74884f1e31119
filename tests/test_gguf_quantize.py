"""Our GGML quantizers (h3_model/checkpoint/gguf_quantize.py).

Oracles: gguf-py's NumPy quantizers for the legacy blocks (our bytes must be theirs, bit for bit); for the
K-quants, which we quantize our own way, gguf-py's NumPy dequantizer: the values it reads from our bytes must be
the values the integers `k_codes` reports give (computed here, in the dequantizer's order), which pins every
field's packing; our codec (kernels/gguf_codec.py) must read the same values; and the round-trip error on
Gaussian rows must stay under the table below (measured: see ROUND_TRIP).
"""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from h3_spark.errors import InputError  # noqa: E402
from h3_spark.h3_model.checkpoint import gguf_quantize as Q  # noqa: E402
from h3_spark.h3_model.checkpoint.gguf_writer import encode, gguf_type_of, writable_types  # noqa: E402
from h3_spark.kernels import gguf_codec  # noqa: E402

# Relative L2 error of a round trip on 64 x 4096 N(0, 1) values (seed 4), measured: Q8_0 0.0054, Q6_K 0.0188,
# Q5_1 0.0379, Q5_K 0.0382, Q5_0 0.0427, Q4_K 0.0784, Q4_1 0.0783, Q4_0 0.0862, Q3_K 0.1550, Q2_K 0.3287; the
# bound each must stay under (about 12 % above).
ROUND_TRIP = {"Q8_0": 0.0061, "Q6_K": 0.021, "Q5_1": 0.043, "Q5_K": 0.043, "Q5_0": 0.048, "Q4_K": 0.088,
              "Q4_1": 0.088, "Q4_0": 0.097, "Q3_K": 0.175, "Q2_K": 0.37}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Gaussian rows of varied scale, with the blocks the rules treat specially: all zeros, constant, a tie of
    +max and -max (the first one sets the sign), one huge value among small ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g).mul(3).exp()
    x[0, :32] = 0
    x[1, :32] = 0.25
    x[2, :32] = torch.rand(32, generator=g)
    x[2, 3], x[2, 9] = -1.5, 1.5
    x[3, 40] = 1e4
    return x


def _gguf(x: torch.Tensor, type_name: str) -> np.ndarray:
    return quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType[type_name])


def _gguf_values(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(blocks.cpu().numpy(), gguf.GGMLQuantizationType[type_name]),
                                     dtype=np.float32))


def _intended(c: Q.KCodes) -> torch.Tensor:
    """d * scale * q - dmin * min per sub-block, from the integers, in the dequantizer's order ([blocks, 256])."""
    values = (c.d.float().unsqueeze(-1) * c.scales.float().unsqueeze(-1)) * c.q.float()
    if c.dmin is not None:
        values = values - c.dmin.float().unsqueeze(-1) * c.mins.float().unsqueeze(-1)
    return values.reshape(c.q.shape[0], -1)


# ------------------------------------------------------------------------------------------ legacy: gguf's bytes
@pytest.mark.parametrize("type_name", Q.EXACT)
def test_legacy_quantizers_are_gguf_bit_for_bit(type_name):
    x = _rows(48, 512, 0)
    assert np.array_equal(Q.quantize(x, type_name).numpy(), _gguf(x, type_name))
    half = _rows(8, 96, 1).to(torch.bfloat16)  # a bf16 tensor is quantized from its exact fp32 values
    assert np.array_equal(Q.quantize(half, type_name).numpy(), _gguf(half, type_name))


@pytest.mark.parametrize("type_name", Q.QUANTIZABLE)
def test_row_chunks_change_no_byte(type_name):
    x = _rows(7, 768, 2)
    kept = x.clone()
    whole = Q.quantize(x, type_name)
    assert torch.equal(x, kept)  # the caller's tensor is never written (an fp32 chunk is the tensor itself)
    assert whole.shape == (7, 768 // Q.block_of(type_name)[0] * Q.block_of(type_name)[1])
    assert torch.equal(Q.quantize(x, type_name, chunk_values=1000), whole)  # one row a chunk
    assert torch.equal(Q.quantize(x.reshape(7, 1, 768), type_name), whole)  # leading dims are rows


# ------------------------------------------------------------------------------------------ K-quants: our codes
@pytest.mark.parametrize("type_name", Q.K_QUANTS)
def test_k_quant_bytes_hold_the_intended_values(type_name):
    x = _rows(24, 512, 3)
    blocks = Q.quantize(x, type_name)
    c = Q.k_codes(x, type_name)
    want = _intended(c).reshape(x.shape)
    assert torch.equal(_gguf_values(blocks, type_name).reshape(x.shape), want)
    ours = torch.empty(x.shape)
    gguf_codec.dequantize_into(ours, blocks, type_name)
    assert torch.equal(ours, want)
    # The integers use their type's whole range: a packing that dropped a bit would show above, a quantizer
    # that left it unused here.
    spec = Q._K[type_name]
    assert (c.q.min().item(), c.q.max().item()) == spec.q_range
    assert c.scales.abs().max().item() == spec.scale_range[1]
    assert spec.scale_range[0] <= c.scales.min().item()
    if c.mins is not None:
        assert c.mins.min().item() >= 0 and c.mins.max().item() == spec.scale_range[1]


@pytest.mark.parametrize("type_name", Q.QUANTIZABLE)
def test_round_trip_error_is_under_its_bound(type_name):
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(4))
    values = _gguf_values(Q.quantize(x, type_name), type_name).reshape(x.shape)
    error = ((values - x).norm() / x.norm()).item()
    assert error < ROUND_TRIP[type_name], error


def test_more_bits_mean_less_error():
    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(5))
    errors = [((_gguf_values(Q.quantize(x, t), t).reshape(x.shape) - x).norm() / x.norm()).item() for t in Q.K_QUANTS]
    assert errors == sorted(errors), dict(zip(Q.K_QUANTS, errors))


@CUDA
@pytest.mark.parametrize("type_name", Q.QUANTIZABLE)
def test_a_gpu_quantizes_as_the_cpu_and_gguf(type_name):
    x = _rows(4096, 1024, 6)
    blocks = Q.quantize(x.cuda(), type_name)
    assert blocks.is_cuda
    if type_name in Q.EXACT:
        assert np.array_equal(blocks.cpu().numpy(), _gguf(x, type_name))
    else:
        want = _intended(Q.k_codes(x.cuda(), type_name)).cpu().reshape(x.shape)
        assert torch.equal(_gguf_values(blocks, type_name).reshape(x.shape), want)


# ------------------------------------------------------------------------------------------ the writer's side
def test_the_writer_writes_our_types():
    assert writable_types() == ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q6_K", "Q5_K", "Q4_K",
                                "Q3_K", "Q2_K")
    assert gguf_type_of("gguf:q4_k") == "Q4_K"
    x = _rows(4, 256, 7)
    data = encode(x.reshape(2, 2, 256), "Q2_K", "w")
    assert data.shape == (2, 2, 84) and np.array_equal(data.reshape(4, 84), Q.quantize(x, "Q2_K").numpy())


@pytest.mark.parametrize("fmt, message", [
    ("gguf:IQ2_XXS", "--format gguf:IQ2_XXS: h3-spark does not quantize IQ2_XXS (llama.cpp's quantizer writes the "
                     "i-quants, from an importance matrix); writable: gguf:F32, gguf:F16, gguf:BF16, gguf:Q8_0, "
                     "gguf:Q5_1, gguf:Q5_0, gguf:Q4_1, gguf:Q4_0, gguf:Q6_K, gguf:Q5_K, gguf:Q4_K, gguf:Q3_K, "
                     "gguf:Q2_K"),
    ("gguf:Q7_K", "--format gguf:Q7_K: Q7_K is not a GGML type; writable: gguf:F32, "),
    ("Q4_K", "'Q4_K' is not a GGUF format (gguf:<TYPE>)"),
])
def test_an_unwritable_format_is_refused(fmt, message):
    with pytest.raises(InputError) as err:
        gguf_type_of(fmt)
    assert str(err.value).startswith(message)


# ------------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("x, type_name, message", [
    (torch.ones(4, 48), "Q8_0", "w: a row of 48 values is not whole Q8_0 blocks of 32"),
    (torch.ones(4, 512 + 32), "Q4_K", "w: a row of 544 values is not whole Q4_K blocks of 256"),
    (torch.tensor(1.0), "Q8_0", "w: a row of no values is not whole Q8_0 blocks of 32"),
    (torch.ones(4, 32), "IQ4_NL", "w: GGML type 'IQ4_NL' is not one h3-spark quantizes (Q8_0, Q5_1, Q5_0, Q4_1, "
                                  "Q4_0, Q6_K, Q5_K, Q4_K, Q3_K, Q2_K)"),
    (torch.ones(4, 32), "q8_0", "w: GGML type 'q8_0' is not one h3-spark quantizes"),
    (torch.ones(4, 32, dtype=torch.int32), "Q8_0", "w: quantizing needs floating-point values, got torch.int32"),
    (torch.tensor([[1.0] * 31 + [float("nan")]]), "Q4_0",
     "w: holds non-finite values (NaN or inf), which no GGML block stores"),
    (torch.tensor([[1.0] * 255 + [float("-inf")]]), "Q2_K",
     "w: holds non-finite values (NaN or inf), which no GGML block stores"),
    (torch.full((1, 256), 6e10), "Q4_K",
     "w: values up to 6e+10 are too large for Q4_K: a block scale overflows fp16 (65504 at most)"),
    (torch.full((1, 256), -6e10), "Q6_K",
     "w: values up to 6e+10 are too large for Q6_K: a block scale overflows fp16 (65504 at most)"),
    (torch.full((1, 32), -1e5), "Q4_1",  # d is 0, the stored min overflows
     "w: values up to 1e+05 are too large for Q4_1: a block scale overflows fp16 (65504 at most)"),
    (torch.full((1, 32), 1e7), "Q8_0",
     "w: values up to 1e+07 are too large for Q8_0: a block scale overflows fp16 (65504 at most)"),
])
def test_a_bad_input_is_refused_in_one_line(x, type_name, message):
    with pytest.raises(InputError) as err:
        Q.quantize(x, type_name, where="w")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_k_codes_are_for_the_k_quants():
    with pytest.raises(InputError) as err:
        Q.k_codes(torch.ones(1, 32), "Q8_0", where="w")
    assert str(err.value) == "w: k_codes is for the K-quants (Q6_K, Q5_K, Q4_K, Q3_K, Q2_K), not 'Q8_0'"
    with pytest.raises(InputError, match=r"^w: holds non-finite values \(NaN or inf\), which no GGML block stores$"):
        Q.k_codes(torch.full((2, 256), float("nan")), "Q3_K", where="w")
