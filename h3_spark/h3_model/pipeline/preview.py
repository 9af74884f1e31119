"""Live previews of a sampling run: a small picture of what the clip is becoming, from its latents alone.

No decoder is needed: the middle latent frame's channels are projected onto their three principal components
(computed on that frame), each stretched to its 2nd..98th percentile. That shows layout, motion and contrast
as they form, in false colour; it is a view of the latent, not the clip's colours. Cheap enough for every
step (one 24x24 eigen-decomposition on the CPU). `decoded_preview` shows a real picture instead when a tiny
decoder for H3 latents is at hand.
"""

from __future__ import annotations

import torch

from ..dit.layout import unpatchify


def latent_frames(rows: torch.Tensor, channels: int, frames: int, height: int, width: int,
                  patch: tuple[int, int, int]) -> torch.Tensor:
    """Packed video rows -> (C, T, H, W) latents."""
    return unpatchify(rows.detach().float().cpu(), channels, frames, height, width, patch)[0]


def preview_image(latents: torch.Tensor, max_size: int = 512, frames: int = 1) -> torch.Tensor:
    """(C, T, H, W) latents -> uint8 (h, w, 3): the middle latent frame, or a strip of `frames` frames spread
    over the clip (one projection for all, so colours compare), upscaled to about `max_size` wide."""
    if latents.ndim != 4 or latents.shape[0] < 3:
        raise ValueError(f"a preview needs (C >= 3, T, H, W) latents, got {list(latents.shape)}")
    c, t, h, w = latents.shape
    frame = latents[:, t // 2].float()
    pixels = frame.reshape(c, -1).T  # (H*W, C)
    mean = pixels.mean(0, keepdim=True)
    _, vectors = torch.linalg.eigh((pixels - mean).T @ (pixels - mean))
    basis = vectors[:, -3:].flip(-1)  # the three strongest directions
    projected = (pixels - mean) @ basis
    low, high = torch.quantile(projected, 0.02, dim=0), torch.quantile(projected, 0.98, dim=0)
    picks = [t // 2] if frames <= 1 else torch.linspace(0, t - 1, min(frames, t)).round().long().tolist()
    tiles = []
    for i in picks:
        part = (latents[:, i].float().reshape(c, -1).T - mean) @ basis
        scaled = ((part - low) / (high - low).clamp_min(1e-6)).clamp(0, 1)
        tiles.append((scaled.T.reshape(3, h, w) * 255).round().to(torch.uint8))
    image = torch.cat(tiles, dim=2)
    factor = max(1, max_size // max(image.shape[1], image.shape[2]))
    image = image.repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    return image.permute(1, 2, 0).contiguous()


def decoded_preview(decoder, latents: torch.Tensor) -> torch.Tensor:
    """(C, T, H, W) latents -> uint8 (h, w, 3): the middle frame as a tiny video decoder (vae/tiny_decoder.py)
    makes it, from the three latent frames up to it (its memory blocks need the past)."""
    middle = latents.shape[1] // 2
    window = latents[:, max(0, middle - 2):middle + 1].permute(1, 0, 2, 3)  # (T, C, H, W)
    parameter = next(decoder.parameters())
    frames = decoder(window.to(parameter.device, parameter.dtype))
    return (frames[-1].float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu()


def png_bytes(image: torch.Tensor) -> bytes:
    """uint8 (h, w, 3) -> PNG file bytes."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()
