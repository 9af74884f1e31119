"""`h3-spark inspect`: reports for every layout and format, other H3 models, broken files, and a
header-only pass over a full-size (sparse) 62 GiB checkpoint."""

import json
import struct
import time

import pytest
import torch
from safetensors.torch import save_file

from h3_spark.cli import main
from h3_spark.kernels import nvfp4_codec as nvfp4
from h3_spark.h3_model.checkpoint.comfy_layout import comfy_groups, comfy_metadata
from h3_spark.h3_model.checkpoint.dit_config import expected_inv_freq
from h3_spark.h3_model.checkpoint.inspect import inspect_checkpoint
from h3_spark.h3_model.checkpoint.make import CURVE_DEFAULTS, make_dit_checkpoint, pruned_config
from h3_spark.h3_model.checkpoint.quant import encode_marker
from h3_spark.h3_model.checkpoint.safetensors_header import encode_header
from h3_spark.h3_model.dit.config import FULL, TINY

TINY_PARAMS = 50_000  # parameters of the tiny full-AdaLN DiT
TINY_PRUNED_PARAMS = 37_604  # time MLP gone, AdaLN from 16 to 4 inputs, plus the [33, 4] table


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    out = {}
    for lay in ("comfy", "comfy-pruned"):
        for fmt in ("bf16", "fp8_scaled", "nvfp4", "int8_convrot"):
            out[(lay, fmt)] = root / f"{lay}-{fmt}.safetensors"
            make_dit_checkpoint(out[(lay, fmt)], TINY, fmt, lay, seed=4, curve=CURVE_DEFAULTS["tiny"])
    out[("diffusers", "bf16")] = root / "transformer"
    make_dit_checkpoint(out[("diffusers", "bf16")], TINY, "bf16", "diffusers", seed=4)
    return out


@pytest.mark.parametrize("lay", ["comfy", "comfy-pruned"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled", "nvfp4", "int8_convrot"])
def test_reports_every_format(files, tmp_path, capsys, lay, fmt):
    code, out, err = _run(capsys, files[(lay, fmt)], "--out", tmp_path)
    assert code == 0 and not err
    report = json.loads((tmp_path / f"{lay}-{fmt}.inspect.json").read_text())
    assert report["model"] == "dit" and report["layout"] == lay and report["complete"]
    assert report["logical_parameters"] == (TINY_PRUNED_PARAMS if lay == "comfy-pruned" else TINY_PARAMS)
    assert report["curve_form"] == (lay == "comfy-pruned")
    expected_formats = {} if fmt == "bf16" else {fmt: 4 * TINY.num_layers}
    assert report["quantization"]["formats"] == expected_formats
    assert "complete" in out and f"layout {lay}" in out
    qkv = report["layers"]["blocks.0.attn.qkv_proj"]
    assert qkv["maps_to"] == "transformer_blocks.0.attn.to_{q,k,v}"
    if fmt == "nvfp4":
        assert qkv["stored"] == {"dtype": "U8", "shape": list(nvfp4.packed_shape(96, 24))}
        assert qkv["logical_shape"] == [96, 24] and qkv["packed_shapes_consistent"]
        block, glob = qkv["scales"]
        assert block["dtype"] == "F8_E4M3" and block["shape"] == [128, 4] and "blocked" in block["layout"]
        assert glob["name"] == "weight_scale_2" and glob["dtype"] == "F32" and glob["value"] > 0
    elif fmt == "int8_convrot":
        assert qkv["convrot_groupsize"] == 4 and qkv["scales"][0]["layout"] == "per-row"
        assert qkv["scales"][0]["shape"] == [96, 1]
    elif fmt == "fp8_scaled":
        assert qkv["stored"]["dtype"] == "F8_E4M3" and qkv["scales"][0]["layout"] == "per-tensor"
        assert qkv["scales"][0]["value"] > 0
    else:
        assert qkv["format"] == "bf16"
    if lay == "comfy-pruned":
        assert report["curve_table"]["shape"] == [33, 4]
        assert report["layers"]["blocks.0.adaln_proj.linear"]["format"] == "fp32"
    assert report["layers"]["video_patch_proj"]["format"] == "fp32"


def test_without_out_nothing_is_written_and_a_diffusers_folder(files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(capsys, files[("diffusers", "bf16")])
    assert code == 0 and "complete" in out and "report:" not in out
    assert list(tmp_path.iterdir()) == []  # no report unless --out asks for one
    report = inspect_checkpoint(files[("diffusers", "bf16")])
    assert report["layout"] == "diffusers" and report["complete"] and report["logical_parameters"] == TINY_PARAMS
    assert report["loader_check"] == {"check": "DitReader.check", "passed": True}
    assert report["dtype_histogram"]["F32"]["tensors"] == 12  # the fp32 islands


def test_incomplete_and_unmapped_are_reported(files, tmp_path, capsys):
    from safetensors import safe_open

    with safe_open(str(files[("comfy", "nvfp4")]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    del tensors["blocks.1.mlp.fc2.weight"], tensors["blocks.1.mlp.fc2.weight_scale"]
    del tensors["blocks.1.mlp.fc2.weight_scale_2"], tensors["blocks.1.mlp.fc2.comfy_quant"]
    tensors["blocks.0.attn.mystery.weight"] = torch.ones(2)
    save_file(tensors, tmp_path / "broken.safetensors", metadata=meta)
    code, out, _ = _run(capsys, tmp_path / "broken.safetensors", "--out", tmp_path)
    assert code == 0
    report = json.loads((tmp_path / "broken.inspect.json").read_text())
    assert not report["complete"]
    assert report["missing"] == ["transformer_blocks.1.ff.net.2.weight"]
    assert report["unmapped"] == ["blocks.0.attn.mystery.weight"]
    assert "INCOMPLETE" in out and "transformer_blocks.1.ff.net.2.weight" in out


def test_other_h3_models(tmp_path, capsys):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    video = AutoencoderKLMiniMaxH3(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
                                   spatial_downsample_factors=(2, 2, 1), temporal_downsample_factors=(2, 2, 1),
                                   norm_num_groups=4, decoder_num_layers=2, decoder_num_attention_heads=2,
                                   decoder_attention_head_dim=8, decoder_num_register_tokens=2, decoder_ffn_mult=2,
                                   clip_length=17, token_drop=3, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    audio = AutoencoderKLMiniMaxH3Audio(encoder_dim=2, encoder_rates=(2, 4, 4, 5, 5), latent_dim=16, latent_channels=8,
                                        num_attention_heads=2, decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2),
                                        decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), resblock_kernel_sizes=(3,),
                                        resblock_dilation_sizes=((1,),), latents_mean=[0.0] * 8,
                                        latents_std=[1.0] * 8)
    vsd = {k: v.contiguous() for k, v in video.state_dict().items()}
    save_file(vsd, tmp_path / "video_vae.safetensors")
    save_file({k: v.contiguous() for k, v in audio.state_dict().items()}, tmp_path / "audio_vae.safetensors")
    te = {"model.language_model.embed_tokens.weight": torch.randn(10, 8)}
    for i in range(2):
        for s in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                  "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight"):
            te[f"model.language_model.layers.{i}.{s}"] = torch.randn(4)
    te["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(4)
    save_file(te, tmp_path / "text_encoder.safetensors")
    del vsd["decoder.transformer_blocks.1.attn.to_k.bias"]
    save_file(vsd, tmp_path / "video_vae_broken.safetensors")
    video.save_pretrained(tmp_path / "video_folder")
    audio.save_pretrained(tmp_path / "audio_folder")
    # The headers of the tiny VAEs' single files hold every tensor, but their strides are not the released ones and
    # a single file carries no config: the loader refuses them, so they are not complete (they once were, by their
    # headers alone). Their diffusers folders, configs beside the weights, are.
    expected = {"video_vae.safetensors": ("video_vae", False), "audio_vae.safetensors": ("audio_vae", False),
                "video_folder": ("video_vae", True), "audio_folder": ("audio_vae", True),
                "text_encoder.safetensors": ("text_encoder", True), "video_vae_broken.safetensors": ("video_vae", False)}
    for name, (model, complete) in expected.items():
        report = inspect_checkpoint(tmp_path / name)
        assert report["model"] == model and report["complete"] == complete, (name, report["missing"],
                                                                           report["loader_check"])
    single = inspect_checkpoint(tmp_path / "video_vae.safetensors")
    assert single["missing"] == [] and single["loader_check"] == {
        "check": "check_video_vae", "passed": False,
        "error": "cannot infer this video VAE's strides or head width from its tensors; it has no config (pass one, "
                 "or use a diffusers folder)"}
    code, out, _ = _run(capsys, tmp_path / "audio_vae.safetensors")
    assert code == 0 and "INCOMPLETE: the loader refuses it (check_audio_vae): cannot infer this audio VAE's " \
                         "decoder rates or dilations from its tensors" in out
    assert inspect_checkpoint(tmp_path / "audio_folder")["loader_check"] == {"check": "check_audio_vae",
                                                                              "passed": True}
    assert inspect_checkpoint(tmp_path / "text_encoder.safetensors")["loader_check"]["skipped"] == \
        "a single-file text encoder: the loader's check needs its tokenizer too"
    assert inspect_checkpoint(tmp_path / "video_vae_broken.safetensors")["missing"] == \
        ["decoder.transformer_blocks.1.attn.to_k.bias"]
    assert inspect_checkpoint(tmp_path / "audio_folder")["logical_parameters"] == \
        sum(p.numel() for p in audio.state_dict().values())
    facts = inspect_checkpoint(tmp_path / "text_encoder.safetensors")["structure"]
    assert facts["language_layers"] == 2 and facts["vision_tensors"] == 1


def _write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def test_broken_files_give_one_line_errors(tmp_path, capsys):
    f32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    cases = {
        "missing.safetensors": (None, "no such file or folder"),
        "pickle.safetensors": (b"PK\x03\x04" + b"\0" * 40, "not a safetensors file (looks like a PyTorch pickle"),
        "text.safetensors": (b"hello, this is a text file and not a checkpoint\n", "not a safetensors file (header length"),
        "short.safetensors": (b"\x10\0\0", "truncated header: the file has 3 bytes"),
        "cut_json.safetensors": ("cut", "truncated header: the JSON ends early"),
        "past_end.safetensors": ("past_end", "header length 4096 runs past the end of the file"),
        "offsets.safetensors": ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}},
                                "data offsets [0, 64] run past the end of the file"),
        "overlap.safetensors": ({"a": f32, "b": {**f32, "data_offsets": [8, 24]}}, "overlap in the data section"),
        "not_h3.safetensors": ({"encoder.layer.0.weight": f32}, "not an H3 checkpoint"),
        # The safetensors library refuses data sections the tensors do not tile exactly.
        "gap.safetensors": ({"a": f32, "b": {**f32, "data_offsets": [24, 40]}},
                            "8 bytes of the data section before tensor 'b' belong to no tensor"),
        "trailing.safetensors": ({"w": f32, "trailing": True}, "8 trailing bytes after the last tensor's data"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content == "cut":
            _write_raw(path, b'{"w": {"dtype": "F32", "sha')
        elif content == "past_end":
            _write_raw(path, {"w": f32}, length=4096)
        elif isinstance(content, dict):
            header = {k: v for k, v in content.items() if k != "trailing"}
            end = max(v["data_offsets"][1] for v in header.values())
            size = 24 if name == "offsets.safetensors" else end + 8 * content.get("trailing", False)
            _write_raw(path, header, bytes(range(size)))
        elif content is not None:
            path.write_bytes(content)
        code, out, err = _run(capsys, path, "--out", tmp_path)
        assert code == 2, name
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("h3-spark inspect: error: "), (name, err)
        assert message in lines[0], (name, lines[0])
        assert "Traceback" not in err


def _sparse_full(path, fmt: str, pruned: bool):
    """A full-size checkpoint whose header, markers and RoPE buffer are real and whose weights are holes."""
    config = pruned_config(FULL, 1025, 8) if pruned else FULL

    class _Fit:  # comfy_groups only needs the table and basis shapes to plan the file
        table = torch.empty(1025, 8)
        basis = torch.empty(FULL.time_embed_dim, 8)

    groups = comfy_groups(config, get=None, fmt=fmt, fit=_Fit() if pruned else None)
    entries = [e for g in groups for e in g.entries]
    metadata = comfy_metadata(config)
    header, offsets = encode_header(entries, metadata)
    total = sum(g.nbytes for g in groups)
    marker = encode_marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256})
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + total)
        for (name, _, _), offset in zip(entries, offsets):
            if name.endswith(".comfy_quant"):
                f.seek(len(header) + offset)
                f.write(marker.numpy().tobytes())
            elif name == "rope.inv_freq":
                f.seek(len(header) + offset)
                f.write(expected_inv_freq(config).numpy().tobytes())
    return total


@pytest.mark.parametrize("fmt,pruned,gib", [("bf16", False, 61.73), ("int8_convrot", True, 19.53)],
                         ids=["bf16", "pruned-int8_convrot"])
def test_full_size_checkpoint_takes_seconds(tmp_path, fmt, pruned, gib):
    path = tmp_path / "full.safetensors"
    total = _sparse_full(path, fmt, pruned)
    # Published sizes of the released files; ours stores the curve-form AdaLN in fp32 (+0.08 GiB).
    assert abs(total / 2 ** 30 - gib) / gib < 0.01
    start = time.perf_counter()
    report = inspect_checkpoint(path)
    seconds = time.perf_counter() - start
    assert seconds < 10, f"inspect took {seconds:.1f} s"
    assert report["complete"] and report["config"]["num_layers"] == 50
    if pruned:
        assert report["quantization"]["formats"] == {"int8_convrot": 200}
        assert report["curve_table"]["shape"] == [1025, 8]
    else:
        assert report["logical_parameters"] == 33_122_992_896


def test_wrong_sized_nvfp4_and_weightless_layers_are_incomplete(files, tmp_path, capsys):
    from safetensors import safe_open

    with safe_open(str(files[("comfy", "nvfp4")]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    packed, scales, g = nvfp4.quantize(torch.randn(24, 48, generator=torch.Generator().manual_seed(2)))
    tensors.update({"blocks.0.mlp.fc2.weight": packed, "blocks.0.mlp.fc2.weight_scale": scales,
                    "blocks.0.mlp.fc2.weight_scale_2": g})
    del tensors["blocks.1.attn.out_proj.weight"]
    save_file(tensors, tmp_path / "misfit.safetensors", metadata=meta)
    code, out, _ = _run(capsys, tmp_path / "misfit.safetensors", "--out", tmp_path)
    assert code == 0
    report = json.loads((tmp_path / "misfit.inspect.json").read_text())
    assert not report["complete"]
    assert not report["layers"]["blocks.0.mlp.fc2"]["packed_shapes_consistent"]
    assert report["layers"]["blocks.1.mlp.fc2"]["packed_shapes_consistent"]
    assert report["nvfp4_mismatches"] == {
        "blocks.0.mlp.fc2": "NVFP4 weight is [32, 24], a logical 24x64 weight packs to [32, 32]"}
    assert report["weight_missing"] == ["blocks.1.attn.out_proj"] and report["unmapped"] == []
    assert "1 weight missing (e.g. blocks.1.attn.out_proj)" in out
    assert "1 NVFP4 layers with wrong packed sizes (e.g. blocks.0.mlp.fc2: NVFP4 weight is [32, 24]" in out


def _rewritten(source, path, change=None, metadata=None):
    from safetensors import safe_open

    with safe_open(str(source), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    if change:
        change(tensors)
    save_file(tensors, path, metadata={**meta, **(metadata or {})})
    return path


def test_a_file_the_headers_pass_and_the_loader_refuses_is_not_complete(files, tmp_path, capsys):
    """A layer's scale of the wrong size for its format: every name and weight shape is right (the header report
    alone said complete), the loader refuses it when it reads the layer; inspect now runs that check and names it,
    and the engine's pre-load checks (DitReader.check) refuse it before any weight is read."""
    from h3_spark.errors import CheckpointError
    from h3_spark.h3_model.checkpoint import open_dit

    def short_scale(tensors):
        tensors["blocks.0.attn.qkv_proj.weight_scale"] = torch.rand(95, 1) + 0.5

    path = _rewritten(files[("comfy", "int8_convrot")], tmp_path / "scales.safetensors", short_scale)
    report = inspect_checkpoint(path)
    assert report["missing"] == [] and report["unmapped"] == [] and not report["complete"]
    check = report["loader_check"]
    assert check["check"] == "DitReader.check" and check["passed"] is False
    assert check["error"].startswith(f"{path}: blocks.0.attn.qkv_proj") and "weight_scale" in check["error"], check
    code, out, _ = _run(capsys, path)
    assert code == 0 and f"INCOMPLETE: the loader refuses it (DitReader.check): {check['error']}" in out
    reader = open_dit(path)
    with pytest.raises(CheckpointError) as err:
        reader.check()
    reader.source.close()
    assert str(err.value) == check["error"]


@pytest.mark.parametrize("what, message", [
    ("group", "blocks.0.attn.qkv_proj: convrot_groupsize: ConvRot group size must be a power of 4 (4, 16, 64, "
              "256, ...), got 8"),
    ("group_text", "blocks.0.attn.qkv_proj: convrot_groupsize must be an integer, got 'four'"),
    ("metadata", "the safetensors metadata field _quantization_metadata is not JSON (Expecting property name "
                 "enclosed in double quotes at character 1)"),
])
def test_format_errors_name_their_layer_or_field(files, tmp_path, capsys, what, message):
    def marker(tensors):
        group = 8 if what == "group" else "four"
        tensors["blocks.0.attn.qkv_proj.comfy_quant"] = encode_marker(
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group})

    path = tmp_path / f"{what}.safetensors"
    if what == "metadata":
        _rewritten(files[("comfy", "int8_convrot")], path, metadata={"_quantization_metadata": "{not json"})
    else:
        _rewritten(files[("comfy", "int8_convrot")], path, marker)
    code, out, err = _run(capsys, path)
    assert code == 2 and err.strip() == f"h3-spark inspect: error: {message}", err
