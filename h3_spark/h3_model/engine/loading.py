"""Build one component from its files: the one place every front door loads a component.

`component_loader` is what the engine calls for each component it plans, and what the ComfyUI loader
nodes call for the one component each node holds; `check_fit` refuses components that do not belong
together before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...errors import InputError
from ...kernels.settings import DEFAULT_TILE_BATCH, KernelSettings

MODE_PARTITIONS = {"t2va": "t2va", "fl2va": "t2va", "ref2va": "ref2va"}
LOADED = ("dit", "dit_ref", "text_encoder", "vae", "audio_vae")  # in load order


@dataclass
class LoadOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    text_dtype: torch.dtype | None = None
    vae_dtype: torch.dtype = torch.float16
    loras: list = field(default_factory=list)
    qkv_layout: str = "auto"
    text_layer: int = 50  # hidden_states[50] for the released Qwen3-VL; tiny test models read less
    # A llama.cpp text GGUF's vision file (mmproj; --text-encoder-vision); None: the one mmproj*.gguf beside it, if any.
    text_vision: Path | None = None
    # The kernels each DiT and the video VAE are configured with once, after loading; None leaves them as
    # built (the bench builds its diffusers twin from the bf16 weights before it applies its own).
    kernels: KernelSettings | None = field(default_factory=KernelSettings)
    vae_tile_batch: int = DEFAULT_TILE_BATCH  # tiles per video VAE decoder call (H3_VAE_TILE_BATCH)
    # The VRAM budget in bytes, "auto" (resident when the files fit the free GPU memory, else a budget of it)
    # or None (resident); --vram-budget, H3_VRAM_BUDGET; memory.py.
    vram_budget: int | str | None = None
    prefetch_depth: int = 2  # streamed blocks copied ahead of use
    plan_rows: int | None = None  # the packed rows a budget plans activations for (None: the released canvas)
    # Quantized layers stay as the file stores them (StoredLinear: codes and scales, dequantized at use, the same
    # bits); False dequantizes them at load (what a diffusers twin, sharing our parameters, needs).
    stored_weights: bool = True
    # Host memory the models may hold under a VRAM budget (streamed blocks, parked VAEs), in bytes; None: unchecked
    # (--host-budget, H3_HOST_BUDGET; memory.check_host).
    host_budget: int | None = None
    # Streamed text-encoder layers in page-locked host memory: auto (when the host has room), on, off
    # (H3_TEXT_PIN; memory.text_pinning).
    text_pin: str = "auto"
    # Threads reading streamed text layers from their file ahead of the copies; 0: madvise alone (H3_READ_THREADS).
    read_threads: int = 0

    @property
    def loads_via_host(self) -> bool:
        """Whether the DiT is read into host memory (views of its file) and placed block by block: under a VRAM
        budget, and when its linears become FP8 / NVFP4 (each block converted on the device as it is placed, so the
        GPU never holds the whole model in the file's bf16)."""
        linear = getattr(self.kernels, "linear", "auto") if self.kernels is not None else "auto"
        return self.vram_budget is not None or (linear in ("fp8", "nvfp4") and self.device.startswith("cuda"))


def component_loader(name: str, path: Path, opts: LoadOptions, tokenizer: Path | None = None) -> Callable[[], object]:
    """The function that loads component `name` ("dit", "dit_ref", "text_encoder", "vae", "audio_vae") from
    `path` with `opts`; nothing is read until it is called."""
    from ..checkpoint import load_dit
    from ..text.encoder import TextEncoder
    from ..vae.loading import load_audio_vae, load_video_vae

    # Under a VRAM budget the DiT and the text encoder are read into host memory (their stored tensors stay views
    # of the memory-mapped files); the engine then places what fits on the device (memory.py).
    dit_device = "cpu" if opts.loads_via_host else opts.device
    te_device = "cpu" if opts.vram_budget is not None else opts.device
    loaders: dict[str, Callable[[], object]] = {
        "dit": lambda: load_dit(path, dtype=opts.dtype, device=dit_device, partition="t2va",
                                qkv_layout=opts.qkv_layout, stored=opts.stored_weights),
        "dit_ref": lambda: load_dit(path, dtype=opts.dtype, device=dit_device, partition="ref2va",
                                    qkv_layout=opts.qkv_layout, stored=opts.stored_weights),
        "text_encoder": lambda: TextEncoder.from_pretrained(path, dtype=opts.text_dtype or opts.dtype,
                                                            device=te_device, tokenizer=tokenizer,
                                                            layer=opts.text_layer, stored=opts.stored_weights,
                                                            vision=opts.text_vision),
        "vae": lambda: load_video_vae(path, device=opts.device, decode_dtype=opts.vae_dtype,
                                      stored=opts.stored_weights),
        "audio_vae": lambda: load_audio_vae(path, device=opts.device),
    }
    if name not in loaders:
        raise InputError(f"unknown component {name!r}; components are {', '.join(loaders)}")
    return loaders[name]


def check_fit(comps) -> None:
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


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device} asked for, but this machine has no CUDA GPU")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"--device {device!r} is not a device torch knows ({exc})") from None
