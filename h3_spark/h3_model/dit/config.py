"""DiT configuration: the released full-size config and the tiny CPU preset.

Field names follow the diffusers `config.json` of the `transformer/` folder, so a released
config loads as is. Every size in the model comes from here; no module hard-codes one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointError

# Modality tags of the packed sequence (AdaLN row = timestep_index * NUM_MODALITIES + tag).
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2
NUM_MODALITIES = 3
# Vectors per AdaLN table row: shift, scale, gate for attention, then for the MLP.
ADALN_VECTORS = 6


@dataclass(frozen=True)
class DiTConfig:
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    # Pruned ("curve-form") checkpoints replace the time MLP by a [grid, time_embed_dim] table.
    adaln_curve_grid: int | None = None
    # FastH3 (FastVideo's DMD2 students) carry a learned VSA gate per block, `attn.to_gate_compress`
    # ([heads x head_dim, hidden], no bias). The dense forward never reads it; the VSA attention does.
    gate_compress: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        problems = []
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            problems.append(
                f"6 * rope_freq_dim ({6 * self.rope_freq_dim}) exceeds attention_head_dim ({self.attention_head_dim})"
            )
        if len(self.patch_size) != 3:
            problems.append(f"patch_size must have 3 entries, got {self.patch_size}")
        for name in ("num_attention_heads", "attention_head_dim", "hidden_size", "ffn_dim", "in_channels",
                     "audio_in_channels", "text_dim", "freq_dim", "time_embed_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.freq_dim % 2:
            problems.append(f"freq_dim must be even, got {self.freq_dim}")
        if not isinstance(self.gate_compress, bool):
            problems.append(f"gate_compress must be true or false, got {self.gate_compress!r}")
        if problems:
            raise CheckpointError("invalid DiT config: " + "; ".join(problems))

    @property
    def inner_dim(self) -> int:
        """Attention width (heads x head_dim); independent of hidden_size (7168 vs 5376 when released)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @property
    def rotary_dim(self) -> int:
        return 6 * self.rope_freq_dim

    @property
    def curve_form(self) -> bool:
        return self.adaln_curve_grid is not None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["patch_size"] = list(self.patch_size)
        if out["adaln_curve_grid"] is None:
            del out["adaln_curve_grid"]
        if not out["gate_compress"]:  # configs of models without the gate read and write as before
            del out["gate_compress"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, strict: bool = False) -> "DiTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in data if k not in known and not k.startswith("_"))
        if strict and unknown:
            raise CheckpointError(f"unknown DiT config fields: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


FULL = DiTConfig()

# Seconds on a CPU. hidden_size (24) differs from the attention width (2 x 16 = 32) as in the
# released model, so code that confuses the two fails on the tiny preset too.
TINY = DiTConfig(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=24,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=64,
    in_channels=4,
    audio_in_channels=8,
    text_dim=24,
    freq_dim=32,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=2,
)

PRESETS: dict[str, DiTConfig] = {"full": FULL, "tiny": TINY}


def preset(name: str) -> DiTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise CheckpointError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
