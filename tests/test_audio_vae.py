"""The audio VAE against the diffusers oracle (AutoencoderKLMiniMaxH3Audio), plus its loaders/writers.

Error budget for every oracle comparison: relative L2 <= 1e-5, all fp32 (observed: 0.0, since the
weight-norm fold uses the same fused op the oracle evaluates on each forward).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3Audio
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3_spark.h3_model.vae import audio as audio_vae
from h3_spark.h3_model.vae import loading as vae_loading
from h3_spark.h3_model.vae import synthetic as vae_synthetic
from h3_spark.errors import CheckpointError, InputError
from oracle import randomize_vae_

FP32_BUDGET = 1e-5

# diffusers builds the oracle with torch's deprecated weight_norm; that is its business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def stats(channels: int, seed: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    return {"latents_mean": (0.5 * torch.randn(channels, generator=gen)).tolist(),
            "latents_std": (0.5 + torch.rand(channels, generator=gen)).tolist()}


TINY = dataclasses.replace(audio_vae.TINY, **{k: tuple(v) for k, v in stats(8, 1).items()})


def diffusers_kwargs(cfg: audio_vae.AudioVAEConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audio")
    ref = AutoencoderKLMiniMaxH3Audio(**diffusers_kwargs(TINY)).eval()
    randomize_vae_(ref, 20)
    ref.save_pretrained(folder / "audio_vae")
    return ref, vae_loading.load_audio_vae(folder), folder


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def folded(name: str) -> str:
    return name[: -len("_g")] if name.endswith(("weight_g", "weight_v")) else name


# ---- structure -------------------------------------------------------------------------------


def test_keys_are_diffusers_keys_with_weight_norm_folded(tiny):
    ref, ours, _ = tiny
    ref_keys = {folded(k) for k in ref.state_dict()}
    assert set(ours.state_dict()) == ref_keys
    normed = {k[: -len("_g")] for k in ref.state_dict() if k.endswith("weight_g")}
    assert normed == {k for k, v in ours.state_dict().items() if audio_vae.is_weight_normed(k, v.ndim)}
    with torch.device("meta"):
        full_ref, full_ours = AutoencoderKLMiniMaxH3Audio(), audio_vae.AudioVAE(audio_vae.FULL)
    assert set(full_ours.state_dict()) == {folded(k) for k in full_ref.state_dict()}
    assert len(full_ref.state_dict()) == 1087


def test_config_field_names_and_full_defaults_equal_diffusers():
    with torch.device("meta"):
        ref = AutoencoderKLMiniMaxH3Audio()
    ref_config = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    ours = diffusers_kwargs(audio_vae.FULL)
    assert ours.keys() == ref_config.keys()
    listed = {k: [list(x) for x in v] if k == "resblock_dilation_sizes" else list(v) if isinstance(v, tuple) else v
              for k, v in ref_config.items()}
    assert ours == listed
    assert audio_vae.FULL.hop_length == 800


def test_filters_are_persistent_buffers_loaded_from_the_file(tiny, tmp_path):
    ref, ours, folder = tiny
    key = "decoder.resblocks.0.activations.0.upsample.filter"
    assert torch.equal(ours.state_dict()[key], ref.state_dict()[key])
    sd = load_file(str(folder / "audio_vae" / vae_loading.WEIGHTS_NAME))
    sd[key] = sd[key] * 1.5
    (tmp_path / "audio_vae").mkdir()
    (tmp_path / "audio_vae" / "config.json").write_text((folder / "audio_vae" / "config.json").read_text())
    save_file(sd, str(tmp_path / "audio_vae" / vae_loading.WEIGHTS_NAME))
    changed = vae_loading.load_audio_vae(tmp_path)
    assert torch.equal(changed.state_dict()[key], ref.state_dict()[key] * 1.5)


def test_everything_is_fp32_even_from_an_fp16_file(tiny, tmp_path):
    ref, _, _ = tiny
    sd = {k: v.half() for k, v in ref.state_dict().items()}
    save_file(sd, str(tmp_path / "half.safetensors"))
    half = vae_loading.load_audio_vae(tmp_path / "half.safetensors", config=TINY)
    assert {t.dtype for t in half.state_dict().values()} == {torch.float32}


# ---- encode / decode -------------------------------------------------------------------------


def test_encode_matches_oracle_including_hop_padding(tiny):
    ref, ours, _ = tiny
    wav = randn(2, 1, 2 * 800 * 10 + 123, seed=1, scale=0.3)  # not a whole number of hops
    with torch.no_grad():
        expected = ref.encode(wav).latent_dist
    got = ours.encode(wav)
    assert got.mean.shape == expected.mean.shape == (2, 8, 21)
    assert rel_l2(got.mean, expected.mean) <= FP32_BUDGET
    assert rel_l2(got.logs, expected.logs) <= FP32_BUDGET
    sample = got.sample(torch.Generator().manual_seed(3))
    assert rel_l2(sample, expected.sample(torch.Generator().manual_seed(3))) <= FP32_BUDGET
    assert rel_l2(sample, got.mean) > 1e-3


def test_decode_matches_oracle_and_is_clamped(tiny):
    ref, ours, _ = tiny
    z = randn(2, 8, 40, seed=2)
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = ours.decode(z)
    assert got.shape == expected.shape == (2, 1, 32000)
    assert rel_l2(got, expected) <= FP32_BUDGET
    loud = ours.decode(randn(2, 8, 5, seed=3, scale=50.0))
    assert loud.abs().max() == 1.0


def test_stereo_helpers_follow_the_pipeline(tiny):
    ref, ours, _ = tiny
    z = randn(2, 8, 12, seed=4)
    mean = torch.tensor(TINY.latents_mean).view(1, -1, 1)
    std = torch.tensor(TINY.latents_std).view(1, -1, 1)
    with torch.no_grad():
        expected = ref.decode(z * std + mean).sample[:, 0]
    assert rel_l2(ours.decode_stereo(z), expected) <= FP32_BUDGET
    wav = randn(2, 4000, seed=5, scale=0.3)
    with torch.no_grad():
        expected_latents = (ref.encode(wav[:, None]).latent_dist.mode() - mean) / std
    assert rel_l2(ours.encode_stereo(wav), expected_latents) <= FP32_BUDGET


# ---- loading ---------------------------------------------------------------------------------


def test_comfy_single_file_with_folded_weights_matches_oracle(tiny, tmp_path):
    ref, _, _ = tiny
    sd = ref.state_dict()
    comfy = {}
    for name, tensor in sd.items():
        if name.endswith("weight_g"):
            continue
        if name.endswith("weight_v"):
            # Folded with torch's own weight_norm (what ComfyUI's converted file holds).
            comfy[folded(name)] = torch._weight_norm(tensor, sd[name[:-1] + "g"], 0)
        else:
            comfy[name] = tensor
    comfy["latents_mean"] = torch.tensor(TINY.latents_mean)
    comfy["latents_std"] = torch.tensor(TINY.latents_std)
    save_file(comfy, str(tmp_path / "minimax_h3_audio_vae_fp32.safetensors"))
    ours = vae_loading.load_audio_vae(tmp_path / "minimax_h3_audio_vae_fp32.safetensors",
                                      config=audio_vae.TINY)
    assert ours.config.latents_std == pytest.approx(TINY.latents_std)
    z = randn(2, 8, 20, seed=6)
    with torch.no_grad():
        assert rel_l2(ours.decode(z), ref.decode(z).sample) <= FP32_BUDGET


def test_full_config_is_inferred_from_folded_shapes():
    plan = vae_synthetic.plan_audio_vae_checkpoint("full", "comfy")
    shapes = {n: s for n, s, _ in plan if n not in ("latents_mean", "latents_std")}
    assert vae_loading.infer_audio_config(shapes) == audio_vae.FULL
    assert len(vae_synthetic.plan_audio_vae_checkpoint("full", "diffusers")) == 1087


def test_loader_and_model_errors_name_the_problem(tiny, tmp_path):
    ref, ours, folder = tiny
    with pytest.raises(CheckpointError, match="no such file or folder"):
        vae_loading.load_audio_vae(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a diffusers audio_vae/ folder"):
        vae_loading.load_audio_vae(tmp_path)
    save_file({"decoder.transformer_blocks.0.scale1": torch.ones(4)}, str(tmp_path / "video.safetensors"))
    with pytest.raises(CheckpointError, match="the video VAE"):
        vae_loading.load_audio_vae(tmp_path / "video.safetensors")
    sd = {k: v for k, v in ref.state_dict().items() if k != "decoder.conv_post.weight_v"}
    save_file(sd, str(tmp_path / "orphan.safetensors"))
    with pytest.raises(CheckpointError, match="decoder.conv_post.weight_g has no matching weight_v"):
        vae_loading.load_audio_vae(tmp_path / "orphan.safetensors", config=TINY)
    no_stats = vae_loading.load_audio_vae(folder, config=audio_vae.AudioVAEConfig(**{
        **diffusers_kwargs(audio_vae.TINY), "latents_mean": None, "latents_std": None}))
    with pytest.raises(CheckpointError, match="no latents_mean/latents_std"):
        no_stats.decode_stereo(randn(2, 8, 4, seed=0))
    with pytest.raises(InputError, match=re.escape("audio VAE encode expects float (B, 1, samples), got (2, 800)")):
        ours.encode(randn(2, 800, seed=0))
    with pytest.raises(InputError, match=re.escape("audio latents must be float (B, 8, T), got (2, 7, 4)")):
        ours.decode(randn(2, 7, 4, seed=0))
    with pytest.raises(InputError, match=re.escape("stereo audio must be (2, samples), got (1, 800)")):
        ours.encode_stereo(randn(1, 800, seed=0))
    with pytest.raises(CheckpointError, match="decoder_rates multiply to 400, not the hop 800"):
        dataclasses.replace(audio_vae.TINY, decoder_rates=(5, 5, 2, 2, 2, 2, 1))
    with pytest.raises(CheckpointError, match="latents_mean needs 8 values, got 2"):
        dataclasses.replace(audio_vae.TINY, latents_mean=(0.0, 0.0))


# ---- writing ---------------------------------------------------------------------------------


def test_written_checkpoints_load_in_diffusers_and_match_ours(tmp_path):
    folder = vae_synthetic.write_audio_vae_checkpoint(tmp_path / "audio_vae", "tiny", "diffusers", seed=4)
    comfy = vae_synthetic.write_audio_vae_checkpoint(tmp_path / "audio.safetensors", "tiny", "comfy", seed=4)
    ref = AutoencoderKLMiniMaxH3Audio.from_pretrained(folder).eval()
    ours = vae_loading.load_audio_vae(tmp_path)
    from_comfy = vae_loading.load_audio_vae(comfy)
    assert ours.config == from_comfy.config and ours.config.latents_mean is not None
    z = randn(2, 8, 20, seed=7)
    with torch.no_grad():
        expected = ref.decode(z).sample
    assert rel_l2(ours.decode(z), expected) <= FP32_BUDGET
    assert rel_l2(from_comfy.decode(z), expected) <= FP32_BUDGET
    with safe_open(str(folder / vae_loading.WEIGHTS_NAME), "pt") as f:
        keys = set(f.keys())
        assert "decoder.conv_post.weight_g" in keys and "decoder.conv_post.weight" not in keys
        weights = [f.get_tensor(k) for k in keys if not k.endswith(("filter", "zero_k_bias"))]
        assert all(bool((w != 0).all()) for w in weights)
    with safe_open(str(comfy), "pt") as f:
        assert "decoder.conv_post.weight" in f.keys() and "latents_mean" in f.keys()
