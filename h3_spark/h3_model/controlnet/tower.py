"""The H3 Fun ControlNet Union's control tower, one readable model, and the hook that runs it inside the DiT.

The tower is a side stack of full H3 transformer blocks (the DiT's own `Block`, so every attention backend and
stored weight format the DiT runs applies) that reads a hint: the control video's latents, the masked source's
latents and the inpaint mask on the latent grid, 49 channels, patchified 2x2 like the video rows (196 columns).

How it joins the DiT's one forward (`H3DiT.forward` calls `ControlInjection.begin` once after the embedding and
`ControlRun.after_block` after each block; nothing else of the forward changes):
- the control stream starts from the DiT's block-0 input x: a copy of it with every video row replaced by
  `control_proj_in` of that row's hint (fp32 projection; condition and reference rows get a zero hint, so they
  carry only the projection's bias), then `before_proj` of that copy plus x;
- after DiT layer `places[k]`, control block k advances the stream and `after_proj` of it is the skip, added to the
  DiT's hidden rows times the strength, zero on the audio rows (text and video rows take it);
- the tower reads the DiT's AdaLN rows (its own projections of the same timestep input), RoPE and modulation rows,
  and always runs the DiT's dense attention backend (never a sparse schedule's: five blocks against fifty);
- only while the target's sigma lies in the request's window [sigma(end), sigma(start)], and only with a nonzero
  strength: otherwise the forward is the uncontrolled one, bit for bit.
The skips depend on the DiT's stream only through x, so running control block k right after layer places[k] is
the same as running the whole tower first and adding its skips later; it only keeps one stream alive instead of
all the skips.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ...errors import CheckpointError, H3Error, InputError
from ...kernels.stored_linear import StoredForm, StoredLinear
from ..dit.config import DiTConfig
from ..dit.model import Block, _assign_parameter, compute_dtype

# The hint: control latents (24) + inpaint visibility (1) + masked source latents (24), as the released files
# were trained (control only: the last 25 channels are zero).
HINT_CHANNELS = 49
LATENT_CHANNELS = 24
BASE_LAYERS = 50


@dataclass(frozen=True)
class ControlConfig:
    """A control tower's sizes, read from its file (checkpoint/controlnet.py) or given by a preset."""

    hidden_size: int
    num_attention_heads: int
    attention_head_dim: int
    ffn_dim: int
    time_embed_dim: int
    places: tuple[int, ...]  # the DiT layers after which block k injects
    curve_form: bool = False  # pruned ("adaln_basis") AdaLN: the projections read the DiT's curve basis
    hint_channels: int = HINT_CHANNELS
    patch_size: tuple[int, int, int] = (1, 2, 2)
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    # Union 2.0 masks the source after the VAE's pixel normalisation: holes are mid-gray, not black.
    post_norm_fill: bool = False

    def __post_init__(self) -> None:
        places = tuple(int(p) for p in self.places)
        object.__setattr__(self, "places", places)
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if not places or places[0] != 0:
            raise CheckpointError(f"a control tower's places must start at DiT layer 0, got {list(places)}")
        if list(places) != sorted(set(places)):
            raise CheckpointError(f"a control tower's places must be distinct and increasing, got {list(places)}")

    @property
    def blocks(self) -> int:
        return len(self.places)

    @property
    def version(self) -> str:
        """v1 or union2: Union 2.0 is the one that fills the inpaint holes mid-gray (its files say so, or have its
        10 blocks)."""
        return "union2" if self.post_norm_fill else "v1"

    @property
    def hint_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.hint_channels * pt * ph * pw

    def block_config(self) -> DiTConfig:
        """The DiT block sizes its blocks are built from (the fields a Block reads; the rest are unused)."""
        return DiTConfig(num_attention_heads=self.num_attention_heads, attention_head_dim=self.attention_head_dim,
                         hidden_size=self.hidden_size, num_layers=self.blocks, ffn_dim=self.ffn_dim,
                         time_embed_dim=self.time_embed_dim, rope_freq_dim=min(16, self.attention_head_dim // 6),
                         norm_eps=self.norm_eps, qk_norm_eps=self.qk_norm_eps)

    def check_fits(self, dit: DiTConfig, where: str = "the ControlNet") -> None:
        """One line when this tower cannot run beside that DiT (another width, AdaLN form or depth)."""
        if (self.hidden_size, self.num_attention_heads, self.attention_head_dim) != (
                dit.hidden_size, dit.num_attention_heads, dit.attention_head_dim):
            raise CheckpointError(
                f"{where} is for a DiT {self.hidden_size} wide with {self.num_attention_heads}x"
                f"{self.attention_head_dim} heads, this DiT is {dit.hidden_size} wide with "
                f"{dit.num_attention_heads}x{dit.attention_head_dim}")
        if self.curve_form != dit.curve_form or self.time_embed_dim != dit.time_embed_dim:
            form = {True: "pruned (curve-form)", False: "full"}
            raise CheckpointError(
                f"{where} has {form[self.curve_form]} AdaLN reading {self.time_embed_dim} values, the DiT "
                f"{form[dit.curve_form]} AdaLN with {dit.time_embed_dim}: use the ControlNet converted for this DiT")
        if self.places[-1] >= dit.num_layers:
            raise CheckpointError(f"{where} injects after DiT layer {self.places[-1]} but the DiT has "
                                  f"{dit.num_layers} layers")


def config_for(dit: DiTConfig, blocks: int, *, places: Iterable[int] | None = None,
               post_norm_fill: bool | None = None) -> ControlConfig:
    """The tower that fits a DiT: `blocks` blocks spread evenly over its layers unless `places` says."""
    if places is None:
        places = spread(blocks, dit.num_layers)
    return ControlConfig(dit.hidden_size, dit.num_attention_heads, dit.attention_head_dim, dit.ffn_dim,
                         dit.time_embed_dim, tuple(places), curve_form=dit.curve_form,
                         post_norm_fill=(blocks == 10) if post_norm_fill is None else post_norm_fill,
                         norm_eps=dit.norm_eps, qk_norm_eps=dit.qk_norm_eps)


def spread(blocks: int, layers: int = BASE_LAYERS) -> tuple[int, ...]:
    """Blocks spread evenly over the DiT's layers, as the released files are placed (5: every 10th, 10: every 5th);
    a short DiT (the tiny preset) takes one per layer from 0."""
    if blocks <= 0:
        raise CheckpointError("a control tower needs at least one block")
    step = max(1, layers // blocks)
    return tuple(range(0, blocks * step, step))


class ControlBlock(Block):
    """A full DiT block plus its zero-initialised skip projection (`after_proj`); block 0 also re-bases the
    control stream on the DiT's input (`before_proj`)."""

    def __init__(self, c: DiTConfig, first: bool):
        super().__init__(c)
        if first:
            self.before_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=True)
        self.after_proj = nn.Linear(c.hidden_size, c.hidden_size, bias=True)

    def forward(self, c: torch.Tensor, table: torch.Tensor, mod, rope, attention, mlp_chunks: int = 1,
                qk_prep=None, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The advanced stream and its skip. Block 0 first re-bases the stream on the DiT's input `base`. All of
        a block's weights are read inside this one call, so a streamed block (dit/streaming.py) is whole on the
        device for its turn."""
        if base is not None:
            c = self.before_proj(c) + base
        c = super().forward(c, table, mod, rope, attention, mlp_chunks, qk_prep)
        return c, self.after_proj(c)


class ControlTower(nn.Module):
    def __init__(self, config: ControlConfig, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.config = config
        block_config = config.block_config()
        # Without a device the caller's device context holds (a meta one builds no weights: the file checks and
        # the writers read shapes that way; forcing the CPU here once made them initialise a full tower, 45 s).
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.control_proj_in = nn.Linear(config.hint_dim, config.hidden_size, bias=True)
            self.control_blocks = nn.ModuleList([ControlBlock(block_config, i == 0) for i in range(config.blocks)])
        for name, param in self.named_parameters():
            param.data = param.data.to(self.param_dtype(name, dtype))
        self.dtype_ = dtype
        # Under a VRAM budget the blocks that do not fit stream (engine/placement.place_tower); None: resident.
        self.block_stream = None

    def param_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """fp32 for the hint projection (as the video patch projection) and a pruned file's AdaLN projections."""
        if name.startswith("control_proj_in."):
            return torch.float32
        if self.config.curve_form and ".adaln_proj.linear." in name:
            return torch.float32
        return dtype

    # ----------------------------------------------------------------- loading
    def load_state(self, tensors: Iterable[tuple[str, "torch.Tensor | StoredForm"]], *, device=None,
                   where: str = "the ControlNet") -> None:
        """Assign every parameter exactly once, one tensor at a time; a `StoredForm` weight becomes a StoredLinear
        (the file's codes, dequantized at use)."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{where}: {name} is no parameter of the control tower")
            target = self.param_dtype(name, self.dtype_)
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(f"{where}: {name} is {tuple(tensor.shape)}, the tower's is {tuple(param.shape)}")
            if isinstance(tensor, StoredForm):
                owner = name.rpartition(".")[0]
                linear = self.get_submodule(owner)
                if not isinstance(linear, nn.Linear) or not name.endswith(".weight"):
                    raise CheckpointError(f"{where}: {name}: a stored quantized weight must belong to a linear layer")
                if device is not None:
                    tensor.tensors = {k: v.to(device) for k, v in tensor.tensors.items()}
                stored = StoredLinear(tensor, target, bias=None)
                if linear.bias is not None:
                    stored.register_parameter("bias", linear.bias)
                self.set_submodule(owner, stored)
                params = dict(self.named_parameters())
            else:
                value = tensor.to(device=device if device is not None else tensor.device, dtype=target)
                _assign_parameter(self, name, nn.Parameter(value, requires_grad=False))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise CheckpointError(f"{where}: {len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")

    # ----------------------------------------------------------------- compute
    def tables(self, adaln_input: torch.Tensor) -> list[torch.Tensor]:
        """Each block's AdaLN table (n_t * 3, 6 * hidden) for the DiT's AdaLN input of n_t timesteps."""
        out = []
        stream = self.block_stream
        for k, blk in enumerate(self.control_blocks):
            # A streamed tower keeps every block's AdaLN projection in host memory, on the device only for this.
            with stream.adaln_scope(k) if stream is not None else contextlib.nullcontext():
                table = blk.adaln_proj.table(adaln_input)
            out.append(table.to(self.dtype_) if self.config.curve_form else table)
        return out

    def embed_hint(self, x: torch.Tensor, hint_rows: torch.Tensor, video_indices: torch.Tensor) -> torch.Tensor:
        """x with every video row replaced by the hint's projection: the stream block 0 re-bases (before_proj)."""
        emb = self.control_proj_in(hint_rows.to(compute_dtype(self.control_proj_in)))
        return x.index_copy(1, video_indices, emb.to(x.dtype).expand(x.shape[0], -1, -1))

    def step(self, k: int, c: torch.Tensor, table: torch.Tensor, mod, rope, attention, mlp_chunks: int = 1,
             qk_prep=None, base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Control block k: the advanced stream and its skip (block 0 re-bases the stream on `base` first)."""
        return self.control_blocks[k](c, table, mod, rope, attention, mlp_chunks, qk_prep, base)


# --------------------------------------------------------------------------------------------- the window
def percent_to_sigma(percent: float, shift: float) -> float:
    """A fraction of the schedule as the video sigma the shifted flow schedule reaches there (0 -> 1, 1 -> 0)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    s = 1.0 - percent
    return shift * s / (1.0 + (shift - 1.0) * s)


def check_window(start: float, end: float, strength: float) -> None:
    for name, v in (("control start", start), ("control end", end)):
        if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
            raise InputError(f"{name} is a fraction of the schedule in [0, 1], got {v!r}")
    if not (isinstance(strength, (int, float)) and 0.0 <= strength <= 10.0):
        raise InputError(f"control strength must be in [0, 10], got {strength!r}")


# --------------------------------------------------------------------------------------------- the hook
class ControlInjection:
    """One request's control on a DiT (`dit.control`): the tower, the hint rows of the target video (patchified,
    (N_target, hint_dim) fp32, in the target rows' order), the strength and the window (fractions of the schedule,
    turned into sigmas with the video shift).

    Every forward asks `begin`: None outside the window or at strength 0 (the forward is then the plain one), else
    a `ControlRun` for that forward."""

    def __init__(self, tower: ControlTower, hint_rows: torch.Tensor, strength: float = 1.0,
                 window: tuple[float, float] = (0.0, 1.0), shift: float = 12.0):
        check_window(window[0], window[1], strength)
        if hint_rows.ndim != 2 or hint_rows.shape[1] != tower.config.hint_dim:
            raise InputError(f"the control hint must be (rows, {tower.config.hint_dim}), got {list(hint_rows.shape)}")
        self.tower, self.strength = tower, float(strength)
        self.hint_rows = hint_rows.float()
        self.window = (float(window[0]), float(window[1]))
        self.sigma_start, self.sigma_end = percent_to_sigma(window[0], shift), percent_to_sigma(window[1], shift)
        self._tables: dict[float, list[torch.Tensor]] = {}
        self._hint_on: dict[str, torch.Tensor] = {}  # the hint rows moved to a device once, not every forward
        self.evaluations = 0  # forwards the tower ran in (reports)

    def active(self, sigma: float) -> bool:
        return self.strength != 0.0 and self.sigma_end <= sigma <= self.sigma_start

    @torch.no_grad()
    def precompute(self, values: list[float], adaln_input: torch.Tensor) -> None:
        """Cache the tower's tables for these timestep values (the DiT precomputes its own at the same time, so the
        DiT's AdaLN weights may be released after)."""
        tables = self.tower.tables(adaln_input)
        for i, v in enumerate(values):
            self._tables[float(v)] = [t[3 * i:3 * i + 3].clone() for t in tables]

    def tables(self, timestep: torch.Tensor, adaln_input: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        values = [float(v) for v in timestep.flatten().tolist()]
        if all(v in self._tables for v in values):
            return [torch.cat([self._tables[v][k] for v in values]) for k in range(self.tower.config.blocks)]
        return self.tower.tables(adaln_input(timestep))

    def begin(self, x: torch.Tensor, *, timestep: torch.Tensor, timestep_indices: torch.Tensor,
              video_indices: torch.Tensor, audio_indices: torch.Tensor, output_video_rows: torch.Tensor | None,
              part, adaln_input: Callable[[torch.Tensor], torch.Tensor], attention) -> "ControlRun | None":
        """x: the DiT's block-0 input over the whole sequence (before any split over ranks)."""
        target = (torch.arange(video_indices.numel(), device=video_indices.device) if output_video_rows is None
                  else output_video_rows)
        if target.numel() == 0:
            return None
        # The step's sigma is the target's (t = 1 - sigma): the least t over the target rows, since condition rows
        # and the rows a noise mask holds sit near t = 1 and are not what the window means.
        t_target = float(timestep[timestep_indices[video_indices[target]]].min())
        if not self.active(1.0 - t_target):
            return None
        if target.numel() != self.hint_rows.shape[0]:
            raise InputError(f"the control hint has {self.hint_rows.shape[0]} rows but the target video has "
                             f"{target.numel()}: the hint was made for another canvas or length")
        tower = self.tower
        rows = torch.zeros(video_indices.numel(), tower.config.hint_dim, dtype=torch.float32, device=x.device)
        hint = self._hint_on.get(str(x.device))
        if hint is None:
            hint = self._hint_on[str(x.device)] = self.hint_rows.to(x.device)
        rows[target] = hint
        c = part.local(tower.embed_hint(x, rows[None], video_indices), 1)
        keep = torch.ones(x.shape[1], 1, dtype=x.dtype, device=x.device)
        keep[audio_indices] = 0
        self.evaluations += 1
        # The re-basing on x is block 0's (its `before_proj` streams with it), so x is kept until block 0 runs.
        return ControlRun(self, c, self.tables(timestep, adaln_input), part.local(keep, 0), attention,
                          part.local(x, 1))


class ControlRun:
    """The control stream of one forward; `after_block(i, x, ...)` adds block k's skip after DiT layer places[k]."""

    def __init__(self, injection: ControlInjection, stream: torch.Tensor, tables: list[torch.Tensor],
                 keep: torch.Tensor, attention, base: torch.Tensor):
        self.injection, self.stream, self.tables, self.keep, self.attention = injection, stream, tables, keep, attention
        self.base = base  # the DiT's block-0 input: block 0 re-bases the stream on it
        self.at = {layer: k for k, layer in enumerate(injection.tower.config.places)}

    def after_block(self, layer: int, x: torch.Tensor, mod, rope, mlp_chunks: int = 1, qk_prep=None) -> torch.Tensor:
        k = self.at.get(layer)
        if k is None:
            return x
        if self.stream is None:
            raise H3Error("the control stream was already finished")
        base, self.base = (self.base, None) if k == 0 else (None, self.base)
        self.stream, skip = self.injection.tower.step(k, self.stream, self.tables[k], mod, rope, self.attention,
                                                      mlp_chunks, qk_prep, base)
        if k == len(self.at) - 1:
            self.stream = None  # the last block: nothing reads the stream again
        return x.add(skip * self.keep, alpha=self.injection.strength)


@contextlib.contextmanager
def attached(dit, injection: "ControlInjection | None") -> Iterator[None]:
    """`dit.control` set to this request's injection while it samples, then put back (None: nothing changes)."""
    if injection is None:
        yield
        return
    previous, dit.control = dit.control, injection
    try:
        yield
    finally:
        dit.control = previous
