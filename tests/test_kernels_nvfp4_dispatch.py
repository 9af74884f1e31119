"""The NVFP4 linear path on the CPU, on a pretend Blackwell GPU (capability patched to sm_100).

The FP4 GEMM is a stand-in: a fake `comfy_kitchen` module whose `scaled_mm_nvfp4` checks its operands as
the cuBLASLt kernel takes them, dequantizes both with the real comfy-kitchen's eager `dequantize_nvfp4`
(the oracle for the layout) and multiplies in fp32, which is what the FP4 tensor cores compute up to
accumulation order. Our Triton encoders run in the interpreter (conftest). Checked here: apply_kernels'
choice, conversion and report; the DiT forward with every fusion setting; the bytes the fused and unfused
producers hand the GEMM; the refusals.

Error budgets:
- NVFP4 DiT vs the bf16 DiT: rel L2 <= 0.04 on both outputs, and >= 0.004 (so a path that silently stayed
  bf16 fails). Why 0.04: one NVFP4 round trip of Gaussian data costs rel L2 ~0.095 (E2M1 keeps one mantissa
  bit under an e4m3 scale per 16 values; <= 0.12 in test_kernels_linear), so a GEMM with both operands
  quantized is off by ~0.13; the DiT's residual stream and its bf16 embeddings and output projections
  dilute that to 0.0125 (the reviewer's measurement on EQUAL_WIDTH) and to 0.011-0.029 over four seeds of
  the model below (0.017 and 0.014 for the one tested). 0.04 is 1.4x the largest of those and under half of
  what a layout bug costs (activation nibbles in the wrong order: 0.098 here).
- NVFP4 DiT vs an emulation that quantizes every block GEMM's operands with comfy-kitchen's eager quantizer
  and nothing of ours: bit-identical where every producer is byte-identical by design (plain quantizer,
  SwiGLU producer, eager norm); within a tenth of the NVFP4 error above where a Triton norm runs (its bf16
  output may differ from eager by 1 ulp, which can move an FP4 code by a step). Measured: identical.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import h3_spark.kernels.attention as att
import h3_spark.kernels.capability as cap
import h3_spark.kernels.dispatch as dispatch
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.kernels.references import RowModulation
from h3_spark.errors import InputError
from h3_spark.h3_model.engine.kernel_plan import apply_kernels
from h3_spark.kernels.dispatch import BLOCK_LINEARS
from h3_spark.kernels.settings import KernelSettings
from oracle import EQUAL_WIDTH, forward_args, rel_l2, text_tags

pytest.importorskip("triton")
ck = pytest.importorskip("comfy_kitchen")  # the real one: the oracle inside the fake GEMM and the emulation
from h3_spark.kernels import nvfp4 as nv  # noqa: E402
from h3_spark.kernels.modulation import FusedRowModulation  # noqa: E402

TOLERANCE = 0.04
MIN_ERROR = 0.004
GEMMS_PER_FORWARD = len(BLOCK_LINEARS) * EQUAL_WIDTH.num_layers  # EQUAL_WIDTH's widths are multiples of 32


# ------------------------------------------------------------------------------------------ the pretend GPU
def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    # NVFP4's per-tensor scale maps the tensor's amax onto the largest code times the largest block scale.
    return (x.float().abs().amax() / (6.0 * 448.0)).reshape(())


def roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def check_operand(packed, block_scales, global_scale, what: str) -> None:
    """The checks cuBLASLt's block-scaled FP4 GEMM would fail on: codes, scale dtype and blocked shape."""
    rows, half_k = packed.shape
    assert packed.dtype == torch.uint8, f"{what}: packed codes must be uint8, got {packed.dtype}"
    assert block_scales.dtype == torch.float8_e4m3fn, f"{what}: block scales must be e4m3, got {block_scales.dtype}"
    want = (roundup(rows, 128), roundup(2 * half_k // 16, 4))
    assert tuple(block_scales.shape) == want, f"{what}: block scales {tuple(block_scales.shape)}, want {want}"
    assert global_scale.dtype == torch.float32 and global_scale.numel() == 1, f"{what}: global scale {global_scale}"


class FakeKitchen:
    """A `comfy_kitchen` module with only the FP4 GEMM, computed from the real package's eager dequantizer."""

    def __init__(self):
        self.calls: list[dict] = []
        self.module = types.ModuleType("comfy_kitchen")
        self.module.scaled_mm_nvfp4 = self.scaled_mm_nvfp4

    def scaled_mm_nvfp4(self, a, b, tensor_scale_a, tensor_scale_b, block_scale_a, block_scale_b, bias=None,
                        out_dtype=None, alpha=None):
        check_operand(a, block_scale_a, tensor_scale_a, "activation")
        check_operand(b, block_scale_b, tensor_scale_b, "weight")
        assert a.shape[1] == b.shape[1] and bias is None and alpha is None
        self.calls.append(dict(a=a, block_scale_a=block_scale_a, tensor_scale_a=tensor_scale_a))
        da = ck.dequantize_nvfp4(a, tensor_scale_a, block_scale_a, torch.float32)[: a.shape[0]]
        db = ck.dequantize_nvfp4(b, tensor_scale_b, block_scale_b, torch.float32)[: b.shape[0]]
        return (da @ db.t()).to(out_dtype or torch.bfloat16)


def pretend_gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    for module in (cap, dispatch, att):
        monkeypatch.setattr(module, "capability", lambda device: capability)
        monkeypatch.setattr(module, "describe_device", lambda device: name)


@pytest.fixture
def blackwell(monkeypatch) -> FakeKitchen:
    pretend_gpu(monkeypatch, (10, 0), "pretend B200 (sm_100)")
    kitchen = FakeKitchen()
    monkeypatch.setitem(sys.modules, "comfy_kitchen", kitchen.module)
    return kitchen


# ------------------------------------------------------------------------------------------ model and inputs
def nvfp4_dit(seed: int = 0) -> H3DiT:
    """EQUAL_WIDTH in bf16, default init, with RMSNorm gains away from 1 so the fused norm's gain matters."""
    torch.manual_seed(seed)
    model = H3DiT(EQUAL_WIDTH, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.RMSNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))
    return model


def small_inputs(seed: int) -> dict:
    """A T2VA forward of 11 rows (3 text, 4 video, 4 audio): each row costs a kernel program in the interpreter."""
    return forward_args(EQUAL_WIDTH, layout.build_t2va(text_tags(3), 2, 2, 4, 2), seed)


def settings(swiglu="auto", rms="auto", modulation="auto", **more) -> KernelSettings:
    return KernelSettings(attention="sdpa", linear="nvfp4", swiglu_nvfp4_fusion=swiglu, rms_adaln_nvfp4_fusion=rms,
                          modulation_fusion=modulation, q_rms_rope_int8_fusion="off", **more)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x through comfy-kitchen's eager NVFP4 quantizer and back, in fp32."""
    rows = x.reshape(-1, x.shape[-1])
    g = nvfp4_global_scale(rows)
    packed, scales = ck.quantize_nvfp4(rows, g)
    return ck.dequantize_nvfp4(packed, g, scales, torch.float32)[: rows.shape[0]].reshape(x.shape)


class EmulatedNvfp4Linear(nn.Module):
    """What an FP4 x FP4 GEMM computes, from comfy-kitchen alone: fp32 product of both dequantized operands."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = fake_quantize(linear.weight.detach())

    def forward(self, x):
        return (fake_quantize(x) @ self.weight.t()).to(x.dtype)


def emulated_dit(seed: int = 0) -> H3DiT:
    model = nvfp4_dit(seed)
    for blk in model.transformer_blocks:
        for name in BLOCK_LINEARS:
            parent_name, _, attr = name.rpartition(".")
            parent = blk.get_submodule(parent_name)
            new = EmulatedNvfp4Linear(blk.get_submodule(name))
            if attr.isdigit():
                parent[int(attr)] = new
            else:
                setattr(parent, attr, new)
    return model


@pytest.fixture(scope="module")
def inputs():
    return small_inputs(seed=10)


@pytest.fixture(scope="module")
def bf16_out(inputs):
    with torch.no_grad():
        return nvfp4_dit()(**inputs)


@pytest.fixture(scope="module")
def emulated_out(inputs):
    with torch.no_grad():
        return emulated_dit()(**inputs)


# ------------------------------------------------------------------------------------------ dispatch and report
@pytest.mark.parametrize("swiglu, rms, modulation", [("auto", "auto", "auto"), ("off", "auto", "auto"),
                                                      ("auto", "off", "auto"), ("off", "off", "off")])
def test_nvfp4_is_chosen_reported_and_converts_the_block_linears(blackwell, swiglu, rms, modulation):
    model = nvfp4_dit()
    report = apply_kernels(model, settings(swiglu, rms, modulation))
    lin = report["linear"]
    assert (lin["format"], lin["exact"], lin["activation_quantizer"]) == ("nvfp4", False, "triton")
    assert lin["why"] == "requested: NVFP4 weights x NVFP4 activations (comfy-kitchen scaled_mm_nvfp4)"
    assert lin["sources"] == {"bf16 weight quantized to NVFP4": GEMMS_PER_FORWARD}
    rms_on = rms == "auto" and modulation == "auto"
    assert (lin["swiglu_nvfp4_fusion"], lin["rms_adaln_nvfp4_fusion"]) == (swiglu == "auto", rms_on)
    assert set(lin["nvfp4_fusions_off"]) == {k for k, on in (("swiglu_nvfp4_fusion", swiglu == "auto"),
                                                             ("rms_adaln_nvfp4_fusion", rms_on)) if not on}
    assert report["capability"] == (10, 0) and report["device"] == "pretend B200 (sm_100)"
    assert report["approximate_paths"] == (["modulation", "linear"] if rms_on else ["linear"])

    want_mod = nv.Nvfp4RowModulation if rms_on else FusedRowModulation if modulation == "auto" else RowModulation
    assert model.modulation_cls is want_mod
    bf16_block = nvfp4_dit().transformer_blocks[0]
    for blk in model.transformer_blocks:
        assert isinstance(blk.ff, nv.Nvfp4SwiGLU) == (swiglu == "auto")
        for name in BLOCK_LINEARS:
            m, shape = blk.get_submodule(name), tuple(bf16_block.get_submodule(name).weight.shape)
            assert type(m) is nv.Nvfp4Linear and (m.out_features, m.in_features) == shape
    # The text refiner is not among the block GEMMs: it keeps its bf16 linears.
    assert type(model.token_refiner.refiner_blocks[0].attn.to_q) is nn.Linear
    assert dispatch.model_heads(model) == {"dtype": torch.bfloat16, "head_dim": EQUAL_WIDTH.attention_head_dim}


def test_report_names_the_nvfp4_swiglu_that_runs(blackwell):
    # It said "triton" (the bf16 SwiGLU kernel) while Nvfp4SwiGLU ran, and "pytorch-reference" with the
    # modulation fusion off.
    for modulation, refiner in (("auto", "triton"), ("off", "pytorch-reference")):
        report = apply_kernels(nvfp4_dit(), settings(modulation=modulation))
        assert report["modulation"]["swiglu"] == "nvfp4-fused"
        assert report["modulation"]["swiglu_text_refiner"] == refiner
    report = apply_kernels(nvfp4_dit(), settings(swiglu="off"))
    assert report["modulation"]["swiglu"] == "triton" and "swiglu_text_refiner" not in report["modulation"]
    assert report["linear"]["nvfp4_fusions_off"]["swiglu_nvfp4_fusion"] == (
        "H3_SWIGLU_NVFP4_FUSION=off: fc2 quantizes the bf16 SwiGLU output itself")


def test_rms_adaln_fusion_off_says_why(blackwell):
    # H3_RMS_ADALN_NVFP4_FUSION=auto did nothing under H3_MODULATION_FUSION=off, and the report did not say so.
    consequence = ": q/k/v and fc1 quantize the bf16 norm output themselves"
    report = apply_kernels(nvfp4_dit(), settings(rms="auto", modulation="off"))
    assert report["linear"]["rms_adaln_nvfp4_fusion"] is False
    assert report["linear"]["nvfp4_fusions_off"] == {"rms_adaln_nvfp4_fusion": (
        "H3_MODULATION_FUSION=off, and this fusion is a form of the fused modulation (H3_MODULATION_FUSION=auto "
        "turns it on)" + consequence)}
    report = apply_kernels(nvfp4_dit(), settings(rms="off"))
    assert report["linear"]["nvfp4_fusions_off"] == {"rms_adaln_nvfp4_fusion": "H3_RMS_ADALN_NVFP4_FUSION=off"
                                                     + consequence}
    report = apply_kernels(nvfp4_dit(), settings())
    assert report["linear"]["rms_adaln_nvfp4_fusion"] is True and report["linear"]["nvfp4_fusions_off"] == {}


def test_auto_runs_an_nvfp4_checkpoint_as_nvfp4_on_blackwell(blackwell, monkeypatch):
    auto = KernelSettings(attention="sdpa", q_rms_rope_int8_fusion="off")
    model = nvfp4_dit()
    lin = apply_kernels(model, auto, checkpoint_format="nvfp4")["linear"]
    assert lin["format"] == "nvfp4" and lin["why"].startswith(
        "auto: Blackwell GPU and an NVFP4 checkpoint run FP4 x FP4 GEMMs (the report's sources say which layers")
    assert type(model.transformer_blocks[0].attn.to_q) is nv.Nvfp4Linear

    # Stored codes, when a weight source gives them, are used as they are.
    stored = {}

    def weight_source(name):
        w = nvfp4_dit().get_submodule(name).weight.detach()
        packed, scales = nv.reference_quantize_nvfp4(w, nvfp4_global_scale(w))
        stored[name] = packed
        return {"format": "nvfp4", "weight": packed, "weight_scale": scales.view(torch.uint8),
                "weight_scale_2": nvfp4_global_scale(w)}

    model = nvfp4_dit()
    lin = apply_kernels(model, auto, checkpoint_format="nvfp4", weight_source=weight_source)["linear"]
    assert lin["sources"] == {"NVFP4 checkpoint, used as stored": GEMMS_PER_FORWARD}
    assert all(model.get_submodule(name).weight is packed for name, packed in stored.items())

    lin = apply_kernels(nvfp4_dit(), auto, checkpoint_format="bf16")["linear"]
    assert lin["format"] == "bf16" and lin["why"] == "auto: exact bf16 (FP8, NVFP4 and W4A8 linears are opt-in via H3_LINEAR)"
    monkeypatch.setitem(sys.modules, "comfy_kitchen", None)  # None in sys.modules makes the import fail
    lin = apply_kernels(nvfp4_dit(), auto, checkpoint_format="nvfp4")["linear"]
    assert lin["format"] == "bf16" and lin["why"].startswith(
        "auto: NVFP4 GEMM unavailable (H3_LINEAR=nvfp4 needs the Python module `comfy_kitchen`")
    pretend_gpu(monkeypatch, (9, 0), "NVIDIA H200 (sm_90)")
    lin = apply_kernels(nvfp4_dit(), auto, checkpoint_format="nvfp4")["linear"]
    assert lin["format"] == "bf16" and lin["why"].startswith("auto: exact bf16")


# ------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("swiglu, rms, modulation, byte_identical", [
    ("auto", "auto", "auto", False), ("off", "auto", "auto", False), ("off", "off", "auto", False),
    ("auto", "off", "off", True), ("off", "off", "off", True)])
def test_dit_forward_matches_bf16_within_nvfp4_error(blackwell, inputs, bf16_out, emulated_out, swiglu, rms,
                                                     modulation, byte_identical):
    model = nvfp4_dit()
    apply_kernels(model, settings(swiglu, rms, modulation))
    with torch.no_grad():
        out = model(**inputs)
    assert len(blackwell.calls) == GEMMS_PER_FORWARD  # every block GEMM went through the FP4 GEMM
    for got, ref, emu in zip(out, bf16_out, emulated_out):
        assert MIN_ERROR <= rel_l2(got, ref) <= TOLERANCE
        if byte_identical:
            assert torch.equal(got, emu)
        else:
            assert rel_l2(got, emu) <= 0.1 * rel_l2(emu, ref)


# ------------------------------------------------------------------------------------------ activation codes
def assert_codes_of(rows: torch.Tensor, packed, block_scales, global_scale) -> None:
    """Byte-identical to comfy-kitchen's eager quantizer on `rows` with NVFP4's per-tensor scale."""
    rows = rows.reshape(-1, rows.shape[-1])
    g = nvfp4_global_scale(rows)
    want_packed, want_scales = ck.quantize_nvfp4(rows, g)
    assert torch.equal(global_scale, g)
    assert torch.equal(packed, want_packed)
    assert torch.equal(block_scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_unfused_gemm_inputs_are_the_exact_rows_quantized(blackwell, inputs):
    model = nvfp4_dit()
    apply_kernels(model, settings("off", "off", "off"))
    rows = []
    for m in model.modules():
        if isinstance(m, nv.Nvfp4Linear):
            m.register_forward_pre_hook(lambda module, args: rows.append(args[0]))
    with torch.no_grad():
        model(**inputs)
    assert len(rows) == len(blackwell.calls) == GEMMS_PER_FORWARD
    for x, call in zip(rows, blackwell.calls):
        assert_codes_of(x, call["a"], call["block_scale_a"], call["tensor_scale_a"])


def test_fused_producers_write_the_codes_of_the_exact_rows(blackwell, inputs, monkeypatch):
    model = nvfp4_dit()
    apply_kernels(model, settings())
    swiglus, norms = [], []
    encode_swiglu, encode_norm = nv.swiglu_quantize_nvfp4, nv.Nvfp4RowModulation.norm_modulate

    def swiglu_recorded(fc1_out, static=None):
        assert static is None  # dynamic scales unless static ones are installed
        swiglus.append((fc1_out, encode_swiglu(fc1_out)))
        return swiglus[-1][-1]

    def norm_recorded(mod, norm, x, shift, scale):
        norms.append((mod, norm, x, shift, scale, encode_norm(mod, norm, x, shift, scale)))
        return norms[-1][-1]

    monkeypatch.setattr(nv, "swiglu_quantize_nvfp4", swiglu_recorded)
    monkeypatch.setattr(nv.Nvfp4RowModulation, "norm_modulate", norm_recorded)
    with torch.no_grad():
        model(**inputs)
    layers = EQUAL_WIDTH.num_layers
    assert len(swiglus) == layers and len(norms) == 2 * layers
    for fc1_out, act in swiglus:
        value, gate = fc1_out.chunk(2, dim=-1)
        assert_codes_of(value * F.silu(gate), act.packed, act.block_scales, act.global_scale)
    for mod, norm, x, shift, scale, act in norms:
        # The bf16 rows this pass replaces: the fused modulation's (what runs with the fusion off) and eager's.
        with torch.no_grad():
            fused = FusedRowModulation.norm_modulate(mod, norm, x, shift, scale)
            eager = RowModulation(mod.rows, use_segments=False).norm_modulate(norm, x, shift, scale)
        assert torch.equal(fused, eager)  # on the CPU; a GPU may round 1 in 1000 a ulp apart (modulation tests)
        assert_codes_of(fused, act.packed, act.block_scales, act.global_scale)
    # q, k and v read one encoded activation: the GEMM gets the same codes three times, not three encodings.
    q, k, v = blackwell.calls[:3]
    assert q["a"] is k["a"] is v["a"] is norms[0][-1].packed


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("swiglu", ["auto", "off"])
def test_mlp_chunks_with_the_rms_adaln_fusion_is_an_input_error(blackwell, inputs, swiglu):
    # With Nvfp4SwiGLU in place this was a ValueError, which the CLI and serve report as an internal error.
    model = nvfp4_dit()
    apply_kernels(model, settings(swiglu=swiglu))
    message = (r"^the MLP input is a Nvfp4Activation, which cannot be split into row chunks: run with mlp_chunks 1, "
               r"or set H3_RMS_ADALN_NVFP4_FUSION=off$")
    with torch.no_grad(), pytest.raises(InputError, match=message):
        model(**inputs, mlp_chunks=2)


def test_mlp_chunks_without_the_rms_adaln_fusion_runs(blackwell, inputs, bf16_out):
    # Each chunk's fc1 input gets its own per-tensor scale, so the codes (not the error budget) change.
    model = nvfp4_dit()
    apply_kernels(model, settings(rms="off"))
    with torch.no_grad():
        out = model(**inputs, mlp_chunks=2)
    for got, ref in zip(out, bf16_out):
        assert MIN_ERROR <= rel_l2(got, ref) <= TOLERANCE
