"""What a checkpoint is, from its tensor names alone (no tensor data is read).

Models: the DiT (diffusers or original/ComfyUI names, full or pruned "curve" AdaLN), the video
VAE, the audio VAE, the Qwen3-VL text encoder and the H3 Fun ControlNet Union (ComfyUI's or Alibaba PAI's names). The rules are the ones ComfyUI uses,
so a file is recognised here exactly when ComfyUI would recognise it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import CheckpointError

DIT_LAYOUTS = ("diffusers", "diffusers-pruned", "comfy", "comfy-pruned")
_TE_LAYER = re.compile(r"^(.*?)layers\.\d+\.self_attn\.q_norm\.weight$")


@dataclass(frozen=True)
class Detected:
    model: str  # dit | video_vae | audio_vae | text_encoder | controlnet
    layout: str  # for the DiT: one of DIT_LAYOUTS; for the others: diffusers | comfy | original | released
    prefix: str  # stripped from every key of this model ("" or e.g. "model.diffusion_model.")

    @property
    def names(self) -> str:
        """Which naming the DiT tensors use: 'diffusers' or 'original'."""
        return "diffusers" if self.layout.startswith("diffusers") else "original"

    @property
    def curve_form(self) -> bool:
        return self.layout.endswith("-pruned")


def _prefix_of(keys: list[str], suffix: str) -> str | None:
    """The shortest prefix p such that p + suffix is a key (None when no key ends that way)."""
    found = [k[: -len(suffix)] for k in keys if k.endswith(suffix) and (k == suffix or k[-len(suffix) - 1] == ".")]
    return min(found, key=len) if found else None


# The H3 Fun ControlNet Union: its hint projection and its first block's two skip projections, in every layout.
CONTROLNET_KEYS = ("control_proj_in.weight", "control_blocks.0.before_proj.weight", "control_blocks.0.after_proj.weight")


def detect(keys: list[str], where: str = "checkpoint") -> Detected:
    keyset = set(keys)
    if all(k in keyset for k in CONTROLNET_KEYS):
        # ComfyUI's converted file fuses the QKV (`attn.qkv_proj`); Alibaba PAI's keeps diffusers' names.
        comfy = "control_blocks.0.attn.qkv_proj.weight" in keyset
        return Detected("controlnet", "comfy" if comfy else "released", "")
    p = _prefix_of(keys, "video_patch_proj.weight")
    if p is not None and p + "audio_patch_proj.weight" in keyset:
        pruned = p + "adaln_t_table" in keyset
        return Detected("dit", "comfy-pruned" if pruned else "comfy", p)
    p = _prefix_of(keys, "audio_proj_in.weight")
    if p is not None and p + "proj_in.weight" in keyset and p + "context_embedder.weight" in keyset:
        pruned = p + "adaln_t_table" in keyset
        return Detected("dit", "diffusers-pruned" if pruned else "diffusers", p)
    p = _prefix_of(keys, "decoder.transformer_blocks.0.scale1")
    if p is not None and any(k.startswith(p + "encoder.") for k in keys):
        comfy = any(k.startswith(p + "encoder.down.") for k in keys)
        return Detected("video_vae", "comfy" if comfy else "diffusers", p)
    p = _prefix_of(keys, "pre_block.attn.zero_k_bias")
    if p is not None:
        return Detected("audio_vae", "original", p)
    for k in keys:
        m = _TE_LAYER.match(k)
        if m and any(key.endswith("embed_tokens.weight") for key in keys):
            return Detected("text_encoder", "qwen3vl", _te_prefix(m.group(1)))
    sample = ", ".join(sorted(keys)[:3]) or "no tensors"
    raise CheckpointError(f"{where}: not an H3 checkpoint (no DiT, video VAE, audio VAE or Qwen3-VL text "
                          f"encoder tensor names; found e.g. {sample})")


def _te_prefix(layer_path: str) -> str:
    # Keep everything before the language model's own names (model.language_model., model., ...).
    for tail in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if layer_path.endswith(tail):
            return layer_path[: -len(tail)]
    return layer_path
