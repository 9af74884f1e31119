"""Reference and keyframe normalisation against diffusers' Ref2VA setup step (static helpers)."""

import functools
import math
import types

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

from h3_spark.h3_model import geometry
from h3_spark.h3_model.media import refs
from h3_spark.errors import InputError


def _video(n, h, w, seed=0):
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fps", [30.0, 12.0, 25.0, 24.0, 60.0])
@pytest.mark.parametrize("size", [(48, 80), (64, 64)])
def test_video_normalisation_matches_diffusers(fps, size):
    frames = _video(70, *size)
    h, w = geometry.resolve_canvas(size[1], size[0])
    theirs = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames.numpy(), fps, 124, 32, 768, 768 * 1344, 24)
    ours = refs.resample_fps(frames, fps)[:124]
    ours = torch.stack([refs.resize(f, h, w) for f in ours])
    assert np.array_equal(ours.numpy(), theirs)


def test_prepare_video_reference_snaps_down_and_truncates_audio():
    clip = refs.VideoReference(_video(100, 36, 64), fps=30.0, audio=torch.randn(1, 44100 * 5) * 0.1, sample_rate=44100)
    (p,) = [r for r in refs.prepare_references([clip], width=128, height=64, frames=124) if r.kind == "video"]
    # 100 frames at 30 fps -> 80 at 24 fps -> snapped down to 17*4+5 = 73 frames.
    assert p.pixels.shape[0] == 73 and p.pixels.shape[1:3] == geometry.resolve_canvas(64, 36)
    assert p.audio.shape[0] == 2 and abs(p.audio.shape[1] - 32000 * 5) <= 64  # 5 s < 124 / 24 s: kept whole


def test_audio_reference_truncated_to_generation():
    audio = torch.sin(torch.arange(32000 * 9) / 10.0)[None]
    (p,) = refs.prepare_references([refs.ImageReference(_video(1, 40, 40)[0]), refs.AudioReference(audio)],
                                   width=128, height=64, frames=124)[1:]
    assert p.audio.shape == (2, int(124 / 24 * 32000))
    assert torch.equal(p.audio[0], p.audio[1])


def test_resample_audio_keeps_a_tone():
    rate, target = 44100, 32000
    t = torch.arange(rate) / rate
    tone = torch.sin(2 * math.pi * 440 * t)[None]
    out = refs.resample_audio(tone, rate, target)[0]
    assert abs(out.shape[0] - target) <= 64
    ref = torch.sin(2 * math.pi * 440 * torch.arange(out.shape[0]) / target)
    mid = slice(1000, out.shape[0] - 1000)  # skip the filter's edges
    assert ((out[mid] - ref[mid]).norm() / ref[mid].norm()).item() < 0.02


def test_soundtracks_are_cut_at_their_own_rate_then_resampled_once(tmp_path):
    # The reference pipeline's order (a 48 kHz file, a 5.3 s generation): truncate at 48 kHz, resample once.
    from h3_spark.h3_model.media.resample import resample
    from test_media import write_audio

    wave = np.random.default_rng(3).uniform(-0.5, 0.5, (2, 48000 * 6)).astype(np.float32)
    write_audio(tmp_path / "a.wav", wave, 48000, "pcm_s16le")
    ref = refs.load_reference("audio", tmp_path / "a.wav", frames=124)
    assert ref.sample_rate == 48000
    (p,) = refs.prepare_references([refs.ImageReference(_video(1, 40, 40)[0]), ref], width=128, height=64,
                                   frames=124)[1:]
    cut = ref.audio[:, : int(124 / 24 * 48000)]
    assert torch.equal(p.audio, resample(cut, 48000, 32000))
    assert p.audio.shape == (2, math.ceil(cut.shape[1] * 2 / 3))
    assert (p.audio - refs.resample_audio(torch.from_numpy(wave), 48000, 32000)[:, : p.audio.shape[1]]).abs()[
        :, :-64].max() < 1e-3  # the 16-bit file's rounding, away from the cut


@pytest.mark.parametrize("policy,src,expect", [
    ("match", (1920, 1080), (544, 960)), ("match", (300, 200), (192, 288)),
    ("max", (4000, 3000), (2048, 2720)), ("max", (640, 480), (480, 640)),
    ("diffusers", (1920, 1080), (2048, 3648)), ("diffusers", (512, 512), (2048, 2048)),
])
def test_image_reference_policies(policy, src, expect):
    assert geometry.reference_size(policy, *src, 960, 544) == expect


def test_keyframes_first_stretched_last_cover_cropped():
    first, last = _video(1, 60, 100)[0], _video(1, 100, 100, seed=1)[0]
    images, anchors, w, h = refs.prepare_keyframes(first, last, None, None)
    assert anchors == ("first", "last") and (h, w) == geometry.resolve_canvas(100, 60)
    assert torch.equal(images[0], refs.resize(first, h, w))
    scale = max(w / 100, h / 100)
    big = refs.resize(last, max(h, round(100 * scale)), max(w, round(100 * scale)))
    top, left = (big.shape[0] - h) // 2, (big.shape[1] - w) // 2
    assert torch.equal(images[1], big[top:top + h, left:left + w])
    only_last, anchors, *_ = refs.prepare_keyframes(None, last, 128, 64)
    assert anchors == ("last",) and only_last[0].shape == (64, 128, 3)


@pytest.mark.parametrize("items,message", [
    ([refs.AudioReference(torch.randn(2, 100))], "audio-only references are not supported"),
    ([refs.ImageReference(torch.zeros(4, 4, 3))], "must be a uint8"),
    ([refs.VideoReference(_video(3, 8, 8))],
     r"reference 1 \(video\) has 3 frames at 24 fps; a video reference needs at least 13 \(0.54 s\): the text "
     r"encoder reads it at 2 fps, 2 sampled frames per vision block"),
    ([refs.VideoReference(_video(12, 8, 8))], "has 12 frames at 24 fps; a video reference needs at least 13"),
    # Counted at 24 fps: 15 frames at 30 fps are 12 (16 would be 13).
    ([refs.VideoReference(_video(15, 8, 8), fps=30.0)], "has 12 frames at 24 fps"),
    ([refs.VideoReference(_video(30, 8, 8), fps=0)], "positive frame rate"),
    ([refs.ImageReference(_video(1, 8, 8)[0]), refs.AudioReference(torch.randn(3, 10))], "mono or stereo"),
    (["picture.png"], "unsupported reference type"),
    ([refs.ImageReference(_video(1, 1000, 40)[0])],
     r"reference 1 \(image\): aspect ratio 40:1000 \(0.04\) is outside 1:4 .. 4:1"),
])
def test_reference_errors(items, message):
    with pytest.raises(InputError, match=message):
        refs.prepare_references(items, width=128, height=64, frames=124)


def test_keyframe_errors():
    with pytest.raises(InputError, match="needs a first and/or a last keyframe"):
        refs.prepare_keyframes(None, None, None, None)
    with pytest.raises(InputError, match="width and height go together"):
        refs.prepare_keyframes(_video(1, 8, 8)[0], None, 64, None)


# ---- short video references, against diffusers' Ref2VA set-up and reference-encoder steps
def _diffusers_components(vae=None, short_edge=768, max_pixels=768 * 1344):
    """What the two steps read of a MiniMaxH3ModularPipeline; the audio VAE only lends its latent stats."""
    audio_stats = types.SimpleNamespace(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
    return types.SimpleNamespace(
        vae=vae, audio_vae=types.SimpleNamespace(config=audio_stats), audio_latent_channels=32,
        audio_sampling_rate=32000, pixel_mean=(0.485, 0.456, 0.406), pixel_std=(0.229, 0.224, 0.225),
        keyframe_encode_seed=42, vae_frames_per_chunk=17, vae_latents_per_chunk=5, canvas_multiple=32, fps=24,
        min_duration=5.0, max_duration=15.0, _execution_device=torch.device("cpu"),
        config=types.SimpleNamespace(canvas_short_edge=short_edge, canvas_max_pixels=max_pixels,
                                     reference_image_short_edge=2048))


def _diffusers_reference_latents(frames, fps, components):
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3VideoReference
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep

    state = PipelineState()
    for name, value in (("references", [MiniMaxH3VideoReference(frames=frames.numpy(), fps=fps)]),
                        ("num_frames", 124), ("height", None), ("width", None)):
        state.set(name, value)
    with torch.no_grad():
        MiniMaxH3Ref2VASetupStep()(components, state)
        MiniMaxH3Ref2VAReferenceEncoderStep()(components, state)
    return state.get("condition_latents")[0]


@pytest.mark.parametrize("count, fps, vae_frames", [
    (13, 24.0, 13), (17, 24.0, 17), (18, 24.0, 18), (21, 24.0, 21), (22, 24.0, 22), (38, 24.0, 22), (39, 24.0, 39),
    (16, 30.0, 13), (200, 24.0, 124),
])
def test_video_reference_reaches_the_vae_as_in_diffusers(monkeypatch, count, fps, vae_frames):
    """Every frame count from the shortest accepted up: the uint8 frames handed to the VAE are diffusers' own (its
    VAE call replaced by a recorder), so a reference shorter than 22 frames goes whole, not snapped to 5."""
    from diffusers.modular_pipelines.minimax_h3 import encoders

    seen = []
    monkeypatch.setattr(encoders, "encode_vae_condition",
                        lambda vae, pixels, *args, **kwargs: seen.append(pixels) or torch.zeros(1))
    frames = _video(count, 36, 64, seed=count)
    _diffusers_reference_latents(frames, fps, _diffusers_components())
    (p,) = refs.prepare_references([refs.VideoReference(frames, fps=fps)], width=128, height=64, frames=124)
    assert torch.equal(p.pixels, seen[0][0].permute(1, 2, 3, 0))
    assert p.pixels.shape[0] == vae_frames
    assert torch.equal(p.prompt_pixels[:vae_frames], p.pixels)
    assert p.prompt_pixels.shape[0] == min(124, refs.resample_fps(frames, fps).shape[0])


@pytest.fixture(scope="module")
def tiny_vaes(tmp_path_factory):
    """diffusers' AutoencoderKLMiniMaxH3 with random weights and latent stats, and ours loaded from its folder."""
    import dataclasses

    from diffusers import AutoencoderKLMiniMaxH3
    from oracle import randomize_vae_

    from h3_spark.h3_model.vae import loading as vae_loading
    from h3_spark.h3_model.vae import video_config
    gen = torch.Generator().manual_seed(3)
    c = video_config.TINY.latent_channels
    cfg = dataclasses.replace(video_config.TINY, latents_mean=tuple((0.5 * torch.randn(c, generator=gen)).tolist()),
                              latents_std=tuple((0.5 + torch.rand(c, generator=gen)).tolist()))
    theirs = AutoencoderKLMiniMaxH3(**{k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}).eval()
    randomize_vae_(theirs, 12)
    folder = tmp_path_factory.mktemp("vae")
    theirs.save_pretrained(folder / "vae")
    return theirs, vae_loading.load_video_vae(folder, decode_dtype=torch.float32)


@pytest.mark.parametrize("count, latent_frames", [(13, 2), (17, 2), (18, 7), (21, 7), (22, 7), (40, 12)])
def test_short_video_reference_encodes_and_lays_out_like_diffusers(tiny_vaes, monkeypatch, count, latent_frames):
    """prepare_references -> the pipeline's condition encode (our video VAE) against diffusers' set-up and
    reference-encoder steps with the same weights: same latents, and the layout block takes their shape."""
    from h3_spark.h3_model.dit.layout import VideoBlock
    from h3_spark.h3_model.pipeline.generation import Components, Pipeline

    theirs_vae, ours_vae = tiny_vaes
    # A 64 px short edge on both sides keeps the VAE cheap; the canvas rule itself is held to diffusers' above.
    short_edge, max_pixels = 64, 64 * 112
    monkeypatch.setattr(geometry, "resolve_canvas", functools.partial(geometry.resolve_canvas, short_edge=short_edge,
                                                                      max_pixels=max_pixels))
    frames = _video(count, 36, 64, seed=100 + count)
    theirs = _diffusers_reference_latents(frames, 24.0, _diffusers_components(theirs_vae, short_edge, max_pixels))
    prepared = refs.prepare_references([refs.VideoReference(frames)], width=128, height=64, frames=124)
    conditions, audio_rows, blocks, hits = Pipeline(Components(vae=ours_vae)).encode_conditions([], prepared)
    assert theirs.shape == (1, 4, latent_frames, 16, 32)
    assert conditions[0].shape == theirs.shape
    assert ((conditions[0] - theirs).norm() / theirs.norm()).item() <= 1e-5
    assert blocks == [VideoBlock(latent_frames, 16, 32, 0)] and audio_rows == [] and hits == 0
