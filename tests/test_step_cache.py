"""Step caches (h3_model/step_cache.py): exactness when off, the window, both reuse rules, the report.

Error budget: `off`, and any cache that computes every step, must be bit-identical to running the
sampler without a cache (torch.equal). Reused steps are approximate by design; their estimates are
checked exactly against the formula each mode documents.
"""

import pytest
import torch

from h3_spark.h3_model import geometry
from h3_spark.h3_model.checkpoint.synthetic import random_state
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.errors import InputError
from h3_spark.h3_model.dit.layout import build_t2va
from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from h3_spark.h3_model.pipeline.step_cache import MODES, CacheOptions, make_step_cache

H, W, FRAMES, STEPS = 64, 64, 124, 11  # 10 evaluations
LF, NA = geometry.video_latent_frames(FRAMES), geometry.audio_latent_frames(FRAMES)
LH, LW = geometry.latent_size(H, W)


class Counting:
    """The DiT with its forwards counted (everything else passes through)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module")
def dit():
    model = H3DiT(TINY, device="meta")
    model.load_state(random_state(TINY, 3), device="cpu")
    return model.eval()


@pytest.fixture(scope="module")
def plain(dit):
    return _run(dit, None)[0]


def _run(model, cache):
    tags = torch.ones(7, dtype=torch.long)
    prompt = torch.randn(1, 7, TINY.text_dim, generator=torch.Generator().manual_seed(1))
    req = SamplingRequest(build_t2va(tags, LF, LH, LW, NA, TINY.patch_size), prompt, LF, LH, LW, NA)
    counting = Counting(model)
    res = sample(counting, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(5), step_cache=cache)
    return res, counting.calls


def test_off_is_bit_identical_and_reports_every_step(dit, plain):
    cache = make_step_cache("off", evaluations=STEPS - 1)
    cached, calls = _run(dit, cache)
    assert torch.equal(plain.video_latents, cached.video_latents)
    assert torch.equal(plain.audio_latents, cached.audio_latents)
    assert calls == STEPS - 1
    rep = cache.report()
    assert rep["mode"] == "off" and rep["computed"] == list(range(STEPS - 1)) and rep["reused"] == []
    assert rep["approximate"] is False


@pytest.mark.parametrize("mode", ["easycache", "h3_cache"])
def test_threshold_zero_computes_every_step(dit, plain, mode):
    cache = make_step_cache(mode, 0.0, 0.0, 1.0, evaluations=STEPS - 1)
    cached, calls = _run(dit, cache)
    assert cache.computed == list(range(STEPS - 1)) and cache.reused == [] and calls == STEPS - 1
    # Computing every step means the cache never touched a velocity: exactly the uncached run.
    assert torch.equal(plain.video_latents, cached.video_latents)
    assert torch.equal(plain.audio_latents, cached.audio_latents)


@pytest.mark.parametrize("mode", ["easycache", "h3_cache"])
def test_huge_threshold_reuses_every_allowed_step_in_the_window(dit, plain, mode):
    cache = make_step_cache(mode, 1e9, 0.2, 0.8, 2, evaluations=STEPS - 1)
    cached, calls = _run(dit, cache)
    window = [i for i in range(STEPS - 1) if 0.2 <= i / (STEPS - 1) < 0.8]
    assert window == [2, 3, 4, 5, 6, 7]
    assert cache.reused == window
    assert cache.computed == [0, 1, 8, 9] and calls == 4
    rep = cache.report()
    assert rep["mode"] == mode and rep["approximate"] is True and rep["subsample_factor"] == 2
    assert rep["computed"] == [0, 1, 8, 9] and rep["reused"] == window
    assert set(rep["relative_changes"]) == {str(i) for i in range(1, STEPS - 1)}
    assert not torch.equal(plain.video_latents, cached.video_latents)
    assert torch.isfinite(cached.video_latents).all() and torch.isfinite(cached.audio_latents).all()


def test_the_first_evaluation_is_always_computed(dit):
    cache = make_step_cache("h3_cache", 1e9, 0.0, 1.0, evaluations=STEPS - 1)
    _run(dit, cache)
    assert cache.computed == [0] and cache.reused == list(range(1, STEPS - 1))


# ------------------------------------------------------------------ a crafted input sequence
CHANGES = [None, 0.02, 0.02, 0.02, 0.02, 0.5, 0.02, 0.02, 0.02]


def _sequence(seed=0):
    """(video rows, audio rows) per step whose relative change from the previous step is CHANGES[i]."""
    gen = torch.Generator().manual_seed(seed)
    v, a = torch.randn(16, 4, generator=gen, dtype=torch.float64), torch.randn(6, 8, generator=gen, dtype=torch.float64)
    out = [(v, a)]
    for r in CHANGES[1:]:
        dv, da = torch.randn(v.shape, generator=gen, dtype=torch.float64), torch.randn(a.shape, generator=gen,
                                                                                      dtype=torch.float64)
        v = v + r * v.norm() * dv / dv.norm()
        a = a + r * a.norm() * da / da.norm()
        out.append((v, a))
    return [(x.float(), y.float()) for x, y in out]


def _drive(cache, sequence):
    """Feed the sequence; forward i returns a velocity unique to step i."""
    results = []
    for i, (v, a) in enumerate(sequence):
        def forward(i=i, v=v, a=a):
            return (torch.full((1, *v.shape), float(i)), torch.full((1, *a.shape), -float(i)))

        results.append(cache.velocities(i, v, a, forward))
    return results


def test_easycache_accumulates_and_h3_cache_looks_at_the_current_step():
    seq = _sequence()
    easy = make_step_cache("easycache", 0.05, 0.0, 1.0, evaluations=len(seq))
    h3 = make_step_cache("h3_cache", 0.05, 0.0, 1.0, evaluations=len(seq))
    easy_out, h3_out = _drive(easy, seq), _drive(h3, seq)
    for i, r in enumerate(CHANGES[1:], start=1):
        assert easy.changes[i] == pytest.approx(r, rel=1e-4) and h3.changes[i] == pytest.approx(r, rel=1e-4)
    # Per step: every 0.02 step is under 0.05, only the 0.5 jump is computed.
    assert h3.computed == [0, 5] and h3.reused == [1, 2, 3, 4, 6, 7, 8]
    # Cumulative: 0.02, 0.04 pass; 0.06 forces a forward (and a reset); the jump too; then 0.02, 0.04, 0.06.
    assert easy.computed == [0, 3, 5, 8] and easy.reused == [1, 2, 4, 6, 7]

    # h3_cache hands back the last computed velocity itself.
    assert torch.equal(h3_out[4][0], torch.full((1, 16, 4), 0.0))
    assert torch.equal(h3_out[7][1], torch.full((1, 6, 8), -5.0))
    # easycache adds the stored change (v - x at the computed step) to the current input.
    (v3, a3), (v4, a4) = seq[3], seq[4]
    assert torch.equal(easy_out[4][0][0], v4 + (torch.full_like(v3, 3.0) - v3))
    assert torch.equal(easy_out[4][1][0], a4 + (torch.full_like(a3, -3.0) - a3))


def test_subsample_measures_on_strided_rows():
    gen = torch.Generator().manual_seed(2)
    v0, a0 = torch.randn(8, 4, generator=gen), torch.randn(4, 8, generator=gen)
    v1, a1 = v0.clone(), a0.clone()
    v1[1::2] += 5.0  # only odd rows move
    a1[1::2] += 5.0
    seq = [(v0, a0), (v1, a1)]
    every = make_step_cache("h3_cache", 1e-6, 0.0, 1.0, 1, evaluations=2)
    strided = make_step_cache("h3_cache", 1e-6, 0.0, 1.0, 2, evaluations=2)
    _drive(every, seq)
    _drive(strided, seq)
    assert every.computed == [0, 1] and every.changes[1] > 1
    assert strided.computed == [0] and strided.reused == [1] and strided.changes[1] == 0.0


def test_empty_window_reuses_nothing():
    seq = _sequence()
    cache = make_step_cache("h3_cache", 1e9, 0.5, 0.5, evaluations=len(seq))
    _drive(cache, seq)
    assert cache.reused == [] and cache.computed == list(range(len(seq)))


def test_the_cache_refuses_a_loop_it_was_not_sized_for():
    seq = _sequence()
    cache = make_step_cache("easycache", 0.1, evaluations=2)
    _drive(cache, seq[:2])
    with pytest.raises(InputError, match="fresh cache"):
        cache.velocities(2, *seq[2], lambda: None)
    out_of_order = make_step_cache("h3_cache", 0.1, evaluations=5)
    with pytest.raises(InputError, match="expected 0"):
        out_of_order.velocities(1, *seq[1], lambda: None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="teacache"), "cache mode"),
    (dict(mode="easycache", threshold=-0.1), "threshold"),
    (dict(mode="easycache", threshold=float("nan")), "threshold"),
    (dict(mode="easycache", threshold=float("inf")), "threshold"),
    (dict(mode="h3_cache", start=0.9, end=0.1), "after end"),
    (dict(mode="h3_cache", start=-0.1), "start percent"),
    (dict(mode="h3_cache", end=1.5), "end percent"),
    (dict(mode="h3_cache", subsample=0), "subsample"),
    (dict(mode="h3_cache", subsample=1.5), "subsample"),
])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(InputError, match=match):
        make_step_cache(evaluations=4, **kwargs)


def test_factory_defaults_and_sizes():
    assert set(MODES) == {"off", "easycache", "h3_cache", "first_block"}
    cache = make_step_cache("easycache", evaluations=9)
    assert cache.options == CacheOptions("easycache", 0.1, 0.2, 0.9, 1)
    with pytest.raises(InputError, match="number of DiT evaluations"):
        make_step_cache("h3_cache", evaluations=0)
