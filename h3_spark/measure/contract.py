"""Benchmark contracts: the request a benchmark measures and the limits its result must meet."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from ..h3_model import geometry
from ..h3_model.dit.config import TEXT_TAG, VIDEO_TAG, DiTConfig
from ..h3_model.dit.layout import ImageBlock, Layout, build_ref2va, build_t2va

REQUIRED = ("name", "mode", "width", "height", "frames", "steps", "seed", "text_tokens", "sequence_length",
            "warmup", "repeats", "limits")
LIMIT_KEYS = ("equals", "max", "min", "max_ratio_to_noise_floor")


@dataclass
class Contract:
    data: dict
    path: Path

    def __getitem__(self, key):
        return self.data[key]

    def get(self, key, default=None):
        return self.data.get(key, default)


def load_contract(path: str | Path) -> Contract:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such contract file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a contract is a JSON object, got {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise InputError(f"{path}: contract lacks {', '.join(missing)}")
    if data["mode"] not in ("t2va", "ref2va", "fl2va"):
        raise InputError(f"{path}: mode must be t2va, fl2va or ref2va, got {data['mode']!r}")
    check_limit_rules(path, data["limits"])
    return Contract(data, path)


def is_number(value) -> bool:
    """A finite int or float. JSON's true/false load as bool, a subclass of int: a flag is no measurement."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_limit_rules(path, limits) -> None:
    """Every limit must be a rule we know how to check: an ignored rule (a typo, an empty object) passes anything."""
    if not isinstance(limits, dict) or not limits:
        raise InputError(f"{path}: limits must be a non-empty object of metric -> rule, got {json.dumps(limits)}")
    for metric, rule in limits.items():
        if not isinstance(rule, dict) or not rule:
            raise InputError(f"{path}: limit {metric!r} must be an object such as {{\"max\": 1.5}}, "
                             f"got {json.dumps(rule)}")
        unknown = sorted(set(rule) - set(LIMIT_KEYS))
        if unknown:
            raise InputError(f"{path}: limit {metric!r} has unknown key(s) {', '.join(unknown)}; "
                             f"use {', '.join(LIMIT_KEYS)}")
        for key, bound in rule.items():
            if not is_number(bound):
                raise InputError(f"{path}: limit {metric!r} {key} must be a number, got {json.dumps(bound)}")


def measured(result: dict, metric: str):
    """The result's value for `metric` (None when absent); a value of another type is a broken result file."""
    value = result.get(metric)
    if value is not None and not is_number(value):
        raise InputError(f"result field {metric!r} must be a number, got {json.dumps(value)}")
    return value


@dataclass
class BenchShape:
    layout: Layout
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int
    reference_latents: list[tuple[int, int]]  # (h, w) per image reference


def contract_shape(contract: Contract, config: DiTConfig, spatial: int = geometry.VAE_SPATIAL) -> BenchShape:
    """The packed layout a contract implies. Text rows: references' labels + vision blocks, then the prompt."""
    width, height, frames = contract["width"], contract["height"], contract["frames"]
    geometry.check_canvas(width, height)
    frames = geometry.align_frames(frames)
    lf = geometry.video_latent_frames(frames)
    lh, lw = height // spatial, width // spatial
    audio = geometry.audio_latent_frames(frames)
    tags: list[int] = []
    blocks, ref_latents = [], []
    label = int(contract.get("label_tokens_per_reference", 0))
    for ref in contract.get("references", []):
        if ref.get("kind") != "image":
            raise InputError(f"{contract.path}: benchmark contracts support image references, got {ref.get('kind')!r}")
        rh, rw = geometry.reference_size(ref.get("policy", "match"), ref["source_width"], ref["source_height"],
                                         width, height)
        vision = (rh // (2 * spatial)) * (rw // (2 * spatial))  # Qwen: one token per 32x32 pixels
        tags += [TEXT_TAG] * label + [VIDEO_TAG] * (vision + 2)
        blocks.append(ImageBlock(rh // spatial, rw // spatial))
        ref_latents.append((rh // spatial, rw // spatial))
    tags += [TEXT_TAG] * int(contract["text_tokens"])
    text_tags = torch.tensor(tags, dtype=torch.long)
    if contract["mode"] == "ref2va":
        lay = build_ref2va(text_tags, blocks, lf, lh, lw, audio, config.patch_size)
    else:
        lay = build_t2va(text_tags, lf, lh, lw, audio, config.patch_size,
                         keyframes=tuple(contract.get("keyframes", ())))
    return BenchShape(lay, lf, lh, lw, audio, ref_latents)


def check_limits(contract: Contract, result: dict) -> dict:
    """Each limit -> {"value", "limit", "ok"}; a metric that was not measured is reported as such."""
    check_limit_rules(contract.path, contract["limits"])  # a Contract may be built without load_contract
    verdicts = {}
    for metric, rule in contract["limits"].items():
        value = measured(result, metric)
        if value is None:
            verdicts[metric] = {"ok": None, "limit": rule, "value": None, "note": "not measured in this run"}
            continue
        ok = True
        if "equals" in rule:
            ok &= value == rule["equals"]
        if "max" in rule:
            ok &= value <= rule["max"]
        if "min" in rule:
            ok &= value >= rule["min"]
        if "max_ratio_to_noise_floor" in rule:
            floor = measured(result, "noise_floor_rel_l2")
            if floor is None:
                verdicts[metric] = {"ok": None, "limit": rule, "value": value, "note": "no noise floor measured"}
                continue
            ok &= value <= rule["max_ratio_to_noise_floor"] * max(floor, 1e-7)
        verdicts[metric] = {"ok": bool(ok), "limit": rule, "value": value}
    return verdicts
