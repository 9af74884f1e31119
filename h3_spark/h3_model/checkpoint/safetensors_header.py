"""The safetensors container read by hand: 8-byte little-endian header length, JSON header, data.

We parse the header ourselves (instead of asking the safetensors library) for two reasons:
`inspect` must explain *why* a file is broken in one line, and it must stay at header cost on a
60 GB file. Tensor data is never touched here except through `read_small`, which reads the few
bytes of a scalar or a marker tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import CheckpointError

# safetensors dtype name -> (torch dtype or None when torch has no such dtype, bytes per element).
# Element size is what the format defines; it is what the offsets are checked against.
DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 1),
    "I16": (torch.int16, 2),
    "U16": (torch.uint16, 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.uint32, 4),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "U64": (torch.uint64, 8),
}
TORCH_TO_ST = {dt: name for name, (dt, _) in DTYPES.items() if dt is not None}

# A header is JSON describing at most a few thousand tensors; anything far larger is not a header.
MAX_HEADER_BYTES = 256 * 1024 * 1024
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it; `begin`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = DTYPES[self.dtype][0]
        if dt is None:
            raise CheckpointError(f"{self.name}: dtype {self.dtype} is not available in this PyTorch build")
        return dt


@dataclass(frozen=True)
class Header:
    path: Path
    file_size: int
    header_size: int  # the JSON part, without the 8-byte length prefix
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]  # in header order

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate a safetensors header; every problem is one CheckpointError line."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder, expected a .safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            if prefix.startswith(_PICKLE_MAGIC) or prefix[:1] == b"\x80":
                raise CheckpointError(f"{path}: not a safetensors file (looks like a PyTorch pickle); "
                                      "only safetensors is accepted")
            raise CheckpointError(f"{path}: truncated header: the file has {size} bytes, "
                                  "fewer than the 8-byte header length")
        if prefix.startswith(_PICKLE_MAGIC):
            raise CheckpointError(f"{path}: not a safetensors file (looks like a PyTorch pickle or zip archive); "
                                  "only safetensors is accepted")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} is implausible "
                                      f"for a {size}-byte file)")
            raise CheckpointError(f"{path}: header length {n} runs past the end of the file "
                                  f"({size} bytes; the file is truncated)")
        if n < 2:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        raw = f.read(n)
    if raw[:1] != b"{":
        raise CheckpointError(f"{path}: not a safetensors file (the header does not start with a JSON object)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a safetensors file (the header is not UTF-8)") from None
    try:
        header = json.loads(text.rstrip(" "))
    except json.JSONDecodeError as exc:
        if _unclosed(text):
            raise CheckpointError(f"{path}: truncated header: the JSON ends early ({exc.msg})") from None
        raise CheckpointError(f"{path}: not a safetensors file (header JSON invalid: {exc.msg} at byte {exc.pos})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (the header is not a JSON object)")
    return _validate(path, size, n, header)


def _unclosed(text: str) -> bool:
    """Whether JSON text stops inside a string or with an object/array still open (it was cut short)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_string or depth > 0


def _validate(path: Path, size: int, n: int, header: dict) -> Header:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise CheckpointError(f"{path}: tensor {name!r} lacks dtype/shape/data_offsets in the header")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        if end > data_len or begin > end:
            raise CheckpointError(f"{path}: tensor {name!r} data offsets [{begin}, {end}] run past the end of the "
                                  f"file (data section is {data_len} bytes)")
        expected = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != expected:
            raise CheckpointError(f"{path}: tensor {name!r} occupies {end - begin} bytes but {dtype} {shape} "
                                  f"needs {expected}")
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    _check_coverage(path, tensors, data_start, size)
    return Header(path, size, n, dict(metadata), tensors)


def _check_coverage(path: Path, tensors: dict[str, TensorEntry], data_start: int, size: int) -> None:
    """The tensors must tile the data section exactly, as the safetensors library requires.

    The library refuses a gap or trailing bytes only when a tensor is first read, minutes into a
    load and with a raw traceback; here it is one line at header cost.
    """
    pos, previous = data_start, None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise CheckpointError(f"{path}: tensors {previous!r} and {t.name!r} overlap in the data section")
        if t.begin > pos:
            raise CheckpointError(f"{path}: {t.begin - pos} bytes of the data section before tensor {t.name!r} "
                                  "belong to no tensor (the safetensors library refuses such a file)")
        pos, previous = t.end, t.name
    if pos != size:
        raise CheckpointError(f"{path}: {size - pos} trailing bytes after the last tensor's data "
                              "(the safetensors library refuses such a file)")


def read_small(header: Header, name: str, max_bytes: int = 1 << 16) -> torch.Tensor:
    """Read one small tensor (a scalar scale, a `.comfy_quant` marker) straight from the file."""
    entry = header.tensors[name]
    if entry.nbytes > max_bytes:
        raise CheckpointError(f"{header.path}: {name} is {entry.nbytes} bytes, too large for a header-cost read")
    with open(header.path, "rb") as f:
        f.seek(entry.begin)
        raw = f.read(entry.nbytes)
    dt = entry.torch_dtype
    if not raw:
        return torch.empty(entry.shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=dt).reshape(entry.shape).clone()


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix + JSON, space-padded to 8-byte alignment) for tensors laid out in order.

    Returns the bytes and the relative data offset of each tensor.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets = []
    pos = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise CheckpointError(f"cannot write {name}: unknown safetensors dtype {dtype}")
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Alignment keeps every tensor's data start 8-byte aligned relative to the file start.
    text += b" " * (-(len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, offsets
