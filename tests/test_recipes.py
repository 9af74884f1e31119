"""Recipes (h3_model/engine/recipes.py) and what they switch on: parsing and its errors, the set-up checks, the
sparse recipe's attention schedule per evaluation and block, and the first-block cache's reuse rule.

Error budget: whatever a recipe leaves on the exact path is bit-identical to the run without it (a schedule
that always answers the model's own attention, a first-block cache at threshold 0); a reused step equals the
documented estimate exactly (the first block, then the other blocks' residual from the last computed step).
"""

import copy

import pytest
import torch
from torch import nn

from h3_spark.errors import InputError
from h3_spark.h3_model import geometry
from h3_spark.h3_model.checkpoint.synthetic import random_state
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.layout import build_t2va
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.h3_model.engine.recipes import SparseSchedule, apply_recipes, check_recipes, parse_recipes
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from h3_spark.h3_model.pipeline.step_cache import make_step_cache
from h3_spark.kernels.attention import sdpa
from h3_spark.kernels.settings import KernelSettings
from oracle import forward_args, text_tags

STEPS = 7  # 6 evaluations
LF, NA = geometry.video_latent_frames(124), geometry.audio_latent_frames(124)
LH, LW = geometry.latent_size(64, 64)


@pytest.fixture(scope="module")
def dit():
    model = H3DiT(TINY, device="meta")
    model.load_state(random_state(TINY, 4), device="cpu")
    return model.eval()


def _sample(model, **kwargs):
    tags = torch.ones(7, dtype=torch.long)
    prompt = torch.randn(1, 7, TINY.text_dim, generator=torch.Generator().manual_seed(2))
    req = SamplingRequest(build_t2va(tags, LF, LH, LW, NA, TINY.patch_size), prompt, LF, LH, LW, NA)
    return sample(model, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(9), **kwargs)


@pytest.fixture(scope="module")
def plain(dit):
    return _sample(dit)


# ------------------------------------------------------------------------------------------ parsing
def test_names_defaults_values_and_bundles():
    assert [r.describe() for r in parse_recipes(["sparse"])] == [
        {"name": "sparse", "tau": 1.0, "dense_steps": 10, "dense_blocks": 2}]
    turbo, = parse_recipes(["Turbo:evaluations=4,video_shift=5.5"])
    assert turbo.params == {"evaluations": 4, "video_shift": 5.5, "audio_shift": 3.0}
    bundle = parse_recipes(["sol-engine:tau=0.9,threshold=0.05"])
    assert [r.name for r in bundle] == ["sparse", "first-block-cache"]
    assert bundle[0].params["tau"] == 0.9 and bundle[1].params["threshold"] == 0.05
    assert parse_recipes([]) == [] and parse_recipes(None) == []


@pytest.mark.parametrize("texts, message", [
    (["warp-speed"], r"unknown recipe 'warp-speed'; the recipes are sparse, first-block-cache, turbo, fasth3, "
                     r"fasth3-8step, fasth3-v2, omniref, pdd, sol-engine"),
    (["sparse:taux=1"], r"recipe sparse takes dense_blocks, dense_steps, tau \(as key=value\), got 'taux=1'"),
    (["sparse:tau"], r"recipe sparse takes .* got 'tau'"),
    (["sparse:tau=fast"], r"recipe sparse: tau must be a number, got 'fast'"),
    (["sparse:tau=0"], r"recipe sparse: tau must be > 0"),
    (["sparse:dense_steps=-1"], r"recipe sparse: dense_steps must be 0..1000, got -1"),
    (["first-block-cache:start=0.9,end=0.1"], r"start 0.9 is after end 0.1"),
    (["turbo:evaluations=0"], r"recipe turbo: evaluations must be 1..100, got 0"),
    (["turbo:video_shift=nan"], r"recipe turbo: video_shift must be >= 0.0, got nan"),
    (["sol-engine", "sparse"], r"recipe sparse is asked for twice"),
])
def test_bad_recipes_are_refused_in_one_line(texts, message):
    with pytest.raises(InputError, match=message):
        parse_recipes(texts)


def test_set_up_checks_name_what_is_missing_or_doubled():
    with pytest.raises(InputError, match=r"^recipe sparse needs Sol-Attn: sol_attn .*CUDA"):
        check_recipes(parse_recipes(["sparse"]), "cpu", KernelSettings())
    # fa3_fp8's Q/K prep hands the blocks FP8 heads (seen on the H200 mid-render): refused at set-up instead.
    with pytest.raises(InputError, match=r"^recipe sparse runs Sol-Attn on bf16 heads, but attention fa3_fp8 "
                                         r"quantizes Q/K/V to FP8 .*attention fa3 or sdpa"):
        check_recipes(parse_recipes(["sol-engine"]), "cuda", KernelSettings().replace(attention="fa3_fp8"))
    with pytest.raises(InputError, match="recipe first-block-cache is a step cache: drop --cache-mode"):
        check_recipes(parse_recipes(["first-block-cache"]), "cpu", KernelSettings(), step_cache=True)
    with pytest.raises(InputError, match="recipe turbo sets the steps and the video shift"):
        check_recipes(parse_recipes(["turbo"]), "cpu", KernelSettings(), explicit_steps=True)
    check_recipes(parse_recipes(["turbo", "first-block-cache"]), "cpu", KernelSettings())


def test_turbo_and_first_block_cache_set_the_request(dit):
    req = GenerationRequest(mode="t2va", prompt="a fox", steps=30)
    out = apply_recipes(parse_recipes(["turbo", "first-block-cache"]), req, dit, "cpu", KernelSettings())
    assert (out.steps, out.video_shift, out.audio_shift) == (9, 6.0, 3.0)
    assert out.step_cache.mode == "first_block" and out.step_cache.evaluations == 8
    assert out.step_cache.options.threshold == 0.08
    assert out.recipes == [{"name": "turbo", "evaluations": 8, "video_shift": 6.0, "audio_shift": 3.0},
                           {"name": "first-block-cache", "threshold": 0.08, "start": 0.0, "end": 1.0}]
    assert req.steps == 30 and req.step_cache is None  # the caller's request is left as it was


# ------------------------------------------------------------------------------------------ attention schedule
class Recorder:
    """A schedule answering the model's own attention everywhere, recording what it was asked."""

    def __init__(self, attention):
        self.attention, self.asked = attention, []

    def at(self, step, block):
        self.asked.append((step, block))
        return self.attention


def test_the_schedule_is_asked_for_every_evaluation_and_block_and_changes_nothing_by_itself(dit, plain):
    recorder = Recorder(dit.attention)
    got = _sample(dit, attention_schedule=recorder)
    evaluations = STEPS - 1
    assert recorder.asked == [(s, b) for s in range(evaluations) for b in range(TINY.num_layers)]
    assert torch.equal(got.video_latents, plain.video_latents) and torch.equal(got.audio_latents, plain.audio_latents)
    assert dit.attention_schedule is None and dit.sampling_step is None  # for this run only


class Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, q, k, v):
        self.calls += 1
        return self.fn(q, k, v)


def test_sparse_runs_past_the_dense_steps_and_blocks_only(dit):
    sparse = Counted(sdpa)
    schedule = SparseSchedule(dit.attention, sparse, dense_steps=2, dense_blocks=1)
    _sample(dit, attention_schedule=schedule)
    assert sparse.calls == (STEPS - 1 - 2) * (TINY.num_layers - 1)
    assert schedule.at(None, 5) is dit.attention  # outside sampling: dense


# ------------------------------------------------------------------------------------------ first-block cache
def test_first_block_cache_at_threshold_zero_is_the_uncached_run(dit, plain):
    cache = make_step_cache("first_block", 0.0, 0.0, 1.0, evaluations=STEPS - 1)
    got = _sample(dit, step_cache=cache)
    assert cache.computed == list(range(STEPS - 1)) and cache.reused == []
    assert torch.equal(got.video_latents, plain.video_latents) and torch.equal(got.audio_latents, plain.audio_latents)


def test_first_block_cache_reuses_within_its_window(dit, plain):
    cache = make_step_cache("first_block", 1e9, 0.3, 0.8, evaluations=STEPS - 1)
    got = _sample(dit, step_cache=cache)
    assert cache.reused == [2, 3, 4] and cache.computed == [0, 1, 5]
    report = cache.report()
    assert report["mode"] == "first_block" and report["approximate"] is True
    assert set(report["relative_changes"]) == {"2", "3", "4"}
    assert torch.isfinite(got.video_latents).all() and not torch.equal(got.video_latents, plain.video_latents)


def test_a_reused_step_is_the_first_block_plus_the_stored_residual(dit):
    """Exact: the reused forward equals a one-block model whose block output gets the stored residual added."""
    lay = build_t2va(text_tags(9, (1, 5)), 7, 4, 6, 10, TINY.patch_size)
    first, second = forward_args(TINY, lay, seed=1), forward_args(TINY, lay, seed=2)
    cache = make_step_cache("first_block", 1e9, 0.0, 1.0, evaluations=2)
    with torch.no_grad():
        cache.velocities(0, None, None, lambda **kw: dit(**first, **kw))
        got = cache.velocities(1, None, None, lambda **kw: dit(**second, **kw))
        assert cache.computed == [0] and cache.reused == [1]
        one_block = copy.deepcopy(dit)
        one_block.transformer_blocks = nn.ModuleList([one_block.transformer_blocks[0]])
        one_block.transformer_blocks[0].register_forward_hook(lambda m, a, out: out + cache._rest)
        want = one_block(**second)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_turbo_gives_the_published_768p_sigma_grid(dit):
    """ModelTC/Minimax-H3-Turbo's 768p 4-step files: video sigmas 1, .9474, .8571, .6667 (shift 6), audio
    1, .9, .75, .5 (shift 3), then 0; four evaluations."""
    from h3_spark.h3_model.pipeline.generation import schedule_of

    req = apply_recipes(parse_recipes(["turbo:evaluations=4"]), GenerationRequest(mode="t2va", prompt="a fox"),
                        dit, "cpu", KernelSettings())
    schedule = schedule_of(req)
    assert len(schedule) == 4
    assert torch.allclose(schedule.video.sigmas, torch.tensor([1, 0.947368, 0.857143, 0.666667, 0]), atol=1e-5)
    assert torch.allclose(schedule.audio.sigmas, torch.tensor([1, 0.9, 0.75, 0.5, 0]), atol=1e-6)


# ----------------------------------------------------------------------------- the registry and the help texts
def test_every_registered_recipe_is_in_generate_help_with_its_defaults(capsys, monkeypatch):
    from h3_spark.cli import main
    from h3_spark.h3_model.engine import recipes

    monkeypatch.setenv("COLUMNS", "4000")  # argparse wraps at hyphens too: one line keeps each name whole
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert set(recipes.NAMES) == {"sparse", "first-block-cache", "turbo", "fasth3", "fasth3-8step", "fasth3-v2",
                                  "omniref", "pdd", "sol-engine"}
    for name, spec in recipes.REGISTRY.items():
        assert f"{name}{'[:' if spec.parameters else ':'}" in text and spec.help in text, name
    assert "fasth3[:sparsity=0.9,tile=64]: FastH3 Preview's" in text
    assert "fasth3-v2[:sparsity=0.9,start=0.2,tile=64]: FastH3 V2" in text
    assert "omniref[:sparsity=0.9,start=0,tile=64]: FastH3 OmniRef" in text
    assert "sol-engine: sparse and first-block-cache" in text
    assert "pdd[:evaluations=8]: a PDD acceleration LoRA's trained grid" in text


def test_the_sampler_node_lists_the_registered_recipes():
    from h3_spark.h3_model.engine import recipes
    from h3_spark.nodes.definitions import NODE_CLASS_MAPPINGS

    tooltip = NODE_CLASS_MAPPINGS["H3SparkSampler"].INPUT_TYPES()["optional"]["recipe"][1]["tooltip"]
    assert recipes.recipes_help() in tooltip and "fasth3-8step[:sparsity=0.8,tile=64]" in tooltip


def test_registry_exclusions_name_what_both_recipes_set():
    from h3_spark.h3_model.engine.recipes import parse_recipes

    with pytest.raises(InputError, match="recipes fasth3-8step and turbo both set the sampling grid: choose one"):
        parse_recipes(["fasth3-8step", "turbo"])
    with pytest.raises(InputError, match="recipes fasth3 and fasth3-8step both set the sampling grid and the attention"):
        parse_recipes(["fasth3-8step", "fasth3"])
    with pytest.raises(InputError, match="recipes fasth3 and sparse both set the attention"):
        parse_recipes(["sol-engine", "fasth3"])
