"""Static NVFP4 activation scales: one global scale per block linear, given instead of measured per call.

Dynamic NVFP4 (the default, always valid) encodes each activation with global scale amax / (448 * 6), which
costs a reduction over the whole activation before every one of the ~200 block GEMMs of an evaluation (the
first pass of nvfp4.py's kernel). A static scale, calibrated offline (measure/nvfp4_calibration.py) and
promoted by a gate, removes that pass. An input larger than the static range saturates as NVFP4 does: its
block scales clamp at e4m3's 448 and its values at +-6 times that; the saturated blocks are counted per layer.

Here: which layers take static scales, setting and clearing them on a converted DiT, turning them off for one
request, and the amax observer calibration uses. The reference emulation calibration runs on (any device) is
installed by the engine (h3_model/engine/block_linears.emulate_nvfp4).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .dispatch import block_linears
from .nvfp4 import E2M1_MAX, E4M3_MAX, Nvfp4Activation, Nvfp4Linear, StaticInput

# q, k and v read one activation (the fused RMSNorm + AdaLN producer encodes it once for all three), so they
# take one scale and are excluded together.
SHARED_INPUT = ("attn.to_q", "attn.to_k", "attn.to_v")
RANGE = E4M3_MAX * E2M1_MAX  # the largest magnitude a global scale g represents is RANGE * g


def nvfp4_linears(model: nn.Module) -> dict[str, Nvfp4Linear]:
    found = block_linears(model)
    plain = [n for n, m in found.items() if not isinstance(m, Nvfp4Linear)]
    if plain:
        from .capability import KernelUnavailable

        raise KernelUnavailable(f"static NVFP4 scales need NVFP4 block linears; {plain[0]} is "
                                f"{type(found[plain[0]]).__name__} (H3_LINEAR must resolve to nvfp4)")
    return found


def layer_shapes(model: nn.Module) -> dict[str, list[int]]:
    """[out_features, in_features] of every NVFP4 block linear: what an artifact's layers must match."""
    return {n: [m.out_features, m.in_features] for n, m in nvfp4_linears(model).items()}


def sharing_group(name: str) -> list[str]:
    """The layers that read the same activation as `name` (q, k, v of one block; else `name` alone)."""
    prefix, _, leaf = name.rpartition(".attn.")
    if leaf and f"attn.{leaf}" in SHARED_INPUT:
        return [f"{prefix}.{n}" for n in SHARED_INPUT]
    return [name]


# ------------------------------------------------------------------------------------------ setting scales
def install(model: nn.Module, scales: dict[str, float], excluded: set[str] = frozenset(), device=None) -> dict:
    """Give each layer of `scales` (global scale, > 0) its static scale, except `excluded` (dynamic); every
    block linear must be named in one of them. `device`: where the model runs (default: each layer's weight's;
    a streamed block's weights wait in host memory). Returns {"static": n, "dynamic": n}."""
    layers = nvfp4_linears(model)
    unknown = sorted((set(scales) | set(excluded)) - set(layers))
    missing = sorted(set(layers) - set(scales) - set(excluded))
    if unknown or missing:
        raise ValueError(f"static scales name {len(unknown)} unknown layer(s) {unknown[:2]} and miss "
                         f"{len(missing)} {missing[:2]}")
    clear(model)
    for name, m in layers.items():
        group = sharing_group(name)
        if any(n in excluded for n in group):
            continue
        g = max(float(scales[n]) for n in group)  # equal for q, k, v by construction; max keeps it safe
        if not g > 0:
            raise ValueError(f"static scale of {name} is {g}; a global scale must be > 0")
        m.static = StaticInput.of(g, m.weight.device if device is None else device)
    # The fused RMSNorm + AdaLN producer encodes for the norm's consumer: to_q (q, k, v) and fc1. A bound method,
    # not the module: a module set on another becomes its submodule (a second name in the state dict).
    for blk in model.transformer_blocks:
        blk.norm1.nvfp4_static_of = blk.attn.to_q.input_static
        blk.norm2.nvfp4_static_of = blk.ff.net[0].proj.input_static
    n_static = sum(m.static is not None for m in layers.values())
    return {"static": n_static, "dynamic": len(layers) - n_static}


def clear(model: nn.Module) -> None:
    for m in block_linears(model).values():
        if isinstance(m, Nvfp4Linear):
            m.static, m.static_on = None, True
    for blk in model.transformer_blocks:
        for norm in (blk.norm1, blk.norm2):
            norm.__dict__.pop("nvfp4_static_of", None)


@contextlib.contextmanager
def dynamic(model: nn.Module) -> Iterator[None]:
    """Every layer measures its own amax inside this block (a request outside the calibrated shapes)."""
    layers = [m for m in block_linears(model).values() if isinstance(m, Nvfp4Linear)]
    before = [m.static_on for m in layers]
    for m in layers:
        m.static_on = False
    try:
        yield
    finally:
        for m, on in zip(layers, before):
            m.static_on = on


def take_saturation(model: nn.Module) -> dict[str, int]:
    """Saturated 16-value blocks per static layer since the last call (non-zero ones), counters reset."""
    out = {}
    for name, m in block_linears(model).items():
        st = getattr(m, "static", None)
        if st is not None:
            n = int(st.saturated.item())
            st.saturated.zero_()
            if n:
                out[name] = n
    return out


# ------------------------------------------------------------------------------------------ observing
class AmaxObserver:
    """Records, per NVFP4 block linear, the amax of every input it quantizes itself (the value the dynamic
    path's reduction computes): calls, max and mean. Calibration and the gate run with it; the fused producers
    hand their linears encoded inputs, so it needs them off (the emulation has none)."""

    def __init__(self, model: nn.Module):
        self.layers = nvfp4_linears(model)
        self.calls = {n: 0 for n in self.layers}
        self.max = {n: 0.0 for n in self.layers}
        self.sum = {n: 0.0 for n in self.layers}
        self._hooks = []

    def __enter__(self) -> "AmaxObserver":
        for name, m in self.layers.items():
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, name=name: self._see(name, args[0])))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _see(self, name: str, x) -> None:
        if isinstance(x, Nvfp4Activation):
            raise RuntimeError(f"{name} received an encoded activation: observe with the NVFP4 fusions off")
        amax = float(x.detach().float().abs().amax())
        self.calls[name] += 1
        self.max[name] = max(self.max[name], amax)
        self.sum[name] += amax

    def stats(self) -> dict[str, dict]:
        return {n: {"calls": self.calls[n], "amax_max": self.max[n],
                    "amax_mean": self.sum[n] / self.calls[n] if self.calls[n] else 0.0} for n in self.layers}


def scale_for_amax(amax: float) -> float:
    """The global scale whose range is exactly `amax` (what the dynamic path takes for an input of that amax)."""
    return float((torch.tensor(amax, dtype=torch.float32).clamp_min(1e-30) / RANGE).item())


def static_range(scale: float) -> float:
    """The largest input magnitude a global scale represents without saturating."""
    return float(scale) * RANGE
