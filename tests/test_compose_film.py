"""A film past one generation, window by window, on the tiny synthetic engine: the frames and sound it keeps
tile the film exactly, and each window that goes on from the last gets the film's own tail as its history and
its last frame as its first-frame guide."""

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.film import ContinuedClip, Shot, render_film
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
    result = render_film(generate, base, plan, shots, history_frames=22, on_frames=chunks.append,
                         continued=continued)
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
        render_film(engine.generate, base, plan_film([400]), [Shot("x", 400)], history_frames=22,
                    on_frames=lambda f: None)
