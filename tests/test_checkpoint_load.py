"""load_dit on every layout: diffusers folders (single, sharded, partitions), ComfyUI files and
their variants (prefix, interleaved QKV, metadata-declared and legacy fp8), and clear errors.

Layout changes are exact: the loaded state must be bit-identical to the source state.
"""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.h3_model.checkpoint import keymap, load_dit, open_dit, read_dit_config
from h3_spark.h3_model.checkpoint.dit_reader import expected_shapes
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.checkpoint.quant import encode_marker
from h3_spark.h3_model.checkpoint.synthetic import random_state
from h3_spark.h3_model.dit.config import FULL, TINY
from h3_spark.errors import CheckpointError
from checkpoints import made_files


def _read_all(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def _state(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------- diffusers folders
@pytest.fixture(scope="module")
def diffusers_model():
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    model = MiniMaxH3Transformer3DModel(**TINY.to_dict()).eval()
    with torch.no_grad():
        for p in model.parameters():  # diffusers initialises some to 0/1; make every value distinct
            p.copy_(torch.randn(p.shape) * 0.3)
    return model


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_diffusers_save_pretrained_loads_identically(tmp_path, diffusers_model, shard):
    folder = tmp_path / "transformer"
    kwargs = {"max_shard_size": shard} if shard else {}
    diffusers_model.save_pretrained(folder, **kwargs)
    if shard:
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").exists()
        assert len(list(folder.glob("*.safetensors"))) > 3
    assert read_dit_config(folder) == TINY
    ours = load_dit(folder)
    _assert_same_state(_state(ours), {k: v for k, v in diffusers_model.state_dict().items()})
    # the parent folder works too when it is unambiguous
    _assert_same_state(_state(load_dit(tmp_path)), _state(ours))


def test_diffusers_bf16_keeps_fp32_islands(tmp_path, diffusers_model):
    from diffusers import MiniMaxH3Transformer3DModel

    diffusers_model.save_pretrained(tmp_path / "fp32")
    bf16 = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "transformer")
    ours = load_dit(tmp_path / "transformer", dtype=torch.bfloat16)
    _assert_same_state(_state(ours), dict(bf16.state_dict()))
    assert ours.proj_in.weight.dtype == torch.float32 and ours.context_embedder.weight.dtype == torch.bfloat16


def test_partitions(tmp_path, diffusers_model):
    diffusers_model.save_pretrained(tmp_path / "transformer")
    make_dit_checkpoint(tmp_path / "transformer_ref", TINY, "bf16", "diffusers", seed=5)
    with pytest.raises(CheckpointError, match="both transformer/ and transformer_ref/.*partition"):
        load_dit(tmp_path)
    t2va = load_dit(tmp_path, partition="t2va")
    ref2va = load_dit(tmp_path, partition="ref2va")
    assert torch.equal(t2va.proj_in.weight, diffusers_model.proj_in.weight)
    assert not torch.equal(ref2va.proj_in.weight, t2va.proj_in.weight)
    with pytest.raises(CheckpointError, match="is the transformer/ folder but partition='ref2va'"):
        load_dit(tmp_path / "transformer", partition="ref2va")
    with pytest.raises(CheckpointError, match="unknown partition"):
        load_dit(tmp_path, partition="t2v")


# ------------------------------------------------------------------------------- ComfyUI files
@pytest.fixture(scope="module")
def comfy_bf16(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy")
    make_dit_checkpoint(root / "comfy.safetensors", TINY, "bf16", "comfy", seed=1)
    make_dit_checkpoint(root / "diffusers", TINY, "bf16", "diffusers", seed=1)
    return root


def test_comfy_and_diffusers_layouts_hold_the_same_model(comfy_bf16):
    comfy = load_dit(comfy_bf16 / "comfy.safetensors")
    diff = load_dit(comfy_bf16 / "diffusers")
    _assert_same_state(_state(comfy), _state(diff))
    assert read_dit_config(comfy_bf16 / "comfy.safetensors") == TINY


def test_prefix_and_other_components(comfy_bf16, tmp_path):
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    full = {keymap.COMFY_PREFIX + k: v for k, v in tensors.items()}
    full["vae.decoder.proj_in.weight"] = torch.randn(4, 4)
    full["text_encoders.qwen3vl_32b.transformer.model.norm.weight"] = torch.randn(4)
    save_file(full, tmp_path / "full.safetensors", metadata=meta)
    reader = open_dit(tmp_path / "full.safetensors")
    assert reader.detected.prefix == keymap.COMFY_PREFIX and len(reader.other_components) == 2
    _assert_same_state(_state(load_dit(tmp_path / "full.safetensors")), _state(load_dit(comfy_bf16 / "comfy.safetensors")))


def test_interleaved_qkv(comfy_bf16, tmp_path):
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    c = TINY
    for k in list(tensors):
        if k.endswith("attn.qkv_proj.weight"):
            q, kk, v = keymap.split_qkv(tensors[k], c.num_attention_heads, c.attention_head_dim, "stacked")
            tensors[k] = keymap.fuse_qkv(q, kk, v, c.num_attention_heads, c.attention_head_dim, "interleaved")
    save_file(tensors, tmp_path / "interleaved.safetensors", metadata=meta)
    stacked = _state(load_dit(comfy_bf16 / "comfy.safetensors"))
    _assert_same_state(_state(load_dit(tmp_path / "interleaved.safetensors", qkv_layout="interleaved")), stacked)
    wrong = _state(load_dit(tmp_path / "interleaved.safetensors"))
    assert not torch.equal(wrong["transformer_blocks.0.attn.to_q.weight"], stacked["transformer_blocks.0.attn.to_q.weight"])


def test_config_from_shapes_without_metadata(comfy_bf16, tmp_path):
    tensors, _ = _read_all(comfy_bf16 / "comfy.safetensors")
    save_file(tensors, tmp_path / "bare.safetensors")  # rope.inv_freq still sizes the RoPE
    assert read_dit_config(tmp_path / "bare.safetensors") == TINY
    del tensors["rope.inv_freq"]
    save_file(tensors, tmp_path / "no_rope.safetensors")
    with pytest.raises(CheckpointError, match="cannot tell rope_freq_dim"):
        read_dit_config(tmp_path / "no_rope.safetensors")


def test_fp8_declared_three_ways_loads_identically(tmp_path):
    path = tmp_path / "fp8.safetensors"
    make_dit_checkpoint(path, TINY, "fp8_scaled", "comfy", seed=2)
    reference = _state(load_dit(path))
    tensors, meta = _read_all(path)
    markers = {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist())) for k, v in tensors.items()
               if k.endswith(".comfy_quant")}
    assert len(markers) == 4 * TINY.num_layers
    plain = {k: v for k, v in tensors.items() if not k.endswith(".comfy_quant")}
    # 1. _quantization_metadata in the header instead of marker tensors
    save_file(plain, tmp_path / "meta.safetensors",
              metadata={**meta, "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": markers})})
    _assert_same_state(_state(load_dit(tmp_path / "meta.safetensors")), reference)
    # 2. legacy scaled_fp8: scale_weight names and a `scaled_fp8` marker tensor
    legacy = {k.replace(".weight_scale", ".scale_weight"): v for k, v in plain.items()}
    legacy["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(legacy, tmp_path / "legacy.safetensors", metadata=meta)
    reader = open_dit(tmp_path / "legacy.safetensors")
    assert {s.source for s in reader.quantized_layers().values()} == {"scaled_fp8"}
    _assert_same_state(_state(load_dit(tmp_path / "legacy.safetensors")), reference)


def test_declaration_errors(tmp_path):
    path = tmp_path / "fp8.safetensors"
    make_dit_checkpoint(path, TINY, "fp8_scaled", "comfy", seed=2)
    tensors, meta = _read_all(path)
    layer = "blocks.0.attn.qkv_proj"
    for conf, message in [({"format": "mxfp8"}, "'mxfp8' is not supported"),
                          ({"format": "int3_magic"}, "unknown quantization format 'int3_magic'"),
                          ({"format": "float8_e4m3fn", "convrot": True}, "convrot is only defined")]:
        broken = dict(tensors)
        broken[f"{layer}.comfy_quant"] = encode_marker(conf)
        save_file(broken, tmp_path / "bad.safetensors", metadata=meta)
        with pytest.raises(CheckpointError, match=message):
            load_dit(tmp_path / "bad.safetensors")
    undeclared = {k: v for k, v in tensors.items() if k != f"{layer}.comfy_quant"}
    save_file(undeclared, tmp_path / "undeclared.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=f"{layer}: has weight_scale but no quantization declaration"):
        load_dit(tmp_path / "undeclared.safetensors")


def test_missing_unexpected_and_wrong_shapes_name_the_keys(comfy_bf16, tmp_path):
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    missing = {k: v for k, v in tensors.items() if not k.startswith("blocks.1.mlp.fc2")}
    save_file(missing, tmp_path / "missing.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"1 tensors missing, e\.g\. transformer_blocks\.1\.ff\.net\.2\.weight"):
        load_dit(tmp_path / "missing.safetensors")
    extra = dict(tensors, **{"blocks.0.attn.mystery.weight": torch.zeros(2, 2)})
    save_file(extra, tmp_path / "extra.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"1 tensors fit no DiT name, e\.g\. blocks\.0\.attn\.mystery\.weight"):
        load_dit(tmp_path / "extra.safetensors")
    wrong = dict(tensors)
    wrong["blocks.0.mlp.fc2.weight"] = torch.zeros(24, 60, dtype=torch.bfloat16)
    save_file(wrong, tmp_path / "wrong.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.0\.ff\.net\.2\.weight is \[24, 60\], expected \[24, 64\]"):
        load_dit(tmp_path / "wrong.safetensors")


def test_refuses_pickle_and_non_dit(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickle checkpoints are not loaded"):
        load_dit(tmp_path / "model.bin")
    save_file({"pre_block.attn.zero_k_bias": torch.zeros(3)}, tmp_path / "audio.safetensors")
    with pytest.raises(CheckpointError, match="holds the audio VAE, not the DiT"):
        load_dit(tmp_path / "audio.safetensors")


def test_a_comfy_file_with_vsa_gates_loads_them(comfy_bf16, tmp_path):
    """FastH3's gate (`blocks.N.attn.to_gate_compress`) is a layer of the model once a file carries it; a file
    gating only some blocks is incomplete."""
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    gates = {f"blocks.{i}.attn.to_gate_compress.weight": torch.randn(32, 24).to(torch.bfloat16)
             for i in range(TINY.num_layers)}
    save_file({**tensors, **gates}, tmp_path / "vsa.safetensors", metadata=meta)
    reader = open_dit(tmp_path / "vsa.safetensors")
    assert reader.ignored == [] and reader.config.gate_compress
    model = load_dit(tmp_path / "vsa.safetensors")
    for i in range(TINY.num_layers):
        assert torch.equal(model.transformer_blocks[i].attn.to_gate_compress.weight.to(torch.bfloat16),
                           gates[f"blocks.{i}.attn.to_gate_compress.weight"])
    save_file({**tensors, "blocks.0.attn.to_gate_compress.weight": gates["blocks.0.attn.to_gate_compress.weight"]},
              tmp_path / "half.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"1 tensors missing, e\.g\. transformer_blocks\.1\.attn\."
                                              r"to_gate_compress\.weight"):
        load_dit(tmp_path / "half.safetensors")


# ------------------------------------------------------------------------------- key mapping
@pytest.mark.parametrize("config", [TINY, FULL], ids=["tiny", "full"])
def test_key_mapping_round_trips(config):
    names = expected_shapes(config)
    originals = {keymap.diffusers_param_to_original(n) for n in names}
    assert None not in originals
    back = set()
    for o in originals:
        layer, _, param = o.rpartition(".")
        target = keymap.original_layer_to_diffusers(layer)
        assert keymap.diffusers_layer_to_original(target) == layer
        if target.endswith("to_qkv"):
            back |= {target[: -len("to_qkv")] + f"{p}.{param}" for p in ("to_q", "to_k", "to_v")}
        else:
            back.add(f"{target}.{param}")
    assert back == set(names)
    # 3 fused QKV per block + refiner block: the original file has 2 fewer names per block
    assert len(originals) == len(names) - 2 * (config.num_layers + config.num_refiner_layers)
    assert keymap.original_layer_to_diffusers("token_refiner.blocks.0.adaln_proj.linear") is None
    assert keymap.original_layer_to_diffusers("blocks.0.attn.qkv") is None


@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_qkv_and_fc1_transforms_round_trip(layout):
    heads, dim = 3, 4
    q, k, v = (torch.randn(heads * dim, 5) for _ in range(3))
    fused = keymap.fuse_qkv(q, k, v, heads, dim, layout)
    assert all(torch.equal(a, b) for a, b in zip(keymap.split_qkv(fused, heads, dim, layout), (q, k, v)))
    if layout == "interleaved":
        assert torch.equal(fused[dim:2 * dim], k[:dim])  # head 0: q, k, v
    gate, value = torch.randn(6, 5), torch.randn(6, 5)
    assert torch.equal(keymap.swap_halves(torch.cat([gate, value])), torch.cat([value, gate]))


def test_loads_in_bfloat16_and_random_state_matches(comfy_bf16):
    model = load_dit(comfy_bf16 / "diffusers", dtype=torch.bfloat16)
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    assert model.time_embedder.linear_1.weight.dtype == torch.float32
    original = dict(random_state(TINY, 1))
    assert torch.equal(model.proj_in.weight, original["proj_in.weight"])  # fp32 island stored exactly
    assert torch.equal(model.context_embedder.weight, original["context_embedder.weight"].bfloat16())


def test_diffusers_file_without_config(comfy_bf16, tmp_path):
    weights = comfy_bf16 / "diffusers" / "diffusion_pytorch_model.safetensors"
    tensors, _ = _read_all(weights)
    save_file(tensors, tmp_path / "bare_diffusers.safetensors")
    # Tiny head_dim 16: the RoPE size is not in the tensors, so sizing must refuse rather than guess.
    with pytest.raises(CheckpointError, match="only be sized for the released head_dim 128"):
        read_dit_config(tmp_path / "bare_diffusers.safetensors")
    # With a config.json next to it (a component folder), it loads.
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text((comfy_bf16 / "diffusers" / "config.json").read_text())
    save_file(tensors, tmp_path / "folder" / "diffusion_pytorch_model.safetensors")
    _assert_same_state(_state(load_dit(tmp_path / "folder")), _state(load_dit(comfy_bf16 / "diffusers")))


def test_both_namings_size_the_same_model_from_shapes():
    # The released geometry described by tensor shapes alone, under ComfyUI's and diffusers' names.
    from h3_spark.h3_model.checkpoint.dit_config import config_from_comfy, config_from_diffusers_shapes

    shapes = expected_shapes(FULL)
    comfy = {}
    for name, shape in shapes.items():
        original = keymap.diffusers_param_to_original(name)
        if original is None:
            continue
        if original in comfy and ".qkv_proj." in original:  # q, k and v stack into one tensor
            shape = (comfy[original][0] + shape[0], *shape[1:])
        comfy[original] = shape
    diff = config_from_diffusers_shapes(list(shapes), shapes.get)
    assert (diff.hidden_size, diff.num_layers, diff.num_attention_heads, diff.ffn_dim) == (5376, 50, 56, 14336)
    assert config_from_comfy(list(comfy), comfy.get, {}, None).to_dict() == diff.to_dict()
    bad = dict(shapes, adaln_t_table=(1, 2688))
    with pytest.raises(CheckpointError, match=r"adaln_t_table must be \[grid >= 2, k\], got \[1, 2688\]"):
        config_from_diffusers_shapes(list(bad), bad.get)


# ------------------------------------------------------------------------------- declarations, names, devices
@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return made_files(tmp_path_factory.mktemp("quantized"), TINY, ("fp8_scaled", "nvfp4", "int8_convrot"), 6)


def _markers(tensors: dict) -> dict:
    return {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist())) for k, v in tensors.items()
            if k.endswith(".comfy_quant")}


def _with_metadata(meta: dict, layers: dict) -> dict:
    return {**meta, "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


def test_quant_spec_equality_ignores_where_it_was_declared():
    from h3_spark.h3_model.checkpoint.quant import QuantSpec

    marked = QuantSpec("int8_tensorwise", convrot=True, convrot_groupsize=16, source="comfy_quant")
    assert marked == QuantSpec("int8_tensorwise", convrot=True, convrot_groupsize=16, source="metadata")
    assert marked != QuantSpec("int8_tensorwise", convrot=True, convrot_groupsize=4, source="comfy_quant")


def test_layer_declared_by_marker_and_metadata_alike_loads(quantized, tmp_path):
    tensors, meta = _read_all(quantized["int8_convrot"])
    layers = _markers(tensors)
    save_file(tensors, tmp_path / "both.safetensors", metadata=_with_metadata(meta, layers))
    _assert_same_state(_state(load_dit(tmp_path / "both.safetensors")), _state(load_dit(quantized["int8_convrot"])))
    # A real disagreement is still refused.
    layer = "blocks.0.attn.out_proj"
    other = dict(layers, **{layer: {**layers[layer], "convrot": False}})
    save_file(tensors, tmp_path / "disagree.safetensors", metadata=_with_metadata(meta, other))
    with pytest.raises(CheckpointError, match=rf"^{layer}: \.comfy_quant \(int8_convrot\) and "
                                              r"_quantization_metadata \(int8\) disagree$"):
        load_dit(tmp_path / "disagree.safetensors")


def test_metadata_of_other_components_and_ignored_layers_is_not_ours(quantized, tmp_path):
    from h3_spark.h3_model.checkpoint.quant import quantize_int8_rows

    tensors, meta = _read_all(quantized["fp8_scaled"])
    layers = {keymap.COMFY_PREFIX + k: v for k, v in _markers(tensors).items()}
    full = {keymap.COMFY_PREFIX + k: v for k, v in tensors.items() if not k.endswith(".comfy_quant")}
    te = "text_encoders.qwen3vl_32b.transformer.model.layers.0.mlp.up_proj"
    full[f"{te}.weight"] = torch.randn(8, 8).to(torch.float8_e4m3fn)
    full[f"{te}.weight_scale"] = torch.rand(())
    # Declared in the same metadata, as ComfyUI saves a full checkpoint; even a format we do not read.
    others = {te: {"format": "float8_e4m3fn"}, "vae.decoder.proj_in": {"format": "mxfp8"}}
    save_file(full, tmp_path / "full.safetensors", metadata=_with_metadata(meta, {**layers, **others}))
    reference = _state(load_dit(quantized["fp8_scaled"]))
    _assert_same_state(_state(load_dit(tmp_path / "full.safetensors")), reference)
    # A VSA gate declared quantized in the metadata loads as the model's gate, the other layers unchanged.
    plain = {k: v for k, v in tensors.items() if not k.endswith(".comfy_quant")}
    vsa = dict(_markers(tensors))
    for i in range(TINY.num_layers):
        gate = f"blocks.{i}.attn.to_gate_compress"
        plain[f"{gate}.weight"], plain[f"{gate}.weight_scale"] = quantize_int8_rows(torch.randn(32, 24), 4)
        vsa[gate] = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 4}
    save_file(plain, tmp_path / "vsa.safetensors", metadata=_with_metadata(meta, vsa))
    assert open_dit(tmp_path / "vsa.safetensors").ignored == []
    gated = _state(load_dit(tmp_path / "vsa.safetensors"))
    assert sorted(k for k in gated if "to_gate_compress" in k) == [
        f"transformer_blocks.{i}.attn.to_gate_compress.weight" for i in range(TINY.num_layers)]
    _assert_same_state({k: v for k, v in gated.items() if "to_gate_compress" not in k}, reference)
    # A declaration under the DiT's own prefix that names no stored layer is still an error.
    ghost = {**layers, keymap.COMFY_PREFIX + "blocks.0.attn.ghost": {"format": "float8_e4m3fn"}}
    save_file(full, tmp_path / "ghost.safetensors", metadata=_with_metadata(meta, ghost))
    with pytest.raises(CheckpointError, match=r"^_quantization_metadata declares 1 layers with no weight, "
                                              r"e\.g\. blocks\.0\.attn\.ghost$"):
        load_dit(tmp_path / "ghost.safetensors")


def test_errors_give_the_file_names_of_an_original_named_file(comfy_bf16, tmp_path):
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    for prefix in ("", keymap.COMFY_PREFIX):
        no_bias = {prefix + k: v for k, v in tensors.items() if k != "condition_proj.bias"}
        save_file(no_bias, tmp_path / "no_bias.safetensors", metadata=meta)
        with pytest.raises(CheckpointError, match=rf"1 tensors missing, e\.g\. context_embedder\.bias "
                                                  rf"\(file name: {re.escape(prefix)}condition_proj\.bias\)$"):
            load_dit(tmp_path / "no_bias.safetensors")
    wrong = dict(tensors, **{"blocks.0.mlp.fc2.weight": torch.randn(24, 60).bfloat16()})
    save_file(wrong, tmp_path / "wrong.safetensors", metadata=meta)
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.0\.ff\.net\.2\.weight is \[24, 60\], expected "
                                              r"\[24, 64\] \(file name: blocks\.0\.mlp\.fc2\.weight\)$"):
        load_dit(tmp_path / "wrong.safetensors")


@pytest.mark.parametrize("declared_by", ["comfy_quant", "metadata"])
def test_quantized_layer_without_its_weight_is_weight_missing(quantized, tmp_path, declared_by):
    tensors, meta = _read_all(quantized["fp8_scaled"])
    layer = "blocks.1.attn.out_proj"
    kept = {k: v for k, v in tensors.items() if k != f"{layer}.weight"}
    if declared_by == "metadata":
        meta = _with_metadata(meta, _markers(kept))
        kept = {k: v for k, v in kept.items() if not k.endswith(".comfy_quant")}
    save_file(kept, tmp_path / "weightless.safetensors", metadata=meta)
    has = f"{layer}.comfy_quant, {layer}.weight_scale" if declared_by == "comfy_quant" else f"{layer}.weight_scale"
    message = rf"weightless\.safetensors: 1 layers have no weight: {re.escape(layer)}\.weight missing"
    with pytest.raises(CheckpointError, match=message + rf" \(the file has {re.escape(has)}\)$"):
        load_dit(tmp_path / "weightless.safetensors")


@pytest.mark.parametrize("fmt", ["fp8_scaled", "nvfp4", "int8_convrot"])
def test_quantized_layers_dequantize_on_the_target_device(quantized, monkeypatch, fmt):
    """What a CPU can check of GPU loading: dequantize is handed tensors already on the target device
    ("meta" here; "cuda" takes the same path), so the arithmetic runs there and not on the CPU."""
    from h3_spark.h3_model.checkpoint import layer_reading

    seen = []
    real = layer_reading.dequantize

    def spy(spec, tensors, shape, dtype, layer):
        seen.append({t.device.type for t in tensors.values()})
        return real(spec, tensors, shape, dtype, layer)

    monkeypatch.setattr(layer_reading, "dequantize", spy)
    model = load_dit(quantized[fmt], device="meta")
    assert len(seen) == 4 * TINY.num_layers and all(devices == {"meta"} for devices in seen)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_data_section_must_be_tiled_exactly(comfy_bf16, tmp_path):
    path = tmp_path / "trailing.safetensors"
    path.write_bytes((comfy_bf16 / "comfy.safetensors").read_bytes() + bytes(range(1, 9)))
    with pytest.raises(CheckpointError, match=r"trailing\.safetensors: 8 trailing bytes after the last tensor's "
                                              r"data \(the safetensors library refuses such a file\)$"):
        load_dit(path)


def test_safetensors_refusals_become_checkpoint_errors(comfy_bf16, tmp_path):
    from h3_spark.h3_model.checkpoint import open_source

    path = tmp_path / "changed.safetensors"
    path.write_bytes((comfy_bf16 / "comfy.safetensors").read_bytes())
    source = open_source(path)
    with open(path, "ab") as f:  # the file changes after its header was checked
        f.write(bytes(range(1, 9)))
    with pytest.raises(CheckpointError, match=r"changed\.safetensors: safetensors cannot read tensor "
                                              r"condition_proj\.weight: .*not fully covered"):
        source.get("condition_proj.weight")


# ------------------------------------------------------------------------------- diffusers as the oracle
@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_comfy_loading_matches_diffusers_single_file_converter(comfy_bf16, tmp_path, layout):
    """Our ComfyUI-layout reader against diffusers' own converter of the same file (names, QKV split, fc1
    halves): a key convention our writer and reader share but the world does not would fail here."""
    import inspect

    single_file = pytest.importorskip("diffusers.loaders.single_file_utils")
    convert = getattr(single_file, "convert_minimax_h3_transformer_checkpoint_to_diffusers", None)
    if convert is None or "qkv_layout" not in inspect.signature(convert).parameters:
        pytest.skip("this diffusers has no MiniMax-H3 single-file converter with qkv_layout")
    tensors, meta = _read_all(comfy_bf16 / "comfy.safetensors")
    # Distinct rows everywhere, so a wrong split or a missed swap cannot pass by symmetry.
    gen = torch.Generator().manual_seed(11)
    tensors = {k: (torch.randn(v.shape, generator=gen) * 0.3).to(v.dtype) if k != "rope.inv_freq" else v
               for k, v in tensors.items()}
    save_file(tensors, tmp_path / "file.safetensors", metadata=meta)
    theirs = convert(dict(tensors), config=TINY.to_dict(), qkv_layout=layout)
    ours = _state(load_dit(tmp_path / "file.safetensors", dtype=torch.bfloat16, qkv_layout=layout))
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert torch.equal(value.to(ours[name].dtype), ours[name]), name


def test_a_lone_file_takes_its_folders_config_and_a_shard_is_refused(tmp_path):
    """A diffusers weights file picked inside its folder reads the folder's config.json (not a guess from
    shapes); one shard of a sharded folder is refused with the folder to choose."""
    from h3_spark.h3_model.checkpoint import read_dit_config
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.dit.config import TINY

    config = TINY  # head_dim 16: shapes alone cannot size it (rope_freq_dim is not stored)
    make_dit_checkpoint(tmp_path / "dit", config, "bf16", "diffusers", seed=0)
    files = sorted((tmp_path / "dit").glob("*.safetensors"))
    assert len(files) == 1
    assert read_dit_config(files[0]) == read_dit_config(tmp_path / "dit") == config
    alone = tmp_path / "alone.safetensors"
    alone.write_bytes(files[0].read_bytes())
    with pytest.raises(CheckpointError, match="put it in a folder with its config.json and choose the folder"):
        read_dit_config(alone)
    (tmp_path / "dit" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        '{"weight_map": {}}')
    with pytest.raises(CheckpointError, match=r"is one shard of the sharded diffusers folder dit/ .*choose the "
                                              r"folder, not a file inside it"):
        read_dit_config(files[0])
