"""The H3 DiT under ComfyUI's model management: ComfyUI decides how much GPU memory it gets, we decide which
blocks stay and which stream.

ComfyUI loads a model with `load_models_gpu`: it frees other models to make room, works out what the model
may hold (free memory less the request's activations, `--reserve-vram` and its inference minimum; everything
with `--highvram` / `--gpu-only`; next to nothing with `--novram`) and calls the patcher's `partially_load`.
When it needs memory for another model it calls `partially_unload`, and `detach` to unload. ComfyUI's own
patcher answers by casting individual layers from the CPU at use (`comfy.ops`); our DiT has no such layers,
so this patcher answers with `engine.placement.Placement`: the first blocks resident, the rest streamed ahead
of use, the AdaLN projections in host memory. Streamed forwards are the resident forward bit for bit.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..errors import InputError
from ..h3_model.engine.memory import gb
from ..h3_model.engine.placement import Placement
from . import host

log = logging.getLogger("h3_spark")
RESERVE = "_h3_reserve"  # bytes the next sampling needs beside the weights (its activations), set before loading


@functools.cache
def dit_patcher_class():
    """A ModelPatcher subclass whose weights move through our Placement (ComfyUI must be importable)."""
    base = host.optional_module("comfy.model_patcher").ModelPatcher
    mm = host.optional_module("comfy.model_management")

    class H3DiTPatcher(base):
        """ModelPatcher over a Held DiT; the DiT's Placement is shared by every clone."""

        def placement(self) -> Placement:
            return Placement.of(self.model.inner)

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
            room = before + extra_memory
            if torch.device(device_to).type != "cpu":
                # What is free now, less what the sampling will need beside the weights: ComfyUI's own share
                # can exceed it (its weight-memory ratio), and a streamed DiT cannot borrow from activations.
                reserve = getattr(self.model, RESERVE, 0) + mm.minimum_inference_memory()
                free = before + mm.get_free_memory(device_to) - reserve
                room = min(room, free)
                minimum = placement.minimum()
                if room < minimum:
                    if free < minimum:
                        raise InputError(
                            f"ComfyUI can give the H3 DiT {gb(max(free, 0))} of GPU memory after this request's "
                            f"activations ({gb(getattr(self.model, RESERVE, 0))}) and its reserve "
                            f"({gb(mm.minimum_inference_memory())}, --reserve-vram included); a streamed DiT needs "
                            f"at least {gb(minimum)}: free other models, lower --reserve-vram, or use a smaller "
                            "canvas or fewer frames")
                    room = minimum  # --novram asks for as little as possible: that is the least we run in
            plan = placement.place(device_to, None if room >= placement.size() else room)
            self._bookkeep(device_to)
            log.info("h3-spark DiT: %s", _line(plan, placement))
            return self.loaded_size() - before

        def partially_unload(self, device_to, memory_to_free=0):
            placement = self.placement()
            before = self.loaded_size()
            placement.shrink(before - memory_to_free)
            self._bookkeep(placement.device or device_to)
            return before - self.loaded_size()

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            room = None if full_load or not lowvram_model_memory else int(lowvram_model_memory)
            self.placement().place(device_to, room)
            self._bookkeep(device_to)

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            if unpatch_weights:
                self.placement().to_host()
            super().unpatch_model(device_to, unpatch_weights)

        def _bookkeep(self, device) -> None:
            # The fields ComfyUI's own load leaves; our modules never take its per-layer casting path.
            self.model.device = device
            self.model.model_loaded_weight_memory = self.loaded_size()
            self.model.model_lowvram = False

    return H3DiTPatcher


def _line(plan, placement: Placement) -> str:
    if not plan.streaming:
        return f"resident, {gb(placement.loaded())} on the GPU"
    return (f"{plan.resident_blocks} of {len(plan.blocks)} blocks resident, {len(plan.streamed)} streamed "
            f"(prefetch depth {plan.depth}), AdaLN projections in host memory; {gb(placement.loaded())} on the GPU")


def load_dit(patcher, activation_bytes: int):
    """Have ComfyUI place the DiT for a sampling that needs `activation_bytes` beside its weights; returns the
    device to run on. Outside ComfyUI the DiT is resident on the compute device."""
    mm = host.optional_module("comfy.model_management")
    if isinstance(patcher, host.LocalModel) or mm is None:
        return host.load_for_compute(patcher)
    setattr(patcher.model, RESERVE, int(activation_bytes))
    mm.load_models_gpu([patcher], memory_required=int(activation_bytes))
    return patcher.load_device
