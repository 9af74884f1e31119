"""The H3 video VAE: a causal 3-D CNN encoder and a non-causal ViT decoder.

Conventions (the released model's, as in diffusers' `AutoencoderKLMiniMaxH3`):

- Pixels are ImageNet-normalised RGB over a [0, 1] base: `(x / 255 - mean) / std` with mean
  (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225). `decode` returns that same space;
  `decode_to_buffer` reverts it, clamps to [0, 1] and stores uint8 or fp16 frames.
- Latents have `latent_channels` (24) channels. The DiT works on *normalised* latents,
  `(z - latents_mean) / latents_std`; `encode`/`decode` work on raw ones. `normalize_latents` and
  `denormalize_latents` convert between the two.
- Time: `clip_length` (17) pixel frames are encoded at a time into 5 latent frames, and
  `token_drop` (3) trailing latent frames are dropped once, so 17n+5 frames give 5n+2 latent
  frames. A single frame gives one latent frame through the exact 2-D shortcut (see `encode`).
  Decoding runs 7-latent-frame windows every 5 latent frames, drops 3 leading pixel frames of
  each window and cross-fades 5 frames between windows, which inverts that geometry.
- Space: 16x. Tiling is on by default for encode and decode (256 px tiles, overlaps of at least
  64 px widened in 16 px steps round robin, linear blends), because the released frames are the
  tiled ones; untiled output differs.
- Precision: the encoder, the 1x1x1 convs, the decoder's input projection, register tokens,
  norms, residual scales and residual stream are always fp32. The decoder's attention/FFN
  linears and output projection run in the decode dtype: fp16 by default, fp32 for the exact
  path that matches the oracle.
- The module's state_dict keys are diffusers' keys, so a diffusers `vae/` folder loads as is.

Peak memory of a 124-frame 960x544 decode (37 latent frames, 34x60 latent grid, full config,
fp16 decode, uint8 output, 256 px tiles, all 15 tiles of a window in one decoder call, a
flash/memory-efficient attention kernel), computed by `decode_memory_estimate` (a test keeps these
figures equal to its output):

    weights (fp32 encoder + 1x1 convs, fp16 decoder)        5,569,131,744 B  (5.19 GiB)
    largest transient of one call (15 tiles of 1797 tokens,  2,560,782,336 B  (2.38 GiB)
      and the decoded tiles waiting to be stitched)
    window: fp32 canvas (22 kept frames), previous tail,      283,029,504 B  (0.26 GiB)
      stitching strips, uint8 chunk
    device peak                                             8,412,943,584 B  (7.84 GiB)
    host output buffer, uint8 (1, 124, 544, 960, 3)           194,273,280 B  (0.18 GiB)

Measured against that (random full-size weights, one H200, torch 2.11, 2026-11-29,
benchmarks/vae_decode_gpu.py): one tile per call peaked at 6,036,039,168 B allocated (computed
6,006,732,000) and took 3.45 s in fp16 (25.8 s in fp32); 15 tiles per call peaked at 7.98 GB
(computed 8.41) and took 3.17 s, the frames within one uint8 step of one tile per call;
encoding the same 124 frames took 7.6 s at 6.4 GB above the weights, and one 2048x3648 image
1.0 s through the 2-D shortcut against 1.45 s through the 3-D path.

The whole video exists only once, in the host buffer; nothing holds a full-video fp32 copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError, InputError
from ...kernels.attention import sdpa
from ...kernels.settings import DEFAULT_TILE_BATCH, check_tile_batch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DIFFUSERS_CLASS_NAME = "AutoencoderKLMiniMaxH3"
DEFAULT_TILE_SIZE = 256
DEFAULT_TILE_MIN_OVERLAP = 64
DECODE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_PAD_MODES = ("reflect", "replicate", "circular", "constant")


@dataclass(frozen=True)
class VideoVAEConfig:
    """Field names are those of diffusers' `vae/config.json`."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    spatial_padding_mode: str = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = (0.0,) * 24
    latents_std: tuple[float, ...] = (1.0,) * 24

    def __post_init__(self) -> None:
        for name in ("block_out_channels", "spatial_downsample_factors", "temporal_downsample_factors"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        for name in ("latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        problems = self._problems()
        if problems:
            raise CheckpointError("invalid video VAE config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        levels = len(self.block_out_channels)
        lengths = {levels, len(self.spatial_downsample_factors), len(self.temporal_downsample_factors)}
        if not levels or len(lengths) != 1:
            problems.append("block_out_channels, spatial_downsample_factors and temporal_downsample_factors "
                            "must be non-empty and of equal length")
        # Lengths are checked above; a mismatch must not stop the remaining checks.
        for s, t in zip(self.spatial_downsample_factors, self.temporal_downsample_factors):  # noqa: B905
            # A strided level without the spatial stride would shrink the frame by its unpadded
            # 3x3 kernel; the released geometry never does that, so neither do we.
            if s not in (1, 2) or t not in (1, 2) or (t == 2 and s == 1):
                problems.append(f"unsupported downsample level (spatial {s}, temporal {t})")
        for channels in self.block_out_channels:
            if channels % self.norm_num_groups:
                problems.append(f"channels {channels} not divisible by norm_num_groups {self.norm_num_groups}")
        if self.rope_dim <= 0 or self.rope_dim % 6:
            problems.append(f"rotary width int(decoder_attention_head_dim * decoder_rope_dim_ratio) = "
                            f"{self.rope_dim} must be a positive multiple of 6")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            problems.append(f"latents_mean/latents_std need {self.latent_channels} values, got "
                            f"{len(self.latents_mean)}/{len(self.latents_std)}")
        if any(s <= 0 for s in self.latents_std):
            problems.append("latents_std must be positive")
        if self.clip_length < 1 or not 0 <= self.token_drop < self.tokens_chunk_size:
            problems.append(f"clip_length {self.clip_length} / token_drop {self.token_drop} give no decodable chunk")
        if self.spatial_padding_mode not in _PAD_MODES:
            problems.append(f"spatial_padding_mode must be one of {', '.join(_PAD_MODES)}")
        return problems

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_num_attention_heads * self.decoder_attention_head_dim

    @property
    def rope_dim(self) -> int:
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    # The encoder's clips are not a multiple of the temporal ratio, so the decoder re-derives the
    # implicit leading pad and the overlap that token_drop leaves between clips.
    @property
    def frame_pre_padding(self) -> int:
        return (-self.clip_length) % self.temporal_ratio

    @property
    def tokens_chunk_size(self) -> int:
        return math.ceil(self.clip_length / self.temporal_ratio)

    @property
    def token_overlap(self) -> int:
        return (-self.token_drop) % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        return max(self.token_overlap * self.temporal_ratio - self.frame_pre_padding, 0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS_NAME}
        for key, value in dataclasses.asdict(self).items():
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VideoVAEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"invalid video VAE config: {exc}") from None


FULL = VideoVAEConfig()
# Spec section 6: the real temporal geometry (x4, clip 17, drop 3) at 4x spatial and a tiny width.
TINY = VideoVAEConfig(
    latent_channels=4,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 1),
    temporal_downsample_factors=(2, 2, 1),
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=8,
    decoder_num_register_tokens=2,
    decoder_ffn_mult=2,
    latents_mean=(0.0,) * 4,
    latents_std=(1.0,) * 4,
)
PRESETS: dict[str, VideoVAEConfig] = {"full": FULL, "tiny": TINY}


def preset(name: str) -> VideoVAEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise CheckpointError(f"unknown video VAE preset {name!r}; choose one of {', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------------------------
# Encoder. Every module accepts (B, C, T, H, W) and also (B, C, H, W) for one frame: with causal
# padding of kernel_t - 1 zero frames, only the last temporal tap of a kernel ever meets a lone
# frame, so a 2-D conv with that slice is exact and a third of the work.
# --------------------------------------------------------------------------------------------


class CausalConv3d(nn.Conv3d):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: Sequence[int] = (1, 1, 1),
                 spatial_padding: int = 0, pad_mode: str = "reflect") -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=tuple(stride), padding=0)
        self.spatial_padding = spatial_padding
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spatial_padding
        if x.ndim == 4:
            if p:
                x = F.pad(x, (p, p, p, p), mode=self.pad_mode)
            return F.conv2d(x, self.weight[:, :, -1], self.bias, stride=self.stride[1:])
        if p:
            x = F.pad(x, (p, p, p, p, 0, 0), mode=self.pad_mode)
        causal = self.kernel_size[0] - 1
        if causal:
            x = F.pad(x, (0, 0, 0, 0, causal, 0))
        return F.conv3d(x, self.weight, self.bias, stride=self.stride)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm whose statistics never mix frames: time is folded into the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 4:
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        b, c, t, h, w = x.shape
        folded = x.transpose(1, 2).reshape(b * t, c, h, w)
        folded = F.group_norm(folded, self.num_groups, self.weight, self.bias, self.eps)
        return folded.reshape(b, t, c, h, w).transpose(1, 2)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, cfg: VideoVAEConfig) -> None:
        super().__init__()
        mode = cfg.spatial_padding_mode
        self.norm1 = FrameGroupNorm(cfg.norm_num_groups, in_channels, eps=cfg.norm_eps)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, spatial_padding=1, pad_mode=mode)
        self.norm2 = FrameGroupNorm(cfg.norm_num_groups, out_channels, eps=cfg.norm_eps)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, spatial_padding=1, pad_mode=mode)
        self.conv_shortcut = CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place: the norm output is fresh, and an encoder activation is the size that matters.
        h = self.conv1(F.silu(self.norm1(x), inplace=True))
        h = self.conv2(F.silu(self.norm2(h), inplace=True))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class Downsample(nn.Module):
    def __init__(self, channels: int, spatial: int, temporal: int, pad_mode: str) -> None:
        super().__init__()
        self.spatial = spatial
        self.pad_mode = pad_mode
        self.conv = CausalConv3d(channels, channels, 3, stride=(temporal, spatial, spatial), pad_mode=pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spatial == 2:
            # Bottom/right only, so the output is exactly ceil(size / 2).
            pad = (0, 1, 0, 1) if x.ndim == 4 else (0, 1, 0, 1, 0, 0)
            x = F.pad(x, pad, mode=self.pad_mode)
        return self.conv(x)


class DownLevel(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, spatial: int, temporal: int, cfg: VideoVAEConfig) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, cfg) for i in range(cfg.layers_per_block)
        )
        # A list of one keeps diffusers' `downsamplers.0.conv` key names.
        self.downsamplers = (
            nn.ModuleList([Downsample(out_channels, spatial, temporal, cfg.spatial_padding_mode)])
            if spatial * temporal > 1 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VideoVAEConfig) -> None:
        super().__init__()
        channels = cfg.block_out_channels
        mode = cfg.spatial_padding_mode
        self.conv_in = CausalConv3d(cfg.in_channels, channels[0], 3, spatial_padding=1, pad_mode=mode)
        inputs = (channels[0],) + channels[:-1]
        self.down_blocks = nn.ModuleList(
            DownLevel(cin, cout, s, t, cfg)
            for cin, cout, s, t in zip(inputs, channels, cfg.spatial_downsample_factors,
                                       cfg.temporal_downsample_factors, strict=True)
        )
        self.norm_out = FrameGroupNorm(cfg.norm_num_groups, channels[-1], eps=cfg.norm_eps)
        self.conv_out = CausalConv3d(channels[-1], 2 * cfg.latent_channels, 3, spatial_padding=1, pad_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for level in self.down_blocks:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x), inplace=True))


# --------------------------------------------------------------------------------------------
# ViT decoder
# --------------------------------------------------------------------------------------------


def rope_tables(grid: tuple[int, int, int], num_extra: int, rope_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (1, T*H*W + num_extra, 1, rope_dim) for the decoder's 3-axis RoPE.

    Each axis is centred on [-1, 1) and scaled by 2*pi; the appended register/zero tokens sit at
    the origin. The (t, h, w) angles are concatenated, then duplicated for the rotate-half pairs.
    """
    exponents = torch.arange(0.0, 1.0, 6.0 / rope_dim, dtype=torch.float32, device=device)
    inv_freq = 1.0 / theta ** exponents
    axes = [2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=device) / size) - 1.0 for size in grid]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    coords = torch.cat([coords, coords.new_zeros(num_extra, 3)])
    angles = (2.0 * math.pi * coords)[:, :, None] * inv_freq
    angles = angles.flatten(1)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
    return angles.cos(), angles.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] channels of each head; the rest pass through."""
    width = cos.shape[-1]
    rot, rest = x[..., :width], x[..., width:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat([-second, first], dim=-1) * sin
    return torch.cat([rotated, rest], dim=-1)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.eps = eps
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # A list of one keeps diffusers' `to_out.0` key names.
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        # (x, eps, cos, sin) -> RMSNorm (no weight) + partial RoPE of one (B, S, H, D) tensor; kernels/
        # swaps in a fused pass. None: the eager formula below.
        self.qk_prep: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.to_q(x).view(b, s, self.heads, self.head_dim)
        k = self.to_k(x).view(b, s, self.heads, self.head_dim)
        v = self.to_v(x).view(b, s, self.heads, self.head_dim)
        prep = self.qk_prep or reference_qk_prep
        q, k = prep(q, self.eps, cos, sin), prep(k, self.eps, cos, sin)
        out = attention(q, k, v).reshape(b, s, -1)
        return self.to_out[0](out)


def reference_qk_prep(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decoder's Q/K norm (fp32 whatever the compute dtype: the released model's numerics), then RoPE
    in the compute dtype. cos/sin are (1, S, 1, R)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return apply_partial_rope(y, cos.to(x.dtype), sin.to(x.dtype))


class GatedProjection(nn.Module):
    """SwiGLU input projection; rows are [value; gate] as in diffusers."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)
        # value * silu(gate) of the projection; kernels/ swaps in a fused pass.
        self.activation: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.proj(x)
        if self.activation is not None:
            return self.activation(up)
        value, gate = up.chunk(2, dim=-1)
        return value * F.silu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Index 1 is diffusers' parameter-free dropout slot; keeping it keeps `net.2` as the key.
        self.net = nn.ModuleList([GatedProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: VideoVAEConfig) -> None:
        super().__init__()
        dim = cfg.decoder_dim
        eps = cfg.decoder_norm_eps
        self.norm1 = nn.RMSNorm(dim, eps=eps)
        self.attn = DecoderAttention(dim, cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim, eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, cfg.decoder_ffn_mult)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        # h stays fp32; only the normed input to each sub-layer takes the compute dtype.
        compute = self.attn.to_q.weight.dtype
        x = F.rms_norm(h, (h.shape[-1],), self.norm1.weight, self.norm1.eps).to(compute)
        h = h + self.attn(x, cos, sin, attention) * self.scale1
        x = F.rms_norm(h, (h.shape[-1],), self.norm2.weight, self.norm2.eps).to(compute)
        return h + self.ff(x) * self.scale2


class Decoder(nn.Module):
    def __init__(self, cfg: VideoVAEConfig) -> None:
        super().__init__()
        dim = cfg.decoder_dim
        self.cfg = cfg
        self.proj_in = nn.Linear(cfg.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.decoder_num_register_tokens, dim))
        self.transformer_blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.decoder_num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=cfg.decoder_norm_eps)
        patch = cfg.out_channels * cfg.temporal_ratio * cfg.spatial_ratio ** 2
        self.proj_out = nn.Linear(dim, patch)

    def forward(self, z: torch.Tensor, attention: AttentionFn = sdpa) -> torch.Tensor:
        cfg = self.cfg
        b, c, t, hh, ww = z.shape
        tokens = t * hh * ww
        h = self.proj_in(z.permute(0, 2, 3, 4, 1).reshape(b, tokens, c).float())
        extra = [self.register_tokens.float().expand(b, -1, -1), h.new_zeros(b, 1, h.shape[-1])]
        h = torch.cat([h] + extra, dim=1)
        cos, sin = rope_tables((t, hh, ww), cfg.decoder_num_register_tokens + 1, cfg.rope_dim,
                               cfg.decoder_rope_theta, z.device)
        for block in self.transformer_blocks:
            h = block(h, cos, sin, attention)
        # The register and zero tokens only steer attention; they have no pixels.
        h = self.norm_out(h[:, :tokens]).to(self.proj_out.weight.dtype)
        out = self.proj_out(h)
        pt, p = cfg.temporal_ratio, cfg.spatial_ratio
        out = out.view(b, t, hh, ww, cfg.out_channels, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, cfg.out_channels, t * pt, hh * p, ww * p)


# --------------------------------------------------------------------------------------------
# Posterior, normalisation, pixels
# --------------------------------------------------------------------------------------------


@dataclass
class VideoPosterior:
    """Diagonal Gaussian over raw latents; logvar is clamped to [-30, 20] as in the reference."""

    mean: torch.Tensor
    logvar: torch.Tensor

    @classmethod
    def from_moments(cls, moments: torch.Tensor) -> "VideoPosterior":
        mean, logvar = moments.chunk(2, dim=1)
        return cls(mean, logvar.clamp(-30.0, 20.0))

    @property
    def std(self) -> torch.Tensor:
        return torch.exp(0.5 * self.logvar)

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None) -> torch.Tensor:
        """mean + std * noise, the noise drawn on the generator's device and then moved."""
        return self.mean + self.std * _noise_like(self.mean, generator)


def _noise_like(ref: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else ref.device
    noise = torch.randn(ref.shape, generator=generator, device=device, dtype=ref.dtype)
    return noise.to(ref.device)


def _channel_view(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    shape = [1, -1] + [1] * (like.ndim - 2)
    return torch.tensor(values, dtype=torch.float32, device=like.device).view(shape)


def normalize_latents(z: torch.Tensor, cfg: VideoVAEConfig) -> torch.Tensor:
    """Raw VAE latents -> the DiT's normalised space: (z - mean) / std per channel."""
    return (z.float() - _channel_view(cfg.latents_mean, z)) / _channel_view(cfg.latents_std, z)


def denormalize_latents(z: torch.Tensor, cfg: VideoVAEConfig) -> torch.Tensor:
    """The DiT's normalised latents -> raw VAE latents: z * std + mean per channel."""
    return z.float() * _channel_view(cfg.latents_std, z) + _channel_view(cfg.latents_mean, z)


def frames_to_vae_input(frames: torch.Tensor) -> torch.Tensor:
    """uint8 (F, H, W, 3) or (H, W, 3) frames -> ImageNet-normalised fp32 (1, 3, F, H, W)."""
    if frames.dtype != torch.uint8 or frames.ndim not in (3, 4) or frames.shape[-1] != 3:
        raise InputError(f"frames must be uint8 (F, H, W, 3) or (H, W, 3), got {tuple(frames.shape)} {frames.dtype}")
    if frames.ndim == 3:
        frames = frames[None]
    x = frames.permute(3, 0, 1, 2)[None].float() / 255.0
    return (x - _channel_view(IMAGENET_MEAN, x)) / _channel_view(IMAGENET_STD, x)


def vae_output_to_unit(x: torch.Tensor) -> torch.Tensor:
    """Decoder output (ImageNet space) -> fp32 RGB in [0, 1]."""
    return _to_unit_(x.float().clone())


def _to_unit_(x: torch.Tensor) -> torch.Tensor:
    # In place: a decoded chunk is the size of the video's largest temporaries.
    return x.mul_(_channel_view(IMAGENET_STD, x)).add_(_channel_view(IMAGENET_MEAN, x)).clamp_(0.0, 1.0)


# --------------------------------------------------------------------------------------------
# Spatial tiling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileAxis:
    """Tile starts, sizes and the overlaps between neighbours along one axis, in one unit."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    overlaps: tuple[int, ...]

    def scaled(self, divisor: int) -> "TileAxis":
        return TileAxis(*(tuple(v // divisor for v in part) for part in (self.starts, self.sizes, self.overlaps)))


def split_tiles(length: int, tile: int, min_overlap: int, step: int) -> TileAxis:
    """Fewest `tile`-wide tiles covering `length` with overlaps >= min_overlap; the slack widens
    the overlaps in `step` increments round robin so tiles end exactly at `length`."""
    if tile >= length:
        return TileAxis((0,), (length,), ())
    count = math.ceil(length / tile)
    while tile * count - min_overlap * (count - 1) < length:
        count += 1
    overlaps = [min_overlap] * (count - 1)
    slack = tile * count - min_overlap * (count - 1) - length
    for i in range(slack // step):
        overlaps[i % (count - 1)] += step
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return TileAxis(tuple(starts), (tile,) * count, tuple(overlaps))


def blend_edge_(a_tail: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Cross-fade the last `extent` slices of a linearly into the first ones of b, in place on b."""
    extent = min(a_tail.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    shape = [1] * b.ndim
    shape[dim] = extent
    ramp = (torch.arange(extent, device=b.device, dtype=b.dtype) / extent).view(shape)
    head = b.narrow(dim, 0, extent)
    head.copy_(a_tail.narrow(dim, a_tail.shape[dim] - extent, extent) * (1 - ramp) + head * ramp)
    return b


def stitch_tiles(tile_fn: Callable[[int, int], torch.Tensor], ys: TileAxis, xs: TileAxis) -> torch.Tensor:
    """Blend tiles (..., h, w) from `tile_fn(row, col)` into one (..., H, W) tensor, one at a time.

    A tile blends with the *raw* tile above and the *raw* tile to its left (not their blended
    versions), then loses its bottom/right overlap to the next tile. Only those raw edge strips
    are kept between tiles, never a whole row of tiles. `tile_fn` must return fresh tensors: they
    are blended in place.
    """
    out = None
    above: list[torch.Tensor | None] = [None] * len(xs.starts)
    for i, y0 in enumerate(ys.starts):
        below: list[torch.Tensor | None] = [None] * len(xs.starts)
        left = None
        last_row = i == len(ys.starts) - 1
        for j, x0 in enumerate(xs.starts):
            last_col = j == len(xs.starts) - 1
            tile = tile_fn(i, j)
            height = tile.shape[-2] - (0 if last_row else ys.overlaps[i])
            width = tile.shape[-1] - (0 if last_col else xs.overlaps[j])
            left_of_next = None if last_col else tile[..., width:].clone()
            if not last_row:
                below[j] = tile[..., height:, :].clone()
            if i > 0:
                blend_edge_(above[j], tile, ys.overlaps[i - 1], dim=-2)
            if j > 0:
                blend_edge_(left, tile, xs.overlaps[j - 1], dim=-1)
            left = left_of_next
            if out is None:
                out = tile.new_empty(*tile.shape[:-2], ys.starts[-1] + ys.sizes[-1], xs.starts[-1] + xs.sizes[-1])
            out[..., y0:y0 + height, x0:x0 + width] = tile[..., :height, :width]
        above = below
    return out




def check_tiling(tile_size: int | None, min_overlap: int, ratio: int) -> None:
    if not tile_size:
        return
    if tile_size % ratio or min_overlap % ratio or tile_size <= min_overlap:
        raise InputError(f"tile size {tile_size} px must be a multiple of {ratio} and larger than the "
                         f"{min_overlap} px minimum overlap (0 disables tiling)")


# --------------------------------------------------------------------------------------------
# Temporal plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemporalPlan:
    """How a latent video of `num_latent_frames` is cut into decoder windows."""

    pad_tokens: int
    num_chunks: int
    window: int          # latent frames per decoder call
    main: slice          # pixel frames of a window emitted as the chunk
    tail: slice | None   # pixel frames cross-faded into the next chunk's head
    num_frames: int      # pixel frames after the padding is cut off


def temporal_plan(cfg: VideoVAEConfig, num_latent_frames: int) -> TemporalPlan:
    step, drop, rt = cfg.tokens_chunk_size, cfg.token_drop, cfg.temporal_ratio
    pad = (-(num_latent_frames + drop)) % step
    chunks = (num_latent_frames + drop + pad) // step - int(drop > 0)
    if chunks < 1:
        raise InputError(f"video latents need at least {step - drop + 1} frames to decode, got {num_latent_frames}")
    window = step + cfg.token_overlap
    window_frames = window * rt
    chunk_frames = step * rt
    pre = cfg.frame_pre_padding
    main = slice(pre, min(chunk_frames, window_frames))
    tail = slice(chunk_frames + pre, min(2 * chunk_frames, window_frames)) if drop > 0 else None
    emitted = chunks * (main.stop - main.start) + (tail.stop - tail.start if tail else 0)
    # A padded latent frame adds temporal_ratio pixel frames, except one that closes an encoder
    # clip, which only covers clip_length % temporal_ratio frames.
    intra = cfg.clip_length % rt
    pad_frames = sum(intra if intra and (num_latent_frames + k) % step == 0 else rt for k in range(pad))
    return TemporalPlan(pad, chunks, window, main, tail, emitted - pad_frames)


def decoded_num_frames(cfg: VideoVAEConfig, num_latent_frames: int) -> int:
    return temporal_plan(cfg, num_latent_frames).num_frames


def encoded_num_frames(cfg: VideoVAEConfig, num_frames: int) -> int:
    """Latent frames `encode` returns for `num_frames` pixel frames."""
    if num_frames == 1:
        return 1
    clips = math.ceil(num_frames / cfg.clip_length)
    per_clip = cfg.clip_length
    for factor in cfg.temporal_downsample_factors:
        per_clip = (per_clip - 1) // factor + 1
    return clips * per_clip - cfg.token_drop


# --------------------------------------------------------------------------------------------
# The VAE
# --------------------------------------------------------------------------------------------


def param_dtype(name: str, decode_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of a parameter: only the decoder's block linears and output projection
    follow the decode dtype; everything numerically sensitive stays fp32."""
    in_block_linear = name.startswith("decoder.transformer_blocks.") and (".attn." in name or ".ff." in name)
    return decode_dtype if in_block_linear or name.startswith("decoder.proj_out.") else torch.float32


class VideoVAE(nn.Module):
    def __init__(self, config: VideoVAEConfig = FULL) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv3d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = nn.Conv3d(config.latent_channels, config.latent_channels, 1)
        self.decoder = Decoder(config)
        self.attention: AttentionFn = sdpa
        # Tiles per decoder call when a decode does not say; front doors set it (H3_VAE_TILE_BATCH).
        self.tile_batch = DEFAULT_TILE_BATCH

    @property
    def decode_dtype(self) -> torch.dtype:
        return self.decoder.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def set_decode_dtype(self, dtype: torch.dtype) -> "VideoVAE":
        if dtype not in DECODE_DTYPES.values():
            raise InputError(f"video VAE decode dtype must be float16 or float32, got {dtype}")
        for name, param in self.named_parameters():
            param.data = param.data.to(param_dtype(name, dtype))
        return self

    # ---- latent normalisation ------------------------------------------------------------

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        return normalize_latents(z, self.config)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        return denormalize_latents(z, self.config)

    # ---- encode --------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, x: torch.Tensor, *, tile_size: int | None = DEFAULT_TILE_SIZE,
               tile_min_overlap: int = DEFAULT_TILE_MIN_OVERLAP, single_frame_2d: bool = True) -> VideoPosterior:
        """ImageNet-normalised (B, 3, F, H, W) -> posterior over raw (B, C, F', H/r, W/r) latents.

        F == 1 takes the exact 2-D shortcut unless `single_frame_2d` is False (kept for the test
        that proves the shortcut). Other F are encoded in clip_length chunks, the last one padded
        by repeating the last frame, and token_drop trailing latent frames are dropped.
        """
        cfg = self.config
        self._check_pixels(x)
        check_tiling(tile_size, tile_min_overlap, cfg.spatial_ratio)
        x = x.to(device=self.device, dtype=torch.float32)
        if x.shape[2] == 1:
            frame = x[:, :, 0] if single_frame_2d else x
            moments = self._encode_tiled(frame, tile_size, tile_min_overlap)
            return VideoPosterior.from_moments(moments if moments.ndim == 5 else moments[:, :, None])
        clip = cfg.clip_length
        pad = (-x.shape[2]) % clip
        if pad:
            x = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        moments = torch.cat(
            [self._encode_tiled(x[:, :, s:s + clip], tile_size, tile_min_overlap) for s in range(0, x.shape[2], clip)],
            dim=2,
        )
        if cfg.token_drop:
            moments = moments[:, :, : moments.shape[2] - cfg.token_drop]
        return VideoPosterior.from_moments(moments)

    def _check_pixels(self, x: torch.Tensor) -> None:
        cfg = self.config
        if x.ndim != 5 or x.shape[1] != cfg.in_channels or not x.is_floating_point():
            raise InputError(f"video VAE encode expects float (B, {cfg.in_channels}, F, H, W) ImageNet-normalised "
                             f"pixels, got {tuple(x.shape)} {x.dtype}")
        r = cfg.spatial_ratio
        if x.shape[-2] % r or x.shape[-1] % r or x.shape[2] < 1:
            raise InputError(f"video VAE encode needs H and W divisible by {r} and at least one frame, "
                             f"got {x.shape[2]} frames of {x.shape[-2]}x{x.shape[-1]}")

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(x)
        if moments.ndim == 4:
            return F.conv2d(moments, self.quant_conv.weight[:, :, 0], self.quant_conv.bias)
        return self.quant_conv(moments)

    def _encode_tiled(self, x: torch.Tensor, tile_size: int | None, min_overlap: int) -> torch.Tensor:
        r = self.config.spatial_ratio
        if not tile_size:
            return self._encode_clip(x)
        ys = split_tiles(x.shape[-2], tile_size, min_overlap, r)
        xs = split_tiles(x.shape[-1], tile_size, min_overlap, r)

        def tile(i: int, j: int) -> torch.Tensor:
            y0, x0 = ys.starts[i], xs.starts[j]
            return self._encode_clip(x[..., y0:y0 + ys.sizes[i], x0:x0 + xs.sizes[j]])

        return stitch_tiles(tile, ys.scaled(r), xs.scaled(r))

    # ---- decode --------------------------------------------------------------------------

    def _check_latents(self, z: torch.Tensor) -> None:
        cfg = self.config
        if z.ndim != 5 or z.shape[1] != cfg.latent_channels or not z.is_floating_point():
            raise InputError(f"video latents must be float (B, {cfg.latent_channels}, T, h, w), "
                             f"got {tuple(z.shape)} {z.dtype}")

    @torch.no_grad()
    def _decode_window(self, z: torch.Tensor, frames: list[int], tile_size: int | None,
                       min_overlap: int, tile_batch: int = 1) -> torch.Tensor:
        """One decoder window -> fp32 raw pixels of the requested frame indices only.

        `tile_batch` tiles go through the decoder together (stacked on the batch axis); the samples
        do not interact, so only the kernels' rounding can differ from one tile at a time."""
        cfg = self.config
        r = cfg.spatial_ratio
        index = torch.tensor(frames, device=z.device)

        def run(latent: torch.Tensor) -> torch.Tensor:
            pixels = self.decoder(self.post_quant_conv(latent.float()), self.attention)
            return pixels.index_select(2, index).float()

        height, width = z.shape[-2] * r, z.shape[-1] * r
        if not tile_size:
            return run(z)
        ys = split_tiles(height, tile_size, min_overlap, r)
        xs = split_tiles(width, tile_size, min_overlap, r)

        def crop(i: int, j: int) -> torch.Tensor:
            y0, x0 = ys.starts[i] // r, xs.starts[j] // r
            return z[..., y0:y0 + ys.sizes[i] // r, x0:x0 + xs.sizes[j] // r]

        # stitch_tiles asks for the tiles in row-major order: decode the next `tile_batch` at once.
        order = [(i, j) for i in range(len(ys.starts)) for j in range(len(xs.starts))]
        ready: dict[tuple[int, int], torch.Tensor] = {}

        def tile(i: int, j: int) -> torch.Tensor:
            if (i, j) not in ready:
                first = order.index((i, j))
                group = order[first:first + tile_batch]
                pixels = run(torch.cat([crop(*cell) for cell in group]))
                for cell, piece in zip(group, pixels.split(z.shape[0])):
                    ready[cell] = piece
            return ready.pop((i, j))

        return stitch_tiles(tile, ys, xs)

    # Deliberately not decorated with no_grad: torch's generator wrapper would hold the last
    # yielded chunk, and with it the whole previous window canvas, while the next one decodes.
    def iter_decode(self, z: torch.Tensor, *, tile_size: int | None = DEFAULT_TILE_SIZE,
                    tile_min_overlap: int = DEFAULT_TILE_MIN_OVERLAP, tile_batch: int | None = None,
                    group: Any = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Raw latents (B, C, T, h, w) -> (first frame, fp32 ImageNet-space chunk (B, 3, n, H, W))
        in frame order; the chunks tile [0, decoded_num_frames(T)) exactly. Each chunk is fresh
        memory the caller may overwrite in place.

        With a torch.distributed `group`, the decoder windows are shared out among its ranks
        (window i on rank i % world) and broadcast, so every rank yields the same chunks as a
        one-process decode, bit for bit: the windows are independent and the cross-fades run
        in the same order everywhere."""
        self._check_latents(z)
        check_tiling(tile_size, tile_min_overlap, self.config.spatial_ratio)
        tile_batch = self.tile_batch if tile_batch is None else check_tile_batch(tile_batch)
        cfg = self.config
        plan = temporal_plan(cfg, z.shape[2])
        z = z.to(device=self.device, dtype=torch.float32)
        if plan.pad_tokens:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, plan.pad_tokens, -1, -1)], dim=2)
        frames = list(range(plan.main.start, plan.main.stop))
        if plan.tail is not None:
            frames += list(range(plan.tail.start, plan.tail.stop))
        main_len = plan.main.stop - plan.main.start

        def window(i: int) -> torch.Tensor:
            start = i * cfg.tokens_chunk_size
            return self._decode_window(z[:, :, start:start + plan.window], frames, tile_size, tile_min_overlap,
                                       tile_batch)

        if group is not None:
            r = cfg.spatial_ratio
            shape = (z.shape[0], cfg.out_channels, len(frames), z.shape[-2] * r, z.shape[-1] * r)
            window = _shared_windows(window, plan.num_chunks, shape, self.device, group)
        written, tail = 0, None
        for i in range(plan.num_chunks):
            pixels = window(i)
            chunk = pixels[:, :, :main_len]
            if tail is not None:
                blend_edge_(tail, chunk, cfg.frame_overlap, dim=2)
            tail = pixels[:, :, main_len:].clone() if plan.tail is not None else None
            written = yield from _emit(chunk, written, plan.num_frames)
            # Unbound before the next window is decoded, or two canvases would coexist.
            del pixels, chunk
        if tail is not None:
            yield from _emit(tail, written, plan.num_frames)

    def decode(self, z: torch.Tensor, **tiling: Any) -> torch.Tensor:
        """Raw latents -> fp32 ImageNet-space video (B, 3, F, H, W), like diffusers' `decode`.

        Holds the whole video in fp32: for tests and short clips. Use `decode_to_buffer` for
        real videos.
        """
        return torch.cat([chunk for _, chunk in self.iter_decode(z, **tiling)], dim=2)

    def decode_to_buffer(self, z: torch.Tensor, *, out: torch.Tensor | None = None,
                         out_dtype: torch.dtype = torch.uint8,
                         on_frames: Callable[[torch.Tensor], None] | None = None, **tiling: Any) -> torch.Tensor:
        """Raw latents -> RGB frames (B, F, H, W, 3) written chunk by chunk into one host buffer.

        uint8 holds round(255 * rgb); fp16 holds rgb in [0, 1]. `out` may be a preallocated
        (e.g. pinned) buffer of the right shape and dtype. `on_frames` gets each finished chunk of the
        buffer, (B, n, H, W, 3) in frame order, as soon as it is stored (an encoder can start on it while
        the next window decodes); the buffer is not written there again.
        """
        self._check_latents(z)
        shape = self.decoded_shape(z.shape)
        if out is None:
            if out_dtype not in (torch.uint8, torch.float16):
                raise InputError(f"decode buffer dtype must be uint8 or float16, got {out_dtype}")
            out = torch.empty(shape, dtype=out_dtype)
        elif tuple(out.shape) != shape or out.dtype not in (torch.uint8, torch.float16):
            raise InputError(f"decode buffer must be uint8/float16 {shape}, got {tuple(out.shape)} {out.dtype}")
        for start, chunk in self.iter_decode(z, **tiling):
            n = _store_rgb(out, start, chunk)
            if on_frames is not None:
                on_frames(out[:, start:start + n])
            # The chunk is a view of the window canvas; unbound, the canvas is freed before the
            # generator decodes the next window.
            del chunk
        return out

    def decoded_shape(self, latent_shape: Sequence[int]) -> tuple[int, int, int, int, int]:
        b, _, t, h, w = latent_shape
        r = self.config.spatial_ratio
        return (b, decoded_num_frames(self.config, t), h * r, w * r, self.config.out_channels)


def _store_rgb(out: torch.Tensor, start: int, chunk: torch.Tensor) -> int:
    """Store one decoded chunk (B, C, n, H, W) at frame `start`; returns n."""
    rgb = _to_unit_(chunk)
    rgb = rgb.mul_(255.0).round_().to(torch.uint8) if out.dtype == torch.uint8 else rgb.to(out.dtype)
    out[:, start:start + rgb.shape[2]].copy_(rgb.permute(0, 2, 3, 4, 1))
    return rgb.shape[2]


def _shared_windows(window: Callable[[int], torch.Tensor], count: int, shape: tuple[int, ...], device,
                    group) -> Callable[[int], torch.Tensor]:
    """Window i is decoded on rank i % world and broadcast; rounds of `world` windows keep at most
    one round in memory. Every rank must ask for the windows in order 0, 1, 2, ..."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    held: dict[int, torch.Tensor] = {}

    def get(i: int) -> torch.Tensor:
        if i not in held:
            first = i - i % world
            mine = first + rank
            own = window(mine) if mine < count else None
            for j in range(first, min(first + world, count)):
                owner = j % world
                buf = own.contiguous() if owner == rank else torch.empty(shape, dtype=torch.float32, device=device)
                dist.broadcast(buf, src=dist.get_global_rank(group, owner) if group is not dist.group.WORLD
                               else owner, group=group)
                held[j] = buf
        return held.pop(i)

    return get


def _emit(chunk: torch.Tensor, written: int, total: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield the part of `chunk` that still fits before `total` frames; returns the new count."""
    keep = min(chunk.shape[2], total - written)
    if keep > 0:
        yield written, chunk[:, :, :keep]
    return written + max(keep, 0)


# The released recipe samples every visual condition under its own generator with this seed, so a reference
# encodes to the same latents in every request.
CONDITION_SEED = 42


@torch.no_grad()
def encode_condition(vae: VideoVAE, frames: torch.Tensor, *, seed: int = CONDITION_SEED,
                     tile_size: int | None = DEFAULT_TILE_SIZE) -> torch.Tensor:
    """Keyframes / image or video references -> normalised conditioning latents (1, C, T, h, w).

    The released recipe: ImageNet-normalise, *sample* the posterior under a fresh CPU generator
    seeded `seed`, round the sample through fp16, normalise with latents_mean/std. fp32 on CPU.
    """
    posterior = vae.encode(frames_to_vae_input(frames), tile_size=tile_size)
    latents = posterior.sample(torch.Generator().manual_seed(seed))
    latents = latents.to(torch.float16).float().cpu()
    return normalize_latents(latents, vae.config)


# --------------------------------------------------------------------------------------------
# Memory arithmetic (what the module docstring quotes)
# --------------------------------------------------------------------------------------------


def parameter_bytes(cfg: VideoVAEConfig, decode_dtype: torch.dtype) -> int:
    with torch.device("meta"):
        model = VideoVAE(cfg)
    itemsize = {torch.float32: 4, torch.float16: 2}
    return sum(p.numel() * itemsize[param_dtype(n, decode_dtype)] for n, p in model.named_parameters())


def decode_memory_estimate(cfg: VideoVAEConfig, num_latent_frames: int, latent_height: int, latent_width: int, *,
                           decode_dtype: torch.dtype = torch.float16, out_dtype: torch.dtype = torch.uint8,
                           tile_size: int | None = DEFAULT_TILE_SIZE,
                           tile_batch: int = DEFAULT_TILE_BATCH) -> dict[str, int]:
    """Bytes held at the peak of `decode_to_buffer` for one video, by term.

    With S tokens per decoder call (window grid + registers + zero token), width D, FFN width I
    and compute-dtype bytes c, the largest transient of one call is the biggest of
      attention: fp32 residual + normed input (fp32 then c) + q/k/v + fp32 QK-norm in/out + RoPE copies
      FFN:       fp32 residual + normed input + fused up projection (S x 2I) + silu(gate) and product (S x I each)
      head:      fp32 residual + LayerNorm (fp32, c) + proj_out output and its unpatchified copy
                 (all window frames) + the kept frames in c and fp32
    attention itself being O(S*D) with a flash or memory-efficient kernel, times the tiles decoded
    together (`tile_batch`, at most the tiles of a window). Alongside it live the
    window's fp32 canvas of kept frames, the previous window's fp32 tail, the stitching state (a
    row of raw bottom strips, the left neighbour's raw strip, the last blended tile); a finished
    chunk is converted in place and only its uint8/fp16 copy is new.
    """
    c = 2 if decode_dtype == torch.float16 else 4
    r, rt = cfg.spatial_ratio, cfg.temporal_ratio
    plan = temporal_plan(cfg, num_latent_frames)
    height, width = latent_height * r, latent_width * r
    tile_h = min(tile_size, height) if tile_size else height
    tile_w = min(tile_size, width) if tile_size else width
    s = plan.window * (tile_h // r) * (tile_w // r) + cfg.decoder_num_register_tokens + 1
    sd, si = s * cfg.decoder_dim, s * cfg.decoder_dim * cfg.decoder_ffn_mult
    main = plan.main.stop - plan.main.start
    tail = (plan.tail.stop - plan.tail.start) if plan.tail else 0
    plane = cfg.out_channels * tile_h * tile_w
    attention = sd * (4 + 4 + c + 3 * c + 2 * 4 + 2 * c)
    ffn = sd * (4 + 4 + c) + 2 * si * c + 2 * si * c
    head = sd * (4 + 4 + c) + 2 * plane * plan.window * rt * c + plane * (main + tail) * (c + 4)
    frame = cfg.out_channels * height * width
    out_item = 1 if out_dtype == torch.uint8 else 2
    columns = len(split_tiles(width, tile_w, DEFAULT_TILE_MIN_OVERLAP, r).starts) if tile_size else 1
    overlap_h = max(split_tiles(height, tile_h, DEFAULT_TILE_MIN_OVERLAP, r).overlaps, default=0)
    overlap_w = max(split_tiles(width, tile_w, DEFAULT_TILE_MIN_OVERLAP, r).overlaps, default=0)
    kept = cfg.out_channels * (main + tail) * 4
    stitching = kept * (columns * overlap_h * tile_w + tile_h * overlap_w + tile_h * tile_w)
    window = frame * (main + 2 * tail) * 4 + 2 * frame * main * out_item + stitching
    weights = parameter_bytes(cfg, decode_dtype)
    rows = len(split_tiles(height, tile_h, DEFAULT_TILE_MIN_OVERLAP, r).starts) if tile_size else 1
    batch = min(tile_batch, rows * columns)
    # The batch's other decoded tiles wait, fp32 and of the kept frames, until stitching takes them.
    waiting = (batch - 1) * plane * (main + tail) * 4
    transient = batch * max(attention, ffn, head) + waiting
    return {"weights": weights, "transient": transient, "window": window,
            "device_peak": weights + transient + window,
            "host_buffer": frame * plan.num_frames * out_item}
