"""Load the models a generation needs, once, from a model folder or per-component paths.

A model folder has the released layout: `transformer/` (t2va/fl2va), `transformer_ref/`
(ref2va), `text_encoder/` (+ tokenizer/processor files there or in `tokenizer/`), `vae/`,
`audio_vae/`. Any component can be given on its own instead (a diffusers folder or a ComfyUI
single file), and only the partitions the requested modes need are loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import InputError
from .pipeline import Components

MODE_PARTITIONS = {"t2va": "t2va", "fl2va": "t2va", "ref2va": "ref2va"}
PARTITION_FOLDERS = {"t2va": "transformer", "ref2va": "transformer_ref"}


@dataclass
class ComponentPaths:
    models: Path | None = None
    dit: Path | None = None
    dit_ref: Path | None = None
    text_encoder: Path | None = None
    tokenizer: Path | None = None
    vae: Path | None = None
    audio_vae: Path | None = None

    def resolve(self, name: str) -> Path | None:
        given = getattr(self, name)
        if given is not None:
            if not Path(given).exists():
                raise InputError(f"{given}: no such file or folder (--{name.replace('_', '-')})")
            return Path(given)
        if self.models is None:
            return None
        folder = {"dit": "transformer", "dit_ref": "transformer_ref", "text_encoder": "text_encoder",
                  "tokenizer": "tokenizer", "vae": "vae", "audio_vae": "audio_vae"}[name]
        candidate = Path(self.models) / folder
        return candidate if candidate.exists() else None


@dataclass
class LoadOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    text_dtype: torch.dtype | None = None
    vae_dtype: torch.dtype = torch.float16
    loras: list = field(default_factory=list)
    qkv_layout: str = "stacked"
    text_layer: int = 50  # hidden_states[50] for the released Qwen3-VL; tiny test models read less


def component_loader(name: str, path: Path, opts: LoadOptions, tokenizer: Path | None = None) -> Callable[[], object]:
    """The function that loads component `name` ("dit", "dit_ref", "text_encoder", "vae", "audio_vae") from
    `path` with `opts`: the one place the CLI, the bench and the service build a component from files."""
    from .checkpoint import load_dit
    from .text_encoder import TextEncoder
    from .vae_loading import load_audio_vae, load_video_vae

    loaders: dict[str, Callable[[], object]] = {
        "dit": lambda: load_dit(path, dtype=opts.dtype, device=opts.device, partition="t2va",
                                qkv_layout=opts.qkv_layout),
        "dit_ref": lambda: load_dit(path, dtype=opts.dtype, device=opts.device, partition="ref2va",
                                    qkv_layout=opts.qkv_layout),
        "text_encoder": lambda: TextEncoder.from_pretrained(path, dtype=opts.text_dtype or opts.dtype,
                                                            device=opts.device, tokenizer=tokenizer,
                                                            layer=opts.text_layer),
        "vae": lambda: load_video_vae(path, device=opts.device, decode_dtype=opts.vae_dtype),
        "audio_vae": lambda: load_audio_vae(path, device=opts.device),
    }
    if name not in loaders:
        raise InputError(f"unknown component {name!r}; components are {', '.join(loaders)}")
    return loaders[name]


def load_components(paths: ComponentPaths, modes: list[str], opts: LoadOptions,
                    log: Callable[[str], None] = lambda message: None) -> tuple[Components, dict[str, float]]:
    """Load what `modes` need; returns the components and seconds per component."""
    from .lora import apply_loras

    if paths.models is not None and not Path(paths.models).is_dir():
        raise InputError(f"{paths.models}: no such model folder")
    bad = [m for m in modes if m not in MODE_PARTITIONS]
    if bad:
        raise InputError(f"unknown mode(s) {bad}; choose from {', '.join(MODE_PARTITIONS)}")
    comps = Components(device=opts.device)
    seconds: dict[str, float] = {}

    def timed(name: str, fn):
        log(f"loading {name}")
        start = time.perf_counter()
        value = fn()
        seconds[name] = time.perf_counter() - start
        return value

    for partition in sorted({MODE_PARTITIONS[m] for m in modes}):
        key = "dit" if partition == "t2va" else "dit_ref"
        path = paths.resolve(key)
        if path is None:
            raise InputError(f"{'/'.join(m for m in modes if MODE_PARTITIONS[m] == partition)} needs the "
                             f"{PARTITION_FOLDERS[partition]}/ DiT: pass --models or --{key.replace('_', '-')}")
        model = timed(key, component_loader(key, path, opts))
        if opts.loras:
            timed(f"{key}_loras", lambda: apply_loras(model, opts.loras))
        setattr(comps, key, model)

    te_path = paths.resolve("text_encoder")
    if te_path is None:
        raise InputError("the text encoder is needed: pass --models or --text-encoder")
    comps.text_encoder = timed("text_encoder", component_loader("text_encoder", te_path, opts,
                                                                paths.resolve("tokenizer")))
    for key in ("vae", "audio_vae"):
        path = paths.resolve(key)
        if path is None:
            raise InputError(f"the {key.replace('_', ' ')} is needed: pass --models or --{key.replace('_', '-')}")
        setattr(comps, key, timed(key, component_loader(key, path, opts)))
    check_fit(comps)
    return comps, seconds


def check_fit(comps: Components) -> None:
    """Components given one by one must belong together: a DiT reads the text encoder's hidden states and
    the VAEs' latents at fixed widths, and a mismatch would otherwise surface as a shape error mid-sampling."""
    for key in ("dit", "dit_ref"):
        dit = getattr(comps, key)
        if dit is None:
            continue
        c = dit.config
        pairs = [("text encoder hidden size", comps.text_encoder.hidden_size if comps.text_encoder else None,
                  "text_dim", c.text_dim),
                 ("video VAE latent channels", comps.vae.config.latent_channels if comps.vae else None,
                  "in_channels", c.in_channels),
                 ("audio VAE latent channels", comps.audio_vae.config.latent_channels if comps.audio_vae else None,
                  "audio_in_channels", c.audio_in_channels)]
        for what, have, name, want in pairs:
            if have is not None and have != want:
                raise InputError(f"the {what} is {have} but the DiT ({key}) reads {want} ({name}): these components "
                                 "do not belong together")
