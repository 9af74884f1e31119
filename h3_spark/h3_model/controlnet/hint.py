"""The ControlNet's hint: what a request controls with, fitted to the canvas and encoded to the latent grid.

The pose, depth, edge (Canny, HED, MLSD), scribble, layout or gray pictures are the user's own, made by their own
preprocessor (ComfyUI nodes, files); nothing here detects anything. A request gives:
- a control video (any length, any size): its frames are taken by index clamped to the clip's count, so a longer
  one is cut and a shorter one holds its last frame, each frame cover-cropped to the canvas, then VAE-encoded like
  a reference (24 channels);
- optionally an inpaint mask (1 = make anew; an image for every frame or a video, the size of the source video)
  and the source video behind it: the source with the masked pixels blanked (black for v1, the VAE's zero, the
  ImageNet mean colour, for Union 2.0) is encoded (24 channels), and what stays visible is pooled to the latent
  grid by trilinear interpolation (1 channel).
The hint is [control (24) | visibility (1) | masked source (24)], zero where a part is absent, patchified 2x2 into
the target video rows' order: (rows, 196) fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..dit.layout import patchify
from .tower import HINT_CHANNELS, LATENT_CHANNELS, check_window

# The VAE's zero: ImageNet's mean colour, the nearest uint8 (Union 2.0 fills its inpaint holes there).
MID_GRAY = (124, 116, 104)


@dataclass
class ControlRequest:
    """A request's control. `video`: uint8 (F, H, W, 3) control frames, None for inpainting alone; `mask`: float
    or bool (F, H, W) or (H, W), 1 (or above 0.5) where to make anew; `source`: uint8 (F, H, W, 3), the video behind
    the mask (None: black); `strength` in [0, 10]; `start` / `end`: the window, fractions of the schedule."""

    video: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    source: torch.Tensor | None = None
    strength: float = 1.0
    start: float = 0.0
    end: float = 1.0

    def validate(self) -> None:
        check_window(self.start, self.end, self.strength)
        if self.video is None and self.mask is None:
            raise InputError("a control needs a control video, an inpaint mask, or both")
        for name, frames in (("control video", self.video), ("inpaint source", self.source)):
            if frames is not None and (not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8
                                       or frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape[:3]) < 1):
                got = f"{getattr(frames, 'dtype', type(frames).__name__)} {list(getattr(frames, 'shape', []))}"
                raise InputError(f"the {name} must be uint8 (F, H, W, 3) frames, got {got}")
        if self.source is not None and self.mask is None:
            raise InputError("an inpaint source goes with an inpaint mask (--inpaint-mask)")
        if self.mask is not None:
            mask = self.mask
            if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 3) or min(mask.shape) < 1:
                raise InputError(f"the inpaint mask must be (H, W) or (F, H, W), got "
                                 f"{list(getattr(mask, 'shape', []))}")
            if self.source is not None and tuple(mask.shape[-2:]) != tuple(self.source.shape[1:3]):
                raise InputError(f"the inpaint mask is {mask.shape[-1]}x{mask.shape[-2]} but its source video is "
                                 f"{self.source.shape[2]}x{self.source.shape[1]}: they must be the same size")

    def check_canvas(self, width: int, height: int) -> None:
        """A mask without a source marks the canvas itself, so it must be the canvas's size."""
        if self.mask is not None and self.source is None and tuple(self.mask.shape[-2:]) != (height, width):
            raise InputError(f"the inpaint mask is {self.mask.shape[-1]}x{self.mask.shape[-2]} but the canvas is "
                             f"{width}x{height}: without a source video the mask marks the canvas")


def clamp_frames(count: int, available: int) -> torch.Tensor:
    """Frame indices 0..count-1, clamped to the clip: a longer clip is cut, a shorter one holds its last frame."""
    return torch.arange(count).clamp(max=available - 1)


def fit_frames(frames: torch.Tensor, count: int, width: int, height: int) -> torch.Tensor:
    """uint8 (count, height, width, 3): the clip's frames by clamped index, each cover-cropped to the canvas."""
    from ..media.refs import cover_crop

    picked = frames[clamp_frames(count, frames.shape[0])]
    if tuple(picked.shape[1:3]) == (height, width):
        return picked.contiguous()
    # One crop per distinct source frame (a held last frame is cropped once).
    cropped = {}
    out = torch.empty(count, height, width, 3, dtype=torch.uint8)
    for i, j in enumerate(clamp_frames(count, frames.shape[0]).tolist()):
        if j not in cropped:
            cropped[j] = cover_crop(frames[j], height, width)
        out[i] = cropped[j]
    return out


def fit_mask(mask: torch.Tensor, count: int, width: int, height: int) -> torch.Tensor:
    """float (count, height, width) of 0 / 1: the mask binarised at 0.5, frames clamped, cover-cropped (bilinear)."""
    mask = (torch.as_tensor(mask).float() > 0.5).float()
    if mask.ndim == 2:
        mask = mask[None]
    mask = mask[clamp_frames(count, mask.shape[0])]
    src_h, src_w = mask.shape[1:]
    scale = max(width / src_w, height / src_h)
    rw, rh = max(width, round(src_w * scale)), max(height, round(src_h * scale))
    if (rh, rw) != (src_h, src_w):
        mask = F.interpolate(mask[:, None], size=(rh, rw), mode="bilinear", align_corners=False)[:, 0]
    top, left = (rh - height) // 2, (rw - width) // 2
    return (mask[:, top:top + height, left:left + width] > 0.5).float()


def hint_latents(control: ControlRequest, encode: Callable[[torch.Tensor], torch.Tensor], frames: int, width: int,
                 height: int, latent_shape: tuple[int, int, int], *, post_norm_fill: bool,
                 latent_channels: int = LATENT_CHANNELS, hint_channels: int = HINT_CHANNELS) -> torch.Tensor:
    """The hint (1, 49, T, h, w) fp32; `encode` turns uint8 (F, H, W, 3) frames into normalised latents
    (1, 24, T, h, w) on the latent grid `latent_shape` (T, h, w). A VAE of fewer channels (the tiny demo's) gives
    [control | visibility | masked source] zero-padded to the 49 channels, as a control-only hint is."""
    if 2 * latent_channels + 1 > hint_channels:
        raise InputError(f"a {latent_channels}-channel VAE's hint does not fit the ControlNet's {hint_channels} "
                         "channels")
    parts = []
    expect = (1, latent_channels, *latent_shape)

    def encoded(pixels: torch.Tensor, what: str) -> torch.Tensor:
        latent = encode(pixels).float().cpu()
        if tuple(latent.shape) != expect:
            raise InputError(f"the {what} encodes to {list(latent.shape)}, the target's latents are {list(expect)}")
        return latent

    zeros = torch.zeros(expect)
    parts.append(zeros if control.video is None else encoded(fit_frames(control.video, frames, width, height),
                                                             "control video"))
    if control.mask is None:
        parts += [torch.zeros(1, 1, *latent_shape), zeros]
    else:
        hole = fit_mask(control.mask, frames, width, height)
        visible = 1.0 - hole
        source = (torch.zeros(frames, height, width, 3, dtype=torch.uint8) if control.source is None
                  else fit_frames(control.source, frames, width, height))
        fill = torch.tensor(MID_GRAY if post_norm_fill else (0, 0, 0), dtype=torch.uint8)
        masked = torch.where(hole[..., None] > 0, fill, source)
        parts.append(F.interpolate(visible[None, None], size=latent_shape, mode="trilinear", align_corners=False))
        parts.append(encoded(masked, "masked inpaint source"))
    hint = torch.cat(parts, dim=1)
    return F.pad(hint, (0, 0, 0, 0, 0, 0, 0, hint_channels - hint.shape[1]))


def hint_rows(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(1, 49, T, h, w) -> (T * h/2 * w/2, 196) in the target video rows' order."""
    return patchify(latents.float(), patch)
