"""Lay a DiT out as ComfyUI stores it: original names, fused QKV, [gate; value] fc1, comfy_quant.

Input is any function giving diffusers-named fp32 tensors (a random model, or a real checkpoint
being converted); output is a list of writer Groups, one per stored layer, so the file streams.
Storage follows the published ComfyUI files: the patch projections, output heads and time MLP
(the fp32 islands) stay fp32; the curve table and the curve-form AdaLN are fp32; everything else
is bf16 unless it is one of the quantized linears (the 4 linears of each DiT block, and optionally
the refiner's), which are stored in the requested format. The 4-bit ConvRot formats (int4_convrot, w4a8*) keep a
linear whose input width they cannot hold in bf16 (w4a8: K not a multiple of 16, as the tiny model's 24), as
mixed files do.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from ...errors import CheckpointError
from ...kernels import nvfp4_codec as nvfp4
from ..dit.config import DiTConfig
from . import keymap
from .dit_config import comfy_metadata_for, expected_inv_freq
from .pruned import CurveFit, project
from .quant import (FOUR_BIT_WRITES, convrot_group_for, encode_marker, four_bit_conf, four_bit_entries,
                    four_bit_tensors, quantize_fp8, quantize_int8_rows)
from .safetensors_header import TORCH_TO_ST
from .writer import Group

FORMATS = ("bf16", "fp8_scaled", "nvfp4", "int8_convrot") + FOUR_BIT_WRITES
GetParam = Callable[[str], torch.Tensor]

_FP32_ORIGINAL = ("video_patch_proj", "audio_patch_proj", "time_embedder.proj_in", "time_embedder.proj_out",
                  "final_layer.video_out", "final_layer.audio_out")
_QUANT_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


def original_layers(config: DiTConfig) -> list[str]:
    """Stored layer names in model order (the order ComfyUI's module tree lists them)."""
    layers = ["video_patch_proj", "audio_patch_proj", "condition_proj"]
    if not config.curve_form:
        layers += ["time_embedder.proj_in", "time_embedder.proj_out"]
    block_parts = ["norm1", "attn.qkv_proj", "attn.q_norm", "attn.k_norm", "attn.out_proj", "norm2", "mlp.fc1", "mlp.fc2"]
    for i in range(config.num_refiner_layers):
        layers += [f"token_refiner.blocks.{i}.{p}" for p in block_parts]
    layers.append("token_refiner.final_norm")
    # A FastH3 block's VSA gate follows the attention's output projection, as in ComfyUI's Attention module.
    dit_parts = block_parts + ["adaln_proj.linear"]
    if config.gate_compress:
        dit_parts.insert(dit_parts.index("attn.out_proj") + 1, "attn.to_gate_compress")
    for i in range(config.num_layers):
        layers += [f"blocks.{i}.{p}" for p in dit_parts]
    layers += ["final_layer.norm", "final_layer.adaln_proj.linear", "final_layer.video_out", "final_layer.audio_out"]
    return layers


def is_quantized_layer(layer: str, quantize_refiner: bool, quantize_gates: bool = False) -> bool:
    if layer.startswith("blocks.") and layer.split(".", 2)[2] in _QUANT_LINEARS:
        return True
    if quantize_gates and layer.startswith("blocks.") and layer.endswith(".attn.to_gate_compress"):
        return True
    return quantize_refiner and layer.startswith("token_refiner.blocks.") and layer.split(".", 3)[3] in _QUANT_LINEARS


def _logical_weight(layer: str, config: DiTConfig, get: GetParam, fit: CurveFit | None,
                    qkv_layout: str = "stacked") -> dict[str, torch.Tensor]:
    """The stored layer's fp32 tensors (weight/bias) in original layout, before storage casting."""
    target = keymap.original_layer_to_diffusers(layer)
    c = config
    if target.endswith(".attn.to_qkv"):
        base = target[: -len("to_qkv")]
        q, k, v = (get(f"{base}{p}.weight") for p in ("to_q", "to_k", "to_v"))
        return {"weight": keymap.fuse_qkv(q, k, v, c.num_attention_heads, c.attention_head_dim, qkv_layout)}
    out = {"weight": get(f"{target}.weight")}
    if target.endswith(".ff.net.0.proj"):
        out["weight"] = keymap.swap_halves(out["weight"])
    if layer.endswith("adaln_proj.linear"):
        out["bias"] = get(f"{target}.bias")
        if fit is not None:
            out["weight"], out["bias"] = project(out["weight"], out["bias"], fit)
        return out
    if target.endswith(("proj_in", "context_embedder", "linear_1", "linear_2", "proj_out")):
        out["bias"] = get(f"{target}.bias")
    return out


def _storage_dtype(layer: str, config: DiTConfig) -> torch.dtype:
    if layer in _FP32_ORIGINAL or (config.curve_form and layer.endswith("adaln_proj.linear")):
        return torch.float32
    return torch.bfloat16


def _quant_entries(layer: str, fmt: str, n: int, k: int) -> tuple[list, dict]:
    """Planned stored tensors of a quantized layer and its comfy_quant JSON."""
    if fmt in FOUR_BIT_WRITES:
        conf = four_bit_conf(fmt, k)
        return four_bit_entries(fmt, layer, n, k, conf), conf
    if fmt == "fp8_scaled":
        conf = {"format": "float8_e4m3fn"}
        entries = [(f"{layer}.weight", "F8_E4M3", (n, k)), (f"{layer}.weight_scale", "F32", ())]
    elif fmt == "nvfp4":
        conf = {"format": "nvfp4"}
        entries = [(f"{layer}.weight", "U8", nvfp4.packed_shape(n, k)),
                   (f"{layer}.weight_scale", "F8_E4M3", nvfp4.scale_shape(n, k)),
                   (f"{layer}.weight_scale_2", "F32", ())]
    elif fmt == "int8_convrot":
        group = convrot_group_for(k)
        if group is None:
            raise CheckpointError(f"{layer}: {k} input columns admit no power-of-4 ConvRot group")
        conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
        entries = [(f"{layer}.weight", "I8", (n, k)), (f"{layer}.weight_scale", "F32", (n, 1))]
    else:
        raise CheckpointError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    marker_len = len(json.dumps(conf).encode("utf-8"))
    entries.append((f"{layer}.comfy_quant", "U8", (marker_len,)))
    return entries, conf


def _quantize(layer: str, fmt: str, weight: torch.Tensor, conf: dict) -> dict[str, torch.Tensor]:
    if fmt in FOUR_BIT_WRITES:
        return four_bit_tensors(fmt, layer, weight, conf)
    if fmt == "fp8_scaled":
        q, s = quantize_fp8(weight)
        out = {"weight": q, "weight_scale": s}
    elif fmt == "nvfp4":
        q, s, g = nvfp4.quantize(weight)
        out = {"weight": q, "weight_scale": s, "weight_scale_2": g}
    else:
        q, s = quantize_int8_rows(weight, conf["convrot_groupsize"])
        out = {"weight": q, "weight_scale": s}
    out["comfy_quant"] = encode_marker(conf)
    return {f"{layer}.{k}": v for k, v in out.items()}


def layer_shapes(layer: str, config: DiTConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Logical stored shapes (weight, bias) of an original-named layer, from diffusers shapes."""
    target = keymap.original_layer_to_diffusers(layer)
    if target.endswith(".attn.to_qkv"):
        n, k = shapes[target[: -len("to_qkv")] + "to_q.weight"]
        return {"weight": (3 * n, k)}
    out = {"weight": shapes[f"{target}.weight"]}
    if f"{target}.bias" in shapes:
        out["bias"] = shapes[f"{target}.bias"]
    if config.curve_form and layer.endswith("adaln_proj.linear"):
        out["weight"] = (out["weight"][0], config.time_embed_dim)
    return out


def comfy_groups(config: DiTConfig, get: GetParam, fmt: str, *, fit: CurveFit | None = None,
                 quantize_refiner: bool = False, quantize_gates: bool = False, prefix: str = "",
                 qkv_layout: str = "stacked") -> list[Group]:
    """Writer groups for an original-named DiT file. `config` is the stored model's (curve form if `fit`);
    `qkv_layout` "stacked" is ComfyUI's fused qkv order, "interleaved" MiniMaxAI's own shards'. `quantize_gates`
    stores a FastH3 model's VSA gates in `fmt` too (the published FastH3 ComfyUI files do), else bf16."""
    from .dit_reader import expected_shapes

    if config.curve_form != (fit is not None):
        raise CheckpointError("internal: a curve-form config needs a curve fit, and only then")
    full_config = DiTConfig(**{k: v for k, v in config.to_dict().items() if k != "adaln_curve_grid"})
    if config.curve_form:
        full_config = DiTConfig(**{**full_config.to_dict(), "time_embed_dim": fit.basis.shape[0]})
    shapes = expected_shapes(full_config)
    groups: list[Group] = []
    if fit is not None:
        table = fit.table
        groups.append(Group([(prefix + "adaln_t_table", "F32", tuple(table.shape))],
                            lambda table=table: {prefix + "adaln_t_table": table.clone()}))
    for layer in original_layers(config):
        logical = layer_shapes(layer, config, shapes)
        quantized = fmt != "bf16" and is_quantized_layer(layer, quantize_refiner, quantize_gates)
        if quantized and fmt in FOUR_BIT_WRITES:
            quantized = four_bit_conf(fmt, logical["weight"][1]) is not None
        store = _storage_dtype(layer, config)
        if quantized:
            n, k = logical["weight"]
            entries, conf = _quant_entries(prefix + layer, fmt, n, k)
        else:
            entries, conf = [(f"{prefix}{layer}.weight", TORCH_TO_ST[store], logical["weight"])], None
        if "bias" in logical:
            entries.append((f"{prefix}{layer}.bias", TORCH_TO_ST[store], logical["bias"]))

        def make(layer=layer, quantized=quantized, conf=conf, store=store):
            tensors = _logical_weight(layer, config, get, fit, qkv_layout)
            out = {}
            if quantized:
                out.update(_quantize(prefix + layer, fmt, tensors.pop("weight"), conf))
            for suffix, t in tensors.items():
                out[f"{prefix}{layer}.{suffix}"] = t.to(store)
            return out

        groups.append(Group(entries, make))
    inv = expected_inv_freq(config)
    groups.append(Group([(prefix + "rope.inv_freq", "F32", tuple(inv.shape))],
                        lambda inv=inv: {prefix + "rope.inv_freq": inv.clone()}))
    return groups


def comfy_metadata(config: DiTConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    meta = {"config": comfy_metadata_for(config)}
    meta.update(extra or {})
    return meta


def diffusers_groups(config: DiTConfig, get: GetParam) -> list[Group]:
    """Writer groups for a diffusers `transformer/` weights file: fp32 islands, bf16 elsewhere."""
    from ..dit.model import keeps_fp32
    from .dit_reader import expected_shapes

    groups = []
    for name, shape in expected_shapes(config).items():
        store = torch.float32 if keeps_fp32(name, config) else torch.bfloat16
        groups.append(Group([(name, TORCH_TO_ST[store], shape)],
                            lambda name=name, store=store: {name: get(name).to(store)}))
    return groups


def diffusers_config_json(config: DiTConfig) -> str:
    data = {"_class_name": "MiniMaxH3Transformer3DModel", "_diffusers_version": "0.42.1"}
    fields = config.to_dict()
    # diffusers has no curve form; a pruned model is never written in this layout.
    fields.pop("adaln_curve_grid", None)
    # Nor a VSA gate argument: FastVideo's FastH3 exports carry the gates in the weights only, and so do ours
    # (the reader tells from the weight names, dit_config.config_from_json).
    fields.pop("gate_compress", None)
    data.update(fields)
    return json.dumps(data, indent=2) + "\n"
