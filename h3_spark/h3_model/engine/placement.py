"""A DiT whose share of the GPU changes while it stays loaded.

The CLI and the service plan once, at load, for a fixed budget (memory.plan_dit, then place_dit). Inside ComfyUI
the share is ComfyUI's: its model management gives the DiT what the other loaded models and the request's
activations leave, and takes memory back when another model needs it. `Placement` keeps one DiT placed for the
weight room it is given now:
- everything resident when it fits;
- otherwise the first blocks resident and the rest streamed through `depth` slots (dit/streaming.py), with
  the AdaLN projections in host memory;
- everything in host memory when it is unloaded.

Moving between those is incremental. Blocks that stream again keep their pinned host buffers (no repacking);
blocks that become resident are copied up from them and give them back; blocks that stop being resident
are packed from the GPU. Weights are never changed on the way, so every placement runs the same forward.

A ControlNet tower under the CLI's and the service's fixed budget is placed once, by `place_tower`, through the
same BlockStream.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import InputError
from ..dit.streaming import ADALN, UNITS, BlockStream, forget_units, packed_bytes
from .memory import (DEFAULT_DEPTH, MemoryPlan, fit, gb, measure, outside_blocks_to, stream_text_encoder,
                     streamed_minimum, tensor_bytes)

PLACEMENT = "_h3_placement"


class Placement:
    """Where one DiT's weights are now, and how to move them for a new weight room."""

    def __init__(self, model: nn.Module, depth: int = DEFAULT_DEPTH):
        self.model = model
        self.depth = depth
        self.device: torch.device | None = None  # None: everything in host memory
        self.plan: MemoryPlan | None = None

    @staticmethod
    def of(model: nn.Module, depth: int = DEFAULT_DEPTH) -> "Placement":
        """The DiT's own placement (clones of a ComfyUI model share one DiT, so they share it too)."""
        placement = model.__dict__.get(PLACEMENT)
        if placement is None:
            placement = model.__dict__[PLACEMENT] = Placement(model, depth)
        return placement

    # ------------------------------------------------------------------ sizes
    @property
    def stream(self) -> BlockStream | None:
        return getattr(self.model, "block_stream", None)

    def size(self) -> int:
        """The weights' bytes wherever they are (streamed ones sit in their host buffers)."""
        stream = self.stream
        return tensor_bytes(self.model) + (stream.host_bytes + stream.in_place_bytes if stream is not None else 0)

    def loaded(self) -> int:
        """Device bytes held now: resident tensors and the stream's slots (a streamed tensor is empty in its
        module between turns)."""
        if self.device is None:
            return 0
        stream = self.stream
        slots = stream.slot_bytes if stream is not None else 0
        return tensor_bytes(self.model, on=self.device.type) + slots

    def weights_plan(self, room: int | None) -> MemoryPlan:
        """The plan for `room` bytes of weights (activations are the caller's to reserve)."""
        plan = self._measure(room)
        if room is not None and not fit(plan, room):
            plan.resident_blocks, plan.adaln_on_host = 0, True
        return plan

    def minimum(self) -> int:
        """The least GPU memory the DiT runs in: weights outside the blocks and the slots."""
        return streamed_minimum(self._measure(None))

    def _measure(self, room: int | None) -> MemoryPlan:
        """The DiT's parts in bytes as if at rest: a streamed tensor is empty in its module, so its unit counts."""
        plan = measure(self.model, 0, depth=self.depth, budget=room)
        stream = self.stream
        if stream is not None:
            for i, unit in stream.units.items():
                plan.blocks[i] += _unit_bytes(unit)
            for i, unit in stream.adaln.items():
                plan.adaln[i] += _unit_bytes(unit)
        return plan

    # ------------------------------------------------------------------ moves
    def place(self, device: torch.device | str, room: int | None) -> MemoryPlan:
        """Resident when `room` (bytes for weights; None: no limit) holds everything, else stream what does not
        fit; refused, with the minimum named, when not even a fully streamed DiT fits."""
        plan = self.weights_plan(room)
        if room is not None and plan.device_bytes > room:
            raise InputError(f"{gb(room)} of GPU memory for the H3 DiT's weights is below the {gb(plan.device_bytes)} "
                             f"a streamed DiT needs ({gb(plan.fixed)} outside the blocks and {self.depth} block slots "
                             f"of {gb(plan.slot_bytes // self.depth)})")
        return self.apply(plan, device)

    def apply(self, plan: MemoryPlan, device: torch.device | str) -> MemoryPlan:
        """Put the plan's resident part on `device` and stream the rest (a no-op when it is placed so already)."""
        device = torch.device(device)
        if self.device is not None and self.device != device:
            self.to_host()
        if self.plan is not None and self.device == device and _same(self.plan, plan):
            return self.plan
        self._unstream()
        outside_blocks_to(self.model, device)
        for i, block in enumerate(self.model.transformer_blocks):
            if i < plan.resident_blocks:
                _block_to(block, device, with_adaln=not plan.adaln_on_host)
        if plan.streaming:
            # Blocks past the resident ones (and the AdaLN projections) pack into host buffers: those already
            # there are reused, those on the GPU are copied down and their GPU memory goes.
            stream = BlockStream(self.model.transformer_blocks, plan.streamed, device, plan.depth)
            stream._hooks.append(self.model.register_forward_pre_hook(lambda module, args: stream.count_forward()))
            self.model.block_stream = stream
        self.device, self.plan = device, plan
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return plan

    def shrink(self, room: int) -> MemoryPlan | None:
        """Hold at most `room` bytes on the GPU: fewer resident blocks, or everything to host memory when even
        a fully streamed DiT does not fit (None)."""
        if self.device is None:
            return None
        if room < self.minimum():
            self.to_host()
            return None
        return self.place(self.device, room)

    def unstream(self) -> None:
        """Every streamed tensor back in its module, as a view of its pinned host buffer; resident blocks stay.
        For work that needs all the weights in place (merging LoRAs); the next `place` streams again."""
        self._unstream()
        self.plan = None

    def to_host(self) -> None:
        """Everything in host memory (the GPU gives back all the DiT held)."""
        self._unstream()
        self.model.to("cpu")
        clear = getattr(self.model, "clear_rope_cache", None)
        if clear is not None:
            clear()
        self.device, self.plan = None, None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _unstream(self) -> None:
        stream = self.stream
        if stream is not None:
            stream.restore()
            self.model.block_stream = None

    def describe(self) -> dict:
        plan = self.plan
        out = {"device": None if self.device is None else str(self.device), "loaded_bytes": self.loaded(),
               "size_bytes": self.size()}
        if plan is not None:
            out.update(resident_blocks=plan.resident_blocks, streamed_blocks=len(plan.streamed),
                       adaln_in_host_memory=plan.adaln_on_host, prefetch_depth=plan.depth,
                       room_bytes=plan.budget)
        return out


class TextPlacement:
    """The text encoder's counterpart: resident, or its decoder layers streamed (dit/streaming.py) with the rest
    (embeddings, vision tower) on the device. It runs once per prompt, so all its layers stream or none."""

    def __init__(self, te, depth: int = DEFAULT_DEPTH):
        self.te = te
        self.depth = depth
        self.device: torch.device | None = None

    @staticmethod
    def of(te, depth: int = DEFAULT_DEPTH) -> "TextPlacement":
        placement = te.__dict__.get(PLACEMENT)
        if placement is None:
            placement = te.__dict__[PLACEMENT] = TextPlacement(te, depth)
        return placement

    @property
    def layers(self) -> nn.ModuleList:
        return self.te.model.language_model.layers

    def size(self) -> int:
        stream = self.te.layer_stream
        return tensor_bytes(self.te.model) + (stream.host_bytes + stream.in_place_bytes if stream is not None else 0)

    def loaded(self) -> int:
        if self.device is None:
            return 0
        stream = self.te.layer_stream
        return tensor_bytes(self.te.model, on=self.device.type) + (stream.slot_bytes if stream is not None else 0)

    def minimum(self) -> int:
        """GPU bytes with every layer streamed: everything outside the layers and the slots."""
        stream = self.te.layer_stream
        if stream is not None:
            return tensor_bytes(self.te.model) + self.depth * stream.largest
        layers = [packed_bytes(layer) for layer in self.layers]
        outside = tensor_bytes(self.te.model) - sum(tensor_bytes(layer) for layer in self.layers)
        return outside + self.depth * max(layers)

    @property
    def streaming(self) -> bool:
        return self.te.layer_stream is not None

    def place(self, device: torch.device | str, room: int | None) -> bool:
        """Resident when `room` holds the whole encoder (None: no limit), else its layers stream; returns
        whether they stream. Refused, naming the minimum, when not even that fits."""
        device = torch.device(device)
        if self.device is not None and self.device != device:
            self.to_host()
        stream = room is not None and room < self.size()
        if stream and room < self.minimum():
            slots = f"{self.depth} layer slot" + ("s" if self.depth != 1 else "")
            raise InputError(f"{gb(room)} of GPU memory for the text encoder is below the {gb(self.minimum())} it "
                             f"needs with its decoder layers streamed ({slots})")
        te = self.te
        if stream and te.layer_stream is None:
            stream_text_encoder(te, device, self.depth)  # packs the layers, the rest waits in host memory
        elif not stream and te.layer_stream is not None:
            te.layer_stream.restore()
            te.layer_stream = None
            for layer in self.layers:
                forget_units(layer)
            te.mark_offloaded()
        te.device = device
        te.ensure_resident()  # the weights outside streamed layers (all of them when resident) to the device
        self.device = device
        return stream

    def to_host(self) -> None:
        self.te.offload()
        self.device = None


def place_dit(model: nn.Module, plan: MemoryPlan, device: torch.device | str) -> BlockStream | None:
    """Put a budget plan's resident part on `device` and stream the rest (the CLI's and the service's fixed
    budget); returns the stream (None when all is resident)."""
    Placement.of(model, plan.depth).apply(plan, device)
    return model.block_stream


def place_tower(tower: nn.Module, plan: MemoryPlan, device: torch.device | str) -> BlockStream | None:
    """A ControlNet tower held in host memory, placed by its plan (memory.plan_tower): the hint projection and the
    resident blocks on `device`, the other blocks (and, when any stream, every AdaLN projection) streamed by the
    DiT's machinery through their own slots. Returns the stream (None when all is resident)."""
    device = torch.device(device)
    blocks = tower.control_blocks
    for name, child in tower.named_children():
        if name != "control_blocks":
            child.to(device)
    for i, block in enumerate(blocks):
        if i < plan.resident_blocks:
            _block_to(block, device, with_adaln=not plan.adaln_on_host)
    tower.block_stream = (BlockStream(blocks, plan.streamed, device, plan.depth) if plan.streaming else None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return tower.block_stream


def _same(a: MemoryPlan, b: MemoryPlan) -> bool:
    return (a.resident_blocks, a.adaln_on_host, a.depth) == (b.resident_blocks, b.adaln_on_host, b.depth)


def _unit_bytes(unit) -> int:
    return unit.nbytes  # aligned like memory.measure's packed sizes


def _block_to(block: nn.Module, device: torch.device, with_adaln: bool) -> None:
    """A resident block on `device`; its AdaLN projection too unless it waits in host memory. Host buffers a
    restore left behind are given back for what moved."""
    for name, child in block.named_children():
        if name == ADALN and not with_adaln:
            continue
        child.to(device)
        if name == ADALN:
            forget_units(child)
    for name, p in block.named_parameters(recurse=False):
        p.data = p.data.to(device)
    for name, b in list(block.named_buffers(recurse=False)):
        block._buffers[name] = b.to(device)
    block.__dict__.get(UNITS, {}).pop("block", None)
