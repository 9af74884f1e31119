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
- fasth3: what FastVideo's FastH3 Preview (a DMD2 distillation of H3) is sampled with: 4 evaluations on the
  5-point grid t = 1000, 750, 500, 250 -> 0 at the release's shifts (video 12, audio 3), and Video Sparse
  Attention in every DiT block (`sparsity` 0.9, `tile` 64 rows) with the model's learned gates
  (`attn.to_gate_compress`). It needs a FastH3 checkpoint, except at an explicit `sparsity=0` (then the
  grid runs with the model's own dense attention).
- fasth3-8step: FastH3-8-Step-V2's: its 8 trained rungs 999, 874, ..., 125 (of 1000) shifted by video 10,
  audio 3, and VSA at `sparsity` 0.8. FastVideo publishes it as another checkpoint with its own sampling
  contract, hence its own recipe rather than a step count of fasth3.
- fasth3-v2: FastH3 V2 as ComfyUI's FastH3 templates run it: 8 evaluations of sampler res_multistep on scheduler
  simple at shifts video 10, audio 3, and VSA keeping 10 % of the video tiles (`sparsity` 0.9, `tile` 64) from
  20 % of the schedule on (`start` 0.2: an evaluation is dense while its video sigma is above shift(1 - start),
  ComfyUI's percent_to_sigma; the model's own attention before). t2va and fl2va (V2 was not distilled on ref2va).
- omniref: FastH3 OmniRef (ref2va) as its template runs it: 8 evaluations of sampler euler on scheduler simple at
  shifts 12 / 3, VSA `sparsity` 0.9 from the start (`start` 0.0). The reference rows are sink tiles: like every
  row before the target video they are tiled on their own (each single-modality run in its own tiles), every
  query attends them whatever the selection, and they attend every key (kernels/vsa_reference.py). ref2va only.
- pdd: what Alibaba PAI's PDD acceleration LoRAs are trained for: `evaluations` (8, or 4) on the plain grid at
  video shift 12, audio 3 (it lands on the bank's interval boundaries), each evaluation through the mean of the
  head-bank heads its step spans, weighted by their overlap (pipeline/pdd.py). The file is a LoRA (`--lora`,
  the LoRA loader node): its trunk merges as any LoRA, its bank goes onto the DiT; the recipe fails without one.

Each is declared once in `REGISTRY` (name, one line of help, parameters, bundle, exclusions); the front doors'
help texts come from it (`recipes_help`). Each fails at set-up, before any weights are read, when what it needs is missing (Sol-Attn needs CUDA and
comfy-kitchen with its kernels) or its values are out of range: one line naming it. What needs the loaded
model (fasth3's gates) fails when the recipe is applied, before sampling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...errors import H3Error, InputError
from ..pipeline.pdd import PDD_AUDIO_SHIFT, PDD_VIDEO_SHIFT

@dataclass(frozen=True)
class RecipeSpec:
    """One recipe, declared once: its name, one line of help, its parameters {name: (default, low, high)} (a bound
    of None is open, or checked in `_checked`; integers stay integers), the recipes it stands for when it is a
    bundle, and the recipes it cannot run with ({other: what both would set})."""

    name: str
    help: str
    parameters: dict = field(default_factory=dict)
    bundle: tuple[str, ...] = ()
    excludes: dict = field(default_factory=dict)


_FASTH3_EXCLUDES = {"turbo": "the sampling grid", "sparse": "the attention"}
_VSA_START = {"sparsity": (0.9, None, None), "start": (0.2, 0.0, 1.0), "tile": (64, None, None)}
_FASTH3_FAMILY = "the sampling grid and the attention"
REGISTRY: dict[str, RecipeSpec] = {spec.name: spec for spec in (
    RecipeSpec("sparse", "Sol-Attn sparse attention after the first dense steps and blocks (needs comfy-kitchen)",
               {"tau": (1.0, 0.0, None), "dense_steps": (10, 0, 1000), "dense_blocks": (2, 0, 1000)}),
    RecipeSpec("first-block-cache", "the first_block step cache",
               {"threshold": (0.08, 0.0, None), "start": (0.0, 0.0, 1.0), "end": (1.0, 0.0, 1.0)}),
    RecipeSpec("turbo", "the sampling of a few-step Turbo LoRA: its steps and shifts (the LoRA is yours to load)",
               {"evaluations": (8, 1, 100), "video_shift": (6.0, 0.0, None), "audio_shift": (3.0, 0.0, None)}),
    RecipeSpec("fasth3", "FastH3 Preview's 4-step grid and Video Sparse Attention (a FastH3 checkpoint)",
               {"sparsity": (0.9, None, None), "tile": (64, None, None)},
               excludes={"fasth3-8step": "the sampling grid and the attention", **_FASTH3_EXCLUDES}),
    RecipeSpec("fasth3-8step", "FastH3-8-Step-V2's 8 trained rungs and Video Sparse Attention (its checkpoint)",
               {"sparsity": (0.8, None, None), "tile": (64, None, None)}, excludes=_FASTH3_EXCLUDES),
    RecipeSpec("fasth3-v2", "FastH3 V2 as the ComfyUI templates run it: 8 steps of res_multistep on simple (shifts "
                            "10/3), VSA from the start fraction of the schedule on (a FastH3 checkpoint; t2va, fl2va)",
               _VSA_START, excludes={"fasth3": _FASTH3_FAMILY, "fasth3-8step": _FASTH3_FAMILY, **_FASTH3_EXCLUDES}),
    RecipeSpec("omniref", "FastH3 OmniRef (ref2va): 8 steps of euler on simple (shifts 12/3), VSA from the start "
                          "fraction on, the references as sink tiles (its checkpoint)",
               {**_VSA_START, "start": (0.0, 0.0, 1.0)},
               excludes={"fasth3": _FASTH3_FAMILY, "fasth3-8step": _FASTH3_FAMILY, "fasth3-v2": _FASTH3_FAMILY,
                         **_FASTH3_EXCLUDES}),
    RecipeSpec("pdd", "a PDD acceleration LoRA's trained grid (shifts 12/3) through its head bank (load the file "
                      "as a LoRA)", {"evaluations": (8, 4, 8)},
               excludes={"turbo": "the sampling grid", "fasth3": "the sampling grid",
                         "fasth3-8step": "the sampling grid", "fasth3-v2": "the sampling grid",
                         "omniref": "the sampling grid"}),
    RecipeSpec("sol-engine", "sparse and first-block-cache, as Sol-Engine publishes them",
               bundle=("sparse", "first-block-cache")),
)}
# The evaluation counts whose plain grid lands on the bank's interval boundaries (32 heads: 8 or 4 per step).
PDD_EVALUATIONS = (4, 8)
PARAMETERS = {name: spec.parameters for name, spec in REGISTRY.items() if not spec.bundle}
BUNDLES = {name: spec.bundle for name, spec in REGISTRY.items() if spec.bundle}
NAMES = tuple(REGISTRY)


def recipes_help() -> str:
    """Every registered recipe as `NAME[:key=default,...]: its help`, for a front door's help text."""
    def entry(spec: RecipeSpec) -> str:
        values = ",".join(f"{k}={default:g}" for k, (default, _, _) in spec.parameters.items())
        return f"{spec.name}{'[:' + values + ']' if values else ''}: {spec.help}"

    return "; ".join(entry(spec) for spec in REGISTRY.values())


@dataclass(frozen=True)
class FastH3Grid:
    """A FastH3 checkpoint's sampling contract. `rungs`: the trained noise levels on the 1000-step clock, before
    the shifts; None: `scheduler`'s grid of `evaluations` + 1 points (None: our h3 grid, the 4-step Preview's).
    `sampler`: the step rule (None: euler)."""

    evaluations: int
    video_shift: float
    audio_shift: float
    rungs: tuple[int, ...] | None = None
    scheduler: str | None = None
    sampler: str | None = None
    modes: tuple[str, ...] | None = None  # the modes the checkpoint was distilled for (None: any)

    def describe(self) -> dict:
        out = {"evaluations": self.evaluations, "video_shift": self.video_shift, "audio_shift": self.audio_shift}
        if self.rungs is not None:
            out["rungs"] = list(self.rungs)
        if self.sampler is not None:
            out["sampler"], out["scheduler"] = self.sampler, self.scheduler
        return out

    def video_sigmas(self) -> list[float]:
        """The video sigmas this contract samples."""
        from ..pipeline.scheduler import JointSchedule

        if self.rungs is not None:
            return self.sigmas(self.video_shift)
        return JointSchedule.from_scheduler(self.scheduler or "h3", self.evaluations + 1, self.video_shift,
                                            self.audio_shift).video.sigmas.tolist()

    def sigmas(self, shift: float) -> list[float]:
        """The rungs as sigmas: rung / 1000 shifted as the scheduler shifts its grid, then the final 0."""
        import torch

        base = torch.tensor(self.rungs, dtype=torch.float32) / 1000.0
        return (shift * base / (1 + (shift - 1) * base)).tolist() + [0.0]


# FastVideo's FastH3 Preview v0.2 (basic_fasth3.py: 5 sigma points = 4 forwards on the release's shifts) and
# FastH3-8-Step-V2 (docs/inference/fasth3-distilled.md: rungs, shifts 10 / 3).
# fasth3-v2 and omniref: Comfy-Org's FastH3 templates (V2: res_multistep on simple, 8 steps, shifts 10/3;
# OmniRef: euler on simple, 8 steps, shifts 12/3).
FASTH3_GRIDS = {"fasth3": FastH3Grid(4, 12.0, 3.0),
                "fasth3-8step": FastH3Grid(8, 10.0, 3.0, (999, 874, 749, 624, 500, 375, 250, 125)),
                "fasth3-v2": FastH3Grid(8, 10.0, 3.0, scheduler="simple", sampler="res_multistep",
                                        modes=("t2va", "fl2va")),
                "omniref": FastH3Grid(8, 12.0, 3.0, scheduler="simple", sampler="euler", modes=("ref2va",))}


@dataclass(frozen=True)
class Recipe:
    name: str
    params: dict = field(default_factory=dict)
    given: frozenset = frozenset()  # the values asked for by name (the others are defaults)

    def describe(self) -> dict:
        grid = FASTH3_GRIDS.get(self.name)
        shifts = {"video_shift": PDD_VIDEO_SHIFT, "audio_shift": PDD_AUDIO_SHIFT} if self.name == "pdd" else {}
        return {"name": self.name, **self.params, **shifts, **(grid.describe() if grid is not None else {})}


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
            recipes.append(Recipe(part, _checked(part, known), frozenset(known)))
    seen = [r.name for r in recipes]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise InputError(f"recipe {twice[0]} is asked for twice")
    _check_pairs(seen)
    return recipes


def _check_pairs(names: list[str]) -> None:
    """Recipes that set the same thing: one of the two would be ignored."""
    for a in names:
        for b, what in REGISTRY[a].excludes.items():
            if b in names:
                raise InputError(f"recipes {a} and {b} both set {what}: choose one")


def _values(name: str, text: str) -> dict:
    allowed = set().union(*(PARAMETERS[p] for p in BUNDLES.get(name, (name,))))
    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            hint = "; FastH3-8-Step-V2 is recipe fasth3-8step" if name == "fasth3" and key == "steps" else ""
            raise InputError(f"recipe {name} takes {', '.join(sorted(allowed))} (as key=value), got {item!r}{hint}")
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
        bounded = low is not None or high is not None  # unbounded values have their own checks below
        if bounded and ((low is not None and value < low) or (high is not None and value > high) or value != value):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise InputError(f"recipe {name}: {key} must be {span}, got {value}")
        params[key] = value
    if name == "first-block-cache" and params["start"] > params["end"]:
        raise InputError(f"recipe first-block-cache: start {params['start']} is after end {params['end']}")
    if name == "sparse" and params["tau"] <= 0:
        raise InputError("recipe sparse: tau must be > 0")
    if name == "pdd" and params["evaluations"] not in PDD_EVALUATIONS:
        raise InputError(f"recipe pdd: evaluations must be {' or '.join(map(str, PDD_EVALUATIONS))} (each then spans "
                         f"whole intervals of the bank), got {params['evaluations']}")
    if name in FASTH3_GRIDS:
        from ...kernels.vsa_reference import TILE_SHAPES

        if not 0.0 <= params["sparsity"] < 1.0:
            raise InputError(f"recipe {name}: sparsity must be in [0, 1), got {params['sparsity']}")
        if params["tile"] not in TILE_SHAPES:
            raise InputError(f"recipe {name}: tile must be {', '.join(map(str, TILE_SHAPES))} (rows per VSA tile, "
                             f"the sizes its kernel has; FastH3 was trained with 64), got {params['tile']}")
    return params


# ------------------------------------------------------------------------------------------ set-up checks
def check_recipes(recipes: list[Recipe], device, settings, *, step_cache: bool = False,
                  explicit_steps: bool = False, cache_fix: str = "drop --cache-mode",
                  steps_fix: str = "drop --steps / --sigmas", loras: list | None = None,
                  explicit_sampler: bool = False, explicit_scheduler: bool = False,
                  sampler_fix: str = "drop --sampler", scheduler_fix: str = "drop --scheduler") -> None:
    """Before loading: every kernel a recipe needs can run here, and nothing it sets is also set by hand.
    `cache_fix` / `steps_fix` say, in the front door's own words, how to undo the conflicting setting. Every
    recipe runs under sequence parallelism as on one GPU (the DiT has one forward; `tests/test_parallel.py`).
    `loras` (the run's LoRA paths, when the door knows them): recipe pdd and a LoRA with a head bank come
    together, read from the files' headers."""
    check_conflicts(recipes, step_cache=step_cache, explicit_steps=explicit_steps, cache_fix=cache_fix,
                    steps_fix=steps_fix, explicit_sampler=explicit_sampler, explicit_scheduler=explicit_scheduler,
                    sampler_fix=sampler_fix, scheduler_fix=scheduler_fix)
    if loras is not None:
        check_pdd_loras(recipes, loras)
    for recipe in recipes:
        if recipe.name == "sparse":
            sparse_backend(recipe, device, settings)
        elif recipe.name in FASTH3_GRIDS:
            vsa_fine(recipe, device, settings)


def check_conflicts(recipes: list[Recipe], *, step_cache: bool, explicit_steps: bool, cache_fix: str,
                    steps_fix: str, explicit_sampler: bool = False, explicit_scheduler: bool = False,
                    sampler_fix: str = "drop --sampler", scheduler_fix: str = "drop --scheduler") -> None:
    """Nothing a recipe sets may also be set by hand (one of the two would be ignored): a recipe with a grid (turbo,
    pdd, the FastH3 ones) sets the scheduler too; fasth3-v2 and omniref set the sampler."""
    names = [r.name for r in recipes]
    grid = next((n for n in names if n in ("turbo", "pdd") or n in FASTH3_GRIDS), None)
    if explicit_scheduler and grid is not None:
        raise InputError(f"recipe {grid} sets the sampling grid, the scheduler's: {scheduler_fix}")
    sampler = next((n for n in names if n in FASTH3_GRIDS and FASTH3_GRIDS[n].sampler is not None), None)
    if explicit_sampler and sampler is not None:
        raise InputError(f"recipe {sampler} samples with {FASTH3_GRIDS[sampler].sampler} on "
                         f"{FASTH3_GRIDS[sampler].scheduler}, as its checkpoint was made to: {sampler_fix}")
    if step_cache and "first-block-cache" in names:
        raise InputError(f"recipe first-block-cache is a step cache: {cache_fix} (one step cache per run)")
    if explicit_steps and "turbo" in names:
        raise InputError(f"recipe turbo sets the steps and the video shift: {steps_fix}")
    if explicit_steps and "pdd" in names:
        raise InputError(f"recipe pdd sets the steps and the shifts its head bank was trained for: {steps_fix}")
    fasth3 = next((n for n in names if n in FASTH3_GRIDS), None)
    if explicit_steps and fasth3 is not None:
        raise InputError(f"recipe {fasth3} sets the steps and the shifts the distilled model was trained with "
                         f"({FASTH3_GRIDS[fasth3].evaluations} evaluations): {steps_fix}")


def check_pdd_loras(recipes: list[Recipe], loras: list) -> None:
    """Recipe pdd needs one LoRA with a head bank, and a LoRA with a bank needs recipe pdd (its trunk with the
    plain heads samples noise), at strength 1. `loras`: LoraSpecs or (path, strength) pairs."""
    from pathlib import Path

    from ..checkpoint.lora import check_lora_path
    from ..checkpoint.pdd import check_bank_strength, has_head_bank

    pairs = [(Path(x.path), x.strength) if hasattr(x, "path") else (Path(x[0]), float(x[1])) for x in loras]
    paths = [p for p, _ in pairs]
    banked = []
    for path, strength in pairs:
        check_lora_path(path)  # a missing or pickled file says so, not "no bank"
        if has_head_bank(path):
            check_bank_strength(path, strength)
            banked.append(path)
    asked = any(r.name == "pdd" for r in recipes)
    if asked and not banked:
        named = ", ".join(p.name for p in paths) or "none"
        raise InputError(f"recipe pdd samples through a PDD LoRA's head bank (proj_out.weight [32, 96, 5376] and "
                         f"its audio twin), and no LoRA carries one (LoRAs: {named}): load the PDD file as a LoRA")
    if banked and not asked:
        raise InputError(f"{banked[0]} is a PDD LoRA (it carries a head bank): sample it with recipe pdd")


def check_recipe_mode(recipes: list[Recipe], mode: str) -> None:
    """A FastH3 recipe whose checkpoint was distilled for some modes only refuses the others."""
    for recipe in recipes:
        modes = FASTH3_GRIDS[recipe.name].modes if recipe.name in FASTH3_GRIDS else None
        if modes is not None and mode not in modes:
            raise InputError(f"recipe {recipe.name} runs a checkpoint distilled for {' and '.join(modes)}, not "
                             f"{mode}" + ("; FastH3 OmniRef is recipe omniref" if mode == "ref2va" else ""))


def pdd_heads(recipes: list[Recipe], dit):
    """Recipe pdd's head schedule for `dit` (pipeline/pdd.PddHeads over its bank), or None without the recipe;
    an InputError when the DiT carries no bank."""
    if not any(r.name == "pdd" for r in recipes):
        return None
    from ..pipeline.pdd import PddHeads

    bank = getattr(dit, "head_bank", None)
    if bank is None:
        raise InputError("recipe pdd samples through a PDD LoRA's head bank, and the loaded DiT has none: load the "
                         "PDD file as a LoRA (--lora FILE, the LoRA loader node)")
    return PddHeads(bank.count)


def sparse_backend(recipe: Recipe, device, settings):
    """Sol-Attn at the recipe's tau; sequences below H3_SOL_MIN_TOKENS fall back to the run's own attention."""
    from ...kernels.attention import QUANTIZED_HEADS, SOL_FALLBACKS, resolve_attention
    from ...kernels.settings import KernelSettings

    settings = settings or KernelSettings()
    if settings.attention in QUANTIZED_HEADS:
        # The fused Q/K prep of these backends hands every block FP8 heads; Sol-Attn takes bf16/fp16 ones.
        raise InputError(f"recipe sparse runs Sol-Attn on bf16 heads, but attention {settings.attention} "
                         f"quantizes Q/K/V to FP8 before any block sees them: run the recipe with attention fa3 "
                         f"or sdpa (FP8 linears combine with it)")
    fallback = settings.attention if settings.attention in SOL_FALLBACKS else "sdpa"
    sol = dataclasses.replace(settings.sol, tau=float(recipe.params["tau"]), fallback=fallback)
    try:
        return resolve_attention("sol_attn", device, settings.replace(attention="sol_attn", sol=sol))[0]
    except H3Error as exc:
        raise InputError(f"recipe sparse needs Sol-Attn: {exc}") from None


def vsa_fine(recipe: Recipe, device, settings) -> str:
    """Where a fasth3 recipe's fine attention runs: "triton" (the block-sparse kernel, on CUDA) or "pytorch"
    (its reference, on a CPU); an InputError where VSA cannot run at all."""
    from ...kernels.attention import QUANTIZED_HEADS
    from ...kernels.capability import KernelUnavailable, as_device, require_triton
    from ...kernels.settings import KernelSettings

    settings = settings or KernelSettings()
    name = recipe.name
    if settings.attention in QUANTIZED_HEADS:
        raise InputError(f"recipe {name} runs VSA on bf16 heads, but attention {settings.attention} quantizes Q/K/V "
                         f"to FP8 before any block sees them: run the recipe with attention fa3 or sdpa (FP8 "
                         f"linears combine with it)")
    if as_device(device).type != "cuda":
        return "pytorch"
    try:
        require_triton(f"recipe {name}'s block-sparse kernel", device)
    except KernelUnavailable as exc:
        raise InputError(str(exc)) from None
    return "triton"


# ------------------------------------------------------------------------------------------ applying
class VsaSchedule:
    """`at(step, block)`: FastH3's VSA (kernels/vsa.py) in every DiT block, over the tiles of one request's packed
    sequence; the first `dense_steps` evaluations keep `dense` (the model's own attention: recipe fasth3-v2's
    start). The sampler hands it the request (`for_layout`); the text refiner keeps the model's attention."""

    def __init__(self, sparsity: float, tile: int, fine: str, patch: tuple[int, int, int], attention=None,
                 dense_steps: int = 0, dense=None):
        self.sparsity, self.tile, self.fine, self.patch = sparsity, tile, fine, tuple(patch)
        self.attention = attention
        self.dense_steps, self.dense = dense_steps, dense

    def for_layout(self, layout, video_latents: tuple[int, int, int]) -> "VsaSchedule":
        """This schedule bound to a request: `layout` and its target video's (frames, height, width) latents."""
        from ...kernels.vsa import VsaAttention, tile_map
        from ..dit.layout import segments_before_video

        patches = tuple(n // p for n, p in zip(video_latents, self.patch))
        tiles = tile_map(segments_before_video(layout), patches, self.tile)
        return VsaSchedule(self.sparsity, self.tile, self.fine, self.patch,
                           VsaAttention(tiles, self.sparsity, self.fine), self.dense_steps, self.dense)

    def at(self, step: int | None, block: int):
        if step is not None and step < self.dense_steps:
            return self.dense
        if self.attention is None:
            raise H3Error("the fasth3 attention tiles one request's packed sequence: it runs through the sampler, "
                          "which binds it to the request (VsaSchedule.for_layout)")
        return self.attention


def fasth3_schedule(recipe: Recipe, dit, device, settings) -> VsaSchedule | None:
    """The VSA schedule of a fasth3 recipe for `dit`; None (the model's own attention) for a model without the
    gates when `sparsity=0` was asked for by name; an InputError naming the checkpoint for one otherwise."""
    name, sparsity = recipe.name, recipe.params["sparsity"]
    if not dit.config.gate_compress:
        if sparsity == 0 and "sparsity" in recipe.given:
            return None
        origin = getattr(getattr(dit, "checkpoint_origin", None), "path", None)
        raise InputError(f"recipe {name}: {origin or 'the loaded DiT'} is not a FastH3 model: no "
                         f"attn.to_gate_compress weights (the VSA gates FastH3 is distilled with); load a FastH3 "
                         f"checkpoint, or ask for {name}:sparsity=0 to sample its grid with dense attention")
    dense_steps = vsa_dense_steps(recipe)
    return VsaSchedule(sparsity, recipe.params["tile"], vsa_fine(recipe, device, settings), dit.config.patch_size,
                       dense_steps=dense_steps, dense=dit.attention if dense_steps else None)


def vsa_dense_steps(recipe: Recipe) -> int:
    """How many leading evaluations of a FastH3 recipe keep dense attention: those whose video sigma lies above
    shift(1 - start) (ComfyUI's percent_to_sigma: start 0 never, start 1 every one); 0 without a `start`."""
    start = recipe.params.get("start")
    if not start:
        return 0
    from ..pipeline.scheduler import shift_sigma

    grid = FASTH3_GRIDS[recipe.name]
    threshold = 0.0 if start >= 1.0 else shift_sigma(1.0 - start, grid.video_shift)
    return sum(1 for sigma in grid.video_sigmas()[:-1] if sigma > threshold)


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
    """What the recipes set for one sampling run besides its attention and heads: evaluations and shifts (turbo,
    pdd, fasth3) and the step cache (first-block-cache); None where no recipe sets it."""

    evaluations: int | None = None
    video_shift: float | None = None
    audio_shift: float | None = None
    step_cache: object | None = None
    # An explicit grid (fasth3-8step's rungs), video and audio, each ending at 0; the shifts are then in it.
    sigmas: list[float] | None = None
    audio_sigmas: list[float] | None = None
    grid_from: str | None = None  # the recipe that set the evaluations and shifts
    # The scheduler and the sampler a recipe samples with (fasth3-v2, omniref); None: the run's own.
    scheduler: str | None = None
    sampler: str | None = None


def recipe_sampling(recipes: list[Recipe], evaluations: int) -> RecipeSampling:
    """The recipes' settings for a run of `evaluations` DiT forwards (the count turbo replaces). Needs no model:
    a front door can check it before loading one."""
    from ..pipeline.step_cache import make_step_cache

    out = RecipeSampling()
    by_name = {r.name: r for r in recipes}
    turbo = by_name.get("turbo")
    if turbo is not None:
        out.evaluations = evaluations = turbo.params["evaluations"]
        out.grid_from = turbo.name
        out.video_shift, out.audio_shift = turbo.params["video_shift"], turbo.params["audio_shift"]
    pdd = by_name.get("pdd")
    if pdd is not None:
        out.evaluations = evaluations = pdd.params["evaluations"]
        out.grid_from = pdd.name
        out.video_shift, out.audio_shift = PDD_VIDEO_SHIFT, PDD_AUDIO_SHIFT
    fasth3 = next((r for r in recipes if r.name in FASTH3_GRIDS), None)
    if fasth3 is not None:
        grid = FASTH3_GRIDS[fasth3.name]
        out.evaluations = evaluations = grid.evaluations
        out.grid_from = fasth3.name
        out.video_shift, out.audio_shift = grid.video_shift, grid.audio_shift
        if grid.rungs is not None:
            out.sigmas, out.audio_sigmas = grid.sigmas(grid.video_shift), grid.sigmas(grid.audio_shift)
        out.scheduler, out.sampler = grid.scheduler, grid.sampler
    cache = by_name.get("first-block-cache")
    if cache is not None:
        out.step_cache = make_step_cache("first_block", cache.params["threshold"], cache.params["start"],
                                         cache.params["end"], evaluations=evaluations)
    return out


def sparse_schedule(recipes: list[Recipe], dit, device, settings) -> "SparseSchedule | VsaSchedule | None":
    """The recipes' attention schedule for `dit` (set its kernels first): the sparse recipe's over the model's own
    attention, fasth3's VSA, or None."""
    fasth3 = next((r for r in recipes if r.name in FASTH3_GRIDS), None)
    if fasth3 is not None:
        return fasth3_schedule(fasth3, dit, device, settings)
    sparse = next((r for r in recipes if r.name == "sparse"), None)
    if sparse is None:
        return None
    return SparseSchedule(dit.attention, sparse_backend(sparse, device, settings), sparse.params["dense_steps"],
                          sparse.params["dense_blocks"])


def apply_recipes(recipes: list[Recipe], req, dit, device, settings):
    """`req` (a GenerationRequest) with the recipes' settings: steps and shifts, the step cache, the attention
    schedule for `dit`; and their description for the outputs."""
    check_recipe_mode(recipes, req.mode)
    run = recipe_sampling(recipes, len(req.sigmas) - 1 if req.sigmas is not None else req.steps - 1)
    changes: dict = {"recipes": [r.describe() for r in recipes],
                     "attention_schedule": sparse_schedule(recipes, dit, device, settings),
                     "head_schedule": pdd_heads(recipes, dit)}
    if run.evaluations is not None:
        # The recipe's grid is all of it: its scheduler (None: our h3 grid, or its rungs as explicit sigmas).
        changes.update(steps=run.evaluations + 1, video_shift=run.video_shift, audio_shift=run.audio_shift,
                       sigmas=run.sigmas, audio_sigmas=run.audio_sigmas, scheduler=run.scheduler)
    if run.sampler is not None:
        changes["sampler"] = run.sampler
    if run.step_cache is not None:
        changes["step_cache"] = run.step_cache
    return dataclasses.replace(req, **changes)
