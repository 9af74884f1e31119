"""Fused RMSNorm + per-segment AdaLN modulation, and the gated residual, as one Triton pass each.

The reference is `h3_model.dit.RowModulation`: RMSNorm (fp32 math, one rounding to the activation dtype),
then `x * (1 + scale[row]) + shift[row]`, then later `residual + gate[row] * y`, each elementwise op
rounding to the activation dtype. The kernel reads the table row of every token through the per-row
index (`adaln_rows`), so all segments go in one launch, and it rounds exactly where eager PyTorch
rounds. Result: modulate and gated_add are bit-identical to the reference; norm_modulate differs only
where the fp32 sum of squares lands on the other side of a rounding boundary (the summation order
differs), i.e. in a few elements per million by one unit of the last place (tests/test_kernels_modulation.py).

Traffic per call at S = 20,480, D = 5376, bf16: read x (+ y) once, write once: 0.44 GB (0.66 GB for the
gated add) instead of the reference's three to four passes.
"""

from __future__ import annotations

import torch

from ._triton import require_kernels, rnd, rnd_store, round_code, tl, triton  # noqa: F401  (used in the kernels)
from .qk_prep import norm_eps
from .references import RowModulation

# Launch shape per row: up to BLOCK columns per step (a step as wide as the row reads it once) and warps.
# 8192 x 8 measured best of six shapes at the released width on the H200 (perf-notes, third session).
BLOCK = 8192
NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _row_pass(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride, D: tl.constexpr,
                  MODE: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        # MODE 0: RMSNorm + modulate (a = shift, b = scale); 1: modulate only; 2: x + a * y (a = gate).
        # D (the hidden size) is a compile-time constant: one compile per model width.
        row = tl.program_id(0).to(tl.int64)
        r = tl.load(rows_ptr + row % S).to(tl.int64)
        xrow = x_ptr + row * D
        arow = a_ptr + r * tab_stride
        brow = b_ptr + r * tab_stride
        orow = out_ptr + row * D
        cols0 = tl.arange(0, BLOCK)
        if MODE == 0:
            if BLOCK >= D:  # the whole row in registers: one read
                x_all = tl.load(xrow + cols0, mask=cols0 < D, other=0.0).to(tl.float32)
                acc = x_all * x_all
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for off in range(0, D, BLOCK):
                    c = off + cols0
                    x = tl.load(xrow + c, mask=c < D, other=0.0).to(tl.float32)
                    acc += x * x
            rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / D + eps)
        for off in range(0, D, BLOCK):
            c = off + cols0
            m = c < D
            if MODE == 0 and BLOCK >= D:
                x = x_all
            else:
                x = tl.load(xrow + c, mask=m, other=0.0).to(tl.float32)
            if MODE == 2:
                g = tl.load(arow + c, mask=m, other=0.0).to(tl.float32)
                yv = tl.load(y_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
                o = rnd_store(x + rnd(g * yv, RND), RND)
            else:
                if MODE == 0:
                    o = _norm_modulate(x, c, m, rstd, w_ptr, arow, brow, HAS_W, RND)
                else:
                    sc = tl.load(brow + c, mask=m, other=0.0).to(tl.float32)
                    sh = tl.load(arow + c, mask=m, other=0.0).to(tl.float32)
                    o = rnd_store(rnd(x * rnd(1.0 + sc, RND), RND) + sh, RND)
            tl.store(orow + c, o.to(out_ptr.dtype.element_ty), mask=m)

    # One named kernel per operation, so a profile tells them apart.
    @triton.jit
    def _norm_modulate_kernel(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride,
                              D: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        _row_pass(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride, D, 0, HAS_W, RND, BLOCK)

    @triton.jit
    def _modulate_kernel(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride,
                         D: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        _row_pass(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride, D, 1, HAS_W, RND, BLOCK)

    @triton.jit
    def _gated_add_kernel(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride,
                          D: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        _row_pass(x_ptr, y_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride, D, 2, HAS_W, RND, BLOCK)

    @triton.jit
    def _norm_modulate(x, c, m, rstd, w_ptr, arow, brow, HAS_W: tl.constexpr, RND: tl.constexpr):
        # RMSNorm (fp32 math, one rounding) then x * (1 + scale) + shift, rounding where eager does; the
        # last rounding is the caller's store.
        v = x * rstd
        if HAS_W:
            v = v * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        v = rnd(v, RND)
        sc = tl.load(brow + c, mask=m, other=0.0).to(tl.float32)
        sh = tl.load(arow + c, mask=m, other=0.0).to(tl.float32)
        return rnd_store(rnd(v * rnd(1.0 + sc, RND), RND) + sh, RND)

    @triton.jit
    def _add_norm_kernel(x_ptr, y_ptr, g_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, res_ptr, out_ptr, S, eps,
                         tab_stride, D: tl.constexpr, HAS_W: tl.constexpr, RND: tl.constexpr, BLOCK: tl.constexpr):
        # One whole row per program (BLOCK >= D): the gated residual x + g * y (written to res_ptr), then
        # RMSNorm + modulate of that sum from the same registers. (Writing e4m3 rows here as well measured
        # slower than this pass plus quantize_rows on the H200: 0.52 vs 0.44 ms at S = 19,540.)
        row = tl.program_id(0).to(tl.int64)
        r = tl.load(rows_ptr + row % S).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < D
        x = tl.load(x_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r * tab_stride + c, mask=m, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
        x = rnd(x + rnd(g * yv, RND), RND)
        tl.store(res_ptr + row * D + c, x.to(res_ptr.dtype.element_ty), mask=m)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        o = _norm_modulate(x, c, m, rstd, w_ptr, a_ptr + r * tab_stride, b_ptr + r * tab_stride, HAS_W, RND)
        tl.store(out_ptr + row * D + c, o.to(out_ptr.dtype.element_ty), mask=m)


def _table_rows(t: torch.Tensor, d: int) -> tuple[torch.Tensor, int]:
    """A (n_rows, d) view whose last dim is unit-stride (table.chunk() views are), and its row stride."""
    if t.ndim != 2 or t.shape[1] != d:
        raise ValueError(f"modulation vectors must be (table rows, {d}), got {list(t.shape)}")
    if t.stride(1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


class FusedRowModulation(RowModulation):
    """RowModulation whose three operations run as one Triton pass each (all segments per launch)."""

    def __init__(self, rows: torch.Tensor, use_segments: bool):
        super().__init__(rows, use_segments)
        self._rows32: dict[torch.device, torch.Tensor] = {}

    def _row_index(self, device: torch.device) -> torch.Tensor:
        idx = self._rows32.get(device)
        if idx is None:
            idx = self._rows32[device] = self.rows.to(device=device, dtype=torch.int32).contiguous()
        return idx

    def _operands(self, x: torch.Tensor, *tables: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """Checked (batch, seq, hidden) rows and their table views sharing one row stride."""
        require_kernels("H3_MODULATION_FUSION")
        if x.ndim != 3:
            raise ValueError(f"expected (batch, seq, hidden), got {list(x.shape)}")
        d = x.shape[-1]
        if self.rows.numel() != x.shape[1]:
            raise ValueError(f"{self.rows.numel()} row indices for a sequence of {x.shape[1]}")
        views = [_table_rows(t, d) for t in tables]
        if len({stride for _, stride in views}) > 1:
            views = [(t.contiguous(), d) for t, _ in views]
        return x.contiguous(), [t for t, _ in views], views[0][1]

    def _launch(self, mode: int, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, y=None, norm=None):
        x, tables, tab_stride = self._operands(x, a, *([b] if b is not None else []))
        a, b = tables[0], tables[-1]
        bsz, s, d = x.shape
        out = torch.empty_like(x)
        w = norm.weight if norm is not None else None
        eps = norm_eps(norm, x.dtype) if norm is not None else 0.0
        dummy = x
        kernel = (_norm_modulate_kernel, _modulate_kernel, _gated_add_kernel)[mode]
        kernel[(bsz * s,)](
            x, y.contiguous() if y is not None else dummy, w if w is not None else dummy, a, b,
            self._row_index(x.device), out, s, eps, tab_stride, D=d,
            HAS_W=w is not None, RND=round_code(x.dtype), BLOCK=min(BLOCK, triton.next_power_of_2(d)),
            num_warps=NUM_WARPS)
        return out

    def norm_modulate(self, norm, x, shift, scale):
        return self._launch(0, x, shift, scale, norm=norm)

    def modulate(self, x, shift, scale):
        return self._launch(1, x, shift, scale)

    def gated_add(self, residual, gate, y):
        if y.shape != residual.shape:
            raise ValueError(f"gated_add: update {list(y.shape)} does not match the residual {list(residual.shape)}")
        return self._launch(2, residual, gate, None, y=y)

    def add_norm_modulate(self, residual, gate, y, norm, shift, scale):
        """The gated residual and the next RMSNorm + modulate in one pass over whole rows (the new residual
        is read once); rows wider than one program holds take the two passes."""
        if residual.shape[-1] > BLOCK:
            return super().add_norm_modulate(residual, gate, y, norm, shift, scale)
        if y.shape != residual.shape:
            raise ValueError(f"gated_add: update {list(y.shape)} does not match the residual {list(residual.shape)}")
        x, (shift, scale, gate), tab_stride = self._operands(residual, shift, scale, gate)
        bsz, s, d = x.shape
        new_residual, out = torch.empty_like(x), torch.empty_like(x)
        w = norm.weight
        eps = norm_eps(norm, x.dtype)
        if x.numel():
            _add_norm_kernel[(bsz * s,)](
                x, y.contiguous(), gate, w if w is not None else x, shift, scale, self._row_index(x.device),
                new_residual, out, s, eps, tab_stride, D=d, HAS_W=w is not None, RND=round_code(x.dtype),
                BLOCK=triton.next_power_of_2(d), num_warps=NUM_WARPS)
        return new_residual, out
