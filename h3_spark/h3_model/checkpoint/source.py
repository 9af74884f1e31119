"""Where a checkpoint's tensors live: one .safetensors file, or a diffusers folder of shards.

`CheckpointSource` knows every tensor's header entry (cheap) and reads tensor data on demand
through safetensors' memory map, one tensor at a time, so a 60 GB checkpoint never needs its size
in RAM. Accepted paths:
- a `.safetensors` file;
- a diffusers component folder (`transformer/`, `transformer_ref/`): `config.json` plus
  `diffusion_pytorch_model.safetensors` or shards listed in `...safetensors.index.json`;
- a released mode folder's `transformer/` (MiniMaxAI's per-mode download): `config.json` plus shards
  listed in `model.safetensors.index.json`;
- the parent of those folders, with `partition` choosing `transformer/` (t2va, fl2va) or
  `transformer_ref/` (ref2va);
- a released mode folder (FL2VA/, Ref2VA/: its model_index.json says which DiT it holds) or the download's root
  that holds them, with `partition` choosing FL2VA/transformer/ (t2va, fl2va) or Ref2VA/transformer/ (ref2va);
- MiniMaxAI's video_vae/ or audio_vae/ folder: the weights its config.json names (for inspect).
A `.gguf` file opens as a `GgufSource` (gguf_source.py), which answers the same questions.
Pickle checkpoints (.bin, .pt, .ckpt) are refused: loading them can run code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors import SafetensorError

from ...errors import CheckpointError, InputError
from .safetensors_header import Header, TensorEntry, read_header, read_small

if TYPE_CHECKING:
    from .gguf_source import GgufSource

PARTITION_FOLDERS = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
# MiniMaxAI's per-mode folders: FL2VA/transformer runs t2va and fl2va, Ref2VA/transformer runs ref2va.
MODE_FOLDER_NAMES = {"fl2va": "t2va", "ref2va": "ref2va"}
# The partition names of a mode folder's model_index.json (`_minimax_h3.partition`).
INDEX_PARTITIONS = {"fl2va": "t2va", "t2va": "t2va", "ref2va": "ref2va"}
# The mode folders of the per-mode download, by the partition their DiT runs.
MODE_FOLDERS = {"t2va": "FL2VA", "ref2va": "Ref2VA"}
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# MiniMaxAI's per-mode folders (FL2VA/transformer, Ref2VA/transformer) name their shard index this way.
INDEX_NAMES = (INDEX_NAME, "model.safetensors.index.json")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointSource:
    """The headers of one checkpoint (one or more files) and lazy, memory-mapped tensor reads."""

    def __init__(self, path: Path, headers: list[Header], config_path: Path | None):
        self.path = path
        self.headers = headers
        self.config_path = config_path
        self._where: dict[str, Header] = {}
        for h in headers:
            for name in h.tensors:
                if name in self._where:
                    raise CheckpointError(f"{path}: tensor {name} appears in both {self._where[name].path.name} "
                                          f"and {h.path.name}")
                self._where[name] = h
        self._handles: dict[Path, object] = {}

    # -- header-level facts (no tensor data)
    @property
    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._where[name].tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} not found") from None

    def header_of(self, name: str) -> Header:
        return self._where[name]

    @property
    def metadata(self) -> dict[str, str]:
        """Metadata of the first file (shards of one checkpoint carry the same)."""
        return dict(self.headers[0].metadata) if self.headers else {}

    @property
    def total_bytes(self) -> int:
        return sum(h.file_size for h in self.headers)

    def file_order(self) -> list[str]:
        """Tensor names in on-disk order (file by file, by offset): sequential reads on a disk."""
        out = []
        for h in self.headers:
            out.extend(sorted(h.tensors, key=lambda n: h.tensors[n].begin))
        return out

    # -- tensor data
    def read_small(self, name: str) -> torch.Tensor:
        """A marker, scalar or other tiny tensor, read with plain file I/O (no memory map of the file)."""
        header = self._where.get(name)
        if header is None:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        return read_small(header, name)

    def get(self, name: str) -> torch.Tensor:
        header = self._where.get(name)
        if header is None:
            raise CheckpointError(f"{self.path}: tensor {name} not found")
        try:
            return self._read(header, name)
        except SafetensorError as exc:
            # Our header check passed, so the file changed since, or the library checks more than we do.
            raise CheckpointError(f"{header.path}: safetensors cannot read tensor {name}: {exc}") from None

    def _read(self, header: Header, name: str) -> torch.Tensor:
        handle = self._handles.get(header.path)
        try:
            if handle is None:
                handle = self._handles[header.path] = self._open(header.path, "mmap")
            return handle.get_tensor(name)
        except (RuntimeError, SafetensorError) as exc:
            # safetensors maps the whole file copy-on-write; a kernel that will not commit a file
            # larger than RAM refuses that. pread(2) reads the same bytes, tensor by tensor.
            if "mmap" not in str(exc):
                raise
            handle = self._handles[header.path] = self._open(header.path, "pread")
            return handle.get_tensor(name)

    @staticmethod
    def _open(path: Path, backend: str):
        from safetensors import safe_open

        if backend == "mmap":
            return safe_open(str(path), framework="pt", device="cpu")
        try:
            return safe_open(str(path), framework="pt", device="cpu", backend=backend)
        except TypeError:
            raise CheckpointError(f"{path}: cannot memory-map this {path.stat().st_size}-byte file and this "
                                  "safetensors has no pread backend; install safetensors>=0.8") from None

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.file_order():
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release_info(folder: Path) -> tuple[Path, object]:
    """(the folder's model_index.json, its `_minimax_h3` entry: None where the file or the entry is not there);
    a file that is there must be readable JSON."""
    index = folder / "model_index.json"
    if not index.is_file():
        return index, None
    try:
        data = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{index}: not readable JSON ({exc})") from None
    return index, data.get("_minimax_h3") if isinstance(data, dict) else None


def mode_partition(folder: Path) -> str | None:
    """"t2va" or "ref2va" for a released mode folder (FL2VA/, Ref2VA/), None for any other folder."""
    index, info = _release_info(folder)
    if not index.is_file():
        return None
    if isinstance(info, dict) and info.get("partition") is not None:
        partition = INDEX_PARTITIONS.get(str(info["partition"]).lower())
        if partition is None:
            raise InputError(f"{index}: unknown _minimax_h3.partition {info['partition']!r} (expected fl2va or "
                             "ref2va)")
        return partition
    return MODE_FOLDER_NAMES.get(folder.name.lower())


def release_shifts(folder: Path) -> tuple[float, float] | None:
    """(video, audio) flow shifts of a released model folder: `_minimax_h3.sigma_shift_scales` of its
    model_index.json (each mode folder carries its own, as SGLang reads them), None when the file or the field is
    not there. A field that is there must hold both shifts, each a positive finite number."""
    import math

    index, info = _release_info(folder)
    scales = info.get("sigma_shift_scales") if isinstance(info, dict) else None
    if scales is None:
        return None
    if not isinstance(scales, dict):
        raise CheckpointError(f"{index}: _minimax_h3.sigma_shift_scales must be an object with video and audio, "
                              f"got {scales!r}")
    shifts = []
    for stream in ("video", "audio"):
        value = scales.get(stream)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{index}: _minimax_h3.sigma_shift_scales.{stream} must be a positive number, "
                                  f"got {value!r}")
        shifts.append(float(value))
    return shifts[0], shifts[1]


def mode_folders(root: Path) -> dict[str, Path]:
    """The released mode folders at `root`, by partition ("t2va", "ref2va"): `root` itself when it is one (its
    model_index.json says which), else its FL2VA/ and Ref2VA/ children; empty for any other folder."""
    own = mode_partition(root)
    if own is not None:
        return {own: root}
    return {partition: root / name for partition, name in MODE_FOLDERS.items() if (root / name).is_dir()}


def _wanted(partition: str) -> str:
    return "ref2va" if partition == "ref2va" else "t2va"


def resolve_dit_folder(path: Path, partition: str | None) -> Path:
    """Pick the DiT component folder for a folder path: the folder itself, a partition child (transformer/,
    transformer_ref/), or the transformer/ of a released mode folder (FL2VA/, Ref2VA/ or their parent)."""
    if partition is not None and partition not in PARTITION_FOLDERS:
        raise CheckpointError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITION_FOLDERS)}")
    if _looks_like_component(path):
        owner = mode_partition(path.parent) if path.name == "transformer" else None
        if partition is not None and owner is not None:
            if owner != _wanted(partition):
                raise CheckpointError(f"{path}: holds the {owner} DiT ({path.parent.name}/model_index.json says so) "
                                      f"but partition={partition!r} asks for the {_wanted(partition)} one, which "
                                      f"is in {MODE_FOLDERS[_wanted(partition)]}/transformer/")
        elif partition is not None and path.name in PARTITION_FOLDERS.values() \
                and path.name != PARTITION_FOLDERS[partition]:
            raise CheckpointError(f"{path}: is the {path.name}/ folder but partition={partition!r} asks for "
                                  f"{PARTITION_FOLDERS[partition]}/")
        return path
    modes = mode_folders(path) if path.is_dir() else {}
    if modes:
        return _mode_dit(path, modes, partition)
    present = [name for name in ("transformer", "transformer_ref") if _looks_like_component(path / name)]
    if not present:
        raise CheckpointError(f"{path}: no safetensors weights here, no transformer/ or transformer_ref/ folder and "
                              f"no {' or '.join(m + '/' for m in MODE_FOLDERS.values())} mode folder")
    if partition is None:
        if len(present) > 1:
            raise CheckpointError(f"{path}: holds both transformer/ and transformer_ref/; choose the partition: t2va "
                                  "(or fl2va) for transformer/, ref2va for transformer_ref/ (--partition on the "
                                  "command line)")
        return path / present[0]
    wanted = PARTITION_FOLDERS[partition]
    if wanted not in present:
        raise CheckpointError(f"{path}: partition {partition!r} needs {wanted}/, which is not there "
                              f"(found {', '.join(p + '/' for p in present)})")
    return path / wanted


def _mode_dit(path: Path, modes: dict[str, Path], partition: str | None) -> Path:
    """The transformer/ of the per-mode download's mode folder that holds the partition asked for."""
    if partition is None:
        if len(modes) > 1:
            raise CheckpointError(f"{path}: holds {' and '.join(m.name + '/' for m in modes.values())}; choose the "
                                  "partition: t2va (or fl2va) for FL2VA/transformer/, ref2va for Ref2VA/transformer/ "
                                  "(--partition on the command line)")
        folder = next(iter(modes.values()))
    else:
        wanted = _wanted(partition)
        if wanted not in modes:
            have = next(iter(modes))
            if modes[have] == path:  # a mode folder given on its own holds the other DiT
                raise CheckpointError(f"{path}: holds the {have} DiT ({path.name}/model_index.json says so); the "
                                      f"{wanted} DiT of partition={partition!r} is in the "
                                      f"{MODE_FOLDERS[wanted]}/transformer/ folder of the download")
            raise CheckpointError(f"{path}: partition {partition!r} needs {MODE_FOLDERS[wanted]}/transformer/, and "
                                  f"there is no {MODE_FOLDERS[wanted]}/ here (found "
                                  f"{', '.join(m.name + '/' for m in modes.values())})")
        folder = modes[wanted]
    dit = folder / "transformer"
    if not _looks_like_component(dit):
        raise CheckpointError(f"{dit}: no safetensors weights (the {folder.name}/ mode folder's DiT)")
    return dit


def _released_vae_weights(folder: Path) -> Path | None:
    """The weights file MiniMaxAI's video_vae/ or audio_vae/ folder names in its config.json (the video VAE's sit
    in source/), or None for any other folder."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    from ..json_file import read_json
    from ..vae import released

    wrapper = read_json(config)
    return released.weights_file(folder, wrapper) if released.is_released(wrapper) else None


def _looks_like_component(path: Path) -> bool:
    return path.is_dir() and (any((path / name).exists() for name in INDEX_NAMES) or any(path.glob("*.safetensors")))


def _sibling_config(path: Path) -> Path | None:
    """The config.json of the diffusers folder a lone weights file sits in (its sizes are then known, not
    guessed from shapes); a shard of a sharded folder is refused, since the rest of the model is elsewhere."""
    folder = path.parent
    index = next((name for name in INDEX_NAMES if (folder / name).exists()), None)
    if index is not None:
        raise CheckpointError(f"{path.name} is one shard of the sharded diffusers folder {folder.name}/ (see its "
                              f"{index}): choose the folder, not a file inside it")
    config = folder / "config.json"
    return config if config.is_file() else None


def open_source(path: str | Path, *, partition: str | None = None) -> "CheckpointSource | GgufSource":
    """Open a checkpoint file or folder (headers only; tensor data is read lazily). A GGUF file holds one DiT
    partition or one text encoder, so `partition` does not apply to it (as to any single file)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .gguf_source import GgufSource

        return GgufSource(path)
    if path.is_file():
        if path.suffix.lower() in _PICKLE_SUFFIXES:
            raise CheckpointError(f"{path}: pickle checkpoints are not loaded (they can run code); "
                                  "convert it to .safetensors")
        return CheckpointSource(path, [read_header(path)], _sibling_config(path))
    vae_weights = _released_vae_weights(path)
    if vae_weights is not None:
        return CheckpointSource(path, [read_header(vae_weights)], None)
    folder = resolve_dit_folder(path, partition)
    config = folder / "config.json"
    config_path = config if config.exists() else None
    index = next((folder / name for name in INDEX_NAMES if (folder / name).exists()), None)
    if index is not None:
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a weight_map object)") from None
        shard_names = list(dict.fromkeys(weight_map.values()))
        headers = []
        for shard in shard_names:
            shard_path = folder / shard
            if not shard_path.exists():
                raise CheckpointError(f"{index}: lists shard {shard}, which is missing")
            headers.append(read_header(shard_path))
        source = CheckpointSource(folder, headers, config_path)
        listed, actual = set(weight_map), set(source.keys)
        if listed != actual:
            diff = sorted(listed ^ actual)
            raise CheckpointError(f"{index}: weight_map and the shards disagree on {len(diff)} tensors, "
                                  f"e.g. {', '.join(diff[:3])}")
        for name, shard in weight_map.items():
            if source.header_of(name).path.name != shard:
                raise CheckpointError(f"{index}: {name} is listed in {shard} but stored in "
                                      f"{source.header_of(name).path.name}")
        return source
    single = folder / WEIGHTS_NAME
    files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES]
        hint = f" (found {', '.join(pickles[:3])}: pickle files are not loaded)" if pickles else ""
        raise CheckpointError(f"{folder}: no .safetensors weights{hint}")
    if len(files) > 1:
        raise CheckpointError(f"{folder}: {len(files)} .safetensors files but no {INDEX_NAME} to say how they fit")
    return CheckpointSource(folder, [read_header(files[0])], config_path)
