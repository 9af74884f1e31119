"""Today's official download: FL2VA/ and Ref2VA/ mode folders, MiniMaxAI's own VAE folders, sharded DiTs.

Synthetic files under the real names, shapes and configs (written by our writers, read by the real loaders):
- the VAE configs round-trip through MiniMaxAI's field names, and the released model's files say exactly what
  the published ones say;
- one seed gives the same weights whether written in the released layout or diffusers' (so every conversion on
  the way, per-head qkv, [gate; value], weight_g / weight_v, is exact); the DiT's qkv order is found from its
  config.json;
- the engine finds every component in the per-mode tree, and `h3-spark generate --models ROOT` makes the same
  latents from it as from the older root layout holding the same weights;
- model_index.json gives the partition, the tokenizer folder and the shifts; inspect reads every component folder
  and picks a DiT by --partition from the root or a mode folder;
- a config.json that contradicts its tensors, a missing shard or components that do not fit are refused in one
  line naming the file and field, before any component starts loading.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.engine.demo import DEMO_VAE, DIT_CONFIG, build_demo_models, write_text_encoder
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.checkpoint.released import write_released_dit, write_released_models
from h3_spark.h3_model.engine.engine import Engine
from h3_spark.h3_model.engine.paths import ComponentPaths
from h3_spark.h3_model.vae import audio as A
from h3_spark.h3_model.vae import released
from h3_spark.h3_model.vae import video_config as VC
from h3_spark.h3_model.vae.loading import load_audio_vae, load_video_vae
from h3_spark.h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# ------------------------------------------------------------------------------------------ configs
def test_the_released_video_config_reads_as_published():
    full = VC.FULL
    wrapper, source = released.video_files(full)
    # The published values (MiniMaxAI/MiniMax-H3, FL2VA/video_vae/source/config.json and config.json).
    assert source["ch"] == 128 and source["ch_mult"] == [1, 2, 2, 4, 4, 8]
    assert source["space_down"] == [2, 2, 2, 2, 1, 1] and source["time_down"] == [1, 2, 2, 1, 1, 1]
    assert source["vae_ratio"] == 16 and source["vae_ratio_t"] == 4 and source["z_channels"] == 24
    assert source["vit_decoder_kwargs"] == {"dim_head": 64, "ffn_activation_fn": "silu", "ffn_use_gated": True,
                                            "heads": 32, "norm_affine": True, "norm_type": "rms_norm",
                                            "num_layers": 36, "qk_norm_affine": False, "qk_norm_type": "rms_norm",
                                            "rope_dim_ratio": 0.75, "rope_theta": 100.0}
    assert "norm_num_groups" not in source  # a constant of MiniMaxAI's code, not a field of the file
    assert wrapper["_class_name"] == "MiniMaxH3VideoVAE" and wrapper["source_path"] == "source"
    assert (wrapper["vae_clip_length"], wrapper["vae_token_drop"]) == (17, 3)


def test_video_config_round_trips_through_the_released_files(tmp_path):
    cfg = VC.VideoVAEConfig.from_dict({**DEMO_VAE.to_dict(), "latents_mean": [0.5, -0.25, 0.125, 1.5],
                                       "latents_std": [1.5, 0.75, 2.0, 0.5]})
    wrapper, source = released.video_files(cfg)
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "config.json").write_text(json.dumps(source))
    assert released.video_config(tmp_path, wrapper) == cfg


def test_the_released_audio_config_reads_as_published(tmp_path):
    cfg = A.AudioVAEConfig(latents_mean=tuple(0.1 * i for i in range(32)), latents_std=(1.25,) * 32)
    wrapper, yaml_text, metadata = released.audio_files(cfg)
    assert metadata == {"metadata": {"kwargs": {
        "attn_proj": True, "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2], "decoder_type": "bigvgan",
        "encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "sample_rate": 32000,
        "vae_latent_channels": 32}}}
    assert wrapper["_class_name"] == "MiniMaxH3AudioVAE" and wrapper["output_channel"] == 2
    (tmp_path / "config.yaml").write_text(yaml_text)
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    assert released.audio_config(tmp_path, wrapper) == cfg


def test_audio_config_files_that_disagree_are_refused(tmp_path):
    cfg = A.AudioVAEConfig(latents_mean=(0.0,) * 32, latents_std=(1.0,) * 32)
    wrapper, yaml_text, metadata = released.audio_files(cfg)
    (tmp_path / "config.yaml").write_text(yaml_text.replace("decoder_dim: 1024", "decoder_dim: 512"))
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="says decoder_dim 1024 but .*config.yaml says decoder_dim 512"):
        released.audio_config(tmp_path, wrapper)
    (tmp_path / "config.yaml").write_text(yaml_text)
    metadata["metadata"]["kwargs"]["decoder_type"] = "hifigan"
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match="decoder_type 'hifigan'"):
        released.audio_config(tmp_path, wrapper)


# ------------------------------------------------------------------------------------------ VAE weights
def test_released_video_vae_loads_the_weights_the_diffusers_folder_holds(tmp_path):
    ours = write_vae_checkpoint(tmp_path / "video_vae", DEMO_VAE, "released", seed=3)
    theirs = write_vae_checkpoint(tmp_path / "vae", DEMO_VAE, "diffusers", seed=3)
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*") if p.is_file()) == [
        "config.json", "source/config.json", "source/model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(ours / "source" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "decoder.transformer_blocks.0.attn.to_qkv.weight" in keys and "decoder.x_embedder.weight" in keys
        assert "latents_mean" not in keys and "decoder.mask_token" in keys
        assert {f.get_tensor(k).dtype for k in keys} == {torch.float32}
    a = load_video_vae(ours, decode_dtype=torch.float32)
    b = load_video_vae(theirs, decode_dtype=torch.float32)
    assert a.config == b.config
    _same_state(a, b)
    # The mode folder that holds video_vae/ is found too.
    assert load_video_vae(tmp_path, decode_dtype=torch.float32).config == a.config


def test_released_audio_vae_loads_the_weights_the_diffusers_folder_holds(tmp_path):
    ours = write_audio_vae_checkpoint(tmp_path / "audio_vae", "tiny", "released", seed=5)
    theirs = write_audio_vae_checkpoint(tmp_path / "diffusers_audio", "tiny", "diffusers", seed=5)
    assert sorted(p.name for p in ours.iterdir()) == ["config.json", "config.yaml", "metadata.json",
                                                     "model.safetensors"]
    a, b = load_audio_vae(ours), load_audio_vae(theirs)
    assert a.config == b.config and a.config.latents_mean is not None
    _same_state(a, b)
    wave = torch.randn(2, a.config.hop_length * 8, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    assert torch.equal(a.encode_stereo(wave), b.encode_stereo(wave))


def test_a_released_folder_naming_missing_or_pickle_weights_is_refused(tmp_path):
    folder = write_vae_checkpoint(tmp_path / "video_vae", DEMO_VAE, "released", seed=0)
    wrapper = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**wrapper, "source_safetensors_path": "model.bin"}))
    with pytest.raises(CheckpointError, match="must name a .safetensors file .*got model.bin"):
        load_video_vae(folder)
    (folder / "source" / "model.safetensors").rename(folder / "source" / "moved.safetensors")
    (folder / "config.json").write_text(json.dumps(wrapper))
    with pytest.raises(CheckpointError, match="source/model.safetensors, which is missing"):
        load_video_vae(folder)


def test_a_released_video_config_for_another_network_is_refused(tmp_path):
    folder = write_vae_checkpoint(tmp_path / "video_vae", DEMO_VAE, "released", seed=0)
    source = json.loads((folder / "source" / "config.json").read_text())
    (folder / "source" / "config.json").write_text(json.dumps({**source, "causal_decoder": True}))
    with pytest.raises(CheckpointError, match="causal_decoder is True; the H3 video VAE this engine runs has False"):
        load_video_vae(folder)


# ------------------------------------------------------------------------------------------ DiT
def test_released_dit_folder_is_sharded_interleaved_and_loads_like_diffusers(tmp_path):
    folder = tmp_path / "transformer"
    write_released_dit(folder, DIT_CONFIG, seed=4)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    assert "blocks.0.attn.qkv_proj.weight" in index["weight_map"]
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "MiniMaxH3DiTModel"
    assert open_dit(folder).qkv_layout == "interleaved"
    make_dit_checkpoint(tmp_path / "diffusers", DIT_CONFIG, "bf16", "diffusers", seed=4)
    ours = load_dit(folder, dtype=torch.float32)
    theirs = load_dit(tmp_path / "diffusers", dtype=torch.float32)
    assert ours.config == theirs.config
    _same_state(ours, theirs)
    # The order matters: read as Comfy-Org's stacked order, the same file gives other attention weights.
    stacked = load_dit(folder, dtype=torch.float32, qkv_layout="stacked")
    assert not torch.equal(stacked.transformer_blocks[0].attn.to_q.weight,
                           theirs.transformer_blocks[0].attn.to_q.weight)


@pytest.fixture(scope="module")
def released_dit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("released-dit") / "transformer"
    write_released_dit(folder, DIT_CONFIG, seed=4)
    return folder


def _dit_with_config(released_dit, tmp_path, **changes) -> Path:
    folder = tmp_path / "transformer"
    shutil.copytree(released_dit, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


# DIT_CONFIG: hidden 24, 2 blocks, 2 heads of 16, 4 latent channels in 1x2x2 patches (16 inputs), 2 refiner blocks.
@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 64}, "hidden_size is 64 but the weights say 24 (video_patch_proj.weight is [24, 16])"),
    ({"num_layers": 3}, "num_layers is 3 but the weights say 2 (blocks.0 to blocks.1)"),
    ({"num_attention_heads": 4}, "num_attention_heads is 4 but the weights say 2 (blocks.0.attn.qkv_proj.weight is "
                                 "[96, 24])"),
    ({"patch_size": [1, 4, 4]}, "latents_dim 4 and patch_size [1, 4, 4] make 64 inputs per patch, but the weights "
                                "have 16 (video_patch_proj.weight is [24, 16])"),
    ({"latents_dim": 8}, "latents_dim 8 and patch_size [1, 2, 2] make 32 inputs per patch"),
    ({"token_refiner_num_layers": 1}, "token_refiner_num_layers is 1 but the weights say 2 (token_refiner.blocks.0 "
                                      "to token_refiner.blocks.1)"),
    ({"ffn_hidden_size": 32}, "ffn_hidden_size is 32 but the weights say 64 (blocks.0.mlp.fc1.weight is [128, 24])"),
    ({"text_dim": 16}, "text_dim is 16 but the weights say 32 (condition_proj.weight is [24, 32])"),
    ({"adaln_out_features": 96768}, "adaln_out_features is 96768 but the weights say 432 "
                                    "(blocks.0.adaln_proj.linear.weight is [432, 16])"),
    ({"patch_size": [1, 2]}, "patch_size must be three positive integers, got [1, 2]"),
])
def test_a_released_dit_config_that_disagrees_with_the_weights_is_refused(released_dit, tmp_path, changes, message):
    folder = _dit_with_config(released_dit, tmp_path, **changes)
    with pytest.raises(CheckpointError) as info:
        open_dit(folder)
    text = str(info.value)
    assert text.startswith(f"{folder / 'config.json'}: ") and message in text and "\n" not in text


def test_a_released_dit_config_gives_what_the_shapes_cannot(released_dit, tmp_path):
    # Epsilons and the RoPE base leave no trace in the tensors: they are the file's.
    assert open_dit(released_dit).config == DIT_CONFIG
    folder = _dit_with_config(released_dit, tmp_path, norm_eps=1e-6, qk_norm_eps=2e-6, final_norm_eps=3e-6)
    config = open_dit(folder).config
    assert (config.norm_eps, config.qk_norm_eps, config.final_norm_eps) == (1e-6, 2e-6, 3e-6)
    assert config.hidden_size == DIT_CONFIG.hidden_size


def test_a_lone_original_named_file_still_defaults_to_stacked(tmp_path):
    path = tmp_path / "h3.safetensors"
    make_dit_checkpoint(path, DIT_CONFIG, "bf16", "comfy", seed=4)
    assert open_dit(path).qkv_layout == "stacked"


# ------------------------------------------------------------------------------------------ the tree
@pytest.fixture(scope="module")
def released_root(tmp_path_factory):
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    root = tmp_path_factory.mktemp("MiniMax-H3")
    # The demo's seeds: FL2VA's DiT seed 0, Ref2VA's seed 1, the VAEs and the text encoder seed 0.
    # The text encoder in shards, as the released one (14 of them).
    return write_released_models(root, DIT_CONFIG, DEMO_VAE, "tiny",
                                 lambda folder: write_text_encoder(folder, 0, "100KB"))


def test_the_engine_finds_every_component_of_the_per_mode_download(released_root):
    paths = ComponentPaths(models=released_root)
    assert paths.layout() == "per-mode"
    plan = Engine(paths).plan()
    assert plan == {"dit": released_root / "FL2VA" / "transformer",
                    "dit_ref": released_root / "Ref2VA" / "transformer",
                    "text_encoder": released_root / "FL2VA" / "text_encoder",
                    "vae": released_root / "FL2VA" / "video_vae", "audio_vae": released_root / "FL2VA" / "audio_vae"}
    # model_index.json names tokenizer/ (the Qwen3-VL processor's configs are found in processor/ beside it).
    assert paths.resolve("tokenizer") == released_root / "FL2VA" / "tokenizer"
    # One mode folder on its own: its model_index.json says which DiT it holds.
    ref_only = Engine(ComponentPaths(models=released_root / "Ref2VA")).plan()
    assert set(ref_only) == {"dit_ref", "text_encoder", "vae", "audio_vae"}
    assert ref_only["vae"] == released_root / "Ref2VA" / "video_vae"
    with pytest.raises(InputError, match="t2va needs the FL2VA/transformer/ DiT: pass --models or --dit"):
        Engine(ComponentPaths(models=released_root / "Ref2VA")).plan(["t2va"])


def _mode_copy(released_root: Path, where: Path, mode: str = "FL2VA", *, index: dict | None = None,
               leave_out: tuple[str, ...] = (), copied: tuple[str, ...] = ()) -> Path:
    """A mode folder under `where` whose components are links to the released ones (copies for those in
    `copied`, to be changed), with its own model_index.json (`index` replaces the published one's entries) and
    without the folders in `leave_out`."""
    folder = where / mode
    folder.mkdir(parents=True)
    for child in (released_root / mode).iterdir():
        if child.name in copied:
            shutil.copytree(child, folder / child.name)
        elif child.name not in leave_out and child.name != "model_index.json":
            (folder / child.name).symlink_to(child, target_is_directory=child.is_dir())
    published = json.loads((released_root / mode / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**published, **(index or {})}))
    return folder


def test_the_tokenizer_is_the_folder_model_index_names(released_root, tmp_path):
    from h3_spark.h3_model.engine.loading import LoadOptions, component_loader

    opts = LoadOptions(text_layer=2, kernels=None)
    paths = ComponentPaths(models=released_root / "FL2VA")
    te = component_loader("text_encoder", paths.resolve("text_encoder"), opts, paths.resolve("tokenizer"))()
    assert Path(te.tokenizer.name_or_path) == released_root / "FL2VA" / "tokenizer"
    ids = te.tokenizer("a paper boat")["input_ids"]
    # A folder without tokenizer/ (or whose model_index.json names none) is read from processor/, as before.
    for name, kwargs in (("no-folder", {"leave_out": ("tokenizer",)}), ("not-named", {"index": {"tokenizer": None}})):
        folder = _mode_copy(released_root, tmp_path / name, **kwargs)
        paths = ComponentPaths(models=folder)
        assert paths.resolve("tokenizer") == folder / "processor"
        te = component_loader("text_encoder", paths.resolve("text_encoder"), opts, paths.resolve("tokenizer"))()
        assert Path(te.tokenizer.name_or_path) == folder / "processor"
        assert te.tokenizer("a paper boat")["input_ids"] == ids


def test_the_shifts_are_read_from_model_index(released_root, tmp_path):
    assert ComponentPaths(models=released_root).sigma_shifts("dit") == (12.0, 3.0)
    assert ComponentPaths(models=released_root).sigma_shifts("dit_ref") == (12.0, 3.0)
    folder = _mode_copy(released_root, tmp_path / "root", index={"_minimax_h3": {
        "partition": "fl2va", "tasks": ["t2va", "fl2va"], "sigma_shift_scales": {"video": 6.5, "audio": 2}}})
    _mode_copy(released_root, tmp_path / "root", "Ref2VA")
    paths = ComponentPaths(models=tmp_path / "root")
    # Each mode folder speaks for its own DiT; a DiT given on its own samples with the released 12 and 3.
    assert paths.sigma_shifts("dit") == (6.5, 2.0) and paths.sigma_shifts("dit_ref") == (12.0, 3.0)
    assert ComponentPaths(models=folder, dit=folder / "transformer").sigma_shifts("dit") is None
    without = _mode_copy(released_root, tmp_path / "without", index={"_minimax_h3": {"partition": "fl2va"}})
    assert ComponentPaths(models=without).sigma_shifts("dit") is None


@pytest.mark.parametrize("scales, message", [
    ({"video": -1, "audio": 3}, "_minimax_h3.sigma_shift_scales.video must be a positive number, got -1"),
    ({"video": 12}, "_minimax_h3.sigma_shift_scales.audio must be a positive number, got None"),
    ({"video": "12", "audio": 3}, "_minimax_h3.sigma_shift_scales.video must be a positive number, got '12'"),
    ([12, 3], "_minimax_h3.sigma_shift_scales must be an object with video and audio, got [12, 3]"),
])
def test_bad_shifts_in_model_index_are_refused(released_root, tmp_path, scales, message):
    folder = _mode_copy(released_root, tmp_path, index={"_minimax_h3": {"partition": "fl2va",
                                                                         "sigma_shift_scales": scales}})
    with pytest.raises(CheckpointError) as info:
        ComponentPaths(models=folder).sigma_shifts("dit")
    assert str(info.value) == f"{folder / 'model_index.json'}: {message}"


def test_generate_samples_with_the_shifts_of_model_index(released_root, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from h3_spark.cli import main

    # The fused row kernels would run in Triton's CPU interpreter: minutes for nothing this test looks at.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")

    root = tmp_path / "root"
    _mode_copy(released_root, root, index={"_minimax_h3": {
        "partition": "fl2va", "tasks": ["t2va", "fl2va"], "sigma_shift_scales": {"video": 5.0, "audio": 1.5}}})
    runs = {}
    for name, models, extra in (("index", root, []), ("given", released_root, ["--video-shift", "5", "--audio-shift",
                                                                                 "1.5"]),
                                ("published", released_root, [])):
        latents = tmp_path / f"{name}.safetensors"
        code = main(["generate", "--models", str(models), "--prompt", "a boat", "--steps", "3", "--width", "64",
                     "--height", "64", "--text-encoder-layer", "2", "--device", "cpu", "--out",
                     str(tmp_path / f"{name}.mp4"), "--save-latents", str(latents), *extra])
        assert code == 0, capsys.readouterr().err
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        runs[name] = summary, load_file(str(latents))
    assert (runs["index"][0]["video_shift"], runs["index"][0]["audio_shift"]) == (5.0, 1.5)
    assert (runs["published"][0]["video_shift"], runs["published"][0]["audio_shift"]) == (12.0, 3.0)
    for key in ("video_latents", "audio_latents"):
        assert torch.equal(runs["index"][1][key], runs["given"][1][key])
        assert not torch.equal(runs["index"][1][key], runs["published"][1][key])


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _refused_before_loading(folder: Path, message: str, error=CheckpointError) -> str:
    """Engine.load of `folder` fails with `message` (one line) before any component starts loading."""
    from h3_spark.h3_model.engine.loading import LoadOptions

    events = []
    with pytest.raises(error) as info:
        Engine(ComponentPaths(models=folder), LoadOptions(text_layer=2)).load(["t2va"], events.append)
    text = str(info.value)
    assert events == [] and "\n" not in text, (events, text)
    assert message in text, text
    return text


def _te_index_shard(folder: Path) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))[1]


def test_a_missing_text_encoder_shard_is_found_at_plan_time(released_root, tmp_path):
    folder = _mode_copy(released_root, tmp_path, copied=("text_encoder",))
    shard = _te_index_shard(folder / "text_encoder")
    (folder / "text_encoder" / shard).unlink()
    _refused_before_loading(folder, f"{folder / 'text_encoder' / 'model.safetensors.index.json'}: lists shard "
                                    f"{shard}, which is missing")


def test_a_wrong_text_encoder_config_is_found_at_plan_time(released_root, tmp_path):
    folder = _mode_copy(released_root, tmp_path, copied=("text_encoder",))
    config = folder / "text_encoder" / "config.json"
    for field, value, message in (
            ("hidden_size", 48, "text_config.hidden_size is 48 but the weights say 32 "
                                "(model.language_model.embed_tokens.weight is [271, 32])"),
            ("intermediate_size", 40, "text_config.intermediate_size is 40 but the weights say 48 "
                                      "(model.language_model.layers.0.mlp.up_proj.weight is [48, 32])"),
            ("num_key_value_heads", 4, "text_config.num_key_value_heads is 4 but the weights say 2")):
        original = config.read_text()
        _edit_json(config, lambda d: d["text_config"].__setitem__(field, value))
        assert _refused_before_loading(folder, message).startswith(f"{config}: ")
        config.write_text(original)


def test_missing_or_disagreeing_video_vae_files_are_found_at_plan_time(released_root, tmp_path):
    folder = _mode_copy(released_root, tmp_path, copied=("video_vae",))
    vae = folder / "video_vae"
    source = json.loads((vae / "source" / "config.json").read_text())
    _edit_json(vae / "source" / "config.json", lambda d: d.__setitem__("embed_dim", 8))
    _refused_before_loading(folder, f"{vae / 'source' / 'config.json'}: embed_dim is 8 but z_channels is 4; the "
                                    "latent channels must agree")
    (vae / "source" / "config.json").write_text(json.dumps(source))
    _edit_json(vae / "config.json", lambda d: d.__setitem__("latent_channels", 8))
    _refused_before_loading(folder, f"{vae / 'config.json'}: latent_channels is 8 but "
                                    f"{vae / 'source' / 'config.json'} says z_channels 4")
    _edit_json(vae / "config.json", lambda d: d.__setitem__("latent_channels", 4))
    # Both configs say 8 channels: the weights say 4.
    _edit_json(vae / "source" / "config.json", lambda d: d.update(z_channels=8, embed_dim=8))
    _edit_json(vae / "config.json", lambda d: d.update(latent_channels=8, latents_mean=[0.0] * 8,
                                                       latents_std=[1.0] * 8))
    _refused_before_loading(folder, f"{vae}: the config's latent channels (z_channels) are 8 but the weights have 4 "
                                    "(post_quant_conv.weight is [4, 4, 1, 1, 1])")
    shutil.rmtree(vae / "source")
    _refused_before_loading(folder, f"{vae / 'config.json'}: source_path names source/, which is missing")


def test_audio_vae_files_that_disagree_are_found_at_plan_time(released_root, tmp_path):
    folder = _mode_copy(released_root, tmp_path, copied=("audio_vae",))
    yaml_path = folder / "audio_vae" / "config.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("decoder_dim: ", "decoder_dim: 1"))
    _refused_before_loading(folder, f"{folder / 'audio_vae' / 'metadata.json'} says decoder_dim ")


def test_a_dit_config_that_disagrees_is_found_at_plan_time(released_root, tmp_path):
    folder = _mode_copy(released_root, tmp_path, copied=("transformer",))
    _edit_json(folder / "transformer" / "config.json", lambda d: d.__setitem__("hidden_size", 64))
    _refused_before_loading(folder, f"{folder / 'transformer' / 'config.json'}: hidden_size is 64 but the weights "
                                    "say 24")


@pytest.mark.parametrize("change, message", [
    ({"text_dim": 48}, "has hidden size 32 but the DiT {dit} reads 48 (text_dim)"),
    ({"in_channels": 8}, "has latent channels 4 but the DiT {dit} reads 8 (in_channels)"),
    ({"audio_in_channels": 16}, "has latent channels 8 but the DiT {dit} reads 16 (audio_in_channels)"),
])
def test_components_that_do_not_fit_are_found_at_plan_time(released_root, tmp_path, change, message):
    import dataclasses

    folder = _mode_copy(released_root, tmp_path, leave_out=("transformer",))
    write_released_dit(folder / "transformer", dataclasses.replace(DIT_CONFIG, **change), seed=0)
    _refused_before_loading(folder, message.format(dit=folder / "transformer"), InputError)


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    from h3_spark.cli import main

    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_reads_every_component_folder_of_the_per_mode_download(released_root, tmp_path, capsys):
    reports = tmp_path / "reports"
    for name, model in (("video_vae", "video_vae"), ("audio_vae", "audio_vae"), ("text_encoder", "text_encoder"),
                        ("transformer", "dit")):
        code, out, err = _inspect(capsys, str(released_root / "FL2VA" / name), "--out", str(reports))
        assert code == 0, err
        report = json.loads((reports / f"{name}.inspect.json").read_text())
        assert report["model"] == model and report["complete"], (name, report.get("missing"))
        assert "  complete" in out.splitlines()  # then what only the file name says, and the report line
    # The video VAE's weights are the file its config.json names (source/model.safetensors).
    video = json.loads((reports / "video_vae.inspect.json").read_text())
    assert [f["name"] for f in video["files"]] == ["model.safetensors"]
    assert video["structure"]["decoder_blocks"] == DEMO_VAE.decoder_num_layers


def test_inspect_picks_the_partition_from_the_mode_folders(released_root, tmp_path, capsys):
    reports = tmp_path / "reports"
    for where, partition, folder in ((released_root, "t2va", "FL2VA"), (released_root, "fl2va", "FL2VA"),
                                     (released_root, "ref2va", "Ref2VA"),
                                     (released_root / "Ref2VA", "ref2va", "Ref2VA"),
                                     (released_root / "FL2VA", "t2va", "FL2VA")):
        code, out, err = _inspect(capsys, str(where), "--partition", partition, "--out", str(reports))
        assert code == 0, err
        report = json.loads((reports / f"{where.name}.{partition}.inspect.json").read_text())
        assert report["path"] == str(where / "transformer" if where.name == folder else where / folder / "transformer")
        assert report["complete"] and report["qkv_layout_assumed"] == "interleaved"
    # The two DiTs are different weights: the reports' first layer says nothing of that, the files do.
    t2va = json.loads((reports / f"{released_root.name}.t2va.inspect.json").read_text())
    ref2va = json.loads((reports / f"{released_root.name}.ref2va.inspect.json").read_text())
    assert t2va["path"] != ref2va["path"] and t2va["config"] == ref2va["config"]


@pytest.mark.parametrize("where, partition, message", [
    ("", None, "holds FL2VA/ and Ref2VA/; choose the partition: t2va (or fl2va) for FL2VA/transformer/, ref2va for "
               "Ref2VA/transformer/ (--partition on the command line)"),
    ("FL2VA", "ref2va", "FL2VA: holds the t2va DiT (FL2VA/model_index.json says so); the ref2va DiT of "
                        "partition='ref2va' is in the Ref2VA/transformer/ folder of the download"),
    ("Ref2VA", "fl2va", "Ref2VA: holds the ref2va DiT (Ref2VA/model_index.json says so); the t2va DiT of "
                        "partition='fl2va' is in the FL2VA/transformer/ folder of the download"),
    ("Ref2VA/transformer", "t2va", "holds the ref2va DiT (Ref2VA/model_index.json says so) but partition='t2va' "
                                   "asks for the t2va one, which is in FL2VA/transformer/"),
])
def test_inspect_refuses_the_other_partition_in_the_per_mode_words(released_root, tmp_path, capsys, where, partition,
                                                                   message):
    args = [str(released_root / where)] + (["--partition", partition] if partition else [])
    code, _, err = _inspect(capsys, *args, "--out", str(tmp_path))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert message in err


def test_inspect_of_a_root_with_one_mode_folder_asks_for_the_missing_one(released_root, tmp_path, capsys):
    root = tmp_path / "only-fl2va"
    root.mkdir()
    (root / "FL2VA").symlink_to(released_root / "FL2VA", target_is_directory=True)
    code, _, err = _inspect(capsys, str(root), "--partition", "ref2va", "--out", str(tmp_path / "r"))
    assert code == 2 and "partition 'ref2va' needs Ref2VA/transformer/, and there is no Ref2VA/ here (found FL2VA/)" in err
    code, _, err = _inspect(capsys, str(root), "--out", str(tmp_path / "r"))
    assert code == 0, err


def test_a_mode_folder_with_an_unknown_partition_is_refused(tmp_path):
    folder = tmp_path / "Other"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": "i2v"}}))
    with pytest.raises(InputError, match="unknown _minimax_h3.partition 'i2v'"):
        ComponentPaths(models=folder).resolve("dit")


def test_generate_from_the_per_mode_download_equals_the_older_layout(released_root, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from h3_spark.cli import main

    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    older = build_demo_models(tmp_path / "older")
    latents = {}
    refs = ["--ref", f"image:{_picture(tmp_path)}", "--ref", f"audio:{_tone(tmp_path)}"]
    for name, folder in (("per-mode", released_root), ("older", older)):
        for mode, extra in (("t2va", ["--prompt", "a boat"]), ("ref2va", ["--prompt", "<Picture 1> sings <Audio 1>",
                                                                          *refs])):
            out = tmp_path / f"{name}-{mode}.mp4"
            code = main(["generate", "--models", str(folder), "--steps", "3", "--width", "64", "--height", "64",
                         "--text-encoder-layer", "2", "--device", "cpu", "--out", str(out),
                         "--save-latents", str(tmp_path / f"{name}-{mode}.safetensors"), *extra])
            assert code == 0, capsys.readouterr().err
            summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert summary["mode"] == mode and out.is_file()
            latents[name, mode] = load_file(str(tmp_path / f"{name}-{mode}.safetensors"))
    for mode in ("t2va", "ref2va"):
        a, b = latents["per-mode", mode], latents["older", mode]
        assert all(torch.equal(a[k], b[k]) for k in ("video_latents", "audio_latents")), mode


def _picture(folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    path = folder / "picture.png"
    if not path.exists():
        Image.fromarray(np.random.default_rng(2).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(path)
    return path


def _tone(folder: Path) -> Path:
    import math
    import wave

    import numpy as np

    path = folder / "tone.wav"
    if not path.exists():
        t = np.arange(32000) / 32000
        samples = (np.sin(2 * math.pi * 440 * t) * 0.5 * 32767).astype("<i2")
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(32000)
            w.writeframes(samples.tobytes())
    return path


def test_make_checkpoint_writes_each_released_folder(tmp_path, capsys):
    from h3_spark.cli import main

    for component, name in (("dit", "transformer"), ("vae", "video_vae"), ("audio_vae", "audio_vae")):
        out = tmp_path / name
        assert main(["make-checkpoint", str(out), "--component", component, "--layout", "released"]) == 0
        assert json.loads(capsys.readouterr().out)["layout"] == "released"
        # --force replaces MiniMaxAI's files (the video VAE's source/ folder included), nothing else.
        assert main(["make-checkpoint", str(out), "--component", component, "--layout", "released",
                     "--force"]) == 0
        capsys.readouterr()
    from h3_spark.h3_model.dit.config import preset

    assert load_dit(tmp_path / "transformer").config == preset("tiny")
    video = load_video_vae(tmp_path / "video_vae").config
    assert video.block_out_channels == VC.TINY.block_out_channels and video.latents_std != VC.TINY.latents_std
    assert load_audio_vae(tmp_path / "audio_vae").config.encoder_rates == A.TINY.encoder_rates
    shutil.rmtree(tmp_path / "transformer")
    with pytest.raises(InputError, match="holds bf16 weights only"):
        make_dit_checkpoint(tmp_path / "transformer", DIT_CONFIG, "fp8_scaled", "released")
