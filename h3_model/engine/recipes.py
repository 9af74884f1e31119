"""Recipes: named, opt-in bundles of the speed settings other H3 engines publish. All are approximate.

`--recipe NAME[:key=value,...]` (generate), `"recipes": [...]` (service requests), the sampler node's
`recipe` input. A recipe is never chosen by `auto`; every output that used one says which, with its values.

- sparse: comfy-kitchen's Sol-Attn sparse attention with the published schedule: dense attention for the
  first `dense_steps` evaluations and in the first `dense_blocks` blocks of every evaluation, Sol-Attn
  (threshold `tau`) elsewhere (NVIDIA's Sol-Engine for H3: tau 1, 10 steps, 2 blocks).
- first-block-cache: the step cache `first_block` (step_cache.FirstBlockCache) at `threshold` (0.08 there).
- turbo: the sampling a few-step Turbo LoRA is run with: `evaluations` DiT evaluations (8) and video shift
  `video_shift` (6; LightX2V's Turbo LoRA). The LoRA file is the user's (`--lora`); the recipe does not
  look for one.
- sol-engine: sparse and first-block-cache together, as Sol-Engine publishes them.

Each fails at set-up, before any weights are read, when what it needs is missing (Sol-Attn needs CUDA and
comfy-kitchen with its kernels) or its values are out of range: one line naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...errors import H3Error, InputError

# name -> {parameter: (default, low, high)}; a bound of None is open. Integers stay integers.
PARAMETERS: dict[str, dict[str, tuple]] = {
    "sparse": {"tau": (1.0, 0.0, None), "dense_steps": (10, 0, 1000), "dense_blocks": (2, 0, 1000)},
    "first-block-cache": {"threshold": (0.08, 0.0, None), "start": (0.0, 0.0, 1.0), "end": (1.0, 0.0, 1.0)},
    "turbo": {"evaluations": (8, 1, 100), "video_shift": (6.0, 0.0, None), "audio_shift": (3.0, 0.0, None)},
}
BUNDLES = {"sol-engine": ("sparse", "first-block-cache")}
QUANTIZED_HEADS = ("fa3_fp8",)  # attention backends whose Q/K prep writes FP8 heads
NAMES = (*PARAMETERS, *BUNDLES)


@dataclass(frozen=True)
class Recipe:
    name: str
    params: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, **self.params}


def parse_recipes(texts) -> list[Recipe]:
    """`NAME` or `NAME:key=value,key=value` each; a bundle expands to its recipes. Errors name the recipe."""
    recipes: list[Recipe] = []
    for text in texts or ():
        name, _, rest = str(text).strip().partition(":")
        name = name.strip().lower()
        if name not in NAMES:
            raise InputError(f"unknown recipe {name!r}; the recipes are {', '.join(NAMES)}")
        given = _values(name, rest)
        for part in BUNDLES.get(name, (name,)):
            known = {k: v for k, v in given.items() if k in PARAMETERS[part]}
            recipes.append(Recipe(part, _checked(part, known)))
    seen = [r.name for r in recipes]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise InputError(f"recipe {twice[0]} is asked for twice")
    return recipes


def _values(name: str, text: str) -> dict:
    allowed = set().union(*(PARAMETERS[p] for p in BUNDLES.get(name, (name,))))
    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise InputError(f"recipe {name} takes {', '.join(sorted(allowed))} (as key=value), got {item!r}")
        values[key] = value.strip()
    return values


def _checked(name: str, given: dict) -> dict:
    params = {}
    for key, (default, low, high) in PARAMETERS[name].items():
        value = given.get(key, default)
        try:
            value = int(value) if isinstance(default, int) else float(value)
        except (TypeError, ValueError):
            raise InputError(f"recipe {name}: {key} must be a number, got {value!r}") from None
        if (low is not None and value < low) or (high is not None and value > high) or value != value:
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise InputError(f"recipe {name}: {key} must be {span}, got {value}")
        params[key] = value
    if name == "first-block-cache" and params["start"] > params["end"]:
        raise InputError(f"recipe first-block-cache: start {params['start']} is after end {params['end']}")
    if name == "sparse" and params["tau"] <= 0:
        raise InputError("recipe sparse: tau must be > 0")
    return params


# ------------------------------------------------------------------------------------------ set-up checks
def check_recipes(recipes: list[Recipe], device, settings, *, step_cache: bool = False,
                  explicit_steps: bool = False, cache_fix: str = "drop --cache-mode",
                  steps_fix: str = "drop --steps / --sigmas") -> None:
    """Before loading: every kernel a recipe needs can run here, and nothing it sets is also set by hand.
    `cache_fix` / `steps_fix` say, in the front door's own words, how to undo the conflicting setting."""
    check_conflicts(recipes, step_cache=step_cache, explicit_steps=explicit_steps, cache_fix=cache_fix,
                    steps_fix=steps_fix)
    for recipe in recipes:
        if recipe.name == "sparse":
            sparse_backend(recipe, device, settings)


def check_conflicts(recipes: list[Recipe], *, step_cache: bool, explicit_steps: bool, cache_fix: str,
                    steps_fix: str) -> None:
    """Nothing a recipe sets may also be set by hand (one of the two would be ignored)."""
    names = [r.name for r in recipes]
    if step_cache and "first-block-cache" in names:
        raise InputError(f"recipe first-block-cache is a step cache: {cache_fix} (one step cache per run)")
    if explicit_steps and "turbo" in names:
        raise InputError(f"recipe turbo sets the steps and the video shift: {steps_fix}")


def sparse_backend(recipe: Recipe, device, settings):
    """Sol-Attn at the recipe's tau; sequences below H3_SOL_MIN_TOKENS fall back to the run's own attention."""
    from ...kernels.attention import resolve_attention
    from ...kernels.settings import ATTENTION_BACKENDS, KernelSettings

    settings = settings or KernelSettings()
    if settings.attention in QUANTIZED_HEADS:
        # The fused Q/K prep of these backends hands every block FP8 heads; Sol-Attn takes bf16/fp16 ones.
        raise InputError(f"recipe sparse runs Sol-Attn on bf16 heads, but attention {settings.attention} "
                         f"quantizes Q/K/V to FP8 before any block sees them: run the recipe with attention fa3 "
                         f"or sdpa (FP8 linears combine with it)")
    fallback = settings.attention if settings.attention in ATTENTION_BACKENDS and settings.attention not in (
        "sol_attn", "kj_head_sliced") else "sdpa"
    sol = dataclasses.replace(settings.sol, tau=float(recipe.params["tau"]), fallback=fallback)
    try:
        return resolve_attention("sol_attn", device, settings.replace(attention="sol_attn", sol=sol))[0]
    except H3Error as exc:
        raise InputError(f"recipe sparse needs Sol-Attn: {exc}") from None


# ------------------------------------------------------------------------------------------ applying
class SparseSchedule:
    """`at(step, block)`: the model's own attention for the first steps and blocks, Sol-Attn elsewhere."""

    def __init__(self, dense, sparse, dense_steps: int, dense_blocks: int):
        self.dense, self.sparse = dense, sparse
        self.dense_steps, self.dense_blocks = dense_steps, dense_blocks

    def at(self, step: int | None, block: int):
        if step is None or step < self.dense_steps or block < self.dense_blocks:
            return self.dense
        return self.sparse


@dataclass
class RecipeSampling:
    """What the recipes set for one sampling run besides its attention: evaluations and shifts (turbo) and the
    step cache (first-block-cache); None where no recipe sets it."""

    evaluations: int | None = None
    video_shift: float | None = None
    audio_shift: float | None = None
    step_cache: object | None = None


def recipe_sampling(recipes: list[Recipe], evaluations: int) -> RecipeSampling:
    """The recipes' settings for a run of `evaluations` DiT forwards (the count turbo replaces). Needs no model:
    a front door can check it before loading one."""
    from ..pipeline.step_cache import make_step_cache

    out = RecipeSampling()
    by_name = {r.name: r for r in recipes}
    turbo = by_name.get("turbo")
    if turbo is not None:
        out.evaluations = evaluations = turbo.params["evaluations"]
        out.video_shift, out.audio_shift = turbo.params["video_shift"], turbo.params["audio_shift"]
    cache = by_name.get("first-block-cache")
    if cache is not None:
        out.step_cache = make_step_cache("first_block", cache.params["threshold"], cache.params["start"],
                                         cache.params["end"], evaluations=evaluations)
    return out


def sparse_schedule(recipes: list[Recipe], dit, device, settings) -> SparseSchedule | None:
    """The sparse recipe's attention schedule over `dit`'s own attention (set its kernels first), or None."""
    sparse = next((r for r in recipes if r.name == "sparse"), None)
    if sparse is None:
        return None
    return SparseSchedule(dit.attention, sparse_backend(sparse, device, settings), sparse.params["dense_steps"],
                          sparse.params["dense_blocks"])


def apply_recipes(recipes: list[Recipe], req, dit, device, settings):
    """`req` (a GenerationRequest) with the recipes' settings: steps and shifts, the step cache, the attention
    schedule for `dit`; and their description for the outputs."""
    run = recipe_sampling(recipes, len(req.sigmas) - 1 if req.sigmas is not None else req.steps - 1)
    changes: dict = {"recipes": [r.describe() for r in recipes],
                     "attention_schedule": sparse_schedule(recipes, dit, device, settings)}
    if run.evaluations is not None:
        changes.update(steps=run.evaluations + 1, video_shift=run.video_shift, audio_shift=run.audio_shift,
                       sigmas=None, audio_sigmas=None)
    if run.step_cache is not None:
        changes["step_cache"] = run.step_cache
    return dataclasses.replace(req, **changes)
