"""Static NVFP4 activation scales: the artifact, its checks, and putting a promoted one to use.

The artifact is a safetensors file: one fp32 tensor `<layer>.input_scale` per block linear, and a JSON header
(safetensors metadata key `h3_nvfp4_static_scales`) that says what it was calibrated on: the DiT's hash, the
partition, the request shapes (mode, canvas, frames, evaluations), the commit, the kernel settings, per layer
the amax statistics; after `h3-spark calibrate --verify`, the gate's verdict and figures. `content_sha256`
covers the header and every tensor: a file changed after writing (a flipped byte, an edited verdict) no longer
matches it. It is an integrity check, not a signature: whoever can write the file can recompute it.

Use (`H3_NVFP4_STATIC_SCALES=PATH`): the engine checks the artifact before loading any weights and refuses,
in one line, one that is missing, unreadable, corrupted, not promoted, or stale (another model, partition or
set of layer shapes); after the kernels are applied it installs the scales (kernels/nvfp4_static.py). A
request whose shape the artifact was not calibrated on runs dynamic and its output info says so.

The model hash: sha256 of the whole file is minutes on a 60 GB DiT, so it is a stated cheaper content hash,
`sampled-sha256-v1`: per file (a folder's .safetensors / .gguf / .json files, sorted by name), its name, its
size, and its bytes in full up to 64 MiB, else its first 8 MiB (the safetensors header and more), its last
1 MiB and 64 evenly spaced 1 MiB windows. Synthetic models (`--synthetic`) are named by their recipe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import InputError

HEADER_KEY = "h3_nvfp4_static_scales"
FORMAT = "h3-spark nvfp4 static activation scales"
VERSION = 1
HASH_METHOD = "sampled-sha256-v1"
RECIPE_METHOD = "synthetic-recipe-sha256"
_MIB = 1 << 20
MODEL_FILES = (".safetensors", ".gguf", ".json")


# ------------------------------------------------------------------------------------------ model identity
def model_hash(path: Path) -> dict:
    """{"method", "hash", "source"} of a DiT file or folder (see the module doc for what is read)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                 and p.suffix in MODEL_FILES)
    if not files:
        raise InputError(f"{path}: no model file to hash")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            if size <= 64 * _MIB:
                h.update(fh.read())
                continue
            windows = [(0, 8 * _MIB), (size - _MIB, _MIB)]
            windows += [(8 * _MIB + i * (size - 9 * _MIB) // 64, _MIB) for i in range(64)]
            for start, length in windows:
                fh.seek(start)
                h.update(fh.read(length))
    return {"method": HASH_METHOD, "hash": h.hexdigest(), "source": str(path)}


def recipe_hash(recipe: str) -> dict:
    """A synthetic model's identity: the recipe that draws its weights (preset, seed, init)."""
    return {"method": RECIPE_METHOD, "hash": hashlib.sha256(recipe.encode()).hexdigest(), "source": recipe}


# ------------------------------------------------------------------------------------------ shapes
def shape_key(mode: str, width: int, height: int, frames: int, evaluations: int) -> dict:
    return {"mode": mode, "width": int(width), "height": int(height), "frames": int(frames),
            "evaluations": int(evaluations)}


def shape_name(shape: dict) -> str:
    return f"{shape['mode']}-{shape['width']}x{shape['height']}-{shape['frames']}f-{shape['evaluations']}ev"


# ------------------------------------------------------------------------------------------ the file
def content_hash(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    body = {k: v for k, v in header.items() if k != "content_sha256"}
    h = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode() + b"\0" + t.numpy().tobytes())
    return h.hexdigest()


def write(path: Path, header: dict, scales: dict[str, float]) -> None:
    """Write the artifact (via a temporary file beside it, then a rename: a reader never sees half of it)."""
    from safetensors.torch import save_file

    tensors = {f"{name}.input_scale": torch.tensor([float(g)], dtype=torch.float32) for name, g in scales.items()}
    header = {**header, "content_sha256": content_hash(header, tensors)}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={HEADER_KEY: json.dumps(header, sort_keys=True)})
    tmp.replace(path)


@dataclass
class Artifact:
    path: Path
    header: dict
    scales: dict[str, float]

    @property
    def excluded(self) -> set[str]:
        return set(self.header.get("excluded", []))

    @property
    def gate(self) -> dict | None:
        return self.header.get("gate")

    def shapes(self) -> list[dict]:
        return list(self.header.get("shapes", []))


def read(path: Path, source: str = "artifact") -> Artifact:
    """The artifact at `path`, its content hash checked; one-line InputError naming `source` otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    where = f"{source} {path}"
    if not path.is_file():
        raise InputError(f"{where}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{where}: corrupted: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
    if HEADER_KEY not in meta:
        raise InputError(f"{where}: not a static-scales artifact (no {HEADER_KEY} header; make one with "
                         "h3-spark calibrate)")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: corrupted: its header is not JSON ({exc.msg})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise InputError(f"{where}: corrupted: header format {header.get('format') if isinstance(header, dict) else None!r} "
                         f"version {header.get('version') if isinstance(header, dict) else None!r}, expected "
                         f"{FORMAT!r} version {VERSION}")
    want, got = header.get("content_sha256"), content_hash(header, tensors)
    if want != got:
        raise InputError(f"{where}: corrupted: content hash {got[:16]} does not match the header's "
                         f"{str(want)[:16]} (the file changed after it was written)")
    scales = {}
    for name, t in tensors.items():
        if not name.endswith(".input_scale") or t.numel() != 1:
            raise InputError(f"{where}: corrupted: unexpected tensor {name} {list(t.shape)}")
        scales[name[: -len(".input_scale")]] = float(t.reshape(()))
    return Artifact(path, header, scales)


# ------------------------------------------------------------------------------------------ checks before use
def check_promoted(art: Artifact, source: str) -> None:
    gate = art.gate
    where = f"{source} {art.path}"
    if gate is None:
        raise InputError(f"{where}: not promoted: no gate verdict yet (run h3-spark calibrate --verify {art.path} "
                         "--requests HELD_OUT.json)")
    if gate.get("verdict") != "promoted":
        raise InputError(f"{where}: not promoted: the gate refused it ({gate.get('why', 'no reason recorded')})")


def check_model(art: Artifact, identity: dict, partition: str, source: str) -> None:
    """Stale: calibrated on another model (hash) or partition."""
    where = f"{source} {art.path}"
    have = art.header.get("model", {})
    if have.get("method") != identity["method"] or have.get("hash") != identity["hash"]:
        raise InputError(f"{where}: stale: calibrated on model {str(have.get('hash'))[:16]} ({have.get('method')}, "
                         f"{have.get('source')}), this DiT is {identity['hash'][:16]} ({identity['method']}, "
                         f"{identity['source']})")
    if art.header.get("partition") != partition:
        raise InputError(f"{where}: stale: calibrated on the {art.header.get('partition')} partition, this DiT is "
                         f"the {partition} partition")


def check_layers(art: Artifact, shapes: dict[str, list[int]], source: str) -> None:
    """Stale: the loaded DiT's NVFP4 linears are not the ones calibrated (names or [out, in] shapes)."""
    where = f"{source} {art.path}"
    have = {n: v.get("shape") for n, v in art.header.get("layers", {}).items()}
    if set(have) != set(shapes):
        extra, missing = sorted(set(have) - set(shapes)), sorted(set(shapes) - set(have))
        raise InputError(f"{where}: stale: its layers differ from this DiT's NVFP4 linears ({len(missing)} not "
                         f"calibrated, e.g. {missing[:1]}; {len(extra)} unknown, e.g. {extra[:1]})")
    for name, shape in shapes.items():
        if list(have[name]) != list(shape):
            raise InputError(f"{where}: stale: {name} was calibrated as {have[name]}, this DiT's is {shape}")
    if set(art.scales) != set(shapes):
        raise InputError(f"{where}: corrupted: its scale tensors do not name the header's layers")


def partition_of(art: Artifact) -> str:
    return str(art.header.get("partition"))


# ------------------------------------------------------------------------------------------ in use
def check_for_engine(path: str, plan: dict, model_ids: dict, linear_format, source: str) -> tuple[str, Artifact]:
    """Before any weights are read: (DiT key, artifact) for `path`, or one line saying why it cannot be used.

    plan: the engine's DiT key -> file path (or the override that builds it); model_ids: a recipe id per
    in-memory DiT; linear_format(key): (format, why) H3_LINEAR resolves to for that DiT."""
    art = read(Path(path), source)
    check_promoted(art, source)
    partition = partition_of(art)
    key = {"t2va": "dit", "ref2va": "dit_ref"}.get(partition)
    if key not in plan:
        raise InputError(f"{source} {art.path}: calibrated for the {partition} partition, which this run does not "
                         "load")
    fmt, why = linear_format(key)
    if fmt != "nvfp4":
        raise InputError(f"{source} {art.path}: static scales are for NVFP4 linears, and the {partition} DiT's "
                         f"linears run {fmt} here ({why}); unset {source} or run NVFP4 (Blackwell)")
    if key in model_ids:
        identity = recipe_hash(model_ids[key])
    elif isinstance(plan[key], (str, Path)):
        identity = model_hash(Path(plan[key]))
    else:
        raise InputError(f"{source} {art.path}: the {partition} DiT is built in memory with no recorded recipe, so "
                         "its hash cannot be checked")
    check_model(art, identity, partition, source)
    return key, art


class StaticScales:
    """A promoted artifact installed on a DiT: which request shapes run static, and what a request reports."""

    def __init__(self, model, art: Artifact, source: str, device=None):
        from ...kernels import nvfp4_static

        self.model, self.path, self.source = model, art.path, source
        self.shapes = [dict(s) for s in art.shapes()]
        self.counts = nvfp4_static.install(model, art.scales, art.excluded, device)
        self.excluded = sorted(art.excluded)

    def describe(self) -> dict:
        return {"path": str(self.path), "static_layers": self.counts["static"],
                "dynamic_layers": self.counts["dynamic"], "excluded": self.excluded,
                "calibrated_shapes": [shape_name(s) for s in self.shapes]}

    def for_request(self, mode: str, width: int, height: int, frames: int, evaluations: int):
        """(context to sample in, what the request's output info says)."""
        from ...kernels import nvfp4_static

        shape = shape_key(mode, width, height, frames, evaluations)
        if shape in self.shapes:
            return contextlib.nullcontext(), {"static": True, "shape": shape_name(shape), "path": str(self.path)}
        return nvfp4_static.dynamic(self.model), {
            "static": False, "shape": shape_name(shape), "path": str(self.path),
            "note": f"{shape_name(shape)} is outside the calibrated shapes "
                    f"({', '.join(shape_name(s) for s in self.shapes)}): this request ran dynamic NVFP4 scales"}

    def saturation(self) -> dict:
        from ...kernels import nvfp4_static

        per_layer = nvfp4_static.take_saturation(self.model)
        return {"saturated_blocks": sum(per_layer.values()), "saturated_layers": per_layer}
