"""FP8 / NVFP4 linears start from the codes a quantized checkpoint stores, not from the dequantized model.

Oracles: the stored tensors read with safetensors and cut by hand (fused QKV rows q | k | v, fc1 stored as
[gate; value]), and comfy-kitchen's eager NVFP4 dequantizer for the re-blocked scales. Budget: bit-exact
(the codes are copied, never recomputed). On the CPU with a pretend Hopper / Blackwell (capability patched,
as in test_kernels_nvfp4_dispatch); the conversions only, the GEMMs themselves are tested elsewhere.
"""

import shutil

import pytest
import torch
from safetensors import safe_open

from h3_spark.h3_model.checkpoint import StoredLinears, linear_format, load_dit, open_dit
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.engine.kernel_plan import apply_kernels
from h3_spark.kernels.dispatch import BLOCK_LINEARS
from h3_spark.kernels.linear_fp8 import Fp8Linear
from h3_spark.kernels.settings import KernelSettings
from checkpoints import made_files
from oracle import EQUAL_WIDTH
from test_kernels_nvfp4_dispatch import blackwell, pretend_gpu  # noqa: F401 - fixture

pytest.importorskip("triton")
ck = pytest.importorskip("comfy_kitchen")
from h3_spark.kernels.nvfp4 import Nvfp4Linear  # noqa: E402

C = EQUAL_WIDTH
INNER = C.num_attention_heads * C.attention_head_dim
PREFIX = ""  # make-checkpoint writes the unprefixed ComfyUI names
LINEARS = len(BLOCK_LINEARS) * C.num_layers


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return made_files(tmp_path_factory.mktemp("stored"), C, ("fp8_scaled", "nvfp4", "bf16"), 5)


@pytest.fixture
def hopper(monkeypatch):
    pretend_gpu(monkeypatch, (9, 0), "pretend H200 (sm_90)")


def fp8_settings() -> KernelSettings:
    return KernelSettings(attention="sdpa", linear="fp8", q_rms_rope_int8_fusion="off")


def stored_rows(path, block: int, name: str) -> torch.Tensor:
    """The rows a diffusers block linear holds, cut by hand from the stored (original-named) tensor, as bytes."""
    with safe_open(str(path), "pt") as f:
        def get(layer, suffix="weight"):
            return f.get_tensor(f"{PREFIX}blocks.{block}.{layer}.{suffix}")
        if name == "attn.to_out.0":
            return get("attn.out_proj").view(torch.uint8)
        if name.startswith("attn.to_"):
            fused = get("attn.qkv_proj")
            i = "qkv".index(name[-1])
            return fused[i * INNER:(i + 1) * INNER].view(torch.uint8)
        if name == "ff.net.0.proj":
            gate, value = get("mlp.fc1").view(torch.uint8).chunk(2)
            return torch.cat([value, gate])
        return get("mlp.fc2").view(torch.uint8)


def block_linears(model):
    for i, blk in enumerate(model.transformer_blocks):
        for name in BLOCK_LINEARS:
            yield i, name, blk.get_submodule(name)


def test_fp8_linears_hold_the_stored_e4m3_codes(files, hopper):
    model = load_dit(files["fp8_scaled"], dtype=torch.bfloat16)
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"fp8_scaled checkpoint codes, unchanged": LINEARS}
    assert report["checkpoint_codes"] == {"checkpoint": str(files["fp8_scaled"]), "layers_from_stored_codes": LINEARS,
                                          "layers_changed_since_load": 0}
    with safe_open(str(files["fp8_scaled"]), "pt") as f:
        for i, name, lin in block_linears(model):
            assert isinstance(lin, Fp8Linear)
            assert torch.equal(lin.weight.view(torch.uint8), stored_rows(files["fp8_scaled"], i, name)), name
            layer = {"attn.to_q": "attn.qkv_proj", "attn.to_k": "attn.qkv_proj", "attn.to_v": "attn.qkv_proj",
                     "attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2"}[name]
            scale = f.get_tensor(f"{PREFIX}blocks.{i}.{layer}.weight_scale").float()
            assert torch.equal(lin.weight_scale, scale.expand(1, lin.out_features)), name


def test_requantizing_the_loaded_bf16_weight_would_change_the_codes(files, hopper):
    # Why the stored codes matter: the loaded bf16 copy quantized per channel lands elsewhere on the grid.
    model = load_dit(files["fp8_scaled"], dtype=torch.bfloat16)
    del model.checkpoint_origin
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"bf16 weight quantized per output channel": LINEARS}
    assert "checkpoint_codes" not in report
    lin = model.transformer_blocks[0].attn.to_k
    assert not torch.equal(lin.weight.view(torch.uint8), stored_rows(files["fp8_scaled"], 0, "attn.to_k"))


def test_a_layer_changed_since_load_is_quantized_from_its_weight(files, hopper):
    model = load_dit(files["fp8_scaled"], dtype=torch.bfloat16)
    w = model.transformer_blocks[1].ff.net[2].weight
    with torch.no_grad():
        w.add_(0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)).to(w.dtype))
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"fp8_scaled checkpoint codes, unchanged": LINEARS - 1,
                                 "bf16 weight quantized per output channel": 1}
    codes = report["checkpoint_codes"]
    assert codes["layers_changed_since_load"] == 1
    assert codes["changed_examples"] == ["transformer_blocks.1.ff.net.2"]
    assert codes["changed_note"].startswith("quantized from the current weight")


def test_the_qkv_split_follows_the_layout_the_model_was_loaded_with(files, hopper):
    path = files["fp8_scaled"]
    model = load_dit(path, dtype=torch.bfloat16, qkv_layout="interleaved")
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["checkpoint_codes"]["layers_from_stored_codes"] == LINEARS
    # Cutting with the other layout gives other rows: the check against the loaded weight catches it.
    origin = model.checkpoint_origin
    wrong = load_dit(path, dtype=torch.bfloat16, qkv_layout="interleaved")
    source = StoredLinears(wrong, type(origin)(origin.path, origin.partition, "stacked", origin.formats), "fp8")
    try:
        assert source("transformer_blocks.0.attn.to_q") is None
        assert source("transformer_blocks.0.attn.to_out.0")["format"] == "fp8_scaled"
    finally:
        source.close()
    assert source.changed == ["transformer_blocks.0.attn.to_q"] and source.used == 1


def test_nvfp4_linears_hold_the_stored_codes_and_scales(files, blackwell):  # noqa: F811
    path = files["nvfp4"]
    assert linear_format(path) == "nvfp4"
    model = load_dit(path, dtype=torch.bfloat16)
    loaded = load_dit(path, dtype=torch.bfloat16)  # the same weights, kept in bf16
    report = apply_kernels(model, KernelSettings(attention="sdpa", q_rms_rope_int8_fusion="off"))["linear"]
    assert report["format"] == "nvfp4" and report["why"].startswith("auto: Blackwell GPU and an NVFP4 checkpoint")
    assert report["sources"] == {"NVFP4 checkpoint, used as stored": LINEARS}
    for i, name, lin in block_linears(model):
        assert isinstance(lin, Nvfp4Linear)
        # Codes: the stored rows, byte for byte (every part here is a multiple of 16 rows: no padding rows).
        assert torch.equal(lin.weight, stored_rows(path, i, name)), name
        # Scales, re-blocked for the part: comfy-kitchen dequantizes the part to the rows of the whole.
        part = ck.dequantize_nvfp4(lin.weight, lin.weight_scale_2, lin.weight_scale, torch.bfloat16)
        assert torch.equal(part[:lin.out_features], loaded.transformer_blocks[i].get_submodule(name).weight), name


def test_nvfp4_file_on_hopper_makes_fp8_from_the_exact_dequantization(files, hopper):
    model = load_dit(files["nvfp4"], dtype=torch.bfloat16)
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"NVFP4 checkpoint dequantized, requantized to e4m3 (pow2 scales)": LINEARS}


def test_unquantized_files_and_other_layers_give_no_codes(files):
    model = load_dit(files["bf16"], dtype=torch.bfloat16)
    assert model.checkpoint_origin.formats == () and model.checkpoint_origin.linear_format == "bf16"
    reader = open_dit(files["fp8_scaled"])
    try:
        assert reader.stored_linear("transformer_blocks.0.adaln_proj.linear") is None  # stored bf16
        assert reader.stored_linear("no.such.layer") is None
        layer = reader.layers["blocks.0.mlp.fc2"]
        layer.keys["pre_quant_scale"] = layer.keys["weight_scale"]  # AWQ: the codes encode W / s
        assert reader.stored_linear("transformer_blocks.0.ff.net.2") is None
    finally:
        reader.source.close()


def test_a_checkpoint_gone_since_load_is_reported_and_the_weights_are_used(files, hopper, tmp_path):
    path = tmp_path / "moved.safetensors"
    path.write_bytes(files["fp8_scaled"].read_bytes())
    model = load_dit(path, dtype=torch.bfloat16)
    path.unlink()
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"bf16 weight quantized per output channel": LINEARS}
    assert report["checkpoint_codes"]["layers_from_stored_codes"] == 0
    assert report["checkpoint_codes"]["unavailable"].startswith("the checkpoint cannot be read again:")
    assert str(path) in report["checkpoint_codes"]["unavailable"]


def test_a_file_replaced_since_load_stops_the_codes_not_the_conversion(files, hopper, tmp_path):
    from dataclasses import replace

    path = tmp_path / "replaced.safetensors"
    path.write_bytes(files["fp8_scaled"].read_bytes())
    model = load_dit(path, dtype=torch.bfloat16)
    make_dit_checkpoint(path, replace(C, ffn_dim=96), "fp8_scaled", "comfy", seed=5)  # same name, other model
    report = apply_kernels(model, fp8_settings())["linear"]
    # Block 0's attention is the same in both files (same seed, same shapes); its fc1 is not: from there on
    # every layer is quantized from the loaded weights, and the model is whole.
    assert report["sources"] == {"fp8_scaled checkpoint codes, unchanged": 4,
                                 "bf16 weight quantized per output channel": LINEARS - 4}
    assert report["checkpoint_codes"]["unavailable"].startswith(
        "the checkpoint no longer gives what was loaded from it (transformer_blocks.0.ff.net.0.proj: ")
    assert all(isinstance(lin, Fp8Linear) for _, _, lin in block_linears(model))


def test_codes_that_the_linears_would_not_use_are_not_read(files, blackwell):  # noqa: F811
    model = load_dit(files["fp8_scaled"], dtype=torch.bfloat16)
    report = apply_kernels(model, KernelSettings(attention="sdpa", linear="nvfp4", q_rms_rope_int8_fusion="off"))
    assert report["linear"]["sources"] == {"bf16 weight quantized to NVFP4": LINEARS}
    assert "checkpoint_codes" not in report["linear"]


def test_a_model_loaded_in_fp32_and_cast_keeps_its_codes(files, hopper):
    model = load_dit(files["fp8_scaled"], dtype=torch.float32).to(torch.bfloat16)
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["checkpoint_codes"]["layers_from_stored_codes"] == LINEARS


def test_stored_linears_serve_only_low_bit_linears(files):
    model = load_dit(files["fp8_scaled"], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stored codes serve the fp8 and nvfp4 linears, not 'bf16'"):
        StoredLinears(model, model.checkpoint_origin, "bf16")


def test_an_e5m2_file_gives_its_codes_to_fp8_linears_through_an_exact_dequantization(files, hopper, tmp_path):
    """float8_e5m2 layers (what ComfyUI's fp8_e5m2 files hold): the stored codes are cut as e5m2, and the e4m3
    linear is made from their exact fp32 values, not from the bf16 copy the model holds."""
    import json

    from safetensors.torch import save_file

    from h3_spark.h3_model.checkpoint.quant import encode_marker

    path = tmp_path / "ew-e5m2.safetensors"
    tensors, exact = {}, {}
    with safe_open(str(files["fp8_scaled"]), "pt") as f:
        meta = f.metadata()
        for key in f.keys():
            tensors[key] = f.get_tensor(key)
    for key in [k for k in tensors if k.endswith(".comfy_quant")]:
        layer = key[: -len(".comfy_quant")]
        w = tensors[f"{layer}.weight"].float() * tensors[f"{layer}.weight_scale"].float()
        scale = (w.abs().amax() / torch.finfo(torch.float8_e5m2).max).reshape(())
        tensors[f"{layer}.weight"] = (w / scale).to(torch.float8_e5m2)
        tensors[f"{layer}.weight_scale"] = scale
        tensors[key] = encode_marker({**json.loads(bytes(tensors[key].tolist())), "format": "float8_e5m2"})
        exact[layer] = tensors[f"{layer}.weight"].float() * scale
    save_file(tensors, str(path), metadata=meta)

    model = load_dit(path, dtype=torch.bfloat16)
    report = apply_kernels(model, fp8_settings())["linear"]
    assert report["sources"] == {"fp8_scaled torch.float8_e5m2 checkpoint requantized to e4m3": LINEARS}
    assert report["checkpoint_codes"]["layers_from_stored_codes"] == LINEARS
    lin = model.transformer_blocks[1].ff.net[0].proj
    gate, value = exact["blocks.1.mlp.fc1"].chunk(2)
    want = torch.cat([value, gate])
    got = lin.weight.float() * lin.weight_scale.reshape(-1, 1)
    # The cut rows (fc1's halves swapped back) within one e4m3 rounding of the exact e5m2 values (half a step:
    # 2^-4 relative, or 2^-10 of the channel scale below e4m3's normal range).
    assert ((got - want).abs() <= want.abs() * 2.0 ** -4 + lin.weight_scale.reshape(-1, 1) * 2.0 ** -10).all()




def test_a_folder_with_both_partitions_gives_each_partition_its_own_codes(tmp_path, hopper):
    # A folder a user assembled: fp8_scaled files (ComfyUI names) under transformer/ and transformer_ref/.
    # The parent names no single partition, so the codes must be re-read from the partition the model came from.
    make_dit_checkpoint(tmp_path / "config", C, "bf16", "diffusers", seed=1)
    files = {}
    for partition, sub, seed in (("t2va", "transformer", 5), ("ref2va", "transformer_ref", 6)):
        (tmp_path / sub).mkdir()
        shutil.copy(tmp_path / "config" / "config.json", tmp_path / sub / "config.json")
        files[partition] = tmp_path / sub / "diffusion_pytorch_model.safetensors"
        make_dit_checkpoint(files[partition], C, "fp8_scaled", "comfy", seed=seed)
    for partition, path in files.items():
        model = load_dit(tmp_path, partition=partition, dtype=torch.bfloat16)
        report = apply_kernels(model, fp8_settings())["linear"]
        assert report["checkpoint_codes"]["layers_from_stored_codes"] == LINEARS, report
        for i, name, lin in block_linears(model):
            assert torch.equal(lin.weight.view(torch.uint8), stored_rows(path, i, name)), (partition, name)
