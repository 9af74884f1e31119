"""Quantized layers against comfy-kitchen, the library ComfyUI itself dequantizes with.

Oracle: comfy-kitchen 0.2.40 (test extra), through the same QuantizedTensor path ComfyUI takes
(`QuantizedTensor(qdata, layout, Params(..., orig_dtype=compute dtype)).dequantize()`), on its
eager CPU backend. Budget: bit-exact, in fp32 and bf16, for every quantized layer of the tiny
checkpoints make-checkpoint writes, and for our quantizers against comfy-kitchen's on odd shapes.
One exception, on purpose: int8_convrot. comfy-kitchen undoes the rotation as a dense fp32 product of the
scaled codes, rounding at every step; we undo it on the integer codes, exactly, and round once
(kernels/stored_codec.py). Ours equals the correctly rounded fp32 value (float64 oracle) bit for bit; against
comfy-kitchen (whose 256-term fp32 sums round as they go) it stays within 16 fp32 ulps of the row's largest
weight (128 x its scale), and in bf16 fewer than 0.5 % of the weights
differ, each by one bf16 ulp (or, near zero, by that fp32 bound).
"""

import re

import pytest
import torch
from comfy_kitchen.backends.eager import quantization as ck_eager
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout, TensorCoreNVFP4Layout, TensorWiseINT8Layout
from safetensors import safe_open

from h3_spark.h3_model.checkpoint import keymap, load_dit
from h3_spark.kernels import nvfp4_codec as nvfp4
from h3_spark.h3_model.checkpoint.quant import (QuantSpec, decode_marker, dequantize, hadamard,
                                                  quantize_fp8, quantize_int8_rows, rotate_groups)
from h3_spark.h3_model.dit.config import TINY
from checkpoints import made_files

SHAPES = [(96, 24), (24, 32), (128, 64), (300, 80), (21, 17)]


def _ck_dequantize(conf: dict, tensors: dict, shape, dtype) -> torch.Tensor:
    """Dequantize one stored layer exactly as ComfyUI's mixed-precision Linear does."""
    fmt = conf["format"]
    if fmt == "nvfp4":
        params = TensorCoreNVFP4Layout.Params(scale=tensors["weight_scale_2"], orig_dtype=dtype, orig_shape=tuple(shape),
                                              block_scale=tensors["weight_scale"].view(torch.float8_e4m3fn))
        return QuantizedTensor(tensors["weight"], "TensorCoreNVFP4Layout", params).dequantize()
    if fmt == "float8_e4m3fn":
        params = TensorCoreFP8Layout.Params(scale=tensors["weight_scale"], orig_dtype=dtype, orig_shape=tuple(shape))
        return QuantizedTensor(tensors["weight"], "TensorCoreFP8Layout", params).dequantize()
    if fmt == "int8_tensorwise":
        params = TensorWiseINT8Layout.Params(scale=tensors["weight_scale"], orig_dtype=dtype, orig_shape=tuple(shape),
                                             convrot=conf.get("convrot", False),
                                             convrot_groupsize=conf.get("convrot_groupsize", 256))
        return QuantizedTensor(tensors["weight"], "TensorWiseINT8Layout", params).dequantize()
    raise AssertionError(fmt)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return made_files(tmp_path_factory.mktemp("quant"), TINY, ("fp8_scaled", "nvfp4", "int8_convrot"), 3,
                      quantize_refiner=True)


@pytest.mark.parametrize("fmt", ["fp8_scaled", "nvfp4", "int8_convrot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loaded_weights_equal_comfy_kitchen_dequantization(files, fmt, dtype):
    model = load_dit(files[fmt], dtype=dtype)
    params = dict(model.named_parameters())
    c = TINY
    checked = 0
    with safe_open(str(files[fmt]), "pt") as f:
        keys = set(f.keys())
        for marker in sorted(k for k in keys if k.endswith(".comfy_quant")):
            layer = marker[: -len(".comfy_quant")]
            conf = decode_marker(f.get_tensor(marker), layer)
            stored = {s: f.get_tensor(f"{layer}.{s}") for s in ("weight", "weight_scale", "weight_scale_2")
                      if f"{layer}.{s}" in keys}
            target = keymap.original_layer_to_diffusers(layer)
            if target.endswith("to_qkv"):
                base = target[: -len("to_qkv")]
                ours = keymap.fuse_qkv(*(params[f"{base}{p}.weight"] for p in ("to_q", "to_k", "to_v")),
                                       c.num_attention_heads, c.attention_head_dim, "stacked")
            elif target.endswith("ff.net.0.proj"):
                ours = keymap.swap_halves(params[f"{target}.weight"])
            else:
                ours = params[f"{target}.weight"]
            expected = _ck_dequantize(conf, stored, ours.shape, dtype)
            assert expected.dtype == ours.dtype == dtype
            if conf.get("convrot"):
                _check_convrot(ours, expected, stored, conf["convrot_groupsize"], layer)
            else:
                assert torch.equal(ours, expected), layer
            checked += 1
    assert checked == 4 * (c.num_layers + c.num_refiner_layers)


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_quantizer_and_dequantizer_match_comfy_kitchen(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * 0.05
    w[1] = 0.0  # an all-zero row: zero blocks must give zero codes, not NaN
    packed, scales, g = nvfp4.quantize(w)
    padded = nvfp4.roundup(shape[0], 16), nvfp4.roundup(shape[1], 16)
    ck_packed, ck_scales = ck_eager.quantize_nvfp4(w, g, pad_16x=padded != tuple(shape))
    assert g.item() == (w.abs().amax() / (448 * 6)).item()
    assert torch.equal(packed, ck_packed)
    assert torch.equal(scales.view(torch.uint8), ck_scales.view(torch.uint8))
    assert tuple(packed.shape) == nvfp4.packed_shape(*shape) and tuple(scales.shape) == nvfp4.scale_shape(*shape)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours = nvfp4.dequantize(packed, scales, g, shape, dtype)
        theirs = ck_eager.dequantize_nvfp4(ck_packed, g, ck_scales, dtype)[: shape[0], : shape[1]]
        assert torch.equal(ours, theirs)


def test_nvfp4_layout_facts():
    # Even element in the high nibble: codes (1, 2) pack to 0x12.
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert nvfp4.pack_codes(codes).tolist() == [[0x12, 0xF8]]
    assert torch.equal(nvfp4.unpack_codes(nvfp4.pack_codes(codes)), codes)
    # Blocked layout: scale (r, c) sits at tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4.
    rows, cols = 256, 8
    plain = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    flat = nvfp4.swizzle_scales(plain).reshape(-1)
    for r, c in [(0, 0), (1, 0), (33, 2), (127, 3), (128, 0), (200, 5), (255, 7)]:
        tile = (r // 128) * (cols // 4) + c // 4
        assert flat[tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4] == plain[r, c]
    assert torch.equal(nvfp4.unswizzle_scales(nvfp4.swizzle_scales(plain), rows, cols), plain)
    # E2M1 rounding: nearest, ties to the even code.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, 0.26])
    values = nvfp4.e2m1_values(torch.float32)[nvfp4.round_to_e2m1(x).long()]
    assert values.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.5]


def _check_convrot(ours, ck, stored, group, layer):
    """Ours: the correctly rounded value of codes @ H x scale (a float64 oracle), then the dtype's rounding;
    comfy-kitchen's: within 16 fp32 ulps of each row's largest weight, or one bf16 ulp on under 0.5 % of the weights."""
    codes, scale = stored["weight"].double(), stored["weight_scale"].double().reshape(-1, 1)
    n, k = codes.shape
    exact = (codes.reshape(n, k // group, group) @ hadamard(group).double()).reshape(n, k) * scale
    assert torch.equal(ours, exact.float().to(ours.dtype)), layer
    if ours.dtype == torch.float32:
        assert ((ours.double() - ck.double()).abs() <= 16 * 2.0 ** -23 * scale * 128).all(), layer
    else:
        differ = ours != ck
        assert differ.float().mean() < 5e-3, layer
        ulp = 2.0 ** (torch.floor(torch.log2(ck.float().abs().clamp_min(1e-30))) - 7)
        # Near zero the fp32 sums' own error (relative to the row's scale) decides, not the bf16 ulp.
        bound = torch.maximum(ulp * 1.001, (16 * 2.0 ** -23 * scale * 128).float().expand_as(ulp))
        assert ((ours.float() - ck.float()).abs()[differ] <= bound[differ]).all(), layer


@pytest.mark.parametrize("shape,group", [((96, 24), 4), ((24, 32), 16), ((24, 64), 64), ((40, 512), 256)])
def test_int8_convrot_matches_comfy_kitchen(shape, group):
    gen = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=gen) * 0.05
    q, s = quantize_int8_rows(w, group)
    ck_q, ck_s = ck_eager.quantize_int8_convrot_weight(w, group)
    assert torch.equal(q, ck_q) and torch.equal(s, ck_s) and s.shape == (shape[0], 1)
    spec = QuantSpec("int8_tensorwise", convrot=True, convrot_groupsize=group)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize(spec, {"weight": q, "weight_scale": s}, shape, dtype, "layer")
        _check_convrot(ours, _ck_dequantize({"format": "int8_tensorwise", "convrot": True,
                                             "convrot_groupsize": group}, {"weight": q, "weight_scale": s},
                                            shape, dtype), {"weight": q, "weight_scale": s}, group, "layer")
    # The stored weight is the rotated one: un-rotating the dequantized rows recovers W closely.
    rotated = q.float() * s
    assert torch.allclose(rotate_groups(rotated, group), dequantize(spec, {"weight": q, "weight_scale": s}, shape,
                                                                      torch.float32, "layer"), atol=1e-6)
    assert ((rotate_groups(rotated, group) - w).norm() / w.norm()) < 1e-2


def test_hadamard_is_comfy_kitchens_and_orthogonal():
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    for size in (4, 16, 64, 256):
        h = hadamard(size)
        assert torch.equal(h, _build_hadamard(size, dtype=torch.float32))
        assert torch.allclose(h @ h.T, torch.eye(size), atol=1e-6) and torch.equal(h, h.T)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_fp8_matches_comfy_kitchen(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.05
    q, s = quantize_fp8(w)
    ck_q = ck_eager.quantize_per_tensor_fp8(w, s)
    assert torch.equal(q.view(torch.uint8), ck_q.view(torch.uint8))
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize(QuantSpec("float8_e4m3fn"), {"weight": q, "weight_scale": s}, shape, dtype, "layer")
        assert torch.equal(ours, _ck_dequantize({"format": "float8_e4m3fn"}, {"weight": q, "weight_scale": s},
                                                shape, dtype))


def test_nvfp4_awq_pre_quant_scale_is_folded_and_input_scale_ignored(files, tmp_path):
    """AWQ layers multiply the input by pre_quant_scale; x (W diag(s))^T is the same product, so the
    loaded weight is the dequantized weight times s per input column (computed in fp32)."""
    from safetensors.torch import save_file

    with safe_open(str(files["nvfp4"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    layer = "blocks.1.mlp.fc2"
    s = torch.rand(TINY.ffn_dim, generator=torch.Generator().manual_seed(5)) + 0.5
    tensors[f"{layer}.pre_quant_scale"] = s
    tensors[f"{layer}.input_scale"] = torch.tensor(0.01)
    save_file(tensors, tmp_path / "awq.safetensors", metadata=meta)
    loaded = load_dit(tmp_path / "awq.safetensors").transformer_blocks[1].ff.net[2].weight
    stored = {k: tensors[f"{layer}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
    expected = _ck_dequantize({"format": "nvfp4"}, stored, loaded.shape, torch.float32) * s[None, :]
    assert torch.equal(loaded, expected)


def _nvfp4_variants(files, tmp_path) -> dict:
    """Copies of the NVFP4 file with blocks.0.mlp.fc2 (logical 24x64) stored wrongly sized."""
    from safetensors.torch import save_file

    with safe_open(str(files["nvfp4"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    layer = "blocks.0.mlp.fc2"
    packed, scales, g = nvfp4.quantize(torch.randn(24, 48, generator=torch.Generator().manual_seed(9)))
    variants = {
        "wrong_k": {f"{layer}.weight": packed, f"{layer}.weight_scale": scales, f"{layer}.weight_scale_2": g},
        "short_scales": {f"{layer}.weight_scale": tensors[f"{layer}.weight_scale"].reshape(-1)[:-4].contiguous()},
        "no_global": {f"{layer}.weight_scale_2": None},
    }
    out = {}
    for name, change in variants.items():
        broken = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        out[name] = tmp_path / f"{name}.safetensors"
        save_file(broken, out[name], metadata=meta)
    return out


NVFP4_MISFITS = {
    "wrong_k": r"NVFP4 weight is \[32, 24\], a logical 24x64 weight packs to \[32, 32\]",
    "short_scales": r"NVFP4 block scales hold 508 values, a logical 24x64 weight needs 512 "
                    r"\(\[128, 4\] in the 128x4 blocked layout\)",
    "no_global": r"NVFP4 layer lacks weight_scale_2",
}


def test_nvfp4_packed_sizes_are_checked_before_loading(files, tmp_path):
    from h3_spark.h3_model.checkpoint import open_dit
    from h3_spark.errors import CheckpointError

    for name, path in _nvfp4_variants(files, tmp_path).items():
        reader = open_dit(path)
        assert list(reader.nvfp4_mismatches()) == ["blocks.0.mlp.fc2"], name
        with pytest.raises(CheckpointError, match=rf"{name}\.safetensors: 1 NVFP4 layers do not fit the model: "
                                                  rf"blocks\.0\.mlp\.fc2: {NVFP4_MISFITS[name]}$"):
            reader.check()
    assert open_dit(files["nvfp4"]).nvfp4_mismatches() == {}


def test_nvfp4_dequantization_errors_name_the_layer_and_file(files, tmp_path):
    from h3_spark.h3_model.checkpoint import open_dit
    from h3_spark.errors import CheckpointError

    path = _nvfp4_variants(files, tmp_path)["wrong_k"]
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: blocks\.0\.mlp\.fc2: NVFP4 weight is "
                                              r"\[32, 24\], a logical 24x64 weight packs to \[32, 32\]$"):
        list(open_dit(path).tensors())  # past check(), as a reader used without it would be
    packed, scales, g = nvfp4.quantize(torch.randn(24, 64, generator=torch.Generator().manual_seed(4)))
    with pytest.raises(CheckpointError, match=r"^some\.layer: NVFP4 block scales hold 508 values"):
        dequantize(QuantSpec("nvfp4"), {"weight": packed, "weight_scale": scales.reshape(-1)[:-4],
                                        "weight_scale_2": g}, (24, 64), torch.float32, "some.layer")
