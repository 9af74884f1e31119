"""Pruned ("curve-form") AdaLN: fit ComfyUI's `adaln_t_table` from a full model.

In the full model every AdaLN projection reads a(t) = SiLU(time_embedder(sinusoid(t))), a
2688-wide vector that depends on the scalar t alone; as t runs over [0, 1] it traces a smooth
curve. A pruned file stores that curve in a k-dimensional basis instead:
- `adaln_t_table` [G, k]: coordinates c(t_i) at the grid t_i = i / (G - 1) (ComfyUI's grid:
  position = clamp(t, 0, 1) * (G - 1), then linear interpolation between the two nearest rows);
- every projection W a + b becomes W' c + b' with W' = W V (N x k) and b' = b + W mu.
We take mu = the mean of a(t_i) and V = the top-k right singular vectors of the centred samples,
so c(t_i) = V^T (a(t_i) - mu) is the best rank-k fit in the least-squares sense. The pruned model
then differs from the full one by (1) the discarded singular directions, reported as
`residual`, and (2) linear interpolation between grid points at off-grid t. Interpolation is
linear, so interpolating c equals projecting the interpolated a: no other error enters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import CheckpointError
from ..dit.config import DiTConfig


@dataclass
class CurveFit:
    table: torch.Tensor  # [G, k] fp32: what the file stores
    basis: torch.Tensor  # [D, k] fp64
    mean: torch.Tensor  # [D] fp64
    singular_values: torch.Tensor  # all of them, fp64

    @property
    def residual(self) -> float:
        """Relative Frobenius norm of the centred samples the k-dimensional basis leaves out."""
        s = self.singular_values
        k = self.basis.shape[1]
        return float(s[k:].norm() / s.norm().clamp_min(1e-300))


def grid_times(grid: int) -> torch.Tensor:
    return torch.arange(grid, dtype=torch.float64) / (grid - 1)


def adaln_curve(time_embedder: dict[str, torch.Tensor], config: DiTConfig, t: torch.Tensor) -> torch.Tensor:
    """a(t) = SiLU(time_embedder(sinusoid(t))) in fp64, from `time_embedder.linear_{1,2}.{weight,bias}`."""
    half = config.freq_dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0, dtype=torch.float64))
                      * torch.arange(half, dtype=torch.float64) / half)
    angles = t.double()[:, None] * freqs[None]
    x = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    p = {k: v.double() for k, v in time_embedder.items()}
    h = torch.nn.functional.silu(x @ p["time_embedder.linear_1.weight"].T + p["time_embedder.linear_1.bias"])
    temb = h @ p["time_embedder.linear_2.weight"].T + p["time_embedder.linear_2.bias"]
    return torch.nn.functional.silu(temb)


def fit_curve(time_embedder: dict[str, torch.Tensor], config: DiTConfig, grid: int, rank: int) -> CurveFit:
    if grid < 2:
        raise CheckpointError(f"the curve grid needs at least 2 points, got {grid}")
    if not 1 <= rank <= min(grid, config.time_embed_dim):
        raise CheckpointError(f"curve rank must lie in [1, {min(grid, config.time_embed_dim)}], got {rank}")
    samples = adaln_curve(time_embedder, config, grid_times(grid))
    mean = samples.mean(dim=0)
    _, s, vh = torch.linalg.svd(samples - mean, full_matrices=False)
    basis = vh[:rank].T.contiguous()
    # Fix each direction's sign (largest entry positive) so a fit is reproducible across LAPACKs.
    signs = torch.sign(basis.gather(0, basis.abs().argmax(dim=0, keepdim=True)))
    basis = basis * signs
    table = ((samples - mean) @ basis).to(torch.float32)
    return CurveFit(table, basis, mean, s)


def project(weight: torch.Tensor, bias: torch.Tensor, fit: CurveFit, rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """A full AdaLN projection (W [N, D], b [N]) -> its curve form (W V [N, k], b + W mu), fp32.

    Computed in fp64 for accuracy, `rows` at a time so a 96768 x 2688 weight adds ~0.2 GB, not 2 GB.
    """
    n, dev = weight.shape[0], weight.device
    basis, mean = fit.basis.to(dev), fit.mean.to(dev)
    w_out = torch.empty(n, fit.basis.shape[1], dtype=torch.float32, device=dev)
    b_out = torch.empty(n, dtype=torch.float32, device=dev)
    for start in range(0, n, rows):
        w = weight[start:start + rows].double()
        w_out[start:start + rows] = (w @ basis).to(torch.float32)
        b_out[start:start + rows] = (bias[start:start + rows].double() + w @ mean).to(torch.float32)
    return w_out, b_out
