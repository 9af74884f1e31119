"""Load the two H3 VAEs from disk (synthetic.py writes test checkpoints in every layout read here).

Accepted sources (safetensors only, memory-mapped, tensor by tensor, each converted to its final
dtype and device before the next is read, so a file never needs twice its size in RAM):

- a diffusers component folder (`vae/` or `audio_vae/`: config.json + one safetensors file or
  an index of shards), or the parent folder that holds it;
- MiniMaxAI's own folders of the per-mode download (`video_vae/`, `audio_vae/`; released.py reads
  their configs), or the mode folder that holds them;
- a ComfyUI single file. Video: the original MiniMax names (`encoder.down.{level}.block.{j}`,
  `nin_shortcut`, `decoder.x_embedder`, a fused per-head-interleaved `attn.to_qkv`, `attn.to_out`,
  `ff.w1` = [gate; value], `ff.w2`, plus `latents_mean`/`latents_std` tensors and an unused
  `decoder.mask_token`), published in fp16. Audio: diffusers' names with weight norm already
  folded into plain weights, plus `latents_mean`/`latents_std`, fp32.
  A ComfyUI video VAE may hold its decoder blocks' linears quantized (`.comfy_quant` per layer, int8 /
  int8_convrot: ComfyUI's `minimax_h3_video_vae_int8_convrot`); those layers are read by the rules every
  checkpoint reader shares (`checkpoint/layer_reading.py`) and kept as stored (StoredLinear, dequantized at
  use) or dequantized at load (`stored=False`), to the same bits. Any other quantized layer is refused by name.

A single file carries no config.json: a `config` JSON in its safetensors metadata wins (our
writer puts one there), otherwise the config is inferred from tensor shapes on top of the
released (FULL) geometry, and anything shapes cannot tell must then match FULL.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from ...errors import CheckpointError, InputError
from ...kernels.stored_linear import StoredForm, StoredLinear
from ..checkpoint import layer_reading
from ..checkpoint.quant import METADATA_KEY, QUANT_SUFFIXES, STORED_PARTS, QuantSpec, check_stored, split_param
from ..checkpoint.safetensors_header import DTYPES, read_header
from ..checkpoint.source import CheckpointSource
from ..json_file import read_json
from . import audio as A
from . import released
from . import video as V
from . import video_config as VC

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_VERSION = "0.42.1"
# The layouts synthetic.py writes: a diffusers folder, a ComfyUI single file, MiniMaxAI's own folder.
LAYOUTS = ("diffusers", "comfy", "released")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# --------------------------------------------------------------------------------------------
# Finding and reading safetensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    files: tuple[Path, ...]
    config: dict[str, Any] | None  # config.json of a diffusers folder, None for a single file
    origin: str                    # what the user pointed at, for messages


# Where a model folder keeps each VAE: diffusers' name, then MiniMaxAI's per-mode folder name.
CHILD_FOLDERS = {"vae": ("vae", "video_vae"), "audio_vae": ("audio_vae",)}


def locate(path: str | os.PathLike, component: str) -> Source:
    """Resolve a VAE path: a diffusers component folder, MiniMaxAI's own video_vae/ or audio_vae/ folder,
    the folder holding one of those, or a single file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        _require_safetensors(path)
        return Source((path,), None, str(path))
    if (path / "config.json").is_file():
        config = read_json(path / "config.json")
        if released.is_released(config):
            return _released_source(path, config)
        return Source(_folder_weights(path), config, str(path))
    for child in CHILD_FOLDERS.get(component, (component,)):
        if (path / child / "config.json").is_file():
            return locate(path / child, component)
    raise CheckpointError(f"{path}: not a diffusers {component}/ folder (config.json + safetensors), nor "
                          f"MiniMaxAI's {CHILD_FOLDERS.get(component, (component,))[-1]}/ folder, nor a folder "
                          "holding one")


def _released_source(folder: Path, wrapper: dict[str, Any]) -> Source:
    """MiniMaxAI's folder: the weights its config.json names, and its configs in our field names."""
    video = wrapper["_class_name"] == released.VIDEO_CLASS
    config = released.video_config(folder, wrapper) if video else released.audio_config(folder, wrapper)
    return Source((released.weights_file(folder, wrapper),), config.to_dict(), str(folder))


def _require_safetensors(path: Path) -> None:
    if path.suffix in _PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: only .safetensors checkpoints are loaded (pickle files can run code)")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: expected a .safetensors file")


def _folder_weights(folder: Path) -> tuple[Path, ...]:
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self._owner[key].get_slice(key).get_dtype()][0]

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


def _is_quant_key(key: str) -> bool:
    """A tensor that belongs to a layer's quantization (its marker, scales), not to the model's parameters."""
    split = split_param(key)
    return split is not None and split[1] in QUANT_SUFFIXES


def _has_quantization(files: TensorFiles) -> bool:
    return METADATA_KEY in files.metadata or any(_is_quant_key(k) for k in files.keys())


def _reject_quantized(files: TensorFiles, origin: str) -> None:
    if _has_quantization(files):
        raise CheckpointError(f"{origin}: a quantized (comfy_quant) audio VAE; load the fp32 file instead")


# --------------------------------------------------------------------------------------------
# Building a module from a stream of tensors
# --------------------------------------------------------------------------------------------


def _materialize(model: torch.nn.Module, entries: Iterable[tuple[str, torch.Tensor]],
                 dtype_of: Callable[[str], torch.dtype], device: torch.device, origin: str,
                 fill_missing: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None) -> torch.nn.Module:
    """Assign each (name, tensor) to a module built on the meta device, checking names and shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    stored: dict[str, StoredLinear] = {}
    unexpected = []
    for name, tensor in entries:
        if name not in expected:
            unexpected.append(name)
            continue
        shape = tuple(tensor.shape)  # a StoredForm's is the logical weight's
        if shape != expected[name]:
            raise CheckpointError(f"{origin}: {name} has shape {shape}, the config needs {expected[name]}")
        if isinstance(tensor, StoredForm):
            stored[name] = _stored_linear(model, name, tensor, dtype_of(name))
            state[name] = stored[name].weight
            continue
        state[name] = tensor.to(device=device, dtype=dtype_of(name))
    for name in expected.keys() - state.keys():
        filled = fill_missing(name, expected[name]) if fill_missing else None
        if filled is not None:
            state[name] = filled.to(device=device, dtype=dtype_of(name))
    _check_names(sorted(expected.keys() - state.keys()), sorted(unexpected), origin)
    for name, linear in stored.items():
        # The codes and scales are the StoredLinear's own buffers; the state names them so the strict load below
        # still checks every other tensor (its bias among them).
        module = name[: -len(".weight")]
        state.update({f"{module}.{buffer}": value for buffer, value in linear.named_buffers()})
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _stored_linear(model: torch.nn.Module, name: str, form: StoredForm, dtype: torch.dtype) -> StoredLinear:
    """Swap the meta-built linear that owns `name` (its weight) for a StoredLinear holding `form`; its bias comes
    later, with the other tensors."""
    module = name[: -len(".weight")]
    old = model.get_submodule(module)
    bias = None if old.bias is None else torch.empty(old.bias.shape, device="meta")
    linear = StoredLinear(form, dtype, bias)
    model.set_submodule(module, linear)
    return linear


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
    """Tensor shapes under diffusers names, without reading any data (a quantized layer's markers and scales are
    its format's, checked with it; its int8 weight has the logical shape)."""
    shapes = {}
    for key in files.keys():
        if _is_quant_key(key):
            continue
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


def infer_video_config(shapes: dict[str, tuple[int, ...]]) -> VC.VideoVAEConfig:
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
            "decoder_num_attention_heads": dim // VC.FULL.decoder_attention_head_dim,
        }
        patch = shapes["decoder.proj_out.weight"][0]
    except KeyError as exc:
        raise CheckpointError(f"not an H3 video VAE: no tensor {exc.args[0]}") from None
    full = VC.FULL
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
                  given: VC.VideoVAEConfig | None) -> VC.VideoVAEConfig:
    if given is not None:
        return _file_stats(given, files)
    data = source.config or _metadata_config(files)
    config = VC.VideoVAEConfig.from_dict(data) if data else infer_video_config(_video_shapes(files, comfy))
    return _file_stats(config, files)


# --------------------------------------------------------------------------------------------
# Video VAE: load
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """What a video VAE's files hold, checked from headers: ComfyUI / MiniMaxAI names or diffusers', the config,
    and the quantized layers by their stored (ComfyUI) name."""

    comfy: bool
    config: VC.VideoVAEConfig
    quantized: dict[str, "QuantizedLayer"]

    @property
    def weights(self) -> str:
        """What inspect says of the weights: floats as stored, or which decoder linears are quantized, and how."""
        if not self.quantized:
            return "floats as stored (no quantized layer)"
        labels = sorted({layer.spec.label for layer in self.quantized.values()})
        return f"{' + '.join(labels)} decoder linears ({len(self.quantized)}), the rest floats as stored"


def _video_identity(source: Source, files: TensorFiles, given: VC.VideoVAEConfig | None) -> Identity:
    """A video VAE's names, config and quantized layers, after checking that its files hold one and that every
    quantized layer is a decoder linear of this config in a format the VAE reads (markers and headers only)."""
    keys = files.keys()
    if "pre_block.attn.zero_k_bias" in files:
        raise CheckpointError(f"{source.origin}: this is the audio VAE, not the video VAE")
    comfy = _is_comfy_video(keys)
    if not comfy and not any(k.startswith("encoder.down_blocks.") for k in keys):
        raise CheckpointError(f"{source.origin}: not an H3 video VAE (no encoder.down_blocks.* or "
                              f"encoder.down.*.block.* tensors)")
    quantized = _quantized_layers(source, files, comfy)
    config = _video_config(source, files, comfy, given)
    _check_quantized(quantized, config, files, source.origin)
    return Identity(comfy, config, quantized)


# --------------------------------------------------------------------------------------------
# Video VAE: quantized decoder linears (ComfyUI's int8_convrot file)
# --------------------------------------------------------------------------------------------

# The layers a ComfyUI video VAE may hold quantized, by their names there: the four linears of each decoder
# transformer block (ComfyUI's int8_convrot file quantizes exactly these, 4 x 36). The causal-CNN encoder,
# x_embedder, proj_out and the norms stay floats.
QUANTIZABLE = re.compile(r"^decoder\.transformer_blocks\.\d+\.(attn\.to_qkv|attn\.to_out|ff\.w1|ff\.w2)$")
# The stored formats such a layer may take (kernels/formats/int8.py: int8, and int8_convrot with ConvRot).
VIDEO_QUANT_FORMATS = ("int8_tensorwise",)


@dataclass(frozen=True)
class QuantizedLayer:
    spec: QuantSpec
    keys: dict[str, str]  # suffix -> stored key


def _reader(source: Source) -> CheckpointSource:
    """The single file as the checkpoint readers open it (layer_reading reads markers and layers through it)."""
    return CheckpointSource(source.files[0], [read_header(source.files[0])], None)


def _quantized_layers(source: Source, files: TensorFiles, comfy: bool) -> dict[str, QuantizedLayer]:
    """Each quantized layer's declaration (its `.comfy_quant` marker or the header's metadata, by the rule every
    reader shares), in a format the video VAE reads; a scale without a declaration is refused there."""
    if not _has_quantization(files):
        return {}
    if not comfy or len(source.files) != 1:
        raise CheckpointError(f"{source.origin}: quantized (comfy_quant) video VAE layers are read from ComfyUI's "
                              "single file only; load this layout's fp16 or fp32 weights")
    layers: dict[str, dict[str, str]] = {}
    for key in files.keys():
        split = split_param(key)
        if split is not None:
            layer_reading.add_key(layers.setdefault(split[0], {}), split[1], key)
    reader = _reader(source)
    try:
        specs = layer_reading.declare(reader, layers, "", None)
    except CheckpointError as exc:
        raise CheckpointError(f"{source.origin}: {exc}") from None
    finally:
        reader.close()
    for name, spec in sorted(specs.items()):
        if spec.format not in VIDEO_QUANT_FORMATS:
            raise CheckpointError(f"{source.origin}: {name} is stored as {spec.label}; the video VAE reads its "
                                  "decoder linears as int8 or int8_convrot (int8_tensorwise) only")
    return {name: QuantizedLayer(spec, layers[name]) for name, spec in specs.items()}


def _logical_shape(name: str, expected: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """The weight [N, K] a ComfyUI layer stores: its model weights' rows stacked (to_qkv is q, k and v)."""
    targets = sorted(comfy_video_names_to_diffusers([f"{name}.weight"]))
    return sum(expected[t][0] for t in targets), expected[targets[0]][1]


def _check_quantized(quantized: dict[str, QuantizedLayer], config: VC.VideoVAEConfig, files: TensorFiles,
                     origin: str) -> None:
    """Every quantized layer is a layer of this VAE, one of its decoder blocks' linears, and its stored tensors can
    hold that weight (their dtypes and shapes, from the header)."""
    if not quantized:
        return
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in V.VideoVAE(config).state_dict().items()}
    for name, layer in sorted(quantized.items()):
        label = layer.spec.label
        if not comfy_video_names_to_diffusers([f"{name}.weight"]) <= expected.keys():
            raise CheckpointError(f"{origin}: {name} is declared {label}, but this video VAE has no such layer")
        if not QUANTIZABLE.match(name):
            raise CheckpointError(f"{origin}: {name} is declared {label}; a video VAE keeps only its decoder blocks' "
                                  "linears (attn.to_qkv, attn.to_out, ff.w1, ff.w2) quantized, and the encoder, "
                                  "x_embedder, proj_out and norms as floats")
        stored = {s: torch.empty(files.shape(k), dtype=files.dtype(k), device="meta")
                  for s, k in layer.keys.items() if s in STORED_PARTS}
        try:
            check_stored(layer.spec, stored, _logical_shape(name, expected), name)
        except CheckpointError as exc:
            raise CheckpointError(f"{origin}: {exc}") from None


def _quantized_entries(reader: CheckpointSource, name: str, layer: QuantizedLayer, shape: tuple[int, int],
                       heads: int, dtype: torch.dtype, device: torch.device,
                       stored: bool) -> list[tuple[str, "torch.Tensor | StoredForm"]]:
    """One quantized ComfyUI layer as the model's weights: dequantized at load (then renamed, split and swapped as
    a float file's), or as StoredForms of its codes (to_qkv's per-head rows gathered into q, k and v; ff.w1's
    halves swapped as they are dequantized), which a StoredLinear dequantizes at use to the same bits."""
    if not stored:
        weight = layer_reading.dequantized(reader, layer.spec, layer.keys, shape, dtype, device, name)
        return comfy_to_diffusers_video(f"{name}.weight", weight, heads)
    held = layer_reading.held(reader, layer.spec, layer.keys, shape, device, name)
    group = layer.spec.params.convrot_group
    if name.endswith(".attn.to_qkv"):
        # Rows are [q_h; k_h; v_h] per head; every format here is per row, so a part's rows are its own layer.
        rows = torch.arange(shape[0], device=device).reshape(heads, 3, -1)
        out = []
        for i, part in enumerate("qkv"):
            index = rows[:, i].reshape(-1)
            tensors = {s: t.index_select(0, index) if t.numel() > 1 else t for s, t in held.items()}
            out.append((f"{name[: -len('to_qkv')]}to_{part}.weight",
                        StoredForm(layer.spec.format, (index.numel(), shape[1]), tensors, group)))
        return out
    target = _comfy_video_name(f"{name}.weight".replace(".ff.w1.", ".ff.net.0.proj."))
    return [(target, StoredForm(layer.spec.format, shape, held, group, swap_halves=name.endswith(".ff.w1")))]


def check_video_vae(path: str | os.PathLike) -> VC.VideoVAEConfig:
    """The video VAE's config, with its files and every tensor's name and shape checked against it, from the
    configs and safetensors headers alone (what load_video_vae refuses, refused before any weight is read)."""
    return video_identity(path).config


def video_identity(path: str | os.PathLike) -> Identity:
    """`check_video_vae`'s checks, and what they found (names, config, quantized layers)."""
    source = locate(path, "vae")
    with TensorFiles(source.files) as files:
        identity = _video_identity(source, files, None)
        comfy, cfg = identity.comfy, identity.config
        shapes = {n: s for n, s in _video_shapes(files, comfy).items() if not (comfy and n in _COMFY_ONLY)}
    post = shapes.get("post_quant_conv.weight")
    if post is not None and post[0] != cfg.latent_channels:
        field = "z_channels" if source.files[0].parent.name == "source" else "latent_channels"
        raise CheckpointError(f"{source.origin}: the config's latent channels ({field}) are {cfg.latent_channels} "
                              f"but the weights have {post[0]} (post_quant_conv.weight is {list(post)})")
    with torch.device("meta"):
        model = V.VideoVAE(cfg)
    check_shapes({n: tuple(t.shape) for n, t in model.state_dict().items()}, shapes, source.origin)
    return identity


def check_shapes(expected: dict[str, tuple[int, ...]], stored: dict[str, tuple[int, ...]], origin: str,
                 optional: Callable[[str], bool] = lambda name: False) -> None:
    """Stored tensor shapes (under the model's names) against the model a config builds, in one line each."""
    for name in sorted(expected.keys() & stored.keys()):
        if tuple(stored[name]) != expected[name]:
            raise CheckpointError(f"{origin}: {name} has shape {tuple(stored[name])}, the config needs "
                                  f"{expected[name]}")
    _check_names(sorted(n for n in expected.keys() - stored.keys() if not optional(n)),
                 sorted(stored.keys() - expected.keys()), origin)


def _check_names(missing: list[str], unexpected: list[str], origin: str) -> None:
    """One line for tensors the config needs and the file lacks, and for tensors the config does not know."""
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:4])})")
        raise CheckpointError(f"{origin}: tensors do not match the config: {'; '.join(parts)}")


def load_video_vae(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                   decode_dtype: torch.dtype = torch.float16, config: VC.VideoVAEConfig | None = None,
                   stored: bool = True) -> V.VideoVAE:
    """The video VAE from a diffusers folder (or its parent) or a ComfyUI single file.

    The encoder and every numerically sensitive tensor are fp32; the decoder's block linears and
    output projection are `decode_dtype` (fp16 default, fp32 for the exact path). `config`
    replaces the file's or folder's config; latents_mean/std tensors in a single file still win.
    Quantized decoder linears (ComfyUI's int8_convrot file) stay as stored, StoredLinears dequantized at use into
    `decode_dtype`; `stored=False` dequantizes them at load into plain linears (the same bits).
    """
    if decode_dtype not in VC.DECODE_DTYPES.values():
        raise InputError(f"video VAE decode dtype must be float16 or float32, got {decode_dtype}")
    source = locate(path, "vae")
    device = torch.device(device)
    with TensorFiles(source.files) as files, ExitStack() as stack:
        keys = files.keys()
        identity = _video_identity(source, files, config)
        comfy, cfg, quantized = identity.comfy, identity.config, identity.quantized
        with torch.device("meta"):
            model = V.VideoVAE(cfg)
        heads = cfg.decoder_num_attention_heads
        reader = stack.enter_context(_reader(source)) if quantized else None
        expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        scales = {k for layer in quantized.values() for s, k in layer.keys.items() if s != "weight" and s != "bias"}

        def entries() -> Iterator[tuple[str, "torch.Tensor | StoredForm"]]:
            for key in keys:
                if key in scales:
                    continue
                layer = key[: -len(".weight")] if key.endswith(".weight") else None
                if layer in quantized:
                    yield from _quantized_entries(reader, layer, quantized[layer], _logical_shape(layer, expected),
                                                  heads, decode_dtype, device, stored)
                    continue
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


def _audio_identity(source: Source, files: TensorFiles, given: A.AudioVAEConfig | None) -> A.AudioVAEConfig:
    """The config of an audio VAE's files, after checking that they hold one."""
    keys = files.keys()
    _reject_quantized(files, source.origin)
    if "pre_block.attn.zero_k_bias" not in files and "pre_block.attn.qkv.weight" not in files:
        video = any(k.startswith("decoder.transformer_blocks.") for k in keys)
        kind = "the video VAE" if video else "not an H3 audio VAE"
        raise CheckpointError(f"{source.origin}: {kind} (no pre_block.attn tensors)")
    return _audio_config(source, files, given)


def check_audio_vae(path: str | os.PathLike) -> A.AudioVAEConfig:
    """The audio VAE's config, with its files and every tensor's name and shape checked against it, from the
    configs and safetensors headers alone."""
    source = locate(path, "audio_vae")
    with TensorFiles(source.files) as files:
        cfg = _audio_identity(source, files, None)
        orphans = [k for k in files.keys() if k.endswith((".weight_g", ".weight_v"))
                   and k[:-1] + ("v" if k.endswith("g") else "g") not in files]
        if orphans:
            raise CheckpointError(f"{source.origin}: {orphans[0]} has no matching weight_"
                                  f"{'v' if orphans[0].endswith('g') else 'g'}")
        shapes = {n: s for n, s in _audio_shapes(files).items() if n not in ("latents_mean", "latents_std")}
    with torch.device("meta"):
        model = A.AudioVAE(cfg)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    check_shapes(expected, shapes, source.origin,
                 optional=lambda name: _audio_buffer(name, expected[name]) is not None)
    return cfg


def load_audio_vae(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                   config: A.AudioVAEConfig | None = None) -> A.AudioVAE:
    """The audio VAE (fp32) from a diffusers folder (or its parent) or a ComfyUI single file;
    weight_g/weight_v pairs are folded into plain weights once, here."""
    source = locate(path, "audio_vae")
    with TensorFiles(source.files) as files:
        cfg = _audio_identity(source, files, config)
        with torch.device("meta"):
            model = A.AudioVAE(cfg)
        return _materialize(model, _audio_entries(files, source.origin), lambda n: torch.float32,
                            torch.device(device), source.origin, fill_missing=_audio_buffer)
