"""A tiny decoder for H3 video latents, for live previews: the TAEHV design (madebyollin/taehv), read from a
`taeh3.safetensors` file (Kijai/MiniMax-H3-TAE publishes one; ComfyUI keeps it in models/vae_approx).

The decoder is a plain stack, stored as `decoder.<index>...`:
    0 clamp (3 tanh(x/3)), 1 conv latent->256, 2 ReLU,
    3-5 memory blocks (256), 6 upsample x2, 7 time grow (x1), 8 conv 256->128,
    9-11 memory blocks (128), 12 upsample x2, 13 time grow (x2), 14 conv 128->64,
    15-17 memory blocks (64), 18 upsample x2, 19 time grow (x2), 20 conv 64->64,
    21 ReLU, 22 conv 64 -> 3 x 2 x 2, then a 2x2 pixel shuffle.
So one latent cell becomes 16x16 pixels and one latent frame four frames; the first three outputs are the
causal start-up and are dropped. A memory block sees its input and the previous frame's input (zeros before
the first). Only the decoder is read; an encoder in the file is ignored.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError

WIDTHS = (256, 128, 64, 64)
PATCH = 2


def _conv(n_in: int, n_out: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


class Clamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    """Residual convs over [this frame, the previous frame's input]."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * width, width), nn.ReLU(), _conv(width, width), nn.ReLU(),
                                  _conv(width, width))

    def forward(self, x, past):
        return F.relu(self.conv(torch.cat([x, past], 1)) + x)


class TimeGrow(nn.Module):
    """Each frame becomes `stride` frames through a 1x1 conv to stride x width channels."""

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(width, width * stride, 1, bias=False)

    def forward(self, x):
        t, c, h, w = x.shape
        return self.conv(x).reshape(t * self.stride, c, h, w)


class TinyVideoDecoder(nn.Module):
    def __init__(self, latent_channels: int = 24):
        super().__init__()
        a, b, c, d = WIDTHS
        self.latent_channels = latent_channels
        self.decoder = nn.Sequential(
            Clamp(), _conv(latent_channels, a), nn.ReLU(),
            MemoryBlock(a), MemoryBlock(a), MemoryBlock(a), nn.Upsample(scale_factor=2), TimeGrow(a, 1),
            _conv(a, b, bias=False),
            MemoryBlock(b), MemoryBlock(b), MemoryBlock(b), nn.Upsample(scale_factor=2), TimeGrow(b, 2),
            _conv(b, c, bias=False),
            MemoryBlock(c), MemoryBlock(c), MemoryBlock(c), nn.Upsample(scale_factor=2), TimeGrow(c, 2),
            _conv(c, d, bias=False),
            nn.ReLU(), _conv(d, 3 * PATCH * PATCH))
        self.time_upscale = 4
        self.startup_frames = self.time_upscale - 1

    @torch.no_grad()
    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """(T, C, H, W) latents -> (4T - 3, 3, 16H, 16W) frames in [0, 1], all frames at once."""
        x = latents
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                past = torch.cat([torch.zeros_like(x[:1]), x[:-1]])  # the previous frame's input, zeros first
                x = layer(x, past)
            else:
                x = layer(x)
        return F.pixel_shuffle(x, PATCH).clamp(0, 1)[self.startup_frames:]


def load_tiny_decoder(path: str | Path, device="cpu", dtype=torch.float32) -> TinyVideoDecoder:
    """The decoder of a taeh3.safetensors file (safetensors only)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path.name}: the tiny preview decoder is read from .safetensors only")
    tensors = load_file(str(path))
    decoder = {k.split("decoder.", 1)[1]: v for k, v in tensors.items() if "decoder." in k}
    if "1.weight" not in decoder:
        raise CheckpointError(f"{path.name} holds no TAEHV decoder (no decoder.1.weight)")
    model = TinyVideoDecoder(latent_channels=int(decoder["1.weight"].shape[1]))
    expected = model.decoder.state_dict()
    for key, value in list(decoder.items()):
        if key in expected and value.shape != expected[key].shape and key.endswith("conv.weight") \
                and value.shape[1:] == expected[key].shape[1:] and value.shape[0] > expected[key].shape[0]:
            # A time-grow layer trained to make more frames than this decoder asks of it: keep the outputs of
            # its last frame (how the TAEHV files are meant to be read with less time upscaling).
            decoder[key] = value[-expected[key].shape[0]:]
    missing = sorted(set(expected) - set(decoder))
    unexpected = sorted(set(decoder) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path.name} is not an H3 TAEHV decoder: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    try:
        model.decoder.load_state_dict(decoder)
    except RuntimeError as exc:
        raise CheckpointError(f"{path.name}: {str(exc).splitlines()[0]}") from None
    return model.to(device=device, dtype=dtype).eval()
