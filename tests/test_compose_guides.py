"""Guides at any frame: the request's checks (one line each), the rows they add to the packed sequence (against
the formulas worked by hand), FL2VA's keyframes as guides, and a generation that carries them to the DiT."""

import math
import re

import numpy as np
import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.guides import Guide, prepare_guides, resolve_frame
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.layout import GuideBlock, build_t2va
from h3_spark.h3_model.geometry import audio_latent_frames, video_latent_frames
from h3_spark.h3_model.pipeline.scheduler import CONDITION_AUDIO_T, CONDITION_VIDEO_T


def _pixels(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _tone(seconds, rate=32000, channels=2):
    t = torch.arange(int(seconds * rate)) / rate
    return torch.stack([torch.sin(2 * torch.pi * 220 * t)] * channels)


# ------------------------------------------------------------------ the request's guides
def test_frames_resolve_from_either_end():
    assert [resolve_frame(i, 124, "g") for i in (0, 48, -1, -124)] == [0, 48, 123, 0]


def test_stills_and_clips_are_cover_cropped_to_the_canvas():
    prepared = prepare_guides([Guide("image", 48, image=_pixels(90, 160, 3)),
                               Guide("clip", -22, clip=_pixels(22, 40, 40, 3, seed=1))], frames=124, width=64,
                              height=32)
    assert [(p.kind, p.frame, tuple(p.pixels.shape)) for p in prepared] == [
        ("image", 48, (32, 64, 3)), ("clip", 102, (22, 32, 64, 3))]


def test_a_clip_at_another_rate_is_resampled_to_24_fps_first():
    # 11 frames at 12 fps are 22 at 24 fps: a valid clip.
    prepared, = prepare_guides([Guide("clip", 0, clip=_pixels(11, 32, 64, 3), fps=12.0)], frames=124, width=64,
                               height=32)
    assert prepared.frames == 22


def test_sound_is_made_stereo_at_32_khz():
    prepared, = prepare_guides([Guide("audio", -48, audio=_tone(1.5, 16000, channels=1), sample_rate=16000)],
                               frames=124, width=64, height=32)
    assert prepared.audio.shape == (2, 48000) and prepared.frame == 76


@pytest.mark.parametrize("guide, message", [
    (Guide("sketch", 0), "guide 1 (sketch): a guide is one of image, clip, audio, got 'sketch'"),
    (Guide("image", 124, image=_pixels(8, 8, 3)),
     "guide 1 (image): frame 124 is outside the 124-frame clip (use 0..123, or -1..-124 from the end)"),
    (Guide("image", -125, image=_pixels(8, 8, 3)), "frame -125 is outside the 124-frame clip"),
    (Guide("image", 1.5, image=_pixels(8, 8, 3)), "guide 1 (image): the frame index must be an integer, got 1.5"),
    (Guide("image", 0, image=torch.zeros(8, 8)), "guide 1 (image) must be a uint8 (H, W, 3) RGB tensor"),
    (Guide("clip", 0, clip=_pixels(20, 8, 8, 3)),
     "guide 1 (clip) has 20 frames at 24 fps; a clip guide is 17k+5 frames (5, 22, 39, ...) (the nearest shorter is 5)"),
    (Guide("clip", 110, clip=_pixels(22, 8, 8, 3)),
     "guide 1 (clip): its 22 frames from frame 110 run past the clip's end (124 frames); anchor it at 102 or earlier"),
    (Guide("clip", 0, clip=_pixels(22, 8, 8)), "guide 1 (clip) must be uint8 (F, H, W, 3) frames"),
    (Guide("audio", 0), "guide 1 (audio) needs a (channels, samples) waveform"),
    # The canvas is 64x32 (2:1): a 1:2 still would keep a quarter of its height, a 1:3 one a sixth.
    (Guide("image", 0, image=_pixels(300, 100, 3)),
     "guide 1 (image) is 100x300: cover-cropped to the 64x32 canvas it would keep 16.7% of its height; its aspect "
     "must be within 4x of the canvas's"),
    (Guide("clip", 0, clip=_pixels(5, 2, 40, 3)),
     "guide 1 (clip) is 40x2: cover-cropped to the 64x32 canvas it would keep 10.0% of its width"),
    (Guide("audio", 0, audio=torch.rand(3, 100)), "guide 1 (audio) must be a (channels, samples) mono or stereo"),
])
def test_bad_guides(guide, message):
    with pytest.raises(InputError, match=re.escape(message)):
        prepare_guides([guide], frames=124, width=64, height=32)


def test_too_many_guides():
    with pytest.raises(InputError, match=re.escape("at most 16 guides, got 17")):
        prepare_guides([Guide("image", 0, image=_pixels(8, 8, 3))] * 17, frames=124, width=64, height=32)


# ------------------------------------------------------------------ the rows they add
TEXT, FRAMES, LH, LW = 37, 124, 4, 6  # 124 frames: 37 latent frames; a 4x6 latent grid: 2x3 patches
LATENT_FRAMES, AUDIO = video_latent_frames(FRAMES), audio_latent_frames(FRAMES)


def _layout(guides=(), keyframes=()):
    return build_t2va(torch.ones(TEXT, dtype=torch.long), LATENT_FRAMES, LH, LW, AUDIO, keyframes=keyframes,
                      guides=tuple(guides))


def test_a_still_a_clip_and_a_sound_sit_where_the_formulas_put_them():
    lay = _layout([GuideBlock(48, 1), GuideBlock(5, 7), GuideBlock(30, 0, 20)])
    pos = lay.position_ids
    grid = 6  # rows of one latent frame
    still, clip, sound = slice(TEXT, TEXT + grid), slice(TEXT + grid, TEXT + 8 * grid), slice(TEXT + 8 * grid,
                                                                                              TEXT + 8 * grid + 40)
    # The still: text length + 5/3 x 48 = 117, on the target's spatial grid.
    assert torch.all(pos[still, 0] == TEXT + 48 * 5 / 3)
    target = lay.target_video_indices
    assert torch.equal(pos[still, 1:], pos[target[:grid], 1:])
    # The clip of 22 frames = 7 latent frames from frame 5: spans of (1, 4, 4, 4, 4, 1, 4) frames x 5/3 each.
    starts = TEXT + 5 * 5 / 3 + np.cumsum([0, 1, 4, 4, 4, 4, 1]) * 5 / 3
    assert torch.allclose(pos[clip, 0].reshape(7, grid)[:, 0], torch.tensor(starts), rtol=0, atol=1e-12)
    # The sound from frame 30: one rotary unit per 40 Hz latent from 37 + 50, left channel then right, each
    # pinned to one end of the target's width axis.
    t0 = TEXT + 30 * 5 / 3
    assert torch.allclose(pos[sound, 0], (t0 + torch.arange(20.0, dtype=torch.float64)).repeat(2), atol=1e-12)
    w = pos[target[:grid], 2]
    assert torch.all(pos[sound][:20, 2] == w.min()) and torch.all(pos[sound][20:, 2] == w.max())
    assert lay.num_condition_video_rows == 8 * grid and lay.num_condition_audio_rows == 40
    # Tags and per-row timesteps: guide video rows are video rows held at the condition level, guide sound at 1.
    assert torch.all(lay.token_tags[TEXT:TEXT + 8 * grid] == layout.VIDEO_TAG)
    assert torch.all(lay.token_tags[sound] == layout.AUDIO_TAG)
    levels, index = lay.row_timesteps(0.3, 0.6, CONDITION_VIDEO_T, CONDITION_AUDIO_T)
    rows = levels[index]
    assert torch.all(rows[TEXT:TEXT + 8 * grid] == CONDITION_VIDEO_T) and torch.all(rows[sound] == CONDITION_AUDIO_T)
    assert torch.all(rows[target] == torch.tensor(0.3)) and torch.all(rows[lay.target_audio_indices] == 0.6)


def test_fl2va_keyframes_are_guides_at_the_first_and_last_frames():
    both = _layout(keyframes=("first", "last"))
    as_guides = _layout([GuideBlock(0, 1), GuideBlock(FRAMES - 1, 1)])
    for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(both, name), getattr(as_guides, name)), name
    # The last keyframe keeps the released pipeline's coordinate (pairwise sum of the spans, less a frame).
    last = both.position_ids[TEXT + 6, 0].item()
    assert last == TEXT + layout._rope_span_pairwise(LATENT_FRAMES) - 5 / 3


@pytest.mark.parametrize("guide, message", [
    (GuideBlock(124, 1), "guide 1: frame 124 is outside the 124-frame target"),
    (GuideBlock(0, 0, 0), "guide 1 needs video or audio latents, got 0 and 0"),
    (GuideBlock(0, 4), "guide 1: a clip is 5k+2 latent frames, got 4"),
    (GuideBlock(110, 7), "guide 1: its 22 frames from frame 110 run past the 124-frame target"),
    (GuideBlock(120, 0, 10), "guide 1: 10 audio latents from frame 120 run past the target's 207 (7 remain)"),
])
def test_bad_guide_blocks(guide, message):
    with pytest.raises(InputError, match=re.escape(message)):
        _layout([guide])


# ------------------------------------------------------------------ a generation with guides
@pytest.fixture
def engine(tiny_t2va_engine):
    return tiny_t2va_engine


def test_guides_reach_the_dit_as_encoded_condition_rows(engine, monkeypatch):
    from h3_spark.h3_model.media.refs import cover_crop
    from h3_spark.h3_model.pipeline.generation import GenerationRequest, Pipeline
    from h3_spark.h3_model.vae.video import encode_condition

    seen = {}
    real = Pipeline.sample

    def capture(self, dit, request, *args, **kwargs):
        seen["request"] = request
        return real(self, dit, request, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "sample", capture)
    still, clip = _pixels(40, 90, 3, seed=3), _pixels(22, 64, 64, 3, seed=4)
    req = GenerationRequest("t2va", "a boat", width=64, height=64, frames=124, steps=2, guides=[
        Guide("image", 48, image=still), Guide("clip", -22, clip=clip), Guide("audio", 24, audio=_tone(0.5))])
    result = engine.generate(req)
    sampled = seen["request"]
    vae = engine.components.vae
    assert len(sampled.condition_latents) == 2  # the still, then the clip, in packed order
    assert torch.equal(sampled.condition_latents[0], encode_condition(vae, cover_crop(still, 64, 64)))
    assert torch.equal(sampled.condition_latents[1], encode_condition(vae, clip))
    assert sampled.condition_latents[1].shape[2] == 7  # 22 frames -> 7 latent frames
    audio_latents = engine.components.audio_vae.encode_stereo(_tone(0.5)).float()
    assert len(sampled.audio_condition_rows) == 1 and sampled.audio_condition_rows[0].shape[0] == 2 * 20
    assert torch.equal(sampled.audio_condition_rows[0],
                       audio_latents.transpose(1, 2).reshape(-1, audio_latents.shape[1]))
    lay = sampled.layout
    text = result.info["text_tokens"]
    grid = (64 // 16 // 2) ** 2
    assert lay.num_condition_video_rows == 8 * grid and lay.num_condition_audio_rows == 40
    assert torch.all(lay.position_ids[text:text + grid, 0] == text + 48 * 5 / 3)
    assert lay.position_ids[text + grid, 0] == text + 102 * 5 / 3  # -22 resolves to frame 102
    assert torch.all(lay.position_ids[text + 8 * grid:text + 8 * grid + 20, 0]
                     == text + 40 + torch.arange(20.0, dtype=torch.float64))
    assert result.video.shape == (124, 64, 64, 3)  # the target is unchanged in size: guides only condition it


def test_a_history_comes_before_the_target_which_goes_on_where_it_ends():
    from h3_spark.h3_model.dit.layout import HistoryBlock

    lay = build_t2va(torch.ones(TEXT, dtype=torch.long), LATENT_FRAMES, LH, LW, AUDIO,
                     guides=(GuideBlock(0, 1),), history=HistoryBlock(7, 36))
    pos, grid = lay.position_ids, 6
    # 22 history frames (7 latent frames) from the text's end: spans (1, 4, 4, 4, 4, 1, 4) x 5/3, 36.67 units.
    span = 22 * 5 / 3
    hist = pos[TEXT:TEXT + 7 * grid, 0].reshape(7, grid)[:, 0]
    assert torch.allclose(hist, TEXT + torch.tensor(np.cumsum([0, 1, 4, 4, 4, 4, 1]) * 5 / 3), atol=1e-12)
    # Its 36 audio latents end one latent before the target's first.
    sound = pos[TEXT + 7 * grid:TEXT + 7 * grid + 72, 0]
    assert torch.allclose(sound[:36], TEXT + span - 36 + torch.arange(36.0, dtype=torch.float64), atol=1e-12)
    # The first-frame guide and the target start where the history ends.
    origin = TEXT + span
    guide = pos[TEXT + 7 * grid + 72:TEXT + 8 * grid + 72, 0]
    assert torch.allclose(guide, torch.full_like(guide, origin), atol=1e-12)
    assert abs(pos[lay.target_video_indices[0], 0].item() - origin) < 1e-12
    assert abs(pos[lay.target_audio_indices[0], 0].item() - origin) < 1e-12
    assert lay.num_condition_video_rows == 8 * grid and lay.num_condition_audio_rows == 72
    # Condition rows in packed order: the history's video first, then the guide's.
    assert torch.equal(lay.video_indices[:8 * grid], torch.cat([torch.arange(TEXT, TEXT + 7 * grid),
                                                                torch.arange(TEXT + 7 * grid + 72, TEXT + 8 * grid + 72)]))


@pytest.mark.parametrize("history, message", [
    (dict(latent_frames=4), "a history is 5k+2 latent frames (k >= 1), got 4"),
    (dict(latent_frames=7, audio_latents=37), "a history's sound must fit its 22 frames: at most 36 audio latents, got 37"),
])
def test_bad_histories(history, message):
    from h3_spark.h3_model.dit.layout import HistoryBlock

    with pytest.raises(InputError, match=re.escape(message)):
        build_t2va(torch.ones(TEXT, dtype=torch.long), LATENT_FRAMES, LH, LW, AUDIO, history=HistoryBlock(**history))


def test_guide_strength_sets_the_level_conditions_are_held_at(engine):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.h3_model.pipeline.sampler import condition_rows, schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule

    def request(strength):
        return GenerationRequest("t2va", "a boat", width=64, height=64, frames=124, steps=3, guide_strength=strength,
                                 guides=[Guide("image", 48, image=_pixels(40, 90, 3, seed=3))])

    default, released, loose = (engine.generate(request(s)) for s in (None, CONDITION_VIDEO_T, 0.5))
    assert torch.equal(default.video_latents, released.video_latents)  # 0.999 is the released level
    assert not torch.allclose(default.video_latents, loose.video_latents)
    assert loose.info["guide_strength"] == 0.5 and "guide_strength" not in default.info
    # The mix: level x latent + (1 - level) x the condition's own draw.
    cond = torch.randn(1, 24, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    rows = condition_rows([cond], torch.Generator().manual_seed(2), (1, 2, 2), 0.5)
    noise = torch.randn(cond.shape, generator=torch.Generator().manual_seed(2))
    assert torch.equal(rows, layout.patchify(0.5 * cond + 0.5 * noise, (1, 2, 2)))
    # Its level is a timestep the AdaLN tables are made for while the target is noisier than it.
    lay = _layout([GuideBlock(48, 1)])
    assert 0.5 in schedule_timestep_values(lay, JointSchedule.create(10), 0.5)


def test_audio_guide_strength_sets_the_level_audio_conditions_are_held_at(engine):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.h3_model.pipeline.sampler import audio_condition_rows, schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule

    sound = torch.randn(2, 32000, generator=torch.Generator().manual_seed(4)) * 0.3

    def request(strength):
        return GenerationRequest("t2va", "a boat", width=64, height=64, frames=124, steps=3,
                                 audio_guide_strength=strength, guides=[Guide("audio", 24, audio=sound)])

    default, released, loose = (engine.generate(request(s)) for s in (None, 1.0, 0.5))
    assert torch.equal(default.audio_latents, released.audio_latents)  # 1.0 (clean) is the released level
    assert torch.equal(default.video_latents, released.video_latents)
    assert not torch.allclose(default.audio_latents, loose.audio_latents)
    assert loose.info["audio_guide_strength"] == 0.5 and "audio_guide_strength" not in default.info
    # The mix: level x rows + (1 - level) x a draw from the seed + 1 stream; the sampling stream is untouched.
    rows = [torch.randn(6, 32, generator=torch.Generator().manual_seed(1))]
    generator = torch.Generator().manual_seed(9)
    mixed, = audio_condition_rows(rows, generator, 0.5)
    noise = torch.randn(6, 32, generator=torch.Generator().manual_seed(10))
    assert torch.equal(mixed, 0.5 * rows[0] + 0.5 * noise)
    assert torch.equal(torch.randn(3, generator=generator), torch.randn(3, generator=torch.Generator().manual_seed(9)))
    assert audio_condition_rows(rows, generator, 1.0) is rows
    # Its level is a timestep the AdaLN tables are made for while the target audio is noisier than it.
    lay = _layout([GuideBlock(48, 0, 3)])
    assert 0.5 in schedule_timestep_values(lay, JointSchedule.create(10), condition_audio_t=0.5)
    assert 0.5 not in schedule_timestep_values(lay, JointSchedule.create(10))


@pytest.mark.parametrize("field, name, strength", [
    ("guide_strength", "guide strength", 0), ("guide_strength", "guide strength", 1.5),
    ("guide_strength", "guide strength", True), ("guide_strength", "guide strength", "high"),
    ("audio_guide_strength", "audio guide strength", 0), ("audio_guide_strength", "audio guide strength", 1.01),
    ("audio_guide_strength", "audio guide strength", False),
])
def test_bad_guide_strengths(field, name, strength):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    with pytest.raises(InputError, match="^" + re.escape(f"{name} is the level conditions are held at, in (0, 1]")):
        GenerationRequest("t2va", "p", **{field: strength}).validate()


# ------------------------------------------------------------------ a sound's count: ComfyUI's
def _comfy_kept(frames, frame):
    """ComfyUI's MiniMaxH3AddGuide: the audio latents a sound at `frame` keeps, floor(T - 5/3 x frame) with T the
    latent's audio length round(frames / 24 x 40), in its float arithmetic."""
    return math.floor(round(frames / 24 * 40) - (5.0 / 3.0) * frame)


@pytest.mark.parametrize("frames", [124, 345])
def test_a_sound_keeps_comfyuis_count_at_every_frame(frames):
    from h3_spark.h3_model.compose.guides import remaining_audio_latents

    audio = audio_latent_frames(frames)
    latent_frames = video_latent_frames(frames)
    long_sound = _tone(frames / 24 + 0.5)
    kept = []
    for frame in range(frames):
        expected = _comfy_kept(frames, frame)
        assert remaining_audio_latents(frame, frames) == expected, frame
        # The guide as prepared keeps that many once encoded; the layout takes that many and refuses one more.
        prepared, = prepare_guides([Guide("audio", frame, audio=long_sound)], frames=frames, width=64, height=32)
        assert prepared.max_audio_latents == expected, frame
        assert prepared.keep(torch.zeros(2, 4, audio + 1)).shape[-1] == expected
        layout.check_guides([GuideBlock(frame, 0, expected)], latent_frames, audio)
        with pytest.raises(InputError, match=re.escape(f"{expected + 1} audio latents from frame {frame} run past")):
            layout.check_guides([GuideBlock(frame, 0, expected + 1)], latent_frames, audio)
        kept.append(expected)
    # Where 5/3 x frame is not whole the count rounds it up: at frame 29 of 124, 207 - 48.33 -> 158, not 159.
    if frames == 124:
        assert kept[29] == 158 and kept[30] == 157 and kept[0] == 207
    # Every last row stays before the target's end: frame x 5/3 + kept <= T.
    assert all(f * 5 / 3 + k <= audio for f, k in enumerate(kept))


def test_a_sound_past_the_end_is_cropped_with_a_note():
    from h3_spark.h3_model.compose.guides import check_guides

    guide = Guide("audio", 110, audio=_tone(1.0))
    # 207 audio latents for 124 frames; from frame 110 (5/3 x 110 = 183.33) 23 remain: 0.575 s.
    note = ("guide 1 (audio): 1.000 s of sound from frame 110 runs past the clip's end; cropped to the 23 audio "
            "latents (0.575 s) that remain")
    assert check_guides([guide], frames=124, width=64, height=32) == [note]
    prepared, = prepare_guides([guide], frames=124, width=64, height=32)
    assert prepared.note == note and prepared.max_audio_latents == 23
    assert prepared.audio.shape == (2, 32000)  # the whole sound is encoded; its latents are cut (as ComfyUI does)
    # One that fits is kept whole, without a note.
    short, = prepare_guides([Guide("audio", 110, audio=_tone(0.5))], frames=124, width=64, height=32)
    assert short.note is None and short.max_audio_latents == 23
    assert check_guides([Guide("audio", 110, audio=_tone(0.5))], frames=124, width=64, height=32) == []


@pytest.mark.slow
def test_a_cropped_sound_reaches_the_dit_at_comfyuis_count(engine, monkeypatch):
    from h3_spark.h3_model.pipeline.generation import GenerationRequest, Pipeline

    seen = {}
    real = Pipeline.sample
    monkeypatch.setattr(Pipeline, "sample", lambda self, dit, request, *a, **k: seen.setdefault("request", request)
                        and real(self, dit, request, *a, **k))
    sound = _tone(6.0) * torch.linspace(0.2, 1.0, 6 * 32000)
    result = engine.generate(GenerationRequest("t2va", "a boat", width=64, height=64, frames=124, steps=2,
                                               guides=[Guide("audio", 29, audio=sound)]))
    full = engine.components.audio_vae.encode_stereo(sound).float()
    assert full.shape[-1] == 240
    kept = full[..., :158]  # ComfyUI crops the encoded latents at floor(207 - 5/3 x 29) = 158
    rows, = seen["request"].audio_condition_rows
    assert torch.equal(rows, kept.transpose(1, 2).reshape(-1, kept.shape[1]))
    assert seen["request"].layout.num_condition_audio_rows == 2 * 158
    assert result.info["notes"] == ["guide 1 (audio): 6.000 s of sound from frame 29 runs past the clip's end; "
                                    "cropped to the 158 audio latents (3.950 s) that remain"]


# ------------------------------------------------------------------ guides in Ref2VA
def test_ref2va_guides_follow_the_text_and_start_where_the_references_end():
    """ComfyUI's PackedLayout with keyframes and refs, worked by hand: guide rows right after the text, then the
    reference blocks; the references' clock starts at the text's end, the guides' time (and the target's) where
    the references' spans end, 5/3 per pixel frame on, on the target's grid."""
    from h3_spark.h3_model.dit.layout import AudioBlock, ImageBlock, VideoBlock, build_ref2va

    refs = [ImageBlock(6, 4), AudioBlock(10), VideoBlock(7, 4, 6, 36)]
    guides = (GuideBlock(36, 1), GuideBlock(72, 1), GuideBlock(120, 1), GuideBlock(5, 7, 20))
    lay = build_ref2va(torch.ones(TEXT, dtype=torch.long), refs, LATENT_FRAMES, LH, LW, AUDIO, guides=guides)
    pos, grid = lay.position_ids, 6  # the target's 4x6 latent: 2x3 patches
    # ComfyUI's cursor: the text, then each reference's span (image 1, sound its latents, video the longer of its
    # sound and its frames' spans), summed in that order in floats.
    video_span = sum(5.0 / 3.0 * n for n in (1, 4, 4, 4, 4, 1, 4))  # 22 frames: 36.67 > its 36 sound latents
    origin = float(TEXT) + 1.0 + 10.0 + video_span
    # The three stills (the multiframe template's 1.5 s, 3 s and 5 s), one latent frame each, in order.
    for i, frame in enumerate((36, 72, 120)):
        rows = slice(TEXT + i * grid, TEXT + (i + 1) * grid)
        assert torch.all(pos[rows, 0] == origin + 5.0 / 3.0 * frame), frame
    target = lay.target_video_indices
    target_grid = pos[target[:grid], 1:]
    assert torch.equal(pos[TEXT:TEXT + 3 * grid, 1:], target_grid.repeat(3, 1))
    # The clip from frame 5: 7 latent frames at (1, 4, 4, 4, 4, 1) x 5/3 after it; then its sound from frame 5, one
    # unit a latent, left channel at the target's lowest width, right at its highest.
    clip = slice(TEXT + 3 * grid, TEXT + 10 * grid)
    t5 = origin + 5.0 / 3.0 * 5
    starts = t5 + np.cumsum([0, 1, 4, 4, 4, 4, 1]) * 5 / 3
    assert torch.allclose(pos[clip, 0].reshape(7, grid)[:, 0], torch.tensor(starts), rtol=0, atol=1e-12)
    sound = slice(TEXT + 10 * grid, TEXT + 10 * grid + 40)
    assert torch.all(pos[sound, 0] == (t5 + torch.arange(20.0, dtype=torch.float64)).repeat(2))
    assert torch.all(pos[sound][:20, 2] == target_grid[:, 1].min()) and torch.all(pos[sound][20:, 2] == target_grid[:, 1].max())
    # The references after them, on their own clock from the text's end: the 6x4 image (3x2 patches, its own grid)
    # at the text's end, the sound from one slot later, the video's sound and frames from 11 slots later.
    start = TEXT + 10 * grid + 40
    image = slice(start, start + 6)
    assert torch.all(pos[image, 0] == float(TEXT))
    assert not torch.equal(pos[image, 1:], target_grid)  # 3x2 patches of its own, not the target's 2x3
    ref_sound = slice(start + 6, start + 26)
    assert torch.all(pos[ref_sound, 0] == (TEXT + 1.0 + torch.arange(10.0, dtype=torch.float64)).repeat(2))
    video_sound = slice(start + 26, start + 98)
    assert torch.all(pos[video_sound, 0] == (TEXT + 11.0 + torch.arange(36.0, dtype=torch.float64)).repeat(2))
    video = slice(start + 98, start + 98 + 7 * grid)
    assert torch.allclose(pos[video, 0].reshape(7, grid)[:, 0],
                          torch.tensor(TEXT + 11.0 + np.cumsum([0, 1, 4, 4, 4, 4, 1]) * 5 / 3), rtol=0, atol=1e-12)
    # The target after them all, at the same origin as the guides.
    assert target[0] == start + 98 + 7 * grid + 2 * AUDIO
    assert pos[target[0], 0] == origin and pos[lay.target_audio_indices[0], 0] == origin
    # Condition rows in packed order (the order of their latents and noise draws): the guides', then the references'.
    assert torch.equal(lay.video_indices[:lay.num_condition_video_rows],
                       torch.cat([torch.arange(TEXT, TEXT + 10 * grid), torch.arange(start, start + 6),
                                  torch.arange(start + 98, start + 98 + 7 * grid)]))
    assert torch.equal(lay.audio_indices[:lay.num_condition_audio_rows],
                       torch.cat([torch.arange(sound.start, sound.stop), torch.arange(start + 6, start + 98)]))
    levels, index = lay.row_timesteps(0.3, 0.6, CONDITION_VIDEO_T, CONDITION_AUDIO_T)
    rows = levels[index]
    assert torch.all(rows[TEXT:TEXT + 10 * grid] == CONDITION_VIDEO_T) and torch.all(rows[sound] == CONDITION_AUDIO_T)
    assert torch.all(lay.token_tags[TEXT:TEXT + 10 * grid] == layout.VIDEO_TAG)
    assert torch.all(lay.token_tags[sound] == layout.AUDIO_TAG)


def test_ref2va_without_guides_is_unchanged_and_a_last_frame_guide_takes_comfyuis_time():
    from h3_spark.h3_model.dit.layout import ImageBlock, VideoBlock, build_ref2va

    tags = torch.ones(TEXT, dtype=torch.long)
    refs = [ImageBlock(4, 6), VideoBlock(37, 4, 6, 200)]
    plain = build_ref2va(tags, refs, LATENT_FRAMES, LH, LW, AUDIO)
    guided = build_ref2va(tags, refs, LATENT_FRAMES, LH, LW, AUDIO, guides=(GuideBlock(FRAMES - 1, 1),))
    # The guide adds one frame of rows after the text; everything else moves down by them, at the same times.
    grid = 6
    assert torch.equal(guided.position_ids[:TEXT], plain.position_ids[:TEXT])
    assert torch.equal(guided.position_ids[TEXT + grid:], plain.position_ids[TEXT:])
    origin = plain.position_ids[plain.target_video_indices[0], 0].item()
    # Ref2VA's last frame: origin + 5/3 x 123, as ComfyUI computes it (no released pipeline's pairwise sum).
    assert guided.position_ids[TEXT, 0].item() == origin + 5.0 / 3.0 * (FRAMES - 1)


@pytest.mark.parametrize("guide, message", [
    (GuideBlock(124, 1), "guide 1: frame 124 is outside the 124-frame target"),
    (GuideBlock(110, 7), "guide 1: its 22 frames from frame 110 run past the 124-frame target"),
    (GuideBlock(120, 0, 8), "guide 1: 8 audio latents from frame 120 run past the target's 207 (7 remain)"),
])
def test_bad_ref2va_guide_blocks(guide, message):
    from h3_spark.h3_model.dit.layout import ImageBlock, build_ref2va

    with pytest.raises(InputError, match=re.escape(message)):
        build_ref2va(torch.ones(TEXT, dtype=torch.long), [ImageBlock(4, 6)], LATENT_FRAMES, LH, LW, AUDIO,
                     guides=(guide,))
