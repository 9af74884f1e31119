"""Block streaming: DiT blocks that do not fit the VRAM budget live in host memory and visit the GPU in turn.

Each streamed block's tensors (parameters and buffers, in whatever form the kernels left them: bf16, FP8 codes
and scales, NVFP4 codes) are packed into one host buffer, pinned on CUDA so the copy runs at full speed and
asynchronously. The GPU holds `depth` slots, each as large as the largest block. Before block i runs, its
copy, issued ahead on a separate stream, must have landed (the compute stream waits on its event); its tensors
then become views into the slot. After it runs, an event on the compute stream marks the slot free and the
copy of the block `depth` places ahead (wrapping to the next forward's first streamed block) is issued into
it, after that event. So a block is never read before its copy lands and a slot is never overwritten while a
block still reads it; the views are dropped between uses, so a stale read fails loudly instead of reading
another block's weights.

The same tensors, the same kernels: a streamed forward is bit-identical to a resident one. On the CPU (tests)
the copies are synchronous and the mechanism is otherwise the same.

A block's AdaLN projection is not used by the forward (the tables are computed once per schedule), so under a
budget every block's projection, resident block or not, is a unit of its own in host memory, brought in only
while `compute_modulation` needs it: the budget goes to the weights every forward reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256  # bytes: every view starts aligned for vector loads and the FP8 GEMMs' 16-byte rule
ADALN = "adaln_proj"


@dataclass
class _Entry:
    module: nn.Module
    name: str
    is_param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass
class Unit:
    """The tensors of one block (or of one block's AdaLN projection), packed in one host buffer."""

    label: str
    entries: list[_Entry]
    host: torch.Tensor  # uint8, pinned on CUDA
    nbytes: int
    adaln: bool = False  # an AdaLN projection (copied for the tables, not by the forward)
    slot: int | None = None
    ready: object = None  # the copy's CUDA event


def _tensors(module: nn.Module, skip: str | None):
    """(owner, name, tensor, is_param) of every parameter and buffer under `module`, but the `skip` child's."""
    for prefix, owner in module.named_modules():
        if skip is not None and (prefix == skip or prefix.startswith(skip + ".")):
            continue
        for name, p in owner.named_parameters(recurse=False):
            yield owner, name, p, True
        for name, b in owner.named_buffers(recurse=False):
            if b is not None:
                yield owner, name, b, False


def _pack(label: str, items: list, pin: bool, adaln: bool = False) -> Unit:
    entries, offset = [], 0
    for owner, name, t, is_param in items:
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(owner, name, is_param, tuple(t.shape), t.dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for entry, (_, _, t, _) in zip(entries, items):
        host[entry.offset:entry.offset + entry.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
    return Unit(label, entries, host, offset, adaln)


def _set(entry: _Entry, tensor: torch.Tensor) -> None:
    if entry.is_param:
        getattr(entry.module, entry.name).data = tensor
    else:
        entry.module._buffers[entry.name] = tensor


@dataclass
class StreamStats:
    forwards: int = 0  # the DiT's forwards since streaming began
    bytes_copied: int = 0  # blocks' tensors copied to the GPU
    copies: int = 0
    adaln_bytes_copied: int = 0  # AdaLN projections copied for tables (once per schedule when sampling)


class BlockStream:
    """Streams `blocks[i]` for i in `streamed` and every block's AdaLN projection; the rest stays in place.

    Any ModuleList of blocks will do: the text encoder's decoder layers stream the same way (they have no
    AdaLN projection). `park()` gives the slots back between uses; the next copy allocates them again."""

    def __init__(self, blocks: nn.ModuleList, streamed: list[int], device: torch.device | str, depth: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.depth = depth
        self.order = list(streamed)
        self.blocks = blocks
        self.units: dict[int, Unit] = {}
        self.adaln: dict[int, Unit] = {}
        for i in self.order:
            self.units[i] = _pack(f"block {i}", list(_tensors(blocks[i], ADALN)), self.cuda)
        for i, block in enumerate(blocks):
            if hasattr(block, ADALN):
                self.adaln[i] = _pack(f"block {i} AdaLN", list(_tensors(getattr(block, ADALN), None)), self.cuda,
                                      adaln=True)
        for unit in [*self.units.values(), *self.adaln.values()]:
            self._drop(unit)  # the weights now live in the host buffers only
        self.largest = max((u.nbytes for u in [*self.units.values(), *self.adaln.values()]), default=0)
        self.slots: list[torch.Tensor] = []
        self._allocate()
        self.slot_free: list[object] = [None] * depth
        self.slot_owner: list[Unit | None] = [None] * depth
        self._next_slot = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = StreamStats()
        self._hooks = []
        for i in self.order:
            self._hooks.append(blocks[i].register_forward_pre_hook(lambda m, a, i=i: self._enter(i)))
            self._hooks.append(blocks[i].register_forward_hook(lambda m, a, o, i=i: self._leave(i)))

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def _allocate(self) -> None:
        if not self.slots:
            self.slots = [torch.empty(self.largest, dtype=torch.uint8, device=self.device) for _ in range(self.depth)]

    def park(self) -> None:
        """Free the GPU slots (between the text encoder's turns, say); the next copy allocates them again."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            torch.cuda.synchronize(self.device)
        for unit in [*self.units.values(), *self.adaln.values()]:
            self._release(unit)
        self.slots, self.slot_free, self.slot_owner = [], [None] * self.depth, [None] * self.depth

    @property
    def host_bytes(self) -> int:
        return sum(u.nbytes for u in [*self.units.values(), *self.adaln.values()])

    # ------------------------------------------------------------------ copies
    def _drop(self, unit: Unit) -> None:
        """Views out: an empty tensor in each place, so a use outside the block's turn cannot read stale data."""
        for entry in unit.entries:
            _set(entry, torch.empty(0, dtype=entry.dtype, device=self.device))

    def _issue(self, unit: Unit) -> None:
        """Copy `unit` into the next slot, after the slot's last reader is done."""
        if unit.slot is not None:
            return
        self._allocate()
        s = self._next_slot
        self._next_slot = (s + 1) % self.depth
        previous = self.slot_owner[s]
        if previous is not None and previous is not unit:
            self._release(previous)
        target = self.slots[s][:unit.nbytes]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self.slot_free[s] is not None:
                    self.copy_stream.wait_event(self.slot_free[s])
                target.copy_(unit.host, non_blocking=True)
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.copy_stream)
        else:
            target.copy_(unit.host)
        unit.slot = s
        self.slot_owner[s] = unit
        if unit.adaln:
            self.stats.adaln_bytes_copied += unit.nbytes
        else:
            self.stats.bytes_copied += unit.nbytes
            self.stats.copies += 1

    def _release(self, unit: Unit) -> None:
        if unit.slot is not None and self.slot_owner[unit.slot] is unit:
            self.slot_owner[unit.slot] = None
        unit.slot, unit.ready = None, None

    def _attach(self, unit: Unit) -> None:
        if unit.slot is None:
            self._issue(unit)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
        slot = self.slots[unit.slot]
        for entry in unit.entries:
            view = slot[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            _set(entry, view)

    def _detach(self, unit: Unit) -> None:
        """The slot is free once the compute stream has passed this point."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.slot_free[unit.slot] = event
        self._drop(unit)

    # ------------------------------------------------------------------ the forward's turns
    def count_forward(self) -> None:
        self.stats.forwards += 1

    def _enter(self, i: int) -> None:
        if i == self.order[0]:
            for j in self.order[:self.depth]:  # a cold start (or the wrap-around's copies, already issued)
                self._issue(self.units[j])
        self._attach(self.units[i])

    def _leave(self, i: int) -> None:
        unit = self.units[i]
        self._detach(unit)
        self._release(unit)
        k = self.order.index(i)
        ahead = self.order[(k + self.depth) % len(self.order)]
        self._issue(self.units[ahead])

    # ------------------------------------------------------------------ AdaLN tables
    def adaln_scope(self, i: int):
        """Context in which block i's AdaLN projection is on the GPU (for `compute_modulation`)."""
        return _AdalnScope(self, i)

    def release_adaln(self) -> int:
        """Forget the streamed AdaLN projections (the tables are cached); returns the host bytes freed."""
        freed = sum(u.nbytes for u in self.adaln.values())
        for unit in self.adaln.values():
            self._release(unit)
        self.adaln.clear()
        return freed

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class _AdalnScope:
    def __init__(self, stream: BlockStream, i: int):
        self.stream, self.unit = stream, stream.adaln.get(i)

    def __enter__(self):
        if self.unit is not None:
            self.stream._issue(self.unit)
            self.stream._attach(self.unit)

    def __exit__(self, *exc):
        if self.unit is not None:
            self.stream._detach(self.unit)
            self.stream._release(self.unit)
