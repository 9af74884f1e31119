"""Fused Q/K preparation (Triton, run by its CPU interpreter here) against its reference, and the reference
against H3's own math and plain computations.

Error budgets: unquantized bf16 output equals reference_qk_prep except where the fp32 sum of squares rounds
differently (>= 99.9 % identical, max 1 bf16 ulp); quantized codes equal the reference's for >= 99.9 % of
elements (the rest: one step, from the mean / Hadamard summation order), scales within 1e-5 relative.
"""

import pytest
import torch

from h3_spark.h3_model.dit.model import Attention, reference_qk_prep, rope_tables
from h3_spark.kernels.attention import math_reference
from h3_spark.kernels.qk_prep import (BOUND_MARGIN, FusedQKPrep, QuantizedHeads, hadamard_matrix,
                                     prepare_heads, reference_norm_rope, reference_prepare_heads)
from oracle import rel_l2

pytest.importorskip("triton")


def make(b=1, s=70, h=2, d=32, dtype=torch.bfloat16, seed=0, rope_freq=4):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, h, d, generator=g) * 2 + 0.3).to(dtype)
    w = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype)
    pos = torch.randint(0, 40, (s, 3), generator=g).float()
    return x, w, rope_tables(pos, rope_freq, 10000.0)


def attn_module(w, d, dtype):
    a = Attention(8, 1, d, 1e-5).to(dtype)
    with torch.no_grad():
        a.norm_q.weight.copy_(w)
        a.norm_k.weight.copy_(w.flip(0))
    return a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_equals_dit_reference(dtype):
    x, w, rope = make(dtype=dtype)
    a = attn_module(w, x.shape[-1], dtype)
    with torch.no_grad():
        q_ref, k_ref = reference_qk_prep(a, x, x * 0.5, rope)
        q, k = FusedQKPrep(use_triton=False)(a, x, x * 0.5, rope)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_reference_against_plain_formula():
    x, w, (cos, sin) = make(dtype=torch.float64)
    y = reference_norm_rope(x, w, 1e-5, (cos.double(), sin.double()))
    r = cos.shape[-1]
    n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    expected = n.clone()
    for i in range(r // 2):  # channel i pairs with i + r/2 (split half)
        a, b = n[..., i], n[..., i + r // 2]
        expected[..., i] = a * cos[:, i, None] - b * sin[:, i, None]
        expected[..., i + r // 2] = b * cos[:, i + r // 2, None] + a * sin[:, i + r // 2, None]
    assert rel_l2(y, expected) <= 1e-6  # the reference computes the norm in fp32, as nn.RMSNorm does for bf16


def test_hadamard_is_orthonormal_and_keeps_scores():
    h = hadamard_matrix(32, 16, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(32, dtype=torch.float64))
    q, k = torch.randn(5, 32, dtype=torch.float64), torch.randn(7, 32, dtype=torch.float64)
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T)
    with pytest.raises(ValueError, match="must be a power of two dividing the head size 32"):
        hadamard_matrix(32, 24)


def test_smoothing_and_rotation_leave_attention_unchanged():
    x, w, rope = make(dtype=torch.float64)
    q = reference_prepare_heads(x, w, 1e-5, rope)
    k = reference_prepare_heads(x.flip(1), w, 1e-5, rope)
    v = torch.randn_like(q)
    k2 = reference_prepare_heads(x.flip(1), w, 1e-5, rope, smooth=True, hadamard=16)
    q2 = reference_prepare_heads(x, w, 1e-5, rope, hadamard=16)
    assert rel_l2(math_reference(q2, k2, v), math_reference(q, k, v)) <= 1e-6  # fp32 smoothing / rotation


def test_reference_quantization_against_plain_computation():
    x, w, rope = make(dtype=torch.float32)
    y = reference_prepare_heads(x, w, 1e-5, rope)
    q8 = reference_prepare_heads(x, w, 1e-5, rope, fmt="int8", granularity="per_head")
    amax = y.abs().amax(dim=(1, 3))
    assert torch.allclose(q8.scale, amax / 127)
    assert torch.equal(q8.data, torch.round(y / (amax / 127)[:, None, :, None]).to(torch.int8))
    f8 = reference_prepare_heads(x, w, 1e-5, rope, fmt="fp8", granularity="per_block")
    assert f8.scale.shape == (1, 2, 2) and f8.block == 64
    assert torch.allclose(f8.scale[0, :, 1], y[0, 64:].abs().amax(dim=(0, 2)) / 448)
    assert rel_l2(f8.dequantize(), y) <= 0.04 and rel_l2(q8.dequantize(), y) <= 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_unquantized_matches_reference(dtype):
    x, w, rope = make(dtype=dtype)
    a, b = prepare_heads(x, w, 1e-5, rope), reference_prepare_heads(x, w, 1e-5, rope)
    if dtype == torch.bfloat16:  # in fp32 every element may differ in the last bits (summation order)
        assert (a == b).float().mean().item() >= 0.999
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    assert ((a.float() - b.float()).abs() <= b.float().abs() * ulp + 1e-6).all()


@pytest.mark.parametrize("heads, d, rope_freq, norm, dtype", [
    (5, 32, 4, True, torch.float16),     # 24 of 32 channels rotated
    (3, 64, 8, False, torch.bfloat16),   # RoPE only
    (4, 24, 0, True, torch.bfloat16)])   # no RoPE
def test_exact_kernel_on_strided_heads_and_other_shapes(heads, d, rope_freq, norm, dtype):
    x, w, rope = make(b=2, s=37, h=heads, d=d, dtype=dtype, rope_freq=max(rope_freq, 1))
    rope = rope if rope_freq else None
    wide = torch.cat([x, x.flip(-1)], dim=-1)[..., :d]  # a strided view, as q is of a wider projection
    want = reference_norm_rope(x, w, 1e-5, rope, norm)
    for got in (prepare_heads(x, w, 1e-5, rope, norm=norm), prepare_heads(wide, w, 1e-5, rope, norm=norm)):
        assert (got == want).float().mean().item() >= 0.999
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


def test_tables_in_the_activation_dtype_give_the_same_heads_and_are_made_once():
    x, w, rope = make(s=50)
    half = tuple(t.to(x.dtype) for t in rope)
    assert torch.equal(prepare_heads(x, w, 1e-5, half), prepare_heads(x, w, 1e-5, rope))
    a = attn_module(w, x.shape[-1], torch.bfloat16)
    hook = FusedQKPrep()
    with torch.no_grad():
        q1, k1 = hook(a, x, x.flip(1), rope)
        first = hook._rope_cache[3]
        q2, _ = hook(a, x, x.flip(1), rope)
    assert hook._rope_cache[3] is first and first[0].dtype == torch.bfloat16  # converted once, reused
    want_q, want_k = reference_qk_prep(a, x, x.flip(1), rope)
    assert torch.equal(q1, q2) and (q1 == want_q).float().mean() >= 0.999 and (k1 == want_k).float().mean() >= 0.999


@pytest.mark.parametrize("norm", [True, False])
def test_key_mean_sums_over_several_programs(norm):
    # 2 x 16 x 16 + 37 tokens: the mean kernel's programs each sum 256 tokens of one head, so three of them
    # (one partly filled) add up per head, for two batch rows of three heads.
    x, w, rope = make(b=2, s=549, h=3, d=32)
    got = prepare_heads(x, w, 1e-5, rope, norm=norm, smooth=True)
    want = reference_prepare_heads(x, w, 1e-5, rope, norm=norm, smooth=True)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-3).all()
    # the smoothed keys average to zero per (batch, head): the mean was taken over all of them
    assert got.float().mean(dim=1).abs().max().item() <= 2e-2


def test_kernel_rejects_tables_that_do_not_fit():
    x, w, rope = make(s=20)
    with pytest.raises(ValueError, match=r"RoPE tables \[19, 24\] do not fit 20 tokens"):
        prepare_heads(x, w, 1e-5, (rope[0][:19], rope[1][:19]))
    with pytest.raises(ValueError, match="expected \\(batch, seq, heads, head_dim\\)"):
        prepare_heads(x[0], w, 1e-5, rope)


@pytest.mark.parametrize("fmt, granularity, smooth, hadamard", [
    ("fp8", "per_head", False, 0), ("fp8", "per_head", True, 32), ("fp8", "per_block", True, 16),
    ("int8", "per_head", True, 32), ("int8", "per_block", False, 0), (None, "per_head", True, 32),
    ("fp8", "per_head_bound", True, 32), ("fp8", "per_head_bound", False, 0)])
def test_triton_quantized_matches_reference(fmt, granularity, smooth, hadamard):
    x, w, rope = make(s=90)
    kw = dict(smooth=smooth, hadamard=hadamard, fmt=fmt, granularity=granularity)
    a, b = prepare_heads(x, w, 1e-5, rope, **kw), reference_prepare_heads(x, w, 1e-5, rope, **kw)
    if fmt is None:
        assert rel_l2(a, b) <= 1e-2
        return
    assert isinstance(a, QuantizedHeads) and a.scale.shape == b.scale.shape and a.block == b.block
    as_int = (lambda t: t.view(torch.uint8).int()) if fmt == "fp8" else (lambda t: t.int())
    assert (as_int(a.data) == as_int(b.data)).float().mean().item() >= 0.999
    assert torch.allclose(a.scale, b.scale, rtol=1e-5)
    assert rel_l2(a.dequantize(), b.dequantize()) <= 1e-3


@pytest.mark.parametrize("impl", [prepare_heads, reference_prepare_heads])
def test_bound_scales_are_reached_by_a_row_on_a_hadamard_axis(impl):
    # Every row is a +-1 Hadamard column: after the norm its L2 norm is exactly |w| sqrt(D), and the rotation
    # puts all of it in one channel, the worst case the bound is for. The code comes within the rounding
    # margin of 448 and is never clamped.
    d, c = 32, 1.75
    h = hadamard_matrix(d, d) * d ** 0.5
    x = h[torch.arange(48) % d].view(1, 48, 1, d).repeat(1, 1, 2, 1) * torch.tensor([1.0, -3.0]).view(1, 1, 2, 1)
    w = torch.full((d,), c)
    got = impl(x, w, 1e-12, None, hadamard=d, fmt="fp8", granularity="per_head_bound")
    assert torch.allclose(got.scale, torch.full((1, 2), c * d ** 0.5 * BOUND_MARGIN / 448))
    codes = got.data.float().abs()
    assert codes.amax().item() == pytest.approx(448 / BOUND_MARGIN, rel=2 ** -4)
    want = reference_prepare_heads(x, w, 1e-12, None, hadamard=d)
    assert rel_l2(got.dequantize(), want) <= 0.04


def test_bound_scales_keep_fp8_accuracy_and_add_the_mean_key():
    # A scale several times the measured maximum costs FP8 almost nothing: the error stays that of per-head
    # absmax scales (a floating-point format's relative step does not depend on the scale).
    x, w, rope = make(s=300, d=64)
    exact = reference_prepare_heads(x.float(), w, 1e-5, rope, smooth=True, hadamard=64)
    kw = dict(smooth=True, hadamard=64, fmt="fp8")
    bound = reference_prepare_heads(x, w, 1e-5, rope, granularity="per_head_bound", **kw)
    absmax = reference_prepare_heads(x, w, 1e-5, rope, granularity="per_head", **kw)
    assert (bound.scale > 1.5 * absmax.scale).all()
    assert rel_l2(bound.dequantize(), exact) <= 1.1 * rel_l2(absmax.dequantize(), exact)
    mean = reference_norm_rope(x, w, 1e-5, rope).float().mean(dim=1)  # (1, H, D)
    want = (w.float().abs().max() * BOUND_MARGIN * 64 ** 0.5 + mean.norm(dim=-1)) / 448
    assert torch.allclose(bound.scale, want, rtol=1e-6)


@pytest.mark.parametrize("kw, msg", [
    (dict(fmt="int8"), "per_head_bound scales are for fp8 \\(a floating-point format\\) only; int8 codes"),
    (dict(fmt="fp8", norm=False), "per_head_bound scales need the RMSNorm")])
@pytest.mark.parametrize("impl", [prepare_heads, reference_prepare_heads])
def test_bound_scales_refuse_what_they_cannot_bound(impl, kw, msg):
    x, w, rope = make()
    with pytest.raises(ValueError, match=msg):
        impl(x, w, 1e-5, rope, granularity="per_head_bound", **kw)


@pytest.mark.parametrize("hadamard", [16, 32, 64, 128])
def test_kronecker_rotation_of_128_wide_heads_matches_the_matrix(hadamard):
    # 128-wide heads rotate as H16 then H8 across groups (block-diagonal for smaller blocks); fp32 in and out
    # so any misplaced channel shows far above summation-order noise.
    x, w, rope = make(s=40, d=128, dtype=torch.float32, rope_freq=16)
    kw = dict(smooth=True, hadamard=hadamard)
    got, want = prepare_heads(x, w, 1e-5, rope, **kw), reference_prepare_heads(x, w, 1e-5, rope, **kw)
    assert rel_l2(got, want) <= 1e-6
    q = prepare_heads(x.bfloat16(), w, 1e-5, rope, fmt="fp8", granularity="per_head_bound", **kw)
    r = reference_prepare_heads(x.bfloat16(), w, 1e-5, rope, fmt="fp8", granularity="per_head_bound", **kw)
    assert (q.data.view(torch.uint8) == r.data.view(torch.uint8)).float().mean().item() >= 0.999


def test_hook_shapes_and_report():
    x, w, rope = make()
    a = attn_module(w, x.shape[-1], torch.bfloat16)
    hook = FusedQKPrep("fp8", smooth_k=True, hadamard=32)
    with torch.no_grad():
        q, k = hook(a, x, x, rope)
    assert isinstance(q, QuantizedHeads) and q.shape == x.shape and q.scale.shape == (1, 2)
    assert hook.describe() == {"impl": "triton", "format": "fp8", "k_smoothing": True, "hadamard_block": 32,
                               "scales": "per_head", "exact": False}
    assert q.slice_heads(1, 2).data.shape == (1, 70, 1, 32)
    assert FusedQKPrep().exact
