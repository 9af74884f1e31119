"""The stored formats, each declared once (kernels/formats/), and the table every reader reads.

Claims: the readers' and StoredLinear's names, labels and allowed tensors are the table's; every format's
dequantization of a range of rows is bit for bit those rows of the whole layer (StoredLinear dequantizes fc1's
halves and the row chunks that way), on random weights quantized by the writers; each format refuses a layer it
cannot hold in one line naming the layer; the fast linears start only from codes their format declares for them
(an fp8_scaled layer gave its e4m3 codes to the NVFP4 quantizer as if they were values)."""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint import quant
from h3_spark.h3_model.checkpoint.quant import (QuantSpec, convrot_group_for, four_bit_conf, four_bit_tensors,
                                                quantize_fp8, quantize_int8_rows)
from h3_spark.kernels import formats
from h3_spark.kernels import nvfp4_codec as nvfp4
from h3_spark.kernels import stored_linear
from h3_spark.kernels.formats import FORMATS, LayerParams, layer_format
from h3_spark.kernels.stored_linear import StoredForm, StoredLinear


def _layer(label: str, n: int, k: int, seed: int = 0):
    """(format name, params, stored tensors as a file holds them) of a random weight, as the writers quantize it."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if label in ("fp8_scaled", "fp8_e5m2_scaled"):
        fp8 = torch.float8_e4m3fn if label == "fp8_scaled" else torch.float8_e5m2
        q, s = quantize_fp8(w, fp8)
        return str(fp8).removeprefix("torch."), LayerParams(), {"weight": q, "weight_scale": s}
    if label in ("int8", "int8_convrot"):
        group = convrot_group_for(k) if label == "int8_convrot" else None
        q, s = quantize_int8_rows(w, group)
        return "int8_tensorwise", LayerParams(group), {"weight": q, "weight_scale": s}
    if label in ("int4_convrot", "w4a8", "w4a8_sym", "w4a8_asym"):
        conf = four_bit_conf(label, k)
        stored = {key.rsplit(".", 1)[1]: t for key, t in four_bit_tensors(label, "x", w, conf).items()}
        stored.pop("comfy_quant")
        return conf["format"], LayerParams(conf["convrot_groupsize"], group_size=conf.get("group_size")), stored
    packed, scales, g = nvfp4.quantize(w)
    return "nvfp4", LayerParams(), {"weight": packed, "weight_scale": scales, "weight_scale_2": g}


LABELS = ("fp8_scaled", "fp8_e5m2_scaled", "int8", "int8_convrot", "nvfp4", "int4_convrot", "w4a8", "w4a8_sym",
          "w4a8_asym")


def test_the_table_is_what_the_readers_and_stored_linear_read():
    assert set(FORMATS) == {"float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "nvfp4", "gguf", "convrot_w4a4",
                            "asym_w4a8_int8"}
    assert stored_linear.LABELS == {name: fmt.label for name, fmt in FORMATS.items()}
    assert set(quant.FORMAT_TENSORS) == set(FORMATS) - {"gguf"}
    assert quant.FORMAT_TENSORS["nvfp4"] == {"weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale"}
    assert quant.FORMAT_TENSORS["int8_tensorwise"] == {"weight_scale"}
    assert quant.KNOWN_UNSUPPORTED == ("mxfp8",)
    assert quant.FORMAT_TENSORS["asym_w4a8_int8"] == {"weight_s_rel", "weight_s_channel", "weight_codebook",
                                                      "weight_correction"}
    assert all(fmt.parts[0] == "weight" for fmt in FORMATS.values())
    assert formats.serving("fp8") == ("float8_e4m3fn", "float8_e5m2", "nvfp4")
    assert formats.serving("nvfp4") == ("nvfp4",)
    assert [QuantSpec("int8_tensorwise", convrot=c).label for c in (False, True)] == ["int8", "int8_convrot"]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_dequantize_as_the_whole_layer(label, dtype):
    n, k = 48, 256
    name, params, tensors = _layer(label, n, k)
    fmt = FORMATS[name]
    assert fmt.label_for(params) == label.removesuffix("_sym").removesuffix("_asym")
    whole = fmt.dequantize(tensors, (n, k), dtype, params, "layer")
    held = fmt.held(tensors)
    for a, b in ((0, 16), (16, 33), (33, 48)):
        part = torch.empty(b - a, k, dtype=dtype)
        fmt.dequantize_rows(part, held, a, b, params)
        assert torch.equal(part, whole[a:b]), (a, b)


@pytest.mark.parametrize("label", LABELS)
def test_a_layer_the_format_cannot_hold_is_one_line_naming_it(label):
    name, params, tensors = _layer(label, 32, 64)
    fmt = FORMATS[name]
    wrong = {**tensors, "weight": torch.zeros(32, 64, dtype=torch.float16)}
    with pytest.raises(CheckpointError) as caught:
        fmt.validate(wrong, (32, 64), params, "blocks.0.attn.qkv_proj")
    message = str(caught.value)
    assert message.startswith("blocks.0.attn.qkv_proj: ") and "\n" not in message
    assert "weight" in message
    with pytest.raises(CheckpointError, match=r"^blocks\.0\.x: pre_quant_scale has 3 values for 64 inputs$"):
        fmt.validate({**tensors, "pre_quant_scale": torch.ones(3)}, (32, 64), params, "blocks.0.x")


def test_an_undeclared_format_is_refused_by_name():
    with pytest.raises(CheckpointError, match=r"^blocks\.0\.x: quantization format 'mxfp8' is not supported$"):
        layer_format("mxfp8", "blocks.0.x")


def test_gguf_blocks_are_checked_against_the_logical_shape():
    fmt, params = FORMATS["gguf"], LayerParams(gguf_type="Q8_0")
    assert fmt.label_for(params) == "gguf Q8_0"
    with pytest.raises(CheckpointError, match=r"^blk\.0: 4 bytes stored, but Q8_0 \[2, 64\] takes 136$"):
        fmt.check({"weight": torch.zeros(2, 2, dtype=torch.uint8)}, (2, 64), params, "blk.0")


@pytest.mark.parametrize("label", LABELS)
def test_fast_linears_start_only_from_codes_declared_for_them(label):
    name, params, tensors = _layer(label, 32, 64)
    fmt = FORMATS[name]
    layer = StoredLinear(StoredForm(name, (32, 64), fmt.held(tensors), params.convrot_group), torch.float32)
    for linear in formats.FAST_LINEARS:
        codes = layer.stored_tensors(linear)
        assert (codes is not None) == (linear in fmt.fast_linears), linear
        if codes is not None:
            assert codes["format"] == fmt.codes


def test_an_fp8_layer_becomes_an_nvfp4_linear_from_its_values():
    """H3_LINEAR=nvfp4 on an fp8_scaled StoredLinear: the NVFP4 weight is its dequantized weight quantized, the
    e4m3 codes are not read as values (within NVFP4's rounding of the weight: 0.15 relative L2 on random data)."""
    from h3_spark.kernels import dispatch

    name, params, tensors = _layer("fp8_scaled", 64, 128, seed=5)
    layer = StoredLinear(StoredForm(name, (64, 128), tensors), torch.float32)
    made = dispatch.make_linear("nvfp4", layer, None, False)
    assert made.source == "bf16 weight quantized to NVFP4"
    got = nvfp4.dequantize(made.weight, made.weight_scale, made.weight_scale_2, (64, 128), torch.float32)
    want = layer.dequantized()
    assert ((got - want).norm() / want.norm()).item() < 0.15
