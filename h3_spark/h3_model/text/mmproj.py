"""llama.cpp's vision file (mmproj) for Qwen3-VL, read as transformers' vision tower (`visual.*`).

llama.cpp converts Qwen3-VL into two GGUFs: the language model (`general.architecture = qwen3vl`) and the vision
tower with its mergers in an "mmproj" file (`general.architecture = clip`, `clip.projector_type =
qwen3vl_merger`). Our docs carry no list of its tensor names, so the gguf package's own table (`gguf.TENSOR_NAMES`
for the MODEL_TENSOR.V_* tensors) is the source of truth here; how llama.cpp's converter places Qwen3-VL's tower
into them:
- the Conv3d patch embedding (temporal patch 2) as two Conv2d kernels, its first and second time step:
  V_ENC_EMBD_PATCH `v.patch_embd.weight` and `v.patch_embd.weight.1` (stacked back on dim 2 here), its bias
  `v.patch_embd.bias`; the learned positions V_ENC_EMBD_POS `v.position_embd.weight`;
- block N: `v.blk.N.ln1` / `ln2` (norm1 / norm2), `attn_qkv` (the fused qkv), `attn_out` (attn.proj),
  `ffn_up` / `ffn_down` (mlp.linear_fc1 / linear_fc2);
- the merger: V_POST_NORM `v.post_ln` (merger.norm), V_MMPROJ `mm.0` / `mm.2` (merger.linear_fc1 / linear_fc2);
- DeepStack merger k: V_DS_* `v.deepstack.I.{norm,fc1,fc2}` where I is the vision block it taps
  (deepstack_visual_indexes[k]), not k.
The header gives the tower's sizes (`clip.vision.block_count`, `embedding_length`, `feed_forward_length`,
`attention.head_count`, `patch_size`, `spatial_merge_size`, `projection_dim`, `is_deepstack_layers`); the
projection width must be the text model's hidden size, or the file belongs to another model.

Every tensor is read as values at load (GGML blocks dequantized by the reader's codec, to the encoder's dtype): the
tower is small (0.6 G parameters at full size against the language model's 25 G), and its linears are run by
transformers' modules, not by StoredLinear.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

import torch

from ...errors import CheckpointError, InputError
from ..checkpoint.gguf_source import GgufSource, declared, dequantize, gguf_module

ARCHITECTURE = "clip"
PROJECTOR = "qwen3vl_merger"
PATCH_SECOND = ".1"  # llama.cpp's name suffix for the patch kernel's second time step
# transformers' block module -> llama.cpp's tensor (gguf's MODEL_TENSOR member).
_BLOCK = {"norm1": "V_ENC_INPUT_NORM", "norm2": "V_ENC_POST_ATTN_NORM", "attn.qkv": "V_ENC_ATTN_QKV",
          "attn.proj": "V_ENC_ATTN_O", "mlp.linear_fc1": "V_ENC_FFN_UP", "mlp.linear_fc2": "V_ENC_FFN_DOWN"}
_DEEPSTACK = {"norm": "V_DS_NORM", "linear_fc1": "V_DS_FC1", "linear_fc2": "V_DS_FC2"}
# header key (after clip.vision.) -> transformers' Qwen3-VL vision_config field.
_SIZES = {"block_count": "depth", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
          "attention.head_count": "num_heads", "patch_size": "patch_size",
          "spatial_merge_size": "spatial_merge_size", "projection_dim": "out_hidden_size"}


@functools.lru_cache(maxsize=1)
def _names() -> dict[str, str]:
    gguf = gguf_module()
    return {member: gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[member]]
            for member in (*_BLOCK.values(), *_DEEPSTACK.values(), "V_ENC_EMBD_PATCH", "V_ENC_EMBD_POS",
                           "V_POST_NORM", "V_MMPROJ")}


def file_names(target: str, deepstack: list[int]) -> list[str]:
    """transformers' vision parameter -> the mmproj tensor(s) holding it (two for the patch kernel); [] for a name
    the mmproj has no place for."""
    names = _names()
    module, _, param = target.removeprefix("visual.").rpartition(".")
    if module == "patch_embed.proj":
        base = f"{names['V_ENC_EMBD_PATCH']}.{param}"
        return [base, base + PATCH_SECOND] if param == "weight" else [base]
    if module == "pos_embed":
        return [f"{names['V_ENC_EMBD_POS']}.{param}"]
    if module == "merger.norm":
        return [f"{names['V_POST_NORM']}.{param}"]
    if module in ("merger.linear_fc1", "merger.linear_fc2"):
        return [f"{names['V_MMPROJ'].format(bid=0 if module.endswith('1') else 2)}.{param}"]
    parts = module.split(".", 2)
    if parts[0] == "blocks" and len(parts) == 3 and parts[2] in _BLOCK:
        return [f"{names[_BLOCK[parts[2]]].format(bid=int(parts[1]))}.{param}"]
    if parts[0] == "deepstack_merger_list" and len(parts) == 3 and parts[2] in _DEEPSTACK:
        k = int(parts[1])
        if k < len(deepstack):
            return [f"{names[_DEEPSTACK[parts[2]]].format(bid=deepstack[k])}.{param}"]
    return []


class Mmproj:
    """One mmproj file: its header checked as Qwen3-VL's vision tower, its sizes and its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.source = GgufSource(self.path)
        arch = self.source.architecture
        if arch != ARCHITECTURE:
            self.source.close()
            raise CheckpointError(f"{self.path}: general.architecture is "
                                  f"{'not declared' if arch is None else declared(arch)}, not a llama.cpp vision file "
                                  f"(an mmproj declares {ARCHITECTURE!r})")
        projector = self.source.field("clip.projector_type") or self.source.field("clip.vision.projector_type")
        if projector != PROJECTOR:
            self.source.close()
            raise CheckpointError(f"{self.path}: an mmproj for another model: clip.projector_type is {projector!r}, "
                                  f"Qwen3-VL's is {PROJECTOR!r}")
        self.vision = self._sizes()

    def _field(self, key: str):
        value = self.source.field(key)
        if value is None:
            self.source.close()
            raise CheckpointError(f"{self.path}: no {key} in the header; a Qwen3-VL mmproj states it")
        return value

    def _sizes(self) -> dict:
        vision = {field: int(self._field(f"clip.vision.{key}")) for key, field in _SIZES.items()}
        flags = self._field("clip.vision.is_deepstack_layers")
        if not isinstance(flags, list) or len(flags) != vision["depth"]:
            self.source.close()
            raise CheckpointError(f"{self.path}: clip.vision.is_deepstack_layers must list one flag per vision block "
                                  f"({vision['depth']}), got {flags!r}")
        vision["deepstack_visual_indexes"] = [i for i, flag in enumerate(flags) if flag]
        patch = f"{_names()['V_ENC_EMBD_PATCH']}.weight"
        positions = f"{_names()['V_ENC_EMBD_POS']}.weight"
        for name in (patch, patch + PATCH_SECOND, positions):
            if name not in self.source:
                self.source.close()
                raise CheckpointError(f"{self.path}: no {name}; Qwen3-VL's mmproj holds the two time steps of its "
                                      "patch kernel and the learned positions")
        vision["temporal_patch_size"] = 2  # the two kernels above
        vision["num_position_embeddings"] = self.source.entry(positions).shape[0]
        return vision

    def check_belongs(self, text_hidden: int, text_deepstack: int | None) -> None:
        """The merger must project into this text model's width (and feed as many DeepStack layers as the text
        GGUF says it takes), or the file is another model's tower."""
        width = self.vision["out_hidden_size"]
        if width != text_hidden:
            raise CheckpointError(f"{self.path}: an mmproj for another model: its projection width "
                                  f"(clip.vision.projection_dim) is {width}, this text encoder's hidden size is "
                                  f"{text_hidden}")
        levels = len(self.vision["deepstack_visual_indexes"])
        if text_deepstack is not None and levels != text_deepstack:
            raise CheckpointError(f"{self.path}: an mmproj for another model: {levels} DeepStack layers, the text "
                                  f"GGUF takes {text_deepstack} (qwen3vl.n_deepstack_layers)")

    def plan(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
        """transformers' vision parameter -> its file tensors, every name and shape checked against `shapes`."""
        deepstack = self.vision["deepstack_visual_indexes"]
        planned = {}
        for target, want in shapes.items():
            names = file_names(target, deepstack)
            missing = [n for n in names if n not in self.source]
            if not names or missing:
                raise CheckpointError(f"{self.path}: {missing[0] if missing else target} is missing (the vision "
                                      f"tower needs {target})")
            got = self.source.entry(names[0]).shape
            got = (got[0], got[1], len(names), *got[2:]) if len(names) == 2 else got
            if tuple(got) != tuple(want):
                raise CheckpointError(f"{self.path}: {' + '.join(names)} is {list(got)}, the vision tower needs "
                                      f"{list(want)} ({target})")
            planned[target] = names
        used = {n for names in planned.values() for n in names}
        extra = sorted(set(self.source.keys) - used)
        if extra:
            raise CheckpointError(f"{self.path}: {extra[0]} is not a tensor of Qwen3-VL's vision tower"
                                  + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        return planned

    def tensors(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, values in `dtype` on `device`), every tensor dequantized at load."""
        for target, names in self.plan(shapes).items():
            parts = [self._values(n, dtype, device) for n in names]
            yield target, parts[0] if len(parts) == 1 else torch.stack(parts, dim=2)

    def _values(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        entry = self.source.entry(name)
        if entry.quantized:
            return dequantize(entry, self.source.get(name), dtype, device)
        return self.source.get(name).to(device=device, dtype=dtype)

    def close(self) -> None:
        self.source.close()


def find_beside(text_file: Path, text_hidden: int, text_deepstack: int | None) -> Mmproj | None:
    """The one `mmproj*.gguf` in the text GGUF's folder that is this text model's tower (its projection width and
    DeepStack count), opened; None when there is none. A shared folder (ComfyUI's text_encoders) may hold other
    models' vision files: those are passed over. Several that fit are refused: which precision to take is the
    user's choice."""
    fitting = []
    for path in sorted(p for p in text_file.parent.iterdir()
                       if p.is_file() and p.name.lower().startswith("mmproj") and p.suffix.lower() == ".gguf"):
        try:
            candidate = Mmproj(path)
        except CheckpointError:
            continue
        try:
            candidate.check_belongs(text_hidden, text_deepstack)
        except CheckpointError:
            candidate.close()
            continue
        fitting.append(candidate)
    if len(fitting) > 1:
        for candidate in fitting:
            candidate.close()
        raise InputError(f"{text_file.parent}: {len(fitting)} mmproj files for this text encoder beside "
                         f"{text_file.name} ({', '.join(c.path.name for c in fitting)}); name the one to use with "
                         "--text-encoder-vision")
    return fitting[0] if fitting else None
