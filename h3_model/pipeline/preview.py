"""Live previews of a sampling run: a small picture of what the clip is becoming, from its latents alone.

No decoder is needed: the middle latent frame's channels are projected onto their three principal components
(computed on that frame), each stretched to its 2nd..98th percentile. That shows layout, motion and contrast
as they form, in false colour; it is a view of the latent, not the clip's colours. Cheap enough for every
step (one 24x24 eigen-decomposition on the CPU).
"""

from __future__ import annotations

import torch

from ..dit.layout import unpatchify


def latent_frames(rows: torch.Tensor, channels: int, frames: int, height: int, width: int,
                  patch: tuple[int, int, int]) -> torch.Tensor:
    """Packed video rows -> (C, T, H, W) latents."""
    return unpatchify(rows.detach().float().cpu(), channels, frames, height, width, patch)[0]


def preview_image(latents: torch.Tensor, max_size: int = 512) -> torch.Tensor:
    """(C, T, H, W) latents -> uint8 (h, w, 3) picture of the middle frame, upscaled to about `max_size`."""
    if latents.ndim != 4 or latents.shape[0] < 3:
        raise ValueError(f"a preview needs (C >= 3, T, H, W) latents, got {list(latents.shape)}")
    frame = latents[:, latents.shape[1] // 2].float()  # (C, H, W)
    c, h, w = frame.shape
    pixels = frame.reshape(c, -1).T  # (H*W, C)
    centred = pixels - pixels.mean(0, keepdim=True)
    _, vectors = torch.linalg.eigh(centred.T @ centred)
    projected = centred @ vectors[:, -3:].flip(-1)  # the three strongest directions
    low, high = torch.quantile(projected, 0.02, dim=0), torch.quantile(projected, 0.98, dim=0)
    scaled = ((projected - low) / (high - low).clamp_min(1e-6)).clamp(0, 1)
    image = (scaled.T.reshape(3, h, w) * 255).round().to(torch.uint8)
    factor = max(1, max_size // max(h, w))
    image = image.repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    return image.permute(1, 2, 0).contiguous()
