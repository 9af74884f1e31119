"""Load the two H3 VAEs from disk, and write synthetic VAE checkpoints.

Accepted sources (safetensors only, memory-mapped, tensor by tensor, each converted to its final
dtype and device before the next is read, so a file never needs twice its size in RAM):

- a diffusers component folder (`vae/` or `audio_vae/`: config.json + one safetensors file or
  an index of shards), or the parent folder that holds it;
- a ComfyUI single file. Video: the original MiniMax names (`encoder.down.{level}.block.{j}`,
  `nin_shortcut`, `decoder.x_embedder`, a fused per-head-interleaved `attn.to_qkv`, `attn.to_out`,
  `ff.w1` = [gate; value], `ff.w2`, plus `latents_mean`/`latents_std` tensors and an unused
  `decoder.mask_token`), published in fp16. Audio: diffusers' names with weight norm already
  folded into plain weights, plus `latents_mean`/`latents_std`, fp32.

A single file carries no config.json: a `config` JSON in its safetensors metadata wins (our
writer puts one there), otherwise the config is inferred from tensor shapes on top of the
released (FULL) geometry, and anything shapes cannot tell must then match FULL.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from . import audio as A
from . import video as V
from ...errors import CheckpointError, InputError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_VERSION = "0.42.1"
LAYOUTS = ("diffusers", "comfy")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# --------------------------------------------------------------------------------------------
# Finding and reading safetensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    files: tuple[Path, ...]
    config: dict[str, Any] | None  # config.json of a diffusers folder, None for a single file
    origin: str                    # what the user pointed at, for messages


def locate(path: str | os.PathLike, component: str) -> Source:
    """Resolve a VAE path: a diffusers component folder, its parent, or a single file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        _require_safetensors(path)
        return Source((path,), None, str(path))
    if (path / "config.json").is_file():
        return Source(_folder_weights(path), _read_json(path / "config.json"), str(path))
    if (path / component / "config.json").is_file():
        return locate(path / component, component)
    raise CheckpointError(f"{path}: not a diffusers {component}/ folder (config.json + safetensors) "
                          f"nor a folder holding one")


def _require_safetensors(path: Path) -> None:
    if path.suffix in _PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: only .safetensors checkpoints are loaded (pickle files can run code)")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: expected a .safetensors file")


def _folder_weights(folder: Path) -> tuple[Path, ...]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = tuple(folder / name for name in sorted(set(weight_map.values())))
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shards missing: {', '.join(missing)}")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return (folder / WEIGHTS_NAME,)
    candidates = sorted(folder.glob("*.safetensors"))
    if len(candidates) == 1:
        return (candidates[0],)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    hint = f" (found {', '.join(pickles)}: only safetensors are loaded)" if pickles else ""
    raise CheckpointError(f"{folder}: expected {WEIGHTS_NAME} or its shard index{hint}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


class TensorFiles:
    """Memory-mapped view over one or more safetensors files as one key space."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._stack = ExitStack()
        self._owner: dict[str, Any] = {}
        self.metadata: dict[str, str] = {}
        try:
            for file in files:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                self.metadata.update(handle.metadata() or {})
                for key in handle.keys():
                    self._owner[key] = handle
        except Exception as exc:
            self._stack.close()
            raise CheckpointError(f"cannot read safetensors {', '.join(map(str, files))}: {exc}") from None

    def __enter__(self) -> "TensorFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def keys(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, key: str) -> bool:
        return key in self._owner

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._owner[key].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._owner[key].get_tensor(key)


def _metadata_config(files: TensorFiles) -> dict[str, Any] | None:
    raw = files.metadata.get("config")
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError("the safetensors metadata 'config' is not valid JSON") from None
    return data if isinstance(data, dict) else None


def _reject_quantized(keys: Iterable[str], origin: str) -> None:
    if any(k.endswith((".comfy_quant", ".weight_scale", ".scale_weight")) for k in keys):
        raise CheckpointError(f"{origin}: a quantized (comfy_quant) VAE; load the fp16 or fp32 file instead")


# --------------------------------------------------------------------------------------------
# Building a module from a stream of tensors
# --------------------------------------------------------------------------------------------


def _materialize(model: torch.nn.Module, entries: Iterable[tuple[str, torch.Tensor]],
                 dtype_of: Callable[[str], torch.dtype], device: torch.device, origin: str,
                 fill_missing: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None) -> torch.nn.Module:
    """Assign each (name, tensor) to a module built on the meta device, checking names and shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in entries:
        if name not in expected:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{origin}: {name} has shape {tuple(tensor.shape)}, the config needs "
                                  f"{expected[name]}")
        state[name] = tensor.to(device=device, dtype=dtype_of(name))
    for name in expected.keys() - state.keys():
        filled = fill_missing(name, expected[name]) if fill_missing else None
        if filled is not None:
            state[name] = filled.to(device=device, dtype=dtype_of(name))
    missing = sorted(expected.keys() - state.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(sorted(unexpected)[:4])})")
        raise CheckpointError(f"{origin}: tensors do not match the config: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------
# Video VAE: name mapping between ComfyUI's (original) names and diffusers'
# --------------------------------------------------------------------------------------------

_COMFY_DOWN_BLOCK = re.compile(r"^encoder\.down\.(\d+)\.block\.(\d+)\.(.+)$")
_COMFY_DOWNSAMPLE = re.compile(r"^encoder\.down\.(\d+)\.downsample\.(.+)$")
_DIFF_DOWN_BLOCK = re.compile(r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$")
_DIFF_DOWNSAMPLE = re.compile(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.+)$")
_COMFY_ONLY = ("latents_mean", "latents_std", "decoder.mask_token")
_SIMPLE_RENAMES = (  # ComfyUI, diffusers
    ("decoder.x_embedder.", "decoder.proj_in."),
    (".attn.to_out.", ".attn.to_out.0."),
    (".ff.w2.", ".ff.net.2."),
)


def _is_comfy_video(keys: Iterable[str]) -> bool:
    return any(_COMFY_DOWN_BLOCK.match(k) for k in keys)


def _comfy_video_name(name: str) -> str:
    """ComfyUI name -> diffusers name for every tensor that maps one to one."""
    match = _COMFY_DOWN_BLOCK.match(name)
    if match:
        rest = match.group(3).replace("nin_shortcut.", "conv_shortcut.")
        return f"encoder.down_blocks.{match.group(1)}.resnets.{match.group(2)}.{rest}"
    match = _COMFY_DOWNSAMPLE.match(name)
    if match:
        return f"encoder.down_blocks.{match.group(1)}.downsamplers.0.{match.group(2)}"
    for comfy, diffusers in _SIMPLE_RENAMES:
        if comfy in name:
            return name.replace(comfy, diffusers)
    return name


def _diffusers_video_name(name: str) -> str:
    """diffusers name -> ComfyUI name (inverse of `_comfy_video_name`)."""
    match = _DIFF_DOWN_BLOCK.match(name)
    if match:
        rest = match.group(3).replace("conv_shortcut.", "nin_shortcut.")
        return f"encoder.down.{match.group(1)}.block.{match.group(2)}.{rest}"
    match = _DIFF_DOWNSAMPLE.match(name)
    if match:
        return f"encoder.down.{match.group(1)}.downsample.{match.group(2)}"
    for comfy, diffusers in _SIMPLE_RENAMES:
        if diffusers in name:
            return name.replace(diffusers, comfy)
    return name


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first])


def _split_qkv(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head [q_h; k_h; v_h] rows -> the three (inner, ...) projections."""
    per_head = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])
    return tuple(per_head[:, i].reshape(-1, *t.shape[1:]).contiguous() for i in range(3))  # type: ignore[return-value]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    parts = [x.reshape(heads, 1, x.shape[0] // heads, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def comfy_to_diffusers_video(name: str, tensor: torch.Tensor, heads: int) -> list[tuple[str, torch.Tensor]]:
    """One ComfyUI video-VAE tensor -> its diffusers tensor(s); file-level extras map to none."""
    if name in _COMFY_ONLY:
        return []
    if ".attn.to_qkv." in name:
        q, k, v = _split_qkv(tensor, heads)
        return [(name.replace(".to_qkv.", f".to_{part}."), t) for part, t in zip("qkv", (q, k, v), strict=True)]
    if ".ff.w1." in name:
        # ComfyUI computes silu(first) * second; diffusers' SwiGLU wants [value; gate].
        return [(name.replace(".ff.w1.", ".ff.net.0.proj."), _swap_halves(tensor))]
    return [(_comfy_video_name(name), tensor)]


def comfy_video_names_to_diffusers(names: Iterable[str]) -> set[str]:
    """The diffusers names a ComfyUI video-VAE file's tensors become (names only, for header checks)."""
    out: set[str] = set()
    for name in names:
        if name in _COMFY_ONLY:
            continue
        if ".attn.to_qkv." in name:
            out.update(name.replace(".to_qkv.", f".to_{part}.") for part in "qkv")
        elif ".ff.w1." in name:
            out.add(name.replace(".ff.w1.", ".ff.net.0.proj."))
        else:
            out.add(_comfy_video_name(name))
    return out


def diffusers_to_comfy_video(items: Iterable[tuple[str, torch.Tensor]],
                             heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """diffusers video-VAE tensors -> ComfyUI tensors; q/k/v are fused once all three are seen."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        match = re.match(r"^(.*\.attn)\.to_([qkv])\.(weight|bias)$", name)
        if match:
            group = pending.setdefault(f"{match.group(1)}.to_qkv.{match.group(3)}", {})
            group[match.group(2)] = tensor
            if len(group) == 3:
                key = f"{match.group(1)}.to_qkv.{match.group(3)}"
                yield key, _fuse_qkv(group["q"], group["k"], group["v"], heads)
                del pending[key]
            continue
        if ".ff.net.0.proj." in name:
            yield name.replace(".ff.net.0.proj.", ".ff.w1."), _swap_halves(tensor)
            continue
        yield _diffusers_video_name(name), tensor
    if pending:
        raise CheckpointError(f"incomplete q/k/v projections: {', '.join(sorted(pending))}")


# --------------------------------------------------------------------------------------------
# Video VAE: config
# --------------------------------------------------------------------------------------------


def _video_shapes(files: TensorFiles, comfy: bool) -> dict[str, tuple[int, ...]]:
    """Tensor shapes under diffusers names, without reading any data."""
    shapes = {}
    for key in files.keys():
        shape = files.shape(key)
        if comfy and ".attn.to_qkv." in key:
            for part in "qkv":
                shapes[key.replace(".to_qkv.", f".to_{part}.")] = (shape[0] // 3, *shape[1:])
        elif comfy:
            shapes[_comfy_video_name(key.replace(".ff.w1.", ".ff.net.0.proj."))] = shape
        else:
            shapes[key] = shape
    return shapes


def _count(shapes: Iterable[str], pattern: str) -> int:
    regex = re.compile(pattern)
    return len({m.group(1) for m in map(regex.match, shapes) if m})


def infer_video_config(shapes: dict[str, tuple[int, ...]]) -> V.VideoVAEConfig:
    """A config from diffusers-named tensor shapes, on top of the released geometry.

    Strides, head width and group count leave no trace in shapes: they are FULL's, and the file
    must agree with them (checked through proj_out's patch size and the group divisibility).
    """
    try:
        levels = _count(shapes, r"^encoder\.down_blocks\.(\d+)\.")
        channels = tuple(shapes[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"][0] for i in range(levels))
        with_down = tuple(f"encoder.down_blocks.{i}.downsamplers.0.conv.weight" in shapes for i in range(levels))
        dim = shapes["decoder.proj_in.weight"][0]
        cfg = {
            "in_channels": shapes["encoder.conv_in.weight"][1],
            "latent_channels": shapes["post_quant_conv.weight"][0],
            "block_out_channels": channels,
            "layers_per_block": _count(shapes, r"^encoder\.down_blocks\.0\.resnets\.(\d+)\."),
            "decoder_num_layers": _count(shapes, r"^decoder\.transformer_blocks\.(\d+)\."),
            "decoder_num_register_tokens": shapes["decoder.register_tokens"][1],
            "decoder_ffn_mult": shapes["decoder.transformer_blocks.0.ff.net.2.weight"][1] // dim,
            "decoder_num_attention_heads": dim // V.FULL.decoder_attention_head_dim,
        }
        patch = shapes["decoder.proj_out.weight"][0]
    except KeyError as exc:
        raise CheckpointError(f"not an H3 video VAE: no tensor {exc.args[0]}") from None
    full = V.FULL
    full_down = tuple(s * t > 1 for s, t in zip(full.spatial_downsample_factors, full.temporal_downsample_factors,
                                                 strict=True))
    if with_down != full_down or dim % full.decoder_attention_head_dim:
        raise CheckpointError("cannot infer this video VAE's strides or head width from its tensors; it has no "
                              "config (pass one, or use a diffusers folder)")
    c = cfg["latent_channels"]
    config = replace(full, **cfg, latents_mean=(0.0,) * c, latents_std=(1.0,) * c)
    if patch != config.out_channels * config.temporal_ratio * config.spatial_ratio ** 2:
        raise CheckpointError(f"decoder.proj_out has {patch} outputs, which the released strides do not give")
    return config


def _file_stats(config: Any, files: TensorFiles) -> Any:
    """A single file's own latents_mean/latents_std tensors are the truth for that file."""
    if "latents_mean" in files and "latents_std" in files:
        config = replace(config, latents_mean=tuple(files.get("latents_mean").float().tolist()),
                         latents_std=tuple(files.get("latents_std").float().tolist()))
    return config


def _video_config(source: Source, files: TensorFiles, comfy: bool,
                  given: V.VideoVAEConfig | None) -> V.VideoVAEConfig:
    if given is not None:
        return _file_stats(given, files)
    data = source.config or _metadata_config(files)
    config = V.VideoVAEConfig.from_dict(data) if data else infer_video_config(_video_shapes(files, comfy))
    return _file_stats(config, files)


# --------------------------------------------------------------------------------------------
# Video VAE: load
# --------------------------------------------------------------------------------------------


def load_video_vae(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                   decode_dtype: torch.dtype = torch.float16, config: V.VideoVAEConfig | None = None) -> V.VideoVAE:
    """The video VAE from a diffusers folder (or its parent) or a ComfyUI single file.

    The encoder and every numerically sensitive tensor are fp32; the decoder's block linears and
    output projection are `decode_dtype` (fp16 default, fp32 for the exact path). `config`
    replaces the file's or folder's config; latents_mean/std tensors in a single file still win.
    """
    if decode_dtype not in V.DECODE_DTYPES.values():
        raise InputError(f"video VAE decode dtype must be float16 or float32, got {decode_dtype}")
    source = locate(path, "vae")
    device = torch.device(device)
    with TensorFiles(source.files) as files:
        keys = files.keys()
        _reject_quantized(keys, source.origin)
        if "pre_block.attn.zero_k_bias" in files:
            raise CheckpointError(f"{source.origin}: this is the audio VAE, not the video VAE")
        comfy = _is_comfy_video(keys)
        if not comfy and not any(k.startswith("encoder.down_blocks.") for k in keys):
            raise CheckpointError(f"{source.origin}: not an H3 video VAE (no encoder.down_blocks.* or "
                                  f"encoder.down.*.block.* tensors)")
        cfg = _video_config(source, files, comfy, config)
        with torch.device("meta"):
            model = V.VideoVAE(cfg)
        heads = cfg.decoder_num_attention_heads

        def entries() -> Iterator[tuple[str, torch.Tensor]]:
            for key in keys:
                tensor = files.get(key)
                yield from (comfy_to_diffusers_video(key, tensor, heads) if comfy else [(key, tensor)])

        return _materialize(model, entries(), lambda n: V.param_dtype(n, decode_dtype), device, source.origin)


# --------------------------------------------------------------------------------------------
# Audio VAE: config and load
# --------------------------------------------------------------------------------------------


def infer_audio_config(shapes: dict[str, tuple[int, ...]]) -> A.AudioVAEConfig:
    """A config from (folded, diffusers-named) shapes. Encoder strides show in the kernel sizes
    (2 * stride); decoder rates, dilations and head count must be FULL's."""
    full = A.FULL
    try:
        stages = _count(shapes, r"^encoder\.block\.(\d+)\.block\.4\.")
        encoder_rates = tuple(shapes[f"encoder.block.{i + 1}.block.4.weight"][-1] // 2 for i in range(stages))
        ups = _count(shapes, r"^decoder\.ups\.(\d+)\.")
        kernels = tuple(shapes[f"decoder.ups.{i}.0.weight"][-1] for i in range(ups))
        per_stage = _count(shapes, r"^decoder\.resblocks\.(\d+)\.") // max(ups, 1)
        res_kernels = tuple(shapes[f"decoder.resblocks.{k}.convs1.0.weight"][-1] for k in range(per_stage))
        dilation_counts = tuple(_count(shapes, rf"^decoder\.resblocks\.{k}\.convs1\.(\d+)\.") for k in range(per_stage))
        cfg = {
            "encoder_dim": shapes["encoder.block.0.weight"][0],
            "encoder_rates": encoder_rates,
            "latent_dim": shapes["dec_in_proj.weight"][0],
            "latent_channels": shapes["mean_proj.weight"][0],
            "decoder_dim": shapes["decoder.conv_pre.weight"][0],
            "decoder_kernel_sizes": kernels,
            "resblock_kernel_sizes": res_kernels,
        }
    except KeyError as exc:
        raise CheckpointError(f"not an H3 audio VAE: no tensor {exc.args[0]}") from None
    full_dilation_counts = tuple(len(d) for d in full.resblock_dilation_sizes)
    if kernels != full.decoder_kernel_sizes or dilation_counts != full_dilation_counts:
        raise CheckpointError("cannot infer this audio VAE's decoder rates or dilations from its tensors; it has "
                              "no config (pass one, or use a diffusers folder)")
    return replace(full, **cfg)


def _audio_shapes(files: TensorFiles) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for key in files.keys():
        if key.endswith(".weight_v"):
            shapes[key[: -len("_v")]] = files.shape(key)
        elif not key.endswith(".weight_g"):
            shapes[key] = files.shape(key)
    return shapes


def _audio_config(source: Source, files: TensorFiles, given: A.AudioVAEConfig | None) -> A.AudioVAEConfig:
    if given is not None:
        return _file_stats(given, files)
    data = source.config or _metadata_config(files)
    config = A.AudioVAEConfig.from_dict(data) if data else infer_audio_config(_audio_shapes(files))
    return _file_stats(config, files)


def _audio_entries(files: TensorFiles, origin: str) -> Iterator[tuple[str, torch.Tensor]]:
    for key in files.keys():
        if key in ("latents_mean", "latents_std") or key.endswith(".weight_g"):
            continue
        if key.endswith(".weight_v"):
            g_key = key[:-1] + "g"
            if g_key not in files:
                raise CheckpointError(f"{origin}: {key} has no {g_key}")
            yield key[: -len("_v")], A.fold_weight_norm(files.get(g_key), files.get(key))
        else:
            yield key, files.get(key)
    orphans = [k for k in files.keys() if k.endswith(".weight_g") and k[:-1] + "v" not in files]
    if orphans:
        raise CheckpointError(f"{origin}: {orphans[0]} has no matching weight_v")


def _audio_buffer(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Fixed buffers a file may leave out: the resampling filters and the zero key bias."""
    if name.endswith(".filter"):
        return A.resampling_filter()
    if name.endswith("zero_k_bias"):
        return torch.zeros(shape)
    return None


def load_audio_vae(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                   config: A.AudioVAEConfig | None = None) -> A.AudioVAE:
    """The audio VAE (fp32) from a diffusers folder (or its parent) or a ComfyUI single file;
    weight_g/weight_v pairs are folded into plain weights once, here."""
    source = locate(path, "audio_vae")
    with TensorFiles(source.files) as files:
        keys = files.keys()
        _reject_quantized(keys, source.origin)
        if "pre_block.attn.zero_k_bias" not in files and "pre_block.attn.qkv.weight" not in files:
            video = any(k.startswith("decoder.transformer_blocks.") for k in keys)
            kind = "the video VAE" if video else "not an H3 audio VAE"
            raise CheckpointError(f"{source.origin}: {kind} (no pre_block.attn tensors)")
        cfg = _audio_config(source, files, config)
        with torch.device("meta"):
            model = A.AudioVAE(cfg)
        return _materialize(model, _audio_entries(files, source.origin), lambda n: torch.float32,
                            torch.device(device), source.origin, fill_missing=_audio_buffer)


# --------------------------------------------------------------------------------------------
# Writing synthetic checkpoints
# --------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


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


def _video_items(cfg: V.VideoVAEConfig, layout: str, seed: int, dtype: torch.dtype,
                 meta: bool) -> Iterator[tuple[str, torch.Tensor]]:
    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, device="meta") if meta else random_tensor(name, shape, seed)

    items: Iterable[tuple[str, torch.Tensor]] = ((n, make(n, s)) for n, s in _meta_shapes(V.VideoVAE, cfg))
    if layout == "comfy":
        items = diffusers_to_comfy_video(items, cfg.decoder_num_attention_heads)
    for name, tensor in items:
        yield name, tensor.to(dtype)
    if layout == "comfy":
        dim = cfg.decoder_dim
        yield "decoder.mask_token", make("decoder.mask_token", (1, 1, dim)).to(dtype)
        # fp32 whatever the file's dtype: fp16 would round the statistics the DiT space rests on.
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
        if layout == "diffusers":
            yield name + "_g", pair["weight_g"]
            yield name + "_v", pair["weight_v"]
        else:
            yield name, pair["weight_v"] if meta else A.fold_weight_norm(pair["weight_g"], pair["weight_v"])
    if layout == "comfy":
        for key in ("latents_mean", "latents_std"):
            yield key, torch.tensor(getattr(cfg, key), device="meta" if meta else "cpu")


def plan_vae_checkpoint(preset: str | V.VideoVAEConfig, layout: str = "diffusers",
                        dtype: torch.dtype | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor `write_vae_checkpoint` writes; nothing is allocated."""
    _check_layout(layout)
    cfg = _resolve_preset(preset, V.PRESETS, "video VAE")
    dtype = dtype or (torch.float16 if layout == "comfy" else torch.float32)
    return [(n, tuple(t.shape), t.dtype) for n, t in _video_items(cfg, layout, 0, dtype, meta=True)]


def plan_audio_vae_checkpoint(preset: str | A.AudioVAEConfig,
                              layout: str = "diffusers") -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    _check_layout(layout)
    cfg = _with_audio_stats(_resolve_preset(preset, A.PRESETS, "audio VAE"), 0)
    return [(n, tuple(t.shape), t.dtype) for n, t in _audio_items(cfg, layout, 0, meta=True)]


def _with_audio_stats(cfg: A.AudioVAEConfig, seed: int) -> A.AudioVAEConfig:
    mean, std = synthetic_latent_stats(cfg.latent_channels, seed)
    return replace(cfg, latents_mean=mean, latents_std=std)


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


def write_vae_checkpoint(out: str | os.PathLike, preset: str | V.VideoVAEConfig = "tiny", layout: str = "diffusers",
                         seed: int = 0, *, dtype: torch.dtype | None = None) -> Path:
    """A synthetic video VAE with deterministic random weights under the real names.

    layout "diffusers": `out` is the component folder (config.json + safetensors), fp32.
    layout "comfy": `out` is a .safetensors file with ComfyUI's names, fp16 like the published
    file. The same seed gives the same model in both layouts. latents_mean/std are random too.
    """
    _check_layout(layout)
    cfg = _resolve_preset(preset, V.PRESETS, "video VAE")
    mean, std = synthetic_latent_stats(cfg.latent_channels, seed)
    cfg = replace(cfg, latents_mean=mean, latents_std=std)
    dtype = dtype or (torch.float16 if layout == "comfy" else torch.float32)
    plan = plan_vae_checkpoint(cfg, layout, dtype)
    items = _video_items(cfg, layout, seed, dtype, meta=False)
    return _write(Path(out), layout, cfg.to_dict(), plan, items, f"synthetic H3 video VAE, seed {seed}")


def write_audio_vae_checkpoint(out: str | os.PathLike, preset: str | A.AudioVAEConfig = "tiny",
                               layout: str = "diffusers", seed: int = 0) -> Path:
    """A synthetic audio VAE (fp32) with deterministic random weights under the real names.

    layout "diffusers": `out` is the component folder, weight-normed convs as weight_g/weight_v.
    layout "comfy": `out` is a .safetensors file with folded weights and latents_mean/std tensors.
    """
    _check_layout(layout)
    cfg = _with_audio_stats(_resolve_preset(preset, A.PRESETS, "audio VAE"), seed)
    plan = [(n, tuple(t.shape), t.dtype) for n, t in _audio_items(cfg, layout, seed, meta=True)]
    items = _audio_items(cfg, layout, seed, meta=False)
    return _write(Path(out), layout, cfg.to_dict(), plan, items, f"synthetic H3 audio VAE, seed {seed}")
