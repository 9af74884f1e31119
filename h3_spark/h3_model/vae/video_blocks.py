"""The video VAE's building blocks: the causal 3-D CNN encoder and the ViT decoder with partial RoPE."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.attention import sdpa
from .video_config import VideoVAEConfig

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
        # x -> the input q, k and v take; kernels/ installs one FP8 quantization the three share. None: x itself.
        self.quantize_input: Callable[[torch.Tensor], object] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        b, s, _ = x.shape
        rows = x if self.quantize_input is None else self.quantize_input(x)
        q = self.to_q(rows).view(b, s, self.heads, self.head_dim)
        k = self.to_k(rows).view(b, s, self.heads, self.head_dim)
        v = self.to_v(rows).view(b, s, self.heads, self.head_dim)
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


def compute_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a block linear computes in: its weight's, or a StoredLinear's `out_dtype` (its weight holds the
    stored codes of a quantized file)."""
    return getattr(linear, "out_dtype", None) or linear.weight.dtype


def residual_norm(h: torch.Tensor, y: torch.Tensor | None, gate: torch.Tensor | None, norm: nn.RMSNorm | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's step between its sub-layers: the fp32 residual plus a sub-layer's output times its scale (y None:
    h as it is), then RMSNorm of the sum (fp32 math) rounded to the compute dtype (norm None: no normed output)."""
    if y is not None:
        h = h + y * gate
    if norm is None:
        return h, None
    return h, F.rms_norm(h, (h.shape[-1],), norm.weight, norm.eps).to(dtype)


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
        # `residual_norm`'s contract; kernels/ swaps in one fused pass. None: the eager formula.
        self.residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        # h stays fp32; only the normed input to each sub-layer takes the compute dtype.
        compute = compute_dtype(self.attn.to_q)
        step = self.residual_norm or residual_norm
        _, x = step(h, None, None, self.norm1, compute)
        h, x = step(h, self.attn(x, cos, sin, attention), self.scale1, self.norm2, compute)
        h, _ = step(h, self.ff(x), self.scale2, None, compute)
        return h


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
