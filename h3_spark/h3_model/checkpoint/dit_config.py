"""DiT config from a checkpoint: diffusers config.json, or tensor shapes (+ a metadata override).

ComfyUI files carry no config.json. ComfyUI reads the sizes from tensor shapes and lets a
safetensors metadata entry `config` (JSON, `{"transformer": {...}}`, ComfyUI's constructor
argument names) override them; we do the same, so a file ComfyUI reads one way reads the same here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...errors import CheckpointError
from ..dit.config import DiTConfig

# ComfyUI's MiniMaxH3Model argument names -> DiTConfig (diffusers) field names.
COMFY_TO_DIFFUSERS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_layers",
    "token_refiner_num_layers": "num_refiner_layers",
    "num_attention_heads": "num_attention_heads",
    "attention_head_dim": "attention_head_dim",
    "ffn_hidden_size": "ffn_dim",
    "latents_dim": "in_channels",
    "audio_latents_dim": "audio_in_channels",
    "patch_size": "patch_size",
    "text_dim": "text_dim",
    "timestep_input_dim": "freq_dim",
    "time_embed_hidden_size": "time_embed_hidden_dim",
    "time_embed_dim": "time_embed_dim",
    "rope_inv_freq_len": "rope_freq_dim",
    "norm_eps": "norm_eps",
    "qk_norm_eps": "qk_norm_eps",
    "final_norm_eps": "final_norm_eps",
    "adaln_curve_grid": "adaln_curve_grid",
    "gate_compress": "gate_compress",
}
DIFFUSERS_TO_COMFY = {v: k for k, v in COMFY_TO_DIFFUSERS.items()}
# ComfyUI arguments that do not change the tensors we load (sampling shifts).
COMFY_IGNORED = {"sigma_shift_video", "sigma_shift_audio", "image_model", "rope_theta"}
# A DiT block's VSA gate (FastH3) under either naming, with or without a file's model prefix.
GATE_WEIGHT = re.compile(r"(?:^|\.)(?:transformer_blocks|blocks)\.\d+\.attn\.to_gate_compress\.weight$")

ShapeFn = Callable[[str], "tuple[int, ...] | None"]


def _count(keys, pattern: str) -> int:
    rx = re.compile(pattern)
    found = {int(m.group(1)) for k in keys if (m := rx.match(k))}
    if found and found != set(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - found)
        raise CheckpointError(f"block indices are not contiguous: missing {missing[:5]}")
    return len(found)


def _need(shape: ShapeFn, name: str) -> tuple[int, ...]:
    s = shape(name)
    if s is None:
        raise CheckpointError(f"cannot size the DiT: tensor {name} is missing")
    return s


@dataclass(frozen=True)
class _Names:
    """Where each size lives in one checkpoint naming: ComfyUI's original names or diffusers'."""

    patch: str
    head_norm: str
    blocks: str
    refiner_blocks: str
    heads_weight: str  # its rows are heads x head_dim x heads_factor
    heads_factor: int
    ffn_up: str
    audio_in: str
    text_in: str
    time_in: str
    time_out: str


COMFY_NAMES = _Names("video_patch_proj.weight", "blocks.0.attn.q_norm.weight", r"^blocks\.(\d+)\.",
                     r"^token_refiner\.blocks\.(\d+)\.", "blocks.0.attn.qkv_proj.weight", 3,
                     "blocks.0.mlp.fc1.weight", "audio_patch_proj.weight", "condition_proj.weight",
                     "time_embedder.proj_in.weight", "time_embedder.proj_out.weight")
DIFFUSERS_NAMES = _Names("proj_in.weight", "transformer_blocks.0.attn.norm_q.weight",
                         r"^transformer_blocks\.(\d+)\.", r"^token_refiner\.refiner_blocks\.(\d+)\.",
                         "transformer_blocks.0.attn.to_q.weight", 1, "transformer_blocks.0.ff.net.0.proj.weight",
                         "audio_proj_in.weight", "context_embedder.weight", "time_embedder.linear_1.weight",
                         "time_embedder.linear_2.weight")


def has_gates(keys) -> bool:
    """Whether tensor names include a DiT block's VSA gate (`attn.to_gate_compress.weight`): a FastH3 model."""
    return any(GATE_WEIGHT.search(k) for k in keys)


def gates_in_folder(folder: Path) -> bool:
    """Whether the weights of a diffusers folder hold VSA gates, from its index or the files' headers only."""
    from ..json_file import read_json
    from .safetensors_header import read_header

    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        return any(has_gates(read_json(index).get("weight_map", {})) for index in indexes)
    return any(has_gates(read_header(path).tensors) for path in sorted(folder.glob("*.safetensors")))


def config_from_json(path: str | Path) -> DiTConfig:
    """A diffusers `config.json`. diffusers' transformer has no `gate_compress` argument, so FastVideo's FastH3
    exports leave it out: without the field, the weights beside the file say whether the gates are there."""
    from ..json_file import read_json

    data = read_json(path)
    if "gate_compress" not in data:
        data = {**data, "gate_compress": gates_in_folder(Path(path).parent)}
    return DiTConfig.from_dict(data)


def _fields_from_shapes(keys: list[str], shape: ShapeFn, n: _Names) -> dict:
    """DiTConfig fields read from tensor shapes under naming `n` (everything but the RoPE size)."""
    hidden, patch_dim = _need(shape, n.patch)
    head_dim = _need(shape, n.head_norm)[0]
    fields: dict = {
        "hidden_size": hidden,
        "num_layers": _count(keys, n.blocks),
        "num_refiner_layers": _count(keys, n.refiner_blocks),
        "attention_head_dim": head_dim,
        "num_attention_heads": _need(shape, n.heads_weight)[0] // (n.heads_factor * head_dim),
        "ffn_dim": _need(shape, n.ffn_up)[0] // 2,
        "in_channels": patch_dim // 4,
        "patch_size": (1, 2, 2),
        "audio_in_channels": _need(shape, n.audio_in)[1],
        "text_dim": _need(shape, n.text_in)[1],
        "gate_compress": has_gates(keys),
    }
    table = shape("adaln_t_table")
    if table is not None:
        if len(table) != 2 or table[0] < 2:
            raise CheckpointError(f"adaln_t_table must be [grid >= 2, k], got {list(table)}")
        fields["adaln_curve_grid"], fields["time_embed_dim"] = table
        # The time MLP is gone; its sizes do not matter to the curve form. ComfyUI assumes the same.
        fields["time_embed_hidden_dim"] = hidden
    else:
        fields["time_embed_hidden_dim"], fields["freq_dim"] = _need(shape, n.time_in)
        fields["time_embed_dim"] = _need(shape, n.time_out)[0]
    return fields


def config_from_comfy(keys: list[str], shape: ShapeFn, metadata: dict[str, str],
                      inv_freq: Callable[[], torch.Tensor] | None, declared: Path | None = None) -> DiTConfig:
    """Sizes from original-named tensors (prefix already stripped), checked against the config.json beside them
    (`declared`: MiniMaxAI's transformer/config.json) and completed by it, then the metadata override."""
    fields = _fields_from_shapes(keys, shape, COMFY_NAMES)
    rope = shape("rope.inv_freq")
    if rope is not None:
        fields["rope_freq_dim"] = rope[0]
    if declared is not None:
        fields = _with_declared(declared, fields, keys, shape)
    override = comfy_metadata_config(metadata)
    fields.update(override)
    head_dim = fields["attention_head_dim"]
    if "rope_freq_dim" not in fields:
        if head_dim != 128:
            raise CheckpointError("cannot tell rope_freq_dim: no rope.inv_freq tensor and no `config` metadata, "
                                  f"and head_dim {head_dim} is not the released 128")
        fields["rope_freq_dim"] = 16
    config = _build(fields)
    if rope is not None and inv_freq is not None:
        config = _check_rope(config, inv_freq(), "rope_theta" in override)
    return config


# The sizes an original-named DiT's tensors show, and the tensor (or block names) each is read from.
SHAPE_EVIDENCE = {
    "hidden_size": "video_patch_proj.weight", "num_layers": "blocks.N", "num_refiner_layers": "token_refiner.blocks.N",
    "attention_head_dim": "blocks.0.attn.q_norm.weight", "num_attention_heads": "blocks.0.attn.qkv_proj.weight",
    "ffn_dim": "blocks.0.mlp.fc1.weight", "audio_in_channels": "audio_patch_proj.weight",
    "text_dim": "condition_proj.weight", "freq_dim": "time_embedder.proj_in.weight",
    "time_embed_hidden_dim": "time_embedder.proj_in.weight", "time_embed_dim": "time_embedder.proj_out.weight",
    "rope_freq_dim": "rope.inv_freq", "gate_compress": "blocks.0.attn.to_gate_compress.weight",
    "adaln_curve_grid": "adaln_t_table",
}
# Output widths MiniMaxAI's config.json records for its AdaLN projections, and the tensor whose rows they are.
ADALN_WIDTHS = {"adaln_out_features": "blocks.0.adaln_proj.linear.weight",
                "final_adaln_out_features": "final_layer.adaln_proj.linear.weight"}


def _with_declared(path: Path, fields: dict, keys: list[str], shape: ShapeFn) -> dict:
    """`fields` (read from shapes) completed by a config.json beside the weights, which must agree with them: a
    size the tensors show and the file states otherwise is refused, naming the file and the field. What shapes
    cannot show (epsilons, rope_theta, the patch when the channels are given) comes from the file; fields this
    engine does not know (`_class_name`, ...) are left alone."""
    from ..json_file import read_json

    data = read_json(path)
    curve = shape("adaln_t_table") is not None
    out = dict(fields)
    for key, value in data.items():
        field = COMFY_TO_DIFFUSERS.get(key, key if key in DiTConfig.__dataclass_fields__ else None)
        if key in ADALN_WIDTHS:
            rows = shape(ADALN_WIDTHS[key])
            if rows is not None and value != rows[0]:
                raise CheckpointError(f"{path}: {key} is {value!r} but the weights say {rows[0]} "
                                      f"({ADALN_WIDTHS[key]} is {list(rows)})")
        elif field in ("in_channels", "patch_size") or field is None:
            continue
        elif field in SHAPE_EVIDENCE and field in fields and not (curve and field.startswith(("freq", "time"))):
            if value != fields[field]:
                raise CheckpointError(f"{path}: {key} is {value!r} but the weights say {fields[field]} "
                                      f"({_evidence(field, keys, shape)})")
        else:
            out[field] = value
    out.update(_declared_patch(path, data, shape))
    return out


def _evidence(field: str, keys: list[str], shape: ShapeFn) -> str:
    name = SHAPE_EVIDENCE[field]
    if name.endswith(".N"):
        prefix = name[:-1]
        count = len({k[len(prefix):].split(".", 1)[0] for k in keys if k.startswith(prefix)})
        return f"{prefix}0 to {prefix}{count - 1}" if count else f"no {prefix}N"
    found = shape(name)
    return f"{name} is {list(found)}" if found is not None else f"no {name}"


def _declared_patch(path: Path, data: dict, shape: ShapeFn) -> dict:
    """in_channels and patch_size from a config.json's latents_dim / patch_size: the patch projection's inputs are
    their product, which is all the tensors show."""
    inputs = shape(COMFY_NAMES.patch)[1]
    latents = data.get("latents_dim", data.get("in_channels"))
    patch = data.get("patch_size")
    if patch is not None and (not isinstance(patch, list) or len(patch) != 3
                              or not all(isinstance(p, int) and p > 0 for p in patch)):
        raise CheckpointError(f"{path}: patch_size must be three positive integers, got {patch!r}")
    size = math.prod(patch) if patch is not None else 4
    if latents is None:
        if inputs % size:
            raise CheckpointError(f"{path}: patch_size {patch} does not divide the {inputs} inputs per patch of "
                                  f"{COMFY_NAMES.patch} ({list(shape(COMFY_NAMES.patch))})")
        latents = inputs // size
    if latents * size != inputs:
        named = "latents_dim" if "latents_dim" in data else "in_channels"
        raise CheckpointError(f"{path}: {named} {latents} and patch_size {patch or [1, 2, 2]} make {latents * size} "
                              f"inputs per patch, but the weights have {inputs} ({COMFY_NAMES.patch} is "
                              f"{list(shape(COMFY_NAMES.patch))})")
    return {"in_channels": latents, "patch_size": tuple(patch) if patch is not None else (1, 2, 2)}


def comfy_metadata_config(metadata: dict[str, str]) -> dict:
    """The `config` metadata override, translated to DiTConfig field names."""
    raw = metadata.get("config")
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"safetensors metadata `config` is not JSON ({exc.msg})") from None
    section = data.get("transformer", {}) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise CheckpointError("safetensors metadata `config` has no `transformer` object")
    out = {}
    for key, value in section.items():
        if key in COMFY_TO_DIFFUSERS:
            out[COMFY_TO_DIFFUSERS[key]] = value
        elif key in DiTConfig.__dataclass_fields__:
            out[key] = value
        elif key not in COMFY_IGNORED:
            raise CheckpointError(f"safetensors metadata `config` has an unknown transformer field {key!r}")
    if section.get("rope_theta") is not None:
        out["rope_theta"] = float(section["rope_theta"])
    return out


def comfy_metadata_for(config: DiTConfig) -> str:
    """The `config` metadata entry describing `config` in ComfyUI's argument names."""
    section = {}
    for field, value in config.to_dict().items():
        if field in DIFFUSERS_TO_COMFY:
            section[DIFFUSERS_TO_COMFY[field]] = value
    section["rope_theta"] = config.rope_theta
    return json.dumps({"transformer": section}, sort_keys=True)


def config_from_diffusers_shapes(keys: list[str], shape: ShapeFn) -> DiTConfig:
    """Sizes of a diffusers-named file without config.json (e.g. a bare state-dict dump)."""
    fields = _fields_from_shapes(keys, shape, DIFFUSERS_NAMES)
    head_dim = fields["attention_head_dim"]
    if head_dim != 128:
        raise CheckpointError("a diffusers-named file without config.json can only be sized for the released "
                              f"head_dim 128 (rope_freq_dim is not stored), got head_dim {head_dim}; put it in a "
                              "folder with its config.json and choose the folder")
    fields["rope_freq_dim"] = 16
    return _build(fields)


def _build(fields: dict) -> DiTConfig:
    try:
        return DiTConfig(**fields)
    except TypeError as exc:
        raise CheckpointError(f"cannot build the DiT config: {exc}") from None


def expected_inv_freq(config: DiTConfig) -> torch.Tensor:
    """theta^(-k / F) for k = 0..F-1: what a ComfyUI file stores as rope.inv_freq."""
    f = config.rope_freq_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))


def _check_rope(config: DiTConfig, stored: torch.Tensor, theta_given: bool) -> DiTConfig:
    """We recompute RoPE from rope_theta, so the stored frequencies must be that series."""
    stored = stored.float().flatten()
    if torch.allclose(stored, expected_inv_freq(config), rtol=1e-5, atol=0):
        return config
    if not theta_given and stored.numel() > 1 and float(stored[1]) > 0:
        theta = float(stored[1]) ** (-config.rope_freq_dim)
        if abs(theta - round(theta)) < 1e-3 * theta:
            theta = float(round(theta))
        candidate = DiTConfig(**{**config.to_dict(), "rope_theta": theta})
        if torch.allclose(stored, expected_inv_freq(candidate), rtol=1e-5, atol=0):
            return candidate
    raise CheckpointError(f"rope.inv_freq is not theta^(-k/{config.rope_freq_dim}) for theta "
                          f"{config.rope_theta:g}; this RoPE is not the H3 one")


def logical_param_count(config: DiTConfig) -> int:
    """Parameters of the model this config describes (33,122,992,896 for the released DiT)."""
    from ..dit.model import H3DiT

    with torch.device("meta"):
        model = H3DiT(config, dtype=torch.bfloat16, device="meta")
    return sum(math.prod(p.shape) for p in model.parameters())
