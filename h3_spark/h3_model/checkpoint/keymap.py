"""DiT tensor names: diffusers <-> the original MiniMax names that ComfyUI files use.

The mapping is structural (per layer, by pattern), not substring replacement, so a name that
fits no pattern is reported instead of silently passing through. Two layers change shape:
- `attn.qkv_proj` (one fused [3 * inner, hidden] weight) <-> `attn.to_q` / `to_k` / `to_v`.
  Comfy-Org files stack it [all q; all k; all v]; the MiniMaxAI original shards interleave it per
  head ([q, k, v] of head 0, then head 1, ...). A file cannot tell which, so the caller says.
- `mlp.fc1` stores [gate; value]; diffusers' `ff.net.0.proj` stores [value; gate].
"""

from __future__ import annotations

import re

import torch

from ...errors import CheckpointError

QKV_LAYOUTS = ("stacked", "interleaved")
COMFY_PREFIX = "model.diffusion_model."

# Layers outside the blocks: original name -> diffusers name.
_TOP_LEVEL = {
    "video_patch_proj": "proj_in",
    "audio_patch_proj": "audio_proj_in",
    "condition_proj": "context_embedder",
    "time_embedder.proj_in": "time_embedder.linear_1",
    "time_embedder.proj_out": "time_embedder.linear_2",
    "final_layer.norm": "norm_out.norm",
    "final_layer.adaln_proj.linear": "norm_out.linear",
    "final_layer.video_out": "proj_out",
    "final_layer.audio_out": "audio_proj_out",
    "token_refiner.final_norm": "token_refiner.final_norm",
}
# Inside a block (DiT or refiner): original suffix -> diffusers suffix. qkv and fc1 are special.
_IN_BLOCK = {
    "norm1": "norm1",
    "norm2": "norm2",
    "attn.q_norm": "attn.norm_q",
    "attn.k_norm": "attn.norm_k",
    "attn.out_proj": "attn.to_out.0",
    "attn.qkv_proj": "attn.to_qkv",  # a virtual diffusers layer: split into to_q/to_k/to_v
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaln_proj.linear": "adaln_proj.linear",
    "attn.to_gate_compress": "attn.to_gate_compress",  # FastH3's VSA gate, same name in both namings
}
# Layers only the DiT blocks have (the refiner blocks have no AdaLN and no VSA gate).
_DIT_BLOCK_ONLY = ("adaln_proj.linear", "attn.to_gate_compress")
_DIFFUSERS_TOP = {v: k for k, v in _TOP_LEVEL.items()}
_DIFFUSERS_IN_BLOCK = {v: k for k, v in _IN_BLOCK.items()}
_DIFFUSERS_IN_BLOCK_DIT_ONLY = tuple(_IN_BLOCK[k] for k in _DIT_BLOCK_ONLY)

_ORIG_BLOCK = re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.+)$")
_DIFF_BLOCK = re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)$")

# Tensors that are not layers of the model we build.
DROPPED_ORIGINAL = ("rope.inv_freq",)
# Original-named layers the reader leaves out on purpose. None any more: the VSA gate a ComfyUI file may carry
# (`blocks.N.attn.to_gate_compress`, FastH3) is a layer of the model, built when the file has it (DiTConfig
# gate_compress, read from the names by dit_config.has_gates).
IGNORED_ORIGINAL = re.compile(r"(?!)")


def original_layer_to_diffusers(layer: str) -> str | None:
    """Original (ComfyUI) layer name -> diffusers layer name; None when it fits no pattern.

    `attn.qkv_proj` maps to the virtual `attn.to_qkv`; see `split_qkv`.
    """
    if layer in _TOP_LEVEL:
        return _TOP_LEVEL[layer]
    m = _ORIG_BLOCK.match(layer)
    if not m:
        return None
    kind, index, rest = m.groups()
    if rest not in _IN_BLOCK or (kind != "blocks" and rest in _DIT_BLOCK_ONLY):
        return None
    prefix = "transformer_blocks" if kind == "blocks" else "token_refiner.refiner_blocks"
    return f"{prefix}.{index}.{_IN_BLOCK[rest]}"


def diffusers_layer_to_original(layer: str) -> str | None:
    """Inverse of `original_layer_to_diffusers` (the virtual `attn.to_qkv` gives `attn.qkv_proj`)."""
    if layer in _DIFFUSERS_TOP:
        return _DIFFUSERS_TOP[layer]
    m = _DIFF_BLOCK.match(layer)
    if not m:
        return None
    kind, index, rest = m.groups()
    if rest not in _DIFFUSERS_IN_BLOCK or (kind != "transformer_blocks" and rest in _DIFFUSERS_IN_BLOCK_DIT_ONLY):
        return None
    prefix = "blocks" if kind == "transformer_blocks" else "token_refiner.blocks"
    return f"{prefix}.{index}.{_DIFFUSERS_IN_BLOCK[rest]}"


def diffusers_param_to_original(name: str) -> str | None:
    """A diffusers parameter name -> the original tensor name (to_q/k/v all give qkv_proj.weight)."""
    if name == "adaln_t_table":
        return name
    layer, _, param = name.rpartition(".")
    m = re.match(r"^(.*\.attn)\.to_[qkv]$", layer)
    if m:
        layer = m.group(1) + ".to_qkv"
    out = diffusers_layer_to_original(layer)
    return None if out is None else f"{out}.{param}"


def split_qkv(weight: torch.Tensor, heads: int, head_dim: int, layout: str) -> tuple[torch.Tensor, ...]:
    """[3 * heads * head_dim, K] -> (q, k, v), each [heads * head_dim, K]."""
    if layout not in QKV_LAYOUTS:
        raise CheckpointError(f"unknown qkv_layout {layout!r}; choose 'stacked' or 'interleaved'")
    inner = heads * head_dim
    if weight.shape[0] != 3 * inner:
        raise CheckpointError(f"qkv_proj has {weight.shape[0]} rows, expected 3 x {heads} x {head_dim} = {3 * inner}")
    if layout == "stacked":
        q, k, v = weight.split(inner, dim=0)
    else:
        per_head = weight.reshape(heads, 3, head_dim, *weight.shape[1:])
        q, k, v = (per_head[:, i].reshape(inner, *weight.shape[1:]) for i in range(3))
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int, layout: str) -> torch.Tensor:
    """Inverse of `split_qkv`."""
    if layout not in QKV_LAYOUTS:
        raise CheckpointError(f"unknown qkv_layout {layout!r}; choose 'stacked' or 'interleaved'")
    if layout == "stacked":
        return torch.cat([q, k, v], dim=0)
    rest = tuple(q.shape[1:])
    parts = [t.reshape(heads, 1, head_dim, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * heads * head_dim, *rest)


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """[a; b] -> [b; a] along rows: fc1 [gate; value] <-> ff.net.0.proj [value; gate] (its own inverse)."""
    if weight.shape[0] % 2:
        raise CheckpointError(f"fc1 has an odd number of rows ({weight.shape[0]})")
    a, b = weight.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)
