"""What a published file's name says that its tensors cannot: partition, family, step count, version.

The tensors tell a DiT's layout, format, AdaLN form and VSA gates (FastH3), and a LoRA's targets and ranks. They
do not tell the two DiT partitions apart (T2VA/FL2VA and Ref2VA share one architecture), FastH3 V2 from FastH3
OmniRef (both FastH3, pruned, int8_convrot), nor a Turbo LoRA from any other LoRA of the same targets. The
published names do, in whole tokens:

| file (Comfy-Org's H3 workflow templates)            | the name says                                  |
|-----------------------------------------------------|------------------------------------------------|
| minimax_h3_fl2va_pruned_int8_convrot                | the t2va/fl2va partition                       |
| minimax_h3_ref2va_pruned_int8_convrot               | the ref2va partition                           |
| fastvideo_fasth3_8step_v2_pruned_int8_convrot       | FastH3 V2, 8 steps; t2va/fl2va (see below)     |
| fasth3_omniref_8step_pruned_int8_convrot (and bf16) | FastH3 OmniRef, 8 steps; ref2va                |
| minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16       | Turbo LoRA, 8 steps, v1.0; t2va/fl2va          |
| minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16  | Turbo LoRA, 4 steps, v1.0, 768p; t2va/fl2va    |
| minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16      | Turbo LoRA, 4 steps, v0.1; ref2va              |

A FastH3 name without a partition word is the t2va/fl2va partition: FastVideo distilled FastH3 V2 for T2VA and
FL2VA, and its one Ref2VA student, OmniRef, says `omniref`. A name with words of both partitions, or of neither
(and not FastH3's), says nothing; the caller asks the user.
"""

from __future__ import annotations

import re
from pathlib import Path

# Whole tokens of a file name that name a partition ("h3_t2va_refined" is not a ref2va file).
PARTITION_WORDS = {"ref2va": {"ref2va", "ref2v", "r2v", "ref", "omniref"},
                   "t2va": {"t2va", "fl2va", "fl2v", "i2v", "t2v"}}
_SUFFIXES = (".safetensors", ".gguf")


def name_tokens(name: str | Path) -> list[str]:
    """The lower-case alphanumeric tokens of a file name, without its extension ("v1.0" is "v1", "0")."""
    stem = Path(name).name.lower()
    for suffix in _SUFFIXES:
        stem = stem.removesuffix(suffix)
    return [t for t in re.split(r"[^a-z0-9]+", stem) if t]


def partition_from_name(name: str | Path) -> str | None:
    """"ref2va" or "t2va" (which runs FL2VA too) when the name's whole tokens say one, else None."""
    tokens = set(name_tokens(name))
    kinds = {kind for kind, words in PARTITION_WORDS.items() if tokens & words}
    if len(kinds) == 1:
        return kinds.pop()
    if not kinds and "fasth3" in tokens:
        return "t2va"
    return None


def name_facts(name: str | Path) -> dict:
    """What the name says beyond the tensors: {"family", "steps", "version", "resolution", "partition"}, each
    only when the name has it (an empty dict for a name that says nothing)."""
    tokens = name_tokens(name)
    text = Path(name).name.lower()
    facts: dict = {}
    if "fasth3" in tokens:
        facts["family"] = ("FastH3 OmniRef (FastVideo's Ref2VA student)" if "omniref" in tokens
                           else "FastH3 V2 (FastVideo's T2VA/FL2VA student)" if "v2" in tokens else "FastH3")
    elif "turbo" in tokens:
        facts["family"] = "Turbo LoRA (few-step distillation)"
    steps = re.search(r"(?:^|[^a-z0-9])(\d+)[-_]?steps?(?:[^a-z0-9]|$)", text)
    if steps:
        facts["steps"] = int(steps.group(1))
    version = re.search(r"(?:^|[^a-z0-9])v(\d+(?:\.\d+)*)(?:[^a-z0-9.]|\.safetensors$|\.gguf$|$)", text)
    if version and not facts.get("family", "").startswith(f"FastH3 V{version.group(1)} "):
        facts["version"] = "v" + version.group(1)
    resolution = re.search(r"(?:^|[^a-z0-9])(\d{3,4})p(?:[^a-z0-9]|$)", text)
    if resolution:
        facts["resolution"] = f"{resolution.group(1)}p"
    partition = partition_from_name(name)
    if partition is not None:
        facts["partition"] = partition
    return facts


def describe(facts: dict) -> str:
    """One phrase for a name's facts ("FastH3 V2 (...), 8 steps, the t2va/fl2va partition")."""
    parts = [facts["family"]] if "family" in facts else []
    if "steps" in facts:
        parts.append(f"{facts['steps']} steps")
    parts += [facts[k] for k in ("version", "resolution") if k in facts]
    if "partition" in facts:
        parts.append("the ref2va partition" if facts["partition"] == "ref2va" else "the t2va/fl2va partition")
    return ", ".join(parts)
