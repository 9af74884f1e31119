"""The window plan of films past one generation: counts, overlaps, trims and exact sound, checked against
values worked out by hand and against the plan's own invariants for every length up to two minutes."""

import re

import pytest

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.windows import (MAX_WINDOW_FRAMES, MIN_WINDOW_FRAMES, frame_sample, frames_for_seconds,
                                               plan_film, window_audio_samples)
from h3_spark.h3_model.geometry import audio_latent_frames


def _rows(plan):
    return [(w.frames, w.start, w.keep_from, w.keep_to, w.history) for w in plan.windows]


def test_frame_sample_is_the_rounded_start_time():
    # 24 fps, 32 kHz: frame g starts at g x 4000/3 samples.
    assert [frame_sample(g) for g in (0, 1, 2, 3, 480, 719)] == [0, 1333, 2667, 4000, 640000, 958667]
    assert frame_sample(-1) == -1333


def test_twenty_seconds_by_hand():
    # 480 frames > 345: two windows. The first holds ceil(480 / 2) = 240 -> 243 (17 x 14 + 5) frames and keeps
    # them all (243 x 5/3 = 405 latents, exact sound). The second starts on the first's last frame (242),
    # repeats it (trimmed) and needs 480 - 243 = 237 more: 238 frames -> 243, its tail of 5 trimmed.
    plan = plan_film([480])
    assert _rows(plan) == [(243, 0, 0, 243, 0), (243, 242, 1, 238, 22)]
    assert plan.audio_samples == 640000
    first, second = plan.windows
    assert first.audio_keep == (0, 324000)
    # The second window's own sound starts at film frame 242 (322,666.67 samples): it keeps film samples
    # 324,000..640,000, i.e. its own 1,333..317,333.
    assert second.audio_keep == (1333, 317333)
    assert second.describe()["overlap_trimmed"] == 1 and second.trimmed_tail == 5


@pytest.mark.parametrize("seconds,count", [(20, 2), (30, 3), (45, 4), (60, 5)])
def test_window_counts(seconds, count):
    assert len(plan_film([seconds * 24]).windows) == count


def _check_invariants(plan, total, first=0):
    kept, samples, film = 0, 0, first
    for i, w in enumerate(plan.windows):
        assert (w.frames - 5) % 17 == 0 and MIN_WINDOW_FRAMES <= w.frames <= MAX_WINDOW_FRAMES
        assert 0 <= w.keep_from < w.keep_to <= w.frames
        assert w.start + w.keep_from == film  # the kept pieces tile the film with no gap and no repeat
        a, b = w.audio_keep
        assert 0 <= a < b <= window_audio_samples(w.frames)  # every kept sample was decoded
        assert b - a == frame_sample(w.start + w.keep_to) - frame_sample(w.start + w.keep_from)
        if i and w.shot == plan.windows[i - 1].shot:
            prev = plan.windows[i - 1]
            assert w.keep_from == 1 and w.history == 22
            assert w.start == prev.start + prev.keep_to - 1  # frame 0 is the previous window's last kept frame
        film += w.kept_frames
        kept += w.kept_frames
        samples += b - a
    assert kept == total == plan.total_frames
    assert samples == frame_sample(first + total) - frame_sample(first) == plan.audio_samples


@pytest.mark.parametrize("frames", list(range(1, 2881, 7)) + [345, 346, 689, 690, 1440, 2880])
def test_every_length_tiles_exactly(frames):
    _check_invariants(plan_film([frames]), frames)


def test_sound_short_of_the_picture_takes_the_next_length():
    # 56-frame windows would decode 93 latents (74,400 samples) for 74,667 samples of picture; the plan never
    # keeps a frame whose sound was not decoded.
    assert window_audio_samples(56) < frame_sample(56)
    assert audio_latent_frames(56) == 93
    for frames in range(346, 1400, 3):
        for w in plan_film([frames]).windows:
            assert w.audio_keep[1] <= window_audio_samples(w.frames)


def test_shots_carry_nothing_over():
    plan = plan_film([240, 100, 400])
    assert [w.shot for w in plan.windows] == [0, 1, 2, 2]
    assert [w.history for w in plan.windows] == [0, 0, 0, 22]
    assert plan.windows[1].start == 240 and plan.windows[2].start == 340
    _check_invariants(plan, 740)


def test_continuing_a_clip_conditions_the_first_window():
    plan = plan_film([360], continues=125)
    first = plan.windows[0]
    assert (first.start, first.keep_from, first.history) == (124, 1, 22)  # frame 0 is the clip's last frame
    assert plan.first_frame == 125 and plan.total_frames == 360
    # On the film's grid: the continuation's sound starts at the clip's end, 125 x 4000/3 = 166,666.67 samples.
    assert plan.audio_samples == frame_sample(485) - frame_sample(125)
    _check_invariants(plan, 360, first=125)


def test_describe_names_windows_overlaps_and_trims():
    described = plan_film([720]).describe()
    assert described["frames"] == 720 and described["audio_samples"] == 960000
    assert [w["film_frames"] for w in described["windows"]] == [[0, 243], [243, 485], [485, 720]]
    assert [w["overlap_trimmed"] for w in described["windows"]] == [0, 1, 1]
    assert [w["tail_trimmed"] for w in described["windows"]] == [0, 0, 7]


def test_seconds_to_frames():
    assert frames_for_seconds(60) == 1440
    assert frames_for_seconds(20.5) == 492


@pytest.mark.parametrize("call,message", [
    (lambda: frames_for_seconds(0), "a film lasts more than 0 and at most 120 s, got 0"),
    (lambda: frames_for_seconds(121), "a film lasts more than 0 and at most 120 s, got 121"),
    (lambda: plan_film([]), "a film needs at least one shot"),
    (lambda: plan_film([100, 0]), "a shot needs at least one frame, got 0"),
    (lambda: plan_film([500], history=20), "history frames must be 17k+5 (5, 22, 39, ...), got 20"),
    (lambda: plan_film([500], history=124), "history frames must leave the shortest window frames of its own: at most 107, got 124"),
    (lambda: plan_film([500], continues=22),
     "a continued clip needs at least 23 frames (its last frame and 22 before it), got 22"),
])
def test_bad_plans(call, message):
    with pytest.raises(InputError, match=re.escape(message)):
        call()
