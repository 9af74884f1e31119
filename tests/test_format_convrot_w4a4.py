"""ComfyUI core's convrot_w4a4 ("int4_convrot") weights, one module (kernels/formats/convrot_w4a4.py).

Oracle: comfy-kitchen 0.2.40's eager ConvRot W4A4 code: its quantizer makes codes, its nibble unpacking and its
dequantization are compared. Budget: bit for bit (torch.equal) in fp32 and bf16, on its quantizer's output and on
random valid tensors (any bytes, any positive fp32 row scales). Ours follows its order of operations, so beside a
float64 oracle of the documented math (codes @ H per group x row scale) both are within fp32's rounding of a
K = group GEMM: 16 fp32 ulps of each row's largest weight (8 x its scale). Our writer's codes dequantize to the
weight within int4's rounding (relative L2 < 0.15). Files in the format are read through the real loaders in
tests/test_four_bit_files.py."""

from __future__ import annotations

import pytest
import torch

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint.quant import hadamard, quantize_int4_convrot
from h3_spark.kernels.formats import FORMATS, LayerParams
from h3_spark.kernels.formats.convrot_w4a4 import unpack_codes

ck = pytest.importorskip("comfy_kitchen.backends.eager.convrot_w4a4")
svdquant = pytest.importorskip("comfy_kitchen.backends.eager.svdquant")
FMT = FORMATS["convrot_w4a4"]
DTYPES = (torch.float32, torch.bfloat16)


def _exact(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float64: the codes' rotation undone, times the row scale (exact for 4-bit codes, sums below 2^24)."""
    codes = unpack_codes(packed).double()
    n, k = codes.shape
    rows = (codes.reshape(n, k // group, group) @ hadamard(group).double()).reshape(n, k)
    return rows * scale.double().reshape(-1, 1)


def test_nibbles_unpack_as_comfy_kitchen_unpacks_them():
    every_byte = torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16)
    assert torch.equal(unpack_codes(every_byte), svdquant._unpack_int4_row_major(every_byte))


@pytest.mark.parametrize("shape, group", [((48, 512), 256), ((40, 256), 64), ((16, 128), 16), ((8, 24), 4)])
@pytest.mark.parametrize("source", ["comfy-kitchen", "random"])
def test_dequantization_is_comfy_kitchens_bit_for_bit(shape, group, source):
    gen = torch.Generator().manual_seed(shape[1] + len(source))
    if source == "random" or shape[1] % 64:  # its quantizer wants K a multiple of its MMA group (64)
        packed = torch.randint(-128, 128, (shape[0], shape[1] // 2), generator=gen, dtype=torch.int8)
        scale = torch.rand(shape[0], generator=gen) * 0.02 + 1e-4
    else:
        packed, scale = ck.quantize_convrot_w4a4_weight(torch.randn(shape, generator=gen) * 0.05, group)
    assert FMT.label_for(LayerParams(group)) == "int4_convrot"
    exact = _exact(packed, scale, group)
    bound = 16 * 2.0 ** -23 * scale.double().reshape(-1, 1) * 8
    for dtype in DTYPES:
        ours = FMT.dequantize({"weight": packed, "weight_scale": scale}, shape, dtype, LayerParams(group), "layer")
        theirs = ck.dequantize_convrot_w4a4_weight(packed, scale, group, output_dtype=dtype)
        assert ours.dtype == dtype and torch.equal(ours, theirs)
        if dtype == torch.float32:
            assert ((ours.double() - exact).abs() <= bound).all()


def test_our_writer_packs_as_comfy_kitchen_and_holds_the_weight():
    """quantize_int4_convrot (make-checkpoint's) gives comfy-kitchen's codes and scales for the same weight (K a
    multiple of 64, where its quantizer runs), and the codes dequantize to the weight within int4's rounding."""
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    packed, scale = quantize_int4_convrot(w, 256)
    want_packed, want_scale = ck.quantize_convrot_w4a4_weight(w, 256)
    assert torch.equal(scale, want_scale)
    assert (unpack_codes(packed).int() - unpack_codes(want_packed).int()).abs().max() <= 1
    assert (packed != want_packed).float().mean() < 1e-3  # only ties of w / scale, rounded apart
    got = FMT.dequantize({"weight": packed, "weight_scale": scale}, (48, 512), torch.float32, LayerParams(256), "l")
    assert ((got - w).norm() / w.norm()).item() < 0.15


@pytest.mark.parametrize("tensors, message", [
    (lambda p, s: {"weight": p[:, :-1], "weight_scale": s},
     r"^layer: convrot_w4a4 weight must be int8 \[16, 64\] \(two 4-bit codes a byte\) for the model's \[16, 128\], "
     r"got torch.int8 \[16, 63\]$"),
    (lambda p, s: {"weight": p.float(), "weight_scale": s}, r"^layer: convrot_w4a4 weight must be int8"),
    (lambda p, s: {"weight": p}, r"^layer: convrot_w4a4 layer lacks weight_scale$"),
    (lambda p, s: {"weight": p, "weight_scale": s[:3]},
     r"^layer: convrot_w4a4 weight_scale has 3 values; expected one per row \(16\)$"),
])
def test_a_layer_it_cannot_hold_is_one_line(tensors, message):
    packed, scale = ck.quantize_convrot_w4a4_weight(torch.randn(16, 128), 64)
    with pytest.raises(CheckpointError, match=message):
        FMT.validate(tensors(packed, scale), (16, 128), LayerParams(64), "layer")
    with pytest.raises(CheckpointError, match=r"^layer: ConvRot group size 256 does not divide the 128 input columns$"):
        FMT.validate({"weight": packed, "weight_scale": scale}, (16, 128), LayerParams(256), "layer")
