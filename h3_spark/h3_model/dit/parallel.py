"""Ulysses sequence parallelism for the DiT on torch.distributed (NCCL on GPUs, gloo on CPUs).

`H3DiT.forward` is the one forward; a model split over ranks holds a `SequenceParallel` and the forward
calls the part it hands out for each sequence (`split`) at the points where a split sequence differs:
- `local`: after the embedding, each rank keeps its contiguous range of the packed rows (lengths may differ
  by one), and every per-row input (RoPE rows, the AdaLN rows behind segment modulation) is cut the same way;
  everything per row then stays local: modulation, QK norm, RoPE, the projections, the SwiGLU;
- `attention`: one all-to-all trades rows for heads, so each rank attends over the whole sequence with
  heads/world heads (a contiguous slice of the head dim), and a second all-to-all trades back. Every backend
  and attention schedule works per head, so each rank's slice gets what one process computes for it;
- `gather`: one all-gather of the final hidden rows before the heads, so outputs equal the single-process
  forward on every rank;
- `mean_abs`: a reduction over the whole sequence (the first-block cache's measure), the same on every rank.
The world size must divide the head count (56 heads: 2, 4, 7 or 8 GPUs). The text refiner runs on the text
rows only, before the split, and is replicated (it is small). A model in one process holds `ONE_PROCESS`,
whose part leaves the forward as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import H3Error, InputError


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


class UlyssesAttention:
    """An attention (q, k, v as (B, S, H, D)) run on this rank's rows: all rows and a slice of the heads go to
    `inner`. A backend that reads the VSA gate (`reads_gate`) gets the gate traded the same way."""

    def __init__(self, inner, shards: SequenceShards, group=None):
        self.inner, self.shards, self.group = inner, shards, group
        self.reads_gate = getattr(inner, "reads_gate", False)

    def __call__(self, q, k, v, gate=None):
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            # Quantized heads carry scales of this rank's rows only: traded, one head would mix scales.
            raise H3Error("sequence parallelism trades the rows of plain q, k, v between ranks, but the Q/K "
                          "preparation hands the attention quantized heads (attention fa3_fp8): choose another "
                          "attention, or run on one GPU")
        q, k, v = (_heads_to_rows(t, self.shards, self.group) for t in (q, k, v))
        if self.reads_gate:
            gate = None if gate is None else _heads_to_rows(gate, self.shards, self.group)
            out = self.inner(q, k, v, gate=gate)
        else:
            out = self.inner(q, k, v)
        return _rows_to_heads(out, self.shards, self.group)


def gather_rows(x: torch.Tensor, shards: SequenceShards, group=None) -> torch.Tensor:
    """(B, S_local, D) on every rank -> (B, S, D) on every rank."""
    biggest = max(shards.sizes)
    padded = x.new_zeros(x.shape[0], biggest, x.shape[2])
    padded[:, : x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in range(shards.world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:, :n] for p, n in zip(parts, shards.sizes)], dim=1)


class RankRows:
    """One sequence's part on this rank: its rows, and the collectives that make the forward whole again."""

    def __init__(self, shards: SequenceShards, group=None):
        self.shards, self.group = shards, group

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows of a per-row tensor whose rows run along `dim`."""
        return t.narrow(dim, self.shards.start, self.shards.sizes[self.shards.rank]).contiguous()

    def attention(self, inner) -> UlyssesAttention:
        return UlyssesAttention(inner, self.shards, self.group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_rows(x, self.shards, self.group)

    def mean_abs(self, t: torch.Tensor) -> float:
        """Mean absolute value over every rank's rows of t (B, S_local, D): one all-reduced fp64 sum, so every
        rank gets the same number and takes the same decision from it."""
        total = t.float().abs().sum(dtype=torch.float64).reshape(1)
        dist.all_reduce(total, group=self.group)
        count = t.numel() // t.shape[1] * sum(self.shards.sizes)
        return total.item() / count


class OneProcess:
    """A model in one process: the whole sequence is this rank's, and every hook leaves its input as it is."""

    world = 1

    def split(self, length: int) -> "OneProcess":
        return self

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def attention(self, inner):
        return inner

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def mean_abs(self, t: torch.Tensor) -> float:
        """Mean absolute value of t in fp32."""
        return t.float().abs().mean().item()


ONE_PROCESS = OneProcess()


class SequenceParallel:
    """Splits each forward of a model with `heads` attention heads over the ranks of `group` (Ulysses). Set it
    on the model (`model.sequence_parallel`); every rank runs the same forwards in the same order."""

    def __init__(self, heads: int, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise H3Error("sequence parallelism needs torch.distributed to be initialised (torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if heads % self.world:
            raise InputError(f"{self.world} ranks do not divide the {heads} attention heads; use a world size that "
                             f"does (for 56 heads: 2, 4, 7 or 8)")

    def split(self, length: int) -> RankRows:
        return RankRows(SequenceShards.split(length, self.rank, self.world), self.group)


def split_over_ranks(model, group=None):
    """`model` (an H3DiT) with every forward split over the ranks of `group` (default: all of them)."""
    model.sequence_parallel = SequenceParallel(model.config.num_attention_heads, group)
    return model
