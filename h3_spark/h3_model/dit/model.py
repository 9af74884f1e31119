"""The H3 diffusion transformer (DiT), one readable model.

One stack of blocks runs over a single packed sequence (see layout.py): full bidirectional
self-attention, no cross-attention, no mask. Modalities differ only in their input projections,
the AdaLN table row each row reads (timestep x modality tag) and the two output heads.

Parameter names are those of the diffusers `transformer/` folder, so that folder loads as is.
Mixed precision as released: patch embeddings, time MLP and heads are fp32; everything else runs
in the model dtype. Exact optimisations (same numerics as the reference):
- the text refiner depends only on the prompt: `encode_text` once, pass `text_embeds` per step;
- AdaLN tables depend only on t: `precompute_modulation` for a schedule, then `release_adaln`
  frees the 13 B AdaLN weights;
- RoPE tables are cached per layout; modulation is applied per contiguous segment;
- the heads run only over the rows asked for (the target rows when sampling).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError, H3Error, InputError
from ...kernels.attention import AttentionFn, sdpa
from ...kernels.references import RowModulation, SwiGLU
from ...kernels.stored_linear import StoredForm, StoredLinear
from .config import ADALN_VECTORS, NUM_MODALITIES, DiTConfig
from .head_bank import HeadBank, HeadMix, MixedHead
from .layout import adaln_rows
from .parallel import ONE_PROCESS, OneProcess, SequenceParallel

# Parameters kept in fp32 whatever the model dtype (prefix match on the parameter name).
FP32_PREFIXES = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.", "adaln_t_table")
# In the curve form the AdaLN projections are fp32 too.
CURVE_FP32_SUFFIXES = ("adaln_proj.linear.weight", "adaln_proj.linear.bias", "norm_out.linear.weight",
                       "norm_out.linear.bias")


def keeps_fp32(name: str, config: DiTConfig) -> bool:
    if name.startswith(FP32_PREFIXES):
        return True
    return config.curve_form and name.endswith(CURVE_FP32_SUFFIXES)


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of unscaled t in [0, 1], cosines first, fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def rope_tables(position_ids: torch.Tensor, rope_freq_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (S, 6 * rope_freq_dim) for (t, h, w) coordinates, fp32.

    One frequency vector serves all three axes; angles are laid out [t | h | w] and duplicated so
    that channel i pairs with channel i + 3 * rope_freq_dim (split-half convention).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / (2 * rope_freq_dim)))
    angles = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # (S, 3, F)
    angles = angles.reshape(angles.shape[0], -1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of every head of x (B, S, H, D); pass the rest through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, heads: int, head_dim: int, eps: float, gate_compress: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden_size, inner, bias=False)
        self.to_k = nn.Linear(hidden_size, inner, bias=False)
        self.to_v = nn.Linear(hidden_size, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, hidden_size, bias=False)])
        # FastH3's VSA gate on the pooled (coarse) branch, as published (no bias). Only a backend that reads it
        # (`reads_gate`, kernels/vsa.py) gets it; the dense forward leaves it unused, as ComfyUI does.
        self.to_gate_compress = nn.Linear(hidden_size, inner, bias=False) if gate_compress else None
        self._gate_zero: tuple | None = None  # ((weight identity, version), all zero?) of the last check

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw q, k, v as (B, S, H, D). Fast linear formats replace the three modules, not this method."""
        b, s, _ = x.shape
        shape = (b, s, self.heads, self.head_dim)
        return self.to_q(x).view(shape), self.to_k(x).view(shape), self.to_v(x).view(shape)

    def compress_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The VSA gate for attention input x, (B, S, H, D); None without a gate or when its weight is all zero
        (the branch would add exactly nothing: a base model's zero-initialised gate, FastVideo skips it too)."""
        gate = self.to_gate_compress
        if gate is None or self._gate_all_zero(gate):
            return None
        b, s, _ = x.shape
        if not isinstance(x, torch.Tensor):
            # With FP8 / NVFP4 linears the fused modulation hands the attention its input already quantized
            # (kernels/linear_fp8.Fp8Rows), which q, k and v share; the gate stays a plain linear of the
            # model's dtype, so it reads the values those codes stand for.
            x = x.dequantize(getattr(gate, "weight").dtype)
        return gate(x).view(b, s, self.heads, self.head_dim)

    def _gate_all_zero(self, gate: nn.Module) -> bool:
        weight = getattr(gate, "weight", None)
        if not isinstance(gate, nn.Linear) or not isinstance(weight, torch.Tensor) or weight.is_meta:
            return False  # stored codes (StoredLinear) do not say zero by their bits: computed as they are
        # Checked once per weight: a LoRA merge or a streamed block's new copy changes the identity or version.
        key = (weight.data_ptr(), weight.device, None if weight.is_inference() else weight._version)
        if self._gate_zero is None or self._gate_zero[0] != key or key[2] is None:
            self._gate_zero = (key, not bool(weight.any()))
        return self._gate_zero[1]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                attention: AttentionFn, qk_prep: "QKPrep | None" = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project_qkv(x)
        q, k = (qk_prep or reference_qk_prep)(self, q, k, rope)
        if getattr(attention, "reads_gate", False):  # VSA (recipe fasth3): its coarse branch takes the gate
            out = attention(q, k, v, gate=self.compress_gate(x))
        else:
            out = attention(q, k, v)
        # v's dtype, not q's: a low-bit Q/K preparation may hand the backend quantized q and k.
        out = out.reshape(b, s, self.heads * self.head_dim).to(v.dtype)
        return self.to_out[0](out)


def reference_qk_prep(attn: Attention, q: torch.Tensor, k: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head QK RMSNorm then partial RoPE; fused kernels (kernels/) replace this as a whole."""
    q, k = attn.norm_q(q), attn.norm_k(k)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k


QKPrep = Callable[[Attention, torch.Tensor, torch.Tensor, "tuple[torch.Tensor, torch.Tensor] | None"],
                  "tuple[torch.Tensor, torch.Tensor]"]


class AdaLNProjection(nn.Module):
    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = nn.Linear(in_dim, ADALN_VECTORS * hidden_size * NUM_MODALITIES, bias=True)

    def table(self, adaln_input: torch.Tensor) -> torch.Tensor:
        """(n_t, in) -> (n_t * 3, 6 * hidden): rows [t0 video, t0 text, t0 audio, t1 video, ...]."""
        return self.linear(adaln_input.to(compute_dtype(self.linear))).view(-1, ADALN_VECTORS * self.hidden_size)


class RefinerBlock(nn.Module):
    """Plain pre-norm block over the text rows only: no AdaLN, no RoPE."""

    def __init__(self, c: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.ff = SwiGLU(c.hidden_size, c.ffn_dim)

    def forward(self, x: torch.Tensor, attention: AttentionFn, mlp_chunks: int = 1) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), None, attention)
        return x + self.ff(self.norm2(x), mlp_chunks)


class TokenRefiner(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([RefinerBlock(c) for _ in range(c.num_refiner_layers)])
        self.final_norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)

    def forward(self, x: torch.Tensor, attention: AttentionFn, mlp_chunks: int = 1) -> torch.Tensor:
        for block in self.refiner_blocks:
            x = block(x, attention, mlp_chunks)
        return self.final_norm(x)


class Block(nn.Module):
    def __init__(self, c: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps,
                              gate_compress=c.gate_compress)
        self.norm2 = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.ff = SwiGLU(c.hidden_size, c.ffn_dim)
        self.adaln_proj = AdaLNProjection(c.time_embed_dim, c.hidden_size)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mod: RowModulation,
                rope: tuple[torch.Tensor, torch.Tensor], attention: AttentionFn, mlp_chunks: int = 1,
                qk_prep: QKPrep | None = None) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = table.chunk(ADALN_VECTORS, dim=-1)
        h = mod.norm_modulate(self.norm1, x, shift_a, scale_a)
        x, h = mod.add_norm_modulate(x, gate_a, self.attn(h, rope, attention, qk_prep), self.norm2, shift_m, scale_m)
        return mod.gated_add(x, gate_m, self.ff(h, mlp_chunks))


class TimeEmbedding(nn.Module):
    def __init__(self, freq_dim: int, hidden: int, out: int):
        super().__init__()
        self.linear_1 = nn.Linear(freq_dim, hidden, bias=True)
        self.linear_2 = nn.Linear(hidden, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class OutputNorm(nn.Module):
    """Final RMSNorm with shift/scale selected per row by timestep only (not by modality)."""

    def __init__(self, c: DiTConfig):
        super().__init__()
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.final_norm_eps)
        self.linear = nn.Linear(c.time_embed_dim, 2 * c.hidden_size, bias=True)

    def table(self, adaln_input: torch.Tensor) -> torch.Tensor:
        return self.linear(adaln_input.to(compute_dtype(self.linear)))


@dataclass
class ModulationTables:
    """AdaLN tables for one forward: per block (n_t * 3, 6D) and the output norm's (n_t, 2D)."""

    blocks: list[torch.Tensor]
    final: torch.Tensor


class H3DiT(nn.Module):
    def __init__(self, config: DiTConfig, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        c = self.config = config
        factory = {"device": device}
        with torch.device(device) if device is not None else _nullcontext():
            self.proj_in = nn.Linear(c.video_patch_dim, c.hidden_size, bias=True)
            self.audio_proj_in = nn.Linear(c.audio_in_channels, c.hidden_size, bias=True)
            self.context_embedder = nn.Linear(c.text_dim, c.hidden_size, bias=True)
            if c.curve_form:
                self.adaln_t_table = nn.Parameter(torch.empty(c.adaln_curve_grid, c.time_embed_dim, **factory))
            else:
                self.time_embedder = TimeEmbedding(c.freq_dim, c.time_embed_hidden_dim, c.time_embed_dim)
            self.token_refiner = TokenRefiner(c)
            self.transformer_blocks = nn.ModuleList([Block(c) for _ in range(c.num_layers)])
            self.norm_out = OutputNorm(c)
            self.proj_out = nn.Linear(c.hidden_size, c.video_patch_dim, bias=True)
            self.audio_proj_out = nn.Linear(c.hidden_size, c.audio_in_channels, bias=True)
        for name, param in self.named_parameters():
            param.data = param.data.to(torch.float32 if keeps_fp32(name, c) else dtype)
        self.dtype_ = dtype
        # Swappable compute (kernels/ provides fast versions; the defaults are the references).
        self.attention: AttentionFn = sdpa
        self.qk_prep: QKPrep | None = None
        self.modulation_cls: type[RowModulation] = RowModulation
        self.use_segments = True
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_last: tuple | None = None
        self._modulation_cache: dict[float, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self.adaln_released = False
        # Under a VRAM budget, the blocks that do not fit stream from host memory (dit/streaming.py).
        self.block_stream = None
        # An attention schedule (`at(step, block) -> AttentionFn`, e.g. a sparse recipe that stays dense for
        # the first steps and blocks) and the sampler's current evaluation; None: `attention` everywhere.
        self.attention_schedule = None
        self.sampling_step: int | None = None
        # Where the forward splits its sequence over ranks (dit/parallel.py, `--gpus N`); one process by default.
        self.sequence_parallel: SequenceParallel | OneProcess = ONE_PROCESS
        # Per-interval output heads a PDD LoRA brings (head_bank.py); a forward given a `head_mix` uses them in
        # place of proj_out / audio_proj_out.
        self.head_bank: HeadBank | None = None
        # A request's ControlNet (controlnet/tower.ControlInjection): asked once per forward after the embedding,
        # its run adds the control tower's skips after the layers it names. None: no control.
        self.control = None

    # ----------------------------------------------------------------- settings
    def set_attention(self, fn: AttentionFn) -> None:
        """Switch the attention backend; weights stay where they are."""
        self.attention = fn

    # ----------------------------------------------------------------- loading
    def load_state(self, tensors: Iterable[tuple[str, "torch.Tensor | StoredForm"]], *, device=None) -> None:
        """Assign checkpoint tensors one at a time (RAM holds the model plus one tensor).

        Works on a model built on the meta device. Every parameter must be provided exactly once. A linear's
        weight given as a `StoredForm` (a quantized layer kept as the file stores it) replaces that nn.Linear
        by a `StoredLinear` computing in the dtype the weight would have had.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected = []
        for name, tensor in tensors:
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if isinstance(tensor, StoredForm):
                self._assign_stored(name, tensor, param, device)
                seen.add(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}"
                )
            target = torch.float32 if keeps_fp32(name, self.config) else self.dtype_
            value = tensor.to(device=device if device is not None else tensor.device, dtype=target)
            _assign_parameter(self, name, nn.Parameter(value, requires_grad=False))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if unexpected:
            raise CheckpointError(f"{len(unexpected)} unexpected tensors, e.g. {', '.join(sorted(unexpected)[:3])}")
        if missing:
            raise CheckpointError(f"{len(missing)} tensors missing, e.g. {', '.join(missing[:3])}")

    def _assign_stored(self, name: str, form: StoredForm, param: nn.Parameter, device) -> None:
        owner_name = name.rpartition(".")[0]
        linear = self.get_submodule(owner_name)
        if not isinstance(linear, nn.Linear) or not name.endswith(".weight"):
            raise CheckpointError(f"{name}: a stored quantized weight must belong to a linear layer")
        if tuple(form.shape) != tuple(param.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(form.shape)} does not match the model's "
                                  f"{tuple(param.shape)}")
        if device is not None:
            form.tensors = {k: v.to(device) for k, v in form.tensors.items()}
        target = torch.float32 if keeps_fp32(name, self.config) else self.dtype_
        # The bias, if any, is assigned after (it is its own entry of the stream).
        stored = StoredLinear(form, target, bias=None)
        if linear.bias is not None:
            stored.register_parameter("bias", linear.bias)
        self.set_submodule(owner_name, stored)

    # ----------------------------------------------------------------- conditioning
    def adaln_input(self, timestep: torch.Tensor) -> torch.Tensor:
        """What every AdaLN projection reads for each distinct timestep, fp32."""
        timestep = timestep.float().flatten()
        if self.config.curve_form:
            return curve_basis(self.adaln_t_table, timestep)
        temb = self.time_embedder(timestep_sinusoid(timestep, self.config.freq_dim).to(compute_dtype(self.time_embedder.linear_1)))
        # SiLU at the time MLP's fp32 precision; each projection casts afterwards.
        return F.silu(temb)

    def compute_modulation(self, timestep: torch.Tensor) -> ModulationTables:
        if self.adaln_released:
            raise H3Error("the AdaLN weights were released; only precomputed timesteps can run")
        a = self.adaln_input(timestep)
        blocks = []
        for i, blk in enumerate(self.transformer_blocks):
            # A streamed block's AdaLN projection visits the GPU for this (engine/memory.py).
            with self.block_stream.adaln_scope(i) if self.block_stream is not None else _nullcontext():
                blocks.append(blk.adaln_proj.table(a))
        final = self.norm_out.table(a)
        if self.config.curve_form:
            # Curve-form AdaLN runs in fp32 (as ComfyUI does); block tables meet the residual stream in
            # its dtype, the final shift/scale stay fp32 and promote the head input to fp32.
            blocks = [t.to(self.dtype_) for t in blocks]
        return ModulationTables(blocks, final)

    @torch.no_grad()
    def precompute_modulation(self, values: Iterable[float]) -> None:
        """Cache AdaLN tables for these timestep values (e.g. every value a schedule will use)."""
        todo = sorted({float(v) for v in values} - set(self._modulation_cache))
        if not todo:
            return
        device = self.context_embedder.weight.device
        tables = self.compute_modulation(torch.tensor(todo, dtype=torch.float32, device=device))
        for i, v in enumerate(todo):
            rows = slice(i * NUM_MODALITIES, (i + 1) * NUM_MODALITIES)
            self._modulation_cache[v] = ([t[rows].clone() for t in tables.blocks], tables.final[i:i + 1].clone())
        if self.control is not None:  # the tower's own tables, while the AdaLN input can still be computed
            self.control.precompute(todo, self.adaln_input(torch.tensor(todo, dtype=torch.float32, device=device)))

    def clear_modulation_cache(self) -> None:
        if self.adaln_released:
            raise H3Error("the AdaLN weights were released; the precomputed tables are all that is left")
        self._modulation_cache.clear()

    def release_adaln(self) -> int:
        """Drop the AdaLN weights (39 % of the DiT) once every needed table is cached; returns bytes freed."""
        if not self._modulation_cache:
            raise H3Error("precompute_modulation must run before the AdaLN weights are released")
        freed = 0 if self.block_stream is None else self.block_stream.release_adaln()
        for blk in self.transformer_blocks:
            freed += _bytes(blk.adaln_proj)
            del blk.adaln_proj
        for name in ("time_embedder", "adaln_t_table"):
            if hasattr(self, name):
                obj = getattr(self, name)
                freed += _bytes(obj) if isinstance(obj, nn.Module) else obj.numel() * obj.element_size()
                delattr(self, name)
        freed += _bytes(self.norm_out.linear)
        del self.norm_out.linear
        self.adaln_released = True
        return freed

    def modulation(self, timestep: torch.Tensor) -> ModulationTables:
        values = [float(v) for v in timestep.flatten().tolist()]
        if all(v in self._modulation_cache for v in values):
            cached = [self._modulation_cache[v] for v in values]
            blocks = [torch.cat([c[0][i] for c in cached]) for i in range(len(self.transformer_blocks))]
            return ModulationTables(blocks, torch.cat([c[1] for c in cached]))
        if self.adaln_released:
            missing = [v for v in values if v not in self._modulation_cache]
            raise H3Error(f"timestep(s) {missing} were not precomputed and the AdaLN weights were released")
        return self.compute_modulation(timestep)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for a layout, cached by content (a layout is reused for every step).

        The sampler hands the same tensor every step: that is recognised without hashing it, which would
        copy it to the host and synchronise the device once per step.
        """
        last = self._rope_last
        # Inference tensors (ComfyUI samples under inference_mode) keep no version counter, so an
        # in-place change would go unseen: they are always hashed.
        version = None if position_ids.is_inference() else position_ids._version
        if last is not None and version is not None and last[0] is position_ids and last[1] == version:
            return last[2]
        key = (hashlib.blake2b(position_ids.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest(),
               tuple(position_ids.shape), str(position_ids.device))
        tables = self._rope_cache.get(key)
        if tables is None:
            tables = rope_tables(position_ids, self.config.rope_freq_dim, self.config.rope_theta)
            if len(self._rope_cache) >= 4:
                self._rope_cache.pop(next(iter(self._rope_cache)))
            self._rope_cache[key] = tables
        self._rope_last = (position_ids, version, tables)
        return tables

    def clear_rope_cache(self) -> None:
        """Forget the RoPE tables (they live on the device the model ran on: unloading gives them back)."""
        self._rope_cache.clear()
        self._rope_last = None

    def encode_text(self, encoder_hidden_states: torch.Tensor, mlp_chunks: int = 1) -> torch.Tensor:
        """Context embedding + token refiner: depends only on the prompt, so run it once per generation."""
        x = self.context_embedder(encoder_hidden_states.to(compute_dtype(self.context_embedder)))
        return self.token_refiner(x, self.attention, mlp_chunks)

    # ----------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | None, timestep: torch.Tensor, timestep_indices: torch.Tensor,
                token_tags: torch.Tensor, position_ids: torch.Tensor, video_indices: torch.Tensor,
                audio_indices: torch.Tensor, text_indices: torch.Tensor, *, text_embeds: torch.Tensor | None = None,
                output_video_rows: torch.Tensor | None = None, output_audio_rows: torch.Tensor | None = None,
                mlp_chunks: int = 1, step_callback: Callable[[int], None] | None = None,
                block_cache=None, head_mix: HeadMix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocities (fp32) for the video and audio rows.

        By default every video/audio row is returned in the order of video_indices/audio_indices.
        `output_video_rows` / `output_audio_rows` select positions within those (e.g. the target
        rows) so the heads only run where needed. `block_cache` (step_cache.FirstBlockCache) sees the first
        block's residual and may answer with the other blocks' residual from an earlier step instead of
        running them. Under sequence parallelism (`sequence_parallel`, dit/parallel.py) each rank runs the blocks
        on its own rows and every rank returns the whole result. `head_mix` (one sampling step's weights over
        `head_bank`) replaces the two heads by the bank's mix for this forward.
        """
        if text_embeds is None:
            if encoder_hidden_states is None:
                raise InputError("either encoder_hidden_states or text_embeds is needed")
            text_embeds = self.encode_text(encoder_hidden_states, mlp_chunks)
        self._check_inputs(hidden_states, audio_hidden_states, text_embeds, timestep, timestep_indices, token_tags,
                           position_ids, video_indices, audio_indices, text_indices)
        cos, sin = self.rope(position_ids)
        tables = self.modulation(timestep)

        x = self.embed_rows(hidden_states, audio_hidden_states, text_embeds, video_indices, audio_indices,
                            text_indices, position_ids.shape[0])
        # From here to the heads each rank holds its own rows (one process: all of them).
        part = self.sequence_parallel.split(position_ids.shape[0])
        control = None if self.control is None else self.control.begin(
            x, timestep=timestep, timestep_indices=timestep_indices, video_indices=video_indices,
            audio_indices=audio_indices, output_video_rows=output_video_rows, part=part,
            adaln_input=self.adaln_input, attention=part.attention(self.attention))
        x, rope = part.local(x, 1), (part.local(cos, 0), part.local(sin, 0))
        mod = self.modulation_cls(part.local(adaln_rows(timestep_indices, token_tags), 0), self.use_segments)
        schedule, step = self.attention_schedule, self.sampling_step
        x_in = after_first = None
        for i, blk in enumerate(self.transformer_blocks):
            if block_cache is not None and i == 0:
                x_in = x
            attention = part.attention(self.attention if schedule is None else schedule.at(step, i))
            x = blk(x, tables.blocks[i], mod, rope, attention, mlp_chunks, self.qk_prep)
            if control is not None:
                x = control.after_block(i, x, mod, rope, mlp_chunks, self.qk_prep)
            if step_callback is not None:
                step_callback(i)
            if block_cache is not None and i == 0:
                rest = block_cache.after_first_block(x - x_in, part.mean_abs)
                if rest is not None:
                    x = x + rest
                    break
                after_first = x
        else:
            if block_cache is not None:
                block_cache.store_rest(x - after_first)

        return self.heads(part.gather(x), timestep_indices, tables.final, video_indices, audio_indices,
                          output_video_rows, output_audio_rows, head_mix)

    def embed_rows(self, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor, text_embeds: torch.Tensor,
                   video_indices: torch.Tensor, audio_indices: torch.Tensor, text_indices: torch.Tensor,
                   sequence_length: int) -> torch.Tensor:
        """Project each modality and scatter its rows into the packed sequence (the text dtype's)."""
        video = self.proj_in(hidden_states.to(compute_dtype(self.proj_in)))
        audio = self.audio_proj_in(audio_hidden_states.to(compute_dtype(self.audio_proj_in)))
        x = text_embeds.new_zeros(text_embeds.shape[0], sequence_length, self.config.hidden_size)
        x = x.index_copy(1, text_indices, text_embeds)
        x = x.index_copy(1, video_indices, video.to(x.dtype))
        return x.index_copy(1, audio_indices, audio.to(x.dtype))

    def heads(self, x: torch.Tensor, timestep_indices: torch.Tensor, final: torch.Tensor, video_indices: torch.Tensor,
              audio_indices: torch.Tensor, output_video_rows: torch.Tensor | None,
              output_audio_rows: torch.Tensor | None,
              head_mix: HeadMix | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Output norm and the two fp32 heads (the bank's mix under `head_mix`) over the requested rows."""
        video_rows = video_indices if output_video_rows is None else video_indices[output_video_rows]
        audio_rows = audio_indices if output_audio_rows is None else audio_indices[output_audio_rows]
        video_proj, audio_proj = self.proj_out, self.audio_proj_out
        if head_mix is not None:
            if self.head_bank is None:
                raise H3Error("a per-step head mix needs a head bank on the DiT (a PDD LoRA), and this one has none")
            video_proj, audio_proj = self.head_bank.mixed(head_mix)
        return (self._head(x, video_rows, timestep_indices, final, video_proj),
                self._head(x, audio_rows, timestep_indices, final, audio_proj))

    def _head(self, x: torch.Tensor, rows: torch.Tensor, timestep_indices: torch.Tensor, final: torch.Tensor,
              proj: "nn.Linear | MixedHead") -> torch.Tensor:
        shift, scale = final.chunk(2, dim=-1)
        t_rows = timestep_indices.index_select(0, rows)
        h = self.norm_out.norm(x.index_select(1, rows))
        h = h * (1.0 + scale.index_select(0, t_rows)) + shift.index_select(0, t_rows)
        return proj(h.to(compute_dtype(proj)))

    def _check_inputs(self, hidden_states, audio_hidden_states, text_embeds, timestep, timestep_indices, token_tags,
                      position_ids, video_indices, audio_indices, text_indices) -> None:
        c = self.config
        if position_ids.ndim != 2 or position_ids.shape[1] != 3:
            raise InputError(f"position_ids must be (seq_len, 3), got {list(position_ids.shape)}")
        s = position_ids.shape[0]
        for name, t in (("token_tags", token_tags), ("timestep_indices", timestep_indices)):
            if tuple(t.shape) != (s,):
                raise InputError(f"{name} must be ({s},) to match position_ids, got {list(t.shape)}")
        expect = {
            "hidden_states": (hidden_states, (video_indices.numel(), c.video_patch_dim)),
            "audio_hidden_states": (audio_hidden_states, (audio_indices.numel(), c.audio_in_channels)),
            "text rows": (text_embeds, (text_indices.numel(), c.hidden_size)),
        }
        for name, (t, (rows, width)) in expect.items():
            if t.ndim != 3 or t.shape[1] != rows or t.shape[2] != width:
                raise InputError(f"{name} must be (batch, {rows}, {width}), got {list(t.shape)}")
        if len({hidden_states.shape[0], audio_hidden_states.shape[0], text_embeds.shape[0]}) != 1:
            raise InputError("hidden_states, audio_hidden_states and encoder_hidden_states have different batch sizes")
        if video_indices.numel() + audio_indices.numel() + text_indices.numel() != s:
            raise InputError(
                f"video ({video_indices.numel()}) + audio ({audio_indices.numel()}) + text ({text_indices.numel()}) "
                f"rows do not add up to seq_len {s}"
            )
        if timestep.ndim != 1 or timestep.numel() == 0:
            raise InputError(f"timestep must be a 1-D tensor of distinct values, got shape {list(timestep.shape)}")
        if s and (int(timestep_indices.min()) < 0 or int(timestep_indices.max()) >= timestep.numel()):
            raise InputError(f"timestep_indices must lie in [0, {timestep.numel()})")
        if s and (int(token_tags.min()) < 0 or int(token_tags.max()) >= NUM_MODALITIES):
            raise InputError("token_tags must be 0 (video), 1 (text) or 2 (audio)")
        covered = torch.cat([video_indices, audio_indices, text_indices])
        if covered.numel() and (int(covered.min()) < 0 or int(covered.max()) >= s or covered.unique().numel() != s):
            raise InputError("video_indices, audio_indices and text_indices must cover every row exactly once")


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear computes in: its weight's, or `out_dtype` for one holding low-bit codes (StoredLinear,
    the FP8 and NVFP4 linears)."""
    return getattr(linear, "out_dtype", None) or linear.weight.dtype


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def curve_basis(table: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """Linear interpolation of a pruned checkpoint's [grid, k] AdaLN table at t in [0, 1], fp32."""
    grid = table.shape[0]
    pos = timestep.float().clamp(0.0, 1.0) * (grid - 1)
    lo = pos.floor().long().clamp(max=grid - 2)  # t = 1 interpolates inside the last interval
    t = table.float()
    return torch.lerp(t[lo], t[lo + 1], (pos - lo.float())[:, None])


def _assign_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, value)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
