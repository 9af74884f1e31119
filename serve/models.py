"""Resident models for the service: load every component once, keep it, and say what is loaded.

`load_models` is the service's one way to build its `Components`: it resolves paths the way the CLI does
(`ComponentPaths`), checks that the asked-for kernels can run here before reading any weights, loads
each component with the loader the CLI uses too (`components.component_loader`), configures each
DiT once with `apply_kernels`, and records progress in a `LoadTracker` that `/ready` reads while
loading is still going on.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..h3_model.components import ComponentPaths
from ..h3_model.errors import H3Error, InputError
from ..h3_model.pipeline import Components
from ..h3_model.video_vae import DEFAULT_TILE_BATCH
from ..kernels.settings import KernelSettings

COMPONENT_ORDER = ("dit", "dit_ref", "text_encoder", "vae", "audio_vae")


@dataclass
class ModelSpec:
    paths: ComponentPaths
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    text_dtype: torch.dtype | None = None
    vae_dtype: torch.dtype = torch.float16
    text_layer: int = 50
    qkv_layout: str = "stacked"
    kernels: KernelSettings = field(default_factory=KernelSettings)
    vae_tile_batch: int = DEFAULT_TILE_BATCH  # tiles per video VAE decoder call (H3_VAE_TILE_BATCH)


class LoadTracker:
    """Thread-safe loading state: overall (loading | ready | failed) and per component."""

    def __init__(self, names: list[str] | tuple[str, ...] = ()):
        self._lock = threading.Lock()
        self.state = "loading"
        self.error: str | None = None
        self.components: dict[str, dict] = {n: {"state": "pending"} for n in names}

    def plan(self, names: list[str]) -> None:
        with self._lock:
            self.components = {n: {"state": "pending"} for n in names}

    def begin(self, name: str) -> float:
        with self._lock:
            self.components[name] = {"state": "loading"}
        return time.perf_counter()

    def done(self, name: str, start: float) -> float:
        seconds = round(time.perf_counter() - start, 3)
        with self._lock:
            self.components[name] = {"state": "resident", "seconds": seconds}
        return seconds

    def fail(self, error: str, name: str | None = None) -> None:
        with self._lock:
            if name is not None:
                self.components[name] = {"state": "failed", "error": error}
            self.state, self.error = "failed", error

    def ready(self) -> None:
        with self._lock:
            self.state = "ready"

    def snapshot(self) -> dict:
        with self._lock:
            out = {"state": self.state, "components": {k: dict(v) for k, v in self.components.items()}}
            if self.error:
                out["error"] = self.error
            out["still_loading"] = [k for k, v in self.components.items() if v["state"] in ("pending", "loading")]
            return out


@dataclass
class ResidentModels:
    components: Components
    spec_device: str
    # Per DiT key ("dit", "dit_ref"): the apply_kernels report, and the attention + Q/K preparation it set;
    # "vae": the decoder's (apply_vae_kernels).
    kernel_reports: dict[str, dict]
    default_attention: dict[str, tuple[object, object]]
    settings: KernelSettings
    load_seconds: dict[str, float]
    checkpoint_formats: dict[str, str] = field(default_factory=dict)
    # Sequence parallel (serve --gpus N): every rank's device, rank 0 first, and the group the pipeline
    # shares the video decode over. One process: [spec_device] and None.
    devices: list[str] = field(default_factory=list)
    decode_group: object = None

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [self.spec_device]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def modes(self) -> list[str]:
        c = self.components
        return (["t2va", "fl2va"] if c.dit is not None else []) + (["ref2va"] if c.dit_ref is not None else [])

    def dit_keys(self) -> list[str]:
        return [k for k in ("dit", "dit_ref") if getattr(self.components, k) is not None]


def _check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device} asked for, but this machine has no CUDA GPU")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"--device {device!r} is not a device torch knows ({exc})") from None


def load_models(spec: ModelSpec, tracker: LoadTracker,
                overrides: Mapping[str, Callable[[], object]] | None = None) -> ResidentModels:
    """Load the text encoder, the DiT partition(s) found, the video VAE and the audio VAE, once.

    `overrides` maps a component name to a function that builds that component instead of reading it
    from a path (an embedding host that already holds the model, or a test's in-memory encoder).
    Raises H3Error naming what is missing or cannot run; the tracker records it too.
    """
    from ..h3_model.checkpoint import linear_format
    from ..h3_model.components import LoadOptions, check_fit, component_loader
    from ..kernels.attention import resolve_attention
    from ..kernels.dispatch import apply_kernels, resolve_linear
    from ..kernels.vae import apply_vae_kernels

    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(COMPONENT_ORDER))
    if unknown:
        raise InputError(f"unknown component override(s) {unknown}; components are {', '.join(COMPONENT_ORDER)}")
    _check_device(spec.device)
    paths = {name: (None if name in overrides else spec.paths.resolve(name)) for name in COMPONENT_ORDER}
    if spec.paths.models is not None and not spec.paths.models.is_dir():
        raise InputError(f"{spec.paths.models}: no such model folder (--models)")
    if paths["dit"] is None and paths["dit_ref"] is None and not {"dit", "dit_ref"} & set(overrides):
        raise InputError("no DiT to serve: pass --models (with transformer/ and/or transformer_ref/), --dit or "
                         "--dit-ref")
    for name, flag in (("text_encoder", "--text-encoder"), ("vae", "--vae"), ("audio_vae", "--audio-vae")):
        if paths[name] is None and name not in overrides:
            raise InputError(f"the {name.replace('_', ' ')} is needed: pass --models or {flag}")
    names = [n for n in COMPONENT_ORDER if paths[n] is not None or n in overrides]
    tracker.plan(names)

    # Fail before reading any weights when the asked-for kernels cannot run on this device.
    formats = {k: linear_format(paths[k], "t2va" if k == "dit" else "ref2va")
               for k in ("dit", "dit_ref") if paths[k] is not None}
    for fmt in formats.values() or ["bf16"]:
        resolve_linear(spec.kernels, spec.device, fmt)
    resolve_attention(spec.kernels.attention, spec.device, spec.kernels)

    comps = Components(device=spec.device)
    reports: dict[str, dict] = {}
    defaults: dict[str, tuple[object, object]] = {}
    seconds: dict[str, float] = {}
    opts = LoadOptions(device=spec.device, dtype=spec.dtype, text_dtype=spec.text_dtype, vae_dtype=spec.vae_dtype,
                       qkv_layout=spec.qkv_layout, text_layer=spec.text_layer)
    tokenizer = spec.paths.resolve("tokenizer")
    builders: dict[str, Callable[[], object]] = {
        name: component_loader(name, paths[name], opts, tokenizer) for name in COMPONENT_ORDER
        if paths[name] is not None}
    builders.update(overrides)
    for name in names:
        start = tracker.begin(name)
        try:
            model = builders[name]()
            if name in ("dit", "dit_ref"):
                reports[name] = apply_kernels(model, spec.kernels)
                defaults[name] = (model.attention, model.qk_prep)
            elif name == "vae":
                model.tile_batch = spec.vae_tile_batch
                reports[name] = apply_vae_kernels(model, spec.kernels)
        except H3Error as exc:
            tracker.fail(str(exc), name)
            raise
        except Exception as exc:
            tracker.fail(f"{type(exc).__name__}: {exc}", name)
            raise
        setattr(comps, name, model)
        seconds[name] = tracker.done(name, start)
    check_fit(comps)  # components given one by one must belong together: fail now, not at the first job
    return ResidentModels(comps, spec.device, reports, defaults, spec.kernels, seconds, formats)


def unwrap(dit):
    """The H3DiT itself, also when it is wrapped in a SequenceParallelDiT (serve --gpus N).

    The wrapper forwards attribute reads to the model but not writes, and is not an nn.Module: code
    that sets the DiT's attention or lists its parameters must reach the model.
    """
    from ..h3_model.parallel import SequenceParallelDiT

    return dit.model if isinstance(dit, SequenceParallelDiT) else dit


# ------------------------------------------------------------------------------------------ reporting
def describe_models(models: ResidentModels) -> dict:
    """Per component: class, parameter dtype(s), device, parameter bytes."""
    out = {}
    c = models.components
    for name in COMPONENT_ORDER:
        obj = getattr(c, name)
        if obj is None:
            continue
        module = getattr(obj, "model", obj) if name == "text_encoder" else unwrap(obj)
        params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        devices = sorted({str(p.device) for p in params})
        out[name] = {"class": type(module if name != "text_encoder" else obj).__name__, "dtypes": dtypes,
                     "devices": devices, "parameter_bytes": sum(p.numel() * p.element_size() for p in params)}
        if module is not obj and name != "text_encoder":
            # Per rank: every rank holds a full copy of the weights.
            out[name]["sequence_parallel"] = models.world_size
        if name == "vae" and name in models.kernel_reports:
            out[name]["kernels"] = models.kernel_reports[name]
        elif name in models.kernel_reports:
            rep = models.kernel_reports[name]
            out[name]["attention"] = rep["attention"]
            out[name]["linear"] = rep["linear"]
            out[name]["exact"] = rep["exact"]
    return out


def memory_report(device: str) -> dict:
    """GPU memory on CUDA; the process's resident set on the CPU (what the models occupy there)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(dev)
        return {"device": str(dev), "allocated_bytes": torch.cuda.memory_allocated(dev),
                "reserved_bytes": torch.cuda.memory_reserved(dev), "free_bytes": free, "total_bytes": total}
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"device": "cpu", "process_rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE")}
    except (OSError, ValueError, IndexError):
        return {"device": "cpu"}


def supported_kernels(device: str, settings: KernelSettings, checkpoint_fmt: str = "bf16") -> dict:
    """Which attention backends and linear formats can run here, and why not for the others."""
    from ..kernels.attention import resolve_attention
    from ..kernels.dispatch import resolve_linear
    from ..kernels.settings import ATTENTION_BACKENDS, LINEAR_FORMATS

    attention, linear = {}, {}
    for name in ATTENTION_BACKENDS:
        try:
            _, chosen = resolve_attention(name, device, settings)
            attention[name] = {"supported": True, "runs": chosen}
        except H3Error as exc:
            attention[name] = {"supported": False, "why": str(exc)}
    for fmt in LINEAR_FORMATS:
        try:
            chosen, why = resolve_linear(settings.replace(linear=fmt), device, checkpoint_fmt)
            linear[fmt] = {"supported": True, "runs": chosen}
        except H3Error as exc:
            linear[fmt] = {"supported": False, "why": str(exc)}
    return {"attention": attention, "linear": linear}


class AttentionSwitch:
    """Run one job with another attention backend, then put the load-time one back; weights untouched.

    The Q/K preparation goes with the backend (a low-bit backend may take pre-quantized Q/K that another
    backend cannot read), so both are switched and both restored, even when the job fails.
    """

    def __init__(self, models: ResidentModels, key: str, name: str | None):
        self.models, self.key, self.name = models, key, name
        self.report: dict | None = None

    def __enter__(self) -> dict:
        from ..kernels.dispatch import switch_attention

        base = self.models.kernel_reports[self.key]
        if self.name is None:
            self.report = {"attention": base["attention"], "qk_prep": base["qk_prep"]}
            return self.report
        dit = unwrap(getattr(self.models.components, self.key))
        self.report = switch_attention(dit, self.name, self.models.settings, self.models.spec_device)
        return self.report

    def __exit__(self, *exc) -> None:
        if self.name is not None:
            dit = unwrap(getattr(self.models.components, self.key))
            attention, qk_prep = self.models.default_attention[self.key]
            dit.set_attention(attention)
            dit.qk_prep = qk_prep
