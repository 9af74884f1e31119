"""Write a safetensors file one tensor group at a time, with bounded RAM.

The header needs every tensor's dtype and shape up front, so a writer is given a plan: groups of
(name, dtype, shape) with a function that produces the group's tensors when it is its turn (a
quantized layer yields its weight, scales and marker together). The header is written first,
then each group's bytes are appended and dropped, so a 66 GB checkpoint never exists in memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ...errors import CheckpointError
from .safetensors_header import DTYPES, TORCH_TO_ST, encode_header


@dataclass
class Group:
    """Tensors written together: `entries` (name, safetensors dtype, shape) and their producer."""

    entries: list[tuple[str, str, tuple[int, ...]]]
    make: Callable[[], dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * DTYPES[dt][1] for _, dt, shape in self.entries)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def write_groups(path: str | Path, groups: Iterable[Group], metadata: dict[str, str] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> int:
    """Write the file; returns its size. The file appears under its name only once complete."""
    path = Path(path)
    groups = list(groups)
    entries = [e for g in groups for e in g.entries]
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"cannot write {path}: duplicate tensor names {', '.join(dup[:3])}")
    header, _ = encode_header(entries, metadata)
    total = sum(g.nbytes for g in groups)
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for group in groups:
                tensors = group.make()
                for name, dtype, shape in group.entries:
                    t = tensors.pop(name, None)
                    if t is None:
                        raise CheckpointError(f"internal: group did not produce {name}")
                    if TORCH_TO_ST.get(t.dtype) != dtype or tuple(t.shape) != tuple(shape):
                        raise CheckpointError(f"internal: {name} is {t.dtype} {list(t.shape)}, planned {dtype} {list(shape)}")
                    f.write(_tensor_bytes(t))
                    done += t.numel() * t.element_size()
                if tensors:
                    raise CheckpointError(f"internal: group produced unplanned tensors {', '.join(sorted(tensors)[:3])}")
                del tensors
                if progress is not None:
                    progress(done, total)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(header) + total
