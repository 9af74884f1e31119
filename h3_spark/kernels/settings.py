"""Kernel settings: one typed object, parsed once from the environment at the front door.

Blocks and kernels never read `os.environ`; a front door calls `KernelSettings.from_env()` (or builds
the dataclass itself) and hands the object to the engine (`h3_model.engine.kernel_plan.apply_kernels`). A bad value is an
`H3Error` that names the variable, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

from .attention import (ATTENTION_BACKENDS, HEAD_SLICE_BACKEND, HEAD_SLICE_INNER, HEAD_SLICE_SIZE, SOL_FALLBACKS,
                        SolSettings)
from .capability import SettingsError

LINEAR_FORMATS = ("auto", "bf16", "fp8", "nvfp4", "w4a8")
# The video VAE decoder's block linears: dense in the decode dtype (exact), or FP8 e4m3 (approximate, Hopper+).
VAE_LINEAR_FORMATS = ("dense", "fp8")
AUTO_OFF = ("auto", "off")
MODULATION_FUSION = ("auto", "exact", "off")
SOL_THRESH_TYPES = ("diag", "topk")
SOL_INT8 = ("auto", "on", "off")
# The Q/K scales of fa3_fp8, the one backend the flag feeds (it takes one descale per head, so the kernel's
# per_block granularity is not offered here: it would be accepted and change nothing).
QK_QUANT_GRANULARITY = ("per_head", "per_head_bound")
QK_HADAMARD = (0, 16, 32, 64, 128)
# Spatial tiles the video VAE decodes per decoder call (all tiles of a window have one size, so they stack
# along the batch). One tile alone leaves an H200 mostly idle; front doors take H3_VAE_TILE_BATCH.
DEFAULT_TILE_BATCH = 16


@dataclass(frozen=True)
class KernelSettings:
    attention: str = "auto"
    head_slice_backend: str = HEAD_SLICE_BACKEND
    head_slice_size: int = HEAD_SLICE_SIZE
    sol: SolSettings = field(default_factory=SolSettings)
    linear: str = "auto"
    swiglu_nvfp4_fusion: str = "auto"
    rms_adaln_nvfp4_fusion: str = "auto"
    modulation_fusion: str = "auto"
    q_rms_rope_int8_fusion: str = "auto"
    # Low-bit QK preparation details (H3_QK_*): K smoothing, block Hadamard size (0 = none), scale granularity.
    qk_smooth_k: bool = True
    qk_hadamard: int = 128
    qk_granularity: str = "per_head_bound"
    # H3_NVFP4_STATIC_SCALES: a promoted static-scales artifact (h3-spark calibrate) for the NVFP4 linears; "" = the
    # per-call (dynamic) scales. The engine checks and installs it (h3_model/engine/static_scales.py).
    nvfp4_static_scales: str = ""
    vae_linear: str = "dense"

    def __post_init__(self) -> None:
        _check_choice("H3_ATTENTION", self.attention, ATTENTION_BACKENDS)
        _check_choice("H3_HEAD_SLICE_BACKEND", self.head_slice_backend, HEAD_SLICE_INNER)
        if self.head_slice_size < 1:
            raise SettingsError(f"H3_HEAD_SLICE_SIZE must be a positive number of heads, got {self.head_slice_size}")
        _check_choice("H3_LINEAR", self.linear, LINEAR_FORMATS)
        _check_choice("H3_VAE_LINEAR", self.vae_linear, VAE_LINEAR_FORMATS)
        _check_choice("H3_SWIGLU_NVFP4_FUSION", self.swiglu_nvfp4_fusion, AUTO_OFF)
        _check_choice("H3_RMS_ADALN_NVFP4_FUSION", self.rms_adaln_nvfp4_fusion, AUTO_OFF)
        _check_choice("H3_MODULATION_FUSION", self.modulation_fusion, MODULATION_FUSION)
        _check_choice("H3_Q_RMS_ROPE_INT8_FUSION", self.q_rms_rope_int8_fusion, AUTO_OFF)
        _check_choice("H3_QK_GRANULARITY", self.qk_granularity, QK_QUANT_GRANULARITY)
        if self.qk_hadamard not in QK_HADAMARD:
            raise SettingsError(f"H3_QK_HADAMARD must be one of {', '.join(map(str, QK_HADAMARD))} "
                                f"(0 = no rotation), got {self.qk_hadamard}")
        s = self.sol
        if not s.tau > 0:
            raise SettingsError(f"H3_SOL_TAU must be > 0, got {s.tau}")
        if s.min_tokens < 0:
            raise SettingsError(f"H3_SOL_MIN_TOKENS must be >= 0, got {s.min_tokens}")
        _check_choice("H3_SOL_THRESH_TYPE", s.thresh_type, SOL_THRESH_TYPES)
        if not 0 < s.topk_ratio < 1:
            raise SettingsError(f"H3_SOL_TOPK_RATIO must lie in (0, 1), got {s.topk_ratio}")
        _check_choice("H3_SOL_INT8_QK", s.int8_qk, SOL_INT8)
        _check_choice("H3_SOL_INT8_PV", s.int8_pv, SOL_INT8)
        _check_choice("H3_SOL_FALLBACK", s.fallback, SOL_FALLBACKS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelSettings":
        """Parse every H3_* kernel variable once; unset variables keep the defaults above."""
        env = os.environ if environ is None else environ
        d = cls()
        sd = d.sol
        sol = SolSettings(
            tau=_float(env, "H3_SOL_TAU", sd.tau),
            min_tokens=_int(env, "H3_SOL_MIN_TOKENS", sd.min_tokens),
            thresh_type=_str(env, "H3_SOL_THRESH_TYPE", sd.thresh_type),
            topk_ratio=_float(env, "H3_SOL_TOPK_RATIO", sd.topk_ratio),
            int8_qk=_str(env, "H3_SOL_INT8_QK", sd.int8_qk),
            int8_pv=_str(env, "H3_SOL_INT8_PV", sd.int8_pv),
            fallback=_str(env, "H3_SOL_FALLBACK", sd.fallback),
            strict=_bool(env, "H3_SOL_STRICT", sd.strict),
        )
        return cls(
            attention=_str(env, "H3_ATTENTION", d.attention),
            head_slice_backend=_str(env, "H3_HEAD_SLICE_BACKEND", d.head_slice_backend),
            head_slice_size=_int(env, "H3_HEAD_SLICE_SIZE", d.head_slice_size),
            sol=sol,
            linear=_str(env, "H3_LINEAR", d.linear),
            swiglu_nvfp4_fusion=_str(env, "H3_SWIGLU_NVFP4_FUSION", d.swiglu_nvfp4_fusion),
            rms_adaln_nvfp4_fusion=_str(env, "H3_RMS_ADALN_NVFP4_FUSION", d.rms_adaln_nvfp4_fusion),
            modulation_fusion=_str(env, "H3_MODULATION_FUSION", d.modulation_fusion),
            q_rms_rope_int8_fusion=_str(env, "H3_Q_RMS_ROPE_INT8_FUSION", d.q_rms_rope_int8_fusion),
            qk_smooth_k=_bool(env, "H3_QK_SMOOTH_K", d.qk_smooth_k),
            qk_hadamard=_int(env, "H3_QK_HADAMARD", d.qk_hadamard),
            qk_granularity=_str(env, "H3_QK_GRANULARITY", d.qk_granularity),
            nvfp4_static_scales=(env.get("H3_NVFP4_STATIC_SCALES") or "").strip(),  # a path: case kept
            vae_linear=_str(env, "H3_VAE_LINEAR", d.vae_linear),
        )

    def replace(self, **changes) -> "KernelSettings":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise SettingsError(f"{name}={value!r} is not accepted; use one of: {', '.join(map(str, choices))}")


def _str(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name)
    return default if raw is None or raw.strip() == "" else raw.strip().lower()


def _number(env: Mapping[str, str], name: str, default, kind, what: str):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return kind(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not {what}") from None


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return _number(env, name, default, int, "an integer")


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, float, "a number")


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def kernel_settings(attention: str | None, linear: str | None):
    """The H3_* kernel settings with --attention / --linear on top. The flags are checked here so that an
    error names the flag the user typed, not the H3_ATTENTION / H3_LINEAR variable it overrides."""
    from ..errors import InputError

    flags = (("attention", attention, ATTENTION_BACKENDS), ("linear", linear, LINEAR_FORMATS))
    for name, value, choices in flags:
        if value is not None and value not in choices:
            raise InputError(f"--{name} {value!r} is not accepted; use one of: {', '.join(choices)}")
    return dataclasses.replace(KernelSettings.from_env(), **{k: v for k, v, _ in flags if v is not None})


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r} is not a yes/no value; use one of: {', '.join(_TRUE + _FALSE)}")


def vae_tile_batch(environ: Mapping[str, str] | None = None) -> int:
    """H3_VAE_TILE_BATCH: tiles per video VAE decoder call (every front door reads it, the engine does not)."""
    from ..errors import InputError

    raw = (os.environ if environ is None else environ).get("H3_VAE_TILE_BATCH", "")
    if raw == "":
        return DEFAULT_TILE_BATCH
    try:
        value = int(raw)
    except ValueError:
        raise InputError(f"H3_VAE_TILE_BATCH={raw!r}: expected a whole number of tiles (>= 1)") from None
    return check_tile_batch(value, "H3_VAE_TILE_BATCH")


def check_tile_batch(tile_batch: int, source: str = "tile_batch") -> int:
    """A tiles-per-decoder-call count, validated."""
    from ..errors import InputError

    if isinstance(tile_batch, bool) or not isinstance(tile_batch, int) or tile_batch < 1:
        raise InputError(f"{source} must be a whole number of tiles >= 1, got {tile_batch!r}")
    return tile_batch
