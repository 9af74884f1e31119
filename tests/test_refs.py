"""Reference and keyframe normalisation against diffusers' Ref2VA setup step (static helpers)."""

import math

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

from h3_spark.h3_model import geometry, refs
from h3_spark.h3_model.errors import InputError


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
     r"has 3 frames at 24 fps; a video reference needs at least 22 \(one VAE chunk\)"),
    ([refs.VideoReference(_video(21, 8, 8))], "has 21 frames at 24 fps; a video reference needs at least 22"),
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
