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
head names (`final_layer.video_out`, `final_layer.audio_out`) are read alike.

ComfyUI's converted files carry the same heads as patches of a normal ComfyUI LoRA: the trunk on ComfyUI's
names (fused `blocks.N.attn.qkv_proj`, `mlp.fc1`, ...: lora.py reads those as it reads any ComfyUI LoRA) and
the bank as `diffusion_model.final_layer.video_out.set_weight` [32 x 96, 5376] / `.set_bias` [32 x 96] (audio:
`final_layer.audio_out`, [32 x 32, ...]): the head's own 2-D shape with the heads stacked along the rows, row
block 0 a whole head and block j > 0 an offset from it (ComfyUI's FinalLayer runs head j as block 0 + block j).
The reader turns that back into whole fp32 heads, so both layouts give the same `HeadBank`.

`make_pdd_lora` writes a random file in either layout (tiny or full), streamed; one seed gives the same heads
and the same trunk in both.
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
from .comfy_lora import comfy_pair_groups
from .writer import Group, write_groups

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.")
# Bank tensor -> (modality, part); the released names first, then the original (ComfyUI) ones.
BANK_NAMES = {"proj_out.weight": ("video", "weight"), "proj_out.bias": ("video", "bias"),
              "audio_proj_out.weight": ("audio", "weight"), "audio_proj_out.bias": ("audio", "bias"),
              "final_layer.video_out.weight": ("video", "weight"), "final_layer.video_out.bias": ("video", "bias"),
              "final_layer.audio_out.weight": ("audio", "weight"), "final_layer.audio_out.bias": ("audio", "bias")}
_RELEASED = {v: k for k, v in list(BANK_NAMES.items())[:4]}
# ComfyUI's converted files: the bank flattened onto the head's own shape, block 0 whole, later blocks offsets.
FLAT_NAMES = {"final_layer.video_out.set_weight": ("video", "weight"),
              "final_layer.video_out.set_bias": ("video", "bias"),
              "final_layer.audio_out.set_weight": ("audio", "weight"),
              "final_layer.audio_out.set_bias": ("audio", "bias")}
_FLAT = {v: k for k, v in FLAT_NAMES.items()}
LAYOUTS = ("released", "comfy")
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
    head has (a 3-D weight, a 2-D bias), or ComfyUI's flattened `set_weight` (2-D) / `set_bias` (1-D) of a
    head. A 2-D `proj_out.weight` is an ordinary (unsupported) head change."""
    name = _strip(key)
    part = BANK_NAMES.get(name)
    if part is not None:
        return part if ndim == (3 if part[1] == "weight" else 2) else None
    part = FLAT_NAMES.get(name)
    if part is not None:
        return part if ndim == (2 if part[1] == "weight" else 1) else None
    return None


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
    flat = set()
    for key, value in tensors.items():
        part = bank_part(key, value.ndim)
        if part is not None:
            parts[part] = (key, value)
            flat.add(_strip(key) in FLAT_NAMES)
    if not parts:
        return None
    if len(flat) > 1:
        raise CheckpointError(f"{path}: the head bank mixes the released layout ({', '.join(_RELEASED.values())}) "
                              f"with ComfyUI's flattened one ({', '.join(FLAT_NAMES)}): a file holds one")
    converted = True in flat
    names = _RELEASED
    if converted:  # named as this file spells them (its prefix)
        key = next(iter(parts.values()))[0]
        names = {p: key[: len(key) - len(_strip(key))] + n for p, n in _FLAT.items()}
    missing = [names[p] for p in names if p not in parts]
    if missing:
        raise CheckpointError(f"{path}: a PDD head bank needs {', '.join(names.values())}; it lacks "
                              f"{', '.join(missing)}")
    wants = {"video": config.video_patch_dim, "audio": config.audio_in_channels}
    for modality in ("video", "audio"):
        key, weight = parts[(modality, "weight")]
        if weight.shape[-1] != config.hidden_size:
            raise CheckpointError(f"{path}: the head bank is for a DiT of width {weight.shape[-1]} ({key} "
                                  f"{list(weight.shape)}), and this DiT is {config.hidden_size} wide")
    if converted:
        parts = {p: (key, _unflatten(path, key, value, wants[p[0]], p)) for p, (key, value) in parts.items()}
    count = _count(path, parts, metadata)
    for modality in ("video", "audio"):
        expected = {"weight": [count, wants[modality], config.hidden_size], "bias": [count, wants[modality]]}
        for what in ("weight", "bias"):
            key, value = parts[(modality, what)]
            if list(value.shape) != expected[what]:
                raise CheckpointError(f"{path}: {key} {list(value.shape)} does not fit this DiT's {modality} head: "
                                      f"{expected[what]} ({count} heads of {wants[modality]} outputs)")
    if converted:
        parts = {p: (key, whole_heads(value)) for p, (key, value) in parts.items()}
    video_w, audio_w = parts[("video", "weight")][1], parts[("audio", "weight")][1]
    bank = HeadBank(video_w, parts[("video", "bias")][1], audio_w, parts[("audio", "bias")][1], origin=str(path))
    return bank if device is None else bank.to(device)


def _unflatten(path: Path, key: str, value: torch.Tensor, outputs: int, part: tuple[str, str]) -> torch.Tensor:
    """A flattened bank tensor ([count x outputs, in] or [count x outputs]) with its head axis back."""
    if value.shape[0] % outputs:
        raise CheckpointError(f"{path}: {key} {list(value.shape)} is not a whole number of this DiT's {part[0]} "
                              f"heads ({value.shape[0]} rows, {outputs} per head)")
    return value.reshape(value.shape[0] // outputs, outputs, *value.shape[1:])


def whole_heads(blocks: torch.Tensor) -> torch.Tensor:
    """ComfyUI's bank blocks ([count, ...]: block 0 a whole head, block j an offset from it) as whole heads,
    added in fp32 as ComfyUI's FinalLayer adds them."""
    blocks = blocks.float()
    return torch.cat([blocks[:1], blocks[:1] + blocks[1:]])


def offset_blocks(heads: torch.Tensor) -> torch.Tensor:
    """Whole heads ([count, ...]) as ComfyUI's bank blocks, in fp32: head 0, then each head minus head 0."""
    heads = heads.float()
    return torch.cat([heads[:1], heads[1:] - heads[:1]])


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


def _trunk_pair(layer: str, n: int, k: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One trunk pair as published (bf16, diffusers names): the up side a tenth of a unit-gain draw (a delta near
    a tenth of the weight)."""
    return (random_param(f"{layer}.lora_down", (rank, k), seed).bfloat16(),
            (0.1 * random_param(f"{layer}.lora_up", (n, rank), seed)).bfloat16())


def _bank_shapes(config: DiTConfig, heads: int) -> dict[str, tuple[int, ...]]:
    return {"proj_out.weight": (heads, config.video_patch_dim, config.hidden_size),
            "proj_out.bias": (heads, config.video_patch_dim),
            "audio_proj_out.weight": (heads, config.audio_in_channels, config.hidden_size),
            "audio_proj_out.bias": (heads, config.audio_in_channels)}


def _released_groups(config: DiTConfig, rank: int, seed: int, heads: int) -> list[Group]:
    groups = []
    for layer, (n, k) in trunk_layers(config).items():
        down, up = f"{layer}.lora_down", f"{layer}.lora_up"
        groups.append(Group([(down, "BF16", (rank, k)), (up, "BF16", (n, rank))],
                            lambda layer=layer, n=n, k=k, down=down, up=up:
                            dict(zip((down, up), _trunk_pair(layer, n, k, rank, seed)))))
    for name, shape in _bank_shapes(config, heads).items():
        groups.append(Group([(name, "BF16", shape)],
                            lambda name=name, shape=shape: {name: random_param(name, shape, seed).bfloat16()}))
    return groups


def _comfy_groups(config: DiTConfig, rank: int, seed: int, heads: int) -> list[Group]:
    """The released file's trunk and heads (same seed, same values) as ComfyUI's converted file holds them: pairs
    on ComfyUI's names with a per-layer `.alpha` (q, k and v fused into one qkv_proj pair of rank 3 x rank, its
    up side block-diagonal; fc1's up side in ComfyUI's [gate; value] row order), the bank flattened into fp32
    `set_weight` / `set_bias` (block 0 head 0, block j head j - head 0, as ComfyUI's fp32 heads hold them)."""
    groups = comfy_pair_groups(trunk_layers(config), rank,
                               lambda layer, n, k: _trunk_pair(layer, n, k, rank, seed), alpha=True)
    for released, shape in _bank_shapes(config, heads).items():
        name = "diffusion_model." + _FLAT[BANK_NAMES[released]]
        flat = (shape[0] * shape[1], *shape[2:])
        groups.append(Group([(name, "F32", flat)], lambda name=name, released=released, shape=shape, flat=flat: {
            name: offset_blocks(random_param(released, shape, seed).bfloat16()).reshape(flat)}))
    return groups


def make_pdd_lora(out: str | Path, config: DiTConfig, *, rank: int, seed: int = 0, heads: int = PDD_HEADS,
                  layout: str = "released", progress: Callable[[int, int], None] | None = None) -> int:
    """Write a random PDD LoRA for `config`: `released` as published (bf16, the trunk pairs of `trunk_layers`,
    `heads` random whole heads per modality), `comfy` the same values as ComfyUI's converted file holds them
    (`_comfy_groups`). Returns the file's size."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a PDD LoRA is one file; give a path ending in .safetensors")
    if config.curve_form:
        raise InputError("a PDD LoRA targets the full-AdaLN DiT; start from a full-AdaLN config")
    if layout not in LAYOUTS:
        raise InputError(f"a PDD LoRA is written in the {' or '.join(LAYOUTS)} layout, not {layout}")
    maker = json.dumps({"maker": "h3-spark make-checkpoint", "component": "pdd", "layout": layout, "seed": str(seed)})
    metadata = {"format": "pt", "pdd_num_steps": str(heads), "pdd_block_size": str(BLOCK_SIZE), "h3_spark": maker}
    if layout == "released":
        groups = _released_groups(config, rank, seed, heads)
        metadata.update({"lora_rank": str(rank), "lora_alpha": str(float(rank)),
                         "lora_targets": ",".join(TRUNK_TARGETS)})
    else:
        groups = _comfy_groups(config, rank, seed, heads)
    return write_groups(out, groups, metadata, progress)
