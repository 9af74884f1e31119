"""`h3-spark make-checkpoint`: deterministic random weights, real names, every layout and format."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from h3_spark.cli import main
from h3_spark.h3_model.checkpoint import read_dit_config
from h3_spark.h3_model.checkpoint.comfy_layout import comfy_groups
from h3_spark.h3_model.checkpoint.make import pruned_config
from h3_spark.h3_model.dit.config import FULL, TINY


def _make(capsys, *argv) -> tuple[int, str, str]:
    code = main(["make-checkpoint", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("layout", ["comfy", "comfy-pruned"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_scaled", "nvfp4", "int8_convrot", "int4_convrot"])
def test_comfy_files_are_deterministic_and_named_like_comfyui(tmp_path, capsys, layout, fmt):
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    for path, seed in ((a, 0), (b, 0), (c, 1)):
        code, out, err = _make(capsys, path, "--format", fmt, "--layout", layout, "--seed", seed)
        assert code == 0, err
    summary = json.loads(out)
    assert summary["format"] == fmt and summary["layout"] == layout and summary["bytes"] == c.stat().st_size
    assert _digest(a) == _digest(b) != _digest(c)
    with safe_open(str(a), "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        assert "video_patch_proj.weight" in keys and "blocks.1.attn.qkv_proj.weight" in keys
        assert "blocks.0.mlp.fc1.weight" in keys and "final_layer.adaln_proj.linear.weight" in keys
        assert ("adaln_t_table" in keys) == (layout == "comfy-pruned")
        assert ("time_embedder.proj_in.weight" in keys) == (layout == "comfy")
        assert f.get_tensor("video_patch_proj.weight").dtype == torch.float32
        assert f.get_tensor("condition_proj.weight").dtype == torch.bfloat16
        markers = sorted(k for k in keys if k.endswith(".comfy_quant"))
        assert len(markers) == (0 if fmt == "bf16" else 4 * TINY.num_layers)
        assert all(k.startswith("blocks.") for k in markers)  # the refiner stays bf16 by default
        for k in keys:  # random, never zeros (markers and NVFP4 padding aside)
            t = f.get_tensor(k)
            if t.is_floating_point() and t.numel():
                assert t.float().abs().sum() > 0, k
        norm = f.get_tensor("blocks.0.norm1.weight").float()
        assert 0.7 < norm.mean() < 1.3
    assert json.loads(meta["h3_spark"])["seed"] == "0"
    expected = pruned_config(TINY, 33, 4) if layout == "comfy-pruned" else TINY
    assert read_dit_config(a) == expected


def test_quantize_refiner_and_curve_options(tmp_path, capsys):
    path = tmp_path / "r.safetensors"
    assert _make(capsys, path, "--format", "int8_convrot", "--layout", "comfy-pruned", "--quantize-refiner",
                 "--curve-grid", 17, "--curve-rank", 3)[0] == 0
    with safe_open(str(path), "pt") as f:
        assert sum(k.endswith(".comfy_quant") for k in f.keys()) == 4 * (TINY.num_layers + TINY.num_refiner_layers)
        assert list(f.get_tensor("adaln_t_table").shape) == [17, 3]
        assert list(f.get_tensor("blocks.0.adaln_proj.linear.weight").shape) == [6 * 3 * TINY.hidden_size, 3]


def test_diffusers_layout_is_a_folder(tmp_path, capsys):
    code, out, _ = _make(capsys, tmp_path / "transformer", "--layout", "diffusers")
    assert code == 0
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "MiniMaxH3Transformer3DModel" and config["hidden_size"] == TINY.hidden_size
    assert read_dit_config(tmp_path / "transformer") == TINY

    from diffusers import MiniMaxH3Transformer3DModel  # the oracle reads it too

    model = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path / "transformer")
    assert model.proj_in.weight.dtype == torch.float32


@pytest.mark.parametrize("argv,message", [
    (["--layout", "diffusers", "--format", "nvfp4"], "the diffusers layout holds bf16 weights only"),
    (["--layout", "comfy", "--curve-grid", "9"], "only apply to --layout comfy-pruned"),
    (["--layout", "comfy-pruned", "--curve-rank", "40"], "curve rank must lie in"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["--component", "vae", "--device", "cuda"], "--device applies to the DiT"),
])
def test_user_errors_are_one_line(tmp_path, capsys, argv, message):
    code, _, err = _make(capsys, tmp_path / "x.safetensors", *argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err and err.startswith("h3-spark make-checkpoint: error: ")


def test_comfy_layout_needs_a_file_name(tmp_path, capsys):
    code, _, err = _make(capsys, tmp_path / "folder", "--layout", "comfy")
    assert code == 2 and "ending in .safetensors" in err


def test_component_choice_is_parsed(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make-checkpoint", str(tmp_path / "x.safetensors"), "--component", "unet"])
    assert "invalid choice: 'unet'" in capsys.readouterr().err


def test_full_preset_streams_one_layer_at_a_time():
    """The full plan holds 33,122,992,896 parameters; producing one block linear needs only that layer."""
    from h3_spark.h3_model.checkpoint.make import curve_fit_for
    from h3_spark.h3_model.checkpoint.synthetic import random_param
    from h3_spark.h3_model.checkpoint.dit_reader import expected_shapes

    shapes = expected_shapes(FULL)
    requested = []

    def get(name):
        requested.append(name)
        return random_param(name, shapes[name], 0)

    groups = comfy_groups(FULL, get, "int8_convrot")
    planned = sum(torch.Size(s).numel() for g in groups for n, _, s in g.entries
                  if not n.endswith((".comfy_quant", ".weight_scale", "rope.inv_freq")))
    assert planned == 33_122_992_896
    assert requested == []  # planning reads nothing
    fc2 = next(g for g in groups if g.entries[0][0] == "blocks.7.mlp.fc2.weight")
    tensors = fc2.make()
    assert requested == ["transformer_blocks.7.ff.net.2.weight"]
    assert tensors["blocks.7.mlp.fc2.weight"].dtype == torch.int8
    assert list(tensors["blocks.7.mlp.fc2.weight_scale"].shape) == [5376, 1]
    assert json.loads(bytes(tensors["blocks.7.mlp.fc2.comfy_quant"].tolist())) == \
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    fit = curve_fit_for(FULL, 0, 1025, 8)
    assert fit.table.shape == (1025, 8) and fit.residual < 1e-3


@pytest.mark.parametrize("fmt, parts, marker", [
    ("int4_convrot", {"weight": ("I8", [5376, 3584]), "weight_scale": ("F32", [5376])},
     {"format": "convrot_w4a4", "convrot_groupsize": 256}),
    ("w4a8", {"weight": ("I8", [5376, 3584]), "weight_s_rel": ("F8_E4M3", [5376, 448]),
              "weight_s_channel": ("F32", [5376]), "weight_codebook": ("F32", [16])},
     {"format": "asym_w4a8_int8", "group_size": 16, "convrot": True, "convrot_groupsize": 256}),
    ("w4a8_asym", {"weight": ("I8", [5376, 3584]), "weight_s_rel": ("F8_E4M3", [5376, 448]),
                   "weight_s_channel": ("F32", [5376]), "weight_correction": ("BF16", [448, 5376])},
     {"format": "asym_w4a8_int8", "group_size": 16, "convrot": True, "convrot_groupsize": 256}),
])
def test_full_preset_four_bit_plan_is_the_published_form(fmt, parts, marker):
    """Header facts only (nothing drawn): every block linear of the full DiT in the format, with the tensors and
    the marker the published files carry, and the plan's entries are what a made layer holds."""
    from h3_spark.h3_model.checkpoint.safetensors_header import TORCH_TO_ST

    groups = comfy_groups(FULL, lambda name: pytest.fail(f"planning drew {name}"), fmt)
    out_proj = next(g for g in groups if g.entries[0][0] == "blocks.7.attn.out_proj.weight")
    planned = {name.rsplit(".", 1)[1]: (dtype, list(shape)) for name, dtype, shape in out_proj.entries}
    assert planned == {**parts, "comfy_quant": ("U8", [len(json.dumps(marker))])}
    markers = [e for g in groups for e in g.entries if e[0].endswith(".comfy_quant")]
    assert len(markers) == 4 * FULL.num_layers
    # A made layer holds what was planned (a 64-row slice of the weight stands in for the 5376 rows).
    from h3_spark.h3_model.checkpoint.quant import four_bit_tensors
    made = four_bit_tensors(fmt, "x", torch.randn(64, 7168) * 0.02, marker)
    for suffix, (dtype, shape) in parts.items():
        got = made[f"x.{suffix}"]
        assert TORCH_TO_ST[got.dtype] == dtype and list(got.shape) == [64 if s == 5376 else s for s in shape], suffix
    assert json.loads(bytes(made["x.comfy_quant"].tolist())) == marker


@pytest.mark.parametrize("component,layout", [("vae", "comfy"), ("vae", "diffusers"), ("audio_vae", "comfy"),
                                              ("audio_vae", "diffusers")])
def test_make_vae_components_inspect_complete_and_load(tmp_path, capsys, component, layout):
    import json as _json

    from h3_spark.cli import main as cli_main
    from h3_spark.h3_model.vae.loading import load_audio_vae, load_video_vae

    out = tmp_path / (f"{component}.safetensors" if layout == "comfy" else component)
    assert cli_main(["make-checkpoint", "--component", component, "--layout", layout, str(out)]) == 0
    made = _json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert made["component"] == component and made["bytes"] > 0
    assert cli_main(["inspect", str(out), "--out", str(tmp_path)]) == 0
    report = _json.loads(next(tmp_path.glob("*.inspect.json")).read_text())
    assert report["complete"] is True, report.get("missing")
    loader = load_video_vae if component == "vae" else load_audio_vae
    model = loader(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_make_vae_refuses_dit_options(tmp_path, capsys):
    from h3_spark.cli import main as cli_main

    assert cli_main(["make-checkpoint", "--component", "vae", "--format", "nvfp4", str(tmp_path / "v.safetensors")]) == 2
    assert "--component vae is written as published (leave --format out) or as int8_convrot (ComfyUI's quantized " \
        "video VAE), not --format nvfp4" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["fp8_scaled", "nvfp4", "int8_convrot", "int4_convrot", "w4a8", "w4a8_sym",
                                 "w4a8_asym"])
@pytest.mark.parametrize("pruned", [False, True])
def test_quantized_layers_are_made_on_the_weights_device(fmt, pruned):
    """make-checkpoint --device cuda draws and quantizes on the GPU. Checked here with meta tensors: any
    intermediate allocated on the CPU would meet a meta tensor and raise; every weight-derived output
    stays on the weights' device (only markers, inv_freq and the curve table are made on the CPU)."""
    from h3_spark.h3_model.checkpoint.dit_reader import expected_shapes
    from h3_spark.h3_model.checkpoint.make import curve_fit_for

    shapes = expected_shapes(TINY)
    fit = curve_fit_for(TINY, 0, 16, 4) if pruned else None
    groups = comfy_groups(pruned_config(TINY, 16, 4) if pruned else TINY,
                          lambda name: torch.empty(shapes[name], device="meta"), fmt, fit=fit)
    on_cpu = set()
    for group in groups:
        for name, tensor in group.make().items():
            if tensor.device.type == "cpu":
                on_cpu.add(name.rsplit(".", 1)[-1])
    assert on_cpu == {"comfy_quant", "inv_freq"} | ({"adaln_t_table"} if pruned else set())


@pytest.mark.parametrize("argv,message", [
    (["--layout", "comfy-pruned", "--curve-grid", "0"], "--curve-grid must be at least 2 (rows of adaln_t_table), got 0"),
    (["--layout", "comfy-pruned", "--curve-grid", "1"], "--curve-grid must be at least 2 (rows of adaln_t_table), got 1"),
    (["--layout", "comfy-pruned", "--curve-rank", "0"],
     "--curve-rank must be at least 1 (columns of adaln_t_table), got 0"),
    (["--component", "vae", "--curve-grid", "0"], "--component vae takes only --preset"),
])
def test_curve_sizes_below_the_minimum_are_refused(tmp_path, capsys, argv, message):
    # 0 once meant "the default" (`0 or default`): an explicit value is now taken as typed, or refused.
    code, _, err = _make(capsys, tmp_path / "x.safetensors", *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "x.safetensors").exists()


def test_an_existing_file_is_replaced_only_with_force(tmp_path, capsys):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old checkpoint")
    code, _, err = _make(capsys, path)
    assert code == 2 and f"{path} exists and is not empty; pass --force to replace it" in err
    assert path.read_bytes() == b"old checkpoint"
    assert _make(capsys, path, "--force")[0] == 0
    assert read_dit_config(path) == TINY


def _old_sharded_folder(folder):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "diffusion_pytorch_model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text('{"weight_map": {}}')


def test_a_sharded_folder_is_replaced_only_with_force(tmp_path, capsys):
    # The old index would win over the new single file when the folder is read.
    folder = tmp_path / "transformer"
    _old_sharded_folder(folder)
    code, _, err = _make(capsys, folder, "--layout", "diffusers")
    assert code == 2 and "exists and is not empty; pass --force to replace it" in err
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert _make(capsys, folder, "--layout", "diffusers", "--force")[0] == 0
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert read_dit_config(folder) == TINY


def test_force_keeps_the_old_checkpoint_when_the_writer_refuses(tmp_path, capsys):
    folder = tmp_path / "transformer"
    _old_sharded_folder(folder)
    before = sorted(p.name for p in folder.iterdir())
    code, _, err = _make(capsys, folder, "--layout", "diffusers", "--format", "nvfp4", "--force")
    assert code == 2 and "the diffusers layout holds bf16 weights only" in err
    assert sorted(p.name for p in folder.iterdir()) == before
    assert (folder / "diffusion_pytorch_model-00001-of-00002.safetensors").read_bytes() == b"old shard"


@pytest.mark.parametrize("component", ["dit", "vae"])
def test_force_never_removes_what_is_not_a_checkpoint_file(tmp_path, capsys, component):
    folder = tmp_path / "out"
    _old_sharded_folder(folder)
    (folder / "notes.txt").write_text("mine")
    code, _, err = _make(capsys, folder, "--component", component, "--layout", "diffusers", "--force")
    assert code == 2 and "also holds notes.txt; choose another folder" in err
    assert len(list(folder.iterdir())) == 4


@pytest.mark.parametrize("layout,name,message", [
    ("diffusers", "file", "is a file; the diffusers layout writes a folder"),
    ("comfy", "dir.safetensors", "is a folder; the comfy layout writes one .safetensors file"),
])
def test_an_output_of_the_wrong_kind_is_refused(tmp_path, capsys, layout, name, message):
    out = tmp_path / name
    if layout == "comfy":
        out.mkdir()
    else:
        out.write_text("x")
    code, _, err = _make(capsys, out, "--layout", layout, "--force")
    assert code == 2 and message in err and "Traceback" not in err


def test_an_empty_folder_needs_no_force_and_help_names_force(tmp_path, capsys):
    (tmp_path / "transformer").mkdir()
    assert _make(capsys, tmp_path / "transformer", "--layout", "diffusers")[0] == 0
    with pytest.raises(SystemExit):
        main(["make-checkpoint", "--help"])
    assert "--force" in capsys.readouterr().out
