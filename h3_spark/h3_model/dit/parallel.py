"""Ulysses sequence parallelism for the DiT on torch.distributed (NCCL on GPUs, gloo on CPUs).

The packed sequence is cut into contiguous row ranges, one per rank (lengths may differ by one).
Everything per row stays local: AdaLN modulation (segments of the local rows), RoPE rows, QK norm,
the projections and the SwiGLU. Around attention, one all-to-all trades rows for heads, so each
rank attends over the whole sequence with heads/world heads; a second all-to-all trades back.
The world size must divide the head count (56 heads: 2, 4, 7 or 8 GPUs). The text refiner runs
on the text rows only and is replicated (it is small and its rows are not split). The heads run
after one all-gather of the final hidden rows, so outputs equal the single-process forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import H3Error, InputError
from .layout import adaln_rows


@dataclass
class SequenceShards:
    rank: int
    world: int
    sizes: list[int]

    @classmethod
    def split(cls, length: int, rank: int, world: int) -> "SequenceShards":
        if length < world:
            raise InputError(f"a {length}-row sequence cannot be split over {world} ranks")
        base, extra = divmod(length, world)
        return cls(rank, world, [base + (1 if r < extra else 0) for r in range(world)])

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def end(self) -> int:
        return self.start + self.sizes[self.rank]


def _heads_to_rows(x: torch.Tensor, shards: SequenceShards, group) -> torch.Tensor:
    """(B, S_local, H, D) -> (B, S, H / world, D): all rows, this rank's heads."""
    b, s_local, h, d = x.shape
    w = shards.world
    send = x.reshape(b, s_local, w, h // w, d).permute(2, 1, 0, 3, 4).contiguous()  # (w, S_local, B, h, d)
    send = send.reshape(w * s_local, b, h // w, d)
    recv = send.new_empty(sum(shards.sizes), b, h // w, d)
    dist.all_to_all_single(recv, send, output_split_sizes=shards.sizes, input_split_sizes=[s_local] * w,
                           group=group)
    return recv.permute(1, 0, 2, 3)


def _rows_to_heads(x: torch.Tensor, shards: SequenceShards, group) -> torch.Tensor:
    """(B, S, H / world, D) -> (B, S_local, H, D): this rank's rows, all heads."""
    b, s, hw, d = x.shape
    w, s_local = shards.world, shards.sizes[shards.rank]
    send = x.permute(1, 0, 2, 3).contiguous()  # (S, B, h, d), rank-ordered row chunks
    recv = send.new_empty(w * s_local, b, hw, d)
    dist.all_to_all_single(recv, send, output_split_sizes=[s_local] * w, input_split_sizes=shards.sizes,
                           group=group)
    return recv.reshape(w, s_local, b, hw, d).permute(2, 1, 0, 3, 4).reshape(b, s_local, w * hw, d)


def ulysses_attention(inner, shards: SequenceShards, group=None):
    """Wrap an attention backend (q, k, v as (B, S, H, D)) so it runs on local rows."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads_to_rows(t, shards, group) for t in (q, k, v))
        return _rows_to_heads(inner(q, k, v), shards, group)

    return attention


def gather_rows(x: torch.Tensor, shards: SequenceShards, group=None) -> torch.Tensor:
    """(B, S_local, D) on every rank -> (B, S, D) on every rank."""
    biggest = max(shards.sizes)
    padded = x.new_zeros(x.shape[0], biggest, x.shape[2])
    padded[:, : x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in range(shards.world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, shards.sizes)], dim=1)


class SequenceParallelDiT:
    """Runs an H3DiT with its sequence split over the ranks of `group`; call it like the model."""

    # Its forward is its own: the model's block loop hooks (attention schedules, the first-block cache) do not
    # reach it (pipeline/sampler.py refuses them).
    takes_block_hooks = False

    def __init__(self, model, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise H3Error("sequence parallelism needs torch.distributed to be initialised (torchrun)")
        self.model = model
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        heads = model.config.num_attention_heads
        if heads % self.world:
            raise InputError(f"{self.world} ranks do not divide the {heads} attention heads; use a world size that "
                             f"does (for 56 heads: 2, 4, 7 or 8)")

    def __getattr__(self, name):
        # config, encode_text, precompute_modulation, ... are the model's own.
        return getattr(self.model, name)

    @torch.no_grad()
    def __call__(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
                 token_tags, position_ids, video_indices, audio_indices, text_indices, *, text_embeds=None,
                 output_video_rows=None, output_audio_rows=None, mlp_chunks: int = 1, step_callback=None):
        m = self.model
        if text_embeds is None:
            if encoder_hidden_states is None:
                raise InputError("either encoder_hidden_states or text_embeds is needed")
            text_embeds = m.encode_text(encoder_hidden_states, mlp_chunks)
        m._check_inputs(hidden_states, audio_hidden_states, text_embeds, timestep, timestep_indices, token_tags,
                        position_ids, video_indices, audio_indices, text_indices)
        s = position_ids.shape[0]
        shards = SequenceShards.split(s, self.rank, self.world)
        lo, hi = shards.start, shards.end
        cos, sin = m.rope(position_ids)
        tables = m.modulation(timestep)

        x = m.embed_rows(hidden_states, audio_hidden_states, text_embeds, video_indices, audio_indices, text_indices,
                         s)[:, lo:hi].contiguous()

        mod = m.modulation_cls(adaln_rows(timestep_indices, token_tags)[lo:hi], m.use_segments)
        attention = ulysses_attention(m.attention, shards, self.group)
        rope = (cos[lo:hi], sin[lo:hi])
        for i, blk in enumerate(m.transformer_blocks):
            x = blk(x, tables.blocks[i], mod, rope, attention, mlp_chunks, m.qk_prep)
            if step_callback is not None:
                step_callback(i)
        x = gather_rows(x, shards, self.group)
        return m.heads(x, timestep_indices, tables.final, video_indices, audio_indices, output_video_rows,
                       output_audio_rows)
