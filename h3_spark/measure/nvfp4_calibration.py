"""Calibrating static NVFP4 activation scales, and the gate that promotes them.

Both run the DiT's sampling (text encode + every evaluation of every step, no VAE decode) on requests from a
JSON file, with the block linears on the NVFP4 reference emulation (h3_model/engine/block_linears.emulate_nvfp4), so
they run on any device and see what the FP4 GEMMs would compute.

- calibrate: per block linear, the amax of every input it quantizes over all evaluations of all requests;
  its static global scale is margin x max amax / (448 x 6) (q, k and v read one input and share one scale).
- the gate (held-out requests, none of them a calibration request): per layer the ratio of the amax observed to
  the static range (448 x 6 x scale); every evaluation also runs with dynamic scales on the same inputs and the
  velocities are compared (rel L2, the worst of video and audio). Promoted only when every static layer is at
  or under the limit and the worst drift is within `final_velocity_rel_l2` of the package's quality budget
  (measure/quality_budget.json).
  `exclude_failing` turns the layers over the limit dynamic (with their input's sharers) and measures the
  drift again with them so.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from ..errors import InputError
from ..h3_model import geometry
from ..h3_model.engine import static_scales as art_mod
from ..h3_model.engine.block_linears import emulate_nvfp4
from ..h3_model.pipeline.generation import GenerationRequest, schedule_of
from ..kernels import nvfp4_static
from . import budget as budgets

REQUEST_KEYS = {"mode", "prompt", "width", "height", "frames", "steps", "seed"}
MAX_REQUESTS = 256


# ------------------------------------------------------------------------------------------ requests
def read_requests(path: Path, what: str) -> list[GenerationRequest]:
    """The requests of a calibration or held-out file: {"requests": [{"prompt", "width", "height", "frames",
    "steps", "seed"[, "mode": "t2va"]}, ...]}, each checked as the engine checks a request (canvas, length,
    steps, prompt); one-line errors naming the file and the request."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{what} file {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{what} file {path}: not valid JSON ({exc})") from None
    items = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise InputError(f"{what} file {path}: expected an object with a \"requests\" list")
    if not items:
        raise InputError(f"{what} file {path}: zero requests; give at least one")
    if len(items) > MAX_REQUESTS:
        raise InputError(f"{what} file {path}: {len(items)} requests, at most {MAX_REQUESTS}")
    return [_request(item, f"{what} file {path}: request {i}") for i, item in enumerate(items)]


def _request(item, where: str) -> GenerationRequest:
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected an object, got {type(item).__name__}")
    unknown = sorted(set(item) - REQUEST_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown}; fields are {', '.join(sorted(REQUEST_KEYS))}")
    mode = item.get("mode", "t2va")
    if mode != "t2va":
        raise InputError(f"{where}: mode {mode!r}: calibration requests are t2va (fl2va keyframes and ref2va "
                         "references are not taken from a calibration file)")
    for key in ("width", "height", "frames", "steps", "seed"):
        value = item.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{where}: {key} must be a whole number, got {value!r}")
    if not isinstance(item.get("prompt"), str):
        raise InputError(f"{where}: prompt must be a string")
    req = GenerationRequest(mode=mode, prompt=item["prompt"], width=item.get("width"), height=item.get("height"),
                            frames=item.get("frames", geometry.DEFAULT_FRAMES), steps=item.get("steps", 50),
                            seed=item.get("seed", 0))
    try:
        req.validate()
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return req


def request_shape(req: GenerationRequest) -> dict:
    """The shape the engine keys static scales by (the canvas a t2va request gets, its frames, evaluations)."""
    height, width = (req.height, req.width) if req.width is not None else geometry.resolve_canvas(16, 9)
    return art_mod.shape_key(req.mode, width, height, geometry.snap_frames(req.frames), len(schedule_of(req)))


def _identity(req: GenerationRequest) -> tuple:
    return (req.prompt, req.seed, json.dumps(request_shape(req), sort_keys=True))


# ------------------------------------------------------------------------------------------ running
def prepare_model(engine, key: str) -> dict:
    """The engine's DiT `key` on the NVFP4 reference emulation, sampling without the VAE decode; returns where
    the NVFP4 weights came from (a file's stored codes, or the loaded weights quantized), by layer count."""
    sources = emulate_nvfp4(getattr(engine.components, key))
    engine.pipeline.decode = False
    return sources


def _run(engine, requests, log) -> int:
    evaluations = 0
    for i, req in enumerate(requests):
        start = time.perf_counter()
        result = engine.generate(req)
        evaluations += result.info["evaluations"]
        log(f"request {i + 1}/{len(requests)} ({art_mod.shape_name(request_shape(req))}): "
            f"{time.perf_counter() - start:.1f} s")
    return evaluations


def calibrate(engine, key: str, requests: list[GenerationRequest], margin: float = 1.0,
              log=lambda message: None) -> tuple[dict[str, float], dict]:
    """(global scale per layer, the header's calibration figures) from running `requests` on DiT `key`."""
    check_margin(margin)
    model = getattr(engine.components, key)
    start = time.perf_counter()
    with nvfp4_static.AmaxObserver(model) as seen:
        evaluations = _run(engine, requests, log)
    stats = seen.stats()
    unseen = [n for n, s in stats.items() if s["calls"] == 0 or s["amax_max"] <= 0]
    if unseen:
        raise InputError(f"calibration saw no (non-zero) input for {len(unseen)} layer(s), e.g. {unseen[0]}")
    scales = {}
    for name in stats:
        group = nvfp4_static.sharing_group(name)
        amax = max(stats[n]["amax_max"] for n in group)
        scales[name] = nvfp4_static.scale_for_amax(amax * margin)
    shapes = _unique([request_shape(r) for r in requests])
    figures = {"requests": len(requests), "evaluations": evaluations, "margin": margin,
               "seconds": round(time.perf_counter() - start, 3)}
    layers = {n: {"shape": [model.get_submodule(n).out_features, model.get_submodule(n).in_features], **s}
              for n, s in stats.items()}
    return scales, {"calibration": figures, "shapes": shapes, "layers": layers,
                    "identities": [list(_identity(r)) for r in requests]}


def check_margin(margin: float) -> None:
    if not margin >= 1.0 or not math.isfinite(margin):
        raise InputError(f"--margin must be a finite number >= 1.0 (a range below the calibrated amax saturates), "
                         f"got {margin}")


def check_limit(limit: float) -> None:
    if not limit > 0 or not math.isfinite(limit):
        raise InputError(f"--limit must be a finite number > 0, got {limit}")


def _unique(shapes: list[dict]) -> list[dict]:
    out = []
    for s in shapes:
        if s not in out:
            out.append(s)
    return out


def quality_budget() -> float:
    return float(budgets.quality_budget()["final_velocity_rel_l2"])


def check_held_out(art: art_mod.Artifact, requests: list[GenerationRequest], source: str) -> None:
    """Held-out requests are not calibration requests, and run on shapes the artifact covers (elsewhere the
    engine runs dynamic, so the gate would say nothing about them)."""
    seen = {tuple(i) for i in art.header.get("identities", [])}
    shapes = art.shapes()
    for i, req in enumerate(requests):
        if _identity(req) in seen:
            raise InputError(f"{source}: request {i} is one of the calibration requests (same prompt, seed and "
                             "shape); held-out requests must be new")
        if request_shape(req) not in shapes:
            raise InputError(f"{source}: request {i} ({art_mod.shape_name(request_shape(req))}) is outside the "
                             f"calibrated shapes ({', '.join(art_mod.shape_name(s) for s in shapes)})")


class _Drift:
    """On every DiT forward with static scales, the same forward with dynamic ones; the worst rel L2."""

    def __init__(self, model):
        self.model, self.values, self._inner = model, [], False

    def __enter__(self):
        self._hook = self.model.register_forward_hook(self._see, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._hook.remove()

    def _see(self, module, args, kwargs, output):
        if self._inner:
            return
        self._inner = True
        try:
            with torch.no_grad(), nvfp4_static.dynamic(module):
                ref = module(*args, **kwargs)
        finally:
            self._inner = False
        self.values.append(max(_rel_l2(o, r) for o, r in zip(output, ref)))


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pass(engine, key, art, excluded, requests, log):
    model = getattr(engine.components, key)
    nvfp4_static.install(model, art.scales, excluded)
    try:
        with nvfp4_static.AmaxObserver(model) as seen, _Drift(model) as drift:
            _run(engine, requests, log)
        saturated = nvfp4_static.take_saturation(model)
    finally:
        nvfp4_static.clear(model)
    return seen.stats(), drift.values, saturated


def gate(engine, key: str, art: art_mod.Artifact, requests: list[GenerationRequest], limit: float = 1.0,
         exclude_failing: bool = False, log=lambda message: None) -> tuple[set[str], dict]:
    """(excluded layers, the gate's record) for `art` on held-out `requests`."""
    check_limit(limit)
    budget = quality_budget()
    start = time.perf_counter()
    excluded = set(art.excluded)
    stats, drift, saturated = _pass(engine, key, art, excluded, requests, log)
    ratios = {n: s["amax_max"] / nvfp4_static.static_range(art.scales[n]) for n, s in stats.items()}
    failing = {n: r for n, r in ratios.items() if r > limit and n not in excluded}
    passes = 1
    if failing and exclude_failing:
        for name in failing:
            excluded.update(nvfp4_static.sharing_group(name))
        log(f"{len(failing)} layer(s) over the limit made dynamic ({len(excluded)} with their input's sharers); "
            "measuring the drift again")
        _, drift, saturated = _pass(engine, key, art, excluded, requests, log)
        passes = 2
    over = {n: r for n, r in failing.items() if n not in excluded}
    worst_drift = max(drift)
    why = []
    if over:
        why.append(f"{len(over)} layer(s) over the limit {limit:g} (worst {max(over.values()):.4f}: "
                   f"{max(over, key=over.get)}); --exclude-failing makes them dynamic")
    if worst_drift > budget:
        why.append(f"velocity drift {worst_drift:.4g} over the budget {budget:g}")
    static_layers = [n for n in ratios if n not in excluded]
    record = {
        "verdict": "refused" if why else "promoted",
        "why": "; ".join(why) if why else "every static layer within the limit and the drift within the budget",
        "limit": limit,
        "static_layers": len(static_layers),
        "excluded_layers": sorted(excluded),
        "failing_layers": dict(sorted(failing.items())),
        "max_ratio": max((ratios[n] for n in static_layers), default=0.0),
        "ratios": ratios,
        "velocity_drift": {"max": worst_drift, "mean": sum(drift) / len(drift), "evaluations": len(drift),
                           "budget": budget, "budget_key": "final_velocity_rel_l2",
                           "budget_file": "h3_spark/measure/quality_budget.json"},
        "saturated_blocks": sum(saturated.values()),
        "held_out": {"requests": len(requests), "shapes": _unique([request_shape(r) for r in requests])},
        "passes": passes,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return excluded, record
