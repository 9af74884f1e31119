"""Write the random Qwen3-VL text encoder as llama.cpp's text GGUF, streamed tensor by tensor.

What such a file is (the reader, checkpoint/gguf_source.py and text/encoder.py, is the contract):
`general.architecture = qwen3vl`, llama.cpp's tensor names (`token_embd.weight`, `blk.N.attn_q.weight`, ...,
`blk.N.ffn_down.weight`: gguf_source.comfy_to_llama_cpp), the language model only (llama.cpp keeps the vision
tower in a separate mmproj file, so the file encodes text presentations and refuses images in one line), and
llama.cpp's `qwen3vl.*` hyperparameters (block count, widths, heads, RoPE base and M-RoPE sections, RMSNorm
epsilon), which the reader takes its RoPE and epsilon from when no config.json is given. The layers are those
of the ComfyUI single file (synthetic.py: 50 for `full`, the layers the DiT reads; no final norm, no LM head),
converted from its bf16 values as llama.cpp converts a bf16 checkpoint.

Storage (llama.cpp's rules, llama-quant.cpp): 1-D tensors (the norms) F32; every 2-D weight in the asked-for
type, or in a mix:
- gguf:<TYPE> (any writable DiT type): every 2-D weight, the token embedding included, in TYPE (llama.cpp's
  `--pure`);
- gguf:Q4_K_M: Q4_K, with attn_v and ffn_down Q6_K in the layers llama.cpp gives more bits (the first and last
  eighth, and every third layer between: `use_more_bits`);
- gguf:Q2_K_M: llama.cpp's Q2_K mix (its ftype MOSTLY_Q2_K; llama.cpp has no "Q2_K_M", the name is the
  published file's): Q2_K, with attn_v Q4_K (Q3_K where fewer than 4 query heads share a KV head), attn_output
  and ffn_down Q3_K.
The token embedding takes the mix's base type, as llama.cpp gives an untied model's (Qwen3-VL-32B has an LM
head; the file here omits it, H3 never reads it). A row that is not whole blocks of its type falls back as
llama.cpp's does (Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), then to F16 where even that
does not fit (the tiny preset's 48-wide ffn_down rows).

The vision tower, on request (`write_mmproj`, make-checkpoint --mmproj), as llama.cpp's separate vision file:
`mmproj-<name>.gguf` beside the text GGUF, `general.architecture = clip`, `clip.projector_type = qwen3vl_merger`,
the `clip.vision.*` sizes, the tower's tensors under the names text/mmproj.py reads (the gguf package's V_* table:
the patch kernel split into its two time steps, DeepStack mergers named by the block they tap), drawn as the
ComfyUI file's `visual.*` tensors of the same seed and rounded to bf16 as that file stores them. Its weights are
F16 (llama.cpp's default for an mmproj), or the text file's own type when that is F32 or BF16; 1-D tensors F32.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from ..checkpoint.gguf_quantize import block_of
from ..checkpoint.gguf_source import PLAIN, comfy_to_llama_cpp, gguf_module
from ..checkpoint.gguf_writer import GGUF_PREFIX, PlannedTensor, write_planned, writable_types
from ..checkpoint.writer import Group
from .mmproj import ARCHITECTURE as MMPROJ_ARCHITECTURE
from .mmproj import PROJECTOR, file_names
from .synthetic import (MadeTextEncoder, Preset, no_draw, plan, preset, random_tensor, stored_shapes,
                        write_tokenizer_folder)

ARCHITECTURE = "qwen3vl"
# Mix -> its base type (llama.cpp's ftype names).
MIXES = {"Q4_K_M": "Q4_K", "Q2_K_M": "Q2_K"}
_FILE_TYPES = {"Q4_K_M": "MOSTLY_Q4_K_M", "Q2_K_M": "MOSTLY_Q2_K"}
# llama.cpp's fallback for rows that are not whole 256-value super-blocks.
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_BLOCK_WEIGHT = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def schemes() -> tuple[str, ...]:
    """What `--format gguf:<X>` may name for the text encoder: the writable types and the mixes."""
    return writable_types() + tuple(MIXES)


def scheme_of(fmt: str) -> str:
    """"gguf:Q4_K_M" -> "Q4_K_M", or InputError naming the choices."""
    if not fmt.startswith(GGUF_PREFIX):
        raise InputError(f"{fmt!r} is not a GGUF format (gguf:<TYPE>)")
    name = fmt[len(GGUF_PREFIX):].upper()
    if name not in schemes():
        raise InputError(f"--format {fmt}: a GGUF text encoder is written as "
                         f"{', '.join(GGUF_PREFIX + s for s in schemes())}")
    return name


def use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp's _M mixes store attn_v and ffn_down in more bits: the first and last eighth of the
    model and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fitting(gguf_type: str, width: int) -> str:
    if gguf_type in PLAIN or width % block_of(gguf_type)[0] == 0:
        return gguf_type
    fallback = _FALLBACK.get(gguf_type)
    if fallback is not None and width % block_of(fallback)[0] == 0:
        return fallback
    return "F16"


def tensor_type(name: str, shape: tuple[int, ...], scheme: str, layers: int, kv_groups: int) -> str:
    """The GGML type of one tensor (llama.cpp name) under `scheme` (see the module docstring); `kv_groups` is
    query heads per KV head."""
    if len(shape) != 2:
        return "F32"
    chosen = MIXES.get(scheme, scheme)
    m = _BLOCK_WEIGHT.match(name)
    if m is not None and scheme in MIXES:
        layer, part = int(m.group(1)), m.group(2)
        if scheme == "Q4_K_M" and part in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
            chosen = "Q6_K"
        elif scheme == "Q2_K_M" and part == "attn_v":
            chosen = "Q4_K" if kv_groups >= 4 else "Q3_K"
        elif scheme == "Q2_K_M" and part in ("attn_output", "ffn_down"):
            chosen = "Q3_K"
    return _fitting(chosen, shape[-1])


def gguf_plan(chosen: Preset, scheme: str, draw: Callable[[str, tuple[int, ...]], torch.Tensor]
              ) -> list[tuple[Group, list[PlannedTensor]]]:
    """The bf16 file's groups with their tensors' llama.cpp names and types; the vision tower's groups plan no
    tensor (never drawn)."""
    text = chosen.config.text_config
    kv_groups = text.num_attention_heads // text.num_key_value_heads
    out = []
    for group in plan(stored_shapes(chosen.config), "bf16", draw):
        tensors = []
        for name, _, shape in group.entries:
            target = comfy_to_llama_cpp(name)
            if target is not None:
                shape = tuple(shape)
                tensors.append(PlannedTensor(target, shape, tensor_type(target, shape, scheme, chosen.layers,
                                                                        kv_groups), source=name))
        out.append((group, tensors))
    return out


def _metadata(chosen: Preset, scheme: str, seed: int) -> Callable[[object], None]:
    gguf = gguf_module()
    text = chosen.config.text_config
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling

    def add(writer) -> None:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        file_type = getattr(gguf.LlamaFileType, _FILE_TYPES.get(scheme, f"MOSTLY_{scheme}"), None)
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.add_block_count(chosen.layers)
        writer.add_context_length(text.max_position_embeddings)
        writer.add_embedding_length(text.hidden_size)
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_head_count(text.num_attention_heads)
        writer.add_head_count_kv(text.num_key_value_heads)
        writer.add_key_length(text.head_dim)
        writer.add_value_length(text.head_dim)
        writer.add_rope_freq_base(float(rope["rope_theta"]))
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
        writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))
        writer.add_num_deepstack_layers(len(chosen.config.vision_config.deepstack_visual_indexes))
        writer.add_string("h3_spark", json.dumps({"maker": "h3-spark make-checkpoint", "component": "text_encoder",
                                                  "preset": chosen.name, "format": GGUF_PREFIX + scheme,
                                                  "seed": str(seed)}))

    return add


def write_text_encoder_gguf(out: str | Path, chosen: Preset | str, fmt: str, *, seed: int = 0,
                            tokenizer_dir: str | Path | None = None, device: str | torch.device = "cpu",
                            progress: Callable[[int, int], None] | None = None) -> MadeTextEncoder:
    """Write the GGUF (tensors drawn, converted and appended one parameter at a time), then the tokenizer
    folder the file needs (`<name>.tokenizer/` beside it by default)."""
    out = Path(out)
    if out.suffix.lower() != ".gguf":
        raise InputError(f"{out}: a GGUF text encoder is one file; give a path ending in .gguf")
    scheme = scheme_of(fmt)
    chosen = preset(chosen) if isinstance(chosen, str) else chosen
    folder = Path(tokenizer_dir) if tokenizer_dir is not None else out.with_name(out.stem + ".tokenizer")

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(name, shape, seed, device)

    size = write_planned(out, gguf_plan(chosen, scheme, draw), ARCHITECTURE, _metadata(chosen, scheme, seed),
                         progress)
    write_tokenizer_folder(folder, chosen)
    return MadeTextEncoder(out, folder, chosen.layers, size)


def planned_bytes(chosen: Preset | str, fmt: str) -> int:
    """The tensor bytes of a preset's GGUF in `fmt`, from the plan alone (nothing drawn)."""
    chosen = preset(chosen) if isinstance(chosen, str) else chosen
    return sum(t.nbytes for _, ts in gguf_plan(chosen, scheme_of(fmt), no_draw) for t in ts)


# ---------------------------------------------------------------------------- the vision file (mmproj)
def mmproj_path(text_gguf: str | Path) -> Path:
    """`x.gguf` -> `mmproj-x.gguf` beside it (the name the encoder's discovery looks for: mmproj*.gguf)."""
    text_gguf = Path(text_gguf)
    return text_gguf.with_name(f"mmproj-{text_gguf.name}")


def mmproj_type(scheme: str) -> str:
    return scheme if scheme in ("F32", "BF16") else "F16"


def mmproj_plan(chosen: Preset, gguf_type: str, draw: Callable[[str, tuple[int, ...]], torch.Tensor]
                ) -> list[tuple[Group, list[PlannedTensor]]]:
    """The bf16 file's `visual.*` groups, each producing its mmproj tensors (the patch kernel as two)."""
    deepstack = list(chosen.config.vision_config.deepstack_visual_indexes)
    out = []
    for group in plan(stored_shapes(chosen.config), "bf16", draw):
        (name, _, shape), = group.entries
        if not name.startswith("visual."):
            continue
        targets = file_names(name, deepstack)
        if len(targets) == 2:
            shape = (shape[0], shape[1], *shape[3:])  # one time step of the Conv3d kernel

            def make(group=group, name=name, targets=targets):
                kernel = group.make()[name]
                return {targets[0]: kernel[:, :, 0], targets[1]: kernel[:, :, 1]}
        else:
            def make(group=group, name=name, targets=targets):
                return {targets[0]: group.make()[name]}
        tensors = [PlannedTensor(t, tuple(shape), gguf_type if len(shape) >= 2 else "F32") for t in targets]
        out.append((Group(group.entries, make), tensors))
    return out


def _mmproj_metadata(chosen: Preset, seed: int, text_file: str) -> Callable[[object], None]:
    vision = chosen.config.vision_config
    text = chosen.config.text_config

    def add(writer) -> None:
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(PROJECTOR)
        writer.add_vision_projection_dim(int(vision.out_hidden_size))
        writer.add_vision_embedding_length(int(vision.hidden_size))
        writer.add_vision_feed_forward_length(int(vision.intermediate_size))
        writer.add_vision_block_count(int(vision.depth))
        writer.add_vision_head_count(int(vision.num_heads))
        writer.add_vision_patch_size(int(vision.patch_size))
        writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
        writer.add_vision_image_size(int(round(vision.num_position_embeddings ** 0.5)) * int(vision.patch_size))
        writer.add_vision_attention_layernorm_eps(float(text.rms_norm_eps))
        writer.add_vision_use_gelu(True)
        taps = set(vision.deepstack_visual_indexes)
        writer.add_vision_is_deepstack_layers([i in taps for i in range(int(vision.depth))])
        writer.add_string("h3_spark", json.dumps({"maker": "h3-spark make-checkpoint", "component": "text_encoder "
                                                  "vision tower", "preset": chosen.name, "seed": str(seed),
                                                  "text_file": text_file}))

    return add


def write_mmproj(text_gguf: str | Path, chosen: Preset | str, scheme: str, *, seed: int = 0,
                 device: str | torch.device = "cpu", progress: Callable[[int, int], None] | None = None) -> Path:
    """Write the vision tower of the seed's model as `mmproj-<name>.gguf` beside `text_gguf`; returns its path."""
    chosen = preset(chosen) if isinstance(chosen, str) else chosen
    out = mmproj_path(text_gguf)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(name, shape, seed, device)

    write_planned(out, mmproj_plan(chosen, mmproj_type(scheme), draw), MMPROJ_ARCHITECTURE,
                  _mmproj_metadata(chosen, seed, Path(text_gguf).name), progress)
    return out
