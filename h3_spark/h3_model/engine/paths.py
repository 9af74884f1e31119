"""Where each component of a model folder lives, in the layouts people download.

Today's official download (`hf download MiniMaxAI/MiniMax-H3 --include "Ref2VA/*" "FL2VA/*"`) holds one
folder per mode, and a root index:

    <root>/modular_model_index.json
    <root>/FL2VA/   model_index.json, transformer/, text_encoder/, tokenizer/, processor/, video_vae/, audio_vae/
    <root>/Ref2VA/  the same names

Each mode folder's model_index.json says which DiT it holds (`_minimax_h3.partition`), the flow shifts it samples
with (`_minimax_h3.sigma_shift_scales`) and names its tokenizer folder (`tokenizer`: tokenizer/).

FL2VA/transformer runs T2VA and FL2VA, Ref2VA/transformer runs Ref2VA; the text encoder and the VAEs of the two
mode folders are the same models, so they are loaded once (from the first mode folder that has them). A mode
folder can also be given on its own: its model_index.json (`_minimax_h3.partition`) says which DiT it holds.
Older revisions put everything at the root: transformer/, transformer_ref/, text_encoder/, tokenizer/, vae/,
audio_vae/. A component given on its own (--dit, --vae, ...) always wins over the folder.

GGUF: a DiT or text encoder may be a `.gguf` file, given on its own (--dit, --dit-ref, --text-encoder) or as the
one `.gguf` file in the component's folder (`FL2VA/transformer/minimax_h3_fl2va_pruned-Q4_K.gguf`), which then
stands for the folder; llama.cpp's `mmproj*.gguf` beside a text encoder is not the text encoder. A GGUF holds one
DiT partition, named by its file (fl2va / ref2va, as the published files are).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import InputError
from ..checkpoint.source import MODE_FOLDERS, mode_folders, release_shifts

COMPONENTS = ("dit", "dit_ref", "text_encoder", "tokenizer", "vae", "audio_vae")
DIT_PARTITIONS = {"dit": "t2va", "dit_ref": "ref2va"}
OLD_FOLDERS = {"dit": "transformer", "dit_ref": "transformer_ref", "text_encoder": "text_encoder",
               "tokenizer": "tokenizer", "vae": "vae", "audio_vae": "audio_vae"}
# The tokenizer is the folder model_index.json names for it (tokenizer/: the tokenizer files only); the text
# encoder finds the Qwen3-VL processor's image / video configs in processor/ beside it. A mode folder whose
# model_index.json names no tokenizer/ (or that lacks it) is read from processor/, which holds both.
MODE_SUBFOLDERS = {"dit": "transformer", "dit_ref": "transformer", "text_encoder": "text_encoder",
                   "tokenizer": "processor", "vae": "video_vae", "audio_vae": "audio_vae"}
# The components a GGUF file can hold.
GGUF_COMPONENTS = ("dit", "dit_ref", "text_encoder")


@dataclass
class ComponentPaths:
    models: Path | None = None
    dit: Path | None = None
    dit_ref: Path | None = None
    text_encoder: Path | None = None
    tokenizer: Path | None = None
    vae: Path | None = None
    audio_vae: Path | None = None

    def check_models(self) -> None:
        if self.models is not None and not Path(self.models).is_dir():
            raise InputError(f"{self.models}: no such model folder (--models)")

    def mode_folders(self) -> dict[str, Path]:
        """The released mode folders under --models, by partition (empty for the older layout)."""
        if self.models is None:
            return {}
        return mode_folders(Path(self.models))

    def layout(self) -> str:
        """"per-mode" (today's official download), "root" (older revisions) or "components" (no --models)."""
        if self.models is None:
            return "components"
        return "per-mode" if self.mode_folders() else "root"

    def resolve(self, name: str) -> Path | None:
        """The path of component `name` (see COMPONENTS), or None when neither a flag nor the folder gives one."""
        if name not in COMPONENTS:
            raise InputError(f"unknown component {name!r}; components are {', '.join(COMPONENTS)}")
        given = getattr(self, name)
        if given is not None:
            if not Path(given).exists():
                raise InputError(f"{given}: no such file or folder (--{name.replace('_', '-')})")
            return Path(given)
        if self.models is None:
            return None
        modes = self.mode_folders()
        if not modes:
            candidate = Path(self.models) / OLD_FOLDERS[name]
            return _gguf_in(candidate, name) if candidate.exists() else None
        if name in DIT_PARTITIONS:
            folders = [modes[DIT_PARTITIONS[name]]] if DIT_PARTITIONS[name] in modes else []
        else:
            folders = [modes[p] for p in MODE_FOLDERS if p in modes]
        for folder in folders:
            candidate = _named_tokenizer(folder) if name == "tokenizer" else None
            candidate = candidate or folder / MODE_SUBFOLDERS[name]
            if candidate.exists():
                return _gguf_in(candidate, name)
        return None

    def sigma_shifts(self, name: str) -> tuple[float, float] | None:
        """The (video, audio) flow shifts the model folder gives DiT `name` ("dit", "dit_ref"): the
        `_minimax_h3.sigma_shift_scales` of the model_index.json of its mode folder (per-mode download) or of the
        root (older layout); None for a DiT given on its own or a folder that does not say."""
        if getattr(self, name) is not None or self.models is None:
            return None
        modes = self.mode_folders()
        if not modes:
            return release_shifts(Path(self.models))
        folder = modes.get(DIT_PARTITIONS[name])
        return release_shifts(folder) if folder is not None else None

    def folder_hint(self, name: str) -> str:
        """Which folder a missing component is looked for in, for error messages."""
        if self.layout() == "per-mode" and name in DIT_PARTITIONS:
            return f"{MODE_FOLDERS[DIT_PARTITIONS[name]]}/transformer/"
        return f"{OLD_FOLDERS[name]}/"


def _named_tokenizer(folder: Path) -> Path | None:
    """The tokenizer/ folder a mode folder's model_index.json names (its `tokenizer` entry), when it is there."""
    from ..json_file import read_json

    index = folder / "model_index.json"
    if not index.is_file() or not read_json(index).get("tokenizer"):
        return None
    candidate = folder / "tokenizer"
    return candidate if candidate.is_dir() else None


def _gguf_in(folder: Path, name: str) -> Path:
    """The component's folder, or the one GGUF file that folder holds in place of safetensors weights."""
    if name not in GGUF_COMPONENTS or not folder.is_dir():
        return folder
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")):
        return folder
    found = sorted(p for p in folder.glob("*.gguf") if p.is_file() and "mmproj" not in p.name.lower())
    if len(found) > 1:
        flag = "--" + name.replace("_", "-")
        raise InputError(f"{folder}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}); "
                         f"choose one with {flag}")
    return found[0] if found else folder
