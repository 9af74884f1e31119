"""TAEH3, the tiny temporal decoder for H3 video latents (the TAEHV design): live previews and whole-clip drafts.

The weights are madebyollin/taehv's `safetensors/taeh3.safetensors` (MIT; 128 tensors, fp16: the decoder below
and an encoder, which is ignored here). ComfyUI keeps it in models/vae_approx. Kijai/MiniMax-H3-TAE publishes a
different file under the same name, a 2D decoder that makes each latent frame's picture alone: it has no memory
blocks and no time growth, cannot decode the clip in time, and is refused in one line (`load_tiny_decoder`).

The decoder is a plain stack, stored as `decoder.<index>...`:
    0 clamp (3 tanh(x/3)), 1 conv latent->256, 2 ReLU,
    3-5 memory blocks (256), 6 upsample x2, 7 time grow (x1), 8 conv 256->128,
    9-11 memory blocks (128), 12 upsample x2, 13 time grow (x2), 14 conv 128->64,
    15-17 memory blocks (64), 18 upsample x2, 19 time grow (x2), 20 conv 64->64,
    21 ReLU, 22 conv 64 -> 3 x 2 x 2, then a 2x2 pixel shuffle.
So one latent cell becomes 16x16 pixels and one latent frame four frames; the first three outputs are the
causal start-up and are dropped. A memory block sees its input and the previous frame's input (zeros before
the first). It reads the normalized latents the sampler makes (not the VAE's denormalized ones).

A whole clip (`decode_draft`) comes out as the full VAE's: H3's encoder makes 5 latents of each 17-frame clip,
the first of them for one frame and the others for four (the stream keeps 5n + 2 latents for 17n + 5 frames),
so of the four frames TAEH3 grows from a clip's first latent only the last is kept, as the start-up trim does for
the very first. That reading of the layout is ours (the frame counts agree with the VAE's for every length the
pipeline makes; `decode_draft` checks them against it).

Memory. The widest tensors are the last stage's, at half the output size (H/2 x W/2, before the pixel shuffle):
the stage-3 time grow makes 4 frames x 64 channels of each latent frame and the 64 -> 64 conv reads them into as
many, so that conv holds 2 x 4 x 64 x (H/2)(W/2) = 128 H W values per latent frame (every earlier layer holds
less). At 1344x768 that is 132 M values, 264 MB in fp16 (528 MB in fp32), a latent frame: the whole-clip pass of
37 latents (124 frames) needs 9.8 GB of it and of 87 latents (345 frames) 23 GB, while `decode_draft`'s default
chunk of 8 latent frames stays at 2.1 GB (4.2 GB fp32) for any length, plus the convolutions' copies and
workspace and the uint8 frames on the host. Measured on the CPU (fp32, 12 latents at 256x256, the growth of the
process's peak RSS): 651 MB at once, 507 / 143 / 89 MB in chunks of 8 / 2 / 1, against 403 / 268 / 67 / 34 MB
counted. Peak memory grows with the picture's area only through that figure, so there is no spatial tiling: at
1344x768 a chunk's peak is a few GB, and `chunk=1` (264 MB in fp16 by the count) is the floor.

Chunked and whole passes do the same convolutions over different numbers of frames. On the CPU in fp32 they give
the same bits whenever each chunk holds at least two latent frames; a one-frame chunk takes another convolution
kernel for the small early layers, whose sums round differently (within 1e-5 of a [0, 1] pixel, one uint8 level
at most). On a GPU the convolution algorithm may also change with the frame count: the same rounding caveat.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError, InputError

WIDTHS = (256, 128, 64, 64)
PATCH = 2
# Latent frames a draft decodes at a time: activations of about 2.1 GB in fp16 at 1344x768 (the module notes).
DRAFT_CHUNK = 8


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
        return self.decode_chunk(latents, {})[self.startup_frames:]

    @torch.no_grad()
    def decode_chunk(self, latents: torch.Tensor, memory: dict[int, torch.Tensor]) -> torch.Tensor:
        """The next (T, C, H, W) latents of a clip -> their 4T frames in [0, 1], the start-up not trimmed.

        `memory` holds, per memory block (its index in the stack), the last input frame it saw; `{}` at the
        clip's start (zeros come before the first frame), and updated here for the next chunk. The network is
        causal in time, so chunks of any size carrying it make the frames of one pass over the whole clip (up to
        the convolutions' rounding, see the module notes)."""
        x = latents
        for index, layer in enumerate(self.decoder):
            if isinstance(layer, MemoryBlock):
                before = memory.get(index)
                past = torch.cat([torch.zeros_like(x[:1]) if before is None else before, x[:-1]])
                memory[index] = x[-1:].clone()  # a copy: a view would keep the whole chunk's input alive
                x = layer(x, past)
            else:
                x = layer(x)
        return F.pixel_shuffle(x, PATCH).clamp(0, 1)


# Where the temporal design shows in the file: a memory block's first conv reads [this frame, the previous one],
# and the time-grow convs of stages 2 and 3 make two frames' channels from one.
_MEMORY_CONV = "3.conv.0.weight"
_TIME_GROWS = ("13.conv.weight", "19.conv.weight")


def _check_temporal(path: Path, decoder: dict) -> None:
    """A 2D per-frame decoder (Kijai's taeh3, TAESD-style) is refused before anything is loaded."""
    why = None
    conv = decoder.get(_MEMORY_CONV)
    if conv is None or conv.ndim != 4 or conv.shape[1] != 2 * conv.shape[0]:
        got = "absent" if conv is None else str(list(conv.shape))
        why = f"decoder.{_MEMORY_CONV} is {got}, a memory block's first conv is [N, 2N, 3, 3] (this frame and the last)"
    for key in _TIME_GROWS:
        grow = decoder.get(key)
        if why is None and (grow is None or grow.ndim != 4 or grow.shape[0] < 2 * grow.shape[1]):
            got = "absent" if grow is None else str(list(grow.shape))
            why = f"decoder.{key} is {got}, a time-grow conv makes two frames' channels [2N, N, 1, 1]"
    if why is not None:
        raise CheckpointError(f"{path}: not the temporal TAEH3 decoder (madebyollin/taehv's taeh3.safetensors): "
                              f"{why}; a per-frame 2D decoder cannot decode the clip in time")


def load_tiny_decoder(path: str | Path, device="cpu", dtype=torch.float32) -> TinyVideoDecoder:
    """The decoder of a taeh3.safetensors file (safetensors only), checked to be the temporal one."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{path.name}: the tiny preview decoder is read from .safetensors only")
    tensors = load_file(str(path))
    decoder = {k.split("decoder.", 1)[1]: v for k, v in tensors.items() if "decoder." in k}
    if "1.weight" not in decoder:
        raise CheckpointError(f"{path.name} holds no TAEHV decoder (no decoder.1.weight)")
    _check_temporal(path, decoder)
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
    model.source = path  # what a report names it by
    return model.to(device=device, dtype=dtype).eval()


# ------------------------------------------------------------------------------------------ whole clips
def clip_openings(num_latents: int, chunk: int, drop: int) -> list[int]:
    """The latent frames that open one of the encoder's clips (each stands for a single frame): the first, and
    every `chunk`-th after the `chunk - drop` latents the stream keeps of its first clip."""
    return [t for t in range(num_latents) if t == 0 or (t + drop) % chunk == 0]


def draft_frame_count(num_latents: int, vae_config) -> int:
    """Frames `decode_draft` makes of `num_latents` latents for a VAE of this config."""
    openings = clip_openings(num_latents, vae_config.tokens_chunk_size, vae_config.token_drop)
    return num_latents * vae_config.temporal_ratio - (vae_config.temporal_ratio - 1) * len(openings)


def _kept_frames(start: int, stop: int, openings: set[int], ratio: int) -> list[int]:
    """Of the `ratio` frames each latent in [start, stop) grows, the ones a draft keeps (indices into the chunk's
    frames): all of them, or only the last for a clip-opening latent (latent 0's being the causal start-up)."""
    return [(t - start) * ratio + k for t in range(start, stop)
            for k in (range(ratio - 1, ratio) if t in openings else range(ratio))]


@torch.no_grad()
def decode_draft(latents: torch.Tensor, decoder: TinyVideoDecoder, vae_config, chunk: int | None = DRAFT_CHUNK,
                 on_frames: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Normalized video latents (1, C, T, h, w), as the sampler makes them -> uint8 frames (F, H, W, 3) on the CPU,
    F, H and W those of the full VAE (`vae_config`) for the same latents: the whole clip through TAEH3, for drafts
    and thumbnails.

    `chunk` latent frames go through the decoder at a time, each memory block carrying the last input frame it
    saw into the next chunk: the frames of the whole-clip pass (the same convolutions over fewer frames; see
    the module notes for what that changes in the last bit), with activation memory bounded by the chunk, not the
    clip (about 128 x H x W values a latent frame, 2.1 GB for 8 in fp16 at 1344x768). `None` sends every frame
    through each layer at once (memory grows with the clip). `on_frames` gets each chunk's finished frames,
    (n, H, W, 3) uint8 in order, as soon as they are made (views of the returned buffer, not written again)."""
    from .video_tiling import decoded_num_frames

    if latents.ndim != 5 or latents.shape[0] != 1:
        raise InputError(f"decode_draft takes latents (1, C, T, h, w), got {list(latents.shape)}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise InputError(f"decode_draft chunk must be a whole number of latent frames, 1 or more (or None for the "
                         f"whole clip at once), got {chunk!r}")
    _, c, t, h, w = latents.shape
    if c != decoder.latent_channels:
        raise InputError(f"the latents have {c} channels, the TAEH3 decoder reads {decoder.latent_channels}")
    scale = 2 ** 3 * PATCH
    if vae_config.spatial_ratio != scale or vae_config.temporal_ratio != decoder.time_upscale:
        raise InputError(f"TAEH3 makes {scale}x space and {decoder.time_upscale}x time, the video VAE "
                         f"{vae_config.spatial_ratio}x and {vae_config.temporal_ratio}x: no draft of the same frames")
    frames = draft_frame_count(t, vae_config)
    if frames != decoded_num_frames(vae_config, t):
        raise InputError(f"{t} latent frames: TAEH3 would make {frames} frames, the video VAE "
                         f"{decoded_num_frames(vae_config, t)}; drafts take the lengths the pipeline makes (5n + 2)")
    parameter = next(decoder.parameters())
    openings = set(clip_openings(t, vae_config.tokens_chunk_size, vae_config.token_drop))
    out = torch.empty((frames, h * scale, w * scale, 3), dtype=torch.uint8)
    step = t if chunk is None else chunk
    memory: dict[int, torch.Tensor] = {}
    written = 0
    for start in range(0, t, step):
        stop = min(t, start + step)
        pictures = decoder.decode_chunk(latents[0, :, start:stop].transpose(0, 1).to(parameter.device,
                                                                                      parameter.dtype), memory)
        keep = _kept_frames(start, stop, openings, decoder.time_upscale)
        if len(keep) < pictures.shape[0]:
            pictures = pictures[torch.tensor(keep, device=pictures.device)]
        n = len(keep)
        scaled = pictures.float().clamp_(0, 1).mul_(255).round_()  # in place: one fp32 copy of the chunk's frames
        out[written:written + n] = scaled.to(torch.uint8).permute(0, 2, 3, 1)
        del pictures, scaled  # the chunk's frames on the device go before the next chunk's are made
        if on_frames is not None:
            on_frames(out[written:written + n])
        written += n
    return out
