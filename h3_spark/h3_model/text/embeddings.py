"""Prompt embeddings (textual inversion): `embedding:NAME` in a prompt puts a file's vectors into the text encoder's
input at that place.

The syntax is ComfyUI's: `embedding:NAME` at the start of the prompt or after a space or a new line; NAME runs to
the next whitespace, and trailing commas are the text's, not the name's. The whitespace before `embedding:` and
the whitespace after the name separate it from the text around it, and each run of text is tokenized on its own
(as ComfyUI does). Each row of the file's tensor takes one token position of Qwen3-VL's input embeddings (its
`embed_tokens` output), tagged text for the DiT; the rows go in as stored, cast to the encoder's dtype.

Files: NAME, or NAME.safetensors, inside one of the embeddings folders (ComfyUI's `models/embeddings`, the CLI's
`--embeddings DIR`); a name may not leave its folder. safetensors only: a .pt / .bin (pickle) is refused, never
opened. The tensor is the file's only one, or the one under a key ComfyUI's loader reads for this model
(`qwen3vl_32b`, the MiniMax H3 encoder's embedding key) or for textual-inversion files (`emb_params`,
`string_to_param.*`); it is (width,) for one vector or (rows, width), width the text encoder's hidden size (5120
for the released Qwen3-VL-32B). Anything else is refused in one line naming the embedding and the file, from the
file's header, before the text encoder loads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ...errors import CheckpointError, InputError

PREFIX = "embedding:"
SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".pt", ".bin", ".pth", ".ckpt")
# The keys a file with several tensors may keep its vectors under, in the order they are looked for: the MiniMax
# H3 text encoder's embedding key in ComfyUI, then the textual-inversion exports' names.
KEYS = ("qwen3vl_32b", "emb_params")
KEY_PREFIXES = ("string_to_param.",)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# `embedding:` where ComfyUI's tokenizer sees one: at the start, or after a space or a new line.
_REFERENCE = re.compile(r"(?:^|(?<=[ \n]))" + re.escape(PREFIX))


@dataclass(frozen=True)
class EmbeddingRef:
    """`embedding:NAME` as written in a prompt."""

    name: str


def split_prompt(prompt: str) -> list[str | EmbeddingRef]:
    """The prompt as runs of text and the embeddings between them, in order (no empty runs)."""
    parts: list[str | EmbeddingRef] = []
    rest = prompt
    while True:
        match = _REFERENCE.search(rest)
        if match is None:
            break
        before = rest[:match.start()]
        if match.start() > 0:
            before = before[:-1]  # the space or new line before `embedding:` separates, like ComfyUI's split
        after = rest[match.end():]
        word = re.match(r"\S*", after).group(0)
        name = word.rstrip(",")
        if not name:
            raise InputError(f"the prompt writes {PREFIX!r} without a name; write embedding:NAME")
        parts += [before] if before else []
        parts.append(EmbeddingRef(name))
        tail = after[len(name):]
        rest = re.sub(r"^\s", "", tail, count=1) if tail[:1].isspace() else tail
    if rest:
        parts.append(rest)
    return parts


def names_in(prompt: str) -> list[str]:
    return [p.name for p in split_prompt(prompt) if isinstance(p, EmbeddingRef)]


@dataclass(frozen=True)
class EmbeddingFile:
    """Where an embedding's vectors are: the file, the tensor's key, and its (rows, width)."""

    name: str
    path: Path
    key: str
    rows: int
    width: int


class EmbeddingLibrary:
    """The embeddings folders a prompt's `embedding:NAME` are found in, and the vectors read from them."""

    def __init__(self, folders: Sequence[str | os.PathLike]):
        self.folders = [Path(f) for f in folders]
        for folder in self.folders:
            if not folder.is_dir():
                raise InputError(f"embeddings folder {folder}: no such folder")
        self._rows: dict[Path, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"EmbeddingLibrary({[str(f) for f in self.folders]})"

    def find(self, name: str) -> Path:
        """The file `name` names: NAME itself or NAME.safetensors, in the first folder that has it."""
        looked = []
        for folder in self.folders:
            root = folder.resolve()
            base = (folder / name).resolve()
            if os.path.commonpath([root, base]) != str(root) or base == root:
                raise InputError(f"embedding:{name}: the name leaves the embeddings folder {folder}")
            for path in (base, base.with_name(base.name + SUFFIX)):
                looked.append(path)
                if path.is_file():
                    if path.suffix.lower() in PICKLE_SUFFIXES:
                        raise InputError(f"embedding:{name}: {path} is a pickle file ({path.suffix}), which h3-spark "
                                         "does not open; convert it to .safetensors")
                    if path.suffix.lower() != SUFFIX:
                        raise InputError(f"embedding:{name}: {path} is not a .safetensors file")
                    return path
            pickled = [base.with_name(base.name + s) for s in PICKLE_SUFFIXES]
            found = next((p for p in pickled if p.is_file()), None)
            if found is not None:
                raise InputError(f"embedding:{name}: {found} is a pickle file ({found.suffix}), which h3-spark does "
                                 "not open; convert it to .safetensors")
        where = ", ".join(str(f) for f in self.folders)
        raise InputError(f"embedding:{name}: no {name}{'' if name.endswith(SUFFIX) else SUFFIX} in the embeddings "
                         f"folder{'s' if len(self.folders) > 1 else ''} {where}")

    def describe(self, name: str, width: int | None = None) -> EmbeddingFile:
        """The embedding's file, key and shape from the safetensors header alone (no tensor is read), checked:
        a float tensor of one or two dimensions, at least one row, `width` wide when given."""
        from ..checkpoint.safetensors_header import read_header

        path = self.find(name)
        try:
            header = read_header(path).tensors
        except CheckpointError as exc:
            raise InputError(f"embedding:{name}: {exc}") from None
        key = _pick_key(name, path, header)
        shape, dtype = header[key].shape, header[key].dtype
        if dtype not in FLOAT_DTYPES:
            raise InputError(f"embedding:{name}: {path} tensor {key!r} is {dtype}; an embedding is floating point")
        if len(shape) not in (1, 2) or 0 in shape:
            raise InputError(f"embedding:{name}: {path} tensor {key!r} has shape {list(shape)}; an embedding is "
                             "(width,) or (rows, width)")
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        if width is not None and cols != width:
            raise InputError(f"embedding:{name}: {path} is {cols} wide, but the text encoder's hidden size is "
                             f"{width}: it was made for another text encoder")
        return EmbeddingFile(name, path, key, rows, cols)

    def check_prompt(self, prompt: str, width: int | None = None) -> list[EmbeddingFile]:
        """Every embedding the prompt names, found and checked from its header (before any weight loads)."""
        return [self.describe(name, width) for name in names_in(prompt)]

    def rows(self, name: str, width: int) -> torch.Tensor:
        """The embedding's vectors, float32 (rows, width); read once per file."""
        from safetensors import safe_open

        info = self.describe(name, width)
        if info.path not in self._rows:
            with safe_open(str(info.path), framework="pt", device="cpu") as f:
                tensor = f.get_tensor(info.key).float().reshape(info.rows, info.width)
            if not torch.isfinite(tensor).all():
                raise InputError(f"embedding:{name}: {info.path} tensor {info.key!r} holds NaN or infinite values")
            self._rows[info.path] = tensor
        return self._rows[info.path]


def _pick_key(name: str, path: Path, header: dict) -> str:
    if len(header) == 1:
        return next(iter(header))
    for key in KEYS:
        if key in header:
            return key
    prefixed = [k for k in header if k.startswith(KEY_PREFIXES)]
    if len(prefixed) == 1:
        return prefixed[0]
    keys = ", ".join(sorted(header)[:8]) or "none"
    raise InputError(f"embedding:{name}: {path} holds {len(header)} tensors ({keys}) and none under a key an "
                     f"embedding is read from ({', '.join(KEYS)}, string_to_param.*)")


def no_library_message(prompt: str) -> str | None:
    """The refusal for a prompt naming embeddings when no embeddings folder is given (None when it names none)."""
    names = names_in(prompt)
    if not names:
        return None
    return (f"the prompt names embedding:{names[0]} but no embeddings folder is given (the CLI's --embeddings DIR, "
            "ComfyUI's models/embeddings)")


def write_embedding(path: str | os.PathLike, width: int, rows: int = 2, *, seed: int = 0,
                    key: str = "emb_params") -> Path:
    """A synthetic embedding file: `rows` random vectors of `width` (the text encoder's hidden size) as float32
    under `key`, at about the scale of Qwen's token embeddings."""
    from safetensors.torch import save_file

    if rows < 1 or width < 1:
        raise InputError(f"an embedding needs at least one row and a width, got {rows} x {width}")
    path = Path(path)
    if path.suffix.lower() != SUFFIX:
        raise InputError(f"an embedding is written as .safetensors, got {path}")
    gen = torch.Generator().manual_seed(seed)
    save_file({key: 0.02 * torch.randn(rows, width, generator=gen)}, str(path),
              metadata={"h3_spark": "synthetic embedding"})
    return path
