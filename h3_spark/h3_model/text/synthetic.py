"""Random-weight Qwen3-VL text encoder files, laid out as Comfy-Org publishes them.

`h3-spark make-checkpoint --component text_encoder` writes one ComfyUI single file and the tokenizer
+ processor folder such a file needs beside it, so that tests, demos and benchmarks load a text
encoder through the real reader: `TextEncoder.from_pretrained(file, tokenizer=folder, layer=...)`.

The published files (Hugging Face Comfy-Org/MiniMax-H3, `text_encoders/`):

| file                                         | bytes          | GiB   |
|----------------------------------------------|----------------|-------|
| qwen3vl_32b_minimax_h3_bf16.safetensors      | 51,506,295,256 | 47.97 |
| qwen3vl_32b_minimax_h3_int8_convrot          | 27,141,342,152 | 25.28 |
| qwen3vl_32b_minimax_h3_nvfp4_awq (template)  | 15,687,142,551 | 14.61 |

What they hold, worked out from those sizes. A Qwen3-VL-32B decoder layer has 7 linears of
487,587,840 weights (q 8192x5120, k and v 1024x5120, o 5120x8192, gate and up 25600x5120, down
5120x25600) and 10,496 norm values; the embedding is 151936x5120 = 777,912,320; the vision tower
(27 blocks, the merger and 3 DeepStack mergers) is 595,266,800.
- bf16: 2 bytes x (n x 487,598,336 + 777,912,320 + 595,266,800) is the published size less a
  103 KB header for n = 50 exactly. 64 layers would be 65 GB; an LM head (1.56 GB) or a final norm
  does not fit either. So: the first 50 decoder layers, no final norm, no LM head, the whole tower.
- int8_convrot: 50 x 487.6 M int8 weights, a fp32 scale per output row (71,680 a layer), 72-byte
  markers, and the embedding and tower in bf16 sum to 27,141,161,040 bytes: the published payload
  to the byte. So only the decoder linears are quantized, scales are per row, nothing else is stored.
- nvfp4_awq: the 350 linears in NVFP4 (12.19 GB of codes + 1.52 GB of e4m3 block scales) plus a
  bf16 embedding and tower would be 16.46 GB, 0.77 GB too many: exactly the embedding's second byte.
  With the embedding int8 (a fp32 scale per row), bf16 AWQ scales on o_proj and down_proj only
  and 55-byte markers, the sum is 15,686,911,143 bytes: the published size less a 231 KB header.
Two third-party readers of the published headers say the same, tensor by tensor: a trace of ComfyUI's
H3 pipeline (int8 file: 1602 tensors, 350 int8 linears `[out, 1]` F32 scales and marker
{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}, the 351-tensor tower and
`model.embed_tokens` BF16) and the spec of a C++ port (nvfp4_awq file: 2054 tensors; per linear
`weight` U8 [out, in/2] high nibble first, `weight_scale` F8_E4M3 in the 128x4 blocked order,
`weight_scale_2` F32 scalar, marker {"format": "nvfp4", "full_precision_matrix_mult": true};
`pre_quant_scale` BF16 [in] on o_proj and down_proj only, the AWQ scales of q/k/v folded into
`input_layernorm` and those of gate/up into `post_attention_layernorm`; `model.embed_tokens` I8 with
a F32 [rows, 1] scale and {"format": "int8_tensorwise"}; no `input_scale` in either file; header
metadata `minimax_h3_te` = {"num_hidden_layers": 50, "output": "unnormalized_hidden_after_layer_50"},
read from the int8 file and assumed of the others). Names are ComfyUI's, without a prefix:
`model.embed_tokens.*`, `model.layers.N.*`, `visual.*` (comfy/sd.py recognises the file by
`visual.deepstack_merger_list.0.norm.weight` and `model.layers.49.self_attn.q_proj.weight`;
comfy/text_encoders/llama.py's Qwen3VL_32BConfig has 50 layers, no final norm, no LM head).

The 4-bit files. `qwen3vl_32b_minimax_h3_int4_convrot.safetensors` (Abiray's, ~15.0 GB) has no published
header we could read; written here as the int8_convrot file with its decoder linears in convrot_w4a4 (int8
[out, in/2] packed codes, a F32 [out] scale, marker {"format": "convrot_w4a4", "convrot_groupsize": 256}).
No w4a8 text encoder is published; `w4a8` / `w4a8_sym` / `w4a8_asym` store the decoder linears in
asym_w4a8_int8's codebook, symmetric or asymmetric variant with the marker of the published w4a8 DiT files
({"format": "asym_w4a8_int8", "group_size": 16, "convrot": true, "convrot_groupsize": 256}).

Chosen here, not published: fp8_scaled. Comfy-Org ships no fp8 text encoder, so the decoder linears
are float8_e4m3fn with a per-tensor F32 `weight_scale` and marker {"format": "float8_e4m3fn"} (the
form of the fp8 DiT files) and everything else is bf16, as in the int8 file. (A community
`qwen3vl_32b_minimax_h3_fp8_scaled`, 26.53 GB, is ~0.6 GB smaller than that: its tower's linears
are presumably fp8 as well. It is not followed.)

One seed, one model. Every tensor is drawn from its own generator, seeded by (seed, stored name),
so the four formats of one seed describe the same random model, each rounded its own way, and
quantized-vs-bf16 drift can be measured. Values are sized like a trained network's: linear and conv
weights N(0, 1/fan_in), embeddings N(0, 0.02) (Qwen's initializer range), biases N(0, 0.02), norm
gains N(1, 0.1). The AWQ scales s are exp(N(0, 0.3)) per input feature, also drawn per name:
o_proj and down_proj store the codes of W / s and s itself (bf16) as `pre_quant_scale`, which the
reader multiplies back into the weight's columns; q/k/v share one s that is folded into
`input_layernorm` (stored: bf16(norm x s), codes of W / s), gate/up likewise into
`post_attention_layernorm`. So the nvfp4_awq file's two norms differ from the bf16 file's by design,
as the published files' do, and the product is the same model.

Presets: `full` is Qwen3-VL-32B cut after layer 50; `tiny` is the demo's tiny Qwen3-VL
(text/stand_in.py), cut after its read layer (2), so tests write and load it in a second.

The tokenizer folder: the byte-level stand-in tokenizer (256 bytes, a few merges, Qwen3-VL's special
tokens) with transformers' Qwen3-VL processors (tiny: the demo's 4-pixel patch; full: the released
16-pixel patch and pixel budget), plus the model's config.json for `tiny` (its shapes are not
Qwen3-VL-32B's, and the reader derives a config from a bare file only for those). A full file works
as well with the real tokenizer: MiniMaxAI/MiniMax-H3's `tokenizer/` and `processor/` folders.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from ...kernels import nvfp4_codec as nvfp4
from ..checkpoint.quant import (FOUR_BIT_WRITES, convrot_group_for, encode_marker, four_bit_conf, four_bit_entries,
                                four_bit_tensors, quantize_fp8, quantize_int8_rows)
from ..checkpoint.safetensors_header import encode_header
from ..checkpoint.synthetic import tensor_seed
from ..checkpoint.writer import Group, write_groups
from . import stand_in

FORMATS = ("bf16", "fp8_scaled", "int8_convrot", "nvfp4_awq") + FOUR_BIT_WRITES
PRESETS = ("tiny", "full")
# The Comfy-Org files' sizes in bytes (model-manifest listings of Comfy-Org/MiniMax-H3).
PUBLISHED_BYTES = {"bf16": 51_506_295_256, "int8_convrot": 27_141_342_152, "nvfp4_awq": 15_687_142_551}
FULL_LAYERS = 50
# Qwen3-VL-32B (the released text encoder), as its public config.json gives it.
QWEN3VL_32B_TEXT = dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                         "mrope_interleaved": True})
QWEN3VL_32B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120,
                          num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
QWEN3VL_VOCAB = 151936
QWEN3VL_PIXELS = (65536, 16777216)  # the processor's (min, max) pixels per image
METADATA_KEY = "minimax_h3_te"

# ComfyUI's markers, byte for byte as the published files carry them.
_NVFP4_MARKER = {"format": "nvfp4", "full_precision_matrix_mult": True}
_EMBED_INT8_MARKER = {"format": "int8_tensorwise"}
_FP8_MARKER = {"format": "float8_e4m3fn"}
_EMBED_LAYER = "model.embed_tokens"
_EMBED = _EMBED_LAYER + ".weight"
_DECODER_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# Which norm absorbs the AWQ scale of which linears (the others carry it as pre_quant_scale).
_FOLDED_INTO = {"self_attn.q_proj": "input_layernorm", "self_attn.k_proj": "input_layernorm",
                "self_attn.v_proj": "input_layernorm", "mlp.gate_proj": "post_attention_layernorm",
                "mlp.up_proj": "post_attention_layernorm"}
_AWQ_SIGMA = 0.3
Draw = Callable[[str, tuple[int, ...]], torch.Tensor]


# ---------------------------------------------------------------------------- the model
@dataclass
class Preset:
    """One preset's model and processing: what the file and the tokenizer folder describe."""

    name: str
    layers: int  # decoder layers stored (the layer the DiT reads)
    tokenizer: object
    processor: object
    config: object  # transformers Qwen3VLConfig, cut to `layers`




def preset(name: str) -> Preset:
    """The tiny or full model, with the byte-level stand-in tokenizer and Qwen3-VL processors."""
    if name not in PRESETS:
        raise InputError(f"text encoder preset must be one of {', '.join(PRESETS)}, got {name!r}")
    from .torchvision_compat import ensure_importable

    ensure_importable()  # transformers' Qwen3-VL video processor imports torchvision
    tok = stand_in.make_tokenizer()
    if name == "full":
        config = stand_in.text_config(tok, FULL_LAYERS, QWEN3VL_32B_TEXT, QWEN3VL_32B_VISION, QWEN3VL_VOCAB)
        processor = stand_in.make_processor(tok, patch_size=16, image_pixels=QWEN3VL_PIXELS, video_pixels=QWEN3VL_PIXELS)
        return Preset(name, FULL_LAYERS, tok, processor, config)
    layers = stand_in.TEXT_READ_LAYER
    return Preset(name, layers, tok, stand_in.make_processor(tok), stand_in.text_config(tok, layers))


def stored_shapes(config) -> dict[str, tuple[int, ...]]:
    """ComfyUI's names and shapes, language model first: `model.*` (no final norm) then `visual.*`.

    Read off transformers' own Qwen3VLModel built on the meta device, so the names are the ones
    the reader maps back (`model.` -> `language_model.`)."""
    from transformers import Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel(config)
    language, vision = {}, {}
    for name, param in model.named_parameters():
        if name.startswith("language_model.norm."):
            continue  # the conditioning is read before the final norm; published files omit it
        if name.startswith("language_model."):
            language["model." + name[len("language_model."):]] = tuple(param.shape)
        else:
            vision[name] = tuple(param.shape)
    return {**language, **vision}


# ---------------------------------------------------------------------------- random values
def init_rule(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std): norm gains around 1, small biases, Qwen-sized embeddings, unit-gain linears and convs;
    an AWQ scale's exponent is standard normal (awq_scale sizes it)."""
    if name.endswith(".awq_scale"):
        return 0.0, 1.0
    if len(shape) == 1:
        return (1.0, 0.1) if name.endswith(".weight") else (0.0, 0.02)
    if name.endswith(("embed_tokens.weight", "pos_embed.weight")):
        return 0.0, 0.02
    return 0.0, 1.0 / math.sqrt(math.prod(shape[1:]))


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One tensor of the random model, fp32 on `device` (the device's stream: cpu and cuda files differ)."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    mean, std = init_rule(name, shape)
    noise.mul_(std)  # in place: the full embedding is 3 GB in fp32
    return noise.add_(mean) if mean else noise


def awq_scale_name(linear_weight: str) -> str:
    """The name an AWQ scale is drawn under: one per group of linears sharing an input (q/k/v, gate/up)."""
    layer, part = _DECODER_LINEAR.match(linear_weight).group(1, 2)
    return f"model.layers.{layer}.{_FOLDED_INTO.get(part, part)}.awq_scale"


def awq_scale(draw: Draw, name: str, features: int) -> torch.Tensor:
    """exp(N(0, 0.3)): positive, mostly within [0.5, 2]; AWQ's smoothing has no other constraint."""
    return draw(name, (features,)).mul_(_AWQ_SIGMA).exp_()


# ---------------------------------------------------------------------------- the plan
def _marker_entry(layer: str, conf: dict) -> tuple[str, str, tuple[int, ...]]:
    return f"{layer}.comfy_quant", "U8", (len(json.dumps(conf).encode("utf-8")),)


def _entries(name: str, shape: tuple[int, ...], fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """Stored tensors of one parameter in `fmt` (header facts only: nothing is drawn)."""
    if fmt == "nvfp4_awq" and name == _EMBED:
        return [(name, "I8", shape), (f"{_EMBED_LAYER}.weight_scale", "F32", (shape[0], 1)),
                _marker_entry(_EMBED_LAYER, _EMBED_INT8_MARKER)]
    if fmt == "bf16" or not _DECODER_LINEAR.match(name):
        return [(name, "BF16", shape)]
    layer = name[: -len(".weight")]
    n, k = shape
    if fmt == "fp8_scaled":
        return [(name, "F8_E4M3", shape), (f"{layer}.weight_scale", "F32", ()), _marker_entry(layer, _FP8_MARKER)]
    if fmt == "int8_convrot":
        return [(name, "I8", shape), (f"{layer}.weight_scale", "F32", (n, 1)),
                _marker_entry(layer, _convrot_marker(layer, k))]
    if fmt in FOUR_BIT_WRITES:
        return four_bit_entries(fmt, layer, n, k, _four_bit_marker(layer, fmt, k))
    entries = [(name, "U8", nvfp4.packed_shape(n, k)), (f"{layer}.weight_scale", "F8_E4M3", nvfp4.scale_shape(n, k)),
               (f"{layer}.weight_scale_2", "F32", ())]
    if _carries_pre_quant_scale(name):
        entries.append((f"{layer}.pre_quant_scale", "BF16", (k,)))
    return entries + [_marker_entry(layer, _NVFP4_MARKER)]


def _convrot_marker(layer: str, k: int) -> dict:
    group = convrot_group_for(k)
    if group is None:
        raise InputError(f"{layer}: {k} input columns admit no power-of-4 ConvRot group")
    return {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}


def _four_bit_marker(layer: str, fmt: str, k: int) -> dict:
    conf = four_bit_conf(fmt, k)
    if conf is None:
        raise InputError(f"{layer}: {fmt} cannot hold {k} input columns (a power-of-4 ConvRot group must divide them; "
                         "w4a8 also needs a multiple of 16)")
    return conf


def _carries_pre_quant_scale(name: str) -> bool:
    return _DECODER_LINEAR.match(name).group(2) not in _FOLDED_INTO


def _folded_norm(name: str, fmt: str) -> str | None:
    """For nvfp4_awq, the awq_scale name a norm absorbs (input_layernorm / post_attention_layernorm)."""
    m = re.match(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", name)
    return f"model.layers.{m.group(1)}.{m.group(2)}.awq_scale" if fmt == "nvfp4_awq" and m else None


def _make(name: str, shape: tuple[int, ...], fmt: str, draw: Draw) -> dict[str, torch.Tensor]:
    """The stored tensors of one parameter, drawn and quantized on the draw's device."""
    value = draw(name, shape)
    absorbed = _folded_norm(name, fmt)
    if absorbed is not None:
        # AWQ folded into the norm: the next linears' inputs grow by s, their columns shrink by s.
        return {name: (value * awq_scale(draw, absorbed, shape[0])).to(torch.bfloat16)}
    if fmt == "nvfp4_awq" and name == _EMBED:
        q, s = quantize_int8_rows(value, None)
        return {name: q, f"{_EMBED_LAYER}.weight_scale": s,
                f"{_EMBED_LAYER}.comfy_quant": encode_marker(_EMBED_INT8_MARKER)}
    if fmt == "bf16" or not _DECODER_LINEAR.match(name):
        return {name: value.to(torch.bfloat16)}
    layer = name[: -len(".weight")]
    if fmt == "fp8_scaled":
        q, s = quantize_fp8(value)
        return {name: q, f"{layer}.weight_scale": s, f"{layer}.comfy_quant": encode_marker(_FP8_MARKER)}
    if fmt == "int8_convrot":
        conf = _convrot_marker(layer, shape[1])
        q, s = quantize_int8_rows(value, conf["convrot_groupsize"])
        return {name: q, f"{layer}.weight_scale": s, f"{layer}.comfy_quant": encode_marker(conf)}
    if fmt in FOUR_BIT_WRITES:
        return four_bit_tensors(fmt, layer, value, _four_bit_marker(layer, fmt, shape[1]))
    return _nvfp4_awq(name, value, draw)


def _nvfp4_awq(name: str, weight: torch.Tensor, draw: Draw) -> dict[str, torch.Tensor]:
    layer = name[: -len(".weight")]
    scale = awq_scale(draw, awq_scale_name(name), weight.shape[1])
    out = {}
    if _carries_pre_quant_scale(name):
        # Stored in bf16, so divide by the rounded value: the reader multiplies by exactly that.
        stored = scale.to(torch.bfloat16)
        scale = stored.float()
        out[f"{layer}.pre_quant_scale"] = stored
    q, block, glob = nvfp4.quantize(weight / scale[None, :])
    out.update({name: q, f"{layer}.weight_scale": block, f"{layer}.weight_scale_2": glob,
                f"{layer}.comfy_quant": encode_marker(_NVFP4_MARKER)})
    return out


def plan(shapes: dict[str, tuple[int, ...]], fmt: str, draw: Draw) -> list[Group]:
    """Writer groups, one per parameter; a group draws its tensor only when the writer reaches it."""
    if fmt not in FORMATS:
        raise InputError(f"unknown text encoder format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return [Group(_entries(name, shape, fmt), lambda name=name, shape=shape: _make(name, shape, fmt, draw))
            for name, shape in shapes.items()]


def file_metadata(layers: int, fmt: str, seed: int, preset_name: str) -> dict[str, str]:
    te = {"num_hidden_layers": layers, "output": f"unnormalized_hidden_after_layer_{layers}"}
    info = {"maker": "h3-spark make-checkpoint", "component": "text_encoder", "preset": preset_name,
            "format": fmt, "seed": str(seed)}
    return {METADATA_KEY: json.dumps(te), "h3_spark": json.dumps(info)}


def planned_bytes(preset_name: str, fmt: str, seed: int = 0) -> tuple[int, int]:
    """(file size, payload) of a preset's file in `fmt`, from the plan alone: nothing is drawn."""
    chosen = preset(preset_name)
    groups = plan(stored_shapes(chosen.config), fmt, no_draw)
    header, _ = encode_header([e for g in groups for e in g.entries], file_metadata(chosen.layers, fmt, seed,
                                                                                    preset_name))
    payload = sum(g.nbytes for g in groups)
    return len(header) + payload, payload


def no_draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The Draw of a plan that is only measured: producing any tensor is a bug."""
    raise AssertionError(f"planning drew {name}")


# ---------------------------------------------------------------------------- writing
@dataclass
class MadeTextEncoder:
    path: Path  # the .safetensors file
    tokenizer_dir: Path
    layers: int  # decoder layers stored: load with layer=<this>
    bytes: int


def default_tokenizer_dir(out: str | Path) -> Path:
    """`<name>.tokenizer/` beside `<name>.safetensors`."""
    out = Path(out)
    return out.with_name(out.stem + ".tokenizer")


def write_tokenizer_folder(folder: Path, chosen: Preset) -> None:
    chosen.processor.save_pretrained(str(folder))  # tokenizer files + processor_config.json
    if chosen.name == "tiny":
        chosen.config.save_pretrained(str(folder))


def write_text_encoder(out: str | Path, preset_name: str, fmt: str, *, seed: int = 0,
                       tokenizer_dir: str | Path | None = None, device: str | torch.device = "cpu",
                       progress: Callable[[int, int], None] | None = None) -> MadeTextEncoder:
    """Write the single file (streamed, one parameter in memory at a time), then its tokenizer folder.

    `device` draws and quantizes each tensor there; only finished tensors go to the host."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise InputError(f"{out}: a ComfyUI text encoder is one file; give a path ending in .safetensors")
    if fmt not in FORMATS:
        raise InputError(f"unknown text encoder format {fmt!r}; choose one of {', '.join(FORMATS)}")
    chosen = preset(preset_name)
    folder = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir(out)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(name, shape, seed, device)

    groups = plan(stored_shapes(chosen.config), fmt, draw)
    size = write_groups(out, groups, file_metadata(chosen.layers, fmt, seed, preset_name), progress)
    write_tokenizer_folder(folder, chosen)
    return MadeTextEncoder(out, folder, chosen.layers, size)
