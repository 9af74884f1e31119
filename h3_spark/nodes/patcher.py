"""The H3 DiT and text encoder under ComfyUI's model management: ComfyUI decides how much GPU memory each
gets, we decide which blocks stay and which stream.

ComfyUI loads a model with `load_models_gpu`: it frees other models to make room, works out what the model
may hold (free memory less the request's activations, `--reserve-vram` and its inference minimum; everything
with `--highvram` / `--gpu-only`; next to nothing with `--novram`) and calls the patcher's `partially_load`.
When it needs memory for another model it calls `partially_unload`, and `detach` to unload. ComfyUI's own
patcher answers by casting individual layers from the CPU at use (`comfy.ops`); our DiT has no such layers,
so this patcher answers with `engine.placement.Placement`: the first blocks resident, the rest streamed ahead
of use, the AdaLN projections in host memory. Streamed forwards are the resident forward bit for bit. The
text encoder (engine.placement.TextPlacement) is resident or has all its decoder layers streamed.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..errors import InputError
from ..h3_model.engine.memory import gb
from ..h3_model.engine.placement import Placement, TextPlacement
from . import host

log = logging.getLogger("h3_spark")
RESERVE = "_h3_reserve"  # bytes the next sampling needs beside the weights (its activations), set before loading


def _room(patcher, mm, device, before: int, extra: int, minimum: int, what: str) -> int:
    """Bytes the model may hold: ComfyUI's share, but no more than what is free now less what its run needs
    beside the weights (ComfyUI's share can exceed that, and streamed weights cannot borrow from activations);
    at least the model's minimum (--novram asks for as little as possible), or an error naming it."""
    room = before + extra
    if torch.device(device).type == "cpu":
        return room
    need = getattr(patcher.model, RESERVE, 0)
    reserve = need + mm.minimum_inference_memory()
    free = before + mm.get_free_memory(device) - reserve
    room = min(room, free)
    if room >= minimum:
        return room
    if free < minimum:
        raise InputError(
            f"ComfyUI can give the {what} {gb(max(free, 0))} of GPU memory after this run's activations "
            f"({gb(need)}) and its reserve ({gb(mm.minimum_inference_memory())}, --reserve-vram included); "
            f"streamed, it needs at least {gb(minimum)}: free other models, lower --reserve-vram, or use a "
            "smaller canvas or fewer frames")
    return minimum


def _bookkeep(patcher, device) -> None:
    # The fields ComfyUI's own load leaves; our modules never take its per-layer casting path.
    patcher.model.device = device
    patcher.model.model_loaded_weight_memory = patcher.loaded_size()
    patcher.model.model_lowvram = False


@functools.cache
def _placed_patcher_class():
    """A ModelPatcher whose weights move through one of our placements (ComfyUI must be importable)."""
    base = host.optional_module("comfy.model_patcher").ModelPatcher
    mm = host.optional_module("comfy.model_management")

    class PlacedPatcher(base):
        what = "model"

        def placement(self):
            raise NotImplementedError

        def place(self, device, room: int | None) -> None:
            raise NotImplementedError

        def model_size(self):
            return self.placement().size()

        def loaded_size(self):
            return self.placement().loaded()

        def current_loaded_device(self):
            placement = self.placement()
            return placement.device if placement.device is not None else self.offload_device

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            placement = self.placement()
            before = self.loaded_size()
            room = _room(self, mm, device_to, before, extra_memory, placement.minimum(), self.what)
            self.place(device_to, None if room >= placement.size() else room)
            _bookkeep(self, device_to)
            return self.loaded_size() - before

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            self.place(device_to, None if full_load or not lowvram_model_memory else int(lowvram_model_memory))
            _bookkeep(self, device_to)

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            if unpatch_weights:
                self.placement().to_host()
            super().unpatch_model(device_to, unpatch_weights)

    return PlacedPatcher


@functools.cache
def dit_patcher_class():
    """The DiT's patcher; its Placement lives on the DiT, so every clone shares it."""

    class H3DiTPatcher(_placed_patcher_class()):
        what = "H3 DiT"

        def placement(self) -> Placement:
            return Placement.of(self.model.inner)

        def place(self, device, room):
            placement = self.placement()
            log.info("h3-spark DiT: %s", _line(placement.place(device, room), placement))

        def partially_unload(self, device_to, memory_to_free=0):
            placement = self.placement()
            before = self.loaded_size()
            placement.shrink(before - memory_to_free)
            _bookkeep(self, placement.device or device_to)
            return before - self.loaded_size()

    return H3DiTPatcher


@functools.cache
def text_patcher_class():
    """The text encoder's patcher: resident when ComfyUI's share holds it, else its decoder layers stream."""

    class H3TextPatcher(_placed_patcher_class()):
        what = "text encoder"

        def placement(self) -> TextPlacement:
            return TextPlacement.of(self.model.owner)

        def place(self, device, room):
            streamed = self.placement().place(device, room)
            log.info("h3-spark text encoder: %s, %s on %s", "decoder layers streamed" if streamed else "resident",
                     gb(self.placement().loaded()), self.placement().device)

        def partially_unload(self, device_to, memory_to_free=0):
            # All or nothing: it runs once per prompt, and streamed it already holds the least it can.
            before = self.loaded_size()
            self.placement().to_host()
            _bookkeep(self, device_to)
            return before - self.loaded_size()

    return H3TextPatcher


def _line(plan, placement: Placement) -> str:
    # The device by name: under `--cpu` ComfyUI's compute device is the CPU, and "on the GPU" would be wrong.
    if not plan.streaming:
        return f"resident, {gb(placement.loaded())} on {placement.device}"
    return (f"{plan.resident_blocks} of {len(plan.blocks)} blocks resident, {len(plan.streamed)} streamed "
            f"(prefetch depth {plan.depth}), AdaLN projections in host memory; {gb(placement.loaded())} on "
            f"{placement.device}")


def load_text_encoder(patcher, encoder):
    """Have ComfyUI place `encoder` (the TextEncoder `patcher` holds) for one encode; outside ComfyUI it is
    resident on the compute device. Either way the encoder's `.device` is where it runs."""
    from ..h3_model.engine.memory import text_activation_bytes

    mm = host.optional_module("comfy.model_management")
    if isinstance(patcher, host.LocalModel) or mm is None:
        encoder.device = torch.device(host.load_for_compute(patcher))
        return encoder.device
    need = text_activation_bytes(encoder)
    setattr(patcher.model, RESERVE, need)
    mm.load_models_gpu([patcher], memory_required=need)
    return encoder.device


def load_dit(patcher, activation_bytes: int):
    """Have ComfyUI place the DiT for a sampling that needs `activation_bytes` beside its weights; returns the
    device to run on. Outside ComfyUI the DiT is resident on the compute device."""
    mm = host.optional_module("comfy.model_management")
    if isinstance(patcher, host.LocalModel) or mm is None:
        return host.load_for_compute(patcher)
    setattr(patcher.model, RESERVE, int(activation_bytes))
    mm.load_models_gpu([patcher], memory_required=int(activation_bytes))
    return patcher.load_device
