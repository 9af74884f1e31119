"""The H3 audio VAE: mono 32 kHz waveform <-> 32-channel latents at 40 per second (hop 800).

- Encoder: DAC-style strided Conv1d stack with Snake activations (dilated residual units 1/3/9,
  each stage doubling the channels), then `pre_block`, a causal attention projection that narrows
  the 2048-wide trunk to the latent width (heads mean-pooled, head width average-pooled), a
  residual LayerNorm'd linear path and a GeGLU MLP; `mean_proj` / `logs_proj` give the posterior
  (log *standard deviation*, not log variance). H3 uses the posterior mean.
- Decoder: `dec_in_proj`, then BigVGAN: transposed-conv upsamplers, parallel AMP blocks averaged,
  every conv preceded by an anti-aliased SnakeBeta (2x Kaiser-sinc upsample, activation, 2x
  low-pass downsample; the filters are persistent buffers of the checkpoint), clamp to [-1, 1].
- Stereo is two batch items of the mono model.
- Always fp32: the released model degrades audibly in bf16.
- Key names are diffusers' (= the original checkpoint's), with each weight-normed conv holding one
  plain `weight`: loaders fold `weight_g`/`weight_v` into it once, instead of recomputing the
  norm on every forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CheckpointError, InputError

DIFFUSERS_CLASS_NAME = "AutoencoderKLMiniMaxH3Audio"
_RESAMPLE_RATIO = 2
_RESAMPLE_KERNEL = 12


@dataclass(frozen=True)
class AudioVAEConfig:
    """Field names are those of diffusers' `audio_vae/config.json`."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sampling_rate: int = 32000
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("encoder_rates", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(self, "resblock_dilation_sizes",
                           tuple(tuple(int(d) for d in ds) for ds in self.resblock_dilation_sizes))
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))
        problems = self._problems()
        if problems:
            raise CheckpointError("invalid audio VAE config: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if math.prod(self.decoder_rates) != self.hop_length:
            problems.append(f"decoder_rates multiply to {math.prod(self.decoder_rates)}, not the hop {self.hop_length}")
        if len(self.decoder_rates) != len(self.decoder_kernel_sizes):
            problems.append("decoder_rates and decoder_kernel_sizes differ in length")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            problems.append("resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if self.latent_dim % self.latent_channels or self.latent_dim % self.num_attention_heads:
            problems.append(f"latent_dim {self.latent_dim} must divide by latent_channels {self.latent_channels} "
                            f"and num_attention_heads {self.num_attention_heads}")
        if self.decoder_dim < 2 ** len(self.decoder_rates):
            problems.append(f"decoder_dim {self.decoder_dim} halves below one channel over "
                            f"{len(self.decoder_rates)} upsamplers")
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None and len(value) != self.latent_channels:
                problems.append(f"{name} needs {self.latent_channels} values, got {len(value)}")
        if self.latents_std is not None and any(s <= 0 for s in self.latents_std):
            problems.append("latents_std must be positive")
        return problems

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS_NAME}
        for key, value in dataclasses.asdict(self).items():
            if key == "resblock_dilation_sizes":
                value = [list(d) for d in value]
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AudioVAEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"invalid audio VAE config: {exc}") from None


# The released statistics live only in the checkpoint's config, hence None here.
FULL = AudioVAEConfig()
# Spec section 6: the real hop (800 samples) with tiny widths.
TINY = AudioVAEConfig(
    encoder_dim=2,
    latent_dim=16,
    latent_channels=8,
    num_attention_heads=2,
    decoder_dim=128,
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
    latents_mean=(0.0,) * 8,
    latents_std=(1.0,) * 8,
)
PRESETS: dict[str, AudioVAEConfig] = {"full": FULL, "tiny": TINY}


def preset(name: str) -> AudioVAEConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise CheckpointError(f"unknown audio VAE preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def is_weight_normed(name: str, ndim: int) -> bool:
    """Whether diffusers stores this weight as weight_g/weight_v: every Conv1d/ConvTranspose1d
    weight of the encoder and decoder stacks, and nothing else."""
    return name.startswith(("encoder.", "decoder.")) and name.endswith(".weight") and ndim == 3


def fold_weight_norm(weight_g: torch.Tensor, weight_v: torch.Tensor) -> torch.Tensor:
    """w = g * v / ||v||, the norm over every dim but the first (weight_norm's dim=0).

    Uses the fused op torch's own weight_norm evaluates on every forward, so the folded weight is
    bit-identical to the one the reference computes; a hand-written norm differs in the last bit,
    which the Snake stack amplifies ~100x.
    """
    return torch._weight_norm(weight_v.float(), weight_g.float(), 0)


# --------------------------------------------------------------------------------------------
# Activations and anti-aliased resampling
# --------------------------------------------------------------------------------------------


class Snake(nn.Module):
    """x + sin^2(alpha x) / (alpha + 1e-9), alpha per channel (1, C, 1)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class SnakeBeta(nn.Module):
    """x + sin^2(e^alpha x) / (e^beta + 1e-9); alpha and beta are stored in log space."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """(1, 1, K) Kaiser-windowed sinc low-pass, normalised to unit sum (the alias-free-torch
    design the checkpoint's stored buffers were made with)."""
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False)
    if kernel_size % 2 == 0:
        time = torch.arange(-half, half) + 0.5
    else:
        time = torch.arange(kernel_size) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return (taps / taps.sum()).view(1, 1, kernel_size)


@functools.lru_cache(maxsize=None)
def _cached_filter(ratio: int, kernel: int) -> torch.Tensor:
    # Always built on the CPU: under a meta-device context (how loaders build the model) the
    # window math would otherwise go through slow meta decompositions, 30 times per model.
    with torch.device("cpu"):
        return kaiser_sinc_filter(cutoff=0.5 / ratio, half_width=0.6 / ratio, kernel_size=kernel)


def _lowpass_filter(ratio: int, kernel: int) -> torch.Tensor:
    return _cached_filter(ratio, kernel).clone()


def resampling_filter() -> torch.Tensor:
    """The one filter every anti-aliased activation stores (up- and downsampling alike)."""
    return _lowpass_filter(_RESAMPLE_RATIO, _RESAMPLE_KERNEL)


class UpSample(nn.Module):
    def __init__(self, ratio: int = _RESAMPLE_RATIO, kernel: int = _RESAMPLE_KERNEL) -> None:
        super().__init__()
        self.ratio = ratio
        self.pad = kernel // ratio - 1
        self.crop_left = self.pad * ratio + (kernel - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel - ratio + 1) // 2
        self.register_buffer("filter", _lowpass_filter(ratio, kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(channels, -1, -1), stride=self.ratio, groups=channels)
        return x[..., self.crop_left: x.shape[-1] - self.crop_right]


class LowPass(nn.Module):
    def __init__(self, ratio: int, kernel: int) -> None:
        super().__init__()
        self.stride = ratio
        self.pad_left = kernel // 2 - int(kernel % 2 == 0)
        self.pad_right = kernel // 2
        self.register_buffer("filter", _lowpass_filter(ratio, kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(channels, -1, -1), stride=self.stride, groups=channels)


class DownSample(nn.Module):
    def __init__(self, ratio: int = _RESAMPLE_RATIO, kernel: int = _RESAMPLE_KERNEL) -> None:
        super().__init__()
        self.lowpass = LowPass(ratio, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class AntiAliasedSnakeBeta(nn.Module):
    """SnakeBeta at twice the rate, so its harmonics are filtered before they alias."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample()
        self.downsample = DownSample()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


# --------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            nn.Conv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
            Snake(dim),
            nn.Conv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class EncoderStage(nn.Module):
    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake(half),
            nn.Conv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig) -> None:
        super().__init__()
        dim = cfg.encoder_dim
        layers: list[nn.Module] = [nn.Conv1d(1, dim, 7, padding=3)]
        for stride in cfg.encoder_rates:
            dim *= 2
            layers.append(EncoderStage(dim, stride))
        layers += [Snake(dim), nn.Conv1d(dim, cfg.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class CausalAttention(nn.Module):
    """Causal attention narrowing in_dim -> out_dim: heads are averaged, then the head width is
    average-pooled to out_dim. Biases: q and v learned, k a stored zero buffer."""

    def __init__(self, in_dim: int, out_dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.out_dim = out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        bias = torch.cat([self.q_bias, self.zero_k_bias, self.v_bias])
        q, k, v = F.linear(x, self.qkv.weight, bias).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.adaptive_avg_pool1d(out.mean(dim=1), self.out_dim)
        return self.proj(out)


class GeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttentionProjection(nn.Module):
    """`pre_block`: (B, T, latent_dim) -> (B, T, latent_channels)."""

    def __init__(self, in_dim: int, out_dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGLU(out_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


# --------------------------------------------------------------------------------------------
# BigVGAN decoder
# --------------------------------------------------------------------------------------------


class AMPBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations
        )
        # Interleaved: activations[2i] precedes convs1[i], activations[2i + 1] precedes convs2[i].
        self.activations = nn.ModuleList(AntiAliasedSnakeBeta(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            y = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](y))
        return x


class BigVGAN(nn.Module):
    def __init__(self, cfg: AudioVAEConfig) -> None:
        super().__init__()
        width = cfg.decoder_dim
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.conv_pre = nn.Conv1d(cfg.latent_dim, width, 7, padding=3)
        # Each upsampler sits in a list of one: the checkpoint's `ups.{i}.0` names.
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(width >> i, width >> (i + 1), k, rate, padding=(k - rate) // 2)])
            for i, (rate, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            AMPBlock(width >> (i + 1), k, d)
            for i in range(len(cfg.decoder_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        final = width >> len(cfg.decoder_rates)
        self.activation_post = AntiAliasedSnakeBeta(final)
        self.conv_post = nn.Conv1d(final, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.num_kernels
        return self.conv_post(self.activation_post(x)).clamp(-1.0, 1.0)


# --------------------------------------------------------------------------------------------
# The VAE
# --------------------------------------------------------------------------------------------


@dataclass
class AudioPosterior:
    mean: torch.Tensor
    logs: torch.Tensor  # log standard deviation

    @property
    def std(self) -> torch.Tensor:
        return self.logs.exp()

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None) -> torch.Tensor:
        device = generator.device if generator is not None else self.mean.device
        noise = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * noise.to(self.mean.device)


class AudioVAE(nn.Module):
    def __init__(self, config: AudioVAEConfig = FULL) -> None:
        super().__init__()
        self.config = config
        c = config.latent_channels
        self.encoder = Encoder(config)
        self.pre_block = AttentionProjection(config.latent_dim, c, config.num_attention_heads)
        self.mean_proj = nn.Conv1d(c, c, 1)
        self.logs_proj = nn.Conv1d(c, c, 1)
        self.dec_in_proj = nn.Conv1d(c, config.latent_dim, 1)
        self.decoder = BigVGAN(config)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @property
    def device(self) -> torch.device:
        return self.mean_proj.weight.device

    @torch.no_grad()
    def encode(self, wav: torch.Tensor) -> AudioPosterior:
        """Mono waveforms (B, 1, N) -> posterior over (B, C, ceil(N / hop)); N is right-padded
        with zeros to a whole number of hops."""
        if wav.ndim != 3 or wav.shape[1] != 1 or wav.shape[-1] < 1 or not wav.is_floating_point():
            raise InputError(f"audio VAE encode expects float (B, 1, samples), got {tuple(wav.shape)} {wav.dtype}")
        wav = wav.to(device=self.device, dtype=torch.float32)
        wav = F.pad(wav, (0, (-wav.shape[-1]) % self.hop_length))
        h = self.pre_block(self.encoder(wav).transpose(1, 2)).transpose(1, 2)
        return AudioPosterior(self.mean_proj(h), self.logs_proj(h))

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents (B, C, T) -> mono waveforms (B, 1, hop * T) in [-1, 1]."""
        c = self.config.latent_channels
        if z.ndim != 3 or z.shape[1] != c or z.shape[-1] < 1 or not z.is_floating_point():
            raise InputError(f"audio latents must be float (B, {c}, T), got {tuple(z.shape)} {z.dtype}")
        return self.decoder(self.dec_in_proj(z.to(device=self.device, dtype=torch.float32)))

    # ---- normalised stereo, as the pipeline uses it ---------------------------------------

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.latents_mean is None or cfg.latents_std is None:
            raise CheckpointError("the audio VAE config has no latents_mean/latents_std; H3 needs both to "
                                  "(de)normalise audio latents")
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=like.device).view(1, -1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=like.device).view(1, -1, 1)
        return mean, std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return (z.float() - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z.float() * std + mean

    def encode_stereo(self, wav: torch.Tensor) -> torch.Tensor:
        """Stereo (2, N) at the sample rate -> normalised posterior-mean latents (2, C, T)."""
        if wav.ndim != 2 or wav.shape[0] != 2:
            raise InputError(f"stereo audio must be (2, samples), got {tuple(wav.shape)}")
        return self.normalize(self.encode(wav[:, None]).mode())

    def decode_stereo(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents (2, C, T) -> stereo waveform (2, hop * T), fp32 in [-1, 1]."""
        if z.ndim != 3 or z.shape[0] != 2:
            raise InputError(f"stereo audio latents must be (2, {self.config.latent_channels}, T), "
                             f"got {tuple(z.shape)}")
        return self.decode(self.denormalize(z))[:, 0]
