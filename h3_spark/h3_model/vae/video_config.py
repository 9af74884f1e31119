"""The video VAE's config (diffusers' `vae/config.json` field names), the released and tiny presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CheckpointError

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
    def tail_clip_frames(self) -> int:
        """Frames of a video's last clip that its kept latents see. The encoder is causal in time (its
        convolutions pad only the past, its norms never mix frames), so latent j of a clip sees the clip's pixel
        frames up to j x temporal_ratio; token_drop then drops all but the clip's first latents. The frames after
        these (the repeated last frame that pads the clip, or real frames past them) never reach a kept latent."""
        kept = self.tokens_chunk_size - self.token_drop
        return min(self.clip_length, (kept - 1) * self.temporal_ratio + 1)

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
