"""Synthetic VAE checkpoints: deterministic random weights with the real names, in every layout we read.

`make-checkpoint --component vae|audio_vae`, the demo and the tests write them; the loaders in loading.py
read them back like any published file. Tensors are streamed to disk one at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ...errors import CheckpointError
from . import audio as A
from . import released
from . import video as V
from . import video_config as VC
from ..checkpoint.quant import convrot_group_for, encode_marker, quantize_int8_rows
from .loading import DIFFUSERS_VERSION, LAYOUTS, QUANTIZABLE, WEIGHTS_NAME, diffusers_to_comfy_video

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
                       torch.uint8: "U8"}
# The video VAE's stored forms: as published (fp16 ComfyUI file, fp32 folders), or ComfyUI's
# minimax_h3_video_vae_int8_convrot (the decoder blocks' linears int8 + ConvRot, the rest fp16; comfy layout).
VIDEO_FORMATS = ("float", "int8_convrot")


def write_safetensors_streaming(path: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                                tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write a safetensors file whose header is known up front, holding one tensor at a time."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dtype in plan:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        written = 0
        for (name, tensor), (p_name, p_shape, p_dtype) in zip(tensors, plan, strict=True):
            if name != p_name or tuple(tensor.shape) != p_shape or tensor.dtype != p_dtype:
                raise RuntimeError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not follow the plan "
                                   f"{p_name} {p_shape} {p_dtype}")
            out.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            written += 1
    os.replace(tmp, path)


def _generator(seed: int, name: str) -> torch.Generator:
    # Per-name streams make every tensor independent of write order and layout.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A deterministic, never-zero value for a named VAE tensor, scaled so activations stay sane."""
    gen = _generator(seed, name)
    normal = torch.randn(shape, generator=gen)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "filter":
        return A.resampling_filter().expand(shape).clone()
    if leaf == "zero_k_bias":  # a zero by definition in the real model too
        return torch.zeros(shape)
    if leaf == "weight_g" or (leaf == "alpha" and len(shape) == 3):  # norms and Snake frequencies: positive
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("alpha", "beta"):  # SnakeBeta, log space
        return 0.1 * normal
    if leaf in ("scale1", "scale2"):
        return 0.1 + 0.05 * normal
    if leaf == "register_tokens" or leaf == "mask_token":
        return normal
    if "norm" in name and leaf == "weight" and len(shape) == 1:
        return 1.0 + 0.1 * normal
    if len(shape) >= 2:
        return normal / math.sqrt(math.prod(shape[1:]))
    return 0.02 * normal


def synthetic_latent_stats(channels: int, seed: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Non-trivial latents_mean/std, so a skipped (de)normalisation shows in any test."""
    gen = _generator(seed, "latents_stats")
    mean = (0.5 * torch.randn(channels, generator=gen)).tolist()
    std = (0.5 + torch.rand(channels, generator=gen)).tolist()
    return tuple(mean), tuple(std)


def _resolve_preset(preset: str | Any, presets: dict[str, Any], kind: str) -> Any:
    if isinstance(preset, str):
        if preset not in presets:
            raise CheckpointError(f"unknown {kind} preset {preset!r}; choose one of {', '.join(presets)}")
        return presets[preset]
    return preset


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown checkpoint layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def _meta_shapes(model_cls: type, cfg: Any) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = model_cls(cfg)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def _int8_convrot_layer(layer: str, weight: torch.Tensor, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A decoder linear as ComfyUI's int8_convrot file stores it: int8 codes of the rotated weight, an fp32 scale per
    row, and its `.comfy_quant` marker. Quantized from the values the fp16 file holds, so both files of one seed
    are the same model up to the int8 rounding."""
    n, k = weight.shape
    group = convrot_group_for(k)
    if group is None:
        raise CheckpointError(f"{layer}: {k} input columns admit no power-of-4 ConvRot group")
    marker = encode_marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group})
    if meta:
        codes, scale = torch.empty(n, k, dtype=torch.int8, device="meta"), torch.empty(n, 1, device="meta")
    else:
        codes, scale = quantize_int8_rows(weight.float(), group)
    yield f"{layer}.weight", codes
    yield f"{layer}.weight_scale", scale
    yield f"{layer}.comfy_quant", marker.to("meta") if meta else marker


def _video_items(cfg: VC.VideoVAEConfig, layout: str, seed: int, dtype: torch.dtype,
                 meta: bool, fmt: str = "float") -> Iterator[tuple[str, torch.Tensor]]:
    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, device="meta") if meta else random_tensor(name, shape, seed)

    items: Iterable[tuple[str, torch.Tensor]] = ((n, make(n, s)) for n, s in _meta_shapes(V.VideoVAE, cfg))
    original_names = layout in ("comfy", "released")
    if original_names:
        items = diffusers_to_comfy_video(items, cfg.decoder_num_attention_heads)
    for name, tensor in items:
        layer = name[: -len(".weight")]
        if fmt == "int8_convrot" and name.endswith(".weight") and QUANTIZABLE.match(layer):
            yield from _int8_convrot_layer(layer, tensor.to(dtype), meta)
            continue
        yield name, tensor.to(dtype)
    if original_names:
        dim = cfg.decoder_dim
        yield "decoder.mask_token", make("decoder.mask_token", (1, 1, dim)).to(dtype)
    if layout == "comfy":
        # fp32 whatever the file's dtype: fp16 would round the statistics the DiT space rests on. MiniMaxAI's
        # own folder keeps them in its config.json instead.
        yield "latents_mean", torch.tensor(cfg.latents_mean, device="meta" if meta else "cpu")
        yield "latents_std", torch.tensor(cfg.latents_std, device="meta" if meta else "cpu")


def _audio_items(cfg: A.AudioVAEConfig, layout: str, seed: int, meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in _meta_shapes(A.AudioVAE, cfg):
        if not A.is_weight_normed(name, len(shape)):
            yield name, torch.empty(shape, device="meta") if meta else random_tensor(name, shape, seed)
            continue
        g_shape = (shape[0],) + (1,) * (len(shape) - 1)
        if meta:
            pair = {"weight_g": torch.empty(g_shape, device="meta"), "weight_v": torch.empty(shape, device="meta")}
        else:
            pair = {"weight_g": random_tensor(name + "_g", g_shape, seed),
                    "weight_v": random_tensor(name + "_v", shape, seed)}
        if layout in ("diffusers", "released"):
            yield name + "_g", pair["weight_g"]
            yield name + "_v", pair["weight_v"]
        else:
            yield name, pair["weight_v"] if meta else A.fold_weight_norm(pair["weight_g"], pair["weight_v"])
    if layout == "comfy":
        for key in ("latents_mean", "latents_std"):
            yield key, torch.tensor(getattr(cfg, key), device="meta" if meta else "cpu")


def _check_video_format(fmt: str, layout: str) -> None:
    if fmt not in VIDEO_FORMATS:
        raise CheckpointError(f"unknown video VAE format {fmt!r}; choose one of {', '.join(VIDEO_FORMATS)}")
    if fmt != "float" and layout != "comfy":
        raise CheckpointError(f"the {fmt} video VAE is ComfyUI's single file (layout comfy), not the {layout} layout")


def plan_vae_checkpoint(preset: str | VC.VideoVAEConfig, layout: str = "diffusers",
                        dtype: torch.dtype | None = None,
                        fmt: str = "float") -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor `write_vae_checkpoint` writes; nothing is allocated."""
    _check_layout(layout)
    _check_video_format(fmt, layout)
    cfg = _resolve_preset(preset, VC.PRESETS, "video VAE")
    dtype = dtype or (torch.float16 if layout == "comfy" else torch.float32)
    return [(n, tuple(t.shape), t.dtype) for n, t in _video_items(cfg, layout, 0, dtype, meta=True, fmt=fmt)]


def plan_audio_vae_checkpoint(preset: str | A.AudioVAEConfig,
                              layout: str = "diffusers") -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    _check_layout(layout)
    cfg = _with_audio_stats(_resolve_preset(preset, A.PRESETS, "audio VAE"), 0)
    return [(n, tuple(t.shape), t.dtype) for n, t in _audio_items(cfg, layout, 0, meta=True)]


def _with_audio_stats(cfg: A.AudioVAEConfig, seed: int) -> A.AudioVAEConfig:
    mean, std = synthetic_latent_stats(cfg.latent_channels, seed)
    return replace(cfg, latents_mean=mean, latents_std=std)


def _write_released(out: Path, files: dict[str, Any], weights: str, plan: list, items: Iterable,
                    description: str) -> Path:
    """MiniMaxAI's folder: its JSON / YAML files, then the weights (no config in the safetensors metadata)."""
    for name, content in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2) + "\n")
    write_safetensors_streaming(out / weights, plan, items,
                                {"format": "pt", "producer": "h3-spark", "description": description})
    return out


def _write(out: Path, layout: str, config: dict[str, Any], plan: list, items: Iterable, description: str) -> Path:
    metadata = {"format": "pt", "producer": "h3-spark", "description": description, "config": json.dumps(config)}
    if layout == "diffusers":
        out.mkdir(parents=True, exist_ok=True)
        config = {**config, "_diffusers_version": DIFFUSERS_VERSION}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors_streaming(out / WEIGHTS_NAME, plan, items, metadata)
        return out
    if out.suffix != ".safetensors":
        raise CheckpointError(f"{out}: a ComfyUI single file must end in .safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors_streaming(out, plan, items, metadata)
    return out


def write_vae_checkpoint(out: str | os.PathLike, preset: str | VC.VideoVAEConfig = "tiny", layout: str = "diffusers",
                         seed: int = 0, *, dtype: torch.dtype | None = None, fmt: str = "float") -> Path:
    """A synthetic video VAE with deterministic random weights under the real names.

    layout "diffusers": `out` is the component folder (config.json + safetensors), fp32.
    layout "comfy": `out` is a .safetensors file with ComfyUI's names, fp16 like the published
    file. layout "released": `out` is MiniMaxAI's video_vae/ folder (config.json, source/config.json,
    source/model.safetensors with the original names), fp32. The same seed gives the same model in every
    layout. latents_mean/std are random too. fmt "int8_convrot" (comfy layout): ComfyUI's
    minimax_h3_video_vae_int8_convrot, the decoder blocks' linears int8 + ConvRot (quantized from the fp16 file's
    values of the same seed, each with its `.comfy_quant` marker), everything else as the fp16 file holds it.
    """
    _check_layout(layout)
    _check_video_format(fmt, layout)
    cfg = _resolve_preset(preset, VC.PRESETS, "video VAE")
    mean, std = synthetic_latent_stats(cfg.latent_channels, seed)
    cfg = replace(cfg, latents_mean=mean, latents_std=std)
    dtype = dtype or (torch.float16 if layout == "comfy" else torch.float32)
    plan = plan_vae_checkpoint(cfg, layout, dtype, fmt)
    items = _video_items(cfg, layout, seed, dtype, meta=False, fmt=fmt)
    description = f"synthetic H3 video VAE, seed {seed}" + (f", {fmt} decoder linears" if fmt != "float" else "")
    if layout == "released":
        wrapper, source = released.video_files(cfg)
        return _write_released(Path(out), {"config.json": wrapper, "source/config.json": source},
                               "source/model.safetensors", plan, items, description)
    return _write(Path(out), layout, cfg.to_dict(), plan, items, description)


def write_audio_vae_checkpoint(out: str | os.PathLike, preset: str | A.AudioVAEConfig = "tiny",
                               layout: str = "diffusers", seed: int = 0) -> Path:
    """A synthetic audio VAE (fp32) with deterministic random weights under the real names.

    layout "diffusers": `out` is the component folder, weight-normed convs as weight_g/weight_v.
    layout "comfy": `out` is a .safetensors file with folded weights and latents_mean/std tensors.
    layout "released": `out` is MiniMaxAI's audio_vae/ folder (config.json, config.yaml, metadata.json,
    model.safetensors with weight_g/weight_v pairs).
    """
    _check_layout(layout)
    cfg = _with_audio_stats(_resolve_preset(preset, A.PRESETS, "audio VAE"), seed)
    plan = [(n, tuple(t.shape), t.dtype) for n, t in _audio_items(cfg, layout, seed, meta=True)]
    items = _audio_items(cfg, layout, seed, meta=False)
    description = f"synthetic H3 audio VAE, seed {seed}"
    if layout == "released":
        wrapper, yaml_text, metadata = released.audio_files(cfg)
        return _write_released(Path(out), {"config.json": wrapper, "config.yaml": yaml_text,
                                           "metadata.json": metadata}, "model.safetensors", plan, items, description)
    return _write(Path(out), layout, cfg.to_dict(), plan, items, description)
