"""Full-size random weights built directly on the device.

Random weights do not change the timing of a dense model (same shapes, same kernels); results
made this way say so. Weights are N(0, 0.02), norm weights N(1, 0.02): never zeros.
"""

from __future__ import annotations

import torch

from ..h3_model.config import DiTConfig
from ..h3_model.dit import H3DiT, keeps_fp32


@torch.no_grad()
def synthetic_dit(config: DiTConfig, dtype: torch.dtype, device: str, seed: int = 0) -> H3DiT:
    model = H3DiT(config, dtype=dtype, device="meta")
    gen = torch.Generator(device=device).manual_seed(seed)

    def tensors():
        for name, param in model.named_parameters():
            target = torch.float32 if keeps_fp32(name, config) else dtype
            value = torch.empty(param.shape, dtype=target, device=device)
            value.normal_(1.0 if "norm" in name and name.endswith("weight") and param.ndim == 1 else 0.0, 0.02,
                          generator=gen)
            yield name, value

    model.load_state(tensors(), device=device)
    return model.eval()
