"""The plain-PyTorch modules the DiT runs by default, and that the fused kernels here subclass.

They live with the kernels (each kernel beside its reference) so that kernels/ never imports the model:
- `RowModulation`: RMSNorm + AdaLN shift/scale per row, and the gated residual, per contiguous segment;
- `SwiGLU`: the block MLP, `value * silu(gate)` of the fused [value; gate] up-projection.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError


def segments(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of equal AdaLN rows as (start, end, table_row)."""
    rows = rows.cpu()
    if rows.numel() == 0:
        return []
    change = torch.nonzero(rows[1:] != rows[:-1]).flatten() + 1
    starts = [0] + change.tolist()
    ends = change.tolist() + [rows.numel()]
    values = rows[starts].tolist()
    return [(s, e, v) for s, e, v in zip(starts, ends, values)]


class _UpProjection(nn.Module):
    # Holds the fused [value; gate] up-projection under the checkpoint's `ff.net.0.proj` name.
    def __init__(self, hidden_size: int, ffn_dim: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 2 * ffn_dim, bias=False)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_dim: int):
        super().__init__()
        # Index 1 is a parameterless slot in the checkpoint naming (`ff.net.2` is the down-projection).
        self.net = nn.ModuleList([_UpProjection(hidden_size, ffn_dim), nn.Identity(),
                                  nn.Linear(ffn_dim, hidden_size, bias=False)])
        # value * silu(gate) of the fused up-projection; kernels/ swaps in a fused version.
        self.activation: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def wrap(cls, ff: "SwiGLU") -> "SwiGLU":
        """An instance of this (sub)class over `ff`'s own linears: kernels/ swap in variants whose activation
        leaves in a quantized format for the down-projection."""
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        obj.net, obj.activation = ff.net, None
        return obj

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        up = self.net[0].proj(x)
        if self.activation is not None:
            return self.net[2](self.activation(up))
        value, gate = up.chunk(2, dim=-1)
        return self.net[2](value * F.silu(gate))

    @staticmethod
    def _tokens(x, start: int, end: int):
        """Tokens start:end of every batch row (a quantized activation type overrides this)."""
        return x[:, start:end]

    def forward(self, x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        """`chunks` > 1 runs the rows in pieces: the (S, 2F) intermediate is the FFN's memory peak."""
        if chunks <= 1 or x.shape[1] < 2:
            return self._rows(x)
        if not isinstance(x, torch.Tensor) and type(self)._tokens is SwiGLU._tokens:
            # A quantized activation (the NVFP4 norm fusion's) whose MLP knows no way to cut its rows.
            raise InputError(f"the MLP input is a {type(x).__name__}, which cannot be split into row chunks: run "
                             "with mlp_chunks 1, or set H3_RMS_ADALN_NVFP4_FUSION=off")
        out = None
        for piece in torch.arange(x.shape[1]).tensor_split(chunks):
            if piece.numel():
                s, e = int(piece[0]), int(piece[-1]) + 1
                y = self._rows(self._tokens(x, s, e))
                if out is None:
                    out = y.new_empty(x.shape[0], x.shape[1], y.shape[-1])
                out[:, s:e] = y
        return out


class RowModulation:
    """Applies AdaLN vectors to the rows that read them, per row (gather) or per contiguous segment."""

    def __init__(self, rows: torch.Tensor, use_segments: bool):
        self.rows = rows
        self.segs = segments(rows) if use_segments else None

    def norm_modulate(self, norm: nn.RMSNorm, x: torch.Tensor, shift: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
        """RMSNorm then shift/scale; a fused kernel overrides this pair as one."""
        return self.modulate(norm(x), shift, scale)

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.segs is None:
            return x * (1.0 + scale.index_select(0, self.rows)) + shift.index_select(0, self.rows)
        out = torch.empty_like(x)
        for s, e, r in self.segs:
            out[:, s:e] = x[:, s:e] * (1.0 + scale[r]) + shift[r]
        return out

    def add_norm_modulate(self, residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, norm: nn.RMSNorm,
                          shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + gate * y, norm_modulate of that sum); a fused kernel reads the new residual only once."""
        x = self.gated_add(residual, gate, y)
        return x, self.norm_modulate(norm, x, shift, scale)

    def gated_add(self, residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.segs is None:
            return residual + gate.index_select(0, self.rows) * y
        out = torch.empty_like(residual)
        for s, e, r in self.segs:
            out[:, s:e] = residual[:, s:e] + gate[r] * y[:, s:e]
        return out
