"""A film past one generation, window by window, on the tiny synthetic engine: the frames and sound it keeps
tile the film exactly, and each window that goes on from the last gets the film's own tail as its history and
its last frame as its first-frame guide."""

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.film import ContinuedClip, Film, Shot, history_of, plan_request, render_film
from h3_spark.h3_model.compose.guides import Guide
from h3_spark.h3_model.compose.windows import frame_sample, plan_film
from h3_spark.h3_model.pipeline.generation import GenerationRequest


@pytest.fixture
def engine(tiny_t2va_engine):
    return tiny_t2va_engine


def _render(engine, plan, shots, continued=None):
    requests, chunks = [], []

    def generate(request):
        requests.append(request)
        return engine.generate(request)

    base = GenerationRequest("t2va", shots[0].prompt, width=64, height=64, steps=2, seed=7)
    result = render_film(generate, base, Film(plan, shots, {}, continued, 64, 64), on_frames=chunks.append)
    return result, requests, torch.cat(chunks)


def test_two_windows_tile_the_film_and_the_second_goes_on_from_the_first(engine):
    plan = plan_film([400])
    assert [(w.frames, w.keep_from, w.keep_to) for w in plan.windows] == [(209, 0, 208), (209, 1, 193)]
    result, requests, film = _render(engine, plan, [Shot("a boat on a lake", 400)])
    assert film.shape == (400, 64, 64, 3) and result.frames == 400
    assert result.audio.shape == (2, frame_sample(400)) == (2, 533333)
    first, second = requests
    assert first.history is None and first.guides == [] and (first.frames, first.seed) == (209, 7)
    # Window 2's frame 0 is film frame 207; its history the 22 film frames before, and the sound under them
    # (36 whole latents, 28,800 samples) ending at frame 207's first sample.
    assert (second.frames, second.seed) == (209, 8)
    assert torch.equal(second.history.pixels, film[185:207])
    assert second.guides[0].kind == "image" and second.guides[0].frame == 0
    assert torch.equal(second.guides[0].image, film[207])
    end = frame_sample(207)
    assert torch.equal(second.history.audio, result.audio[:, end - 28800:end])
    assert [w["film_frames"] for w in result.info["windows"]] == [[0, 208], [208, 400]]


def test_a_new_shot_carries_nothing_and_a_continued_clip_comes_first(engine):
    clip = torch.randint(0, 256, (30, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    plan = plan_film([40, 30], continues=30)
    result, requests, film = _render(engine, plan, [Shot("a fox", 40), Shot("a crow", 30)],
                                     ContinuedClip(clip, None))
    assert film.shape[0] == 100 and torch.equal(film[:30], clip)
    assert result.audio.shape == (2, frame_sample(100))
    assert torch.count_nonzero(result.audio[:, :frame_sample(30)]) == 0  # a silent clip stays silent
    first, second = requests
    assert torch.equal(first.history.pixels, clip[7:29]) and torch.equal(first.guides[0].image, clip[29])
    assert first.prompt == "a fox" and second.prompt == "a crow"
    assert second.history is None and second.guides == []


def test_a_film_is_made_of_t2va_windows(engine):
    base = GenerationRequest("fl2va", "x", last_frame=torch.zeros(8, 8, 3, dtype=torch.uint8))
    with pytest.raises(InputError, match="a film is made of t2va windows, got mode 'fl2va'"):
        render_film(engine.generate, base, Film(plan_film([400]), [Shot("x", 400)], {}, None, 64, 64),
                    on_frames=lambda f: None)


def _clip(frames, seed=3):
    return torch.randint(0, 256, (frames, 32, 48, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_request_takes_the_continued_clips_canvas_and_its_guides_go_to_the_windows_that_keep_them():
    clip = ContinuedClip(_clip(30))
    guides = [Guide("image", 250, image=_clip(1)[0]), Guide("image", -1, image=_clip(1, 4)[0])]
    film = plan_request([Shot("a", 400)], guides, width=None, height=None, continued=clip)
    assert (film.width, film.height) == (48, 32) and film.plan.first_frame == 30
    # Film frames past the clip: guide 1 at new frame 250 (film frame 280), guide 2 at the last (film frame 429).
    kept = {w.index: (w.start + w.keep_from, w.start + w.keep_to) for w in film.plan.windows}
    for guide, film_frame in zip(guides, (280, 429)):
        index, = [i for i, (a, b) in kept.items() if a <= film_frame < b]
        placed, = [g for g in film.guides[index] if g.image is guide.image]
        assert placed.frame == film_frame - film.plan.windows[index].start


def test_a_request_is_refused_when_it_names_another_canvas_or_a_guide_crosses_windows():
    with pytest.raises(InputError, match=r"^the clip to continue is 48x32; the request asks for 64x64: a clip is "
                                         r"continued at its own size$"):
        plan_request([Shot("a", 100)], [], width=64, height=64, continued=ContinuedClip(_clip(30)))
    plan = plan_film([400])
    boundary = plan.windows[1].start + plan.windows[1].keep_from  # the second window's first kept frame
    clip = Guide("clip", boundary - 3, clip=_clip(5), fps=24.0)
    with pytest.raises(InputError, match=r"^guide 1 \(clip\): its 5 frames from frame 205 cross a window boundary"):
        plan_request([Shot("a", 400)], [clip], width=64, height=64)


def test_the_history_is_the_frames_before_the_last_with_the_sound_that_ends_where_the_last_begins():
    tail = _clip(30)
    sound = torch.randn(2, 50_000, generator=torch.Generator().manual_seed(5))
    history, last = history_of(tail, sound, 40_000, 22)
    assert torch.equal(history.pixels, tail[7:29]) and torch.equal(last, tail[29])
    # 22 frames at 24 fps are 22 x 40 / 24 -> 36 whole audio latents of 800 samples before sample 40,000.
    assert torch.equal(history.audio, sound[:, 40_000 - 36 * 800:40_000])
    assert history_of(tail, None, 40_000, 22)[0].audio is None


@pytest.mark.parametrize("frames, end, message", [
    (22, 40_000, r"^going on from a clip takes its last frame and 22 before it; it has 22 frames$"),
    (30, 17_000, r"^the clip's sound has 50000 samples; the history needs the 28800 before sample 17000$"),
    (30, 50_001, r"^the clip's sound has 50000 samples; the history needs the 28800 before sample 50001$"),
])
def test_a_history_that_the_clip_cannot_give_is_refused(frames, end, message):
    with pytest.raises(InputError, match=message):
        history_of(_clip(frames), torch.randn(2, 50_000), end, 22)
