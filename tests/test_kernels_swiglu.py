"""Fused SwiGLU activation against the DiT's own formula (Triton's CPU interpreter here, the GPU in
test_kernels_gpu). Budget: bf16 outputs bit-identical in >= 99.9 % of elements, the rest 1 bf16 ulp
(exp's last bit); fp32 rel L2 <= 1e-6."""

import pytest
import torch

from h3_spark.kernels._triton import triton
from h3_spark.kernels.swiglu import fused_swiglu, reference_swiglu

pytestmark = pytest.mark.skipif(triton is None, reason="needs Triton (its CPU interpreter runs these)")


def _up(rows, half, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * half, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 64), (1, 3, 96)])
def test_fused_swiglu_matches_reference(dtype, shape):
    up = _up(shape[-2] if len(shape) == 2 else 3, shape[-1], dtype, seed=1)
    if len(shape) == 3:
        up = up[None]
    got, want = fused_swiglu(up), reference_swiglu(up)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        assert ((got - want).norm() / want.norm()).item() <= 1e-6
    else:
        same = (got == want).float().mean().item()
        ulp = ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all().item()
        assert same >= 0.999 and ulp


def test_fused_swiglu_in_the_dit_block():
    from h3_spark.kernels.references import SwiGLU

    torch.manual_seed(0)
    ff = SwiGLU(24, 64).eval()
    x = torch.randn(1, 19, 24)
    with torch.no_grad():
        want = ff(x)
        ff.activation = fused_swiglu
        got = ff(x)
    assert ((got - want).norm() / want.norm()).item() <= 1e-6


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="even width"):
        fused_swiglu(torch.randn(4, 7))


@pytest.mark.parametrize("mode,expected", [("exact", "triton"), ("auto", "triton"),
                                           ("off", "pytorch-reference")])
def test_dispatch_follows_the_fused_modulation(mode, expected):
    # The suite runs Triton interpreted (conftest), so auto finds Triton ready, as it would on a GPU.
    import dataclasses

    from h3_spark.h3_model.dit.config import TINY
    from h3_spark.h3_model.dit.model import H3DiT
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings

    model = H3DiT(TINY)
    report = apply_kernels(model, dataclasses.replace(KernelSettings(), attention="sdpa", modulation_fusion=mode))
    assert report["modulation"]["swiglu"] == expected
    assert (model.transformer_blocks[0].ff.activation is fused_swiglu) == (expected == "triton")


def test_swiglu_written_as_fp8_rows():
    from h3_spark.kernels.linear_fp8 import quantize_rows, reference_quantize_rows
    from h3_spark.kernels.swiglu import swiglu_rows_fp8

    up = _up(29, 80, torch.bfloat16, seed=7)
    up[3] = 0  # an all-zero row keeps a finite scale and zero codes
    codes, scales = swiglu_rows_fp8(up)
    want_codes, want_scales = quantize_rows(fused_swiglu(up))
    assert codes.shape == (29, 80) and codes.dtype == torch.float8_e4m3fn and scales.shape == (29, 1)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
    ref_codes, ref_scales = reference_quantize_rows(reference_swiglu(up))
    assert (codes.view(torch.uint8) == ref_codes.view(torch.uint8)).float().mean() >= 0.99
    assert torch.allclose(scales, ref_scales, rtol=2 ** -7) and (codes[3].float() == 0).all()
    with pytest.raises(ValueError, match=r"expected \(rows, 2 \* ffn\) with an even width, got \[29, 159\]"):
        swiglu_rows_fp8(up[:, :159])
