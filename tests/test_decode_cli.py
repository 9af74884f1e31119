"""`h3-spark decode`: saved normalised latents -> mp4, checked against the diffusers oracle.

Budget: the uint8 frames handed to the muxer match the oracle pipeline's (denormalise, decode,
revert ImageNet, clamp, round) within 1 level (fp32 decode); the waveform within rel L2 1e-5.
The mp4 itself is lossy, so it is checked for structure, not pixels.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from safetensors.torch import save_file

from h3_spark import cli
from h3_spark.cli import decode
from h3_spark.h3_model.vae import audio as audio_vae
from h3_spark.h3_model.media import files as media
from h3_spark.h3_model.vae import video as video_vae
from h3_spark.h3_model.vae import video_config
from h3_spark.errors import InputError
from oracle import randomize_vae_

pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*is deprecated:FutureWarning")

IMAGENET_MEAN = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1, 1)
IMAGENET_STD = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1, 1)


def kwargs_with_stats(cfg, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    c = cfg.latent_channels
    out = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}
    out["latents_mean"] = (0.5 * torch.randn(c, generator=gen)).tolist()
    out["latents_std"] = (0.5 + torch.rand(c, generator=gen)).tolist()
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    vae = AutoencoderKLMiniMaxH3(**kwargs_with_stats(video_config.TINY, 1)).eval()
    avae = AutoencoderKLMiniMaxH3Audio(**kwargs_with_stats(audio_vae.TINY, 2)).eval()
    randomize_vae_(vae, 3)
    randomize_vae_(avae, 4)
    vae.save_pretrained(root / "vae")
    avae.save_pretrained(root / "audio_vae")
    gen = torch.Generator().manual_seed(5)
    latents = {"video_latents": torch.randn(1, 4, 12, 8, 12, generator=gen),   # 39 frames, 32 x 48
               "audio_latents": torch.randn(2, 8, 66, generator=gen)}         # 1.65 s, longer than 39/24 s
    save_file(latents, str(root / "latents.safetensors"))
    return root, vae, avae, latents


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    decode.add_parser(sub, "decode")
    return decode.run(parser.parse_args(["decode", *argv]))


def oracle_frames(vae, z: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(z * std + mean).sample
    unit = (video * IMAGENET_STD + IMAGENET_MEAN).clamp(0, 1)
    return (unit * 255).round()[0].permute(1, 2, 3, 0)


def oracle_audio(avae, z: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(avae.config.latents_mean).view(1, -1, 1)
    std = torch.tensor(avae.config.latents_std).view(1, -1, 1)
    with torch.no_grad():
        return avae.decode(z * std + mean).sample[:, 0]


def test_decode_hands_oracle_pixels_and_audio_to_the_muxer(checkpoint, tmp_path, monkeypatch, capsys):
    root, vae, avae, latents = checkpoint
    seen = {}

    def capture(path, frames, audio, **kw):
        seen.update(path=path, frames=frames.clone(), audio=audio.clone(), **kw)

    monkeypatch.setattr(media, "write_mp4", capture)
    assert run(str(root / "latents.safetensors"), "--vae", str(root), "--audio-vae", str(root / "audio_vae"),
               "--out", str(tmp_path / "o.mp4"), "--vae-dtype", "float32") == 0
    expected = oracle_frames(vae, latents["video_latents"])
    assert seen["frames"].dtype == torch.uint8 and seen["frames"].shape == expected.shape == (39, 32, 48, 3)
    assert (seen["frames"].float() - expected).abs().max() <= 1
    wav = oracle_audio(avae, latents["audio_latents"])
    assert seen["audio"].shape == wav.shape
    assert ((seen["audio"] - wav).norm() / wav.norm()).item() <= 1e-5
    assert (seen["fps"], seen["sample_rate"]) == (24, 32000)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["frames"] == 39 and summary["vae_dtype"] == "float32"
    assert summary["audio_samples"] == 52000  # trimmed to 39 frames at 24 fps
    # CPU run: plain SDPA; the fused passes run only where Triton does (here: its interpreter, in the tests)
    from h3_spark.kernels.capability import triton_interpreting

    fused = "triton" if triton_interpreting() else "pytorch-reference"
    assert summary["vae_kernels"]["attention"]["chosen"] == "sdpa"
    assert summary["vae_kernels"]["qk_prep"] == summary["vae_kernels"]["swiglu"] == fused


def test_decode_writes_a_real_mp4(checkpoint, tmp_path, capsys):
    root, _, _, _ = checkpoint
    out = tmp_path / "video.mp4"
    assert run(str(root / "latents.safetensors"), "--vae", str(root), "--audio-vae", str(root),
               "--out", str(out)) == 0
    info = media.probe(out)
    assert (info["video_codec"], info["audio_codec"], info["channels"]) == ("h264", "aac", 2)
    assert (info["frames"], info["width"], info["height"]) == (39, 48, 32)
    assert info["audio_duration"] == pytest.approx(39 / 24, abs=1e-3)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["command"] == "decode" and summary["out"] == str(out)
    assert summary["vae_dtype"] == "float16" and summary["vae_tile_size"] == 256 and summary["device"] == "cpu"


def test_video_only_latents(checkpoint, tmp_path):
    root, _, _, latents = checkpoint
    save_file({"video_latents": latents["video_latents"]}, str(tmp_path / "v.safetensors"))
    assert run(str(tmp_path / "v.safetensors"), "--vae", str(root), "--out", str(tmp_path / "v.mp4")) == 0
    assert "audio_codec" not in media.probe(tmp_path / "v.mp4")


def test_environment_supplies_defaults_and_flags_win():
    args = argparse.Namespace(vae_dtype=None, vae_tile_size=None, device="cpu")
    env = {"H3_VAE_DTYPE": "float32", "H3_VAE_TILE_SIZE": "0"}
    assert decode.resolve_settings(args, env) == decode.Settings("float32", 0, "cpu")
    flags = argparse.Namespace(vae_dtype="float16", vae_tile_size=128, device="cpu")
    assert decode.resolve_settings(flags, env) == decode.Settings("float16", 128, "cpu")
    assert decode.resolve_settings(args, {}) == decode.Settings("float16", 256, "cpu")
    with pytest.raises(InputError, match="H3_VAE_DTYPE='bf16': choose one of float16, float32"):
        decode.resolve_settings(args, {"H3_VAE_DTYPE": "bf16"})
    with pytest.raises(InputError, match="H3_VAE_TILE_SIZE='big': expected a whole number of pixels"):
        decode.resolve_settings(args, {"H3_VAE_TILE_SIZE": "big"})
    with pytest.raises(InputError, match="tile size must be >= 0"):
        decode.resolve_settings(argparse.Namespace(vae_dtype=None, vae_tile_size=-1, device="cpu"), {})


def test_untiled_env_setting_reaches_the_decoder(checkpoint, tmp_path, monkeypatch, capsys):
    root, _, _, _ = checkpoint
    monkeypatch.setenv("H3_VAE_TILE_SIZE", "0")
    monkeypatch.setenv("H3_VAE_DTYPE", "float32")
    calls = []
    original = video_vae.VideoVAE.iter_decode

    def spy(self, z, **kw):
        calls.append(kw)
        return original(self, z, **kw)

    monkeypatch.setattr(video_vae.VideoVAE, "iter_decode", spy)
    assert run(str(root / "latents.safetensors"), "--vae", str(root), "--audio-vae", str(root),
               "--out", str(tmp_path / "o.mp4")) == 0
    assert calls == [{"tile_size": None}]
    summary = json.loads(capsys.readouterr().out)
    assert (summary["vae_tile_size"], summary["vae_dtype"]) == (0, "float32")


@pytest.mark.parametrize("tensors, metadata, message", [
    ({"audio_latents": torch.randn(2, 8, 4)}, None, "no video_latents tensor"),
    ({"video_latents": torch.randn(4, 7, 8, 12)}, None,
     "video_latents must be float (1, C, T, h, w), got (4, 7, 8, 12)"),
    ({"video_latents": torch.randn(1, 4, 7, 8, 12), "audio_latents": torch.randn(1, 8, 4)}, None,
     "audio_latents must be float (2, C, Ta), got (1, 8, 4)"),
    ({"video_latents": torch.randn(1, 4, 7, 8, 12)}, {"latents": "raw"},
     "metadata says latents are 'raw'; decode expects normalised latents"),
    ({"video_latents": torch.randn(1, 5, 7, 8, 12)}, None, "video_latents have 5 channels, the video VAE takes 4"),
    ({"video_latents": torch.randn(1, 4, 7, 8, 12), "audio_latents": torch.randn(2, 8, 4)}, None,
     "has audio_latents; pass --audio-vae"),
])
def test_bad_latents_files(checkpoint, tmp_path, tensors, metadata, message):
    root, _, _, _ = checkpoint
    save_file(tensors, str(tmp_path / "l.safetensors"), metadata=metadata)
    with pytest.raises(InputError, match=re.escape(message)):
        run(str(tmp_path / "l.safetensors"), "--vae", str(root), "--out", str(tmp_path / "o.mp4"))


def test_other_bad_arguments(checkpoint, tmp_path):
    root, _, _, _ = checkpoint
    latents = str(root / "latents.safetensors")
    with pytest.raises(InputError, match="no such latents file"):
        run(str(tmp_path / "none.safetensors"), "--vae", str(root), "--out", str(tmp_path / "o.mp4"))
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(InputError, match="not a readable safetensors file"):
        run(str(tmp_path / "junk.safetensors"), "--vae", str(root), "--out", str(tmp_path / "o.mp4"))
    with pytest.raises(InputError, match="the output must be an .mp4 file"):
        run(latents, "--vae", str(root), "--audio-vae", str(root), "--out", str(tmp_path / "o.mkv"))
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="this machine has no CUDA GPU"):
            run(latents, "--vae", str(root), "--audio-vae", str(root), "--out", str(tmp_path / "o.mp4"),
                "--device", "cuda")


def test_front_door_prints_one_error_line_and_exits_2(checkpoint, tmp_path, capsys):
    root, _, _, _ = checkpoint
    code = cli.main(["decode", str(root / "latents.safetensors"), "--vae", str(tmp_path / "missing"),
                     "--out", str(tmp_path / "o.mp4"), "--audio-vae", str(root)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("h3-spark decode: error:") and "no such file or folder" in err
    assert "decode" in cli.COMMANDS
