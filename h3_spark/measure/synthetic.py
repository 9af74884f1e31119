"""Synthetic models built directly on the device: random weights, released shapes.

The released H3 weights cannot be downloaded here. Random weights do not change the timing of these
dense models (same shapes, same kernels), so benchmarks and the service's cold start use models built
this way, and results made with them say so. Nothing is zero: linear and conv weights are random
(N(0, 1/fan_in) in the DiT and the VAEs, N(0, 0.02) in Qwen3-VL as its own initializer does), norm
weights are near 1, biases small.

`full` is the released geometry: the 50-block DiT, Qwen3-VL-32B cut after layer 50 with its 16-pixel
vision patch (a byte-level tokenizer stands in for Qwen's vocabulary), the 16x video VAE and the audio
VAE. `tiny` is the demo's model set, for tests on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ..h3_model.dit.config import DiTConfig
from ..h3_model.dit.model import H3DiT, keeps_fp32

# Qwen3-VL-32B's sizes and processor budget: one definition, beside make-checkpoint's text-encoder writer.
from ..h3_model.text.synthetic import QWEN3VL_32B_TEXT, QWEN3VL_32B_VISION, QWEN3VL_PIXELS, QWEN3VL_VOCAB  # noqa: E402,F401
PRESETS = ("full", "tiny")
COMPONENTS = ("dit", "dit_ref", "text_encoder", "vae", "audio_vae")
MODE_KEYS = {"t2va": "dit", "fl2va": "dit", "ref2va": "dit_ref"}


def tiny_nvfp4_config() -> DiTConfig:
    """The demo's tiny DiT at hidden width 32: its 24 wide blocks have no NVFP4 form (the FP4 GEMM takes K in
    multiples of 32), so the NVFP4 tools' tests (calibrate --synthetic tiny) use this one."""
    from ..h3_model.engine import demo

    return dataclasses.replace(demo.DIT_CONFIG, hidden_size=32)


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        from ..errors import InputError

        raise InputError(f"synthetic preset must be one of {', '.join(PRESETS)}, got {preset!r}")


DIT_INITS = ("fan_in", "normal_0.02")


@torch.no_grad()
def synthetic_dit(config: DiTConfig, dtype: torch.dtype, device: str, seed: int = 0,
                  init: str = "fan_in") -> H3DiT:
    """The DiT with random weights made on `device`.

    init "fan_in" (default) draws every tensor by make-checkpoint's rule (checkpoint/synthetic.init_rule:
    unit-gain linears, small AdaLN): like a trained network, 50 blocks of it do not amplify rounding
    much, so quality comparisons on it mean something. "normal_0.02" is N(0, 0.02) everywhere (norm gains
    N(1, 0.02)), what the first H200 receipts used: at 5376 wide that is a gain of ~1.5 per linear, and
    the stack turns any rounding difference into several percent of the output."""
    from ..h3_model.checkpoint.synthetic import init_rule

    if init not in DIT_INITS:
        from ..errors import InputError

        raise InputError(f"synthetic DiT init must be one of {', '.join(DIT_INITS)}, got {init!r}")
    model = H3DiT(config, dtype=dtype, device="meta")
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors():
        for name, param in model.named_parameters():
            target = torch.float32 if keeps_fp32(name, config) else dtype
            value = torch.empty(param.shape, dtype=target, device=device)
            if init == "fan_in":
                mean, std = init_rule(name, tuple(param.shape))
            else:
                mean, std = (1.0 if "norm" in name and name.endswith("weight") and param.ndim == 1 else 0.0), 0.02
            value.normal_(mean, std, generator=gen)
            yield name, value

    model.load_state(tensors(), device=device)
    return model.eval()


def _random_like(name: str, shape: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator,
                 std: Callable[[tuple[int, ...]], float]) -> torch.Tensor:
    value = torch.empty(shape, dtype=torch.float32, device=device)
    if len(shape) == 1 and name.endswith("weight"):
        value.normal_(1.0, 0.02, generator=gen)
    elif name.endswith("bias") or len(shape) <= 1:
        value.normal_(0.0, 0.02, generator=gen)
    else:
        value.normal_(0.0, std(shape), generator=gen)
    return value.to(dtype)


def _fan_in_std(shape: tuple[int, ...]) -> float:
    return 1.0 / math.sqrt(max(1, math.prod(shape[1:])))


@torch.no_grad()
def synthetic_video_vae(config, device: str, decode_dtype: torch.dtype = torch.float16, seed: int = 0):
    """The video VAE of `config` with random weights, assigned through the loader's own checks."""
    from ..h3_model.vae import video as V
    from ..h3_model.vae.loading import _materialize
    from ..h3_model.vae.synthetic import synthetic_latent_stats

    mean, std = synthetic_latent_stats(config.latent_channels, seed)
    config = dataclasses.replace(config, latents_mean=mean, latents_std=std)
    with torch.device("meta"):
        model = V.VideoVAE(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    entries = ((n, _random_like(n, tuple(t.shape), torch.float32, device, gen, _fan_in_std))
               for n, t in model.state_dict().items())
    return _materialize(model, entries, lambda n: V.param_dtype(n, decode_dtype), torch.device(device),
                        "synthetic video VAE")


@torch.no_grad()
def synthetic_audio_vae(config, device: str, seed: int = 0):
    from ..h3_model.vae import audio as A
    from ..h3_model.vae.loading import _audio_buffer, _materialize
    from ..h3_model.vae.synthetic import _with_audio_stats

    config = _with_audio_stats(config, seed)
    with torch.device("meta"):
        model = A.AudioVAE(config)
    params = {n for n, _ in model.named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    entries = ((n, _random_like(n, tuple(t.shape), torch.float32, device, gen, _fan_in_std))
               for n, t in model.state_dict().items() if n in params)
    return _materialize(model, entries, lambda n: torch.float32, torch.device(device), "synthetic audio VAE",
                        fill_missing=_audio_buffer)


def _text_config(preset: str, tok, layer: int):
    """(the layer read, the Qwen3-VL config) of a synthetic text encoder: the 32B geometry cut at `layer` for
    `full`, the demo's for `tiny`."""
    from ..h3_model.engine import demo

    if preset == "full":
        return layer, demo.text_config(tok, layers=layer, text=QWEN3VL_32B_TEXT, vision=QWEN3VL_32B_VISION,
                                       vocab_size=QWEN3VL_VOCAB)
    return demo.TEXT_READ_LAYER, demo.text_config(tok, layers=demo.TEXT_READ_LAYER)


@torch.no_grad()
def synthetic_text_encoder(preset: str, device: str, dtype: torch.dtype, seed: int = 0, layer: int = 50):
    """Qwen3-VL cut after `layer` (the released 32B geometry for `full`), random weights, as a TextEncoder."""
    _check_preset(preset)
    from ..h3_model.engine import demo
    from ..h3_model.text.encoder import TextEncoder, _check_token_ids, _drop_final_norm, _rebuild_rotary
    from ..h3_model.text.torchvision_compat import ensure_importable

    ensure_importable()
    from transformers import Qwen3VLModel

    tok = demo.make_tokenizer()
    layer, config = _text_config(preset, tok, layer)
    if preset == "full":
        processor = demo.make_processor(tok, patch_size=16, image_pixels=QWEN3VL_PIXELS, video_pixels=QWEN3VL_PIXELS)
    else:
        processor = demo.make_processor(tok)
    _check_token_ids(config, tok, "synthetic text encoder")
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    for name, p in model.named_parameters():
        p.copy_(_random_like(name, tuple(p.shape), p.dtype, device, gen, lambda shape: 0.02))
    _rebuild_rotary(model, config, torch.device(device))
    _drop_final_norm(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"synthetic text encoder: tensors left unmaterialized: {left[:4]}")
    return TextEncoder(model, tok, processor, layer=layer, dtype=dtype, device=torch.device(device),
                       source=f"synthetic Qwen3-VL ({preset}), random weights")


def component_builders(preset: str, modes: list[str], device: str, dtype: torch.dtype,
                       vae_dtype: torch.dtype = torch.float16, seed: int = 0, text_layer: int = 50,
                       dit_init: str = "fan_in", fasth3: bool = False) -> dict[str, Callable[[], object]]:
    """Component name -> a function that builds it (the service's load overrides take these). `fasth3`: the DiT
    carries FastH3's VSA gates (random, non-zero), so the fasth3 recipe runs its VSA attention."""
    _check_preset(preset)
    from ..errors import InputError
    from ..h3_model.dit.config import preset as dit_preset
    from ..h3_model.engine import demo
    from ..h3_model.vae import audio as audio_vae
    from ..h3_model.vae import video_config

    bad = [m for m in modes if m not in MODE_KEYS]
    if bad or not modes:
        raise InputError(f"synthetic modes must be among {', '.join(MODE_KEYS)}, got {modes}")
    dit_config = dit_preset("full") if preset == "full" else demo.DIT_CONFIG
    if fasth3:
        from ..h3_model.checkpoint.fasth3 import fasth3_config

        dit_config = fasth3_config(dit_config)
    builders: dict[str, Callable[[], object]] = {}
    for key in sorted({MODE_KEYS[m] for m in modes}):
        builders[key] = SizedBuilder(
            lambda key=key: synthetic_dit(dit_config, dtype, device, seed=seed + (key == "dit_ref"), init=dit_init),
            lambda: _dit_bytes(dit_config, dtype), dit_config)
    builders["text_encoder"] = SizedBuilder(lambda: synthetic_text_encoder(preset, device, dtype, seed, text_layer),
                                            lambda: _text_encoder_bytes(preset, dtype, text_layer))
    vae_config = video_config.FULL if preset == "full" else demo.DEMO_VAE
    builders["vae"] = SizedBuilder(lambda: synthetic_video_vae(vae_config, device, vae_dtype, seed),
                                   lambda: _video_vae_bytes(vae_config, vae_dtype))
    audio_config = audio_vae.preset(preset)
    builders["audio_vae"] = SizedBuilder(lambda: synthetic_audio_vae(audio_config, device, seed),
                                         lambda: _audio_vae_bytes(audio_config))
    return builders


@dataclasses.dataclass(frozen=True)
class SizedBuilder:
    """A component builder that also says how many device bytes its model holds, read from the config on the meta
    device: what lets `--vram-budget auto` plan synthetic models as it plans files from their headers (without it
    a full-size set built on an 80 GB card ran out of memory while being placed)."""

    build: Callable[[], object]
    size: Callable[[], int]
    dit_config: DiTConfig | None = None  # a DiT's config, for the activations the plan adds

    def __call__(self):
        return self.build()

    def planned_bytes(self) -> int:
        return int(self.size())


def _module_bytes(model: torch.nn.Module, dtype_of: Callable[[str, torch.Tensor], torch.dtype]) -> int:
    return sum(p.numel() * torch.empty(0, dtype=dtype_of(n, p)).element_size() for n, p in model.named_parameters())


def _dit_bytes(config: DiTConfig, dtype: torch.dtype) -> int:
    model = H3DiT(config, dtype=dtype, device="meta")
    return _module_bytes(model, lambda n, p: torch.float32 if keeps_fp32(n, config) else dtype)


def _text_encoder_bytes(preset: str, dtype: torch.dtype, layer: int) -> int:
    from ..h3_model.engine import demo
    from ..h3_model.text.torchvision_compat import ensure_importable

    ensure_importable()
    from transformers import Qwen3VLModel

    from ..h3_model.text.encoder import _drop_final_norm

    _, config = _text_config(preset, demo.make_tokenizer(), layer)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    _drop_final_norm(model)  # as the built encoder: its hidden states are read before the final norm
    return _module_bytes(model, lambda n, p: dtype)


def _video_vae_bytes(config, decode_dtype: torch.dtype) -> int:
    from ..h3_model.vae.video import parameter_bytes

    return parameter_bytes(config, decode_dtype)


def _audio_vae_bytes(config) -> int:
    from ..h3_model.vae import audio as A

    with torch.device("meta"):
        model = A.AudioVAE(config)
    return _module_bytes(model, lambda n, p: torch.float32)


def synthetic_components(preset: str, modes: list[str], device: str, dtype: torch.dtype,
                         vae_dtype: torch.dtype = torch.float16, seed: int = 0, text_layer: int = 50,
                         log: Callable[[str], None] = lambda message: None, dit_init: str = "fan_in",
                         kernels=None, vram_budget: int | None = None, prefetch_depth: int = 2,
                         plan_rows: int | None = None, fasth3: bool = False, host_budget: int | None = None):
    """(the engine over these components, seconds per component), built on `device`. Without `kernels` the
    engine's kernels are left as built (the bench applies its own after any diffusers twin); a `vram_budget`
    (bytes, or "auto": the engine sizes the components from their configs and chooses) places them as the
    engine does for a smaller card, checked against `host_budget` as the front doors check it."""
    from ..h3_model.engine.engine import Engine
    from ..h3_model.engine.flags import read_threads, text_pin
    from ..h3_model.engine.loading import LoadOptions

    builders = component_builders(preset, modes, device, dtype, vae_dtype, seed, text_layer, dit_init, fasth3)
    options = LoadOptions(device=device, dtype=dtype, vae_dtype=vae_dtype, text_layer=text_layer, kernels=kernels,
                          vram_budget=vram_budget, prefetch_depth=prefetch_depth, plan_rows=plan_rows,
                          host_budget=host_budget, text_pin=text_pin(),
                          read_threads=read_threads())
    engine = Engine(options=options, overrides=builders)

    def progress(event) -> None:
        if event.state == "loading":
            log(f"building synthetic {event.component} ({preset})")

    engine.load(modes, on_progress=progress)
    return engine, dict(engine.load_seconds)


def describe(preset: str, dit_init: str = "fan_in", text_encoder: bool = True, fasth3: bool = False) -> str:
    """What a result says its weights were."""
    stand_in = "; the text encoder uses a byte-level stand-in tokenizer" if text_encoder else ""
    model = " a FastH3 DiT (random non-zero VSA gates)," if fasth3 else ""
    return (f"synthetic random weights, preset {preset},{model} DiT init {dit_init}, built on the device (real H3 weights "
            f"are not available here; timing does not depend on weight values{stand_in})")
