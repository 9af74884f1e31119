"""H3 Fun ControlNet Union files, read into the control tower (controlnet/tower.py), and synthetic ones written.

Two layouts, told apart by their names (detect.py):
- `released`: Alibaba PAI's own file (v1: 5 blocks, Union 2.0: 10), bf16 with the hint projection in fp32,
  diffusers' names under `control_blocks.N.` (ours as they are) plus `before_proj` / `after_proj` and
  `control_proj_in`; no metadata, so its places are its blocks spread over the DiT's 50 layers;
- `comfy`: ComfyUI's converted file, the original names under `control_blocks.N.` (fused `attn.qkv_proj` stacked
  [q; k; v], `mlp.fc1` as [gate; value], `attn.q_norm`, `attn.out_proj`, ...), the block linears stored as a
  quantized format (int8_convrot as published, declared by `.comfy_quant` markers), and metadata that may say
  `minimax_h3_fun_controlnet: adaln_basis` (pruned AdaLN: the projections read the DiT's curve basis),
  `control_blocks_places` (a JSON list of DiT layers) and `inpaint_masked_pixel_mode: post_norm` (Union 2.0's
  mid-gray inpaint fill).
Everything is checked from the header first (`check`), so a wrong file fails in one line before any weight is read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from ...errors import CheckpointError
from ...kernels.formats import FORMATS
from ...kernels.stored_linear import StoredForm
from ..controlnet.tower import BASE_LAYERS, HINT_CHANNELS, ControlConfig, ControlTower, spread
from ..dit.config import DiTConfig
from . import keymap, layer_reading
from .detect import detect
from .quant import QuantSpec, split_param
from .safetensors_header import TORCH_TO_ST
from .writer import Group, write_groups

LAYOUTS = ("comfy", "released")
_BLOCK = re.compile(r"^control_blocks\.(\d+)\.(.+)$")
_SKIPS = ("before_proj", "after_proj")
# The block linears ComfyUI's converted file stores quantized (the skip projections too: 2.14 GB for 1.9 B weights).
_QUANTIZED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2") + _SKIPS
_COMFY_PARTS = ("norm1", "attn.qkv_proj", "attn.q_norm", "attn.k_norm", "attn.out_proj", "norm2", "mlp.fc1",
                "mlp.fc2", "adaln_proj.linear")


def is_controlnet(path: str | Path) -> bool:
    """Whether a safetensors file holds an H3 Fun ControlNet (headers only)."""
    from .source import open_source

    source = open_source(path)
    try:
        return detect(list(source.keys), str(path)).model == "controlnet"
    except CheckpointError:
        return False
    finally:
        source.close()


def ours_of(layer: str, layout: str) -> str | None:
    """A stored layer name -> the tower's (`attn.to_qkv` for the fused QKV); None when it fits no pattern."""
    if layer == "control_proj_in":
        return layer
    m = _BLOCK.match(layer)
    if not m:
        return None
    index, rest = m.groups()
    if rest in _SKIPS or layout == "released":
        return layer
    target = keymap.original_layer_to_diffusers(f"blocks.{index}.{rest}")
    return None if target is None else f"control_blocks.{index}.{target.split('.', 2)[2]}"


class ControlNetFile:
    """A ControlNet file opened from its header: its layout, its tower's config, its layers and their formats."""

    def __init__(self, path: str | Path):
        from .gguf_source import GgufSource
        from .source import open_source

        self.path = Path(path)
        self.source = open_source(self.path)
        if isinstance(self.source, GgufSource) or self.path.is_dir():
            self.source.close()
            raise CheckpointError(f"{self.path}: an H3 Fun ControlNet is one .safetensors file")
        detected = detect(list(self.source.keys), str(self.path))
        if detected.model != "controlnet":
            self.source.close()
            what = {"dit": "the DiT (give it with --dit)", "video_vae": "the video VAE", "audio_vae": "the audio VAE",
                    "text_encoder": "the text encoder"}[detected.model]
            raise CheckpointError(f"{self.path}: holds {what}, not an H3 Fun ControlNet")
        self.layout = detected.layout
        self.metadata = self.source.metadata
        self.layers: dict[str, dict[str, str]] = {}
        self.unmapped: list[str] = []
        for key in self.source.keys:
            split = split_param(key)
            if split is None:
                self.unmapped.append(key)
                continue
            layer_reading.add_key(self.layers.setdefault(split[0], {}), split[1], key)
        self.specs: dict[str, QuantSpec] = layer_reading.declare(self.source, self.layers, "", None)
        self.targets = {name: ours_of(name, self.layout) for name in self.layers}
        self.unmapped += sorted(k for name, t in self.targets.items() if t is None for k in self.layers[name].values())
        self.config = self._read_config()

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "ControlNetFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- the tower this file builds
    def _shape(self, layer: str) -> tuple[int, int]:
        """A layer's logical weight shape (a quantized one's columns as the format packs them)."""
        entry = self.source.entry(self.layers[layer]["weight"])
        if len(entry.shape) != 2 and not layer.endswith(("norm1", "norm2", "q_norm", "k_norm", "norm_q", "norm_k")):
            raise CheckpointError(f"{self.path}: {layer}.weight is {list(entry.shape)}, not a matrix")
        spec = self.specs.get(layer)
        if spec is None or len(entry.shape) != 2:
            return tuple(entry.shape)
        return entry.shape[0], entry.shape[1] * FORMATS[spec.format].values_per_column

    def _need(self, layer: str) -> tuple[int, ...]:
        if layer not in self.layers or "weight" not in self.layers[layer]:
            raise CheckpointError(f"{self.path}: {layer}.weight is missing")
        return self._shape(layer)

    def _read_config(self) -> ControlConfig:
        comfy = self.layout == "comfy"
        hidden, hint_dim = self._need("control_proj_in")
        if hint_dim != HINT_CHANNELS * 4:
            raise CheckpointError(f"{self.path}: control_proj_in reads {hint_dim} columns, the H3 Fun ControlNet's "
                                  f"hint is {HINT_CHANNELS} channels patchified 2x2 ({HINT_CHANNELS * 4})")
        blocks = 0
        while f"control_blocks.{blocks}.after_proj" in self.layers:
            blocks += 1
        found = {int(m.group(1)) for name in self.layers if (m := _BLOCK.match(name))}
        if found != set(range(blocks)):
            raise CheckpointError(f"{self.path}: control blocks {sorted(found)} are not 0..{blocks - 1} each with "
                                  "an after_proj")
        head_dim = self._need("control_blocks.0.attn.q_norm" if comfy else "control_blocks.0.attn.norm_q")[0]
        if comfy:
            heads = self._need("control_blocks.0.attn.qkv_proj")[0] // (3 * head_dim)
            ffn = self._need("control_blocks.0.mlp.fc1")[0] // 2
        else:
            heads = self._need("control_blocks.0.attn.to_q")[0] // head_dim
            ffn = self._need("control_blocks.0.ff.net.0.proj")[0] // 2
        time_dim = self._need("control_blocks.0.adaln_proj.linear")[1]
        meta = self.metadata
        form = meta.get("minimax_h3_fun_controlnet")
        if form not in (None, "adaln_basis"):
            raise CheckpointError(f"{self.path}: metadata minimax_h3_fun_controlnet is {form!r}; only "
                                  "'adaln_basis' (pruned AdaLN) is known")
        places = spread(blocks, BASE_LAYERS)
        if "control_blocks_places" in meta:
            try:
                places = json.loads(meta["control_blocks_places"])
                ok = isinstance(places, list) and all(type(p) is int and p >= 0 for p in places)
            except json.JSONDecodeError:
                ok = False
            if not ok or len(places) != blocks:
                raise CheckpointError(f"{self.path}: metadata control_blocks_places {meta['control_blocks_places']!r}"
                                      f" is not a list of {blocks} DiT layers, one per control block")
        fill = meta.get("inpaint_masked_pixel_mode")
        if fill not in (None, "post_norm", "pre_norm"):
            raise CheckpointError(f"{self.path}: metadata inpaint_masked_pixel_mode is {fill!r}; expected post_norm "
                                  "or pre_norm")
        post_norm = fill == "post_norm" if fill is not None else (not comfy and blocks == 10)
        return ControlConfig(hidden, heads, head_dim, ffn, time_dim, tuple(places), curve_form=form == "adaln_basis",
                             post_norm_fill=post_norm)

    def _outputs(self, layer: str, suffix: str) -> list[tuple[str, tuple[int, ...]]]:
        """The tower parameters one stored tensor gives, with their shapes (three for the fused QKV)."""
        target = self.targets[layer]
        shape = self._shape(layer) if suffix == "weight" else tuple(self.source.entry(self.layers[layer][suffix]).shape)
        if target.endswith(".attn.to_qkv"):
            base = target[: -len("to_qkv")]
            return [(f"{base}{p}.{suffix}", (shape[0] // 3, *shape[1:])) for p in ("to_q", "to_k", "to_v")]
        return [(f"{target}.{suffix}", shape)]

    def check(self, dit: DiTConfig | None = None) -> None:
        """Every tensor the tower needs, at its shape, and nothing else; with `dit`, that the tower fits it."""
        if self.unmapped:
            raise CheckpointError(f"{self.path}: {len(self.unmapped)} tensors fit no control tower name, e.g. "
                                  f"{', '.join(self.unmapped[:3])}")
        with torch.device("meta"):
            want = {n: tuple(p.shape) for n, p in ControlTower(self.config, torch.bfloat16).named_parameters()}
        have = {}
        for layer, keys in self.layers.items():
            for suffix in ("weight", "bias"):
                if suffix in keys:
                    have.update(self._outputs(layer, suffix))
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensors of the control tower missing, e.g. "
                                  f"{', '.join(missing[:3])}")
        if extra:
            raise CheckpointError(f"{self.path}: {len(extra)} tensors the control tower has no place for, e.g. "
                                  f"{', '.join(extra[:3])}")
        for name, shape in want.items():
            if tuple(have[name]) != shape:
                raise CheckpointError(f"{self.path}: {name} is {list(have[name])}, the tower built from this file "
                                      f"needs {list(shape)}")
        if dit is not None:
            self.config.check_fits(dit, str(self.path))

    # ----------------------------------------------------------------- reading
    def tensors(self, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", *,
                stored: bool = False) -> Iterator[tuple[str, "torch.Tensor | StoredForm"]]:
        """The tower's tensors by name; a quantized layer dequantized to `dtype` on `device`, or with `stored` as
        a StoredForm of its codes (the tower then dequantizes at use)."""
        device = torch.device(device)
        for layer in sorted(self.layers, key=self._order):
            keys, spec = self.layers[layer], self.specs.get(layer)
            outs = self._outputs(layer, "weight")
            if spec is None:
                yield from self._finish(layer, outs, self.source.get(keys["weight"]))
            elif stored:
                yield from self._stored_forms(layer, spec, outs, device)
            else:
                weight = layer_reading.dequantized(self.source, spec, keys, self._shape(layer), dtype, device, layer)
                yield from self._finish(layer, outs, weight)
            if "bias" in keys:
                yield from self._finish(layer, self._outputs(layer, "bias"), self.source.get(keys["bias"]))

    def _order(self, layer: str) -> tuple[int, str]:
        """On-disk order, so the memory map is read front to back."""
        return self.source.entry(self.layers[layer]["weight"]).begin, layer

    def _finish(self, layer: str, outs, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if len(outs) == 3:
            c = self.config
            for (name, _), part in zip(outs, keymap.split_qkv(tensor, c.num_attention_heads, c.attention_head_dim,
                                                               "stacked")):
                yield name, part
            return
        if self.layout == "comfy" and layer.endswith(".mlp.fc1"):
            tensor = keymap.swap_halves(tensor)
        yield outs[0][0], tensor

    def _stored_forms(self, layer: str, spec: QuantSpec, outs, device) -> Iterator[tuple[str, StoredForm]]:
        rows, cols = self._shape(layer)
        tensors = layer_reading.held(self.source, spec, self.layers[layer], (rows, cols), device, layer)
        group = spec.convrot_groupsize if spec.convrot else None
        if len(outs) == 3:
            shared = FORMATS[spec.format].shared + ("pre_quant_scale",)
            per_row = {s for s, t in tensors.items() if s not in shared and t.ndim >= 1 and t.numel() > 1}
            c = self.config
            parts = {s: keymap.split_qkv(tensors[s][:rows], c.num_attention_heads, c.attention_head_dim, "stacked")
                     for s in per_row}
            for i, (name, _) in enumerate(outs):
                cut = {s: (parts[s][i] if s in parts else t) for s, t in tensors.items()}
                yield name, StoredForm(spec.format, (rows // 3, cols), cut, group, group_size=spec.group_size)
            return
        swap = self.layout == "comfy" and layer.endswith(".mlp.fc1")
        yield outs[0][0], StoredForm(spec.format, (rows, cols), tensors, group, swap_halves=swap,
                                     group_size=spec.group_size)

    def device_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """What the tower holds on its device when loaded in `dtype` (quantized layers as stored, plus the scratch
        their dequantization shares: the largest such weight in `dtype`), from the header alone."""
        total = scratch = 0
        item = torch.empty(0, dtype=dtype).element_size()
        for layer, keys in self.layers.items():
            spec = self.specs.get(layer)
            for suffix, key in keys.items():
                entry = self.source.entry(key) if suffix != "_legacy" else None
                if entry is None or suffix == "comfy_quant":
                    continue
                if spec is not None and suffix != "bias":
                    total += entry.nbytes
                    continue
                fp32 = layer == "control_proj_in" or (self.config.curve_form and layer.endswith("adaln_proj.linear"))
                total += entry.numel * (4 if fp32 else item)
            if spec is not None:
                scratch = max(scratch, math.prod(self._shape(layer)) * item)
        return total + scratch

    def streamed_bytes(self, dtype: torch.dtype = torch.bfloat16, depth: int = 2) -> int:
        """The least the tower holds on its device with every block streamed (engine/memory.plan_tower), from the
        header alone: the weights outside the blocks, the dequantization scratch and `depth` slots of the largest
        block or AdaLN projection, each tensor aligned as streaming packs it."""
        from ...kernels.stored_linear import layer_scratch_bytes
        from ..dit.streaming import ALIGN

        item = torch.empty(0, dtype=dtype).element_size()
        fixed = scratch = 0
        units: dict[tuple[int, bool], int] = {}
        for layer, keys in self.layers.items():
            target = self.targets.get(layer) or ""
            spec = self.specs.get(layer)
            fp32 = layer == "control_proj_in" or (self.config.curve_form and layer.endswith("adaln_proj.linear"))
            parts = target.split(".")
            in_block = parts[0] == "control_blocks" and len(parts) > 1 and parts[1].isdigit()
            # A fused QKV becomes three parameters: its per-row tensors split in three, a stored form's shared
            # scales copied into each (as `tensors` does).
            parts_of = len(self._outputs(layer, "weight"))
            shared = (*FORMATS[spec.format].shared, "pre_quant_scale") if spec is not None else ()
            nbytes = 0
            for suffix, key in keys.items():
                entry = self.source.entry(key) if suffix != "_legacy" else None
                if entry is None or suffix == "comfy_quant":
                    continue
                size = entry.nbytes if spec is not None and suffix != "bias" else entry.numel * (4 if fp32 else item)
                if not in_block:
                    nbytes += size  # only streamed units are packed (each tensor aligned)
                elif parts_of > 1 and (suffix in shared or entry.numel <= 1):
                    nbytes += parts_of * (-(-size // ALIGN) * ALIGN)
                else:
                    nbytes += parts_of * (-(-size // parts_of // ALIGN) * ALIGN)
            if spec is not None:
                scratch = max(scratch, layer_scratch_bytes(*self._shape(layer), dtype, spec.format))
            if in_block:
                unit = (int(parts[1]), ".adaln_proj" in target)
                units[unit] = units.get(unit, 0) + nbytes
            else:
                fixed += nbytes
        return fixed + scratch + depth * max(units.values(), default=0)

    def facts(self) -> dict:
        """What `inspect` says of the file: version, blocks, places, AdaLN form, formats."""
        c = self.config
        formats = sorted({s.label for s in self.specs.values()})
        return {"version": c.version, "blocks": c.blocks, "places": list(c.places), "hidden_size": c.hidden_size,
                "heads": c.num_attention_heads, "head_dim": c.attention_head_dim, "ffn_dim": c.ffn_dim,
                "adaln": "pruned (curve basis)" if c.curve_form else "full", "adaln_input": c.time_embed_dim,
                "inpaint_fill": "mid-gray (post_norm)" if c.post_norm_fill else "black",
                "hint_channels": c.hint_channels, "quantized_layers": len(self.specs),
                "formats": formats or ["bf16/fp32 as stored"],
                "parameters": sum(math.prod(s) for layer in self.layers for _, s in self._outputs(layer, "weight"))
                + sum(math.prod(s) for layer, k in self.layers.items() if "bias" in k
                      for _, s in self._outputs(layer, "bias"))}


def load_tower(path: str | Path, dit: DiTConfig, *, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", stored: bool = True) -> ControlTower:
    """Check the file against the DiT from its header, then build the tower and read its weights (a quantized file
    keeps its codes unless `stored` is off)."""
    with ControlNetFile(path) as f:
        f.check(dit)
        tower = ControlTower(f.config, dtype=dtype, device="meta")
        tower.load_state(f.tensors(dtype, device, stored=stored), device=device, where=str(f.path))
    return tower.eval()


# ================================================================================================ writing
def synthetic_config(dit: DiTConfig, *, union2: bool, comfy: bool, curve_rank: int | None = None) -> ControlConfig:
    """The tower a synthetic file holds for this DiT: 5 blocks (Union 2.0: 10) spread over its layers, at most one per
    layer (the tiny DiT's 2 take 2); ComfyUI's layout with pruned AdaLN reading `curve_rank` basis values."""
    blocks = min(10 if union2 else 5, dit.num_layers)
    places = spread(blocks, dit.num_layers)
    time_dim = (curve_rank or (8 if dit.hidden_size >= 1024 else 4)) if comfy else dit.time_embed_dim
    return ControlConfig(dit.hidden_size, dit.num_attention_heads, dit.attention_head_dim, dit.ffn_dim, time_dim,
                         places, curve_form=comfy, post_norm_fill=union2, norm_eps=dit.norm_eps,
                         qk_norm_eps=dit.qk_norm_eps)


def random_getter(config: ControlConfig, seed: int, device: str = "cpu") -> Callable[[str], torch.Tensor]:
    """Deterministic random tower tensors by name (weights ~ N(0, 1/fan_in), norms ~ 1, biases small), fp32."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in ControlTower(config, torch.float32).named_parameters()}
    order = {n: i for i, n in enumerate(shapes)}

    def get(name: str) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + order[name])
        shape = shapes[name]
        noise = torch.randn(shape, generator=gen, device=device)
        if len(shape) == 1 and name.endswith("weight"):
            return 1.0 + 0.1 * noise
        if name.endswith("bias"):
            return 0.05 * noise
        return noise / math.sqrt(shape[1])

    return get


def _metadata(config: ControlConfig, layout: str) -> dict[str, str]:
    meta = {}
    if layout == "comfy" and config.curve_form:
        meta["minimax_h3_fun_controlnet"] = "adaln_basis"
    # Alibaba PAI's file carries no metadata; a tower placed otherwise than spread over 50 layers must say so.
    if layout == "comfy" or config.places != spread(config.blocks, BASE_LAYERS):
        meta["control_blocks_places"] = json.dumps(list(config.places))
    if config.post_norm_fill and (layout == "comfy" or config.blocks != 10):
        meta["inpaint_masked_pixel_mode"] = "post_norm"
    return meta


def controlnet_groups(config: ControlConfig, get: Callable[[str], torch.Tensor], layout: str,
                      fmt: str = "int8_convrot") -> list[Group]:
    """Writer groups for a ControlNet file of `layout` holding the tower `get` gives (our names, fp32).
    released: bf16, the hint projection fp32. comfy: original names, the block linears (and skip projections) in
    `fmt` (int8_convrot as published, or bf16), norms bf16, a pruned AdaLN projection fp32."""
    from .comfy_layout import _quant_entries, _quantize

    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown ControlNet layout {layout!r}; choose {' or '.join(LAYOUTS)}")
    c = config
    if layout == "released" and c.curve_form:
        raise CheckpointError("Alibaba PAI's layout holds a full-AdaLN tower; a pruned one is ComfyUI's (comfy)")
    groups = [_plain_group(c, "control_proj_in", ["weight", "bias"], get, torch.float32)]
    for i in range(c.blocks):
        p = f"control_blocks.{i}."
        if layout == "released":
            with torch.device("meta"):
                names = [n for n, _ in ControlTower(c, torch.float32).named_parameters() if n.startswith(p)]
            for n in names:
                store = torch.bfloat16
                groups.append(Group([(n, TORCH_TO_ST[store], _shape_of(c, n))], lambda n=n, s=store: {n: get(n).to(s)}))
            continue
        parts = list(_COMFY_PARTS) + (["before_proj"] if i == 0 else []) + ["after_proj"]
        for part in parts:
            layer = p + part
            target = ours_of(layer, "comfy")

            def logical(layer=layer, target=target, part=part):
                if target.endswith(".attn.to_qkv"):
                    base = target[: -len("to_qkv")]
                    return {"weight": torch.cat([get(f"{base}{q}.weight") for q in ("to_q", "to_k", "to_v")])}
                out = {"weight": get(f"{target}.weight")}
                if layer.endswith(".mlp.fc1"):
                    out["weight"] = keymap.swap_halves(out["weight"])
                if part_has_bias(part):
                    out["bias"] = get(f"{target}.bias")
                return out

            shape = _stored_shape(c, part)
            store = torch.float32 if part == "adaln_proj.linear" and c.curve_form else torch.bfloat16
            quantized = fmt != "bf16" and part in _QUANTIZED
            if quantized:
                entries, conf = _quant_entries(layer, fmt, *shape)
            else:
                entries, conf = [(f"{layer}.weight", TORCH_TO_ST[store], shape)], None
            if part_has_bias(part):
                entries.append((f"{layer}.bias", TORCH_TO_ST[store], (shape[0],)))

            def make(layer=layer, logical=logical, quantized=quantized, conf=conf, store=store):
                tensors = logical()
                out = {}
                if quantized:
                    out.update(_quantize(layer, fmt, tensors.pop("weight").float(), conf))
                out.update({f"{layer}.{s}": t.to(store) for s, t in tensors.items()})
                return out

            groups.append(Group(entries, make))
    return groups


def part_has_bias(part: str) -> bool:
    return part in ("adaln_proj.linear",) + _SKIPS


def _shape_of(c: ControlConfig, name: str) -> tuple[int, ...]:
    with torch.device("meta"):
        return tuple(dict(ControlTower(c, torch.float32).named_parameters())[name].shape)


def _stored_shape(c: ControlConfig, part: str) -> tuple[int, ...]:
    inner, hidden = c.num_attention_heads * c.attention_head_dim, c.hidden_size
    return {"norm1": (hidden,), "norm2": (hidden,), "attn.q_norm": (c.attention_head_dim,),
            "attn.k_norm": (c.attention_head_dim,), "attn.qkv_proj": (3 * inner, hidden),
            "attn.out_proj": (hidden, inner), "mlp.fc1": (2 * c.ffn_dim, hidden), "mlp.fc2": (hidden, c.ffn_dim),
            "adaln_proj.linear": (6 * 3 * hidden, c.time_embed_dim), "before_proj": (hidden, hidden),
            "after_proj": (hidden, hidden)}[part]


def _plain_group(config: ControlConfig, layer: str, suffixes: list[str], get, store: torch.dtype) -> Group:
    names = [f"{layer}.{s}" for s in suffixes]
    return Group([(n, TORCH_TO_ST[store], _shape_of(config, n)) for n in names],
                 lambda: {n: get(n).to(store) for n in names})


def write_controlnet(path: str | Path, config: ControlConfig, get: Callable[[str], torch.Tensor], layout: str, *,
                     fmt: str = "int8_convrot", progress=None) -> int:
    """Write a ControlNet file (layout `comfy` or `released`) of the tower `get` gives; returns its size."""
    return write_groups(path, controlnet_groups(config, get, layout, fmt if layout == "comfy" else "bf16"),
                        _metadata(config, layout), progress)
