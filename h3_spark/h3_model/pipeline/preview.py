"""Live previews of a sampling run: a small picture of what the clip is becoming, from its latents alone.

No decoder is needed: the middle latent frame's channels are projected onto their three principal components
(computed on that frame), each stretched to its 2nd..98th percentile. That shows layout, motion and contrast
as they form, in false colour; it is a view of the latent, not the clip's colours. Cheap enough for every
step (one 24x24 eigen-decomposition on the CPU). `decoded_preview` and `decoded_strip` show real pictures instead
when a tiny decoder for H3 latents (TAEH3) is at hand: each frame from the few latent frames up to it, not the clip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dit.layout import unpatchify

# Latent frames a decoded preview frame is made from: its own and the two before it (the memory blocks' past).
DECODE_WINDOW = 3


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
    picks = strip_picks(t, frames)
    tiles = []
    for i in picks:
        part = (latents[:, i].float().reshape(c, -1).T - mean) @ basis
        scaled = ((part - low) / (high - low).clamp_min(1e-6)).clamp(0, 1)
        tiles.append((scaled.T.reshape(3, h, w) * 255).round().to(torch.uint8))
    image = torch.cat(tiles, dim=2)
    factor = strip_factor(h, w, len(picks), max_size)
    image = image.repeat_interleave(factor, 1).repeat_interleave(factor, 2)
    return image.permute(1, 2, 0).contiguous()


def strip_picks(latent_frames: int, frames: int) -> list[int]:
    """The latent frames a strip of `frames` shows: the middle one alone, or `frames` spread over the clip."""
    if frames <= 1:
        return [latent_frames // 2]
    return torch.linspace(0, latent_frames - 1, min(frames, latent_frames)).round().long().tolist()


def strip_factor(height: int, width: int, tiles: int, max_size: int) -> int:
    """The whole-number upscale of a strip of `tiles` latent-sized tiles side by side to about `max_size`."""
    return max(1, max_size // max(height, tiles * width))


def decoded_frame(decoder, latents: torch.Tensor, index: int) -> torch.Tensor:
    """(C, T, H, W) latents -> (3, 16H, 16W) float in [0, 1] on the decoder's device: the last picture a tiny video
    decoder (vae/tiny_decoder.py) grows from latent frame `index`, decoded from the DECODE_WINDOW latent frames
    up to it one at a time (its memory blocks carried), so the activations are one latent frame's."""
    parameter = next(decoder.parameters())
    memory: dict = {}
    for t in range(max(0, index - DECODE_WINDOW + 1), index + 1):
        frames = decoder.decode_chunk(latents[:, t:t + 1].permute(1, 0, 2, 3).to(parameter.device, parameter.dtype),
                                      memory)
    return frames[-1].float()


def decoded_preview(decoder, latents: torch.Tensor) -> torch.Tensor:
    """(C, T, H, W) latents -> uint8 (h, w, 3): the middle frame as a tiny video decoder makes it."""
    frame = decoded_frame(decoder, latents, latents.shape[1] // 2)
    return (frame.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu()


def decoded_strip(decoder, latents: torch.Tensor, max_size: int = 512, frames: int = 1) -> torch.Tensor:
    """(C, T, H, W) latents -> uint8 (h, w, 3): `preview_image`'s strip (the same frames, layout and size), each
    frame the picture a tiny video decoder makes of it (`decoded_frame`), resized to the strip's tile."""
    c, t, h, w = latents.shape
    picks = strip_picks(t, frames)
    factor = strip_factor(h, w, len(picks), max_size)
    tiles = []
    for i in picks:
        picture = decoded_frame(decoder, latents, i)[None]
        tiles.append(F.interpolate(picture, size=(h * factor, w * factor), mode="bilinear", antialias=True,
                                   align_corners=False)[0])
    image = (torch.cat(tiles, dim=2).clamp(0, 1) * 255).round().to(torch.uint8)
    return image.permute(1, 2, 0).contiguous().cpu()


def png_bytes(image: torch.Tensor) -> bytes:
    """uint8 (h, w, 3) -> PNG file bytes."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()
