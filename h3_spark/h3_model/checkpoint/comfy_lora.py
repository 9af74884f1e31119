"""LoRA pairs on ComfyUI's names, as its converted LoRA files hold them (the PDD and Turbo writers share this).

ComfyUI's H3 DiT fuses q, k and v into one `qkv_proj`, so a converted file holds one pair there of rank 3 x rank:
the three down sides stacked, the up sides block-diagonal; fc1's up side is in ComfyUI's [gate; value] row order.
"""

from __future__ import annotations

from typing import Callable

import torch

from .keymap import diffusers_layer_to_original, swap_halves
from .writer import Group


def comfy_pair_groups(layers: dict[str, tuple[int, int]], rank: int,
                      pair: Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor]],
                      alpha: bool = False) -> list[Group]:
    """One writer group per ComfyUI pair for `layers` ({diffusers layer: (out, in)}); `pair(layer, n, k)` draws one
    layer's (down, up). With `alpha`, each pair carries `.alpha` = its rank (the released scale, alpha / rank = 1)."""
    groups = []
    for layer, (_, k) in layers.items():
        if layer.endswith((".attn.to_k", ".attn.to_v")):
            continue  # fused into the to_q entry's qkv_proj
        fused = layer.endswith(".attn.to_q")
        members = [layer[: -len("to_q")] + t for t in ("to_q", "to_k", "to_v")] if fused else [layer]
        name = "diffusion_model." + diffusers_layer_to_original(layer[: -len(".to_q")] + ".to_qkv" if fused else layer)
        pair_rank, rows = rank * len(members), sum(layers[m][0] for m in members)

        def make(name=name, members=members, k=k, fc1=layer.endswith("ff.net.0.proj"), pair_rank=pair_rank):
            downs, ups = zip(*(pair(m, layers[m][0], k) for m in members))
            up = torch.block_diag(*ups)
            out = {f"{name}.lora_A.weight": torch.cat(downs), f"{name}.lora_B.weight": swap_halves(up) if fc1 else up}
            if alpha:
                out[f"{name}.alpha"] = torch.tensor(float(pair_rank))
            return out

        specs = [(f"{name}.lora_A.weight", "BF16", (pair_rank, k)), (f"{name}.lora_B.weight", "BF16", (rows, pair_rank))]
        groups.append(Group(specs + ([(f"{name}.alpha", "F32", ())] if alpha else []), make))
    return groups
