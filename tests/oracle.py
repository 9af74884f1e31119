"""Shared test helpers: the diffusers oracle (test-only dependency) and random tiny models."""

from __future__ import annotations

import math
import types

import torch

from h3_spark.h3_model.dit.config import TINY, DiTConfig
from h3_spark.h3_model.dit.model import H3DiT

# The tiny config of the spec's recipe, where hidden size equals the attention width, next to our
# TINY preset where they differ (24 vs 2 x 16), as in the released model (5376 vs 56 x 128).
EQUAL_WIDTH = DiTConfig(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2,
                        num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=8, text_dim=24,
                        freq_dim=32, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
CONFIGS = {"tiny": TINY, "equal_width": EQUAL_WIDTH}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def diffusers_dit(config: DiTConfig, seed: int = 0):
    """A diffusers MiniMaxH3Transformer3DModel with every parameter random (diffusers inits some to 0/1)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(**config.to_dict()).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def ours_from(reference, config: DiTConfig, dtype=torch.float32) -> H3DiT:
    model = H3DiT(config, dtype=dtype, device="meta")
    model.load_state(reference.state_dict().items(), device="cpu")
    return model.eval()


def ref_blocks(spec):
    """Our layout blocks and the objects diffusers' Ref2VA builder reads (kind, has_audio, latents)."""
    from h3_spark.h3_model.dit.layout import AudioBlock, ImageBlock, VideoBlock

    ours, theirs, cond, audio_cond = [], [], [], []
    for item in spec:
        kind = item[0]
        if kind == "image":
            _, h, w = item
            ours.append(ImageBlock(h, w))
            theirs.append(types.SimpleNamespace(kind="image", has_audio=False))
            cond.append(torch.empty(1, 4, 1, h, w))
        elif kind == "video":
            _, f, h, w, a = item
            ours.append(VideoBlock(f, h, w, a))
            theirs.append(types.SimpleNamespace(kind="video", has_audio=a > 0))
            cond.append(torch.empty(1, 4, f, h, w))
            if a:
                audio_cond.append(torch.empty(2 * a, 8))
        else:
            _, a = item
            ours.append(AudioBlock(a))
            theirs.append(types.SimpleNamespace(kind="audio", has_audio=True))
            audio_cond.append(torch.empty(2 * a, 8))
    return ours, theirs, cond, audio_cond


def text_tags(n: int, vision: tuple[int, int] | None = None) -> torch.Tensor:
    tags = torch.ones(n, dtype=torch.long)
    if vision:
        tags[vision[0]:vision[1]] = 0
    return tags


def randomize_vae_(model: torch.nn.Module, seed: int) -> None:
    """Every VAE parameter random and non-zero, including what diffusers zero-inits (residual scales, q/v
    biases): positive weight-norm gains and Snake frequencies, N(0, 1) register tokens, unit-gain weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("weight_g") or (name.endswith(".alpha") and param.ndim == 3):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            elif name.endswith("register_tokens"):
                param.copy_(noise)
            elif param.ndim >= 2:
                param.copy_(noise / math.sqrt(param[0].numel()))
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.3 * noise)


def forward_args(c: DiTConfig, lay, seed: int) -> dict:
    """Random H3DiT forward arguments (video, audio and text rows drawn in that order) for a packed layout."""
    gen = torch.Generator().manual_seed(seed)
    ts, idx = lay.row_timesteps(0.4, 0.6, 0.4)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), c.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), c.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, c.text_dim, generator=gen),
                token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                audio_indices=lay.audio_indices, text_indices=lay.text_indices, timestep=ts, timestep_indices=idx)

