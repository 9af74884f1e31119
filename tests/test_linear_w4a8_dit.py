"""H3_LINEAR=w4a8 on a DiT: every asym_w4a8_int8 layer kept as stored runs as `W4A8Linear` (int8 grid x per-token
int8 activations), the file's other layers keep their path, and whatever it cannot run is refused when the kernels
are set up, before the model changes.

Files: make-checkpoint's tiny DiTs (`make_dit_checkpoint`, --format w4a8 / w4a8_sym / w4a8_asym), loaded with their
stored weights by the real loader (`load_dit(..., stored=True)`). Oracle: the same file's stored model, dequantized
at use (StoredLinear), fp32. Budget: DiT velocities within 0.5 % rel L2 and above 0.005 % (a run that agreed closer
would not have quantized its activations). Measured (seed 5): 0.040 % video / 0.034 % audio with the codebook
variant, 0.039 % / 0.028 % symmetric, 0.018 % / 0.026 % for the tiny DiT with bf16 q/k/v and fc1; far below the
per-linear 0.77 % (tests/test_linear_w4a8.py, budget 1.5 %) on these synthetic weights. The bound still
tells a broken linear: one without its rotation measured 3.8-5.7 %, one returning zeros 2.6-4.8 %."""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import H3Error
from h3_spark.h3_model.checkpoint import load_dit
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.engine.kernel_plan import apply_kernels
from h3_spark.kernels.capability import KernelUnavailable
from h3_spark.kernels.dispatch import check_w4a8_linears, resolve_linear
from h3_spark.kernels.linear_w4a8 import W4A8Linear
from h3_spark.kernels.settings import KernelSettings
from h3_spark.kernels.stored_linear import StoredLinear
from oracle import EQUAL_WIDTH, forward_args, rel_l2, text_tags

W4A8 = KernelSettings(linear="w4a8")
# The CPU tests run Triton's interpreter, so the layers take the fused activation quantizer.
SOURCE = "asym_w4a8_int8 codes on their int8 grid x per-token int8 activations (rotated, quantized and scaled by triton)"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a8_dit")
    out = {}
    for name, config, fmt in (("w4a8", EQUAL_WIDTH, "w4a8"), ("w4a8_sym", EQUAL_WIDTH, "w4a8_sym"),
                              ("w4a8_asym", EQUAL_WIDTH, "w4a8_asym"), ("bf16", EQUAL_WIDTH, "bf16"),
                              ("tiny", TINY, "w4a8")):
        out[name] = root / f"{name}.safetensors"
        make_dit_checkpoint(out[name], config, fmt, "comfy", seed=5)
    return out


def _velocities(model, config) -> tuple[torch.Tensor, ...]:
    lay = layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))
    with torch.no_grad():
        return tuple(model(**forward_args(config, lay, 3)))


def _count(model, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("name", ["w4a8", "w4a8_sym"])
def test_every_block_linear_runs_the_integer_gemm_within_budget(files, name):
    want = _velocities(load_dit(files[name], stored=True), EQUAL_WIDTH)
    model = load_dit(files[name], stored=True)
    report = apply_kernels(model, W4A8)
    layers = 6 * EQUAL_WIDTH.num_layers  # q, k, v cut from the fused layer; out, fc1, fc2
    assert _count(model, W4A8Linear) == layers and _count(model, StoredLinear) == 0
    lin = report["linear"]
    assert lin["format"] == "w4a8" and lin["exact"] is False and lin["sources"] == {SOURCE: layers}
    assert lin["why"].startswith("requested: a w4a8 file's layers as their int8 grid")
    assert report["exact"] is False and "linear" in report["approximate_paths"]
    for got, ref in zip(_velocities(model, EQUAL_WIDTH), want):
        assert 5e-5 < rel_l2(got, ref) < 5e-3


def test_layers_of_other_formats_keep_their_path_and_are_counted(files):
    """The tiny DiT's 24-wide inputs (q/k/v, fc1) stay dense in a w4a8 file; out and fc2 are w4a8."""
    want = _velocities(load_dit(files["tiny"], stored=True), TINY)
    model = load_dit(files["tiny"], stored=True)
    lin = apply_kernels(model, W4A8)["linear"]
    n = TINY.num_layers
    assert lin["sources"] == {SOURCE: 2 * n, "float32 dense weights": 4 * n}
    blk = model.transformer_blocks[0]
    assert isinstance(blk.attn.to_out[0], W4A8Linear) and isinstance(blk.ff.net[2], W4A8Linear)
    assert type(blk.attn.to_q) is torch.nn.Linear and type(blk.ff.net[0].proj) is torch.nn.Linear
    for got, ref in zip(_velocities(model, TINY), want):
        assert 5e-5 < rel_l2(got, ref) < 5e-3


def test_auto_never_chooses_it(files):
    model = load_dit(files["w4a8"], stored=True)
    lin = apply_kernels(model, KernelSettings())["linear"]
    assert lin["format"] == "bf16" and lin["exact"] is True and _count(model, W4A8Linear) == 0


def _refused(model, message: str, device=None) -> None:
    before = [type(m) for m in model.modules()]
    with pytest.raises(KernelUnavailable, match=message):
        apply_kernels(model, W4A8, device=device)
    assert [type(m) for m in model.modules()] == before  # refused before anything changed


def test_a_dit_without_w4a8_layers_is_refused(files):
    _refused(load_dit(files["bf16"], stored=True),
             r"^H3_LINEAR=w4a8 runs a w4a8 \(asym_w4a8_int8\) checkpoint's layers kept as stored, and this DiT has "
             r"none \(its block linears: float32 dense weights\); load a w4a8 file with its stored weights, or use "
             r"H3_LINEAR=bf16$")
    # The same w4a8 file dequantized at load holds no codes the integer GEMM could take.
    _refused(load_dit(files["w4a8"], stored=False),
             r"^H3_LINEAR=w4a8 runs .* \(its block linears: float32 dense weights\); load a w4a8 file with its stored "
             r"weights, or use H3_LINEAR=bf16$")


def test_an_asymmetric_layer_is_refused(files):
    _refused(load_dit(files["w4a8_asym"], stored=True),
             r"^H3_LINEAR=w4a8: transformer_blocks\.0\.attn\.to_q is an asymmetric w4a8 layer, whose correction per "
             r"group after the channel scale the integer GEMM cannot carry; use H3_LINEAR=bf16$")


def test_an_already_converted_dit_is_refused(files):
    model = load_dit(files["w4a8"], stored=True)
    apply_kernels(model, W4A8)
    with pytest.raises(KernelUnavailable, match=r"^the block linears were already converted \(W4A8Linear\); reload "
                                                r"the model to apply H3_LINEAR again$"):
        apply_kernels(model, W4A8)


def test_output_features_cublas_cannot_take_are_refused_for_a_cuda_run(files):
    """Checked from the model alone (no GPU needed): an fc2 of 32 outputs cut to 28 rows."""
    model = load_dit(files["w4a8"], stored=True)
    check_w4a8_linears(model, "cpu")  # the CPU's int8 GEMM takes any shape
    fc2 = model.transformer_blocks[1].ff.net[2]
    fc2.out_features = 28
    with pytest.raises(KernelUnavailable, match=r"^H3_LINEAR=w4a8: transformer_blocks\.1\.ff\.net\.2 has 28 output "
                                                r"features; cuBLASLt's int8 GEMM needs a multiple of 8$"):
        check_w4a8_linears(model, "cuda")


def test_a_device_without_the_int8_gemm_is_refused():
    with pytest.raises(KernelUnavailable, match=r"^H3_LINEAR=w4a8 needs the CPU or a CUDA GPU \(torch\._int_mm\); "
                                                r"this run is on meta \(no CUDA GPU\)$"):
        resolve_linear(W4A8, "meta", "bf16")
    assert resolve_linear(W4A8, "cpu", "bf16")[0] == "w4a8"


def test_an_unknown_linear_lists_w4a8():
    with pytest.raises(H3Error, match=r"^H3_LINEAR='w8a8' is not accepted; use one of: auto, bf16, fp8, nvfp4, "
                                      r"w4a8$"):
        KernelSettings.from_env({"H3_LINEAR": "w8a8"})
