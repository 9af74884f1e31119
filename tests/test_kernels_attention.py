"""Attention backends: references against a plain computation, and resolution + error messages for every
backend on a CPU-only machine (real) and on a pretend Hopper GPU (capability patched; packages faked).

Error budgets: sdpa vs the fp64 formula rel L2 <= 1e-5 (fp32); head slicing is bit-identical to its inner
backend on CPU; fa3_fp8's quantization plumbing (per-(batch, head) descales) with a stand-in kernel that
dequantizes exactly: rel L2 <= 0.08 (three e4m3 roundings of random data).
"""

import math
import sys
import types

import pytest
import torch

import h3_spark.kernels.attention as att
import h3_spark.kernels.capability as cap
from h3_spark.errors import H3Error
from h3_spark.kernels.attention import BACKENDS, math_reference, resolve_attention, sdpa
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.kernels.settings import ATTENTION_BACKENDS, KernelSettings, SettingsError, SolSettings
from oracle import rel_l2


def qkv(b=1, s=37, h=3, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3)]


def plain_attention(q, k, v):
    """Loops over batch and heads in fp64: softmax(q k^T / sqrt(d)) v."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            qq, kk, vv = (t[b, :, h].double() for t in (q, k, v))
            w = torch.exp(qq @ kk.T / math.sqrt(q.shape[-1]))
            out[b, :, h] = (w / w.sum(-1, keepdim=True)) @ vv
    return out


def test_references_against_plain_computation():
    q, k, v = qkv(b=2)
    expected = plain_attention(q, k, v)
    assert rel_l2(sdpa(q, k, v), expected) <= 1e-5
    assert rel_l2(math_reference(q, k, v), expected) <= 1e-5
    assert BACKENDS["sdpa"] is sdpa and "cudnn_sdpa" in BACKENDS


def test_cpu_resolution_sdpa_and_auto():
    fn, name = resolve_attention("sdpa", "cpu")
    assert name == "sdpa" and fn.exact
    fn, name = resolve_attention("auto", "cpu")
    assert name == "sdpa"
    refused = {"fa3": "fa3 needs sm_90 (FlashAttention-3 kernels are built for Hopper only); this run is on cpu "
                      "(no CUDA GPU)",
               "cudnn_sdpa": "cudnn_sdpa needs sm_80 or newer (cuDNN fused attention); this run is on cpu (no CUDA GPU)"}
    assert fn.describe() == {"backend": "sdpa", "exact": True, "chosen_by_auto": "cpu (no CUDA GPU): PyTorch SDPA",
                             "refused_by_auto": refused}
    q, k, v = qkv()
    assert torch.equal(fn(q, k, v), sdpa(q, k, v))


def test_head_sliced_runs_on_cpu_and_matches_inner():
    s = KernelSettings(attention="kj_head_sliced", head_slice_backend="sdpa", head_slice_size=2)
    fn, name = resolve_attention("kj_head_sliced", "cpu", s)
    assert name == "kj_head_sliced(sdpa)"
    q, k, v = qkv(h=5)
    assert torch.allclose(fn(q, k, v), sdpa(q, k, v), rtol=0, atol=1e-6)
    assert fn.describe()["heads_per_slice"] == 2 and fn.describe()["inner"]["backend"] == "sdpa"


NO_GPU = r"this run is on cpu \(no CUDA GPU\)"


@pytest.mark.parametrize("name, message", [
    ("cudnn_sdpa", f"cudnn_sdpa needs sm_80 or newer \\(cuDNN fused attention\\); {NO_GPU}"),
    ("fa3", f"fa3 needs sm_90 \\(FlashAttention-3 kernels are built for Hopper only\\); {NO_GPU}"),
    ("fa3_fp8", f"fa3_fp8 needs sm_90 \\(FlashAttention-3 kernels are built for Hopper only\\); {NO_GPU}"),
    ("sage2", f"sage2 needs sm_80 or newer \\(SageAttention's CUDA kernels\\); {NO_GPU}"),
    ("sage2-quality", f"sage2-quality needs sm_80 or newer \\(SageAttention's CUDA kernels\\); {NO_GPU}"),
    ("ck_int8", f"ck_int8 needs sm_75 or newer \\(comfy-kitchen's INT8 attention kernel\\); {NO_GPU}"),
    ("sol_attn", f"sol_attn needs sm_80 or newer \\(comfy-kitchen's Sol-Attn CUDA kernels\\); {NO_GPU}"),
])
def test_cpu_errors_name_the_gpu_needed(name, message):
    with pytest.raises(KernelUnavailable, match=message) as info:
        resolve_attention(name, "cpu")
    assert isinstance(info.value, H3Error)


def test_cpu_head_sliced_error_comes_from_its_inner_backend():
    s = KernelSettings(head_slice_backend="fa3")
    with pytest.raises(KernelUnavailable, match=f"fa3 needs sm_90 .*{NO_GPU}"):
        resolve_attention("kj_head_sliced", "cpu", s)


def test_unknown_name():
    with pytest.raises(SettingsError, match="unknown attention backend 'flash'; use one of: auto, sdpa"):
        resolve_attention("flash", "cpu")
    assert len(ATTENTION_BACKENDS) == 10


# ----------------------------------------------------------------------------- a pretend Hopper GPU
@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(cap, "capability", lambda device: (9, 0))
    monkeypatch.setattr(att, "capability", lambda device: (9, 0))
    monkeypatch.setattr(cap, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    monkeypatch.setattr(att, "describe_device", lambda device: "NVIDIA H200 (sm_90)")
    for name in att.FA3_MODULES + ("sageattention",):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    return monkeypatch


def test_hopper_without_fa3(hopper):
    with pytest.raises(KernelUnavailable, match=r"FlashAttention-3 is not installed \(fa3_fwd_interface: .*"
                                                r"`pip install fa3-fwd`"):
        resolve_attention("fa3", "cpu")
    with pytest.raises(KernelUnavailable, match="`pip install fa3-fwd`"):
        resolve_attention("fa3_fp8", "cpu")


def test_hopper_auto_prefers_fa3_then_cudnn(hopper):
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: True)
    fn, name = resolve_attention("auto", "cpu")
    assert name == "cudnn_sdpa" and "no FlashAttention-3 installed" in fn.describe()["chosen_by_auto"]
    fake = types.ModuleType("fa3_fwd_interface")
    fake.flash_attn_func = lambda q, k, v, **kw: q
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake)
    fn, name = resolve_attention("auto", "cpu")
    assert name == "fa3" and fn.describe()["module"] == "fa3_fwd_interface"
    assert "fastest exact kernel measured" in fn.describe()["chosen_by_auto"]


@pytest.mark.parametrize("body, error", [
    ("raise ImportError('libcudart.so.13: cannot open shared object file')",
     "ImportError: libcudart.so.13: cannot open shared object file"),
    ("import h3_no_such_dependency", "ModuleNotFoundError: No module named 'h3_no_such_dependency'"),
    ("raise OSError('undefined symbol: _ZN3c104cuda')", "OSError: undefined symbol: _ZN3c104cuda"),
])
def test_hopper_fa3_that_fails_to_import_is_not_called_missing(hopper, tmp_path, body, error):
    # auto said "no FlashAttention-3 installed" for a build that is installed but broken (for another torch or
    # CUDA, or missing a dependency): the fix is a rebuild, and the error must be shown.
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: True)
    (tmp_path / "fa3_fwd_interface.py").write_text(body + "\n")
    hopper.delitem(sys.modules, "fa3_fwd_interface")
    hopper.syspath_prepend(str(tmp_path))
    fn, name = resolve_attention("auto", "cpu")
    why = fn.describe()["chosen_by_auto"]
    assert name == "cudnn_sdpa" and "no FlashAttention-3 installed" not in why
    assert why.startswith(f"cuDNN attention: FlashAttention-3 is installed but failed to import (fa3_fwd_interface: "
                          f"{error}); reinstall or rebuild it for this torch and CUDA")
    with pytest.raises(att.FA3ImportFailed, match=r"FlashAttention-3 is installed but failed to import "
                                                  r"\(fa3_fwd_interface: .*`pip install fa3-fwd`"):
        resolve_attention("fa3", "cpu")


def fake_fa3(dtypes, calls):
    fake = types.ModuleType("fa3_fwd_interface")

    def flash_attn_func(q, k, v, causal=False):
        calls.append(q.dtype)
        if q.dtype not in dtypes:  # the message the fa3-fwd wheel gives for fp16 on the H200
            raise RuntimeError("run_mha_fwd_constexpr: This flash attention build does not support FP16.")
        return q

    fake.flash_attn_func = flash_attn_func
    return fake


def test_hopper_auto_follows_the_model_dtype(hopper):
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: True)
    calls = []
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake_fa3({torch.bfloat16}, calls))
    assert resolve_attention("auto", "cpu", dtype=torch.bfloat16, head_dim=64)[1] == "fa3"
    fn, name = resolve_attention("auto", "cpu", dtype=torch.float16, head_dim=64)
    assert name == "cudnn_sdpa"
    assert "this FlashAttention-3 build has no torch.float16 kernel for head size 64" in fn.describe()["chosen_by_auto"]
    fn, name = resolve_attention("auto", "cpu", dtype=torch.float32)
    assert name == "sdpa" and "torch.float32 heads: PyTorch SDPA" in fn.describe()["chosen_by_auto"]
    assert calls == [torch.bfloat16, torch.float16]  # one probe call each; float32 needs none
    resolve_attention("auto", "cpu", dtype=torch.float16, head_dim=64)
    assert calls == [torch.bfloat16, torch.float16]  # a later resolution asks no more


def test_hopper_requested_backend_that_cannot_run_the_model_fails_at_set_up(hopper):
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: True)
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake_fa3({torch.bfloat16}, []))
    with pytest.raises(KernelUnavailable, match="fa3 takes bf16/fp16 heads and this model computes in torch.float32"):
        resolve_attention("fa3", "cpu", dtype=torch.float32)
    with pytest.raises(KernelUnavailable, match="cudnn_sdpa takes bf16/fp16 heads .* torch.float32"):
        resolve_attention("cudnn_sdpa", "cpu", dtype=torch.float32)
    with pytest.raises(KernelUnavailable, match="fa3_fp8 runs bf16 models; this one computes in torch.float16"):
        resolve_attention("fa3_fp8", "cpu", dtype=torch.float16)
    with pytest.raises(KernelUnavailable, match=r"this FlashAttention-3 build \(fa3_fwd_interface\) has no "
                                                r"torch.float16 kernel for head size 128; choose cudnn_sdpa"):
        resolve_attention("fa3", "cpu", dtype=torch.float16)
    fn, _ = resolve_attention("fa3", "cpu")  # without a dtype: as before, the call itself reports it
    with pytest.raises(KernelUnavailable, match="cannot run torch.float16 heads of size 64"):
        fn(*(torch.randn(1, 8, 1, 64).half(),) * 3)
    assert resolve_attention("fa3", "cpu", dtype=torch.bfloat16)[1] == "fa3"


def test_hopper_sage_missing_and_too_old(hopper):
    with pytest.raises(KernelUnavailable, match=r"sage2 needs the Python module `sageattention`.*SageAttention 2 is "
                                                r"not on PyPI \(the latest there is 1.0.6"):
        resolve_attention("sage2", "cpu")
    hopper.setitem(sys.modules, "sageattention", types.ModuleType("sageattention"))
    hopper.setattr(att, "package_version", lambda dist: "1.0.6")
    with pytest.raises(KernelUnavailable, match="sage2-quality needs sageattention >= 2, found 1.0.6"):
        resolve_attention("sage2-quality", "cpu")


def test_hopper_comfy_kitchen_reports_unavailable(hopper):
    pytest.importorskip("comfy_kitchen")
    with pytest.raises(KernelUnavailable, match=r"ck_int8: comfy-kitchen .* reports int8_attention unavailable on "
                                                r"NVIDIA H200 \(sm_90\)"):
        resolve_attention("ck_int8", "cpu")
    with pytest.raises(KernelUnavailable, match="sol_attn: comfy-kitchen .* reports its Sol-Attn kernels unavailable"):
        resolve_attention("sol_attn", "cpu", KernelSettings(sol=SolSettings(fallback="sdpa")))


def test_hopper_ck_int8_refuses_fp32_heads_at_set_up(hopper):
    calls = []
    ck = fake_comfy_kitchen(calls)
    ck.int8_attention = lambda q, k, v, **kw: sdpa(q, k, v)
    ck.int8_attention_is_available = lambda device: True
    hopper.setitem(sys.modules, "comfy_kitchen", ck)
    resolve_attention("ck_int8", "cpu", dtype=torch.bfloat16, head_dim=128)
    with pytest.raises(KernelUnavailable, match="ck_int8 takes bf16/fp16 heads and this model computes in "
                                                "torch.float32"):
        resolve_attention("ck_int8", "cpu", dtype=torch.float32, head_dim=128)


def test_hopper_comfy_kitchen_missing(hopper):
    hopper.setitem(sys.modules, "comfy_kitchen", None)
    with pytest.raises(KernelUnavailable, match="ck_int8 needs the Python module `comfy_kitchen`.*"
                                                "`pip install comfy-kitchen`"):
        resolve_attention("ck_int8", "cpu")


def fake_comfy_kitchen(calls):
    ck = types.ModuleType("comfy_kitchen")
    ck.sol_attn_is_available = lambda device: True

    def sol_attn(q, k, v, tau=1.0, scale=None, sink_blocks=None, sink_q=None, key_bias=None, topk_ratio=0.0,
                 tail=True, block_len=None, coarse_gate=None, token_aug=0):
        calls.append((q.shape[1], tau, topk_ratio))
        return sdpa(q, k, v)

    ck.sol_attn = sol_attn
    return ck


def test_hopper_sol_settings_and_routing(hopper):
    calls = []
    hopper.setitem(sys.modules, "comfy_kitchen", fake_comfy_kitchen(calls))
    with pytest.raises(KernelUnavailable, match="H3_SOL_INT8_QK=on: the installed comfy-kitchen .* sol_attn has no "
                                                "`int8_qk` switch .*leave H3_SOL_INT8_QK unset"):
        resolve_attention("sol_attn", "cpu", KernelSettings(sol=SolSettings(int8_qk="on", fallback="sdpa")))
    # the default fallback (sage2) must itself be resolvable: fail closed, naming it
    with pytest.raises(KernelUnavailable, match="sage2 needs the Python module `sageattention`"):
        resolve_attention("sol_attn", "cpu")
    settings = KernelSettings(sol=SolSettings(min_tokens=40, thresh_type="topk", topk_ratio=0.25, fallback="sdpa"))
    fn, name = resolve_attention("sol_attn", "cpu", settings)
    short = qkv(s=30, d=128, dtype=torch.bfloat16)
    long = qkv(s=50, d=128, dtype=torch.bfloat16)
    fn(*short)
    fn(*long)
    assert calls == [(50, 1.3, 0.25)]
    d = fn.describe()
    assert (d["sparse_calls"], d["short_calls_on_fallback"], d["fallback"]["backend"]) == (1, 1, "sdpa")
    with pytest.raises(KernelUnavailable, match=r"sol_attn takes bf16/fp16 heads of 128 channels, got torch.float32 "
                                                r".*H3_SOL_STRICT=0 would route"):
        fn(*qkv(s=50, d=16))
    with pytest.raises(KernelUnavailable, match=r"sol_attn takes bf16/fp16 heads and this model computes in "
                                                r"torch.float32; run it in bf16 or choose sdpa \(or H3_SOL_STRICT=0\)"):
        resolve_attention("sol_attn", "cpu", settings, dtype=torch.float32, head_dim=128)
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake_fa3({torch.bfloat16}, []))
    with pytest.raises(KernelUnavailable, match="fa3 takes bf16/fp16 heads and this model computes in torch.float32"):
        # not strict: fp32 heads go to the fallback, which must take them
        resolve_attention("sol_attn", "cpu", settings.replace(sol=SolSettings(strict=False, fallback="fa3")),
                          dtype=torch.float32, head_dim=128)
    lax, _ = resolve_attention("sol_attn", "cpu", settings.replace(sol=SolSettings(min_tokens=40, strict=False,
                                                                                    fallback="sdpa")),
                               dtype=torch.float32, head_dim=128)
    lax(*qkv(s=50, d=16))
    assert lax.describe()["unsupported_calls_on_fallback"] == 1


def test_hopper_fa3_fp8_descales(hopper):
    """fa3_fp8 hands FA3 e4m3 heads and per-(batch, head) descales: a stand-in kernel that dequantizes with them
    must reproduce attention to FP8 accuracy."""
    seen = {}

    def flash_attn_func(q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None, **kw):
        seen.update(dtype=q.dtype, shape=tuple(q_descale.shape))
        deq = [t.float() * s[:, None, :, None] for t, s in ((q, q_descale), (k, k_descale), (v, v_descale))]
        return math_reference(*deq).to(torch.bfloat16)

    fake = types.ModuleType("fa3_fwd_interface")
    fake.flash_attn_func = flash_attn_func
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake)
    fn, name = resolve_attention("fa3_fp8", "cpu")
    assert name == "fa3_fp8" and not fn.exact
    q, k, v = qkv(b=2, s=40, h=3, d=32, dtype=torch.bfloat16)
    out = fn(q, k, v)
    assert seen == {"dtype": torch.float8_e4m3fn, "shape": (2, 3)}
    assert out.dtype == torch.bfloat16
    assert rel_l2(out, math_reference(q, k, v)) <= 0.08
    assert fn.describe()["calls_quantizing_qk_here"] == 1
    with pytest.raises(KernelUnavailable, match="fa3_fp8 runs bf16 models"):
        fn(*qkv(s=40, d=32))


# ----------------------------------------------------------------------------- the registry and auto's refusals
def test_names_and_lists_come_from_the_registry():
    assert att.ATTENTION_BACKENDS == ("auto", *(spec.name for spec in att.SPECS))
    assert att.EXACT_BACKENDS == ("sdpa", "cudnn_sdpa", "fa3")
    assert att.AUTO_ORDER == ("fa3", "cudnn_sdpa", "sdpa")
    assert att.QUANTIZED_HEADS == ("fa3_fp8",)
    assert att.SOL_FALLBACKS == tuple(n for n in ATTENTION_BACKENDS if n not in ("sol_attn", "kj_head_sliced"))
    with pytest.raises(SettingsError, match="H3_SOL_FALLBACK='sol_attn' is not accepted; use one of: auto, sdpa"):
        KernelSettings.from_env({"H3_SOL_FALLBACK": "sol_attn"})


def test_auto_says_why_each_faster_backend_was_refused_on_hopper(hopper):
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: True)
    fn, name = resolve_attention("auto", "cpu", dtype=torch.bfloat16, head_dim=64)
    refused = fn.describe()["refused_by_auto"]
    assert name == "cudnn_sdpa" and list(refused) == ["fa3"]
    assert refused["fa3"].startswith("FlashAttention-3 is not installed (fa3_fwd_interface: ")
    assert refused["fa3"].endswith(att.FA3_HOW)
    report = {"chosen": name, **fn.describe()}
    assert att.auto_line(report) == ("auto chose cudnn_sdpa (cuDNN attention: no FlashAttention-3 installed); fa3: "
                                     + refused["fa3"])
    hopper.setitem(sys.modules, "fa3_fwd_interface", fake_fa3({torch.bfloat16}, []))
    fn, _ = resolve_attention("auto", "cpu", dtype=torch.float16, head_dim=64)
    assert fn.describe()["refused_by_auto"] == {
        "fa3": "this FlashAttention-3 build (fa3_fwd_interface) has no torch.float16 kernel for head size 64; choose "
               "cudnn_sdpa or sdpa, or auto"}
    fn, name = resolve_attention("auto", "cpu", dtype=torch.float32, head_dim=64)
    assert name == "sdpa" and fn.describe()["refused_by_auto"] == {
        "fa3": "fa3 takes bf16/fp16 heads and this model computes in torch.float32; run it in bf16 or choose sdpa",
        "cudnn_sdpa": "cudnn_sdpa takes bf16/fp16 heads and this model computes in torch.float32; run it in bf16 or "
                      "choose sdpa"}
    fn, name = resolve_attention("auto", "cpu", dtype=torch.bfloat16, head_dim=64)
    assert name == "fa3" and "refused_by_auto" not in fn.describe()


def test_auto_without_cudnn_names_it(hopper):
    hopper.setattr(torch.backends.cudnn, "is_available", lambda: False)
    fn, name = resolve_attention("auto", "cpu")
    assert name == "sdpa" and fn.describe()["chosen_by_auto"] == "no cuDNN installed: PyTorch SDPA"
    assert fn.describe()["refused_by_auto"]["cudnn_sdpa"] == (
        "cudnn_sdpa needs cuDNN, which this PyTorch build does not load; install a CUDA build of torch (it bundles "
        "nvidia-cudnn)")


def test_auto_that_finds_nothing_lists_every_refusal(monkeypatch):
    monkeypatch.setattr(att, "AUTO_ORDER", ("fa3", "cudnn_sdpa"))
    with pytest.raises(KernelUnavailable, match=r"auto found no exact attention backend: fa3: fa3 needs sm_90 .*; "
                                                r"cudnn_sdpa: cudnn_sdpa needs sm_80 or newer"):
        resolve_attention("auto", "cpu")


def test_hopper_sol_refuses_other_head_sizes_at_set_up_when_strict(hopper):
    hopper.setitem(sys.modules, "comfy_kitchen", fake_comfy_kitchen([]))
    settings = KernelSettings(sol=SolSettings(fallback="sdpa"))
    with pytest.raises(KernelUnavailable, match=r"sol_attn takes heads of 128 channels and this model's have 64; "
                                                r"choose sdpa \(or H3_SOL_STRICT=0\)"):
        resolve_attention("sol_attn", "cpu", settings, dtype=torch.bfloat16, head_dim=64)
    lax = settings.replace(sol=SolSettings(fallback="sdpa", strict=False))
    assert resolve_attention("sol_attn", "cpu", lax, dtype=torch.bfloat16, head_dim=64)[1] == "sol_attn"
    assert resolve_attention("sol_attn", "cpu", settings, dtype=torch.bfloat16, head_dim=128)[1] == "sol_attn"


def test_attention_help_names_every_backend_and_whether_it_is_exact():
    text = att.attention_help()
    assert text.startswith("auto: the fastest exact backend here")
    for spec in att.SPECS:
        assert f"{spec.name}: {spec.summary} (" in text
    assert "fa3: FlashAttention-3 forward (exact)" in text and "ck_int8: comfy-kitchen INT8" in text
    assert "kj_head_sliced: another backend (H3_HEAD_SLICE_BACKEND) run over slices of heads (as exact as" in text
