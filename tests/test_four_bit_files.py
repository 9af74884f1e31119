"""The 4-bit ConvRot formats in files, through the real loaders: make-checkpoint's tiny DiT and text encoder in
int4_convrot (convrot_w4a4) and w4a8 / w4a8_sym / w4a8_asym (asym_w4a8_int8's codebook, symmetric and
asymmetric variants), inspected, loaded dense and kept as stored.

Oracles: comfy-kitchen 0.2.40's eager dequantization of the file's own tensors (the dense load must hold exactly
its fp32 values), and the dense load itself for the stored one. Budgets: bit for bit (torch.equal) everywhere:
weights, DiT velocities and text-encoder hidden states, in fp32 and bf16. The DiT is the equal-width one (every
block linear's input width a multiple of 16, so all four quantize and q/k/v are cut from one fused layer; the
tiny DiT's 24-wide inputs stay bf16 in w4a8, checked too). Declarations that are not JSON, name an unknown
format or disagree with the tensors are one line naming the file or the layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.checkpoint.inspect import inspect_checkpoint
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.checkpoint.quant import encode_marker
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.kernels.stored_linear import StoredLinear
from oracle import EQUAL_WIDTH, forward_args, text_tags

ck_w4a4 = pytest.importorskip("comfy_kitchen.backends.eager.convrot_w4a4")
ck_w4a8 = pytest.importorskip("comfy_kitchen.backends.eager.w4a8_int8")
LABELS = ("int4_convrot", "w4a8", "w4a8_sym", "w4a8_asym")
VARIANT = {"w4a8": "codebook", "w4a8_sym": "symmetric", "w4a8_asym": "asymmetric"}
C = EQUAL_WIDTH


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_bit")
    out = {}
    for label in LABELS:
        out[label] = root / f"{label}.safetensors"
        make_dit_checkpoint(out[label], C, label, "comfy", seed=9)
    return out


def _comfy_kitchen_weight(f, layer: str, conf: dict) -> torch.Tensor:
    """A quantized layer of an open file, dequantized to fp32 by comfy-kitchen's eager code."""
    get = lambda suffix: f.get_tensor(f"{layer}.{suffix}")  # noqa: E731
    if conf["format"] == "convrot_w4a4":
        return ck_w4a4.dequantize_convrot_w4a4_weight(get("weight"), get("weight_scale"), conf["convrot_groupsize"],
                                                      output_dtype=torch.float32)
    keys = set(f.keys())
    optional = [get(s) if f"{layer}.{s}" in keys else None for s in ("weight_codebook", "weight_correction")]
    return ck_w4a8.dequantize_w4a8_int8_weight(get("weight"), get("weight_s_rel"), get("weight_s_channel"), *optional,
                                               conf["group_size"], conf["convrot_groupsize"], torch.float32)


@pytest.mark.parametrize("label", LABELS)
def test_dense_load_holds_comfy_kitchens_values(files, tmp_path, label):
    """The file with every quantized layer replaced by comfy-kitchen's fp32 dequantization (plain tensors) loads to
    the same model, bit for bit."""
    with safe_open(str(files[label]), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
        plain, quantized = {}, 0
        for key in keys:
            if key.endswith(".comfy_quant"):
                layer = key[: -len(".comfy_quant")]
                plain[f"{layer}.weight"] = _comfy_kitchen_weight(f, layer, json.loads(bytes(f.get_tensor(key).tolist())))
                quantized += 1
        for key in keys:
            layer, suffix = key.rsplit(".", 1)
            if f"{layer}.comfy_quant" not in keys or suffix == "bias":
                plain.setdefault(key, f.get_tensor(key))
    assert quantized == 4 * C.num_layers
    save_file(plain, tmp_path / "plain.safetensors", metadata=meta)
    dense, want = load_dit(files[label]), load_dit(tmp_path / "plain.safetensors")
    for (name, a), (_, b) in zip(dense.state_dict().items(), want.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_as_stored_gives_the_dense_velocities(files, label, dtype):
    reader = open_dit(files[label])
    specs = reader.quantized_layers()
    reader.source.close()
    assert len(specs) == 4 * C.num_layers
    assert {s.label for s in specs.values()} == {"int4_convrot" if label == "int4_convrot" else "w4a8"}
    dense = load_dit(files[label], dtype=dtype)
    kept = load_dit(files[label], dtype=dtype, stored=True)
    stored = {n: m for n, m in kept.named_modules() if isinstance(m, StoredLinear)}
    assert len(stored) == 6 * C.num_layers  # q, k, v cut from the fused layer; out, fc1, fc2
    for name, module in stored.items():
        assert module.weight.dtype == torch.int8
        assert torch.equal(module.dequantized(), dense.get_submodule(name).weight), name
    lay = layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))
    args = forward_args(C, lay, 3)
    args["encoder_hidden_states"] = args["encoder_hidden_states"].to(dtype)
    with torch.no_grad():
        for a, b in zip(dense(**args), kept(**args)):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def bf16_parameters(tmp_path_factory) -> int:
    """The logical parameter count of the same model in bf16 (a 4-bit layer counts its unpacked weights)."""
    path = tmp_path_factory.mktemp("bf16") / "bf16.safetensors"
    make_dit_checkpoint(path, C, "bf16", "comfy", seed=9)
    return inspect_checkpoint(path)["logical_parameters"]


@pytest.mark.parametrize("label", LABELS)
def test_inspect_reports_the_format_its_variant_and_scales(files, bf16_parameters, label):
    report = inspect_checkpoint(files[label])
    assert report["complete"] and report["logical_parameters"] == bf16_parameters
    qkv = report["layers"]["blocks.0.attn.qkv_proj"]
    assert qkv["logical_shape"] == [96, 32] and qkv["stored"] == {"dtype": "I8", "shape": [96, 16]}
    assert qkv["convrot_groupsize"] == 16 and qkv["nibble_order"] == "even element in the low nibble"
    scales = {s["name"]: s for s in qkv["scales"]}
    if label == "int4_convrot":
        assert report["quantization"]["formats"] == {"int4_convrot": 4 * C.num_layers}
        assert scales["weight_scale"]["shape"] == [96] and scales["weight_scale"]["layout"] == "per-row"
        return
    assert report["quantization"]["formats"] == {"w4a8": 4 * C.num_layers}
    assert qkv["variant"] == VARIANT[label] and qkv["group_size"] == 16
    assert scales["weight_s_rel"]["dtype"] == "F8_E4M3" and scales["weight_s_rel"]["shape"] == [96, 2]
    assert scales["weight_s_channel"]["shape"] == [96]
    assert ("weight_codebook" in scales) == (label == "w4a8")
    assert ("weight_correction" in scales) == (label == "w4a8_asym")
    if label == "w4a8_asym":
        assert scales["weight_correction"]["shape"] == [2, 96]


def test_the_tiny_dit_keeps_what_w4a8_cannot_hold_in_bf16(tmp_path):
    path = tmp_path / "tiny.safetensors"
    make_dit_checkpoint(path, TINY, "w4a8", "comfy", seed=2)
    with safe_open(str(path), "pt") as f:
        markers = {k[: -len(".comfy_quant")] for k in f.keys() if k.endswith(".comfy_quant")}
        assert f.get_tensor("blocks.0.attn.qkv_proj.weight").dtype == torch.bfloat16  # 24 inputs: not a multiple of 16
    assert markers == {f"blocks.{i}.{p}" for i in range(TINY.num_layers) for p in ("attn.out_proj", "mlp.fc2")}
    load_dit(path, stored=True)


def _rewrite(src, dst, change) -> None:
    with safe_open(str(src), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    change(tensors, meta)
    save_file(tensors, dst, metadata=meta)


@pytest.mark.parametrize("change, message", [
    (lambda t, m: t.update({"blocks.0.mlp.fc2.comfy_quant": torch.tensor(list(b"{not json"), dtype=torch.uint8)}),
     r"^blocks\.0\.mlp\.fc2\.comfy_quant does not hold JSON$"),
    (lambda t, m: t.update({"blocks.0.mlp.fc2.comfy_quant": encode_marker({"format": "w4a8"})}),
     r"^blocks\.0\.mlp\.fc2: unknown quantization format 'w4a8' \(supported: .*asym_w4a8_int8.*\)$"),
    (lambda t, m: t.update({"blocks.0.mlp.fc2.comfy_quant": encode_marker(
        {"format": "asym_w4a8_int8", "group_size": 32, "convrot": True, "convrot_groupsize": 64})}),
     r"^.*w4a8_asym\.safetensors: blocks\.0\.mlp\.fc2: asym_w4a8_int8 weight_s_rel is torch\.float8_e4m3fn "
     r"\[32, 4\]; group_size 32 over 64 input columns takes float8_e4m3fn or float32 \[32, 2\]$"),
    (lambda t, m: t.update({"blocks.0.mlp.fc2.weight": t["blocks.0.mlp.fc2.weight"][:, :-2].contiguous()}),
     r"^.*w4a8_asym\.safetensors: blocks\.0\.mlp\.fc2: asym_w4a8_int8 weight must be int8 \[32, 32\] \(two 4-bit "
     r"codes a byte\) for the model's \[32, 64\], got torch\.int8 \[32, 30\]$"),
])
def test_bad_declarations_and_tensors_are_one_line(files, tmp_path, change, message):
    bad = tmp_path / "w4a8_asym.safetensors"
    _rewrite(files["w4a8_asym"], bad, change)
    for stored in (False, True):
        with pytest.raises(CheckpointError, match=message):
            load_dit(bad, stored=stored)


def test_the_header_metadata_declares_them_too(files, tmp_path):
    """ComfyUI's other carrier: `_quantization_metadata` instead of the .comfy_quant tensors, same model."""
    def to_metadata(tensors, meta):
        layers = {k[: -len(".comfy_quant")]: json.loads(bytes(tensors.pop(k).tolist()))
                  for k in [k for k in tensors if k.endswith(".comfy_quant")]}
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})

    path = tmp_path / "declared.safetensors"
    _rewrite(files["w4a8"], path, to_metadata)
    for a, b in zip(load_dit(path).state_dict().values(), load_dit(files["w4a8"]).state_dict().values()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ the text encoder
@pytest.fixture(scope="module")
def te_files(tmp_path_factory):
    from fixtures import qwen_tiny as Q
    from h3_spark.h3_model.text.synthetic import write_text_encoder

    if not Q.HAS_TORCHVISION:
        pytest.skip("transformers' Qwen3-VL processor needs torchvision")
    root = tmp_path_factory.mktemp("four_bit_te")
    return {label: write_text_encoder(root / f"qwen_{label}.safetensors", "tiny", label, seed=4) for label in LABELS}


def _text_encoder(made, dtype, stored):
    from h3_spark.h3_model.text.encoder import TextEncoder

    return TextEncoder.from_pretrained(made.path, dtype=dtype, device="cpu", tokenizer=made.tokenizer_dir,
                                       layer=made.layers, stored=stored)


def _hidden(te):
    from fixtures import qwen_tiny as Q

    return te.encode(te.prompts.fl2va("the cat <d>says</d> hi", [Q.image(40, 56, 1)])).embeds


@pytest.mark.parametrize("label", LABELS)
def test_text_encoder_dense_load_holds_comfy_kitchens_values(te_files, label):
    made = te_files[label]
    params = dict(_text_encoder(made, torch.float32, False).model.named_parameters())
    checked = 0
    with safe_open(str(made.path), "pt") as f:
        for key in f.keys():
            if key.endswith(".comfy_quant"):
                layer = key[: -len(".comfy_quant")]
                want = _comfy_kitchen_weight(f, layer, json.loads(bytes(f.get_tensor(key).tolist())))
                got = params["language_model." + layer[len("model."):] + ".weight"]
                assert torch.equal(got, want), layer
                checked += 1
    assert checked == 7 * made.layers


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_encoder_kept_as_stored_gives_the_dense_hidden_states(te_files, label, dtype):
    dense = _text_encoder(te_files[label], dtype, False)
    kept = _text_encoder(te_files[label], dtype, True)
    stored = {n: m for n, m in kept.model.named_modules() if isinstance(m, StoredLinear)}
    assert len(stored) == 7 * te_files[label].layers
    for name, module in stored.items():
        assert torch.equal(module.dequantized(), dense.model.get_submodule(name).weight), name
    assert torch.equal(_hidden(dense), _hidden(kept))
