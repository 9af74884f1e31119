"""comfy-kitchen's grouped W4A8 weights (asym_w4a8_int8, "w4a8"), one module (kernels/formats/asym_w4a8_int8.py),
in its three variants: codebook, symmetric, asymmetric (with its correction).

Oracle: comfy-kitchen 0.2.40's eager W4A8 code (backends/eager/w4a8_int8.py): its quantizer makes codes, its
unpacking, its int8 grid and its dequantization are compared. Budget: bit for bit (torch.equal) in fp32 and bf16,
on its quantizer's output and on random valid tensors (any code bytes; e4m3 or fp32 relative scales; any positive
channel scales; a random codebook; a random bf16 correction). Our writer's tensors (make-checkpoint's) dequantize
to the weight within 4-bit rounding: relative L2 under 0.15 (0.07-0.09 measured on N(0, 1) weights, as
comfy-kitchen's own quantizer's). Every layer
the format cannot hold is one line naming the layer, the tensor and what would be valid."""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint.quant import W4A8_VARIANTS, parse_layer_conf, quantize_w4a8
from h3_spark.kernels.formats import FORMATS, LayerParams
from h3_spark.kernels.formats.asym_w4a8_int8 import grid_rows, unpack_codes, variant

ck = pytest.importorskip("comfy_kitchen.backends.eager.w4a8_int8")
packed_codec = pytest.importorskip("comfy_kitchen.tensor.w4a8_packed")
FMT = FORMATS["asym_w4a8_int8"]
DTYPES = (torch.float32, torch.bfloat16)
# (N, K, group_size, convrot group)
SHAPES = [(48, 512, 16, 256), (40, 256, 32, 64), (16, 64, 8, 16), (8, 64, 4, 4)]


def _random_layer(n: int, k: int, g: int, kind: str, s_rel_dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Random valid stored tensors of a `kind` layer (any bytes, positive scales)."""
    tensors = {"weight": torch.randint(-128, 128, (n, k // 2), generator=gen, dtype=torch.int8),
               "weight_s_rel": (torch.rand(n, k // g, generator=gen) * 40 + 0.5).to(s_rel_dtype),
               "weight_s_channel": torch.rand(n, generator=gen) * 1e-3 + 1e-5}
    if kind == "codebook":
        tensors["weight_codebook"] = (torch.rand(16, generator=gen) * 2 - 1).sort().values
    if kind == "asymmetric":
        tensors["weight_correction"] = (torch.randn(k // g, n, generator=gen) * 0.01).to(torch.bfloat16)
    return tensors


def _theirs(tensors: dict, g: int, cg: int, dtype: torch.dtype) -> torch.Tensor:
    return ck.dequantize_w4a8_int8_weight(tensors["weight"], tensors["weight_s_rel"], tensors["weight_s_channel"],
                                          tensors.get("weight_codebook"), tensors.get("weight_correction"), g, cg,
                                          dtype)


def test_nibbles_unpack_as_comfy_kitchen_unpacks_them():
    every_byte = torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16)
    assert torch.equal(unpack_codes(every_byte).int(), packed_codec._unpack_codes(every_byte, 32, 4))


@pytest.mark.parametrize("n, k, g, cg", SHAPES)
@pytest.mark.parametrize("kind", W4A8_VARIANTS)
def test_dequantization_of_comfy_kitchens_quantizer_is_bit_for_bit(n, k, g, cg, kind):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k + g)) * 0.05
    q, s_rel, s_channel, correction, codebook = ck.quantize_w4a8_int8_weight(
        w, g, cg, symmetric=kind != "asymmetric", codebook=kind == "codebook")
    tensors = {"weight": q, "weight_s_rel": s_rel, "weight_s_channel": s_channel}
    tensors.update({name: t for name, t in (("weight_codebook", codebook), ("weight_correction", correction))
                    if t is not None})
    assert variant(tensors) == kind and FMT.label_for(LayerParams(cg, group_size=g)) == "w4a8"
    params = LayerParams(cg, group_size=g)
    assert torch.equal(grid_rows(FMT.held(tensors), 0, n, g),
                       ck._dequant_int4_grouped_to_int8(q, s_rel, codebook, g))
    for dtype in DTYPES:
        ours = FMT.dequantize(tensors, (n, k), dtype, params, "layer")
        assert ours.dtype == dtype and torch.equal(ours, _theirs(tensors, g, cg, dtype))


@pytest.mark.parametrize("n, k, g, cg", SHAPES)
@pytest.mark.parametrize("kind", W4A8_VARIANTS)
@pytest.mark.parametrize("s_rel_dtype", [torch.float8_e4m3fn, torch.float32])
def test_dequantization_of_random_valid_tensors_is_bit_for_bit(n, k, g, cg, kind, s_rel_dtype):
    gen = torch.Generator().manual_seed(n * k + g)
    tensors = _random_layer(n, k, g, kind, s_rel_dtype, gen)
    params = LayerParams(cg, group_size=g)
    for dtype in DTYPES:
        ours = FMT.dequantize(tensors, (n, k), dtype, params, "layer")
        assert torch.equal(ours, _theirs(tensors, g, cg, dtype))
        # Row ranges (StoredLinear's fc1 halves, the DiT's q/k/v) are those rows of the whole layer.
        part = torch.empty(n - 3, k, dtype=dtype)
        FMT.dequantize_rows(part, FMT.held(tensors), 3, n, params)
        assert torch.equal(part, ours[3:])


@pytest.mark.parametrize("kind", W4A8_VARIANTS)
def test_our_writer_holds_the_weight_in_each_variant(kind):
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(11))
    tensors = quantize_w4a8(w, 16, 256, kind, rows_per_chunk=24)
    assert variant(tensors) == kind
    assert tensors["weight_s_rel"].dtype == torch.float8_e4m3fn and tensors["weight"].dtype == torch.int8
    got = FMT.dequantize(tensors, (64, 512), torch.float32, LayerParams(256, group_size=16), "layer")
    assert torch.equal(got, _theirs(tensors, 16, 256, torch.float32))
    assert ((got - w).norm() / w.norm()).item() < 0.15
    # The grid uses its range: each row's largest decoded level is at (or, after e4m3 rounding, clamped to) 127.
    assert (grid_rows(FMT.held(tensors), 0, 64, 16).abs().amax(dim=1) >= 120).all()


def _valid(n=16, k=64, g=16):
    return _random_layer(n, k, g, "asymmetric", torch.float8_e4m3fn, torch.Generator().manual_seed(5))


@pytest.mark.parametrize("change, shape, params, message", [
    (lambda t: {**t, "weight": t["weight"][:, :-1]}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 weight must be int8 \[16, 32\] \(two 4-bit codes a byte\) for the model's \[16, 64\], "
     r"got torch.int8 \[16, 31\]$"),
    (lambda t: {**t, "weight": torch.zeros(16, 48, dtype=torch.int8)}, (16, 64), (16, 16),
     r"got torch.int8 \[16, 48\] \(3K/4 bytes a row: 6-bit W6A8 codes, not read\)$"),
    (lambda t: {**t, "weight": t["weight"].float()}, (16, 64), (16, 16), r"^layer: asym_w4a8_int8 weight must be int8"),
    (lambda t: t, (16, 64), (16, 32),
     r"^layer: asym_w4a8_int8 weight_s_rel is torch.float8_e4m3fn \[16, 4\]; group_size 32 over 64 input columns "
     r"takes float8_e4m3fn or float32 \[16, 2\]$"),
    (lambda t: {**t, "weight_s_rel": t["weight_s_rel"].to(torch.bfloat16)}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 weight_s_rel is torch.bfloat16 \[16, 4\]"),
    (lambda t: {k: v for k, v in t.items() if k != "weight_s_rel"}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 layer lacks weight_s_rel$"),
    (lambda t: {k: v for k, v in t.items() if k != "weight_s_channel"}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 layer lacks weight_s_channel$"),
    (lambda t: {**t, "weight_s_channel": t["weight_s_channel"][:15]}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 weight_s_channel is torch.float32 \[15\]; expected a float \[16\]$"),
    (lambda t: {**t, "weight_correction": t["weight_correction"].t()}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 weight_correction is torch.bfloat16 \[16, 4\]; expected a float \[4, 16\]$"),
    (lambda t: {**t, "weight_codebook": torch.linspace(-1, 1, 8)}, (16, 64), (16, 16),
     r"^layer: asym_w4a8_int8 weight_codebook is torch.float32 \[8\]; expected a float \[16\]$"),
    (lambda t: t, (16, 64), (16, 12),
     r"^layer: asym_w4a8_int8 group_size must be at least 4 and divide 16 or be a multiple of 16, got 12$"),
    (lambda t: t, (16, 64), (256, 16), r"^layer: ConvRot group size 256 does not divide the 64 input columns$"),
    (lambda t: {**t, "weight": torch.zeros(16, 12, dtype=torch.int8)}, (16, 24), (4, 4),
     r"^layer: asym_w4a8_int8 needs a multiple of 16 input columns, the model's weight has 24$"),
    (lambda t: {**t, "weight": torch.zeros(16, 24, dtype=torch.int8)}, (16, 48), (16, 32),
     r"^layer: asym_w4a8_int8 group_size 32 does not divide the 48 input columns$"),
])
def test_a_layer_it_cannot_hold_is_one_line(change, shape, params, message):
    with pytest.raises(CheckpointError, match=message):
        FMT.validate(change(_valid()), shape, LayerParams(params[0], group_size=params[1]), "layer")


def test_the_declaration_gives_the_group_size_and_the_rotation():
    spec = parse_layer_conf({"format": "asym_w4a8_int8", "group_size": 32, "convrot": True,
                             "convrot_groupsize": 64}, "x", "comfy_quant")
    assert spec.params == LayerParams(64, group_size=32) and spec.label == "w4a8"
    bare = parse_layer_conf({"format": "asym_w4a8_int8"}, "x", "metadata")  # comfy-kitchen's defaults
    assert bare.params == LayerParams(256, group_size=16) and bare.convrot
    with pytest.raises(CheckpointError, match=r"^x: asym_w4a8_int8 group_size must be an integer, got '16'$"):
        parse_layer_conf({"format": "asym_w4a8_int8", "group_size": "16"}, "x", "comfy_quant")
