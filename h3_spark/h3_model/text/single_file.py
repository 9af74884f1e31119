"""A single-file Qwen3-VL text encoder (ComfyUI's safetensors, or a GGUF) read as transformers' tensors.

The file's tensors are grouped per layer under transformers' `Qwen3VLModel` names, cut after the decoder layer
the DiT reads; each layer's format is declared and its weight read by the rules every checkpoint reader shares
(`checkpoint/layer_reading.py`: a legacy scaled-fp8 file means the same here as in a DiT file). A quantized
linear is dequantized at load, or kept as stored (a `StoredForm`, for a StoredLinear that dequantizes it at use
to the same bits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ...errors import CheckpointError
from ...kernels.stored_linear import StoredForm
from ..checkpoint import layer_reading
from ..checkpoint.detect import detect
from ..checkpoint.gguf_source import GgufSource, GgufSpec, declared, text_encoder_names
from ..checkpoint.gguf_source import dequantize as gguf_dequantize
from ..checkpoint.quant import LEGACY_MARKER, QuantSpec, split_param
from ..checkpoint.source import CheckpointSource, open_source

LM_LAYER = re.compile(r"^language_model\.layers\.(\d+)\.")


def target_name(stored: str, layer: int) -> str | None:
    """A stored (prefix-free) tensor name -> transformers' Qwen3VLModel name; None to skip it.

    ComfyUI names the language model `model.*` and the tower `visual.*`; transformers' own export
    names them `model.language_model.*` / `model.visual.*`. Layers past `layer`, the final norm,
    the LM head and rotary tables are not part of the truncated model.
    """
    for old, new in (("model.language_model.", "language_model."), ("model.visual.", "visual."),
                     ("model.", "language_model."), ("visual.", "visual."), ("language_model.", "language_model.")):
        if stored.startswith(old):
            name = new + stored[len(old):]
            break
    else:
        return None if stored.startswith("lm_head.") else stored
    m = LM_LAYER.match(name)
    if name.startswith("language_model.norm.") or name.endswith("inv_freq") or (m and int(m.group(1)) >= layer):
        return None
    return name


@dataclass
class _Layer:
    target: str  # transformers module name
    keys: dict[str, str] = field(default_factory=dict)  # suffix -> stored key
    spec: QuantSpec | None = None


class SingleFile:
    """The tensors of a single-file Qwen3-VL, grouped per layer under transformers' names."""

    def __init__(self, path: Path, layer: int):
        self.path = path
        self.source: CheckpointSource | GgufSource = open_source(path)
        self.gguf = isinstance(self.source, GgufSource)
        arch = self.source.architecture if self.gguf else None
        if arch not in (None, "qwen3vl"):
            raise CheckpointError(f"{path}: general.architecture is {declared(arch)}, not the "
                                  "Qwen3-VL text encoder (which declares qwen3vl or nothing)")
        # ComfyUI-style name -> the file's name: a llama.cpp GGUF's `blk.N.*` names are mapped here.
        names = text_encoder_names(self.source.keys)
        found = detect(list(names), str(path))
        if found.model != "text_encoder":
            raise CheckpointError(f"{path}: is a {found.model.replace('_', ' ')} checkpoint, not the Qwen3-VL "
                                  "text encoder")
        self.prefix = found.prefix
        self.stored = {n[len(self.prefix):]: k for n, k in names.items() if n.startswith(self.prefix)}
        self.num_layers = len({int(m.group(1)) for k in self.stored
                               if (m := LM_LAYER.match(target_name(k, 1 << 30) or ""))})
        self.layers = self._group(layer)
        self._declare_quant()

    def _group(self, layer: int) -> dict[str, _Layer]:
        layers: dict[str, _Layer] = {}
        unmapped = []
        for stored in self.stored:
            if stored == LEGACY_MARKER:
                continue
            split = split_param(stored)
            name = target_name(stored, layer)
            if split is None or name is None:
                if split is None and name is not None:
                    unmapped.append(stored)
                continue
            target = name[: -len(split[1]) - 1]
            layer_reading.add_key(layers.setdefault(split[0], _Layer(target)).keys, split[1], self.stored[stored])
        if unmapped:
            raise CheckpointError(f"{self.path}: {len(unmapped)} tensors fit no Qwen3-VL name, "
                                  f"e.g. {', '.join(sorted(unmapped)[:3])}")
        return layers

    @property
    def has_vision(self) -> bool:
        return any(layer.target.startswith("visual.") for layer in self.layers.values())

    def _declare_quant(self) -> None:
        """Each layer's format from its `.comfy_quant` marker, header metadata or the legacy fp8 form; in a GGUF,
        from its weight's GGML type. Layers past the cut are not read, so their declarations are not checked."""
        for stored, layer in self.layers.items():
            if "weight" not in layer.keys and "bias" not in layer.keys:
                keys = sorted(s for s in layer.keys if s != "_legacy")
                raise CheckpointError(f"{self.path}: {stored} has {', '.join(keys)} but no weight")
        keys = {stored: layer.keys for stored, layer in self.layers.items()}
        if self.gguf:
            specs = layer_reading.gguf_specs(self.source, keys, [k for ks in keys.values() for k in ks.values()],
                                             "text encoder")
        else:
            marker = layer_reading.marker_key(self.source, self.stored)
            specs = layer_reading.declare(self.source, keys, self.prefix, marker,
                                          ignore=lambda name: name not in self.layers)
        for stored, spec in specs.items():
            self.layers[stored].spec = spec

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Names and plain shapes against the model, from headers alone (before any weight is read)."""
        planned = {f"{layer.target}.{s}": (stored, layer) for stored, layer in self.layers.items()
                   for s in ("weight", "bias") if s in layer.keys}
        unexpected = sorted(set(planned) - set(shapes))
        if unexpected:
            raise CheckpointError(f"{self.path}: {unexpected[0]} is not a parameter of this Qwen3-VL"
                                  + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
        missing = sorted(set(shapes) - set(planned))
        if missing:
            raise CheckpointError(f"{self.path}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")
        for name, (stored, layer) in planned.items():
            suffix = name.rpartition(".")[2]
            got = tuple(self.source.entry(layer.keys[suffix]).shape)
            # A GGUF entry's shape is the logical one even for GGML blocks; other quantized weights are checked
            # against their format when read.
            logical = layer.spec is None or suffix == "bias" or isinstance(layer.spec, GgufSpec)
            if logical and got != shapes[name]:
                raise CheckpointError(f"{self.path}: {stored}.{suffix} is {list(got)}, the model needs "
                                      f"{list(shapes[name])}")

    def shape(self, target: str) -> tuple[int, ...] | None:
        """The stored shape of a tensor by its transformers name (quantized layers: the stored one)."""
        for layer in self.layers.values():
            base, _, suffix = target.rpartition(".")
            if layer.target == base and suffix in layer.keys:
                return tuple(self.source.entry(layer.keys[suffix]).shape)
        return None

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return len({m.group(1) for layer in self.layers.values() if (m := rx.match(layer.target))})

    def tensors(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                keep_stored: bool = False) -> Iterator[tuple[str, "torch.Tensor | StoredForm"]]:
        """(name, tensor in dtype on device) layer by layer, in on-disk order; one layer in RAM at a time.
        `keep_stored`: a quantized layer's weight comes as its StoredForm (codes and scales on `device`)."""
        rank = {k: i for i, k in enumerate(self.source.file_order())}
        ordered = sorted(self.layers.items(), key=lambda kv: min(rank[k] for k in kv[1].keys.values()))
        for stored, layer in ordered:
            # Only linears compute from a StoredLinear; a quantized embedding (the NVFP4-AWQ file's int8
            # embed_tokens) is dequantized at load, as before.
            if "weight" in layer.keys and keep_stored and self._keeps_codes(layer, shapes):
                yield f"{layer.target}.weight", self._stored_form(stored, layer, shapes, device)
            elif "weight" in layer.keys:
                yield f"{layer.target}.weight", self._weight(stored, layer, shapes, dtype, device)
            if "bias" in layer.keys:
                yield f"{layer.target}.bias", self._read(layer.keys["bias"]).to(device, dtype)

    def _keeps_codes(self, layer: _Layer, shapes: dict[str, tuple[int, ...]]) -> bool:
        """A quantized linear kept as stored: a GGUF one in a type the codec dequantizes at use, rows as the model's."""
        return self._is_linear(layer, shapes) and layer_reading.keeps_codes(self.source, layer.spec, layer.keys)

    def _read(self, key: str) -> torch.Tensor:
        """A tensor as values: as stored, or (a GGUF tensor in GGML blocks) dequantized to fp32 on the CPU."""
        entry = self.source.entry(key)
        if self.gguf and entry.quantized:
            return gguf_dequantize(entry, self.source.get(key), torch.float32, "cpu")
        return self.source.get(key)

    def _model_shape(self, stored: str, layer: _Layer, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        shape = shapes.get(f"{layer.target}.weight")
        if shape is None:
            raise CheckpointError(f"{self.path}: {stored} is not a layer of this Qwen3-VL")
        return shape

    def _weight(self, stored: str, layer: _Layer, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        if layer.spec is None:
            return self._read(layer.keys["weight"]).to(device, dtype)
        shape = self._model_shape(stored, layer, shapes)
        if isinstance(layer.spec, GgufSpec):
            entry = self.source.entry(layer.keys["weight"])
            return gguf_dequantize(entry, self.source.get(layer.keys["weight"]), dtype, device)
        # Dequantize where the weight will live: NVFP4 unpacking of a 32B model is slow on a CPU.
        return layer_reading.dequantized(self.source, layer.spec, layer.keys, shape, dtype, device, stored)

    @staticmethod
    def _is_linear(layer: _Layer, shapes: dict[str, tuple[int, ...]]) -> bool:
        return not layer.target.endswith(("embed_tokens", "pos_embed")) and len(shapes.get(f"{layer.target}.weight",
                                                                                           ())) == 2

    def _stored_form(self, stored: str, layer: _Layer, shapes: dict[str, tuple[int, ...]],
                     device: torch.device) -> StoredForm:
        shape = self._model_shape(stored, layer, shapes)
        if isinstance(layer.spec, GgufSpec):
            # The raw blocks, uint8 [N, row_bytes], a view of the file on the CPU.
            raw = self.source.get(layer.keys["weight"]).to(device)
            return StoredForm("gguf", shape, {"weight": raw}, gguf_type=layer.spec.gguf_type)
        held = layer_reading.held(self.source, layer.spec, layer.keys, shape, device, stored)
        return StoredForm(layer.spec.format, shape, held, layer.spec.params.convrot_group,
                          group_size=layer.spec.group_size)
