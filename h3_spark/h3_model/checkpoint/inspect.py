"""What is in a checkpoint, from its headers: layout, formats, shapes, scales, completeness; and whether the loader
takes it (`loader_check`: the same check the engine runs on the files before reading any weight).

Reads safetensors headers and metadata only; the only tensor bytes touched are `.comfy_quant`
markers, scalar scales and the 16-value RoPE buffer, so it takes a second on a 60 GB file.
A GGUF file reports the same, plus its version, `general.architecture` and every tensor's GGML type,
shape and bytes (a layer's format is its weight's type; a llama.cpp text encoder's names are mapped first).
A LoRA file reports its key style, targets, ranks, AdaLN adapters and alpha (lora.lora_facts). What only the
file name says (partition, FastH3 V2 or OmniRef, a Turbo LoRA's steps: published.py) is reported apart, as the
name's, with what the tensors cannot tell.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from ...errors import CheckpointError
from .detect import Detected, detect
from .dit_reader import DitReader
from .gguf_source import GgufSource, GgufSpec, gguf_module, gguf_spec, readable, text_encoder_names
from .lora import is_lora_file, lora_facts
from .published import describe, name_facts
from ...kernels.formats import FORMATS
from ...kernels.formats import asym_w4a8_int8 as w4a8
from .quant import LEGACY_MARKER, QUANT_SUFFIXES, QuantSpec, declare_layers, split_param
from .safetensors_header import DTYPES
from .source import CheckpointSource, open_source

_LEGACY_RENAME = {"scale_weight": "weight_scale", "scale_input": "input_scale"}
_META_PREVIEW = 300


def inspect_checkpoint(path: str | Path, *, partition: str | None = None, qkv_layout: str = "auto") -> dict:
    source = open_source(path, partition=partition)
    try:
        gguf = isinstance(source, GgufSource)
        # A llama.cpp text GGUF's `blk.N.*` names, in ComfyUI's naming (the identity for every other file).
        names = text_encoder_names(source.keys) if gguf else {k: k for k in source.keys}
        if not gguf and is_lora_file(names):
            return _lora(source)
        detected = detect(list(names), str(source.path))
        report = _common(source, detected)
        if gguf:
            report["gguf"] = _gguf_facts(source)
        if detected.model == "dit":
            report.update(_dit(source, detected, qkv_layout))
            report.update(_name_report(source.path, "dit", report["fasth3"]))
        elif detected.model == "controlnet":
            report.update(_controlnet(source.path))
        elif gguf:
            report.update(_gguf_text_encoder(source, detected, names))
        else:
            report.update(_other(source, detected))
    finally:
        source.close()
    report["loader_check"] = loader_check(path, detected.model, partition, qkv_layout)
    report["complete"] = report["complete"] and report["loader_check"]["passed"] is not False
    return report


# What the engine runs on each component's files before any weight is read (engine/file_checks.py), by model.
_LOADER_CHECKS = {"dit": "DitReader.check", "video_vae": "check_video_vae", "audio_vae": "check_audio_vae",
                  "text_encoder": "check_text_encoder"}


def loader_check(path: str | Path, model: str, partition: str | None, qkv_layout: str) -> dict:
    """The loader's own check of these files (the one `generate` and `serve` run before reading weights, which the
    weight read repeats): {check, passed, error}. The header report above can pass a file this refuses (a config
    that contradicts its tensors, a layer's scales of the wrong size for its format); `complete` needs both."""
    from ...errors import H3Error

    name = _LOADER_CHECKS.get(model)
    if name is None:
        return {"check": None, "passed": None, "skipped": f"no loader reads a {model} here"}
    try:
        if model == "dit":
            from . import open_dit

            reader = open_dit(path, partition=partition, qkv_layout=qkv_layout)
            try:
                reader.check()
            finally:
                reader.source.close()
        elif model == "video_vae":
            from ..vae.loading import check_video_vae

            check_video_vae(path)
        elif model == "audio_vae":
            from ..vae.loading import check_audio_vae

            check_audio_vae(path)
        else:
            if Path(path).is_file():  # its tokenizer comes from elsewhere (--tokenizer), which inspect is not given
                return {"check": name, "passed": None,
                        "skipped": "a single-file text encoder: the loader's check needs its tokenizer too"}
            from ..text.encoder import check_text_encoder

            # The layer a prompt is read from is a generation's flag (--text-encoder-layer, checked there against
            # the file's depth); here the files, configs and tokenizer are, from the first layer on.
            check_text_encoder(path, layer=1)
    except H3Error as exc:
        return {"check": name, "passed": False, "error": str(exc)}
    return {"check": name, "passed": True}


# ------------------------------------------------------------------------------- shared
def _common(source: CheckpointSource, detected: Detected) -> dict:
    hist: dict[str, dict[str, int]] = {}
    for h in source.headers:
        for e in h.tensors.values():
            slot = hist.setdefault(e.dtype, {"tensors": 0, "bytes": 0})
            slot["tensors"] += 1
            slot["bytes"] += e.nbytes
    metadata = {k: (v if len(v) <= _META_PREVIEW else v[:_META_PREVIEW] + f"... ({len(v)} chars)")
                for k, v in source.metadata.items()}
    return {
        "path": str(source.path),
        "files": [{"name": h.path.name, "bytes": h.file_size, "header_bytes": h.header_size,
                   "tensors": len(h.tensors)} for h in source.headers],
        "model": detected.model,
        "layout": detected.layout,
        "prefix": detected.prefix,
        "tensors": len(source.keys),
        "bytes": source.total_bytes,
        "dtype_histogram": dict(sorted(hist.items())),
        "metadata": metadata,
    }


def _scale_layout(spec: QuantSpec, suffix: str, shape: tuple[int, ...], n: int) -> str:
    if suffix == "weight_scale" and spec.format == "nvfp4":
        return "nvfp4 block scales, 1 per 16 inputs, cuBLAS 128x4 blocked (swizzled)"
    if suffix == "weight_scale" and spec.format == "int8_tensorwise":
        return "per-row" if math.prod(shape) == n and n > 1 else "per-tensor"
    if suffix in ("weight_s_channel", "weight_scale") and spec.format in ("asym_w4a8_int8", "convrot_w4a4"):
        return "per-row"
    if suffix == "weight_s_rel":
        return f"per group of {spec.group_size} inputs, relative to the row's scale"
    if suffix == "weight_codebook":
        return "the 16 levels a 4-bit code decodes to (x the group's scale)"
    if suffix == "weight_correction":
        return f"per group of {spec.group_size} inputs, [groups, rows], added after the row scale (asymmetric)"
    if suffix == "pre_quant_scale":
        return "per-input-channel (AWQ smoothing, multiplies the input)"
    if suffix == "input_scale":
        return "per-tensor static activation scale (used only by low-precision activation GEMMs)"
    return "per-tensor"


def _quant_layer(source: CheckpointSource, name: str, keys: dict[str, str], spec: QuantSpec,
                 logical: tuple[int, ...] | None) -> dict:
    w = source.entry(keys["weight"])
    info: dict = {"format": spec.label, "declared_by": spec.source,
                  "stored": {"dtype": w.dtype, "shape": list(w.shape)}}
    if spec.format == "nvfp4":
        info["nibble_order"] = "even element in the high nibble (comfy-kitchen hi_first)"
        if logical is None:
            info["logical_shape_padded"] = [w.shape[0], w.shape[1] * 2]
        else:
            info["logical_shape"] = list(logical)
    else:
        per_column = FORMATS[spec.format].values_per_column
        info["logical_shape"] = list(logical) if logical is not None else [w.shape[0], w.shape[1] * per_column]
    if spec.format in ("convrot_w4a4", "asym_w4a8_int8"):
        info["nibble_order"] = "even element in the low nibble"
    if spec.format == "asym_w4a8_int8":
        info["variant"] = w4a8.variant(keys)
        info["group_size"] = spec.group_size
    if spec.convrot:
        info["convrot_groupsize"] = spec.convrot_groupsize
    if spec.full_precision_mm:
        info["full_precision_matrix_mult"] = True
    scales = []
    rows = (logical or w.shape)[0]
    for suffix in ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "weight_s_rel",
                   "weight_s_channel", "weight_codebook", "weight_correction"):
        if suffix not in keys:
            continue
        e = source.entry(keys[suffix])
        entry = {"name": suffix, "dtype": e.dtype, "shape": list(e.shape),
                 "layout": "global (fp32 decode multiplier)" if suffix == "weight_scale_2"
                 else _scale_layout(spec, suffix, e.shape, rows)}
        if e.numel == 1 and DTYPES[e.dtype][0] is not None:
            entry["value"] = float(source.read_small(keys[suffix]).float().reshape(()))
        scales.append(entry)
    info["scales"] = scales
    return info


def _controlnet(path: Path) -> dict:
    """An H3 Fun ControlNet: its version, blocks and the DiT layers they follow, AdaLN form and formats; a file that
    fails its header check says why instead of `complete`."""
    from .controlnet import ControlNetFile

    with ControlNetFile(path) as f:
        facts = f.facts()
        try:
            f.check()
            problem = None
        except CheckpointError as exc:
            problem = str(exc)
        return {"controlnet": facts, "logical_parameters": facts["parameters"],
                "quantization": _quant_summary(f.specs, len(f.layers)), "complete": problem is None,
                **({"problem": problem} if problem else {})}


def _quant_summary(specs: dict[str, QuantSpec], total_layers: int) -> dict:
    counts = Counter(s.label for s in specs.values())
    return {"formats": dict(sorted(counts.items())), "unquantized_layers": total_layers - len(specs),
            "declared_by": sorted({s.source for s in specs.values()})}


def _plain_format(dtype: str) -> str:
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8_e4m3 (unscaled)",
            "F8_E5M2": "fp8_e5m2 (unscaled)"}.get(dtype, dtype.lower())


def _gguf_facts(source: GgufSource) -> dict:
    h = source.header
    tensors = {}
    for name in source.file_order():
        e = source.entry(name)
        info = {"type": e.dtype, "shape": list(e.shape), "bytes": e.nbytes}
        if e.reshaped:
            info["stored_shape"] = list(e.stored_shape)  # ComfyUI-GGUF's comfy.gguf.orig_shape form
        tensors[name] = info
    return {"version": h.version, "alignment": h.alignment,
            "architecture": h.architecture or "(not declared)", "tensor_types": source.type_counts(),
            "tensors": tensors}


def _gguf_layer(entry, spec: GgufSpec, kept: bool | None) -> dict:
    """A layer stored in GGML blocks: its type, geometry and what a stored load makes of it."""
    gguf = gguf_module()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[entry.dtype]]
    info = {"format": spec.label, "declared_by": spec.source, "logical_shape": list(entry.shape),
            "stored": {"type": entry.dtype, "bytes": entry.nbytes, "row_bytes": entry.row_bytes,
                       "block": {"values": block, "bytes": size}},
            "bits_per_weight": round(8 * entry.nbytes / max(entry.numel, 1), 4)}
    if entry.reshaped:
        info["stored"]["shape"] = list(entry.stored_shape)
    if kept is not None:
        info["loaded_as"] = "GGML blocks, dequantized at use (StoredLinear)" if kept else "dequantized at load"
    return info


# ------------------------------------------------------------------------------- DiT
def _dit(source: CheckpointSource, detected: Detected, qkv_layout: str) -> dict:
    from . import resolve_qkv_layout

    qkv_layout = resolve_qkv_layout(source, qkv_layout)
    reader = DitReader(source, qkv_layout=qkv_layout)
    c = reader.config
    layers = {}
    specs = reader.quantized_layers()
    mismatched = reader.nvfp4_mismatches()
    for layer in reader.layers.values():
        if isinstance(layer.spec, GgufSpec):
            info = _gguf_layer(source.entry(layer.keys["weight"]), layer.spec, reader.keeps_codes(layer))
        elif layer.spec is not None:
            logical = tuple(reader.logical_shape(layer, "weight"))
            info = _quant_layer(source, layer.name, layer.keys, layer.spec, logical)
            if layer.spec.format == "nvfp4":
                info["packed_shapes_consistent"] = layer.name not in mismatched
        else:
            e = source.entry(layer.keys["weight"])
            info = {"format": _plain_format(e.dtype), "shape": list(e.shape)}
        info["maps_to"] = layer.target if not layer.target.endswith("to_qkv") else \
            layer.target[: -len("to_qkv")] + "to_{q,k,v}"
        layers[layer.name] = info
    missing, unexpected, bad = reader.diff()
    plan = reader.plan()
    out = {
        "config": c.to_dict(),
        # FastVideo's distilled students carry a VSA gate per block (the fasth3 recipe runs them).
        "fasth3": bool(c.gate_compress),
        "qkv_layout_assumed": qkv_layout if detected.names == "original" else None,
        "curve_form": c.curve_form,
        "logical_parameters": sum(math.prod(o.shape) for o in plan),
        "model_parameters": reader.logical_param_count(),
        "quantization": _quant_summary(specs, len(reader.layers)),
        "layers": layers,
        "unmapped": sorted(reader.unmapped),
        "missing": missing,
        "unexpected": unexpected,
        "wrong_shapes": [{"name": n, "shape": list(s), "expected": list(e)} for n, s, e in bad],
        "weight_missing": sorted(reader.weightless),
        "nvfp4_mismatches": mismatched,
        "ignored": sorted(reader.ignored),
        "dropped": sorted(reader.dropped),
        "other_components": len(reader.other_components),
    }
    unreadable = reader.gguf_unreadable()
    if reader.gguf:
        out["gguf_dequantized_at_load"] = reader.gguf_dequantized_at_load()
        out["gguf_unreadable"] = unreadable
    if c.curve_form:
        e = source.entry(reader.stored["adaln_t_table"])
        out["curve_table"] = {"shape": list(e.shape), "dtype": e.dtype,
                              "interpolation": "pos = clamp(t, 0, 1) * (grid - 1); linear between rows "
                                               "floor(pos) (at most grid - 2) and the next"}
    out["complete"] = not (missing or unexpected or bad or reader.unmapped or reader.weightless or mismatched
                           or unreadable)
    return out


# ------------------------------------------------------------------------------- what only the name says
def _name_report(path: Path, model: str, fasth3: bool = False) -> dict:
    """The file name's facts (published.py), and what the tensors cannot tell for this kind of file."""
    untold = {"dit": ["the t2va/fl2va partition from the ref2va one (one architecture)"],
              "lora": ["what the LoRA was trained for (a Turbo LoRA is an ordinary LoRA of these targets)",
                       "which partition it was trained on"]}[model]
    if fasth3:
        untold.append("FastH3 V2 from FastH3 OmniRef (both FastH3 DiTs of one architecture)")
    return {"name_says": name_facts(path), "tensors_cannot_tell": untold}


def _lora(source: CheckpointSource) -> dict:
    facts = lora_facts(source.keys, lambda k: source.entry(k).shape, source.metadata)
    prefixes = [p for p in facts["prefixes"] if p]
    report = _common(source, Detected("lora", ", ".join(facts["names"]), ", ".join(prefixes)))
    report.update(facts)
    report.update(_name_report(source.path, "lora"))
    report["complete"] = not (facts["half_pairs"] or facts["unread"])
    return report


# ------------------------------------------------------------------------------- other models
def _group_layers(keys: list[str]) -> tuple[dict[str, dict[str, str]], list[str]]:
    layers: dict[str, dict[str, str]] = {}
    singles = []
    for key in keys:
        split = split_param(key)
        if split is None:
            singles.append(key)
            continue
        layer, suffix = split
        slot = layers.setdefault(layer, {})
        slot[_LEGACY_RENAME.get(suffix, suffix)] = key
        if suffix in _LEGACY_RENAME:
            slot.setdefault("_legacy", key)
    return layers, singles


def _other(source: CheckpointSource, detected: Detected) -> dict:
    p = detected.prefix
    own = [k for k in source.keys if k.startswith(p)]
    stripped = [k[len(p):] for k in own]
    layers, _ = _group_layers(stripped)
    full = {n: {s: p + k for s, k in keys.items()} for n, keys in layers.items()}
    marker = p + LEGACY_MARKER if p + LEGACY_MARKER in source else None
    specs = declare_layers(full, source.read_small, source.metadata, p, marker,
                           source.entry(marker).numel if marker else 0)
    aux = {p + f"{n}.{s}" for n, keys in layers.items() for s in keys if s in QUANT_SUFFIXES}
    params = 0
    for k in own:
        if k in aux or k.endswith("." + LEGACY_MARKER) or k == marker:
            continue
        e = source.entry(k)
        split = split_param(k[len(p):])
        if split and split[1] == "weight" and split[0] in specs:
            params += e.numel * FORMATS[specs[split[0]].format].values_per_column
        else:
            params += e.numel
    quant_layers = {n: _quant_layer(source, n, full[n], s, None) for n, s in specs.items()}
    check = {"video_vae": _video_vae_missing, "audio_vae": _audio_vae_missing,
             "text_encoder": _text_encoder_missing}[detected.model]
    missing, facts = check(set(stripped))
    refused = None
    if detected.model == "video_vae" and specs:
        facts, refused = _video_vae_loadable(source, facts)
    return {
        "logical_parameters": params,
        "quantization": _quant_summary(specs, len(layers)),
        "layers": quant_layers,
        "missing": missing,
        "structure": facts,
        "other_components": len(source.keys) - len(own),
        "complete": not missing and refused is None,
    }


def _video_vae_loadable(source: CheckpointSource, facts: dict) -> tuple[dict, str | None]:
    """For a video VAE with quantized layers, the loader's own header checks (names, shapes, which layers may be
    quantized and how): what its weights are, or the one line it refuses the file with."""
    from ..vae.loading import video_identity

    if facts.get("encoder_tensors", 0) == 0:
        return facts, None  # already incomplete; the loader would only repeat it
    try:
        identity = video_identity(source.path)
    except CheckpointError as exc:
        return {**facts, "loader_refuses": str(exc)}, str(exc)
    return {**facts, "weights": identity.weights}, None


def _gguf_text_encoder(source: GgufSource, detected: Detected, names: dict[str, str]) -> dict:
    """A GGUF Qwen3-VL: layers and formats from the tensor types, completeness under ComfyUI's names."""
    p = detected.prefix
    own = {n[len(p):]: k for n, k in names.items() if n.startswith(p)}
    layers, _ = _group_layers(list(own))
    quant_layers, unreadable = {}, {}
    for layer, keys in layers.items():
        entry = source.entry(own[keys["weight"]]) if "weight" in keys else None
        if entry is not None and entry.quantized:
            quant_layers[layer] = _gguf_layer(entry, gguf_spec(entry), None)
            if not readable(entry.dtype):
                unreadable[entry.name] = entry.dtype
    missing, facts = _text_encoder_missing(set(own))
    vision = facts["vision_tensors"] > 0
    facts["vision_tower"] = vision
    if not vision:
        facts["vision_note"] = ("no vision tower (llama.cpp keeps it in a separate mmproj file): T2VA prompts "
                                "encode, Ref2VA image / video references and FL2VA keyframes do not")
    if any(k != n for n, k in names.items()):
        facts["names"] = "llama.cpp (blk.N.*), read as ComfyUI's model.layers.N.*"
    counts: dict[str, int] = {}
    for info in quant_layers.values():
        counts[info["format"]] = counts.get(info["format"], 0) + 1
    return {
        "logical_parameters": sum(source.entry(k).numel for k in own.values()),
        "quantization": {"formats": dict(sorted(counts.items())), "unquantized_layers": len(layers) - len(quant_layers),
                         "declared_by": ["gguf tensor type"] if quant_layers else []},
        "layers": quant_layers,
        "missing": missing,
        "gguf_unreadable": unreadable,
        "structure": facts,
        "other_components": len(source.keys) - len(own),
        "complete": not missing and not unreadable,
    }


def _indices(keys: set[str], pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return sorted({int(m.group(1)) for k in keys if (m := rx.match(k))})


def _gaps(found: list[int], what: str) -> list[str]:
    if not found:
        return [f"{what} 0"]
    return [f"{what} {i}" for i in range(found[-1] + 1) if i not in set(found)]


def _has_conv(keys: set[str], name: str) -> bool:
    # ComfyUI may store weight-normed convs folded (`weight`) or split (`weight_g` + `weight_v`).
    return f"{name}.weight" in keys or {f"{name}.weight_g", f"{name}.weight_v"} <= keys


def _video_vae_missing(keys: set[str]) -> tuple[list[str], dict]:
    comfy_encoder = any(k.startswith("encoder.down.") for k in keys)
    if comfy_encoder:
        from ..vae.loading import comfy_video_names_to_diffusers

        # ComfyUI renames the decoder too (x_embedder, fused to_qkv, ff.w1/w2): check under diffusers names.
        keys = comfy_video_names_to_diffusers(keys)
    required = ["decoder.register_tokens", "decoder.proj_in.weight", "decoder.proj_in.bias", "decoder.norm_out.weight",
                "decoder.norm_out.bias", "decoder.proj_out.weight", "decoder.proj_out.bias", "quant_conv.weight",
                "quant_conv.bias", "post_quant_conv.weight", "post_quant_conv.bias"]
    missing = [k for k in required if k not in keys]
    blocks = _indices(keys, r"^decoder\.transformer_blocks\.(\d+)\.")
    missing += _gaps(blocks, "decoder.transformer_blocks")
    per_block = ["scale1", "scale2", "norm1.weight", "norm2.weight", "ff.net.0.proj.weight", "ff.net.0.proj.bias",
                 "ff.net.2.weight", "ff.net.2.bias"] + [f"attn.{p}.{s}" for p in ("to_q", "to_k", "to_v", "to_out.0")
                                                        for s in ("weight", "bias")]
    for i in blocks:
        missing += [f"decoder.transformer_blocks.{i}.{s}" for s in per_block
                    if f"decoder.transformer_blocks.{i}.{s}" not in keys]
    if not comfy_encoder:
        missing += [k for k in ("encoder.conv_in.weight", "encoder.conv_out.weight", "encoder.norm_out.weight")
                    if k not in keys]
    encoder = [k for k in keys if k.startswith("encoder.")]
    if not encoder:
        missing.append("encoder.*")
    return missing, {"decoder_blocks": len(blocks), "encoder_tensors": len(encoder),
                     "encoder_names": "comfy (encoder.down.L.block.J)" if comfy_encoder
                     else "diffusers (encoder.down_blocks.I.resnets.J)"}


def _audio_vae_missing(keys: set[str]) -> tuple[list[str], dict]:
    required = ["pre_block.attn.qkv.weight", "pre_block.attn.q_bias", "pre_block.attn.v_bias",
                "pre_block.attn.zero_k_bias", "pre_block.attn.proj.weight", "pre_block.attn.proj.bias",
                "pre_block.proj.weight", "pre_block.proj.bias"]
    required += [f"pre_block.{n}.{s}" for n in ("norm1", "norm2", "norm3", "mlp.norm", "mlp.w0", "mlp.w1", "mlp.w2")
                 for s in ("weight", "bias")]
    required += [f"{n}.{s}" for n in ("mean_proj", "logs_proj", "dec_in_proj") for s in ("weight", "bias")]
    required += ["decoder.conv_pre.bias", "decoder.activation_post.act.alpha", "decoder.activation_post.act.beta"]
    missing = [k for k in required if k not in keys]
    missing += [f"{n}.weight" for n in ("decoder.conv_pre", "decoder.conv_post") if not _has_conv(keys, n)]
    enc = _indices(keys, r"^encoder\.block\.(\d+)\.")
    ups = _indices(keys, r"^decoder\.ups\.(\d+)\.")
    res = _indices(keys, r"^decoder\.resblocks\.(\d+)\.")
    missing += _gaps(enc, "encoder.block") + _gaps(ups, "decoder.ups") + _gaps(res, "decoder.resblocks")
    folded = "decoder.conv_pre.weight" in keys
    return missing, {"encoder_blocks": len(enc), "decoder_upsamples": len(ups), "decoder_resblocks": len(res),
                     "weight_norm": "folded" if folded else "split (weight_g, weight_v)"}


_TE_LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight")


def _text_encoder_missing(keys: set[str]) -> tuple[list[str], dict]:
    layer_keys = [k for k in keys if re.search(r"(^|\.)layers\.\d+\.self_attn\.q_norm\.weight$", k)]
    lm = min((k.split("layers.")[0] for k in layer_keys), key=len)
    layers = _indices(keys, rf"^{re.escape(lm)}layers\.(\d+)\.")
    missing = _gaps(layers, f"{lm}layers")
    for i in layers:
        missing += [f"{lm}layers.{i}.{s}" for s in _TE_LAYER_KEYS
                    if f"{lm}layers.{i}.{s}" not in keys]
    if not any(k.endswith("embed_tokens.weight") for k in keys):
        missing.append(f"{lm}embed_tokens.weight")
    vision = [k for k in keys if ".visual." in f".{k}" or k.startswith("visual.")]
    return missing, {"language_layers": len(layers), "language_prefix": lm, "vision_tensors": len(vision),
                     "note": "ComfyUI's H3 text encoder keeps 50 layers (hidden state after layer 50)"}


def summary_lines(report: dict) -> list[str]:
    """A compact human summary of an inspect report."""
    gib = report["bytes"] / 2 ** 30
    lines = [f"{report['path']}: {report['model'].replace('_', ' ')}, layout {report['layout']}"
             + (f" (prefix {report['prefix']!r})" if report["prefix"] else "")
             + f", {report['tensors']} tensors in {len(report['files'])} file(s), {gib:.2f} GiB"]
    if report["model"] == "dit":
        c = report["config"]
        shape = (f"  {c['num_layers']} blocks, hidden {c['hidden_size']}, {c['num_attention_heads']}x"
                 f"{c['attention_head_dim']} heads, ffn {c['ffn_dim']}")
        if report["curve_form"]:
            shape += f", curve AdaLN table {report['curve_table']['shape']}"
        lines.append(shape)
    if report["model"] == "controlnet":
        c = report["controlnet"]
        lines.append(f"  Fun ControlNet Union {c['version']}: {c['blocks']} blocks after DiT layers "
                     f"{', '.join(map(str, c['places']))}; hidden {c['hidden_size']}, {c['heads']}x{c['head_dim']} heads, "
                     f"{c['adaln']} AdaLN ({c['adaln_input']} inputs), inpaint fill {c['inpaint_fill']}")
    if report["model"] == "dit" and report.get("fasth3"):
        lines.append("  FastH3 (distilled, VSA gates in every block): run it with --recipe fasth3")
    if report["model"] == "lora":
        return lines + _lora_lines(report)
    lines.append(f"  logical parameters {report['logical_parameters']:,}")
    if "gguf" in report:
        g = report["gguf"]
        lines.append(f"  GGUF v{g['version']}, general.architecture {g['architecture']}, alignment {g['alignment']}")
        note = (report.get("structure") or {}).get("vision_note")
        if note:
            lines.append(f"  {note}")
        later = report.get("gguf_dequantized_at_load") or []
        if later:
            lines.append(f"  {len(later)} GGML-block layers dequantized at load (not a linear, ComfyUI-GGUF's "
                         f"reshaped rows, or a type the codec does not keep), e.g. {later[0]}")
    weights = (report.get("structure") or {}).get("weights") if report["model"] == "video_vae" else None
    if weights:
        lines.append(f"  video VAE, {weights}")
    hist = ", ".join(f"{k} {v['tensors']}" for k, v in report["dtype_histogram"].items())
    lines.append(f"  dtypes: {hist}")
    q = report["quantization"]
    if q["formats"]:
        fmts = ", ".join(f"{k} x{v}" for k, v in q["formats"].items())
        lines.append(f"  quantized layers: {fmts} (declared by {', '.join(q['declared_by'])}); "
                     f"{q['unquantized_layers']} layers unquantized")
    else:
        lines.append("  no quantized layers")
    problems = []
    refused = (report.get("structure") or {}).get("loader_refuses")
    if refused:
        problems.append(f"the video VAE loader refuses it: {refused}")
    for key in ("missing", "unexpected", "unmapped", "weight_missing", "gguf_unreadable"):
        items = list(report.get(key) or [])  # gguf_unreadable maps names to types
        if items:
            problems.append(f"{len(items)} {key.replace('_', ' ')} (e.g. {', '.join(items[:3])})")
    if report.get("wrong_shapes"):
        problems.append(f"{len(report['wrong_shapes'])} wrong shapes (e.g. {report['wrong_shapes'][0]['name']})")
    mismatched = report.get("nvfp4_mismatches") or {}
    if mismatched:
        name, why = next(iter(mismatched.items()))
        problems.append(f"{len(mismatched)} NVFP4 layers with wrong packed sizes (e.g. {name}: {why})")
    if report.get("problem"):
        problems.append(report["problem"])
    check = report.get("loader_check") or {}
    if check.get("passed") is False and check["error"] != refused:  # the video VAE's own line says it already
        problems.append(f"the loader refuses it ({check['check']}): {check['error']}")
    elif check.get("skipped"):
        lines.append(f"  loader check not run: {check['skipped']}")
    lines.append("  complete" if report["complete"] else "  INCOMPLETE: " + "; ".join(problems))
    return lines + _name_lines(report)


def _name_lines(report: dict) -> list[str]:
    said = describe(report.get("name_says") or {})
    lines = [f"  by its file name: {said}"] if said else []
    if report.get("tensors_cannot_tell"):
        lines.append("  the tensors cannot tell " + "; nor ".join(report["tensors_cannot_tell"]))
    return lines


def _lora_lines(report: dict) -> list[str]:
    kinds = ", ".join(f"{kind} x{t['layers']} (rank {'/'.join(map(str, t['ranks']))})"
                      for kind, t in report["targets"].items())
    lines = [f"  {', '.join(report['pair_names']) or 'no'} pairs: {kinds or 'none'}; "
             f"{report['dit_blocks']} DiT blocks, {report['refiner_blocks']} refiner blocks"]
    widths = report["adaln_input_widths"]
    lines.append("  no AdaLN adapter: merges onto a full or a pruned DiT alike" if not widths else
                 f"  AdaLN adapters read a {'/'.join(map(str, widths))}-wide input: they fit a DiT whose AdaLN "
                 "input is that wide (a pruned DiT's curve table width, or the full model's time_embed_dim)")
    for key in ("full deltas (.diff / .diff_b)", "replacements (set / adaln_t_table)"):
        if report.get(key):
            lines.append(f"  {report[key]} {key}")
    if report["head_bank_tensors"]:
        lines.append(f"  PDD head bank ({report['head_bank_tensors']} tensors): run it with --recipe pdd")
    lines.append(f"  alpha: {report['alpha']}")
    problems = []
    if report["half_pairs"]:
        problems.append(f"{len(report['half_pairs'])} pairs with one half (e.g. {report['half_pairs'][0]})")
    if report["unread"]:
        problems.append(f"{len(report['unread'])} tensors no LoRA style reads (e.g. {', '.join(report['unread'][:3])})")
    lines.append("  complete" if report["complete"] else "  INCOMPLETE: " + "; ".join(problems))
    return lines + _name_lines(report)
