"""The ControlNet in a generation: the hint built from a control video and an inpaint mask, the tower attached while
sampling, the CLI's flags and their one-line errors (tiny synthetic models through the real loaders)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from h3_spark.cli import main
from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint.controlnet import random_getter, synthetic_config, write_controlnet
from h3_spark.h3_model.controlnet.hint import MID_GRAY, ControlRequest, fit_frames, fit_mask, hint_latents
from h3_spark.h3_model.dit.layout import patchify
from h3_spark.h3_model.media import files as media


def _pixels(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ fitting the inputs
def test_frames_are_cut_or_hold_the_last_and_cover_the_canvas():
    clip = _pixels(3, 8, 16, 3)
    held = fit_frames(clip, 5, 16, 8)
    assert torch.equal(held[:3], clip) and torch.equal(held[3], clip[2]) and torch.equal(held[4], clip[2])
    assert torch.equal(fit_frames(clip, 2, 16, 8), clip[:2])
    from h3_spark.h3_model.media.refs import cover_crop

    cropped = fit_frames(clip, 4, 8, 8)  # 16x8 -> 8x8: the centre columns
    assert cropped.shape == (4, 8, 8, 3) and torch.equal(cropped[3], cover_crop(clip[2], 8, 8))


def test_masks_are_binarised_clamped_and_cropped():
    mask = torch.zeros(2, 8, 16)
    mask[1, :, 4:8] = 0.9
    mask[0, 0, 0] = 0.4  # below one half: kept
    fitted = fit_mask(mask, 3, 8, 8)  # 16 wide -> the centre 8 columns
    assert fitted.shape == (3, 8, 8) and fitted[0].sum() == 0
    assert torch.equal(fitted[1], fitted[2])  # the last frame held
    assert torch.equal(fitted[1][:, :4], torch.ones(8, 4)) and fitted[1][:, 4:].sum() == 0


@pytest.mark.parametrize("post_norm", [False, True], ids=["v1_black", "union2_mid_gray"])
def test_hint_channels_and_fill(post_norm):
    seen = []

    def encode(frames):  # a stand-in VAE: the frames, 4x pooled, as 2 channels
        seen.append(frames)
        x = frames.float().permute(3, 0, 1, 2)[None][:, :2] / 255.0
        return F.avg_pool3d(x, (1, 4, 4))

    video, source = _pixels(6, 8, 8, 3, seed=1), _pixels(6, 8, 8, 3, seed=2)
    mask = torch.zeros(8, 8)
    mask[:, :4] = 1.0
    control = ControlRequest(video=video, mask=mask, source=source)
    hint = hint_latents(control, encode, 6, 8, 8, (6, 2, 2), post_norm_fill=post_norm, latent_channels=2)
    assert hint.shape == (1, 49, 6, 2, 2)
    assert torch.equal(seen[0], video)
    fill = torch.tensor(MID_GRAY if post_norm else (0, 0, 0), dtype=torch.uint8)
    assert torch.equal(seen[1][:, :, :4], fill.expand(6, 8, 4, 3)) and torch.equal(seen[1][:, :, 4:], source[:, :, 4:])
    assert torch.equal(hint[:, :2], encode(video))
    assert torch.allclose(hint[0, 2, :, :, 0], torch.zeros(6, 2))
    assert torch.allclose(hint[0, 2, :, :, 1], torch.ones(6, 2))
    assert torch.equal(hint[:, 3:5], encode(seen[1])) and hint[:, 5:].abs().sum() == 0
    only = hint_latents(ControlRequest(video=video), encode, 6, 8, 8, (6, 2, 2), post_norm_fill=post_norm,
                        latent_channels=2)
    assert torch.equal(only[:, :2], hint[:, :2]) and only[:, 2:].abs().sum() == 0


def test_bad_control_requests_are_one_line():
    with pytest.raises(InputError, match="a control needs a control video, an inpaint mask, or both"):
        ControlRequest().validate()
    with pytest.raises(InputError, match="the inpaint mask is 8x6 but its source video is 8x8"):
        ControlRequest(mask=torch.ones(6, 8), source=_pixels(3, 8, 8, 3)).validate()
    with pytest.raises(InputError, match="the control video must be uint8 \\(F, H, W, 3\\) frames"):
        ControlRequest(video=torch.zeros(3, 8, 8, 3)).validate()
    with pytest.raises(InputError, match="control strength must be in \\[0, 10\\]"):
        ControlRequest(video=_pixels(3, 8, 8, 3), strength=-1).validate()
    with pytest.raises(InputError, match="the inpaint mask is 8x8 but the canvas is 64x64"):
        ControlRequest(mask=torch.ones(8, 8)).check_canvas(64, 64)


# ------------------------------------------------------------------------------------------ in a generation
def _quick_encode(vae, frames, **_):
    """A stand-in for the video VAE's encode (16 s for 124 frames on a shared CPU): the frames at each latent
    frame's start, 16x pooled, as the VAE's channels. The real encode runs in the slow CLI test."""
    from h3_spark.h3_model import geometry

    t = geometry.video_latent_frames(frames.shape[0])
    x = frames[torch.linspace(0, frames.shape[0] - 1, t).long()].float().permute(3, 0, 1, 2)[None] / 255.0
    x = F.avg_pool3d(x, (1, 16, 16))
    c = vae.config.latent_channels
    return x.repeat(1, -(-c // 3), 1, 1, 1)[:, :c]


@pytest.fixture
def engine(tiny_t2va_engine, tmp_path, monkeypatch):
    monkeypatch.setattr("h3_spark.h3_model.vae.video.encode_condition", _quick_encode)
    dit = tiny_t2va_engine.components.dit.config
    config = synthetic_config(dit, union2=False, comfy=False)
    path = tmp_path / "controlnet.safetensors"
    write_controlnet(path, config, random_getter(config, 5), "released")
    tiny_t2va_engine.load_controlnet(path)
    yield tiny_t2va_engine
    tiny_t2va_engine.load_controlnet(None)


def _request(control=None, steps=3):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    return GenerationRequest("t2va", "a dancer", width=64, height=64, frames=124, steps=steps, control=control)


def test_control_steers_the_sampling_and_strength_zero_is_the_plain_run(engine, monkeypatch):
    from h3_spark.h3_model.pipeline.generation import Pipeline

    monkeypatch.setattr(engine.pipeline, "decode", False)
    plain = engine.generate(_request())
    video = _pixels(30, 48, 80, 3, seed=3)
    controlled = engine.generate(_request(ControlRequest(video=video)))
    assert controlled.info["control"]["evaluations"] == 2 and controlled.info["control"]["version"] == "v1"
    assert not torch.equal(controlled.video_latents, plain.video_latents)
    off = engine.generate(_request(ControlRequest(video=video, strength=0.0)))
    assert off.info["control"]["evaluations"] == 0
    assert torch.equal(off.video_latents, plain.video_latents) and torch.equal(off.audio_latents, plain.audio_latents)
    late = engine.generate(_request(ControlRequest(video=video, start=0.9, end=1.0)))  # an empty window here
    assert late.info["control"]["evaluations"] == 0 and torch.equal(late.video_latents, plain.video_latents)
    assert engine.components.dit.control is None  # detached after each request


def test_a_generation_with_the_tower_streamed_equals_the_resident_one(engine, monkeypatch):
    """The tower placed as a budget too small for it resident places it (every block streamed, the AdaLN
    projections in host memory): the same latents, bit for bit, and the summary says how many blocks streamed."""
    from h3_spark.h3_model.engine.memory import measure_tower, plan_tower, streamed_minimum
    from h3_spark.h3_model.engine.placement import place_tower

    monkeypatch.setattr(engine.pipeline, "decode", False)
    control = ControlRequest(video=_pixels(30, 48, 80, 3, seed=3))
    resident = engine.generate(_request(control))
    assert resident.info["control"]["streamed_blocks"] == 0
    tower = engine.components.controlnet
    plan = plan_tower(tower, streamed_minimum(measure_tower(tower)))
    assert plan.resident_blocks == 0 and len(plan.streamed) == tower.config.blocks
    stream = place_tower(tower, plan, "cpu")
    streamed = engine.generate(_request(control))
    assert streamed.info["control"]["streamed_blocks"] == tower.config.blocks
    assert stream.stats.copies >= 2 * tower.config.blocks  # two evaluations, each block copied in for its turn
    assert torch.equal(streamed.video_latents, resident.video_latents)
    assert torch.equal(streamed.audio_latents, resident.audio_latents)


def test_the_hint_is_the_encoded_control_video(engine, monkeypatch):
    from h3_spark.h3_model.pipeline.generation import Pipeline

    monkeypatch.setattr(engine.pipeline, "decode", False)
    seen = {}
    real = Pipeline.control_injection

    def capture(self, *args, **kwargs):
        seen["injection"] = real(self, *args, **kwargs)
        return seen["injection"]

    monkeypatch.setattr(Pipeline, "control_injection", capture)
    video = _pixels(200, 64, 64, 3, seed=4)  # longer than the clip: cut at 124
    engine.generate(_request(ControlRequest(video=video), steps=2))
    latents = _quick_encode(engine.components.vae, video[:124])
    c = latents.shape[1]
    want = patchify(F.pad(latents, (0, 0, 0, 0, 0, 0, 0, 49 - c)), (1, 2, 2))
    assert torch.equal(seen["injection"].hint_rows, want)


def test_a_control_without_a_controlnet_is_refused(tiny_t2va_engine):
    with pytest.raises(InputError, match="needs a ControlNet: load one \\(--controlnet\\)"):
        tiny_t2va_engine.generate(_request(ControlRequest(video=_pixels(5, 8, 8, 3))))


def test_a_controlnet_for_another_dit_is_refused_before_its_weights(tiny_t2va_engine, tmp_path):
    dit = tiny_t2va_engine.components.dit.config
    wide = dataclasses.replace(dit, hidden_size=32, num_attention_heads=2)
    config = synthetic_config(wide, union2=False, comfy=False)
    path = tmp_path / "wide.safetensors"
    write_controlnet(path, config, random_getter(config, 0), "released")
    with pytest.raises(CheckpointError, match="is for a DiT 32 wide"):
        tiny_t2va_engine.load_controlnet(path)
    assert tiny_t2va_engine.components.controlnet is None


# ------------------------------------------------------------------------------------------ the CLI
@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def _cn(tmp_path, capsys, *argv):
    out = tmp_path / "cn.safetensors"
    assert main(["make-checkpoint", str(out), "--component", "controlnet", *argv]) == 0
    capsys.readouterr()
    return out


@pytest.mark.slow
def test_cli_generates_with_a_control_video_and_an_inpaint_mask(demo_models, tmp_path, capsys):
    pytest.importorskip("av")
    cn = _cn(tmp_path, capsys, "--layout", "released", "--union2")
    pose, src = tmp_path / "pose.mp4", tmp_path / "src.mp4"
    media.write_mp4(pose, _pixels(30, 48, 80, 3, seed=1), None, fps=24)
    media.write_mp4(src, _pixels(12, 64, 64, 3, seed=2), None, fps=24)
    mask = tmp_path / "mask.png"
    pixels = torch.zeros(64, 64, 3, dtype=torch.uint8)
    pixels[16:48, 16:48] = 255
    from PIL import Image

    Image.fromarray(pixels.numpy()).save(mask)
    code = main(["generate", "--demo", "--demo-dir", str(demo_models), "--prompt", "a dancer", "--steps", "3",
                 "--width", "64", "--height", "64", "--out", str(tmp_path / "o.mp4"), "--controlnet", str(cn),
                 "--control", str(pose), "--control-strength", "0.8", "--control-range", "0-0.5",
                 "--inpaint-mask", str(mask), "--inpaint-source", str(src)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["control"]["version"] == "union2" and summary["control"]["inpaint"] is True
    assert summary["control"]["window"] == [0.0, 0.5] and summary["control"]["strength"] == 0.8
    # 12 / (12 + 11 * 0.5) = 0.686 ends the window; the 2 evaluations run at sigma 1 and ~0.92
    assert summary["control"]["evaluations"] == 2


@pytest.mark.parametrize("flags,message", [
    (["--control", "{pose}"], "--control and --inpaint-mask need --controlnet FILE"),
    (["--controlnet", "{cn}"], "--controlnet needs --control VIDEO, --inpaint-mask M, or both"),
    (["--controlnet", "{cn}", "--control", "{pose}", "--control-range", "0.5"],
     "--control-range must be A-B, fractions of the schedule"),
    (["--controlnet", "{cn}", "--inpaint-source", "{pose}", "--control", "{pose}"],
     "--inpaint-source goes with --inpaint-mask"),
    (["--controlnet", "{dit}", "--control", "{pose}"], "holds the DiT .*, not an H3 Fun ControlNet"),
    (["--controlnet", "{cn}", "--control", "{bad}"], "bad.mp4"),
])
def test_cli_errors_are_one_line_before_loading(tmp_path, capsys, flags, message):
    cn = _cn(tmp_path, capsys, "--layout", "released")
    dit = tmp_path / "dit.safetensors"
    assert main(["make-checkpoint", str(dit)]) == 0
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    names = {"cn": cn, "dit": dit, "pose": tmp_path / "pose.mp4", "bad": bad}
    media.write_mp4(names["pose"], _pixels(5, 16, 16, 3), None, fps=24)
    capsys.readouterr()
    code = main(["generate", "--prompt", "p", "--out", str(tmp_path / "o.mp4"), "--models", str(tmp_path),
                 *[f.format(**names) for f in flags]])
    err = capsys.readouterr().err
    assert code == 2
    import re

    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
