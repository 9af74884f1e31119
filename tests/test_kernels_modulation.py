"""Fused RMSNorm + per-segment AdaLN and gated residual (Triton interpreter) against RowModulation, and
RowModulation against a plain fp64 formula.

Error budget: modulate and gated_add bit-identical in bf16 and fp32; norm_modulate bit-identical except where
the fp32 sum of squares rounds differently (>= 99.9 % of elements identical, the rest within 1 bf16 ulp).
"""

import pytest
import torch

from h3_spark.kernels.references import RowModulation
from oracle import rel_l2

pytest.importorskip("triton")
from h3_spark.kernels.modulation import FusedRowModulation  # noqa: E402


def setup(dtype, d=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.cat([torch.full((7,), 1), torch.full((5,), 0), torch.full((13,), 5), torch.full((3,), 1)])
    table = (torch.randn(6, 6 * d, generator=g) * 0.5).to(dtype)
    shift, scale, gate, *_ = table.chunk(6, dim=-1)
    x = (torch.randn(2, rows.numel(), d, generator=g) * 3).to(dtype)
    y = torch.randn(2, rows.numel(), d, generator=g).to(dtype)
    norm = torch.nn.RMSNorm(d, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g) * 0.2 + 1)
    return rows, shift, scale, gate, x, y, norm


def test_reference_against_plain_formula():
    rows, shift, scale, gate, x, y, norm = setup(torch.float64)
    ref = RowModulation(rows, use_segments=True)
    with torch.no_grad():
        got = ref.norm_modulate(norm, x, shift, scale)
        n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
        assert rel_l2(got, n * (1 + scale[rows]) + shift[rows]) <= 1e-12
        assert rel_l2(ref.gated_add(x, gate, y), x + gate[rows] * y) <= 1e-15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("use_segments", [True, False])
@pytest.mark.parametrize("block", [8192, 64])  # the row in one read (160 wide), or in 3 steps
def test_fused_matches_reference(dtype, use_segments, block, monkeypatch):
    from h3_spark.kernels import modulation

    monkeypatch.setattr(modulation, "BLOCK", block)
    rows, shift, scale, gate, x, y, norm = setup(dtype)
    ref, fused = RowModulation(rows, use_segments), FusedRowModulation(rows, use_segments)
    with torch.no_grad():
        assert torch.equal(fused.modulate(x, shift, scale), ref.modulate(x, shift, scale))
        assert torch.equal(fused.gated_add(x, gate, y), ref.gated_add(x, gate, y))
        a, b = fused.norm_modulate(norm, x, shift, scale), ref.norm_modulate(norm, x, shift, scale)
    if dtype == torch.bfloat16:  # in fp32 many elements differ in the last bits (summation order)
        assert (a == b).float().mean().item() >= 0.999
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    assert ((a.float() - b.float()).abs() <= b.float().abs() * ulp + 1e-6).all()


def test_errors():
    rows, shift, scale, gate, x, y, norm = setup(torch.float32)
    fused = FusedRowModulation(rows, True)
    with pytest.raises(ValueError, match="row indices for a sequence of"):
        fused.modulate(x[:, :-1], shift, scale)
    with pytest.raises(ValueError, match="does not match the residual"):
        fused.gated_add(x, gate, y[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_add_and_norm_modulate_in_one_pass(dtype):
    # Block.forward's middle pair: residual + gate * y, then RMSNorm + modulate of that sum.
    rows, shift, scale, gate, x, y, norm = setup(dtype, seed=4)
    ref, fused = RowModulation(rows, True), FusedRowModulation(rows, True)
    with torch.no_grad():
        want_res, want = ref.add_norm_modulate(x, gate, y, norm, shift, scale)
        got_res, got = fused.add_norm_modulate(x, gate, y, norm, shift, scale)
    assert torch.equal(got_res, want_res)  # the residual is the gated add, bit for bit
    if dtype == torch.bfloat16:  # fp32 differs in the last bits (summation order), as norm_modulate does
        assert (got == want).float().mean().item() >= 0.999
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    assert ((got.float() - want.float()).abs() <= want.float().abs() * ulp + 1e-6).all()


def test_fp8_modulation_hands_one_quantized_activation_to_the_linears():
    from h3_spark.kernels.linear_fp8 import Fp8RowModulation, Fp8Rows, reference_quantize_rows

    rows, shift, scale, gate, x, y, norm = setup(torch.bfloat16, seed=5)
    fused, fp8 = FusedRowModulation(rows, True), Fp8RowModulation(rows, True)
    with torch.no_grad():
        res, a = fp8.add_norm_modulate(x, gate, y, norm, shift, scale)
        want_res, h = fused.add_norm_modulate(x, gate, y, norm, shift, scale)
        b = fp8.norm_modulate(norm, x, shift, scale)
    codes, scales = reference_quantize_rows(h.reshape(-1, h.shape[-1]))
    assert isinstance(a, Fp8Rows) and a.shape == x.shape and torch.equal(res, want_res)
    # the rows the exact fused pass writes, quantized as Fp8Linear quantizes them
    assert torch.equal(a.data.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(a.scale, scales)
    assert isinstance(b, Fp8Rows) and rel_l2(b.dequantize(), fused.norm_modulate(norm, x, shift, scale)) <= 0.04


def test_one_pass_errors_and_wide_rows():
    rows, shift, scale, gate, x, y, norm = setup(torch.bfloat16)
    fused = FusedRowModulation(rows, True)
    with pytest.raises(ValueError, match=r"gated_add: update \[2, 28, 159\] does not match the residual"):
        fused.add_norm_modulate(x, gate, y[..., :159], norm, shift, scale)
    with pytest.raises(ValueError, match="expected \\(batch, seq, hidden\\)"):
        fused.add_norm_modulate(x[0], gate, y[0], norm, shift, scale)
    with pytest.raises(ValueError, match="3 row indices for a sequence of 28"):
        FusedRowModulation(rows[:3], True).add_norm_modulate(x, gate, y, norm, shift, scale)
    # Rows wider than one program holds take the two passes, with the same results.
    import h3_spark.kernels.modulation as mod

    d = mod.BLOCK + 16
    w_rows, w_shift, w_scale, w_gate, w_x, w_y, w_norm = setup(torch.bfloat16, d=d, seed=6)
    w_rows, w_x, w_y = w_rows[:4], w_x[:1, :4], w_y[:1, :4]
    with torch.no_grad():
        got_res, got = FusedRowModulation(w_rows, True).add_norm_modulate(w_x, w_gate, w_y, w_norm, w_shift, w_scale)
        want_res, want = RowModulation(w_rows, True).add_norm_modulate(w_x, w_gate, w_y, w_norm, w_shift, w_scale)
    assert torch.equal(got_res, want_res) and (got == want).float().mean() >= 0.999
