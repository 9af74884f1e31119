"""PDD acceleration LoRA files: a trunk LoRA plus a bank of per-interval output heads, as published.

Alibaba PAI's MiniMax-H3 Acc files (FL2VA and Ref2VA, 8 evaluations) hold, in one safetensors file:
- a rank-64 LoRA on diffusers names, `lora_down` / `lora_up` without a `.weight` suffix
  (`transformer_blocks.N.attn.to_q.lora_down`, ...: to_q, to_k, to_v, to_out.0, ff.net.0.proj, ff.net.2 and
  adaln_proj.linear of every block; the first six of each `token_refiner.refiner_blocks.N`), merged by lora.py
  like any LoRA (alpha from the header's `lora_alpha`);
- the head bank under the heads' own names with a leading head axis: `proj_out.weight` [32, 96, 5376],
  `proj_out.bias` [32, 96], `audio_proj_out.weight` [32, 32, 5376], `audio_proj_out.bias` [32, 32]; head j
  is a whole head (not an offset), trained for interval j of the fine grid (pipeline/pdd.py);
- header metadata `pdd_num_steps` (32, the heads), `pdd_block_size` (4, heads per evaluation), `lora_rank`,
  `lora_alpha`, `lora_targets`.
The bank is told by its names and a 3-D weight; prefixes (`diffusion_model.`, `transformer.`) and the original
head names (`final_layer.video_out`, `final_layer.audio_out`) are read alike. `make_pdd_lora` writes a random
one with the published names and shapes (tiny or full), streamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ...errors import CheckpointError, InputError
from ..dit.config import ADALN_VECTORS, NUM_MODALITIES, DiTConfig
from ..dit.head_bank import HeadBank
from .synthetic import random_param
from .writer import Group, write_groups

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
# Bank tensor -> (modality, part); the released names first, then the original (ComfyUI) ones.
BANK_NAMES = {"proj_out.weight": ("video", "weight"), "proj_out.bias": ("video", "bias"),
              "audio_proj_out.weight": ("audio", "weight"), "audio_proj_out.bias": ("audio", "bias"),
              "final_layer.video_out.weight": ("video", "weight"), "final_layer.video_out.bias": ("video", "bias"),
              "final_layer.audio_out.weight": ("audio", "weight"), "final_layer.audio_out.bias": ("audio", "bias")}
_RELEASED = {v: k for k, v in list(BANK_NAMES.items())[:4]}
# What a published trunk LoRA targets in each DiT block (the refiner's blocks have no adaln_proj).
TRUNK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2",
                 "adaln_proj.linear")
PDD_RANK = {"full": 64, "tiny": 4}
# Heads per modality in the published banks, one per interval of the fine grid.
PDD_HEADS = 32
BLOCK_SIZE = 4


def _strip(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def bank_part(key: str, ndim: int) -> tuple[str, str] | None:
    """(modality, "weight"|"bias") when `key` is a head-bank tensor: a head's name with one more axis than the
    head has (a 3-D weight, a 2-D bias). A 2-D `proj_out.weight` is an ordinary (unsupported) head change."""
    part = BANK_NAMES.get(_strip(key))
    if part is None or ndim != (3 if part[1] == "weight" else 2):
        return None
    return part


def has_head_bank(path: Path) -> bool:
    """Whether a LoRA file carries a head bank, from its header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return any(bank_part(k, len(f.get_slice(k).get_shape())) is not None for k in f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def check_bank_strength(path: Path, strength: float) -> None:
    """A head bank is a whole set of heads trained with its trunk: the trunk merges at the strength it was trained."""
    if strength != 1.0:
        raise InputError(f"{path}: a PDD LoRA (it carries a head bank) runs at strength 1, got {strength:g}")


def read_head_bank(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config: DiTConfig,
                   device=None) -> HeadBank | None:
    """The file's head bank checked against the DiT it will run on, or None when it has none. Every misfit is
    one CheckpointError naming the tensor, its shape and what this DiT needs."""
    parts: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        part = bank_part(key, value.ndim)
        if part is not None:
            parts[part] = (key, value)
    if not parts:
        return None
    missing = [_RELEASED[p] for p in _RELEASED if p not in parts]
    if missing:
        raise CheckpointError(f"{path}: a PDD head bank needs {', '.join(_RELEASED.values())}; it lacks "
                              f"{', '.join(missing)}")
    count = _count(path, parts, metadata)
    wants = {"video": config.video_patch_dim, "audio": config.audio_in_channels}
    for modality in ("video", "audio"):
        key, weight = parts[(modality, "weight")]
        if weight.shape[2] != config.hidden_size:
            raise CheckpointError(f"{path}: the head bank is for a DiT of width {weight.shape[2]} ({key} "
                                  f"{list(weight.shape)}), and this DiT is {config.hidden_size} wide")
        expected = {"weight": [count, wants[modality], config.hidden_size], "bias": [count, wants[modality]]}
        for what in ("weight", "bias"):
            key, value = parts[(modality, what)]
            if list(value.shape) != expected[what]:
                raise CheckpointError(f"{path}: {key} {list(value.shape)} does not fit this DiT's {modality} head: "
                                      f"{expected[what]} ({count} heads of {wants[modality]} outputs)")
    video_w, audio_w = parts[("video", "weight")][1], parts[("audio", "weight")][1]
    bank = HeadBank(video_w, parts[("video", "bias")][1], audio_w, parts[("audio", "bias")][1], origin=str(path))
    return bank if device is None else bank.to(device)


def _count(path: Path, parts: dict, metadata: dict[str, str]) -> int:
    """The bank's head count: the same along all four tensors, and the file's `pdd_num_steps` (else 32)."""
    counts = {parts[p][0]: int(parts[p][1].shape[0]) for p in _RELEASED}  # in the published order
    if len(set(counts.values())) != 1:
        raise CheckpointError(f"{path}: the head bank's tensors disagree on the head count: "
                              + ", ".join(f"{k} {n}" for k, n in counts.items()))
    count = next(iter(counts.values()))
    declared = metadata.get("pdd_num_steps")
    try:
        want = PDD_HEADS if declared is None else int(declared)
    except ValueError:
        raise CheckpointError(f"{path}: metadata pdd_num_steps={declared!r} is not a whole number") from None
    if count != want:
        source = f"its metadata pdd_num_steps says {want}" if declared is not None else \
            f"PDD banks hold {want} (one per interval of the trained grid)"
        raise CheckpointError(f"{path}: the head bank holds {count} heads, but {source}")
    return count


# ------------------------------------------------------------------------------------------ synthetic files
def trunk_layers(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """Every layer a published PDD trunk LoRA targets, diffusers names -> (out, in)."""
    c = config
    sizes = {"attn.to_q": (c.inner_dim, c.hidden_size), "attn.to_k": (c.inner_dim, c.hidden_size),
             "attn.to_v": (c.inner_dim, c.hidden_size), "attn.to_out.0": (c.hidden_size, c.inner_dim),
             "ff.net.0.proj": (2 * c.ffn_dim, c.hidden_size), "ff.net.2": (c.hidden_size, c.ffn_dim),
             "adaln_proj.linear": (ADALN_VECTORS * NUM_MODALITIES * c.hidden_size, c.time_embed_dim)}
    layers = {f"transformer_blocks.{i}.{t}": sizes[t] for i in range(c.num_layers) for t in TRUNK_TARGETS}
    layers.update({f"token_refiner.refiner_blocks.{i}.{t}": sizes[t] for i in range(c.num_refiner_layers)
                   for t in TRUNK_TARGETS[:-1]})
    return layers


def make_pdd_lora(out: str | Path, config: DiTConfig, *, rank: int, seed: int = 0, heads: int = PDD_HEADS,
                  progress: Callable[[int, int], None] | None = None) -> int:
    """Write a random PDD LoRA for `config` (bf16, as published): the trunk pairs of `trunk_layers`, up sides a
    tenth of a unit-gain draw (a delta near a tenth of the weight), and `heads` random whole heads per modality.
    Returns the file's size."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a PDD LoRA is one file; give a path ending in .safetensors")
    if config.curve_form:
        raise InputError("a PDD LoRA targets the full-AdaLN DiT; start from a full-AdaLN config")
    groups = []
    for layer, (n, k) in trunk_layers(config).items():
        down, up = f"{layer}.lora_down", f"{layer}.lora_up"

        def make(down=down, up=up, n=n, k=k):
            return {down: random_param(down, (rank, k), seed).bfloat16(),
                    up: (0.1 * random_param(up, (n, rank), seed)).bfloat16()}

        groups.append(Group([(down, "BF16", (rank, k)), (up, "BF16", (n, rank))], make))
    bank = {"proj_out.weight": (heads, config.video_patch_dim, config.hidden_size),
            "proj_out.bias": (heads, config.video_patch_dim),
            "audio_proj_out.weight": (heads, config.audio_in_channels, config.hidden_size),
            "audio_proj_out.bias": (heads, config.audio_in_channels)}
    for name, shape in bank.items():
        groups.append(Group([(name, "BF16", shape)],
                            lambda name=name, shape=shape: {name: random_param(name, shape, seed).bfloat16()}))
    metadata = {"format": "pt", "pdd_num_steps": str(heads), "pdd_block_size": str(BLOCK_SIZE),
                "lora_rank": str(rank), "lora_alpha": str(float(rank)), "lora_targets": ",".join(TRUNK_TARGETS),
                "h3_spark": json.dumps({"maker": "h3-spark make-checkpoint", "component": "pdd", "seed": str(seed)})}
    return write_groups(out, groups, metadata, progress)
