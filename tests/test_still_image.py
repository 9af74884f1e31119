"""Stills (text to image): one latent frame, sampled with its two audio latents, decoded by the video VAE alone.

Tolerances: the still decode against diffusers' decoder (the same arithmetic): relative L2 <= 1e-5, the fp32 oracle
budget of test_video_vae.py. The first frame of a longer decode against the still: relative L2 <= 1e-6 where the
decoder sees every latent frame alone (attention residuals zeroed; only the batch shapes of the same per-token
arithmetic differ), and > 1e-3 with attention, which is why a still is decoded on its own.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from h3_spark.cli import main
from h3_spark.errors import InputError
from h3_spark.h3_model import geometry
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.h3_model.vae import loading as vae_loading
from h3_spark.h3_model.vae import video_config, video_tiling
from oracle import randomize_vae_
from test_nodes import models  # noqa: F401  (the ComfyUI models folder fixture)

FP32_BUDGET = 1e-5

# A 16x variant of the tiny config (the real temporal geometry: clip 17, x4, drop 3), so 256 px tiles really tile.
TINY16 = dataclasses.replace(video_config.TINY, block_out_channels=(8, 16, 16, 16),
                             spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(2, 2, 1, 1))


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("still_vae")
    ref = AutoencoderKLMiniMaxH3(**{k: v for k, v in TINY16.to_dict().items() if not k.startswith("_")}).eval()
    randomize_vae_(ref, 21)
    ref.save_pretrained(folder / "vae")
    return ref, vae_loading.load_video_vae(folder, decode_dtype=torch.float32)


# ------------------------------------------------------------------------------------------ the video VAE
def test_the_released_geometry_keeps_the_last_of_four_frames_for_a_still():
    # ComfyUI's single-image decode keeps the last of the temporal_ratio frames; ours keeps frame_pre_padding,
    # the frame a video's first latent frame keeps. The two agree where clip_length = 4k + 1 (17).
    for cfg in (video_config.FULL, TINY16):
        assert cfg.frame_pre_padding == cfg.temporal_ratio - 1 == 3
    assert video_tiling.decoded_num_frames(TINY16, 1) == 1 and geometry.video_latent_frames(1) == 1
    assert geometry.audio_latent_frames(1) == 2  # ComfyUI's one-frame latent: round(1 * 5 / 3) audio latents


def test_a_still_decodes_like_the_oracle_decoder_on_its_one_latent_frame(vaes):
    ref, ours = vaes
    z = randn(1, 4, 1, 18, 34, seed=3)  # 288 x 544 px: 2 x 3 tiles of 256 px
    with torch.no_grad():
        expected = ref._decode_clip(z)[:, :, -1:]  # diffusers' tiled decoder call, the last of its 4 frames
    got = ours.decode(z)
    assert got.shape == expected.shape == (1, 3, 1, 288, 544)
    assert rel_l2(got, expected) <= FP32_BUDGET
    frames = ours.decode_to_buffer(z)
    assert frames.shape == (1, 1, 288, 544, 3) and frames.dtype == torch.uint8
    assert ours.decoded_shape(z.shape) == (1, 1, 288, 544, 3)


def test_a_still_is_the_first_frame_of_a_clip_only_where_the_decoder_sees_frames_alone(vaes):
    _, ours = vaes
    still = randn(1, 4, 1, 8, 12, seed=4)
    clip = torch.cat([still, randn(1, 4, 6, 8, 12, seed=5)], dim=2)  # 7 latent frames: 22 pixel frames
    # Zeroed attention residuals: each latent frame's pixels come from that frame alone.
    local = copy.deepcopy(ours)
    for block in local.decoder.transformer_blocks:
        block.scale1.data.zero_()
    video = local.decode(clip)
    assert video.shape[2] == 22
    assert rel_l2(local.decode(still), video[:, :, :1]) <= 1e-6
    # The released decoder attends across the window's latent frames: its first frame also depends on the rest.
    assert rel_l2(ours.decode(still), ours.decode(clip)[:, :, :1]) > 1e-3


# ------------------------------------------------------------------------------------------ requests
@pytest.mark.parametrize("changes, message", [
    ({"mode": "fl2va", "first_frame": torch.zeros(64, 64, 3, dtype=torch.uint8)},
     "a still (1 frame) is text to image, t2va only: it takes no keyframes or references"),
    ({"decoder": "taeh3"}, "a still (1 frame) is text to image, t2va only: it takes no decoder taeh3"),
    ({"frames": 2}, "2 frames snaps to 5 (0.21 s); H3 generates 124..345 frames (5-15 s at 24 fps; nearest valid: "
                    "124 frames, 5.17 s), or 1 frame for a still image"),
])
def test_what_a_still_cannot_be_is_refused(changes, message):
    req = GenerationRequest(**{"mode": "t2va", "prompt": "a cat", "frames": 1, **changes})
    with pytest.raises(InputError) as err:
        req.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_still_is_generated_without_an_audio_vae(tiny_t2va_engine):
    engine = tiny_t2va_engine
    audio_vae, engine.components.audio_vae = engine.components.audio_vae, None
    try:
        result = engine.generate(GenerationRequest("t2va", "a red kite", width=64, height=96, frames=1, steps=3,
                                                   seed=5))
    finally:
        engine.components.audio_vae = audio_vae
    assert result.video.shape == (1, 96, 64, 3) and result.video.dtype == torch.uint8
    assert result.audio.shape == (2, 0) and result.info["still"] is True
    assert result.video_latents.shape[2] == 1 and result.audio_latents.shape[-1] == 2
    assert "audio_decode" not in result.timings
    assert result.video.float().std() > 0  # a decoded picture, not an empty buffer


def test_the_plan_for_a_still_leaves_the_audio_vae_out(demo_models):
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.paths import ComponentPaths

    paths = ComponentPaths(models=demo_models)
    assert "audio_vae" in Engine(paths).plan(["t2va"])
    assert set(Engine(paths).plan(["t2va"], audio=False)) == {"dit", "text_encoder", "vae"}
    no_audio = ComponentPaths(dit=demo_models / "transformer", text_encoder=demo_models / "text_encoder",
                              vae=demo_models / "vae")
    with pytest.raises(InputError, match="the audio vae is needed: pass --models or --audio-vae"):
        Engine(no_audio).plan(["t2va"])
    assert "audio_vae" not in Engine(no_audio).plan(["t2va"], audio=False)


# ------------------------------------------------------------------------------------------ the CLI
@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


@pytest.mark.parametrize("flag", [["--image"], ["--frames", "1"]])
def test_generate_writes_a_png_of_the_canvas(demo_models, tmp_path, capsys, flag):
    from PIL import Image

    out = tmp_path / "still.png"
    code = main(["generate", "--demo-dir", str(demo_models), *flag, "--steps", "3", "--width", "96", "--height",
                 "64", "--prompt", "a lighthouse at dusk", "--out", str(out), "--progress"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert "loading audio_vae" not in cap.err and "loading vae" in cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["frames"] == 1 and summary["audio_samples"] == 0 and "audio_vae" not in summary["load_s"]
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (96, 64) and image.mode == "RGB"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["still.png"]  # no partial file left


@pytest.mark.parametrize("argv, message", [
    (["--image", "--out", "o.mp4"], "--out must end in .png for a still (--frames 1 / --image), got o.mp4"),
    (["--frames", "1", "--out", "o.jpg"], "--out must end in .png for a still (--frames 1 / --image), got o.jpg"),
    (["--out", "o.png"], "--out must end in .mp4 for a clip, got o.png; a .png is written for a still"),
    (["--image", "--frames", "124", "--out", "o.png"],
     "--image is --frames 1 (a still); --frames 124 makes a clip: drop one of them"),
    (["--image", "--seconds", "8", "--out", "o.png"], "a still (--frames 1 / --image) is one picture; --seconds "
                                                      "make a clip"),
    (["--image", "--guide", "image:g.png@0", "--out", "o.png"],
     "a still (1 frame) is text to image, t2va only: it takes no guides"),
])
def test_still_flags_are_refused_in_one_line(demo_models, argv, message, capsys, tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (64, 64), (200, 10, 30)).save(tmp_path / "g.png")
    code = main(["generate", "--demo-dir", str(demo_models), "--prompt", "p", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ the nodes
def test_the_node_graph_makes_the_pipelines_still(models, monkeypatch):
    """H3 Text to Video at length 1 -> H3 Sampler -> H3 Decode: one IMAGE frame (what Save Image takes), equal to
    the pipeline's still, and the frame's length of silence without the audio VAE decoding."""
    from test_nodes import fake_comfy, load_all, node, pipeline_for

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    cond, latent = node("H3SparkTextToVideo").encode(te, "a lighthouse at dusk", 64, 96, 1)
    video, audio = latent["samples"]
    assert video.shape == (1, 24, 1, 6, 4) and audio.shape == (1, 32, 2, 2)  # ComfyUI's one-frame latent
    out = node("H3SparkSampler").sample(model, cond, latent, 9, 2, 12.0, 3.0)[0]
    monkeypatch.setattr(type(vae), "decode_audio", lambda *a: pytest.fail("a still decodes no audio"))
    images, sound = node("H3SparkDecode").decode(vae, out)
    assert images.shape == (1, 96, 64, 3) and images.dtype == torch.float32
    assert sound["sample_rate"] == 32000 and sound["waveform"].shape == (1, 2, 1333)
    assert not sound["waveform"].any()
    monkeypatch.undo()
    req = GenerationRequest("t2va", "a lighthouse at dusk", width=64, height=96, frames=1, steps=3, seed=9)
    theirs = pipeline_for(model, te, vae, "t2va").generate(req)
    assert torch.equal(out["samples"][0], theirs.video_latents)
    assert torch.equal((images * 255).round().to(torch.uint8), theirs.video)


def test_a_still_is_made_by_text_to_video_only(models, monkeypatch):
    from test_nodes import fake_comfy, image, load_all, node

    fake_comfy(monkeypatch, models)
    _, te, vae = load_all(models)
    with pytest.raises(InputError, match="length 1 is a still image, made by H3 Text to Video; fl2va makes clips"):
        node("H3SparkFirstLastFrameToVideo").encode(te, vae, "", 64, 64, 1, image(1))
    with pytest.raises(InputError, match="3 frames snaps to 5 .* or 1 frame for a still image"):
        node("H3SparkTextToVideo").encode(te, "a cat", 64, 64, 3)
    length = type(node("H3SparkTextToVideo")).INPUT_TYPES()["required"]["length"][1]
    assert (length["min"], length["max"]) == (1, 345) and "still image" in length["tooltip"]


# ------------------------------------------------------------------------------------------ the service
@pytest.mark.parametrize("extra", [{"frames": 1}, {"seconds": 0.04}])
def test_the_service_refuses_a_still_and_says_why(extra):
    from h3_spark.serve.validation import Limits, RequestError, parse_request

    with pytest.raises(RequestError) as err:
        parse_request({"prompt": "a cat", "output": "a.mp4", **extra}, Limits())
    assert err.value.status == 400 and "frames 1 is a still image, which the service does not make: its outputs " \
        "are mp4 clips" in str(err.value) and "h3-spark generate --image" in str(err.value)


def test_a_stills_saved_latents_decode_to_the_same_png(demo_models, tmp_path, capsys):
    from PIL import Image
    import numpy as np

    out, latents = tmp_path / "still.png", tmp_path / "still.safetensors"
    assert main(["generate", "--demo-dir", str(demo_models), "--image", "--steps", "2", "--width", "64", "--height",
                 "64", "--prompt", "a kite", "--out", str(out), "--save-latents", str(latents)]) == 0
    again = tmp_path / "again.png"
    argv = ["decode", str(latents), "--vae", str(demo_models / "vae"), "--device", "cpu", "--vae-dtype", "float32"]
    assert main([*argv, "--out", str(tmp_path / "again.mp4")]) == 2
    assert "holds one latent frame (a still); the output must be a .png file" in capsys.readouterr().err
    assert main([*argv, "--out", str(again)]) == 0  # no --audio-vae: a still's audio latents are not decoded
    with Image.open(out) as a, Image.open(again) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))
