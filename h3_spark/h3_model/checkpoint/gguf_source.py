"""A GGUF file as a checkpoint source: the same questions `CheckpointSource` answers, for `.gguf` files.

GGUF (llama.cpp's container) holds typed key/values, a tensor-info table and aligned tensor data. It is read
with gguf-py's `GGUFReader` (the file memory-mapped; the tensors views of that map). What is checked at
open, each failure one line naming the file and, where there is one, the tensor:
- the 4-byte magic `GGUF`, a version the installed gguf reads (2 and 3), little-endian byte order, a header
  that is all there;
- every tensor: a GGML type gguf knows, rows that are whole blocks of it, bytes that fit in the file and
  exactly fill the space before the next tensor (GGUF stores no byte count: the type and the dims give it,
  and a wrong type or shape shows as a tensor running into the next one, or leaving a gap);
- nothing about `general.architecture`: the component readers judge it (a DiT reader loads a file that declares
  another architecture when its tensor names and shapes are H3's, with a note; a file that is not H3 is refused
  there, naming the declared architecture).

Dims. GGUF lists a tensor's dims fastest first (`ne[0]` is the row length), the reverse of PyTorch: a
linear weight [N out, K in] is stored as ne = [K, N], rows of K values one after another, which is the
row-major [N, K] layout, so a row range is a contiguous byte range. `entry().shape` is the PyTorch order.
ComfyUI-GGUF's converter may store a tensor whose rows are not whole blocks as [n / 256, 256] and record
the real shape under `comfy.gguf.orig_shape.<name>`; `shape` is then that shape, `stored_shape` the file's.

What `get` returns: F32 / F16 / BF16 tensors as torch tensors of their dtype and shape, views of the map
(copy-on-write, as safetensors maps); block-quantized tensors as their raw blocks, uint8 [rows, row_bytes]
views, which `StoredForm("gguf", ...)` keeps and `dequantize` turns into values.

The published H3 GGUFs (facts from ComfyUI-GGUF, stable-diffusion.cpp, audio.cpp):
- DiTs keep ComfyUI's single-file names (`blocks.N.attn.qkv_proj.weight`, ..., `rope.inv_freq`; the
  stable-diffusion.cpp converter prefixes `model.diffusion_model.` when given the file as a diffusion
  model). city96/ComfyUI-GGUF forks' tools/convert.py declare `general.architecture = minimax_h3`
  (ComfyUI-GGUF PR #476: `minimax_h3_fl2va_pruned_fp8_Q4_0.gguf`); the stable-diffusion.cpp files
  (unsloth/MiniMax-H3-GGUF `minimax_h3_{fl2va,ref2va}_pruned-{Q2_K,Q3_K,Q4_K,Q5_0,Q6_K,Q8_0}.gguf`,
  leejet/MiniMax-H3-GGUF) carry no metadata at all (PR #480: kv_count = 0, 532 tensors); one community
  repack (`MiniMax-H3-FL2VA-Q3_K_M.gguf`, PR #476) mislabels itself `wan` while holding H3's tensors
  (ComfyUI-GGUF loads it by its names): the DiT reader loads it with a note.
- Text encoders: llama.cpp's Qwen3-VL conversion (`general.architecture = qwen3vl`, `blk.N.attn_q.weight`,
  ..., the vision tower in a separate mmproj file, `general.architecture = clip`: text/mmproj.py), or
  ComfyUI's names (`model.layers.N.*`, `visual.*`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ...errors import CheckpointError
from .quant import QuantSpec
from .safetensors_header import TensorEntry

MAGIC = b"GGUF"
# The plain float types, handed over as torch tensors (the other GGML types are blocks).
PLAIN = ("F32", "F16", "BF16")
# Integer and fp64 tensors are readable but never an H3 weight: the readers refuse them by name.
INTEGER = ("I8", "I16", "I32", "I64", "F64")
# general.architecture -> the H3 component that declares it (llama.cpp's mmproj files declare clip).
ARCHITECTURES = {"minimax_h3": "DiT", "qwen3vl": "text encoder", "clip": "vision tower (mmproj)"}
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
_HEADER_BYTES = 24  # magic, version, tensor count, key/value count
_LONG_ARRAY = 32  # metadata arrays longer than this are summarised (a tokenizer's 151k tokens)


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading .gguf files needs the gguf package: pip install 'gguf>=0.10'") from None
    return gguf


def declared(arch: str) -> str:
    """'qwen3vl' -> "'qwen3vl', a text encoder GGUF"; an architecture no H3 component declares -> "'wan'"."""
    return f"{arch!r}, a {ARCHITECTURES[arch]} GGUF" if arch in ARCHITECTURES else repr(arch)


# ------------------------------------------------------------------------------------------ entries
@dataclass(frozen=True)
class GgufEntry(TensorEntry):
    """One tensor of a GGUF file. `dtype` is the GGML type's name ("F32", "BF16", "Q4_K", ...; the plain and
    integer names are the safetensors spellings too), `shape` the logical PyTorch-order shape, `stored_shape`
    the file's dims in PyTorch order (GGUF's ne reversed), `begin`/`end` absolute file offsets."""

    stored_shape: tuple[int, ...]

    @property
    def gguf_type(self) -> str:
        return self.dtype

    @property
    def quantized(self) -> bool:
        """Stored as GGML blocks (not a plain float or integer tensor)."""
        return self.dtype not in PLAIN and self.dtype not in INTEGER

    @property
    def reshaped(self) -> bool:
        """Stored in another geometry than its shape (ComfyUI-GGUF's orig_shape): its rows are not the model's."""
        return self.stored_shape != self.shape

    @property
    def row_bytes(self) -> int:
        rows = math.prod(self.stored_shape[:-1])
        return self.nbytes // max(rows, 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else super().torch_dtype


@dataclass(frozen=True)
class GgufHeader:
    """The header facts of one GGUF file (the counterpart of a safetensors `Header`)."""

    path: Path
    file_size: int
    header_size: int  # bytes before the tensor data: magic, counts, key/values, tensor infos, padding
    version: int
    alignment: int
    architecture: str | None
    metadata: dict[str, str]
    tensors: dict[str, GgufEntry]  # in the file's tensor-info order


@dataclass(frozen=True)
class GgufSpec(QuantSpec):
    """A layer stored as GGML blocks: QuantSpec format "gguf" plus the block type."""

    gguf_type: str = ""

    @property
    def label(self) -> str:
        return f"gguf {self.gguf_type}"


def gguf_spec(entry: GgufEntry) -> GgufSpec:
    return GgufSpec("gguf", source="gguf tensor type", gguf_type=entry.gguf_type)


# ------------------------------------------------------------------------------------------ opening
def _check_prefix(path: Path, size: int) -> int:
    """Magic, byte order and version from the first bytes (before gguf parses anything); returns the version."""
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < 4:
        raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a GGUF header")
    if head[:4] != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file: it starts with {head[:4]!r}, not the magic b'GGUF'")
    if len(head) < _HEADER_BYTES:
        raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a GGUF header ({_HEADER_BYTES})")
    (version,) = struct.unpack("<I", head[4:8])
    if version & 0xFFFF == 0:
        raise CheckpointError(f"{path}: a big-endian GGUF file; only little-endian GGUF files are read")
    supported = _reader_versions()
    if version not in supported:
        raise CheckpointError(f"{path}: GGUF version {version}; the installed gguf package reads versions "
                              f"{', '.join(map(str, supported))}")
    return version


def _reader_versions() -> list[int]:
    gguf_module()
    from gguf import gguf_reader

    return list(getattr(gguf_reader, "READER_SUPPORTED_VERSIONS", [2, 3]))


@functools.lru_cache(maxsize=1)
def _reader_class():
    """GGUFReader, checking each tensor's info before gguf computes its view: gguf raises a bare ValueError
    (no tensor named) for an unknown type or a row that is not whole blocks, and silently gives a short view
    of a tensor cut off by the end of the file."""
    gguf = gguf_module()

    class Reader(gguf.GGUFReader):
        where: Path
        file_size: int

        def __init__(self, path: Path, mode: str, size: int):
            self.where, self.file_size = path, size
            super().__init__(path, mode)

        def _build_tensors(self, start_offs, fields):
            _check_tensor_infos(self.where, self.file_size, int(start_offs), int(self.alignment),
                                [_tensor_info(f) for f in fields])
            super()._build_tensors(start_offs, fields)

    return Reader


@dataclass(frozen=True)
class _Info:
    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int


def _tensor_info(field) -> _Info:
    # gguf's tensor-info field: parts [name length, name bytes, n_dims, dims, type, offset].
    parts = field.parts
    return _Info(bytes(parts[1]).decode("utf-8", "replace"), tuple(int(d) for d in parts[3]), int(parts[4][0]),
                 int(parts[5][0]))


def _check_tensor_infos(path: Path, size: int, data_start: int, alignment: int, infos: list[_Info]) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    seen: set[str] = set()
    spans = []
    for info in infos:
        if info.name in seen:
            raise CheckpointError(f"{path}: tensor {info.name} appears twice in the tensor table")
        seen.add(info.name)
        try:
            qtype = GGMLQuantizationType(info.type_id)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {info.name} has GGML type id {info.type_id}, which the "
                                  "installed gguf package does not know") from None
        # No upper bound on the dims: ggml computes with 4, but ComfyUI-GGUF's fix_5d_tensors adds 5-D patch
        # embeddings (F32) to its files.
        if not info.ne or any(d <= 0 for d in info.ne):
            raise CheckpointError(f"{path}: tensor {info.name} has dims {list(info.ne)}; a GGUF tensor has one or "
                                  "more positive dims")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if info.ne[0] % block:
            raise CheckpointError(f"{path}: tensor {info.name} is {qtype.name} with rows of {info.ne[0]} values, "
                                  f"not whole {qtype.name} blocks of {block}: its bytes do not match its type "
                                  "and shape")
        if info.offset % alignment:
            raise CheckpointError(f"{path}: tensor {info.name} starts at data offset {info.offset}, not a "
                                  f"multiple of the file's alignment {alignment}")
        nbytes = math.prod(info.ne) // block * type_size
        begin = data_start + info.offset
        if begin + nbytes > size:
            raise CheckpointError(f"{path}: truncated: tensor {info.name} ({qtype.name} {list(info.ne[::-1])}) "
                                  f"needs bytes up to {begin + nbytes} but the file ends at {size}")
        spans.append((begin, nbytes, info.name, qtype.name, info.ne))
    spans.sort()
    for (begin, nbytes, name, qname, ne), (nxt, _, next_name, _, _) in zip(spans, spans[1:]):
        room = nxt - begin
        if nbytes > room or room - nbytes >= alignment:
            raise CheckpointError(f"{path}: tensor {name} is {qname} {list(ne[::-1])} ({nbytes} bytes) but "
                                  f"{room} bytes lie before the next tensor ({next_name}): its bytes do not "
                                  "match its type and shape")


def _open_reader(path: Path, size: int):
    reader_class = _reader_class()
    for mode in ("c", "r"):
        try:
            return reader_class(path, mode, size), mode
        except CheckpointError:
            raise
        except OSError as exc:
            # A copy-on-write map of a file larger than RAM can be refused; a read-only map of it cannot.
            if mode == "c":
                continue
            raise CheckpointError(f"{path}: cannot memory-map it ({exc})") from None
        except (ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
            raise CheckpointError(f"{path}: the GGUF header is truncated or malformed "
                                  f"({type(exc).__name__}: {exc})") from None
    raise AssertionError("unreachable")


def _field_value(field):
    """A key/value field as a Python value (gguf's ReaderField.contents, or its parts on older gguf)."""
    contents = getattr(field, "contents", None)
    if contents is not None:
        return contents()
    from gguf.constants import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", "replace")
    values = [field.parts[i].tolist() for i in field.data]
    values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
    return values if field.types and field.types[0] == GGUFValueType.ARRAY else values[0]


def _metadata_text(field) -> str:
    """A key/value as text; a long array (a tokenizer's vocabulary) as its length and type, never materialised."""
    from gguf.constants import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > _LONG_ARRAY:
        return f"[{len(field.data)} x {field.types[-1].name}]"
    value = _field_value(field)
    return value if isinstance(value, str) else json.dumps(value)


def _orig_shape(path: Path, fields: dict, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    field = fields.get(ORIG_SHAPE_KEY + name)
    if field is None:
        return stored
    value = _field_value(field)
    if not isinstance(value, list) or not all(isinstance(v, int) and v > 0 for v in value):
        raise CheckpointError(f"{path}: {ORIG_SHAPE_KEY}{name} must be a list of positive ints, got {value!r}")
    if math.prod(value) != math.prod(stored):
        raise CheckpointError(f"{path}: tensor {name} is stored as {list(stored)} but {ORIG_SHAPE_KEY}{name} says "
                              f"{value}: the element counts differ")
    return tuple(value)


class GgufSource:
    """One GGUF file: header facts and memory-mapped tensor reads, with `CheckpointSource`'s interface."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path}: no such file")
        if path.is_dir():
            raise CheckpointError(f"{path}: is a folder, expected a .gguf file")
        size = path.stat().st_size
        version = _check_prefix(path, size)
        self._reader, mode = _open_reader(path, size)
        # A read-only map cannot be written through: plain tensors are then copied out (see get).
        self._copy_plain = mode == "r"
        self._size = size
        self.path = path
        self.config_path = None
        fields = {k: f for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}
        self._fields = fields
        metadata = {k: _metadata_text(f) for k, f in fields.items()}
        arch = metadata.get("general.architecture")
        entries = {t.name: self._entry(t, fields) for t in self._reader.tensors}
        self.header = GgufHeader(path, size, int(self._reader.data_offset), version, int(self._reader.alignment),
                                 arch, metadata, entries)
        self.headers = [self.header]
        self._by_name = None

    def _entry(self, tensor, fields) -> GgufEntry:
        stored = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        begin = int(tensor.data_offset)
        return GgufEntry(tensor.name, tensor.tensor_type.name, _orig_shape(self.path, fields, tensor.name, stored),
                         begin, begin + int(tensor.n_bytes), stored)

    # -- header-level facts (no tensor data)
    @property
    def architecture(self) -> str | None:
        return self.header.architecture

    @property
    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.header.tensors

    def entry(self, name: str) -> GgufEntry:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} not found") from None

    def header_of(self, name: str) -> GgufHeader:
        return self.header

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.header.metadata)

    def field(self, key: str):
        """A key/value as its Python value (str, int, float, bool or list), or None when absent."""
        found = self._fields.get(key)
        return None if found is None else _field_value(found)

    @property
    def total_bytes(self) -> int:
        return self.header.file_size

    def file_order(self) -> list[str]:
        """Tensor names by data offset: sequential reads on a disk."""
        return sorted(self.header.tensors, key=lambda n: self.header.tensors[n].begin)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.header.tensors.values():
            counts[e.dtype] = counts.get(e.dtype, 0) + 1
        return dict(sorted(counts.items()))

    # -- tensor data
    def get(self, name: str) -> torch.Tensor:
        """Plain tensors as torch tensors of their shape; GGML blocks as uint8 [rows, row_bytes] (views)."""
        entry = self.entry(name)
        data = self._tensor(name).data
        with warnings.catch_warnings():
            # A read-only map gives non-writable arrays; those tensors are copied below.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(data)
        if entry.quantized:
            rows = math.prod(entry.stored_shape[:-1])
            return tensor.reshape(max(rows, 1), entry.row_bytes)
        if entry.dtype == "BF16":
            tensor = tensor.view(torch.bfloat16)  # gguf hands BF16 over as its bytes, two per value
        tensor = tensor.reshape(entry.shape)
        return tensor.clone() if self._copy_plain else tensor

    def read_small(self, name: str) -> torch.Tensor:
        """A small tensor (the RoPE buffer, a table) as values: blocks are dequantized (fp32)."""
        entry = self.entry(name)
        if entry.quantized:
            return dequantize(entry, self.get(name), torch.float32, "cpu")
        return self.get(name).clone()

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.file_order():
            yield name, self.get(name)

    def _tensor(self, name: str):
        """gguf's tensor record (its data a view of the map); the map is opened again after `close`."""
        if self._reader is None:
            self._reader, mode = _open_reader(self.path, self._size)
            self._copy_plain = mode == "r"
        if self._by_name is None:
            self._by_name = {t.name: t for t in self._reader.tensors}
        return self._by_name[name]

    def close(self) -> None:
        """Drop this source's references to the map (tensors handed out keep it alive while they live)."""
        self._reader = self._by_name = None

    def __enter__(self) -> "GgufSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ values
def codec_keeps(gguf_type: str) -> bool:
    """Whether `StoredLinear` can hold this type as its blocks (kernels/gguf_codec.py dequantizes it at use)."""
    from ...kernels import gguf_codec

    return gguf_type in gguf_codec.SUPPORTED and gguf_type not in PLAIN


@functools.lru_cache(maxsize=None)
def readable(gguf_type: str) -> bool:
    """Whether a tensor of this type can be dequantized at all: by our codec, or by gguf's NumPy code (probed on
    one block of zeros: gguf raises NotImplementedError for the types it has no dequantizer for)."""
    if codec_keeps(gguf_type) or gguf_type in PLAIN:
        return True
    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[gguf_type]
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (NotImplementedError, gguf.quants.QuantError):
        return False
    return True


def dequantize(entry: GgufEntry, raw: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A GGML-block tensor's values in `entry.shape`, `dtype`, on `device`.

    kernels/gguf_codec.py where it knows the type (the function StoredLinear dequantizes with, so a layer
    dequantized at load holds the bits it would hold dequantized at use); gguf's NumPy dequantizer on the CPU
    for the others (TQ1_0, TQ2_0, MXFP4, ...). Both compute gguf's fp32 values, then cast."""
    device = torch.device(device)
    rows, width = raw.shape[0], entry.stored_shape[-1]
    if codec_keeps(entry.gguf_type):
        from ...kernels import gguf_codec

        out = torch.empty(rows, width, dtype=dtype, device=device)
        gguf_codec.dequantize_into(out, raw.to(device), entry.gguf_type)
        return out.reshape(entry.shape)
    gguf = gguf_module()
    values = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType[entry.gguf_type])
    return torch.from_numpy(values).reshape(entry.shape).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------ text encoder names
# llama.cpp's Qwen3-VL text tensors (gguf-py tensor_mapping.py, MODEL_ARCH.QWEN3VL) -> ComfyUI's single-file
# names, which the text encoder reader maps on to transformers'. convert_hf_to_gguf's Qwen3-VL text model
# (a Qwen2/Qwen3 model) renames only: no weight is permuted or fused.
_LLAMA_CPP_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight", "rope_freqs.weight": "model.rotary_emb.inv_freq"}
_LLAMA_CPP_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def comfy_to_llama_cpp(name: str) -> str | None:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (the inverse of llama_cpp_to_comfy);
    None for a name llama.cpp's text GGUF has no place for (the vision tower: the mmproj file's)."""
    top = {comfy: llama for llama, comfy in _LLAMA_CPP_TOP.items()}
    if name in top:
        return top[name]
    block = {comfy: llama for llama, comfy in _LLAMA_CPP_BLOCK.items()}
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m and m.group(2) in block:
        return f"blk.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    return None


def uses_llama_cpp_names(keys) -> bool:
    return any(k.startswith("blk.") or k == "token_embd.weight" for k in keys)


def llama_cpp_to_comfy(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a name outside the table is returned
    unchanged (the reader then reports it as no Qwen3-VL tensor)."""
    if name in _LLAMA_CPP_TOP:
        return _LLAMA_CPP_TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LLAMA_CPP_BLOCK:
        return f"model.layers.{parts[1]}.{_LLAMA_CPP_BLOCK[parts[2]]}.{parts[3]}"
    return name


def text_encoder_names(keys) -> dict[str, str]:
    """ComfyUI-style name -> the file's name, for a text encoder file in either naming."""
    keys = list(keys)
    if not uses_llama_cpp_names(keys):
        return {k: k for k in keys}
    return {llama_cpp_to_comfy(k): k for k in keys}
