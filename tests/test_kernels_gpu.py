"""The fast paths on a real GPU (skipped without CUDA): compiled Triton kernels against their references,
and every attention backend that resolves here against SDPA. Budgets as in the CPU tests; attention:
exact backends rel L2 <= 1e-2 vs SDPA in bf16, approximate ones <= 0.1 on random data."""

import pytest
import torch

from h3_spark.h3_model.dit import RowModulation, rope_tables
from h3_spark.kernels.attention import resolve_attention, sdpa
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.kernels.settings import ATTENTION_BACKENDS, KernelSettings, SolSettings
from oracle import rel_l2

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rand(*shape, scale=1.0, seed=0):
    return torch.randn(*shape, generator=torch.Generator(DEV).manual_seed(seed), device=DEV) * scale


@pytest.mark.parametrize("name", [n for n in ATTENTION_BACKENDS if n != "auto"] + ["auto"])
def test_attention_backends(name):
    settings = KernelSettings(head_slice_backend="cudnn_sdpa", sol=SolSettings(min_tokens=0, fallback="cudnn_sdpa"))
    try:
        fn, chosen = resolve_attention(name, DEV, settings)
    except KernelUnavailable as exc:
        pytest.skip(f"unavailable here: {exc}")
    q, k, v = (rand(1, 4096, 4, 128, seed=i).bfloat16() for i in range(3))
    if name == "sol_attn":
        # Block-sparse attention only promises accuracy where attention is concentrated; on unstructured
        # random Q/K it dropped 77 % of the output (receipts/h200/kernels-h200.json). Peaky attention: every
        # query's own key dominates, which the always-kept diagonal blocks cover.
        k = (q.float() * 4).bfloat16()
    err = rel_l2(fn(q, k, v), sdpa(q, k, v))
    assert err <= (1e-2 if fn.exact else 0.1), (chosen, err)


def test_qk_prep_kernel():
    from h3_spark.kernels.qk_prep import prepare_heads, reference_prepare_heads

    x = rand(1, 1000, 8, 128, scale=2).bfloat16()
    w = (rand(128, scale=0.3) + 1).bfloat16()
    rope = rope_tables(torch.randint(0, 60, (1000, 3), device=DEV).float(), 16, 10000.0)
    a, b = prepare_heads(x, w, 1e-5, rope), reference_prepare_heads(x, w, 1e-5, rope)
    assert (a == b).float().mean() >= 0.999
    for fmt in ("fp8", "int8"):
        qa = prepare_heads(x, w, 1e-5, rope, smooth=True, hadamard=128, fmt=fmt)
        qb = reference_prepare_heads(x, w, 1e-5, rope, smooth=True, hadamard=128, fmt=fmt)
        assert rel_l2(qa.dequantize(), qb.dequantize()) <= 2e-2  # tf32 Hadamard on the GPU


def test_modulation_kernel():
    from h3_spark.kernels.modulation import FusedRowModulation

    d = 5376
    rows = torch.cat([torch.full((300,), 1), torch.full((700,), 0)]).to(DEV)
    shift, scale, gate, *_ = rand(6, 6 * d, scale=0.5).bfloat16().chunk(6, dim=-1)
    x, y = rand(1, 1000, d, scale=3).bfloat16(), rand(1, 1000, d, seed=1).bfloat16()
    norm = torch.nn.RMSNorm(d, eps=1e-5).to(DEV, torch.bfloat16)
    ref, fused = RowModulation(rows, True), FusedRowModulation(rows, True)
    with torch.no_grad():
        assert torch.equal(fused.gated_add(x, gate, y), ref.gated_add(x, gate, y))
        assert (fused.norm_modulate(norm, x, shift, scale) == ref.norm_modulate(norm, x, shift, scale)).float().mean() >= 0.999


def test_fp8_linear():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("rowwise FP8 GEMM needs sm_90+")
    from h3_spark.kernels.linear_fp8 import Fp8Linear, fp8_linear_reference, quantize_rows, reference_quantize_rows

    x = rand(512, 1024, scale=2).bfloat16()
    a, sa = quantize_rows(x)
    b, sb = reference_quantize_rows(x)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)
    lin = torch.nn.Linear(1024, 768, bias=False).to(DEV, torch.bfloat16)
    f8 = Fp8Linear.from_linear(lin)
    assert rel_l2(f8(x), fp8_linear_reference(x, f8.weight, f8.weight_scale.flatten())) <= 1e-2
    assert rel_l2(f8(x), lin(x)) <= 0.06


def test_swiglu_kernel():
    from h3_spark.kernels.swiglu import fused_swiglu, reference_swiglu

    up = rand(4096, 2 * 14336, scale=3).bfloat16()
    got, want = fused_swiglu(up), reference_swiglu(up)
    assert (got == want).float().mean().item() >= 0.999
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all()
