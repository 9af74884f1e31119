"""The video VAE decoder's kernels (kernels/vae.py), run by Triton's CPU interpreter: the fused Q/K norm +
RoPE equals the decoder's own formula, a decode with the fused passes equals the reference decode, and the
attention report says what the VAE runs when the DiT's backend is approximate.

Budgets: the fused Q/K pass is bit-identical to the reference in fp16 except where the fp32 sum of
squares rounds differently (>= 99.9 % identical, max 1 fp16 ulp); a whole fp32 decode with the fused passes
is within 1e-5 rel L2 of the reference decode (summation order only).
"""

from __future__ import annotations

import pytest
import torch

from h3_spark.measure.synthetic import synthetic_video_vae
from h3_spark.h3_model.vae import video_blocks
from h3_spark.h3_model.vae import video_config
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.kernels.settings import KernelSettings
from h3_spark.h3_model.engine.kernel_plan import apply_vae_kernels
from h3_spark.kernels.vae import fused_decoder_qk_prep

pytest.importorskip("triton")


def tables(tokens: int, rope_dim: int):
    return video_blocks.rope_tables((2, 3, tokens // 6), 5, rope_dim, 100.0, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_qk_prep_equals_the_decoder_formula(dtype):
    g = torch.Generator().manual_seed(3)
    cos, sin = tables(36, 24)  # 36 + 5 tokens, 24 of 32 channels rotated, like the released 48 of 64
    x = (torch.randn(2, 41, 3, 32, generator=g) * 3 + 0.5).to(dtype)
    got = fused_decoder_qk_prep(x, 1e-5, cos, sin)
    want = video_blocks.reference_qk_prep(x, 1e-5, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float16:
        assert (got == want).float().mean().item() >= 0.999
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -10 + 1e-6).all()
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_decode_with_fused_passes_matches_the_reference():
    vae = synthetic_video_vae(video_config.TINY, "cpu", torch.float32, seed=4)
    z = torch.randn(1, video_config.TINY.latent_channels, 7, 6, 8, generator=torch.Generator().manual_seed(5))
    report = apply_vae_kernels(vae, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    assert report["qk_prep"] == report["swiglu"] == "pytorch-reference"
    want = vae.decode(z)
    report = apply_vae_kernels(vae, KernelSettings(modulation_fusion="exact"))
    assert report["qk_prep"] == report["swiglu"] == "triton"
    assert all(b.attn.qk_prep is fused_decoder_qk_prep for b in vae.decoder.transformer_blocks)
    got = vae.decode(z)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_attention_choice_and_report():
    vae = synthetic_video_vae(video_config.TINY, "cpu", torch.float32, seed=4)
    report = apply_vae_kernels(vae, KernelSettings(attention="sage2"))  # a DiT choice: not the decoder's
    assert report["attention"]["chosen"] == "sdpa" and "PyTorch SDPA" in report["attention"]["why"]
    # (which backend auto picks for the decoder's fp16/fp32 heads on a GPU: test_kernels_attention.py)
    assert report["exact"] is True
    report = apply_vae_kernels(vae, attention="sdpa")
    assert report["attention"] == {"chosen": "sdpa", "why": "requested"}


def test_approximate_or_unavailable_decoder_attention_fails_closed():
    vae = synthetic_video_vae(video_config.TINY, "cpu", torch.float32, seed=4)
    before = vae.attention
    with pytest.raises(KernelUnavailable, match="exact attention only .* not 'fa3_fp8'"):
        apply_vae_kernels(vae, attention="fa3_fp8")
    with pytest.raises(KernelUnavailable, match="fa3"):
        apply_vae_kernels(vae, attention="fa3")
    assert vae.attention is before
