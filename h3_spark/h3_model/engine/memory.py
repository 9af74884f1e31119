"""The VRAM budget: how much of the DiT stays on the GPU, and which blocks stream from host memory.

`--vram-budget GB` (or H3_VRAM_BUDGET) caps what the DiT may hold on the GPU, its activations included. When
everything fits, the DiT is resident, as without a budget. When it does not, the first blocks stay resident
while the budget allows and the others stream (dit/streaming.py) through `depth` slots. A budget below the
non-block weights, the slots and the activations is refused at set-up, naming the minimum.

A ControlNet tower has a plan of its own (`plan_tower`): the DiT's plan sets aside the least the tower runs in, the
tower keeps resident what the budget leaves beside the DiTs' plans (`tower_room`) and streams its other blocks.

When every DiT is resident whole, the room left beside it keeps the VAEs and the text encoder (or its first
layers) on the GPU too (`keep_on_device`); a longer request takes that room back before it samples (the engine's
`_check_rows`).

Activations are planned for a sequence length (the default canvas's unless told otherwise) and every
request is checked against what its own length needs before it samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...errors import InputError
from ...kernels.stored_linear import scratch_bytes
from ..dit.streaming import ADALN, BlockStream, Held, hold_on_host, move_except, packed_bytes, place_held

GB = 10 ** 9
GIB = 2 ** 30
DEFAULT_DEPTH = 2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|g|gib|mb|mib)?\s*$", re.IGNORECASE)
_UNITS = {None: GB, "gb": GB, "g": GB, "gib": GIB, "mb": 10 ** 6, "mib": 2 ** 20}
BUDGET_FORMS = "auto, or a size in GB: 24, 24GB, 22.5GiB or 800MB"
# Bytes of activations per packed row and per unit of (3 x hidden + 3 x FFN width) in the model dtype; a
# margin of 30 % over the peak of one block's tensors (residual, normed input, fused QKV, attention out,
# FC1 out, SwiGLU out) for the allocator's rounding and the embeddings/heads around the blocks.
ACTIVATION_MARGIN = 1.3
# Left free under a budget for the caching allocator's fragmentation and the step's small tensors (AdaLN and
# RoPE tables, indices): an H200 capped at 32 GB ran out with 0.5 GB reserved but unallocated.
SLACK_FRACTION, SLACK_MIN = 0.03, GB


def slack(budget: int) -> int:
    return max(SLACK_MIN, int(budget * SLACK_FRACTION))


def budget_for(device_bytes: int) -> int:
    """The smallest budget whose room (the budget less its slack) holds `device_bytes`."""
    return max(device_bytes + SLACK_MIN, -(-device_bytes * 100 // int(100 - 100 * SLACK_FRACTION)))


def parse_budget(text: str | None, source: str = "--vram-budget") -> int | str | None:
    """Bytes; "auto"; or None for no budget ("" / None). Plain numbers are GB (10^9 bytes), as `nvidia-smi`
    rounds."""
    if text is None or str(text).strip() == "":
        return None
    if str(text).strip().lower() == AUTO:
        return AUTO
    match = _SIZE.match(str(text))
    if not match:
        raise InputError(f"{source} {text!r} is not a size; use {BUDGET_FORMS}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower() if match.group(2) else None]
    if value <= 0:
        raise InputError(f"{source} must be positive, got {text!r}")
    return int(value)


def gb(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB else f"{nbytes / 10 ** 6:.1f} MB"


def activation_bytes(config, rows: int, dtype: torch.dtype = torch.bfloat16, mlp_chunks: int = 1) -> int:
    """A bound on one forward's activations at `rows` packed rows (what one block holds at its peak)."""
    size = torch.empty(0, dtype=dtype).element_size()
    hidden, ffn = config.hidden_size, config.ffn_dim
    inner = config.num_attention_heads * config.attention_head_dim
    attention_stage = 2 * hidden + 2 * 3 * inner + inner
    mlp_stage = 3 * hidden + 3 * ffn // max(1, mlp_chunks)
    return int(rows * size * max(attention_stage, mlp_stage) * ACTIVATION_MARGIN)


def tensor_bytes(module: nn.Module, skip: str | None = None, on: str | None = None) -> int:
    """Bytes of the module's parameters and buffers, but the `skip` child's; only those on device type `on`
    when given."""
    total = 0
    for prefix, owner in module.named_modules():
        if skip is not None and (prefix == skip or prefix.startswith(skip + ".")):
            continue
        for t in [*owner.parameters(recurse=False), *owner.buffers(recurse=False)]:
            if t is not None and (on is None or t.device.type == on):
                total += t.numel() * t.element_size()
    return total


@dataclass
class MemoryPlan:
    budget: int | None
    fixed: int  # weights outside the blocks (embeddings, refiner, heads)
    blocks: list[int]  # each block's forward tensors
    adaln: list[int]  # each block's AdaLN projection (0 once released)
    activations: int
    rows: int
    depth: int = DEFAULT_DEPTH
    resident_blocks: int = 0
    # Under a budget the AdaLN projections wait in host memory (they only make the tables once per schedule).
    adaln_on_host: bool = False

    @property
    def streaming(self) -> bool:
        """Whether anything lives in host memory: the AdaLN projections, and the blocks past the resident ones."""
        return self.adaln_on_host or self.resident_blocks < len(self.blocks)

    @property
    def streamed(self) -> list[int]:
        return list(range(self.resident_blocks, len(self.blocks)))

    @property
    def slot_bytes(self) -> int:
        if not self.streaming:
            return 0
        return self.depth * max([self.blocks[i] for i in self.streamed] + self.adaln)

    @property
    def device_bytes(self) -> int:
        resident = sum(self.blocks[:self.resident_blocks])
        if not self.adaln_on_host:
            resident += sum(self.adaln)
        return self.fixed + resident + self.slot_bytes + self.activations

    def describe(self) -> dict:
        return {"budget_bytes": self.budget, "resident_blocks": self.resident_blocks,
                "adaln_in_host_memory": self.adaln_on_host,
                "streamed_blocks": len(self.streamed), "prefetch_depth": self.depth,
                "planned_device_bytes": self.device_bytes, "slot_bytes": self.slot_bytes,
                "activation_bytes": self.activations, "activation_rows": self.rows,
                "host_bytes": sum(self.blocks[i] for i in self.streamed) + (sum(self.adaln) if self.adaln_on_host else 0),
                "slack_bytes": slack(self.budget) if self.budget is not None else 0}


def measure(model: nn.Module, rows: int, *, depth: int = DEFAULT_DEPTH, mlp_chunks: int = 1,
            budget: int | None = None) -> MemoryPlan:
    """The DiT's parts in bytes, everything resident: what a budget is then fitted to."""
    if depth < 1:
        raise InputError(f"the prefetch depth must be at least 1, got {depth}")
    blocks = list(model.transformer_blocks)
    # The scratch quantized layers kept in their stored form dequantize into (kernels/stored_linear.py) lives
    # on the device beside the weights outside the blocks.
    fixed = tensor_bytes(model) - sum(tensor_bytes(b) for b in blocks) + scratch_bytes(model)
    # Blocks and projections as packed for streaming (each tensor aligned): a slot holds the largest.
    return MemoryPlan(budget, fixed, [packed_bytes(b, ADALN) for b in blocks],
                      [packed_bytes(getattr(b, ADALN)) if hasattr(b, ADALN) else 0 for b in blocks],
                      activation_bytes(model.config, rows, model.dtype_, mlp_chunks) if rows else 0, rows, depth,
                      len(blocks))


def fit(plan: MemoryPlan, room: int) -> bool:
    """Keep as many blocks resident as `room` holds (all of them, AdaLN included, when everything fits);
    False when not even a fully streamed DiT fits."""
    plan.adaln_on_host, plan.resident_blocks = False, len(plan.blocks)
    if plan.device_bytes <= room:
        return True
    plan.adaln_on_host, plan.resident_blocks = True, 0
    if plan.device_bytes > room:
        return False
    while plan.resident_blocks < len(plan.blocks):
        plan.resident_blocks += 1
        if plan.device_bytes > room:
            plan.resident_blocks -= 1
            break
    return True


def streamed_minimum(plan: MemoryPlan) -> int:
    """GPU bytes of the plan with every block streamed: the least the DiT can run in."""
    least = MemoryPlan(plan.budget, plan.fixed, plan.blocks, plan.adaln, plan.activations, plan.rows, plan.depth,
                       0, adaln_on_host=True)
    return least.device_bytes


def dit_budget(budget: int, kept: int, activations: int) -> int:
    """The budget a DiT's plan (weights, slots, its own `activations`) is fitted to when the other stages need
    `kept` bytes beside the DiT's weights. The text encode runs before sampling and the VAE decode after it,
    while the DiT's resident blocks and slots stay on the device but its activations are gone: the weights
    must leave room for the larger of the two, not for their sum."""
    return budget - max(0, kept - activations)


def plan_dit(model: nn.Module, budget: int | None, rows: int, *, depth: int = DEFAULT_DEPTH,
             mlp_chunks: int = 1, share: str = "") -> MemoryPlan:
    """How many of the DiT's blocks stay resident under `budget` (all of them without one)."""
    plan = measure(model, rows, depth=depth, mlp_chunks=mlp_chunks, budget=budget)
    if budget is None:
        return plan
    if not fit(plan, budget - slack(budget)):
        raise InputError(
            f"the VRAM budget of {gb(budget)}{share} is below what a streamed DiT forward needs, "
            f"{gb(plan.device_bytes + slack(budget))}: {gb(plan.fixed)} of weights outside the blocks, {depth} block "
            f"slots of {gb(plan.slot_bytes // depth)}, {gb(plan.activations)} of activations at {rows} rows and "
            f"{gb(slack(budget))} of allocator slack; raise the budget, or lower --prefetch-depth")
    return plan


def measure_tower(tower: nn.Module, depth: int = DEFAULT_DEPTH, budget: int | None = None) -> MemoryPlan:
    """A ControlNet tower's parts in bytes, everything resident: the hint projection (and the scratch its stored
    layers dequantize into) outside the blocks, each control block and its AdaLN projection as packed. Its
    activations are the DiT forward's (it runs between the DiT's blocks), so the plan holds none of its own."""
    if depth < 1:
        raise InputError(f"the prefetch depth must be at least 1, got {depth}")
    blocks = list(tower.control_blocks)
    fixed = tensor_bytes(tower) - sum(tensor_bytes(b) for b in blocks) + scratch_bytes(tower)
    return MemoryPlan(budget, fixed, [packed_bytes(b, ADALN) for b in blocks],
                      [packed_bytes(getattr(b, ADALN)) for b in blocks], 0, 0, depth, len(blocks))


def plan_tower(tower: nn.Module, room: int | None, *, depth: int = DEFAULT_DEPTH) -> MemoryPlan:
    """How many of a ControlNet tower's blocks stay resident in `room` device bytes (what the budget leaves beside
    the DiTs' plans; None: all of them), the rest streaming like the DiT's; refused, naming the minimum, when not
    even a fully streamed tower fits."""
    plan = measure_tower(tower, depth, room)
    if room is None:
        return plan
    if not fit(plan, room):
        raise InputError(
            f"the VRAM budget leaves the ControlNet {gb(max(room, 0))} beside the DiT, below the "
            f"{gb(streamed_minimum(plan))} its tower needs with every block streamed: {gb(plan.fixed)} outside the "
            f"blocks and {depth} block slots of {gb(plan.slot_bytes // depth)}; raise the budget, or lower "
            "--prefetch-depth")
    return plan


def tower_room(budget: int, plans, kept: int) -> int:
    """Device bytes a ControlNet tower may hold under `budget` beside these DiT plans: the budget less its slack,
    the DiTs' weights and slots, and the larger of their activations and the other stages' `kept` bytes (the
    tower's weights stay on the device through the text encode and the decode, as the DiT's do)."""
    plans = list(plans)
    weights = sum(p.device_bytes - p.activations for p in plans)
    return budget - slack(budget) - weights - max([kept, *(p.activations for p in plans)])


def check_rows(plan: MemoryPlan, config, rows: int, dtype: torch.dtype, mlp_chunks: int = 1) -> None:
    """A request longer than the plan's rows must still fit: refused before sampling if it does not."""
    if plan.budget is None or rows <= plan.rows:
        return
    need = plan.device_bytes - plan.activations + activation_bytes(config, rows, dtype, mlp_chunks)
    if need + slack(plan.budget) > plan.budget:
        raise InputError(f"this request packs {rows} rows, whose activations bring the DiT to {gb(need)} of the "
                         f"{gb(plan.budget)} VRAM budget (planned for {plan.rows} rows); use a smaller canvas or "
                         "fewer frames, more --mlp-chunks, or a larger budget")


def outside_blocks_to(model: nn.Module, device: torch.device) -> None:
    """Everything of the DiT but its blocks (embeddings, refiner, heads, tables) to `device`."""
    move_except(model, device, [model.transformer_blocks])


class _BlockOnDevice:
    """Block i on the device while the kernels convert it, back in host memory after (unless `keep`)."""

    def __init__(self, model: nn.Module, device: torch.device, keep: bool = False):
        self.model, self.device, self.keep = model, device, keep

    def __call__(self, i: int) -> "_BlockOnDevice":
        self.block = self.model.transformer_blocks[i]
        return self

    def __enter__(self):
        self.block.to(self.device)

    def __exit__(self, *exc):
        if not self.keep:
            self.block.to("cpu")


def configure_in_host(model: nn.Module, settings, device: torch.device | str, keep: bool = False) -> dict:
    """apply_kernels for a DiT loaded into host memory: everything but the blocks moves to `device`, and each
    block visits it while its linears are converted (the GPU never holds more than one block of them in the
    file's form). `keep`: each converted block stays on the device (no budget: the model ends up resident)."""
    from .kernel_plan import apply_kernels

    device = torch.device(device)
    outside_blocks_to(model, device)
    model.block_scope = _BlockOnDevice(model, device, keep)
    try:
        return apply_kernels(model, settings, device=device)
    finally:
        model.block_scope = None


def check_host(budget: int | None, plans, text_encoder, parked, tower: MemoryPlan | None = None) -> dict:
    """What the models will hold in host memory under these plans, checked against `budget` (--host-budget) before
    anything is packed: the streamed DiT blocks and AdaLN projections (page-locked), the text encoder outside its
    layers (which stream in place from the file's pages, or from page-locked buffers once `text_pinning` chose
    that, counted then), the parked VAEs, and a ControlNet tower's streamed blocks and AdaLN projections (`tower`,
    its plan_tower plan). Raises naming the minimum."""
    parts = {"dit_streamed": sum(p.describe()["host_bytes"] for p in plans if p.streaming),
             # What waits on the CPU: kept layers (or a whole encoder) stay on the GPU, streamed ones are emptied.
             "text_encoder_outside_layers": (tensor_bytes(text_encoder.model, on="cpu")
                                             if hasattr(text_encoder, "model") else 0),
             "parked_vaes": sum(tensor_bytes(m) for m in parked),
             "text_layers_pinned": pinned_text_bytes(text_encoder)}
    if tower is not None:
        parts["controlnet_streamed"] = tower.describe()["host_bytes"] if tower.streaming else 0
    need = sum(parts.values())
    report = {"budget_bytes": budget, "held_bytes": need, **{f"{k}_bytes": v for k, v in parts.items()}}
    if budget is not None and need > budget:
        tower_part = (f"{gb(parts['controlnet_streamed'])} of streamed ControlNet blocks (page-locked), "
                      if parts.get("controlnet_streamed") else "")
        raise InputError(
            f"the host memory budget of {gb(budget)} is below what the models hold in host memory under this VRAM "
            f"budget, {gb(need)}: {gb(parts['dit_streamed'])} of streamed DiT blocks (page-locked), {tower_part}"
            f"{gb(parts['text_encoder_outside_layers'])} of the text encoder outside its layers and "
            f"{gb(parts['parked_vaes'])} of VAEs waiting for their stages (Python, torch and CUDA need ~3 GB more); "
            "raise --host-budget, or raise --vram-budget so that more of the DiT stays on the GPU")
    return report


def pinned_text_bytes(te) -> int:
    """The page-locked buffers the text encoder's streamed layers sit in (0 when they stream in place)."""
    stream = getattr(te, "layer_stream", None)
    return 0 if stream is None or stream.in_place else stream.host_bytes


def default_rows(config) -> int:
    """Packed rows of the released canvas (1344x768, 124 frames) with a 1,024-token prompt: what a budget
    plans its activations for unless told otherwise."""
    from ..geometry import DEFAULT_FRAMES, audio_latent_frames, latent_size, resolve_canvas, video_latent_frames

    height, width = resolve_canvas(16, 9)
    lh, lw = latent_size(height, width)
    _, ph, pw = config.patch_size
    video = video_latent_frames(DEFAULT_FRAMES) * (lh // ph) * (lw // pw)
    return video + 2 * audio_latent_frames(DEFAULT_FRAMES) + 1024


# ------------------------------------------------------------------------------------------ the other stages
TEXT_STAGE_ROWS = 4096  # prompt + vision tokens the text encoder's stage is planned for


def stream_text_encoder(te, device: torch.device | str, depth: int = DEFAULT_DEPTH,
                        kept_layers: int = 0, pin: bool = False) -> BlockStream:
    """The text encoder's decoder layers stream like DiT blocks; the rest (embeddings, vision tower) waits in host
    memory and visits the GPU for the encoder's own stage (TextEncoder.ensure_resident / offload). The first
    `kept_layers` layers stay on the GPU throughout (room the budget has to spare: `keep_on_device`).

    By default the layers are copied from where they were loaded (the memory-mapped file's pages for a single
    file): pageable copies need no host memory of their own. `pin` packs them into page-locked buffers instead,
    when the host has room for them (`text_pinning`): pageable copies ran at 17 GB/s against 55 pinned on the H200
    machine, and at ~5.6 GB/s on the H100 machine, where 35 streamed layers took 6 s a prompt."""
    device = torch.device(device)
    layers = te.model.language_model.layers
    stream = BlockStream(layers, list(range(kept_layers, len(layers))), device, depth, in_place=not pin)
    te.kept_layers = kept_layers
    for layer in layers[:kept_layers]:
        layer.to(device)
    te.move("cpu")  # everything but the kept layers waits in host memory
    te.layer_stream = stream
    te.device = device
    te.mark_offloaded()
    stream.park()
    return stream


# Available host memory a page reader leaves beside the text layers it reads ahead (memory.read_ahead_window).
READ_AHEAD_HEADROOM = 4 * GB


def read_ahead_window(stream: BlockStream, available: int | None) -> tuple[int, str]:
    """(layers read ahead beyond the slots, why): as many of the stream's layers as `available` host memory
    (host_memory.available_bytes) holds in page cache beside READ_AHEAD_HEADROOM, at least one; four when the host
    does not say. Page cache is what the kernel reclaims first, so a window too large costs reads, not memory."""
    n = len(stream.order)
    largest = max((stream.units[i].nbytes for i in stream.order), default=0)
    if n == 0 or largest == 0:
        return 1, "no layers stream"
    if available is None:
        return min(n, 4), "the host's available memory is unknown: 4 layers ahead"
    window = max(1, min(n, (available - READ_AHEAD_HEADROOM) // largest))
    return window, (f"{gb(available)} available on the host holds {window} of {n} layers ({gb(window * largest)}) "
                    f"in page cache beside {gb(READ_AHEAD_HEADROOM)}")


# Host memory left available after the text layers are pinned: Python, torch and CUDA (~3 GB), the page cache of
# what a request reads, and the decode's frame buffer (1.4 GB for 5 s at 1344x768; 17 GB for a minute's film).
PIN_HEADROOM = 8 * GB


@dataclass
class TextPinning:
    """Whether the text encoder's streamed layers sit in page-locked host memory, and why."""
    pinned: bool
    layer_bytes: int  # every decoder layer: a give-back streams the kept ones too
    available_bytes: int | None
    why: str

    def describe(self) -> dict:
        return {"pinned": self.pinned, "layer_bytes": self.layer_bytes, "available_bytes": self.available_bytes,
                "why": self.why}


def text_pinning(te, choice: str, held_bytes: int, budget: int | None, available: int | None) -> TextPinning:
    """`choice` auto: pin the text layers when the host holds them beside what it holds already (`held_bytes`,
    memory.check_host) within `budget` (--host-budget), and `available` (host_memory.available_bytes, measured
    after the DiTs are placed) keeps PIN_HEADROOM beyond them; "on" pins regardless of room (refused over the
    budget), "off" never pins."""
    size = all_text_layer_bytes(te)
    if choice == "off":
        return TextPinning(False, size, available, "off (H3_TEXT_PIN=off): copied from pageable memory")
    if budget is not None and held_bytes + size > budget:
        why = (f"the host budget of {gb(budget)} holds {gb(held_bytes)} already, not {gb(size)} more of text layers")
        if choice == "on":
            raise InputError(f"H3_TEXT_PIN=on: {why}; raise --host-budget or set H3_TEXT_PIN=auto")
        return TextPinning(False, size, available, why + ": copied from pageable memory")
    if choice == "on":
        return TextPinning(True, size, available, "on (H3_TEXT_PIN=on)")
    if available is None:
        return TextPinning(False, size, None, "the host's available memory is unknown: copied from pageable memory")
    if available - size < PIN_HEADROOM:
        return TextPinning(False, size, available,
                           f"{gb(available)} available on the host, not {gb(size)} of text layers and "
                           f"{gb(PIN_HEADROOM)} to spare: copied from pageable memory")
    return TextPinning(True, size, available, f"{gb(available)} available on the host holds {gb(size)} of text "
                                              f"layers with {gb(PIN_HEADROOM)} to spare")


def text_activation_bytes(te, rows: int = TEXT_STAGE_ROWS) -> int:
    """A bound on a text encode's activations at `rows` tokens (one decoder layer's peak, with the margin)."""
    text = te.model.config.text_config
    size = torch.empty(0, dtype=te.dtype).element_size()
    return int(rows * size * (3 * text.hidden_size + 3 * text.intermediate_size) * ACTIVATION_MARGIN)


def text_layer_bytes(te) -> list[int]:
    """Each decoder layer's bytes as a stream unit (what a slot holds, and what keeping it on the GPU costs)."""
    return [packed_bytes(layer) for layer in te.model.language_model.layers]


def all_text_layer_bytes(te) -> int:
    """Every decoder layer's bytes, wherever it is now (on the device, or in its stream's units)."""
    stream = getattr(te, "layer_stream", None)
    return sum(text_layer_bytes(te)) + (0 if stream is None else stream.host_bytes + stream.in_place_bytes)


def text_sizes(te, depth: int, rows: int = TEXT_STAGE_ROWS) -> TextSizes:
    """The text encoder's GPU bytes as `keep_on_device` weighs them, each layer measured once: a text encode with
    k layers kept needs the rest of the model (which visits), the slots of the streamed layers and the
    activations beside them; kept whole, its weights and the activations."""
    layers = text_layer_bytes(te)
    outside = tensor_bytes(te.model) - sum(tensor_bytes(layer) for layer in te.model.language_model.layers)
    around = scratch_bytes(te.model) + text_activation_bytes(te, rows)
    return TextSizes(layers, lambda kept: outside + depth * max(layers[kept:], default=0) + around,
                     (tensor_bytes(te.model), around))


def text_stage_bytes(te, depth: int, rows: int = TEXT_STAGE_ROWS, kept_layers: int = 0) -> int:
    """GPU bytes of a text encode beyond its kept layers (before any streaming)."""
    return text_sizes(te, depth, rows).stage(kept_layers)


def vae_stage_bytes(vae, audio_vae, kept: bool = False) -> int:
    """GPU bytes of the largest VAE stage: the video decode of the released canvas, or the audio VAE's. `kept`:
    beyond the VAEs' weights, for VAEs that stay on the GPU."""
    need = 0
    if vae is not None:
        need = _video_decode_extra(vae) + (0 if kept else tensor_bytes(vae))
    if audio_vae is not None:
        # Its weights and as much again for its activations: 0.6 GB at the released size, far below the video
        # decode, so the guess never decides the reserve there.
        need = max(need, tensor_bytes(audio_vae) * (1 if kept else 2))
    return need


def _video_decode_extra(vae) -> int:
    """The video decode of the released canvas beyond its weights."""
    from ..geometry import DEFAULT_FRAMES, latent_size, resolve_canvas, video_latent_frames
    from ..vae.video import decode_memory_estimate

    height, width = resolve_canvas(16, 9)
    lh, lw = latent_size(height, width)
    estimate = decode_memory_estimate(vae.config, video_latent_frames(DEFAULT_FRAMES), lh, lw,
                                      tile_batch=getattr(vae, "tile_batch", 1))
    # A quantized decoder's linears are dequantized at use into a scratch the size of the largest one.
    return scratch_bytes(vae) + estimate["transient"] + estimate["window"]


@dataclass
class TextSizes:
    """A text encoder's GPU bytes as `keep_on_device` weighs them (`text_sizes`)."""
    layers: list[int]
    stage: Callable[[int], int]  # a text encode's bytes beyond k kept layers, the rest visiting
    whole: tuple[int, int]  # (weights, bytes beyond them) for an encoder kept whole


@dataclass
class KeptOnDevice:
    """What a budget's spare room keeps on the GPU beside resident DiTs."""
    vaes: bool = False
    text_whole: bool = False
    text_layers: int = 0
    kept_bytes: int = 0
    text_bytes: int = 0  # of kept_bytes, the text encoder's
    peak_bytes: int = 0  # the kept bytes and the largest stage's beside them, as planned at load
    room_bytes: int = 0
    why: str = ""

    def describe(self, layers: int | None) -> dict:
        text = None if layers is None else ("whole" if self.text_whole else f"{self.text_layers} of {layers} layers")
        return {"vaes": self.vaes, "text_encoder": text, "kept_bytes": self.kept_bytes, "text_bytes": self.text_bytes,
                "peak_bytes": self.peak_bytes, "room_bytes": self.room_bytes, "why": self.why}


def keep_on_device(room: int, activations: int, vae_weights: int, vae_stage: tuple[int, int],
                   text: TextSizes | None) -> KeptOnDevice:
    """What stays on the GPU beside DiTs that are resident whole, in the `room` their weights leave. The stages take
    turns: sampling needs `activations`, the decode `vae_stage` (parked, kept: its bytes beyond what is kept), the
    text encode what `text` says; whatever is kept is there through all of them. Kept in the order of what a render
    saves by it: the VAEs (otherwise copied up and back for every decode and every encode), then the text encoder
    whole (no visit at all), else as many of its decoder layers as fit (the rest visits its stage)."""
    def peak(vaes: bool, whole: bool, k: int) -> tuple[int, int]:
        kept = vae_weights if vaes else 0
        stages = [activations, vae_stage[1] if vaes else vae_stage[0]]
        if text is not None:
            kept += text.whole[0] if whole else sum(text.layers[:k])
            stages.append(text.whole[1] if whole else text.stage(k))
        return kept, kept + max(stages)

    vaes = vae_weights > 0 and peak(True, False, 0)[1] <= room
    whole, k = False, 0
    if text is not None:
        whole = peak(vaes, True, 0)[1] <= room
        if not whole:
            while k < len(text.layers) and peak(vaes, False, k + 1)[1] <= room:
                k += 1
    kept, top = peak(vaes, whole, k)
    return KeptOnDevice(vaes, whole, k, kept, kept - (vae_weights if vaes else 0), top, room,
                        "the spare room beside the resident DiTs")


class Visits:
    """Components parked in host memory, brought to the device for the stage that uses them.

    A parked module's weights keep one host copy for the engine's life, page-locked when the device is a GPU: a
    visit copies them up at the pinned rate, and its end only drops the device copies (the weights did not
    change), so nothing is copied back. (Moving the module whole to the GPU and back from pageable memory cost a
    24 GB box 2.2 s of a 1344x768x124 decode and 0.6 s of the audio decode: receipts/h100/README.md.)"""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._held: dict[int, tuple[nn.Module, Held]] = {}  # id(module) -> (module, its host copies)
        self._depth: dict[int, int] = {}  # id(module) -> visits open on it

    @property
    def parked(self) -> list[nn.Module]:
        return [module for module, _ in self._held.values()]

    def park(self, module: nn.Module) -> None:
        held = hold_on_host(module, None, pin=self.device.type == "cuda")
        place_held(held, "cpu")
        self._held[id(module)] = (module, held)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def enter(self, module: nn.Module) -> None:
        key = id(module)
        if key in self._held:
            self._depth[key] = self._depth.get(key, 0) + 1
            if self._depth[key] == 1:
                place_held(self._held[key][1], self.device)

    def leave(self, module: nn.Module) -> None:
        key = id(module)
        if key in self._held:
            self._depth[key] -= 1
            if not self._depth[key]:
                place_held(self._held[key][1], "cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def __call__(self, module):
        return _Visit(self, module)


class _Visit:
    def __init__(self, visits: Visits, module):
        self.visits, self.module = visits, module

    def __enter__(self):
        self.visits.enter(self.module)
        return self.module

    def __exit__(self, *exc):
        self.visits.leave(self.module)


# ------------------------------------------------------------------------------------------ the default
AUTO = "auto"
AUTO_FREE_FRACTION = 0.95  # of the free memory at start: the rest is CUDA's own and other processes' growth


def planned_bytes(plan: dict, options) -> int | None:
    """GPU bytes of loading `plan` resident, from the files' headers (None when a component has no file)."""
    from ..checkpoint import open_dit
    from ..checkpoint.dit_config import logical_param_count

    size = torch.empty(0, dtype=options.dtype).element_size()
    total, config = 0, None
    for name, source in plan.items():
        if callable(source):
            # Built in memory: a synthetic builder sizes itself from its config; a host's own cannot be sized.
            size = getattr(source, "planned_bytes", None)
            if size is None:
                return None
            total += size()
            config = getattr(source, "dit_config", None) or config
            continue
        if name in ("dit", "dit_ref"):
            reader = open_dit(source, partition="t2va" if name == "dit" else "ref2va")
            try:
                config = reader.config
                total += (reader.loaded_bytes(options.dtype) if getattr(options, "stored_weights", True)
                          else logical_param_count(config) * size)
            finally:
                reader.source.close()
        elif name == "vae":
            total += _video_vae_bytes(source, options.vae_dtype, getattr(options, "stored_weights", True))
        elif name == "text_encoder":
            total += _text_encoder_bytes(source, options.text_layer)
        else:
            total += sum(f.stat().st_size for f in _files(source))
    return total + (activation_bytes(config, default_rows(config), options.dtype) if config is not None else 0)


def _video_vae_bytes(path, decode_dtype: torch.dtype, stored: bool = True) -> int:
    """The video VAE as it loads: fp32 encoder, `decode_dtype` decoder; a quantized decoder linear (ComfyUI's
    int8_convrot file) as its stored codes and scales when kept stored, plus the scratch it is dequantized into."""
    from ..checkpoint.quant import STORED_PARTS
    from ..vae.loading import TensorFiles, _is_comfy_video, _video_config, locate, video_identity
    from ..vae.video import parameter_bytes

    source = locate(path, "vae")
    with TensorFiles(source.files) as files:
        if not any(k.endswith(".comfy_quant") for k in files.keys()) and "_quantization_metadata" not in files.metadata:
            return parameter_bytes(_video_config(source, files, _is_comfy_video(files.keys()), None), decode_dtype)
        identity = video_identity(path)
        total = parameter_bytes(identity.config, decode_dtype)
        if not stored:
            return total
        size = torch.empty(0, dtype=decode_dtype).element_size()
        largest = 0
        for layer in identity.quantized.values():
            n, k = files.shape(layer.keys["weight"])
            largest = max(largest, n * k)
            total -= n * k * size
            total += sum(math.prod(files.shape(key)) * files.dtype(key).itemsize for part, key in layer.keys.items()
                         if part in STORED_PARTS)
    return total + largest * size


def _text_encoder_bytes(path, layer: int) -> int:
    """The text encoder as it loads: cut at `layer` of its decoder layers (the file holds them all)."""
    import json
    from pathlib import Path

    files = sum(f.stat().st_size for f in _files(path))
    config = Path(path) / "config.json"
    if Path(path).is_dir() and config.is_file():
        data = json.loads(config.read_text())
        layers = (data.get("text_config") or data).get("num_hidden_layers")
        if layers:
            return files * min(layer, layers) // layers
    return files


def _files(path):
    from pathlib import Path

    path = Path(path)
    return [path] if path.is_file() else [f for f in path.rglob("*.safetensors") if f.is_file()]


def auto_budget(need: int | None, free: int) -> int | None:
    """What `--vram-budget auto` (the default on a GPU) chooses: None (resident) when `need` fits the free
    memory, else a budget of that memory."""
    room = int(free * AUTO_FREE_FRACTION)
    if need is None or need <= room:
        return None
    return room
