"""ComfyUI's per-layer quantization (`comfy_quant`): how a layer declares it, and how we undo it.

A layer is quantized when one of these says so (ComfyUI's rules):
- a `<layer>.comfy_quant` uint8 tensor whose bytes are JSON (`{"format": "nvfp4", ...}`);
- the header metadata `_quantization_metadata` = `{"layers": {"<layer>": {...}}}`;
- legacy "scaled fp8" files: a `scaled_fp8` marker tensor, and `<layer>.scale_weight`
  (-> weight_scale) / `<layer>.scale_input` (-> input_scale) on each fp8 layer.
The formats we read are those kernels/formats/ declares, one module each (what a layer of the format stores,
its checks, its dequantization, its label); everything else is refused by name, never guessed.
This module keeps the declaration rules above and the writers' quantizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import CheckpointError
from ...kernels import stored_codec as codec
from ...kernels.formats import FORMATS, LayerParams, layer_format

# comfy_quant format -> tensors a layer of that format may carry besides `weight` (and `bias`). GGUF's blocks are
# declared by the file's tensor types, never by a marker.
FORMAT_TENSORS = {name: set(fmt.tensors) for name, fmt in FORMATS.items() if name != "gguf"}
# Formats ComfyUI knows that we do not load; named in the error so the user knows what they have.
KNOWN_UNSUPPORTED = tuple(f for f in ("mxfp8", "convrot_w4a4", "asym_w4a8_int8") if f not in FORMATS)
# Per-layer tensor suffixes that belong to quantization (a layer's name is the key minus these): every declared
# format's tensors (longest first, so weight_scale_2 is not read as weight_scale), the marker, the legacy names.
QUANT_SUFFIXES = tuple(sorted({t for f in FORMAT_TENSORS.values() for t in f}, key=lambda t: (-len(t), t))) + (
    "comfy_quant", "scale_weight", "scale_input")
PARAM_SUFFIXES = ("weight", "bias") + QUANT_SUFFIXES
LEGACY_MARKER = "scaled_fp8"
METADATA_KEY = "_quantization_metadata"


@dataclass(frozen=True)
class QuantSpec:
    format: str
    convrot: bool = False
    convrot_groupsize: int = 256
    full_precision_mm: bool = False
    # Input columns sharing a scale, for the formats that have such a group (asym_w4a8_int8's group_size).
    group_size: int | None = None
    # Where it was declared (comfy_quant | metadata | scaled_fp8): a report fact, not part of the format,
    # so a layer declared the same way by a marker and by the metadata compares equal.
    source: str = field(default="comfy_quant", compare=False)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def params(self) -> LayerParams:
        return LayerParams(self.convrot_groupsize if self.convrot else None, group_size=self.group_size)

    @property
    def label(self) -> str:
        """The user-facing name of the format (what make-checkpoint --format takes)."""
        return FORMATS[self.format].label_for(self.params)


def parse_layer_conf(conf: object, layer: str, source: str) -> QuantSpec:
    if not isinstance(conf, dict):
        if isinstance(conf, str):
            conf = {"format": conf}
        else:
            raise CheckpointError(f"{layer}: quantization config must be a JSON object, got {type(conf).__name__}")
    fmt = conf.get("format")
    if fmt in KNOWN_UNSUPPORTED:
        raise CheckpointError(f"{layer}: quantization format {fmt!r} is not supported by h3-spark "
                              f"(supported: {', '.join(FORMAT_TENSORS)})")
    if fmt not in FORMAT_TENSORS:
        raise CheckpointError(f"{layer}: unknown quantization format {fmt!r} (supported: {', '.join(FORMAT_TENSORS)})")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    convrot = FORMATS[fmt].always_rotated or bool(conf.get("convrot", params.get("convrot", False)))
    group = conf.get("convrot_groupsize", params.get("convrot_groupsize", 256))
    if isinstance(group, bool) or not isinstance(group, int):
        raise CheckpointError(f"{layer}: convrot_groupsize must be an integer, got {group!r}")
    if convrot and FORMATS[fmt].convrot_label is None:
        rotated = ", ".join(n for n, f in FORMATS.items() if f.convrot_label)
        raise CheckpointError(f"{layer}: convrot is only defined for {rotated}, not {fmt}")
    if convrot:
        try:
            hadamard(group)  # validates the size
        except CheckpointError as exc:
            raise CheckpointError(f"{layer}: convrot_groupsize: {exc}") from None
    group_size = None
    if FORMATS[fmt].default_group is not None:
        group_size = conf.get("group_size", params.get("group_size", FORMATS[fmt].default_group))
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise CheckpointError(f"{layer}: {fmt} group_size must be an integer, got {group_size!r}")
    extra = {k: v for k, v in conf.items() if k not in ("format", "convrot", "convrot_groupsize", "group_size",
                                                         "full_precision_matrix_mult", "params")}
    return QuantSpec(fmt, convrot, group, bool(conf.get("full_precision_matrix_mult", False)), group_size, source,
                     extra)


def decode_marker(tensor: torch.Tensor, layer: str) -> dict:
    """A `.comfy_quant` uint8 tensor -> its JSON object."""
    if tensor.dtype not in (torch.uint8, torch.int8) or tensor.ndim != 1:
        raise CheckpointError(f"{layer}.comfy_quant must be a 1-D uint8 tensor, got {tensor.dtype} {list(tensor.shape)}")
    try:
        return json.loads(tensor.contiguous().view(torch.uint8).numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{layer}.comfy_quant does not hold JSON") from None


def encode_marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def metadata_layers(metadata: dict[str, str]) -> dict[str, object] | None:
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"the safetensors metadata field {METADATA_KEY} is not JSON ({exc.msg} at "
                              f"character {exc.pos})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise CheckpointError(f"the safetensors metadata field {METADATA_KEY} has no `layers` object")
    return layers


def split_param(key: str) -> tuple[str, str] | None:
    """'blocks.0.attn.qkv_proj.weight_scale' -> ('blocks.0.attn.qkv_proj', 'weight_scale')."""
    for suffix in PARAM_SUFFIXES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return None


def declare_layers(layers: dict[str, dict[str, str]], read: Callable[[str], torch.Tensor], metadata: dict[str, str], prefix: str,
                   legacy_marker_key: str | None, legacy_marker_numel: int = 0,
                   ignore: Callable[[str], bool] = lambda name: False) -> dict[str, QuantSpec]:
    """QuantSpec of every quantized layer, from markers, header metadata or the legacy fp8 form.

    `layers` maps a prefix-free layer name to {suffix: stored key}, legacy suffixes already renamed
    (scale_weight -> weight_scale, with `_legacy` set); `read(key)` returns a small tensor.
    `ignore(name)` is true for prefix-free layers the caller skips on purpose (their metadata
    entries are not ours to check). A layer with scale tensors but no declaration is an error:
    guessing its format could load garbage silently.
    """
    meta_layers = metadata_layers(metadata)
    declared = {} if meta_layers is None else own_declarations(meta_layers, prefix, set(layers), ignore)
    legacy = legacy_marker_key is not None and meta_layers is None
    specs: dict[str, QuantSpec] = {}
    for name, keys in layers.items():
        spec = declared.pop(name, None)
        if "comfy_quant" in keys:
            marked = parse_layer_conf(decode_marker(read(keys["comfy_quant"]), name), name, "comfy_quant")
            if spec is not None and spec != marked:
                raise CheckpointError(f"{name}: .comfy_quant ({marked.label}) and {METADATA_KEY} ({spec.label}) disagree")
            spec = marked
        if spec is None and legacy and "_legacy" in keys and "weight_scale" in keys:
            spec = QuantSpec("float8_e4m3fn", full_precision_mm=legacy_marker_numel == 2, source="scaled_fp8")
        if spec is None:
            stray = sorted(s for s in keys if s in QUANT_SUFFIXES)
            if stray:
                raise CheckpointError(f"{name}: has {', '.join(stray)} but no quantization declaration "
                                      f"(.comfy_quant, {METADATA_KEY} or scaled_fp8)")
            continue
        allowed = FORMAT_TENSORS[spec.format] | {"weight", "bias", "comfy_quant", "_legacy"}
        extra = sorted(set(keys) - allowed)
        if extra:
            raise CheckpointError(f"{name}: {spec.label} layer has unexpected tensors {', '.join(extra)}")
        if "weight" not in keys:
            raise CheckpointError(f"{name}: declared {spec.label} but has no weight")
        specs[name] = spec
    if declared:
        names = sorted(declared)
        raise CheckpointError(f"{METADATA_KEY} declares {len(names)} layers with no weight, e.g. {', '.join(names[:3])}")
    return specs


def own_declarations(meta_layers: dict[str, object], prefix: str, layers: set[str],
                     ignore: Callable[[str], bool]) -> dict[str, QuantSpec]:
    """The metadata entries that describe this model's layers, by prefix-free name.

    A full ComfyUI checkpoint declares its text encoder's and VAE's layers in the same metadata;
    they belong to other loaders, so they are skipped before parsing (an exotic format there must
    not stop this model from loading). An unprefixed name still counts when it is one of ours.
    """
    own: dict[str, QuantSpec] = {}
    for name, conf in meta_layers.items():
        prefixed = name.startswith(prefix)
        stripped = name[len(prefix):] if prefixed else name
        if ignore(stripped) or not (prefixed or stripped in layers):
            continue
        own[stripped] = parse_layer_conf(conf, stripped, "metadata")
    return own


# --------------------------------------------------------------------- Hadamard (ConvRot)
# The rotation and every format's dequantization live beside StoredLinear (kernels/stored_codec.py), which
# dequantizes at use with the same functions.
hadamard, rotate_groups = codec.hadamard, codec.rotate_groups


def convrot_group_for(k: int, preferred: int = 256) -> int | None:
    """The group size a writer uses: 256 as released, else the largest power of 4 dividing K."""
    if k % preferred == 0:
        return preferred
    g = 4
    best = None
    while g <= preferred and g <= k:
        if k % g == 0:
            best = g
        g *= 4
    return best


# --------------------------------------------------------------------- dequantize
# The tensors of a quantized layer that hold its weight (input_scale is an activation scale, comfy_quant a marker),
# in the order StoredLinear registers them.
STORED_PARTS = tuple(dict.fromkeys(p for fmt in FORMATS.values() for p in fmt.parts))


def check_stored(spec: QuantSpec, tensors: dict[str, torch.Tensor], shape: tuple[int, int], layer: str) -> None:
    """The stored tensors can hold the logical weight [N, K]: dtypes, shapes and scale sizes (no values read)."""
    layer_format(spec.format, layer).validate(tensors, shape, spec.params, layer)


def held_tensors(spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's stored tensors in the form a StoredLinear holds them (NVFP4's block scales unblocked)."""
    return layer_format(spec.format).held(tensors)


def dequantize(spec: QuantSpec, tensors: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
               layer: str) -> torch.Tensor:
    """A quantized layer's stored tensors -> its logical weight [N, K] in `dtype` (AWQ's pre_quant_scale is
    folded in by the caller, `fold_pre_quant_scale`)."""
    return layer_format(spec.format, layer).dequantize(tensors, shape, dtype, spec.params, layer)


def fold_pre_quant_scale(weight: torch.Tensor, pre_quant_scale: torch.Tensor) -> torch.Tensor:
    """AWQ smoothing multiplies the input by s before the GEMM; x (W s)^T is the same product."""
    return codec.pre_quant_into(weight, pre_quant_scale)


# --------------------------------------------------------------------- quantize (writers)
def quantize_fp8(weight: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn,
                 rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor fp8: scale = amax / fp8 max, q = clamp(w / scale) (as ComfyUI quantizes)."""
    top = torch.finfo(fp8).max
    scale = (weight.abs().amax().to(torch.float32) / top).clamp(min=torch.finfo(torch.float32).tiny).reshape(())
    inv = (1.0 / scale).to(weight.dtype)
    q = torch.empty(weight.shape, dtype=fp8, device=weight.device)
    for start in range(0, weight.shape[0], rows_per_chunk):
        q[start:start + rows_per_chunk] = (weight[start:start + rows_per_chunk] * inv).clamp(-top, top).to(fp8)
    return q, scale


def quantize_int8_rows(weight: torch.Tensor, convrot_group: int | None,
                       rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 (scale [N, 1] = row amax / 127), optionally after the ConvRot rotation.

    Rows are independent, so they are done `rows_per_chunk` at a time to bound temporaries.
    """
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    for start in range(0, n, rows_per_chunk):
        w = weight[start:start + rows_per_chunk].float()
        if convrot_group:
            w = rotate_groups(w, convrot_group)
        s = (w.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
        safe = torch.where(s == 0, torch.full_like(s, torch.finfo(torch.float32).tiny), s)
        q[start:start + rows_per_chunk] = (w / safe).round().clamp(-128, 127).to(torch.int8)
        scale[start:start + rows_per_chunk] = s
    return q, scale


def quantize_int4_convrot(weight: torch.Tensor, group: int,
                          rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """convrot_w4a4: rotated per group, then per row symmetric 4-bit (scale = row amax / 7, codes in [-7, 7]),
    packed two a byte, the low nibble the even column. Returns (int8 [N, K / 2], fp32 scale [N])."""
    n, k = weight.shape
    packed = torch.empty(n, k // 2, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, rows_per_chunk):
        w = rotate_groups(weight[start:start + rows_per_chunk].float(), group)
        s = (w.abs().amax(dim=1, keepdim=True) / 7).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (w / s).round().clamp(-7, 7).to(torch.int16)
        packed[start:start + rows_per_chunk] = _pack_nibbles(codes)
        scale[start:start + rows_per_chunk] = s.reshape(-1)
    return packed, scale


W4A8_VARIANTS = ("codebook", "symmetric", "asymmetric")
_CODEBOOK_SAMPLE = 1 << 18


def quantize_w4a8(weight: torch.Tensor, group_size: int, convrot_group: int, variant: str,
                  rows_per_chunk: int = 4096) -> dict[str, torch.Tensor]:
    """asym_w4a8_int8 in one of its variants: rotated per ConvRot group, then per group of `group_size` columns a
    scale d and 4-bit levels (codebook: the table's entries x the group's amax; symmetric: code - 8 with d = amax / 7;
    asymmetric: code - 8 with d = range / 15 and a correction 8 d + min). The row's largest decoded level goes to
    127 on the int8 grid: s_channel = that / 127, s_rel = d / s_channel in e4m3. Returns the stored tensors
    (weight, weight_s_rel, weight_s_channel, weight_codebook or weight_correction)."""
    if variant not in W4A8_VARIANTS:
        raise CheckpointError(f"unknown w4a8 variant {variant!r}; choose one of {', '.join(W4A8_VARIANTS)}")
    n, k = weight.shape
    groups = k // group_size
    codebook = _w4a8_codebook(weight, group_size, convrot_group) if variant == "codebook" else None
    out = {"weight": torch.empty(n, k // 2, dtype=torch.int8, device=weight.device),
           "weight_s_rel": torch.empty(n, groups, dtype=torch.float8_e4m3fn, device=weight.device),
           "weight_s_channel": torch.empty(n, dtype=torch.float32, device=weight.device)}
    if variant == "asymmetric":
        out["weight_correction"] = torch.empty(groups, n, dtype=torch.bfloat16, device=weight.device)
    for start in range(0, n, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        w = rotate_groups(weight[rows].float(), convrot_group).reshape(-1, groups, group_size)
        if variant == "codebook":
            d = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
            codes = _nearest(w / d, codebook)
            levels = codebook[codes]
        elif variant == "symmetric":
            d = (w.abs().amax(dim=-1, keepdim=True) / 7).clamp(min=1e-30)
            codes = ((w / d).round().clamp(-8, 7) + 8).to(torch.int16)
            levels = codes.float() - 8
        else:
            low = w.amin(dim=-1, keepdim=True)
            d = ((w.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=1e-30)
            codes = ((w - low) / d).round().clamp(0, 15).to(torch.int16)
            levels = codes.float() - 8
            out["weight_correction"][:, rows] = (8 * d + low).reshape(-1, groups).t().to(torch.bfloat16)
        channel = ((levels * d).abs().amax(dim=(1, 2)) / 127).clamp(min=1e-30)
        out["weight_s_rel"][rows] = (d.squeeze(-1) / channel[:, None]).to(torch.float8_e4m3fn)
        out["weight_s_channel"][rows] = channel
        out["weight"][rows] = _pack_nibbles(codes.reshape(-1, k).to(torch.int16))
    if codebook is not None:
        out["weight_codebook"] = codebook
    return out


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int16 codes [R, K] (signed or 0..15) -> int8 [R, K / 2], the even column in the low nibble."""
    return ((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).to(torch.uint8).view(torch.int8)


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted table (ties to the lower one)."""
    above = torch.searchsorted(table, values.contiguous()).clamp(1, table.numel() - 1)
    below = above - 1
    return torch.where((values - table[below]).abs() <= (table[above] - values).abs(), below, above)


def _w4a8_codebook(weight: torch.Tensor, group_size: int, convrot_group: int) -> torch.Tensor:
    """16 sorted levels in [-1, 1] for a layer's amax-normalised groups: Lloyd's iterations from the quantiles, on a
    fixed sample of rows (deterministic, and a full-size layer is not rotated twice whole)."""
    n, k = weight.shape
    rows = torch.linspace(0, n - 1, max(1, min(n, _CODEBOOK_SAMPLE // k)), device=weight.device).long()
    w = rotate_groups(weight[rows].float(), convrot_group).reshape(-1, group_size)
    x = (w / w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)).flatten()
    table = torch.quantile(x, torch.linspace(0, 1, 16, device=x.device))
    for _ in range(8):
        nearest = _nearest(x, table)
        sums = torch.zeros(16, device=x.device).index_add_(0, nearest, x)
        counts = torch.zeros(16, device=x.device).index_add_(0, nearest, torch.ones_like(x))
        table = torch.where(counts > 0, sums / counts.clamp(min=1), table).sort().values
    return table.contiguous()


# --------------------------------------------------------------------- the 4-bit ConvRot layers the writers store
# make-checkpoint's --format -> the asym_w4a8_int8 variant it writes ("w4a8" is the published codebook form).
W4A8_WRITES = {"w4a8": "codebook", "w4a8_sym": "symmetric", "w4a8_asym": "asymmetric"}
FOUR_BIT_WRITES = ("int4_convrot",) + tuple(W4A8_WRITES)
W4A8_GROUP = 16


def four_bit_conf(label: str, k: int) -> dict | None:
    """The `.comfy_quant` of a layer with `k` input columns written as `label` (int4_convrot or a w4a8 one), as the
    published files declare it; None where the format cannot hold such a layer (no power-of-4 ConvRot group; w4a8:
    K not a multiple of 16), which a writer then keeps in bf16 as mixed files do."""
    group = convrot_group_for(k)
    if label == "int4_convrot":
        return None if group is None or k % 2 else {"format": "convrot_w4a4", "convrot_groupsize": group}
    if group is None or k % W4A8_GROUP:
        return None
    return {"format": "asym_w4a8_int8", "group_size": W4A8_GROUP, "convrot": True, "convrot_groupsize": group}


def four_bit_entries(label: str, layer: str, n: int, k: int, conf: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The stored tensors (name, safetensors dtype, shape) of such a layer, its marker included."""
    marker = (f"{layer}.comfy_quant", "U8", (len(json.dumps(conf).encode("utf-8")),))
    if label == "int4_convrot":
        return [(f"{layer}.weight", "I8", (n, k // 2)), (f"{layer}.weight_scale", "F32", (n,)), marker]
    groups = k // conf["group_size"]
    entries = [(f"{layer}.weight", "I8", (n, k // 2)), (f"{layer}.weight_s_rel", "F8_E4M3", (n, groups)),
               (f"{layer}.weight_s_channel", "F32", (n,))]
    variant = W4A8_WRITES[label]
    if variant == "codebook":
        entries.append((f"{layer}.weight_codebook", "F32", (16,)))
    elif variant == "asymmetric":
        entries.append((f"{layer}.weight_correction", "BF16", (groups, n)))
    return entries + [marker]


def four_bit_tensors(label: str, layer: str, weight: torch.Tensor, conf: dict) -> dict[str, torch.Tensor]:
    """The stored tensors of such a layer, quantized from its weight, keyed by stored name."""
    if label == "int4_convrot":
        packed, scale = quantize_int4_convrot(weight, conf["convrot_groupsize"])
        out = {"weight": packed, "weight_scale": scale}
    else:
        out = quantize_w4a8(weight, conf["group_size"], conf["convrot_groupsize"], W4A8_WRITES[label])
    out["comfy_quant"] = encode_marker(conf)
    return {f"{layer}.{k}": v for k, v in out.items()}
