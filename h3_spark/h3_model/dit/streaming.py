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

Units can also be left in place (`in_place`: the text encoder's layers, from the memory-mapped file's pages when
the host has no room to pin them): copied from where they are, with the unit after the slots' read ahead
(madvise WILLNEED) so that a cold file is read while the block before it runs; or, given a page reader
(`attach_reader`), `window` units ahead of the slots read by its threads, and read ahead of the first forward by
`prime` (page_reader.py).

The same tensors, the same kernels: a streamed forward is bit-identical to a resident one. On the CPU (tests)
the copies are synchronous and the mechanism is otherwise the same.

A block's AdaLN projection is not used by the forward (the tables are computed once per schedule), so under a
budget every block's projection, resident block or not, is a unit of its own in host memory, brought in only
while `compute_modulation` needs it: the budget goes to the weights every forward reads.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 256  # bytes: every view starts aligned for vector loads and the FP8 GEMMs' 16-byte rule
ADALN = "adaln_proj"
# A restored block keeps its packed unit here, so streaming it again (a new plan) copies nothing on the host.
UNITS = "_h3_stream_units"


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
    host: torch.Tensor | None  # uint8, pinned on CUDA; None for a unit left in place
    nbytes: int
    adaln: bool = False  # an AdaLN projection (copied for the tables, not by the forward)
    pinned: bool = False  # `host` is page-locked (pinned_buffer)
    # In place: the tensors as they were (views of a memory-mapped file, say), copied from there on each visit;
    # nothing is packed, so host memory holds no second copy (pageable copies: for rarely visited units).
    sources: list | None = None
    slot: int | None = None
    ready: object = None  # the copy's CUDA event
    reading: object = None  # in place with a page reader: page_reader.Reading of the sources, not yet copied


def module_tensors(module: nn.Module, skip: str | None = None):
    """(owner, name, tensor, is_param) of every parameter and buffer under `module`, but the `skip` child's."""
    for prefix, owner in module.named_modules():
        if skip is not None and (prefix == skip or prefix.startswith(skip + ".")):
            continue
        for name, p in owner.named_parameters(recurse=False):
            yield owner, name, p, True
        for name, b in owner.named_buffers(recurse=False):
            if b is not None:
                yield owner, name, b, False


def move_except(module: nn.Module, device: torch.device | str, kept: list[nn.Module]) -> None:
    """`module.to(device)` for everything but the submodules in `kept`, which stay where they are."""
    kept_ids = {id(k) for k in kept}
    if id(module) in kept_ids:
        return
    if not any(id(m) in kept_ids for m in module.modules()):
        module.to(device)
        return
    for child in module.children():
        move_except(child, device, kept)
    for param in module.parameters(recurse=False):
        param.data = param.data.to(device)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None:
            module._buffers[name] = buf.to(device)


class Held(list):
    """`hold_on_host`'s [(owner, name, is_param, host tensor)]. Page-locked, the tensors are views of one buffer,
    kept here: its registration with CUDA lives exactly as long as that buffer's tensor does."""

    buffer: torch.Tensor | None = None


def hold_on_host(module: nn.Module, skip: str | None, pin: bool) -> Held:
    """Host copies of the module's tensors but the `skip` child's, kept for good (page-locked when `pin`: packed
    as a unit, one registration for all of them, where a vision tower has hundreds of small tensors):
    `place_held` then puts them on a device by copying them up, and back on the host by pointing at the copies,
    without copying down (the weights never change)."""
    items = list(module_tensors(module, skip))
    if not pin:
        return Held((owner, name, is_param, t.detach().to("cpu")) for owner, name, t, is_param in items)
    unit = _pack("held on the host", items, pin=True)
    held = Held((e.module, e.name, e.is_param, _host_view(unit, e)) for e in unit.entries)
    held.buffer = unit.host
    return held


def place_held(held: Held, device: torch.device | str) -> None:
    """The `hold_on_host` tensors in their modules: on the host, the copies themselves; elsewhere, copies of them
    (asynchronous from page-locked memory)."""
    device = torch.device(device)
    for owner, name, is_param, host in held:
        tensor = host if device.type == "cpu" else host.to(device, non_blocking=True)
        if is_param:
            getattr(owner, name).data = tensor
        else:
            owner._buffers[name] = tensor


def packed_bytes(module: nn.Module, skip: str | None = None) -> int:
    """Bytes of the module's tensors packed as a unit (each aligned): what a slot must hold for it."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t, _ in module_tensors(module, skip))


PAGE = 4096


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, exactly: malloc'd pages registered with CUDA.

    torch's pinned allocator (`pin_memory=True`) rounds every request up to a power of two (measured on the
    H200 machine: 1.05 GB asked, 2^30 bytes reserved), so a 0.77 GB bf16 DiT block would hold 1.07 GB;
    registering plain memory costs the bytes themselves. Only whole pages inside this allocation are
    registered (a page shared with another allocation could be registered twice). The registration lives on
    the returned tensor and ends just before its memory goes. torch's `is_pinned()` does not see registered
    memory; copies from it are asynchronous all the same (cudaMemcpyAsync from page-locked pages)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    size = -(-nbytes // PAGE) * PAGE
    base = torch.empty(size + PAGE, dtype=torch.uint8)
    start = (-base.data_ptr()) % PAGE
    buffer = base[start:start + nbytes]
    buffer._h3_registration = _Registration(base, buffer.data_ptr(), size)
    return buffer


class _Registration:
    """Keeps the allocation alive while its pages are registered; unregisters them before letting it go."""

    def __init__(self, base: torch.Tensor, ptr: int, size: int):
        self.cudart = torch.cuda.cudart()
        torch.cuda.check_error(self.cudart.cudaHostRegister(ptr, size, 0))
        self.base, self.ptr = base, ptr

    def __del__(self):
        self.cudart.cudaHostUnregister(self.ptr)  # before `base` (freed after this) gives the pages back


MADV_WILLNEED = 3  # <sys/mman.h>, Linux


@functools.lru_cache(maxsize=1)
def _libc():
    """The C library's madvise, typed; None outside Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def advise_willneed(ptr: int, nbytes: int) -> int | None:
    """madvise(MADV_WILLNEED) over the pages holding [ptr, ptr + nbytes): the kernel starts reading them in (a
    memory-mapped file's pages after a page-cache drop) and returns at once. The libc result (0: done); None
    outside Linux."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return None
    start = ptr - ptr % PAGE
    return libc.madvise(start, -(-(ptr + nbytes - start) // PAGE) * PAGE, MADV_WILLNEED)


def read_ahead(unit: Unit) -> None:
    """Start reading an in-place unit's pages now, so that its copy a block later finds them in memory instead of
    faulting them in a few pages at a time from a cold file (a packed unit is in memory already)."""
    for t in unit.sources or ():
        advise_willneed(t.data_ptr(), t.numel() * t.element_size())


def _pack(label: str, items: list, pin: bool, adaln: bool = False) -> Unit:
    entries, offset = [], 0
    for owner, name, t, is_param in items:
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(owner, name, is_param, tuple(t.shape), t.dtype, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    host = pinned_buffer(offset) if pin else torch.empty(offset, dtype=torch.uint8)
    for entry, (_, _, t, _) in zip(entries, items):
        host[entry.offset:entry.offset + entry.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
    return Unit(label, entries, host, offset, adaln, pinned=pin)


def _in_place(label: str, items: list, adaln: bool = False) -> Unit:
    """A unit over the tensors where they are (contiguous host tensors): laid out like a packed one in the slot."""
    entries, offset, sources = [], 0, []
    for owner, name, t, is_param in items:
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()  # a stray device or strided tensor: its own host copy
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(owner, name, is_param, tuple(t.shape), t.dtype, offset, nbytes))
        sources.append(t)
        offset += -(-nbytes // ALIGN) * ALIGN
    return Unit(label, entries, None, offset, adaln, sources=sources)


def _host_view(unit: Unit, entry: _Entry) -> torch.Tensor:
    if unit.sources is not None:
        return unit.sources[unit.entries.index(entry)]
    return unit.host[entry.offset:entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)


def _still_packed(unit: Unit, items: list) -> bool:
    """Whether `items` are exactly the unit's tensors, still the host views `restore` left (not moved, not
    replaced by a LoRA merge or a kernel conversion)."""
    if len(items) != len(unit.entries):
        return False
    base = unit.host.data_ptr()
    for entry, (owner, name, t, _) in zip(unit.entries, items):
        if (owner is not entry.module or name != entry.name or t.device.type != "cpu" or t.dtype != entry.dtype
                or tuple(t.shape) != entry.shape or t.data_ptr() != base + entry.offset):
            return False
    return True


def _unit(module: nn.Module, key: str, label: str, skip: str | None, pin: bool, adaln: bool = False,
          in_place: bool = False) -> Unit:
    """The module's packed unit: the one `restore` left when its tensors are still those views, else a new one."""
    items = list(module_tensors(module, skip))
    if in_place:
        module.__dict__.get(UNITS, {}).pop(key, None)
        return _in_place(label, items, adaln)
    kept = module.__dict__.get(UNITS, {}).pop(key, None)
    if kept is not None and kept.host is not None and kept.pinned == pin and _still_packed(kept, items):
        kept.label, kept.slot, kept.ready = label, None, None
        return kept
    return _pack(label, items, pin, adaln)


def forget_units(module: nn.Module) -> None:
    """Drop the packed units a restore left on `module` and its children (it now lives elsewhere)."""
    for child in module.modules():
        child.__dict__.pop(UNITS, None)


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

    def __init__(self, blocks: nn.ModuleList, streamed: list[int], device: torch.device | str, depth: int = 2,
                 in_place: bool = False):
        self.device = torch.device(device)
        # in_place: the units copy from the tensors where they are (pageable) instead of packed pinned buffers.
        self.in_place = in_place
        self.cuda = self.device.type == "cuda"
        self.depth = depth
        self.order = list(streamed)
        self.blocks = blocks
        self.units: dict[int, Unit] = {}
        self.adaln: dict[int, Unit] = {}
        # Each unit's tensors are dropped as soon as it is packed: the weights then live in the host buffer only,
        # so packing a model held in (pageable) host memory never holds more than one extra block.
        for i in self.order:
            self.units[i] = _unit(blocks[i], "block", f"block {i}", ADALN, self.cuda, in_place=in_place)
            self._drop(self.units[i])
        for i, block in enumerate(blocks):
            if hasattr(block, ADALN):
                self.adaln[i] = _unit(getattr(block, ADALN), "adaln", f"block {i} AdaLN", None, self.cuda,
                                      adaln=True, in_place=in_place)
                self._drop(self.adaln[i])
        self.largest = max((u.nbytes for u in [*self.units.values(), *self.adaln.values()]), default=0)
        self.slots: list[torch.Tensor] = []
        self._allocate()
        self.slot_free: list[object] = [None] * depth
        self.slot_owner: list[Unit | None] = [None] * depth
        self._next_slot = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = StreamStats()
        self.reader = None
        self.window = 0
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
        """Bytes of the packed host buffers this stream made (units left in place add none)."""
        return sum(u.nbytes for u in [*self.units.values(), *self.adaln.values()] if u.host is not None)

    @property
    def in_place_bytes(self) -> int:
        """Bytes copied from tensors left where they were (file pages, pageable)."""
        return sum(u.nbytes for u in [*self.units.values(), *self.adaln.values()] if u.host is None)

    def attach_reader(self, reader, window: int) -> str | None:
        """Read in-place units' pages with `reader` (page_reader.PageReader), `window` units beyond the slots; None
        when attached, else why not. The stream owns the reader from here on."""
        if not self.in_place:
            reader.close(wait=False)
            return "the units are packed in host memory: nothing to read"
        self.reader, self.window = reader, max(1, int(window))
        return None

    def prime(self) -> None:
        """Start reading the first units ahead of the first forward (with a page reader; else nothing)."""
        if self.reader is not None and self.order:
            self._want(0)

    def read_progress(self) -> dict:
        """The page reader's work so far: units whose pages are in (read and not yet copied), still being read, and
        the bytes its threads have touched (all of it over the stream's life)."""
        reading = [u for u in self.units.values() if u.reading is not None]
        done = sum(u.reading.done() for u in reading)
        return {"layers_read": done, "layers_reading": len(reading) - done,
                "bytes_read": 0 if self.reader is None else self.reader.bytes_read}

    def wait_reads(self) -> None:
        """Until the reads asked for so far are done (a read that failed raises here)."""
        for unit in self.units.values():
            if unit.reading is not None:
                unit.reading.wait()

    def _want(self, k: int) -> None:
        """The units from the k-th in order through `depth + window` of them, up to this forward's last, are in a slot
        or being read; into the next forward only as far as the wrap-around's copies go (`depth` ahead), so a unit
        just copied is not read again at once however large the window."""
        n = len(self.order)
        end = max(min(k + self.depth + self.window, n), min(k + self.depth + 1, k + n))
        for p in range(k, end):
            unit = self.units[self.order[p % n]]
            if unit.slot is None and unit.reading is None:
                unit.reading = self.reader.read(unit.sources)

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
        if unit.reading is not None:  # its pages are in the page cache once the reader's requests are done
            unit.reading.wait()
            unit.reading = None
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self.slot_free[s] is not None:
                    self.copy_stream.wait_event(self.slot_free[s])
                _copy_unit(target, unit, non_blocking=True)
                unit.ready = torch.cuda.Event()
                unit.ready.record(self.copy_stream)
        else:
            _copy_unit(target, unit)
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
            cold = self.units[i].slot is None
            if cold and self.reader is not None:
                self._want(0)
            for j in self.order[:self.depth]:  # a cold start (or the wrap-around's copies, already issued)
                self._issue(self.units[j])
            if cold:  # else the wrap-around read it ahead already
                self._read_ahead(0)
        self._attach(self.units[i])

    def _leave(self, i: int) -> None:
        unit = self.units[i]
        self._detach(unit)
        self._release(unit)
        k = self.order.index(i)
        ahead = self.order[(k + self.depth) % len(self.order)]
        self._issue(self.units[ahead])
        self._read_ahead(k + 1)

    def _read_ahead(self, k: int) -> None:
        """In place, the unit copied after the ones in the slots (the block k-th in order plus `depth`) is advised in
        meanwhile, or with a page reader the `window` units after the slots are read; packed units are in memory
        already."""
        if self.reader is not None:
            self._want(k)
        elif self.in_place:
            read_ahead(self.units[self.order[(k + self.depth) % len(self.order)]])

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
        if self.reader is not None:  # reads still queued are dropped; the ones running finish on their own
            self.reader.close(wait=False)
            self.reader = None
            for unit in self.units.values():
                unit.reading = None

    def restore(self) -> None:
        """Stop streaming: every streamed tensor becomes a view of its host buffer again (pinned, on the CPU),
        and the hooks go. The units stay with their modules, so a later stream over them packs nothing anew;
        a block moved to the device afterwards should `forget_units` to give the host buffer back."""
        self.park()
        self.remove()
        for i, unit in self.units.items():
            self._restore(self.blocks[i], "block", unit)
        for i, unit in self.adaln.items():
            self._restore(getattr(self.blocks[i], ADALN), "adaln", unit)
        self.units, self.adaln, self.order = {}, {}, []

    @staticmethod
    def _restore(module: nn.Module, key: str, unit: Unit) -> None:
        for entry in unit.entries:
            _set(entry, _host_view(unit, entry))
        module.__dict__.setdefault(UNITS, {})[key] = unit


def _copy_unit(target: torch.Tensor, unit: Unit, non_blocking: bool = False) -> None:
    if unit.host is not None:
        target.copy_(unit.host, non_blocking=non_blocking)
        return
    # From pageable memory the copy is staged by the driver (the issuing thread waits for it): correct, slower.
    for entry, src in zip(unit.entries, unit.sources):
        target[entry.offset:entry.offset + entry.nbytes].copy_(src.reshape(-1).view(torch.uint8),
                                                                non_blocking=non_blocking)


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
