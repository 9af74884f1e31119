"""Noise masks: pooling pixels and samples to the DiT's rows (against indices worked by hand), and a repaint on
the tiny engine whose kept rows come out as the clip's own latents, exactly."""

import re

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.masks import NoiseMask, Source, audio_rows, latent_frame_spans, time_span_mask, video_rows


def test_latent_frames_cover_1_then_4_frames():
    assert latent_frame_spans(7) == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17), (17, 18), (18, 22)]


def test_one_pixel_marks_its_patch_of_its_latent_frame():
    mask = torch.zeros(22, 64, 96)
    mask[6, 40, 10] = 0.5  # frame 6 is in latent frame 2 (frames 5..8); patch row 1, column 0 of a 2x3 grid
    rows = video_rows(mask, 22, 64, 96)
    assert rows.shape == (7 * 6,) and rows.nonzero().flatten().tolist() == [2 * 6 + 1 * 3 + 0]


def test_a_still_mask_applies_to_every_frame_and_whole_frames_to_every_patch():
    still = torch.zeros(64, 96)
    still[:32, 64:] = 1  # the top-right patch
    assert video_rows(still, 22, 64, 96).reshape(7, 6)[:, 2].all()
    frames = torch.zeros(22)
    frames[17] = 1  # the sixth latent frame is frame 17 alone
    assert video_rows(frames, 22, 64, 96).reshape(7, 6).any(1).tolist() == [False] * 5 + [True, False]


def test_audio_masks_pool_to_whole_latents_of_both_channels():
    mask = torch.zeros(8000)
    mask[1600] = 1  # sample 1600: latent 2 (800 samples each)
    rows = audio_rows(mask, 10)
    assert rows.nonzero().flatten().tolist() == [2, 12]


def test_a_time_span_marks_the_frames_and_samples_it_overlaps():
    mask = time_span_mask(124, 1.0, 2.0)
    assert mask.video.nonzero().flatten().tolist() == list(range(24, 48))
    assert mask.audio.nonzero().flatten().tolist() == list(range(32000, 64000))


@pytest.mark.parametrize("call, message", [
    (lambda: video_rows(torch.zeros(5, 64, 64), 22, 64, 64),
     "a video mask is (frames, height, width) = (22, 64, 64), (height, width) or (frames,), got (5, 64, 64)"),
    (lambda: video_rows(torch.full((64, 64), 2.0), 22, 64, 64), "a video mask holds values in [0, 1] (1: make anew), got 2..2"),
    (lambda: audio_rows(torch.zeros(9000), 10), "an audio mask is one value per sample, at most 8000 for this clip"),
    (lambda: time_span_mask(124, 2.0, 1.0), "a time span runs from a start >= 0 to a later end, got 2..1 s"),
    (lambda: time_span_mask(124, 6.0, 7.0), "the span 6..7 s starts past the clip's end (5.16667 s)"),
])
def test_bad_masks(call, message):
    with pytest.raises(InputError, match=re.escape(message)):
        call()


@pytest.fixture
def engine(tiny_t2va_engine):
    return tiny_t2va_engine


def _source():
    gen = torch.Generator().manual_seed(5)
    frames = torch.randint(0, 256, (124, 64, 64, 3), dtype=torch.uint8, generator=gen)
    audio = torch.rand(2, 124 * 4000 // 3, generator=gen) - 0.5
    return Source(frames, audio)


def test_a_repaint_keeps_the_clips_latents_where_the_mask_keeps(engine):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest, audio_rows_of
    from h3_spark.h3_model.vae.video import encode_condition

    source = _source()
    mask = time_span_mask(124, 1.0, 2.0)
    req = GenerationRequest("t2va", "a boat", steps=3, seed=1, source=source, mask=mask)
    result = engine.generate(req)
    assert (req.width, req.height, req.frames) == (64, 64, 124)
    want = encode_condition(engine.components.vae, source.frames)
    anew = video_rows(mask.video, 124, 64, 64).reshape(37, 2, 2)
    kept = ~anew.any(dim=(1, 2))  # whole latent frames here: the span covers every patch of its frames
    assert kept.sum() == 37 - 8  # frames 24..47 touch latent frames 7..14 (frames 22..50)
    assert torch.equal(result.video_latents[:, :, kept], want[:, :, kept])
    assert not torch.allclose(result.video_latents[:, :, ~kept], want[:, :, ~kept])
    sound = engine.components.audio_vae.encode_stereo(torch.nn.functional.pad(source.audio, (0, 207 * 800 -
                                                                                             source.audio.shape[1])))
    kept_audio = ~audio_rows(mask.audio, 207)[:207]
    assert torch.equal(result.audio_latents[..., kept_audio], sound.float()[..., kept_audio])
    assert not torch.allclose(result.audio_latents[..., ~kept_audio], sound.float()[..., ~kept_audio])
    assert result.info["kept_rows"] == {"video": 29 * 4, "audio": 2 * int(kept_audio.sum())}


@pytest.mark.parametrize("changes, message", [
    (dict(mask=None), "a noise mask and the clip it masks go together (source and mask)"),
    (dict(mode="fl2va", last_frame=torch.zeros(8, 8, 3, dtype=torch.uint8)),
     "fl2va takes no noise mask; repainting a clip is t2va"),
    (dict(width=128, height=64), "the clip to repaint is 64x64, the request 128x64: it is repainted at its own size"),
])
def test_bad_repaints(changes, message):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    args = dict(mode="t2va", prompt="p", source=_source(), mask=NoiseMask(video=torch.ones(64, 64)))
    args.update(changes)
    with pytest.raises(InputError, match=re.escape(message)):
        GenerationRequest(**args).validate()


def test_a_clip_to_repaint_is_17k_plus_5_frames():
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    req = GenerationRequest("t2va", "p", source=Source(torch.zeros(130, 64, 64, 3, dtype=torch.uint8)),
                            mask=NoiseMask(video=torch.ones(64, 64)))
    with pytest.raises(InputError, match=re.escape("the clip to repaint has 130 frames; it must be 17k+5 (124..345)")):
        req.validate()
