"""ComfyUI core's convrot_w4a4 ("int4_convrot") weights, one module (kernels/formats/convrot_w4a4.py).

Oracles: comfy-kitchen's eager ConvRot W4A4 code (its quantizer makes the codes; its nibble unpacking and its
dequantization are compared), and a float64 oracle of the documented math (codes @ H per group x row scale).
Budget, as for int8_convrot and for the same reason (tests/test_checkpoint_formats.py): ours is the correctly
rounded value of the exact product, bit for bit, in fp32 and bf16; comfy-kitchen rounds its fp32 products and
sums as it goes, so against it: within 16 fp32 ulps of each row's largest weight (8 x its scale), and in bf16
under 5 % of the weights differ (0.8 to 2.1 % measured), each by one bf16 ulp or, near zero, by that fp32 bound. A tiny
DiT file in the format loads through the DiT reader, dense and kept as stored, to the same bits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.checkpoint.quant import convrot_group_for, encode_marker, hadamard, rotate_groups
from h3_spark.h3_model.dit.config import TINY
from h3_spark.kernels.formats import FORMATS, LayerParams
from h3_spark.kernels.formats.convrot_w4a4 import unpack_codes
from h3_spark.kernels.stored_linear import StoredLinear

ck = pytest.importorskip("comfy_kitchen.backends.eager.convrot_w4a4")
svdquant = pytest.importorskip("comfy_kitchen.backends.eager.svdquant")
FMT = FORMATS["convrot_w4a4"]


def _exact(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float64: the codes' rotation undone, times the row scale (exact for 4-bit codes, sums below 2^24)."""
    codes = unpack_codes(packed).double()
    n, k = codes.shape
    rows = (codes.reshape(n, k // group, group) @ hadamard(group).double()).reshape(n, k)
    return rows * scale.double().reshape(-1, 1)


def _pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented quantizer (rotate per group, per-row symmetric int4 in [-7, 7], low nibble = even column),
    for shapes comfy-kitchen's quantizer refuses (K not a multiple of its MMA group of 64)."""
    rotated = rotate_groups(w.float(), group)
    scale = (rotated.abs().amax(dim=1, keepdim=True) / 7).clamp(min=1e-10)
    codes = (rotated / scale).round().clamp(-7, 7).to(torch.int16)
    packed = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    return packed.to(torch.uint8).view(torch.int8), scale.reshape(-1)


def test_nibbles_unpack_as_comfy_kitchen_unpacks_them():
    every_byte = torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16)
    assert torch.equal(unpack_codes(every_byte), svdquant._unpack_int4_row_major(every_byte))


@pytest.mark.parametrize("shape, group", [((48, 512), 256), ((40, 256), 64), ((16, 128), 16)])
def test_dequantization_is_exact_and_within_comfy_kitchen_rounding(shape, group):
    gen = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=gen) * 0.05
    packed, scale = ck.quantize_convrot_w4a4_weight(w, group)
    assert FMT.label_for(LayerParams(group)) == "int4_convrot"
    exact = _exact(packed, scale, group)
    bound = 16 * 2.0 ** -23 * scale.double().reshape(-1, 1) * 8
    for dtype in (torch.float32, torch.bfloat16):
        ours = FMT.dequantize({"weight": packed, "weight_scale": scale}, shape, dtype, LayerParams(group), "layer")
        assert torch.equal(ours, exact.float().to(dtype))
        theirs = ck.dequantize_convrot_w4a4_weight(packed, scale, group, output_dtype=dtype)
        error = (ours.double() - theirs.double()).abs()
        if dtype == torch.float32:
            assert (error <= bound).all()
        else:
            differ = ours != theirs
            assert differ.float().mean() < 5e-2
            ulp = 2.0 ** (torch.floor(torch.log2(theirs.double().abs().clamp_min(1e-30))) - 7)
            assert (error[differ] <= torch.maximum(ulp * 1.001, bound.expand_as(ulp))[differ]).all()
    # The dequantized weight is W within int4's rounding (rotated back: rotating it again gives the stored rows).
    assert ((exact.float() - w).norm() / w.norm()).item() < 0.15


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


def test_a_dit_file_loads_dense_and_kept_as_stored(tmp_path):
    """Every block linear of a tiny ComfyUI DiT in convrot_w4a4 (declared by .comfy_quant with the group size
    alone, as ComfyUI writes it): the reader loads the exact dequantized weights (the same file with those values
    as plain fp32 tensors is the reference), and kept as stored, each StoredLinear dequantizes to the same bits."""
    made = tmp_path / "bf16.safetensors"
    make_dit_checkpoint(made, TINY, "bf16", "comfy", seed=7)
    with safe_open(str(made), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    quantized, reference = dict(tensors), dict(tensors)
    for key, w in tensors.items():
        if ".blocks." not in f".{key}" or not key.endswith(".weight") or w.ndim != 2 or "norm" in key:
            continue
        group = convrot_group_for(w.shape[1])
        packed, scale = _pack(w, group)
        layer = key[: -len(".weight")]
        quantized.update({key: packed, f"{layer}.weight_scale": scale,
                          f"{layer}.comfy_quant": encode_marker({"format": "convrot_w4a4", "convrot_groupsize": group})})
        reference[key] = _exact(packed, scale, group).float()
    assert len(quantized) > len(tensors)
    save_file(quantized, tmp_path / "int4.safetensors", metadata=meta)
    save_file(reference, tmp_path / "exact.safetensors", metadata=meta)
    reader = open_dit(tmp_path / "int4.safetensors")
    assert {s.label for s in reader.quantized_layers().values()} == {"int4_convrot"}
    reader.source.close()
    dense = load_dit(tmp_path / "int4.safetensors")
    want = load_dit(tmp_path / "exact.safetensors")
    for (name, a), (_, b) in zip(dense.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name
    kept = load_dit(tmp_path / "int4.safetensors", stored=True)
    stored = {n: m for n, m in kept.named_modules() if isinstance(m, StoredLinear)}
    assert stored and {m.label for m in stored.values()} == {"int4_convrot"}
    for name, module in stored.items():
        assert torch.equal(module.dequantized(), dense.get_submodule(name).weight), name
