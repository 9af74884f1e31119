"""A bank of output heads the sampler mixes per step (PDD's per-interval heads), beside the DiT's own two heads.

A PDD distillation trains one video and one audio head per interval of a fine noise grid; a sampling step
uses the mean of the heads its interval spans, weighted by how much of the step each covers. Which heads, and
with what weights, is a per-step input of the forward (`HeadMix`); the bank only mixes: a linear head is
linear in its weight and bias, so the head of the mixed weights gives the mixed outputs of the heads, with one
matmul per modality. The heads run after the sequence-parallel gather, on whole rows, as the plain heads do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import H3Error


@dataclass(frozen=True)
class HeadMix:
    """One step's weight per bank head, video and audio (each the length of the bank; zeros for heads the
    step does not span)."""

    video: tuple[float, ...]
    audio: tuple[float, ...]


class MixedHead:
    """One fp32 head made from the bank for one step: called like the nn.Linear it stands in for."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class HeadBank(nn.Module):
    """`count` video heads ([count, video_patch_dim, hidden] + [count, video_patch_dim]) and as many audio heads,
    held in fp32 as the DiT's own heads are. Buffers, not parameters: no LoRA or kernel plan touches them, and
    they move with the model. `origin` names the file they came from, for messages."""

    def __init__(self, video_weight: torch.Tensor, video_bias: torch.Tensor, audio_weight: torch.Tensor,
                 audio_bias: torch.Tensor, origin: str = ""):
        super().__init__()
        self.register_buffer("video_weight", video_weight.float(), persistent=False)
        self.register_buffer("video_bias", video_bias.float(), persistent=False)
        self.register_buffer("audio_weight", audio_weight.float(), persistent=False)
        self.register_buffer("audio_bias", audio_bias.float(), persistent=False)
        self.origin = origin

    @property
    def count(self) -> int:
        return int(self.video_weight.shape[0])

    def mixed(self, mix: HeadMix) -> tuple[MixedHead, MixedHead]:
        """The video and audio heads of one step."""
        return (self._mix(mix.video, self.video_weight, self.video_bias),
                self._mix(mix.audio, self.audio_weight, self.audio_bias))

    def _mix(self, weights: tuple[float, ...], bank: torch.Tensor, bias: torch.Tensor) -> MixedHead:
        if len(weights) != bank.shape[0]:
            raise H3Error(f"a head mix of {len(weights)} weights for a bank of {bank.shape[0]} heads")
        w = torch.tensor(weights, dtype=torch.float32, device=bank.device)
        used = w.nonzero().flatten()  # a step spans a few heads of the bank: mix only those
        w = w.index_select(0, used)
        return MixedHead(torch.einsum("n,noi->oi", w, bank.index_select(0, used)),
                         torch.einsum("n,no->o", w, bias.index_select(0, used)))
