"""apply_kernels on a CPU model: the report, exactness of the auto choices (fused Triton kernels run in the
CPU interpreter here), and fail-closed errors that leave the model untouched."""

import sys

import pytest
import torch

import h3_spark.kernels.capability as cap
import h3_spark.kernels.dispatch as dispatch
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.kernels.references import RowModulation
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.h3_model.engine.kernel_plan import apply_kernels
from h3_spark.kernels.settings import KernelSettings, SettingsError
from oracle import EQUAL_WIDTH, diffusers_dit, forward_args, ours_from, rel_l2, text_tags

pytest.importorskip("triton")


def forward_inputs(c, seed: int) -> dict:
    """Random T2VA forward arguments for a DiT config (a small packed layout)."""
    return forward_args(c, layout.build_t2va(text_tags(6), 2, 4, 4, 5), seed)


@pytest.fixture(scope="module")
def setup():
    return diffusers_dit(TINY, seed=3), forward_inputs(TINY, seed=5)


def model_bf16(ref):
    return ours_from(ref, TINY, dtype=torch.bfloat16)


def test_default_report_and_exactness(setup):
    ref, args = setup
    plain, fast = model_bf16(ref), model_bf16(ref)
    report = apply_kernels(fast, KernelSettings.from_env({}))
    assert report["attention"]["chosen"] == "sdpa" and report["attention"]["requested"] == "auto"
    assert report["qk_prep"]["impl"] == "triton" and report["qk_prep"]["exact"]
    assert report["modulation"]["impl"] == "triton" and report["linear"]["format"] == "bf16"
    assert report["exact"] and report["approximate_paths"] == [] and report["triton_interpreter"]
    with torch.no_grad():
        a, b = plain(**args), fast(**args)
    # fused norm/RoPE/modulation differ from eager only by rare 1-ulp bf16 roundings
    assert rel_l2(b[0], a[0]) <= 2e-2 and rel_l2(b[1], a[1]) <= 2e-2


def test_everything_off_is_the_reference(setup):
    ref, args = setup
    plain, model = model_bf16(ref), model_bf16(ref)
    report = apply_kernels(model, KernelSettings(attention="sdpa", modulation_fusion="off",
                                                 q_rms_rope_int8_fusion="off", linear="bf16"))
    assert model.qk_prep is None and model.modulation_cls is RowModulation
    assert report["qk_prep"]["impl"] == "pytorch-reference" and report["exact"]
    with torch.no_grad():
        a, b = plain(**args), model(**args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("settings, message", [
    (KernelSettings(linear="fp8"), r"H3_LINEAR=fp8 needs sm_90 or newer \(rowwise-scaled FP8 GEMMs"),
    (KernelSettings(linear="nvfp4"), r"H3_LINEAR=nvfp4 needs sm_100 or newer \(FP4 tensor cores"),
    (KernelSettings(attention="fa3"), r"fa3 needs sm_90"),
    (KernelSettings(attention="cudnn_sdpa"), r"cudnn_sdpa needs sm_80 or newer"),
])
def test_cpu_errors_leave_the_model_untouched(setup, settings, message):
    ref, _ = setup
    model = model_bf16(ref)
    before = type(model.transformer_blocks[0].attn.to_q)
    with pytest.raises(KernelUnavailable, match=message):
        apply_kernels(model, settings)
    assert model.qk_prep is None and model.modulation_cls is RowModulation
    assert type(model.transformer_blocks[0].attn.to_q) is before


def test_modulation_exact_needs_triton(setup, monkeypatch):
    ref, _ = setup
    monkeypatch.setattr(cap, "triton_interpreting", lambda: False)
    with pytest.raises(KernelUnavailable, match=r"H3_MODULATION_FUSION=exact is a Triton GPU kernel and needs a "
                                                r"CUDA GPU; this run is on cpu \(no CUDA GPU\)"):
        apply_kernels(model_bf16(ref), KernelSettings(modulation_fusion="exact"))
    report = apply_kernels(model_bf16(ref), KernelSettings())
    assert report["modulation"]["impl"] == "pytorch-reference" and "auto: no Triton GPU kernel" in \
        report["modulation"]["note"]


def test_fa3_fp8_needs_per_head_scales(setup, monkeypatch):
    ref, _ = setup
    for module in (cap, dispatch):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", type(sys)("fa3_fwd_interface"))
    sys.modules["fa3_fwd_interface"].flash_attn_func = lambda *a, **k: None
    with pytest.raises(SettingsError, match="H3_QK_GRANULARITY='per_block' is not accepted; use one of: per_head, "
                                            "per_head_bound"):
        KernelSettings(attention="fa3_fp8", qk_granularity="per_block")
    torch.manual_seed(0)
    sixteen = H3DiT(EQUAL_WIDTH, dtype=torch.bfloat16)  # FP8 GEMMs need widths divisible by 16
    report = apply_kernels(sixteen, KernelSettings(attention="fa3_fp8", linear="fp8"))
    assert report["qk_prep"]["format"] == "fp8" and report["qk_prep"]["hadamard_block"] == 128
    assert report["approximate_paths"] == ["attention", "qk_prep", "linear"] and not report["exact"]
    assert report["linear"]["sources"] == {"bf16 weight quantized per output channel": 6 * EQUAL_WIDTH.num_layers}
    assert type(sixteen.transformer_blocks[0].ff.net[2]).__name__ == "Fp8Linear"
    # A per-request attention switch (serve, ComfyUI) reads the heads' dtype: the compute dtype, not e4m3.
    assert dispatch.model_heads(sixteen) == {"dtype": torch.bfloat16, "head_dim": EQUAL_WIDTH.attention_head_dim}
    report = apply_kernels(model_bf16(ref), KernelSettings(attention="fa3_fp8", qk_granularity="per_head_bound"))
    assert report["qk_prep"]["scales"] == "per_head_bound" and report["qk_prep"]["format"] == "fp8"


def test_linears_that_cannot_be_converted_leave_the_model_untouched(setup, monkeypatch):
    ref, _ = setup
    for module in (cap, dispatch):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    tiny = model_bf16(ref)  # TINY's widths (24, 32, 64) are not all multiples of 16
    before = (tiny.modulation_cls, tiny.qk_prep, tiny.transformer_blocks[0].ff.activation)
    with pytest.raises(KernelUnavailable, match=r"H3_LINEAR=fp8 needs bias-free block linears with out features "
                                                r"divisible by 16 and in features by 16; transformer_blocks.0.attn.to_q "
                                                r"is 32x24"):
        apply_kernels(tiny, KernelSettings(attention="sdpa", linear="fp8"))
    assert (tiny.modulation_cls, tiny.qk_prep, tiny.transformer_blocks[0].ff.activation) == before
    torch.manual_seed(0)
    sixteen = H3DiT(EQUAL_WIDTH, dtype=torch.bfloat16)
    apply_kernels(sixteen, KernelSettings(attention="sdpa", linear="fp8"))
    for linear, message in (("bf16", "already run as Fp8Linear; reload the model for exact bf16 linears"),
                            ("fp8", "already converted \\(Fp8Linear\\); reload the model to apply H3_LINEAR again")):
        with pytest.raises(KernelUnavailable, match=message):
            apply_kernels(sixteen, KernelSettings(attention="sdpa", linear=linear))


def test_fp8_linears_take_their_activations_from_the_fused_passes(monkeypatch):
    # With FP8 linears q, k and v share one quantized input and SwiGLU writes e4m3 rows: same values as letting each
    # Fp8Linear quantize the model-dtype rows (modulation off), up to the fused norm's rare 1-ulp roundings.
    from h3_spark.kernels.linear_fp8 import Fp8RowModulation, Fp8SwiGLU

    for module in (cap, dispatch):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    models = []
    for fusion in ("auto", "off"):
        torch.manual_seed(0)
        m = H3DiT(EQUAL_WIDTH, dtype=torch.bfloat16)
        report = apply_kernels(m, KernelSettings(attention="sdpa", linear="fp8", modulation_fusion=fusion,
                                                 q_rms_rope_int8_fusion="off"))
        models.append((m, report))
    (fused, fused_report), (plain, plain_report) = models
    assert fused.modulation_cls is Fp8RowModulation and isinstance(fused.transformer_blocks[0].ff, Fp8SwiGLU)
    assert "one quantized input for q, k and v" in fused_report["linear"]["activation_quantizer"]
    assert plain.modulation_cls is RowModulation and plain_report["linear"]["activation_quantizer"] == "triton"
    inputs = forward_inputs(EQUAL_WIDTH, seed=1)
    with torch.no_grad():
        a, b = fused(**inputs), plain(**inputs)
    assert rel_l2(a[0], b[0]) <= 2e-2 and rel_l2(a[1], b[1]) <= 2e-2


def test_auto_attention_follows_the_model_dtype_and_fa3_fails_at_set_up(setup, monkeypatch):
    # A float32 model on a Hopper GPU with FlashAttention-3: auto must not pick a half-precision kernel (it
    # did, and the first forward failed), and an explicit fa3 fails before the model is changed.
    import h3_spark.kernels.attention as att

    ref, _ = setup
    for module in (cap, dispatch, att):
        monkeypatch.setattr(module, "capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", type(sys)("fa3_fwd_interface"))
    sys.modules["fa3_fwd_interface"].flash_attn_func = lambda q, k, v, causal=False: q
    fp32 = ours_from(ref, TINY, dtype=torch.float32)
    report = apply_kernels(fp32, KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    assert report["attention"]["chosen"] == "sdpa"
    assert "torch.float32 heads: PyTorch SDPA" in report["attention"]["chosen_by_auto"]
    with pytest.raises(KernelUnavailable, match="fa3 takes bf16/fp16 heads and this model computes in torch.float32"):
        apply_kernels(ours_from(ref, TINY, dtype=torch.float32), KernelSettings(attention="fa3"))
    assert apply_kernels(model_bf16(ref), KernelSettings(q_rms_rope_int8_fusion="off"))["attention"]["chosen"] == "fa3"


def test_attention_counts_are_read_when_asked():
    import types

    class Backend:
        n = 0

        def describe(self):
            return {"backend": "sol_attn", "exact": False, "short_calls_on_fallback": self.n,
                    "unsupported_calls_on_fallback": 2 * self.n, "strict": True}

    model = types.SimpleNamespace(attention=Backend())
    assert dispatch.attention_counts(model) == {"short_calls_on_fallback": 0, "unsupported_calls_on_fallback": 0}
    model.attention.n = 3
    assert dispatch.attention_counts(model) == {"short_calls_on_fallback": 3, "unsupported_calls_on_fallback": 6}
    assert dispatch.attention_counts(types.SimpleNamespace(attention=lambda q, k, v: q)) == {}
