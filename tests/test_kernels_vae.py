"""The video VAE decoder's kernels (kernels/vae.py), run by Triton's CPU interpreter: the fused Q/K norm +
RoPE equals the decoder's own formula, a decode with the fused passes equals the reference decode, and the
attention report says what the VAE runs when the DiT's backend is approximate; H3_VAE_LINEAR=fp8's block linears
decode as their plain-PyTorch definition and are refused where they cannot run.

Budgets: the fused Q/K pass is bit-identical to the reference in fp16 except where the fp32 sum of
squares rounds differently (>= 99.9 % identical, max 1 fp16 ulp); a whole fp32 decode with the fused passes
is within 1e-5 rel L2 of the reference decode (summation order only); an fp16 decode with FP8 linears within 1e-3
of the same codes in fp32 PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.measure.synthetic import synthetic_video_vae
from h3_spark.h3_model.vae import video_blocks
from h3_spark.h3_model.vae import video_config
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.kernels.settings import KernelSettings
from h3_spark.h3_model.engine.kernel_plan import apply_vae_kernels
from h3_spark.kernels.vae import fused_decoder_qk_prep, fused_residual_norm

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_residual_norm_equals_the_blocks_step(dtype):
    """The residual bit for bit (the product rounds to fp32 before the sum, as eager's); the normed input as eager's
    but for the fp32 sum of squares' order: in fp16 >= 99.9 % identical and at most 1 ulp apart, in fp32 (where no
    final rounding hides it) >= 70 % identical and within 4 ulp; the step without an update (a block's first norm)
    and without a norm (its last residual) too."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(2, 37, 96, generator=g) * 4 + 0.3
    y = (torch.randn(2, 37, 96, generator=g) * 2).to(dtype)
    gate = torch.randn(96, generator=g) * 0.1
    norm = torch.nn.RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    want_h, want_x = video_blocks.residual_norm(h, y, gate, norm, dtype)
    got_h, got_x = fused_residual_norm(h, y, gate, norm, dtype)
    assert torch.equal(got_h, want_h) and got_x.dtype == dtype
    share, ulps = (0.999, 2 ** -10) if dtype == torch.float16 else (0.7, 4 * 2 ** -23)
    assert (got_x == want_x).float().mean().item() >= share
    assert ((got_x.float() - want_x.float()).abs() <= want_x.float().abs() * ulps + 1e-6).all()
    same, x = fused_residual_norm(h, None, None, norm, dtype)
    assert same is h or torch.equal(same, h)
    assert torch.equal(x, fused_residual_norm(h, torch.zeros_like(y), gate, norm, dtype)[1])
    only_h, none = fused_residual_norm(h, y, gate, None, dtype)
    assert none is None and torch.equal(only_h, want_h)
    with pytest.raises(ValueError, match=r"^the decoder's residual is fp32 \(batch, tokens, width\), got "
                                         r"torch.float16 \[2, 37, 96\]$"):
        fused_residual_norm(h.half(), y, gate, norm, dtype)
    with pytest.raises(ValueError, match=r"^a sub-layer output \[2, 36, 96\] does not match the residual "
                                         r"\[2, 37, 96\]$"):
        fused_residual_norm(h, y[:, :36], gate, norm, dtype)


def test_decode_with_fused_passes_matches_the_reference():
    vae = synthetic_video_vae(video_config.TINY, "cpu", torch.float32, seed=4)
    z = torch.randn(1, video_config.TINY.latent_channels, 7, 6, 8, generator=torch.Generator().manual_seed(5))
    report = apply_vae_kernels(vae, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    assert report["qk_prep"] == report["swiglu"] == report["residual_norm"] == "pytorch-reference"
    want = vae.decode(z)
    report = apply_vae_kernels(vae, KernelSettings(modulation_fusion="exact"))
    assert report["qk_prep"] == report["swiglu"] == report["residual_norm"] == "triton"
    assert all(b.attn.qk_prep is fused_decoder_qk_prep for b in vae.decoder.transformer_blocks)
    assert all(b.residual_norm is fused_residual_norm for b in vae.decoder.transformer_blocks)
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


# --------------------------------------------------------------------------------------------- FP8 block linears
class _ReferenceFp8(torch.nn.Module):
    """An Fp8Linear's codes, scales and bias computed by `fp8_linear_reference` (fp32 PyTorch)."""

    def __init__(self, f8):
        super().__init__()
        self.f8, self.out_dtype = f8, f8.out_dtype  # the block computes in the linear's output dtype

    def forward(self, x):
        from h3_spark.kernels.linear_fp8 import fp8_linear_reference

        return fp8_linear_reference(x, self.f8.weight, self.f8.weight_scale.flatten(), x.dtype, self.f8.bias)


def _fp16_vae():
    return synthetic_video_vae(video_config.TINY, "cpu", torch.float16, seed=4)


def _latent():
    return torch.randn(1, video_config.TINY.latent_channels, 7, 6, 8, generator=torch.Generator().manual_seed(5))


def test_fp8_decoder_linears_decode_as_their_plain_pytorch_definition():
    """H3_VAE_LINEAR=fp8's swap: every block's six linears become Fp8Linear (biases kept); the decode equals the same
    codes computed in plain PyTorch within 1e-3 rel L2 (torch._scaled_mm's accumulation against fp32), stays within
    1 % of the dense fp16 decode on these random weights, and is not the dense decode (the swap is real). The fused
    SwiGLU handing the down projection its FP8 rows (Triton's interpreter) decodes the same within 1e-3."""
    from h3_spark.kernels.linear_fp8 import Fp8Linear
    from h3_spark.kernels.vae import DECODER_LINEARS, fp8_converted, fp8_decoder_linears

    vae, z = _fp16_vae(), _latent()
    apply_vae_kernels(vae, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    dense = vae.decode(z)
    layers = len(vae.decoder.transformer_blocks)
    assert not fp8_converted(vae.decoder)
    sources = fp8_decoder_linears(vae.decoder, fused_swiglu=False, use_triton=False)
    assert sources == {"fp16 weight quantized per output channel": 6 * layers} and fp8_converted(vae.decoder)
    block = vae.decoder.transformer_blocks[0]
    assert all(isinstance(block.get_submodule(n), Fp8Linear) and block.get_submodule(n).bias is not None
               for n in DECODER_LINEARS)
    got = vae.decode(z)
    assert got.dtype == dense.dtype and got.shape == dense.shape
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert 1e-4 < rel(got, dense) <= 0.01
    with pytest.raises(InputError, match=r"^this VAE's decoder linears are FP8 \(H3_VAE_LINEAR=fp8\) computing in "
                                         r"float16; load it again to decode in float32$"):
        vae.set_decode_dtype(torch.float32)
    assert vae.set_decode_dtype(torch.float16) is vae
    # Idempotent: a second swap converts nothing again.
    assert fp8_decoder_linears(vae.decoder, fused_swiglu=False, use_triton=False) == sources

    reference = _fp16_vae()
    apply_vae_kernels(reference, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    for ours, theirs in zip(vae.decoder.transformer_blocks, reference.decoder.transformer_blocks):
        for name in DECODER_LINEARS:
            theirs.set_submodule(name, _ReferenceFp8(ours.get_submodule(name)))
    assert rel(got, reference.decode(z)) <= 1e-3

    fused = _fp16_vae()
    apply_vae_kernels(fused, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    fp8_decoder_linears(fused.decoder, fused_swiglu=True, use_triton=True)
    assert rel(fused.decode(z), got) <= 1e-3


def test_fp8_decoder_linears_are_asked_for_and_refused_where_they_cannot_run(monkeypatch):
    from h3_spark.kernels import vae as vae_kernels
    from h3_spark.kernels.capability import SettingsError

    with pytest.raises(SettingsError, match=r"^H3_VAE_LINEAR='int8' is not accepted; use one of: dense, fp8$"):
        KernelSettings.from_env({"H3_VAE_LINEAR": "int8"})
    assert KernelSettings.from_env({"H3_VAE_LINEAR": " FP8 "}).vae_linear == "fp8"
    assert KernelSettings.from_env({}).vae_linear == "dense"
    vae = _fp16_vae()
    with pytest.raises(KernelUnavailable, match=r"^H3_VAE_LINEAR=fp8 needs sm_90 or newer \(rowwise-scaled FP8 GEMMs "
                                                r"\(torch._scaled_mm\) need Hopper or newer\); this run is on "):
        apply_vae_kernels(vae, KernelSettings(vae_linear="fp8"))
    monkeypatch.setattr(vae_kernels, "require_cuda", lambda *a, **k: (9, 0))  # a pretend Hopper from here on
    exact = synthetic_video_vae(video_config.TINY, "cpu", torch.float32, seed=4)
    with pytest.raises(KernelUnavailable, match=r"^H3_VAE_LINEAR=fp8 is for the fp16 decode; this VAE decodes in "
                                                r"float32 \(the exact path"):
        apply_vae_kernels(exact, KernelSettings(vae_linear="fp8"))
    report = apply_vae_kernels(vae, KernelSettings(vae_linear="fp8", modulation_fusion="off",
                                                   q_rms_rope_int8_fusion="off"))
    layers = len(vae.decoder.transformer_blocks)
    assert report["linear"]["format"] == "fp8" and report["exact"] is False
    assert report["linear"]["sources"] == {"fp16 weight quantized per output channel": 6 * layers}
    assert report["linear"]["why"].startswith("requested (approximate): the decoder blocks' linears as FP8 e4m3")
    # The weights were rounded: going back to dense needs the VAE loaded again.
    with pytest.raises(KernelUnavailable, match=r"^the video VAE decoder's linears were already converted to FP8 "
                                                r"\(H3_VAE_LINEAR=fp8\); reload the VAE to decode with dense ones$"):
        apply_vae_kernels(vae, KernelSettings())
    dense = apply_vae_kernels(_fp16_vae(), KernelSettings())
    assert dense["linear"]["format"] == "dense" and dense["exact"] is True
