"""Turbo LoRA files: the few-step distillation LoRAs ComfyUI's H3 workflow templates switch on.

The templates offer `minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16`, `minimax_h3_fl2v_turbo_4step_v1.0_768p_
comfyui_bf16` (T2VA / FL2VA) and `minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16` (Ref2VA) on top of the pruned
int8_convrot DiTs. They are LightX2V's Turbo LoRAs converted to ComfyUI's names:
- LightX2V's own file (`released` here): a PEFT dump on diffusers names, `transformer_blocks.N.attn.to_q.lora_A.
  default.weight` / `lora_B`, q, k and v apart, the attention and feed-forward linears (to_q, to_k, to_v,
  to_out.0, ff.net.0.proj, ff.net.2) of every DiT block and of both token-refiner blocks, no AdaLN adapter,
  alpha in the header;
- the ComfyUI file (`comfy`): the same pairs under `diffusion_model.` on the original names, q, k and v fused
  into one `attn.qkv_proj` pair of three times the rank (lora_A the three downs stacked, lora_B block-diagonal),
  fc1's up side in ComfyUI's [gate; value] row order, bf16, the scale 1 (no `.alpha`: alpha equals the rank).
LightX2V's layout is read from its loaders; the ComfyUI file's is inferred from its size and ComfyUI's LoRA key
map for H3 (`diffusion_model.` + the model's own names, pairs by ComfyUI's generic adapters): rank 128 on those
six linears of 52 blocks, qkv fused that way, is 978,059,264 bf16 values, 1.82 GiB, the listed size of the
Ref2VA file (the listing's sizes are GiB: its 19.53 for the pruned int8 DiT is that file's 20,970,379,616 bytes;
beside those pairs, an AdaLN adapter of any rank, full or in a pruned DiT's curve basis, would
overshoot the published size's last digit: rank 1 on 50 blocks is 9.7 MB). The two FL2V files' ranks are not
known from a size; they are written at the same rank. No AdaLN adapter means nothing in them depends on the
AdaLN's form: they merge onto a pruned (curve-form) DiT as onto a full one.
(A LoRA that does adapt a pruned DiT's AdaLN, as ComfyUI conversions of PDD LoRAs do, reads the curve table's
k-wide coordinates: lora_A [r, k], plus a `diff_b` for the bias; lora.py merges that form too.)

`make_turbo_lora` writes a random file in either layout (tiny or full), streamed; one seed gives the same pairs
in both, so the two merge to the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from ..dit.config import DiTConfig
from .comfy_lora import comfy_pair_groups
from .synthetic import random_param
from .writer import Group, write_groups

LAYOUTS = ("released", "comfy")
# What a Turbo LoRA targets in each DiT and token-refiner block.
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
TURBO_RANK = {"full": 128, "tiny": 4}


def turbo_layers(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """Every layer a Turbo LoRA targets, diffusers names -> (out, in)."""
    c = config
    sizes = {"attn.to_q": (c.inner_dim, c.hidden_size), "attn.to_k": (c.inner_dim, c.hidden_size),
             "attn.to_v": (c.inner_dim, c.hidden_size), "attn.to_out.0": (c.hidden_size, c.inner_dim),
             "ff.net.0.proj": (2 * c.ffn_dim, c.hidden_size), "ff.net.2": (c.hidden_size, c.ffn_dim)}
    blocks = [f"transformer_blocks.{i}" for i in range(c.num_layers)]
    blocks += [f"token_refiner.refiner_blocks.{i}" for i in range(c.num_refiner_layers)]
    return {f"{block}.{t}": sizes[t] for block in blocks for t in TARGETS}


def turbo_pair(layer: str, n: int, k: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair (down [rank, k], up [n, rank]) on diffusers names, bf16: the up side a tenth of a unit-gain draw,
    so the merged delta is near a tenth of the weight."""
    return (random_param(f"{layer}.lora_A", (rank, k), seed).bfloat16(),
            (0.1 * random_param(f"{layer}.lora_B", (n, rank), seed)).bfloat16())


def _released_groups(config: DiTConfig, rank: int, seed: int) -> list[Group]:
    groups = []
    for layer, (n, k) in turbo_layers(config).items():
        down, up = f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight"
        groups.append(Group([(down, "BF16", (rank, k)), (up, "BF16", (n, rank))],
                            lambda layer=layer, n=n, k=k, down=down, up=up:
                            dict(zip((down, up), turbo_pair(layer, n, k, rank, seed)))))
    return groups


def _comfy_groups(config: DiTConfig, rank: int, seed: int) -> list[Group]:
    return comfy_pair_groups(turbo_layers(config), rank, lambda layer, n, k: turbo_pair(layer, n, k, rank, seed))


def make_turbo_lora(out: str | Path, config: DiTConfig, *, rank: int, seed: int = 0, layout: str = "comfy",
                    progress: Callable[[int, int], None] | None = None) -> int:
    """Write a random Turbo LoRA for `config`'s block sizes (full or pruned AdaLN alike: it has no AdaLN
    adapter): `comfy` as the ComfyUI templates download it, `released` as LightX2V publishes it (alpha = rank in
    the header). Returns the file's size."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a Turbo LoRA is one file; give a path ending in .safetensors")
    if layout not in LAYOUTS:
        raise InputError(f"a Turbo LoRA is written in the {' or '.join(LAYOUTS)} layout, not {layout}")
    maker = json.dumps({"maker": "h3-spark make-checkpoint", "component": "turbo", "layout": layout,
                        "seed": str(seed)})
    metadata = {"format": "pt", "h3_spark": maker}
    if layout == "released":
        metadata["alpha"] = str(float(rank))
        groups = _released_groups(config, rank, seed)
    else:
        groups = _comfy_groups(config, rank, seed)
    return write_groups(out, groups, metadata, progress)
