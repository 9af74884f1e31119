"""Read any H3 DiT checkpoint as a stream of diffusers-named tensors for `H3DiT.load_state`.

One reader covers every layout (diffusers folders and files, ComfyUI files with or without the
`model.diffusion_model.` prefix, pruned curve-form files) and every stored format (bf16/fp16/fp32,
fp8_scaled, NVFP4, int8 / int8_convrot, and GGUF files: ComfyUI's names, each tensor F32/F16/BF16 or GGML
blocks, a layer's format being its weight's block type). It works in two phases:
1. `plan()` from headers only: which diffusers tensor comes from which stored layer, with its
   logical shape, checked against the model the config describes. A wrong or incomplete file fails
   here, in a second, before any weight is read.
2. `tensors(dtype, device)`: layer by layer in on-disk order, read through the memory map, move to
   the target device, dequantize (to the dtype the parameter will have), split the fused QKV, swap
   the fc1 halves, yield.
   RAM holds one layer at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ...errors import CheckpointError
from ...kernels import nvfp4_codec as nvfp4
from ..dit.config import DiTConfig
from . import keymap
from .detect import Detected, detect
from .dit_config import config_from_comfy, config_from_diffusers_shapes, config_from_json
from .gguf_source import GgufSource, GgufSpec, declared, readable
from .gguf_source import dequantize as gguf_dequantize
from ...kernels.formats import FORMATS
from ...kernels.stored_linear import StoredForm
from . import layer_reading
from .quant import LEGACY_MARKER, STORED_PARTS, QuantSpec, split_param
from .source import CheckpointSource
# Stored non-layer tensors by naming: kept (same name in diffusers) or dropped (recomputed by us).
_SINGLES_KEPT = ("adaln_t_table",)
_SINGLES_DROPPED = {"original": ("rope.inv_freq",), "diffusers": ()}
# Stored formats whose codes an FP8 or NVFP4 linear can take as they are (int8 has no linear of its own).
STORED_CODE_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.fast_linears)


@dataclass
class Layer:
    name: str  # stored name without the model prefix
    keys: dict[str, str] = field(default_factory=dict)  # suffix (weight, bias, weight_scale, ...) -> stored key
    spec: QuantSpec | None = None
    target: str | None = None  # diffusers layer name (attn.to_qkv for the fused QKV)


@dataclass(frozen=True)
class Output:
    name: str  # diffusers parameter name
    shape: tuple[int, ...]
    layer: str  # stored layer (or single tensor) it comes from


def expected_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the H3DiT this config builds, with its shape (meta device, no memory)."""
    from ..dit.model import H3DiT

    model = H3DiT(config, dtype=torch.bfloat16, device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def target_dtype(name: str, config: DiTConfig, dtype: torch.dtype) -> torch.dtype:
    from ..dit.model import keeps_fp32

    return torch.float32 if keeps_fp32(name, config) else dtype


class DitReader:
    def __init__(self, source: CheckpointSource, *, qkv_layout: str = "stacked", config: DiTConfig | None = None):
        if qkv_layout not in keymap.QKV_LAYOUTS:
            raise CheckpointError(f"unknown qkv_layout {qkv_layout!r}; choose 'stacked' or 'interleaved'")
        self.source = source
        self.qkv_layout = qkv_layout
        self.gguf = isinstance(source, GgufSource)
        # A GGUF that declares another architecture is judged by its tensors: H3's names and shapes load it
        # (a community repack labels H3's DiT `wan`), with a note saying so; anything else is refused here.
        mislabelled = self.gguf and source.architecture not in (None, "minimax_h3")
        self.note: str | None = None
        try:
            self._open(source, config)
            if mislabelled:
                self.check()
        except CheckpointError as exc:
            if not mislabelled:
                raise
            why = str(exc).removeprefix(f"{source.path}: ")
            raise CheckpointError(f"{source.path}: general.architecture is {declared(source.architecture)}, and its "
                                  f"tensors are not an H3 DiT's ({why}): not an H3 DiT GGUF") from None
        if mislabelled:
            self.note = (f"{source.path.name} declares general.architecture {source.architecture!r} but holds the "
                         "H3 DiT's tensors (every name and shape checked): loaded as the H3 DiT")

    def _open(self, source, config: DiTConfig | None) -> None:
        self.detected: Detected = detect(source.keys, str(source.path))
        if self.detected.model != "dit":
            what = {"video_vae": "video VAE", "audio_vae": "audio VAE", "text_encoder": "text encoder",
                    "controlnet": "H3 Fun ControlNet (give it with --controlnet)"}[self.detected.model]
            raise CheckpointError(f"{source.path}: holds the {what}, not the DiT")
        p = self.detected.prefix
        self.stored = {k[len(p):]: k for k in source.keys if k.startswith(p)}
        # Other components of a full ComfyUI checkpoint (vae., text_encoders.) are not ours to load.
        self.other_components = [k for k in source.keys if not k.startswith(p)]
        self.layers: dict[str, Layer] = {}
        self.singles: list[str] = []
        self.dropped: list[str] = []
        self.ignored: list[str] = []
        self.unmapped: list[str] = []
        self.weightless: dict[str, Layer] = {}  # layers of the model stored without their weight
        self._parts: dict[str, tuple[Layer, int]] | None = None
        self._last_stored: tuple | None = None
        self._group()
        self._declare_quant()
        self.config = config if config is not None else self._read_config()
        self._expected = expected_shapes(self.config)
        self._settle_weightless()

    # ----------------------------------------------------------------- phase 0: names
    def _group(self) -> None:
        names = self.detected.names
        for key in self.stored:
            if key in _SINGLES_KEPT:
                self.singles.append(key)
                continue
            if key in _SINGLES_DROPPED[names] or key == LEGACY_MARKER:
                self.dropped.append(key)
                continue
            split = split_param(key)
            if split is None:
                self.unmapped.append(key)
                continue
            layer, suffix = split
            if names == "original" and keymap.IGNORED_ORIGINAL.match(layer):
                self.ignored.append(key)
                continue
            layer_reading.add_key(self.layers.setdefault(layer, Layer(layer)).keys, suffix, self.stored[key])
        for layer in list(self.layers.values()):
            layer.target = layer.name if names == "diffusers" else keymap.original_layer_to_diffusers(layer.name)
            if layer.target is None:
                self.unmapped.extend(self._stored_names(layer))
                del self.layers[layer.name]
            elif "weight" not in layer.keys:
                # Held apart so check() can say "weight missing" instead of "fits no DiT name".
                self.weightless[layer.name] = self.layers.pop(layer.name)

    def _stored_names(self, layer: Layer) -> list[str]:
        """A layer's stored tensor names without the model prefix."""
        return sorted(k[len(self.detected.prefix):] for s, k in layer.keys.items() if s != "_legacy")

    def _settle_weightless(self) -> None:
        """A weightless layer the model does not have is just unmapped tensors (the model is known only now)."""
        for name, layer in list(self.weightless.items()):
            if all(shape is None for _, shape in self._weight_outputs(layer, "weight")):
                self.unmapped.extend(self._stored_names(layer))
                del self.weightless[name]

    def _declare_quant(self) -> None:
        if self.gguf:
            self._declare_gguf()
            return
        marker = self.stored.get(LEGACY_MARKER)
        specs = layer_reading.declare(self.source, {l.name: l.keys for l in self.layers.values()},
                                      self.detected.prefix, marker, ignore=self._skipped_layer)
        for name, spec in specs.items():
            self.layers[name].spec = spec

    def _declare_gguf(self) -> None:
        """A GGUF layer's format is its weight's GGML type (layer_reading.gguf_specs)."""
        specs = layer_reading.gguf_specs(self.source, {l.name: l.keys for l in self.layers.values()},
                                         list(self.stored.values()), "DiT")
        for name, spec in specs.items():
            self.layers[name].spec = spec

    def _skipped_layer(self, name: str) -> bool:
        """Layers left out on purpose or reported by check(): their metadata entries are no error here."""
        ignored = self.detected.names == "original" and keymap.IGNORED_ORIGINAL.match(name) is not None
        return ignored or name in self.weightless

    def _read_config(self) -> DiTConfig:
        if self.detected.names == "diffusers":
            if self.source.config_path is not None:
                config = config_from_json(self.source.config_path)
                table = self._shape("adaln_t_table")
                if table is not None and config.adaln_curve_grid is None:
                    config = DiTConfig(**{**config.to_dict(), "adaln_curve_grid": table[0], "time_embed_dim": table[1]})
                return config
            return config_from_diffusers_shapes(list(self.stored), self._shape)
        inv = self.stored.get("rope.inv_freq")
        # MiniMaxAI's transformer/ folder (or any config.json beside original-named weights) states the sizes too:
        # they must agree with the tensors.
        return config_from_comfy(list(self.stored), self._shape, self.source.metadata,
                                 (lambda: self.source.read_small(inv)) if inv else None,
                                 declared=getattr(self.source, "config_path", None))

    def _shape(self, name: str) -> tuple[int, ...] | None:
        """Stored shape by prefix-free name; an NVFP4 weight reports its padded logical size."""
        key = self.stored.get(name)
        if key is None:
            return None
        shape = self.source.entry(key).shape
        split = split_param(name)
        if split and split[1] == "weight":
            layer = self.layers.get(split[0])
            if layer is not None and layer.spec is not None and len(shape) == 2:
                shape = (shape[0], shape[1] * FORMATS[layer.spec.format].values_per_column)
        return shape

    # ----------------------------------------------------------------- phase 1: plan
    def _weight_outputs(self, layer: Layer, suffix: str) -> list[tuple[str, tuple[int, ...] | None]]:
        """Diffusers names produced by one stored tensor of a layer, with their expected shapes."""
        target = layer.target
        if target.endswith(".attn.to_qkv"):
            base = target[: -len("to_qkv")]
            return [(f"{base}{p}.{suffix}", self._expected.get(f"{base}{p}.{suffix}")) for p in ("to_q", "to_k", "to_v")]
        name = f"{target}.{suffix}"
        return [(name, self._expected.get(name))]

    def logical_shape(self, layer: Layer, suffix: str) -> tuple[int, ...]:
        """The stored tensor's logical shape (fused for QKV); NVFP4 weights take it from the model."""
        stored = self.source.entry(layer.keys[suffix]).shape
        outs = self._weight_outputs(layer, suffix)
        if suffix == "weight" and layer.spec is not None and FORMATS[layer.spec.format].values_per_column > 1:
            shapes = [s for _, s in outs]
            if any(s is None for s in shapes):
                return (stored[0], stored[1] * FORMATS[layer.spec.format].values_per_column)
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return stored

    def plan(self) -> list[Output]:
        outputs: list[Output] = []
        for layer in self.layers.values():
            for suffix in ("weight", "bias"):
                if suffix not in layer.keys:
                    continue
                shape = self.logical_shape(layer, suffix)
                outs = self._weight_outputs(layer, suffix)
                if len(outs) == 3:
                    if shape[0] % 3:
                        raise CheckpointError(f"{layer.name}.{suffix}: {shape[0]} rows do not split into q, k, v")
                    each = (shape[0] // 3, *shape[1:])
                    outputs.extend(Output(n, each, layer.name) for n, _ in outs)
                else:
                    outputs.append(Output(outs[0][0], tuple(shape), layer.name))
        for single in self.singles:
            outputs.append(Output(single, self.source.entry(self.stored[single]).shape, single))
        return outputs

    def diff(self) -> tuple[list[str], list[str], list[tuple[str, tuple, tuple]]]:
        """(missing, unexpected, wrong shapes) of the plan against the model the config builds."""
        planned = {o.name: o for o in self.plan()}
        unexpected = sorted(set(planned) - set(self._expected))
        missing = sorted(set(self._expected) - set(planned))
        bad = [(n, tuple(o.shape), self._expected[n]) for n, o in planned.items()
               if n in self._expected and tuple(o.shape) != self._expected[n]]
        return missing, unexpected, bad

    def nvfp4_mismatches(self) -> dict[str, str]:
        """NVFP4 layer -> why its stored tensors cannot hold the weight the model needs."""
        out = {}
        for layer in self.layers.values():
            if layer.spec is not None and layer.spec.format == "nvfp4":
                problem = self._nvfp4_mismatch(layer)
                if problem is not None:
                    out[layer.name] = problem
        return out

    def _nvfp4_mismatch(self, layer: Layer) -> str | None:
        # plan() takes an NVFP4 layer's logical shape from the model, so only the packed sizes can disagree.
        if any(shape is None for _, shape in self._weight_outputs(layer, "weight")):
            return None  # not a layer of this model: diff() reports it as unexpected
        lacking = [s for s in ("weight_scale", "weight_scale_2") if s not in layer.keys]
        if lacking:
            return f"NVFP4 layer lacks {', '.join(lacking)}"
        rows, cols = self.logical_shape(layer, "weight")
        return nvfp4.stored_mismatch(self.source.entry(layer.keys["weight"]).shape,
                                     self.source.entry(layer.keys["weight_scale"]).numel, rows, cols)

    def file_name(self, param: str) -> str:
        """A diffusers parameter name followed by the name an original-named file gives it."""
        original = keymap.diffusers_param_to_original(param) if self.detected.names == "original" else None
        return param if original is None else f"{param} (file name: {self.detected.prefix}{original})"

    def check(self) -> None:
        """Verify the plan against the model: names, shapes, nothing missing or left over."""
        where = self.source.path
        if self.unmapped:
            raise CheckpointError(f"{where}: {len(self.unmapped)} tensors fit no DiT name, "
                                  f"e.g. {', '.join(sorted(self.unmapped)[:3])}")
        if self.weightless:
            detail = "; ".join(f"{self.detected.prefix}{n}.weight missing (the file has "
                               f"{', '.join(self._stored_names(l))})" for n, l in sorted(self.weightless.items())[:3])
            raise CheckpointError(f"{where}: {len(self.weightless)} layers have no weight: {detail}")
        missing, unexpected, bad = self.diff()
        if unexpected:
            raise CheckpointError(f"{where}: {len(unexpected)} unexpected tensors for this DiT config, "
                                  f"e.g. {', '.join(map(self.file_name, unexpected[:3]))}")
        if missing:
            raise CheckpointError(f"{where}: {len(missing)} tensors missing, "
                                  f"e.g. {', '.join(map(self.file_name, missing[:3]))}")
        if bad:
            detail = "; ".join(f"{n} is {list(s)}, expected {list(e)}" + self.file_name(n)[len(n):]
                               for n, s, e in bad[:3])
            raise CheckpointError(f"{where}: {len(bad)} tensors have the wrong shape: {detail}")
        mismatched = self.nvfp4_mismatches()
        if mismatched:
            detail = "; ".join(f"{self.detected.prefix}{n}: {why}" for n, why in list(mismatched.items())[:3])
            raise CheckpointError(f"{where}: {len(mismatched)} NVFP4 layers do not fit the model: {detail}")
        unreadable = self.gguf_unreadable()
        if unreadable:
            key, kind = next(iter(unreadable.items()))
            raise CheckpointError(f"{where}: {len(unreadable)} tensors are stored in GGML types that neither "
                                  f"h3-spark's codec nor the gguf package dequantizes, e.g. {key} ({kind})")
        self.check_layers()

    def check_layers(self) -> None:
        """Each quantized layer's stored tensors against its format (dtypes, shapes, scale sizes), as the loader
        checks them when it reads the layer, here from the header alone (GGUF's blocks are checked by type)."""
        if self.gguf:
            return
        for layer in self.layers.values():
            if layer.spec is not None and "weight" in layer.keys and layer.target is not None:
                layer_reading.check_declared(self.source, layer.spec, layer.keys, self.logical_shape(layer, "weight"),
                                             layer.name)

    def gguf_unreadable(self) -> dict[str, str]:
        """GGUF tensor -> its GGML type, for the tensors no dequantizer here reads (none outside GGUF)."""
        if not self.gguf:
            return {}
        entries = (self.source.entry(k) for k in self.stored.values())
        return {e.name: e.dtype for e in entries if e.quantized and not readable(e.dtype)}

    # ----------------------------------------------------------------- phase 2: tensors
    def _order(self) -> list[tuple[str, str]]:
        """(kind, name) in on-disk order: kind 'layer' or 'single'."""
        rank = {k: i for i, k in enumerate(self.source.file_order())}
        items = [("layer", l.name, rank[l.keys["weight"]]) for l in self.layers.values()]
        items += [("single", s, rank[self.stored[s]]) for s in self.singles]
        return [(kind, name) for kind, name, _ in sorted(items, key=lambda x: x[2])]

    def tensors(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                stored: bool = False) -> Iterator[tuple[str, "torch.Tensor | StoredForm"]]:
        """Diffusers-named tensors; quantized layers arrive dequantized on `device`, the others as stored.
        `stored`: a quantized layer's weight arrives as a `StoredForm` instead (its codes and scales on `device`,
        cut to the model's linear; views of the memory-mapped file on the CPU), for a `StoredLinear`."""
        device = torch.device(device)
        for kind, name in self._order():
            if kind == "single":
                yield name, self._read(self.stored[name])
                continue
            yield from self._layer_tensors(self.layers[name], dtype, device, stored)

    def _layer_tensors(self, layer: Layer, dtype: torch.dtype, device: torch.device,
                       stored: bool = False) -> Iterator[tuple[str, "torch.Tensor | StoredForm"]]:
        outs = self._weight_outputs(layer, "weight")
        want = target_dtype(outs[0][0], self.config, dtype)
        if layer.spec is None:
            yield from self._finish(layer, "weight", self._read(layer.keys["weight"]))
        elif isinstance(layer.spec, GgufSpec):
            if stored and self.keeps_codes(layer):
                yield from self._gguf_stored_forms(layer, device)
            else:
                entry = self.source.entry(layer.keys["weight"])
                values = gguf_dequantize(entry, self.source.get(layer.keys["weight"]), want, device)
                yield from self._finish(layer, "weight", values)
        elif stored:
            yield from self._stored_forms(layer, device)
        else:
            yield from self._finish(layer, "weight", self._dequantized(layer, want, device))
        if "bias" in layer.keys:
            yield from self._finish(layer, "bias", self._read(layer.keys["bias"]))

    def _read(self, key: str) -> torch.Tensor:
        """A tensor the model takes as values: as stored, or (a GGUF tensor in GGML blocks: a quantized norm, bias or
        table) dequantized to fp32 on the CPU; the model casts it to its parameter's dtype."""
        if self.gguf:
            entry = self.source.entry(key)
            if entry.quantized:
                return gguf_dequantize(entry, self.source.get(key), torch.float32, "cpu")
        return self.source.get(key)

    def keeps_codes(self, layer: Layer) -> bool:
        """Whether `tensors(stored=True)` hands this quantized layer over as its stored codes. A GGUF layer does when
        it is a 2-D linear weight whose rows are the model's (not ComfyUI-GGUF's reshaped form) in a type the codec
        dequantizes at use; the others are dequantized at load (`gguf_dequantized_at_load`)."""
        return layer_reading.keeps_codes(self.source, layer.spec, layer.keys)

    def gguf_dequantized_at_load(self) -> list[str]:
        """The GGUF layers in GGML blocks that a stored load still dequantizes at load (see keeps_codes)."""
        return [l.name for l in self.layers.values() if isinstance(l.spec, GgufSpec) and not self.keeps_codes(l)]

    def _gguf_stored_forms(self, layer: Layer, device: torch.device) -> Iterator[tuple[str, StoredForm]]:
        """A GGML-block layer as StoredForms of its raw rows, uint8 [N, row_bytes]. A row's blocks are one byte range,
        so q, k and v of the fused (stacked) QKV are row ranges, views of the file; fc1's halves are swapped at use."""
        entry = self.source.entry(layer.keys["weight"])
        rows, cols = entry.shape
        raw = self.source.get(layer.keys["weight"]).to(device)
        outs = self._weight_outputs(layer, "weight")
        if len(outs) == 3:
            c = self.config
            parts = keymap.split_qkv(raw, c.num_attention_heads, c.attention_head_dim, self.qkv_layout)
            for (name, _), part in zip(outs, parts):
                yield name, StoredForm("gguf", (rows // 3, cols), {"weight": part}, gguf_type=entry.gguf_type)
            return
        swap = self.detected.names == "original" and layer.target.endswith(".ff.net.0.proj")
        yield outs[0][0], StoredForm("gguf", (rows, cols), {"weight": raw}, swap_halves=swap,
                                     gguf_type=entry.gguf_type)

    def _stored_forms(self, layer: Layer, device: torch.device) -> Iterator[tuple[str, StoredForm]]:
        """A quantized layer's stored tensors, checked, cut to each model linear it holds (q, k, v of the fused
        QKV: row slices, so views; fc1's halves are swapped at use instead of copied)."""
        spec = layer.spec
        rows, cols = self.logical_shape(layer, "weight")
        tensors = layer_reading.held(self.source, spec, layer.keys, (rows, cols), device, layer.name)
        shared = FORMATS[spec.format].shared + ("pre_quant_scale",)
        per_row = {s for s, t in tensors.items() if s not in shared and t.ndim >= 1 and t.numel() > 1}
        outs = self._weight_outputs(layer, "weight")
        swap = self.detected.names == "original" and layer.target.endswith(".ff.net.0.proj")
        group = spec.convrot_groupsize if spec.convrot else None
        if len(outs) == 3:
            c = self.config
            parts = {s: keymap.split_qkv(tensors[s][:rows], c.num_attention_heads, c.attention_head_dim,
                                         self.qkv_layout) for s in per_row}
            for i, (name, shape) in enumerate(outs):
                cut = {s: (parts[s][i] if s in parts else t) for s, t in tensors.items()}
                yield name, StoredForm(spec.format, (rows // 3, cols), cut, group, group_size=spec.group_size)
            return
        yield outs[0][0], StoredForm(spec.format, (rows, cols), tensors, group, swap_halves=swap,
                                     group_size=spec.group_size)

    def _dequantized(self, layer: Layer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return layer_reading.dequantized(self.source, layer.spec, layer.keys, self.logical_shape(layer, "weight"),
                                         dtype, device, layer.name)

    def _finish(self, layer: Layer, suffix: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        outs = self._weight_outputs(layer, suffix)
        if len(outs) == 3:
            c = self.config
            parts = keymap.split_qkv(tensor, c.num_attention_heads, c.attention_head_dim, self.qkv_layout)
            for (name, _), part in zip(outs, parts):
                yield name, part
            return
        name = outs[0][0]
        if self.detected.names == "original" and layer.target.endswith(".ff.net.0.proj"):
            tensor = keymap.swap_halves(tensor)
        yield name, tensor

    # ----------------------------------------------------------------- stored codes of one linear
    def stored_linear(self, name: str, device: torch.device | str = "cpu"
                      ) -> tuple[QuantSpec, dict[str, torch.Tensor]] | None:
        """The stored quantized tensors behind diffusers linear `name` (e.g. `transformer_blocks.3.attn.to_k`),
        cut to that linear's rows as loading cuts the weight (the fused QKV split, fc1's halves swapped):
        what an FP8 or NVFP4 linear can start from. None when the layer is stored unquantized or as int8, or
        carries an AWQ pre_quant_scale (its codes then encode W / s, not W). The cut runs on `device`
        (re-blocking the NVFP4 scales of a full-size fc1 takes ~0.5 s on a CPU)."""
        if self.stored_code_format(name) is None:
            return None
        layer, part = self._linear_parts()[name]
        spec = layer.spec
        rows = self.logical_shape(layer, "weight")[0]
        held = self._held_tensors(layer, torch.device(device))
        # The row-wise tensors (codes, NVFP4's plain block scales) are cut as loading cuts the weight; the format
        # then gives its codes in the form the fast linears take (NVFP4: padded to 16 rows, scales blocked again).
        cut = {s: self._cut(layer, part, t[:rows].view(torch.uint8)).view(t.dtype) if t.numel() > 1 else t
               for s, t in held.items()}
        codes = FORMATS[spec.format].linear_codes(cut, cut["weight"].shape[0], False)
        return spec, {s: t for s, t in codes.items() if s != "format"}

    def stored_code_format(self, name: str) -> str | None:
        """The stored format (QuantSpec.format) whose codes `stored_linear` would give for linear `name`, from
        the headers alone; None where it gives none."""
        found = self._linear_parts().get(name)
        if found is None:
            return None
        layer = found[0]
        spec = layer.spec
        if spec is None or spec.format not in STORED_CODE_FORMATS or "pre_quant_scale" in layer.keys:
            return None
        return spec.format

    def _held_tensors(self, layer: Layer, device: torch.device) -> dict[str, torch.Tensor]:
        # The last layer read is kept: q, k and v are asked for one after another and share the fused QKV.
        key = (layer.name, device)
        if self._last_stored is None or self._last_stored[0] != key:
            tensors = layer_reading.held(self.source, layer.spec, layer.keys, self.logical_shape(layer, "weight"),
                                         device, layer.name)
            self._last_stored = (key, tensors)
        return self._last_stored[1]

    def _linear_parts(self) -> dict[str, tuple[Layer, int]]:
        """Diffusers linear name -> (stored layer, which of its parts): the fused QKV holds three."""
        if self._parts is None:
            self._parts = {}
            for layer in self.layers.values():
                for i, (param, _) in enumerate(self._weight_outputs(layer, "weight")):
                    self._parts[param[: -len(".weight")]] = (layer, i)
        return self._parts

    def _cut(self, layer: Layer, part: int, rows: torch.Tensor) -> torch.Tensor:
        """Row-wise tensor of a stored layer -> the rows of part `part`, in the model's order."""
        if len(self._weight_outputs(layer, "weight")) == 3:
            c = self.config
            return keymap.split_qkv(rows, c.num_attention_heads, c.attention_head_dim, self.qkv_layout)[part]
        if self.detected.names == "original" and layer.target.endswith(".ff.net.0.proj"):
            return keymap.swap_halves(rows)
        return rows

    # ----------------------------------------------------------------- facts for reports
    def loaded_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the model holds loaded with `stored=True`, from the headers: quantized layers' stored tensors as
        they are, every other tensor in the dtype its parameter gets, plus the dequantization scratch."""
        size = {d: torch.empty(0, dtype=d).element_size() for d in (dtype, torch.float32)}
        total, largest = 0, 0
        for out in self.plan():
            layer = self.layers.get(out.layer)
            if layer is not None and self.keeps_codes(layer) and out.name.endswith(".weight"):
                largest = max(largest, math.prod(out.shape) * size[target_dtype(out.name, self.config, dtype)])
                continue
            total += math.prod(out.shape) * size[target_dtype(out.name, self.config, dtype)]
        for layer in self.layers.values():
            if self.keeps_codes(layer):
                total += sum(self.source.entry(layer.keys[s]).nbytes for s in STORED_PARTS if s in layer.keys)
        return total + largest

    def quantized_layers(self) -> dict[str, QuantSpec]:
        return {l.name: l.spec for l in self.layers.values() if l.spec is not None}

    def logical_param_count(self) -> int:
        return sum(math.prod(s) for s in self._expected.values())
