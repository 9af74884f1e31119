"""FP8 and NVFP4 linears on the CPU: quantizers (Triton interpreter) against references and comfy-kitchen's
eager NVFP4 quantizer byte for byte, GEMM references against plain computations, constructors from
checkpoint formats. The Blackwell FP4 GEMM itself cannot run here (tests/test_kernels_dispatch.py checks
that asking for it fails with the reason).

Error budgets: quantizers byte-identical; Fp8Linear (CPU torch._scaled_mm) vs its fp32 reference rel L2 <= 1e-2
(bf16 output rounding); FP8 vs the exact bf16 linear rel L2 <= 0.06 on random data; NVFP4 round trip <= 0.12.
"""

import pytest
import torch

from h3_spark.kernels import nvfp4_codec as ckpt_nvfp4
from h3_spark.kernels.references import RowModulation
from h3_spark.kernels.linear_fp8 import (Fp8Linear, fp8_linear_reference, quantize_rows, quantize_weight,
                                         reference_quantize_rows)
from oracle import rel_l2

pytest.importorskip("triton")
from h3_spark.kernels import nvfp4 as nv  # noqa: E402


def rand(*shape, scale=1.0, dtype=torch.bfloat16, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_fp8_row_quantizer_matches_reference_and_plain():
    x = rand(9, 1040, scale=3)
    x[4] = 0
    a, sa = quantize_rows(x)
    b, sb = reference_quantize_rows(x)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
    amax = x.float().abs().amax(-1, keepdim=True)
    assert torch.allclose(sb[amax[:, 0] > 0], (amax / 448)[amax[:, 0] > 0])
    assert rel_l2(b.float() * sb, x) <= 0.04


def test_fp8_weight_scales():
    w = rand(32, 64, scale=0.02, dtype=torch.float32)
    q, s = quantize_weight(w)
    assert torch.allclose(s, w.abs().amax(1) / 448)
    q2, s2 = quantize_weight(w, pow2=True)
    assert torch.equal(torch.log2(s2), torch.log2(s2).round()) and (s2 >= s).all() and (s2 < 2 * s).all()
    assert rel_l2(q.float() * s[:, None], w) <= 0.04


def bf16_linear(k: int, n: int, seed: int = 1) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(rand(n, k, scale=0.05, seed=seed))
    return lin


def test_fp8_linear_forward_vs_reference_and_bf16():
    lin = bf16_linear(64, 48)
    f8 = Fp8Linear.from_linear(lin)
    x = rand(2, 11, 64, scale=2, seed=2)
    out = f8(x)  # CPU torch._scaled_mm
    ref = fp8_linear_reference(x, f8.weight, f8.weight_scale.flatten())
    plain = (reference_quantize_rows(x.reshape(-1, 64))[0].float() * reference_quantize_rows(x.reshape(-1, 64))[1]
             ) @ f8.dequantized_weight().t()
    assert out.shape == (2, 11, 48) and out.dtype == torch.bfloat16
    assert rel_l2(ref.reshape(-1, 48), plain) <= 1e-2
    assert rel_l2(out, ref) <= 1e-2
    assert rel_l2(out, lin(x)) <= 0.06


def test_fp8_linear_with_a_bias_adds_it_in_the_output_dtype():
    """The video VAE decoder's linears carry biases (fp16): kept in the output dtype, added by the GEMM."""
    lin = torch.nn.Linear(64, 48).to(torch.float16)
    with torch.no_grad():
        lin.weight.copy_(rand(48, 64, scale=0.05, seed=4))
        lin.bias.copy_(rand(48, scale=0.5, seed=5))
    f8 = Fp8Linear.from_linear(lin)
    assert f8.bias.dtype == torch.float16 and f8.source == "fp16 weight quantized per output channel"
    x = rand(3, 7, 64, scale=2, seed=6).to(torch.float16)
    out = f8(x)
    ref = fp8_linear_reference(x.float(), f8.weight, f8.weight_scale.flatten(), torch.float32, lin.bias)
    assert out.dtype == torch.float16 and rel_l2(out.float(), ref) <= 1e-2
    without = fp8_linear_reference(x.float(), f8.weight, f8.weight_scale.flatten(), torch.float32)
    assert rel_l2(out.float(), without) > 0.1  # the bias is really there
    assert rel_l2(out.float(), lin.float()(x.float())) <= 0.06
    with pytest.raises(ValueError, match=r"^Fp8Linear's bias must have 48 entries, got \[47\]$"):
        Fp8Linear(f8.weight, f8.weight_scale.flatten(), torch.float16, "test", bias=torch.zeros(47))


def test_fp8_from_checkpoints():
    w = rand(32, 64, scale=0.02, dtype=torch.float32)
    scale = w.abs().amax() / 448
    codes = (w / scale).to(torch.float8_e4m3fn)
    f = Fp8Linear.from_fp8_scaled(codes, scale, torch.bfloat16)
    assert torch.equal(f.weight.view(torch.uint8), codes.view(torch.uint8))  # codes kept: exact
    assert torch.allclose(f.dequantized_weight(), codes.float() * scale)
    packed, blocks, g = ckpt_nvfp4.quantize(w)
    f4 = Fp8Linear.from_nvfp4(packed, blocks, g, (32, 64), torch.bfloat16)
    exact = ckpt_nvfp4.dequantize(packed, blocks, g, (32, 64), torch.float32)
    assert "pow2" in f4.source and rel_l2(f4.dequantized_weight(), exact) <= 0.04


def test_nvfp4_quantizer_matches_reference_and_comfy_kitchen():
    ck = pytest.importorskip("comfy_kitchen")
    x = rand(40, 512, scale=2)
    x[5, :16] = 0
    a = nv.quantize_nvfp4(x)
    assert torch.equal(a.global_scale, nv.global_scale_for(x.float().abs().amax()))
    q, s = ck.quantize_nvfp4(x, a.global_scale)  # the eager backend on the CPU
    rq, rs = nv.reference_quantize_nvfp4(x, a.global_scale)
    for packed, scales in ((q, s), (rq, rs)):
        assert torch.equal(a.packed, packed) and torch.equal(a.block_scales.view(torch.uint8), scales.view(torch.uint8))
    assert rel_l2(a.dequantize(), x) <= 0.12
    assert torch.allclose(ck.dequantize_nvfp4(q, a.global_scale, s, torch.float32), a.dequantize(), rtol=1e-6, atol=0)


def test_nvfp4_swiglu_and_rms_adaln_producers():
    ck = pytest.importorskip("comfy_kitchen")
    fc1 = rand(2, 20, 2 * 256, scale=2)
    act = nv.swiglu_quantize_nvfp4(fc1)
    h = nv.reference_swiglu(fc1)
    q, s = ck.quantize_nvfp4(h.reshape(-1, 256), act.global_scale)
    assert act.shape == (2, 20, 256) and torch.equal(act.packed, q)
    assert torch.equal(act.global_scale, nv.global_scale_for(h.float().abs().amax()))

    d = 256
    rows = torch.cat([torch.full((8,), 1), torch.full((12,), 4)])
    shift, scale, *_ = rand(6, 6 * d, scale=0.5, seed=3).chunk(6, dim=-1)
    x = rand(2, 20, d, scale=3, seed=4)
    norm = torch.nn.RMSNorm(d, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(rand(d, scale=0.2, seed=5) + 1)
        act = nv.rms_adaln_quantize_nvfp4(x, norm, shift, scale, rows.int())
        hm = RowModulation(rows, True).norm_modulate(norm, x, shift, scale)
    q, s = ck.quantize_nvfp4(hm.reshape(-1, d), act.global_scale)
    assert (act.packed == q).float().mean() >= 0.999  # the norm's 1-ulp cases may move a code
    assert rel_l2(act.dequantize(), hm) <= 0.12


def test_nvfp4_linear_reference_and_layout_checks():
    w = rand(48, 256, scale=0.05, dtype=torch.float32, seed=6)
    lin = torch.nn.Linear(256, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    f4 = nv.Nvfp4Linear.from_linear(lin)
    assert f4.weight.shape == (48, 128) and f4.weight_scale.shape == (128, 16)
    x = rand(3, 256, scale=2, dtype=torch.float32, seed=7)
    a = nv.quantize_nvfp4(x)
    out = nv.nvfp4_linear_reference(a, f4.weight, f4.weight_scale, f4.weight_scale_2, 48, torch.float32)
    assert rel_l2(out, x @ w.t()) <= 0.2
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        nv.Nvfp4Linear.from_linear(torch.nn.Linear(48, 40, bias=False))


def test_fp8_rows_feed_the_linear_and_slice_by_tokens():
    from h3_spark.kernels.linear_fp8 import Fp8Rows, quantize_activation

    f8 = Fp8Linear.from_linear(bf16_linear(64, 48))
    x = rand(2, 11, 64, scale=2, seed=3)
    a = quantize_activation(x)
    assert isinstance(a, Fp8Rows) and a.shape == x.shape and a.data.shape == (22, 64)
    assert torch.equal(f8(a), f8(x))  # a pre-quantized input skips the quantizer, same values
    assert rel_l2(a.dequantize(), x) <= 0.04
    part = a.seq_slice(3, 7)
    assert part.shape == (2, 4, 64) and torch.equal(f8(part), f8(x[:, 3:7]))
    with pytest.raises(ValueError, match=r"Fp8Linear takes 64 features, got \[2, 11, 32\]"):
        f8(quantize_activation(x[..., :32]))


def test_fp8_swiglu_chunks_and_unfused_path_agree():
    from h3_spark.kernels.references import SwiGLU
    from h3_spark.kernels.linear_fp8 import Fp8SwiGLU, quantize_activation

    ff = SwiGLU(64, 80).to(torch.bfloat16)
    with torch.no_grad():
        for p in ff.parameters():
            p.copy_(rand(*p.shape, scale=0.1, seed=p.numel()))
    ff.net[0].proj = Fp8Linear.from_linear(ff.net[0].proj)
    ff.net[2] = Fp8Linear.from_linear(ff.net[2])
    fused = Fp8SwiGLU.wrap(ff)
    x = rand(2, 9, 64, seed=4)
    with torch.no_grad():
        unfused = ff(x)  # each Fp8Linear quantizes its own input
        whole = fused(quantize_activation(x))
        chunked = fused(quantize_activation(x), chunks=3)
        plain = fused(x)
    assert torch.equal(whole, unfused) and torch.equal(chunked, whole) and torch.equal(plain, whole)
