"""Deterministic random DiT weights with the real names and shapes (for test and demo checkpoints).

Each tensor has its own generator seeded from (seed, name), so any tensor can be produced alone,
in any order: a writer streams a 33 B-parameter model without holding it, and the pruned and full
files made from one seed describe the same model. Values are sized like a trained network's:
linear weights N(0, 1/fan_in), biases small, norm weights around 1, and AdaLN projections scaled
down so that modulation stays near identity and 50 random blocks do not blow up.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..dit.config import DiTConfig


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_rule(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a DiT parameter in the random model: RMSNorm gains around 1, small biases, linear
    weights N(0, 1/fan_in) (unit gain), AdaLN projections five times smaller."""
    if len(shape) == 1 and name.endswith(".weight"):  # every 1-D weight of the DiT is an RMSNorm gain
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.02
    fan_in = shape[-1] if len(shape) > 1 else 1
    std = 1.0 / math.sqrt(fan_in)
    if ".adaln_proj." in name or name.startswith("norm_out.linear"):
        std *= 0.2
    return 0.0, std


def random_param(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One parameter of the random model, fp32, drawn on `device` (its generator's stream: a tensor drawn on
    a GPU differs from the same name and seed drawn on the CPU)."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
    mean, std = init_rule(name, shape)
    noise.mul_(std)  # in place: an AdaLN weight is 1 GB in fp32
    return noise.add_(mean) if mean else noise


def random_state(config: DiTConfig, seed: int):
    """(name, fp32 tensor) for every parameter of the full-AdaLN model `config` describes."""
    from .dit_reader import expected_shapes

    for name, shape in expected_shapes(config).items():
        yield name, random_param(name, shape, seed)
