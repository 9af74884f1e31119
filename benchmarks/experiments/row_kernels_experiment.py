"""Experiment behind docs/perf-notes.md (sixth session), kept so its receipt can be re-run (GPU only):

  python benchmarks/experiments/row_kernels_experiment.py OUT.json

1. Row-kernel variants side by side with the production kernels at S = 19,540, D = 5376, bf16, each
   checked against the production output: the last rounding left to the store (FINAL=False, what
   `rnd_store` shipped), and 2/4/8 rows per program with table rows gathered per row or shared
   (the shared form did not compile as written; its error is recorded).
2. FlashAttention-3 bf16 at S alone, then inside a loop of the block's six bf16 GEMMs, with the SM
   clock and board power read from nvidia-smi (the power limit explains the in-model rate).

Receipt: receipts/h200/row-kernels-experiment.json (run at e3ee8fd, before rnd_store; one H200 call).
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for kernels_gpu
import kernels_gpu  # noqa: E402
from h3_spark.kernels._triton import round_bf16
from h3_spark.kernels.modulation import FusedRowModulation

S = int(os.environ.get("SEQ", "19540"))
D = 5376
ITERS = 30


def bench(fn, iters=ITERS, warmup=3):
    return kernels_gpu.bench(fn, iters, warmup)  # median CUDA-event ms, as the kernel receipts take them


@triton.jit
def _rnd(v):
    return round_bf16(v)


@triton.jit
def _modulate2(v, sc, sh, FINAL: tl.constexpr):
    o = _rnd(v * _rnd(1.0 + sc)) + sh
    if FINAL:
        o = _rnd(o)
    return o


@triton.jit
def _nm_kernel(x_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, N, S, eps, tab_stride, D: tl.constexpr,
               ROWS: tl.constexpr, BLOCK: tl.constexpr, SHARE: tl.constexpr, FINAL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ri = pid * ROWS + tl.arange(0, ROWS)
    valid = ri < N
    r = tl.load(rows_ptr + ri % S, mask=valid, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    cm = c < D
    m2 = valid[:, None] & cm[None, :]
    x = tl.load(x_ptr + ri[:, None] * D + c[None, :], mask=m2, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    v = _rnd(x * rstd[:, None] * w[None, :])
    if SHARE:
        r0 = tl.load(rows_ptr + (pid * ROWS) % S).to(tl.int64)
        rr = tl.where(valid, r, r0)
        if tl.min(rr, axis=0) == tl.max(rr, axis=0):
            sc = tl.load(b_ptr + r0 * tab_stride + c, mask=cm, other=0.0).to(tl.float32)
            sh = tl.load(a_ptr + r0 * tab_stride + c, mask=cm, other=0.0).to(tl.float32)
            o = _rnd(v * _rnd(1.0 + sc)[None, :]) + sh[None, :]
        else:
            sc = tl.load(b_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
            sh = tl.load(a_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
            o = _rnd(v * _rnd(1.0 + sc)) + sh
        if FINAL:
            o = _rnd(o)
    else:
        sc = tl.load(b_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        sh = tl.load(a_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        o = _modulate2(v, sc, sh, FINAL)
    tl.store(out_ptr + ri[:, None] * D + c[None, :], o.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _anm_kernel(x_ptr, y_ptr, g_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, res_ptr, out_ptr, N, S, eps, tab_stride,
                D: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SHARE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ri = pid * ROWS + tl.arange(0, ROWS)
    valid = ri < N
    r = tl.load(rows_ptr + ri % S, mask=valid, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    cm = c < D
    m2 = valid[:, None] & cm[None, :]
    off = ri[:, None] * D + c[None, :]
    x = tl.load(x_ptr + off, mask=m2, other=0.0).to(tl.float32)
    yv = tl.load(y_ptr + off, mask=m2, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    r0 = tl.load(rows_ptr + (pid * ROWS) % S).to(tl.int64)
    rr = tl.where(valid, r, r0)
    if SHARE and tl.min(rr, axis=0) == tl.max(rr, axis=0):
        g = tl.load(g_ptr + r0 * tab_stride + c, mask=cm, other=0.0).to(tl.float32)
        x = _rnd(x + _rnd(g[None, :] * yv))
        tl.store(res_ptr + off, x.to(res_ptr.dtype.element_ty), mask=m2)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        v = _rnd(x * rstd[:, None] * w[None, :])
        sc = tl.load(b_ptr + r0 * tab_stride + c, mask=cm, other=0.0).to(tl.float32)
        sh = tl.load(a_ptr + r0 * tab_stride + c, mask=cm, other=0.0).to(tl.float32)
        o = _rnd(v * _rnd(1.0 + sc)[None, :]) + sh[None, :]
    else:
        g = tl.load(g_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        x = _rnd(x + _rnd(g * yv))
        tl.store(res_ptr + off, x.to(res_ptr.dtype.element_ty), mask=m2)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        v = _rnd(x * rstd[:, None] * w[None, :])
        sc = tl.load(b_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        sh = tl.load(a_ptr + r[:, None] * tab_stride + c[None, :], mask=m2, other=0.0).to(tl.float32)
        o = _rnd(v * _rnd(1.0 + sc)) + sh
    tl.store(out_ptr + off, o.to(out_ptr.dtype.element_ty), mask=m2)


def main(path):
    out = {"S": S, "D": D}
    g = torch.Generator("cuda").manual_seed(2)
    layouts = {
        "4seg": torch.cat([torch.full((300,), 1), torch.full((1200,), 0), torch.full((400,), 5),
                           torch.full((S - 1900,), 3)]).cuda(),
        "9seg_sorted": torch.randint(0, 9, (S,), generator=g, device="cuda").sort().values,
        "random": torch.randint(0, 9, (S,), generator=g, device="cuda"),
    }
    table = torch.randn(9, 6 * D, generator=g, device="cuda").mul(0.3).bfloat16()
    shift, scale, gate, *_ = table.chunk(6, dim=-1)
    x = torch.randn(1, S, D, generator=g, device="cuda").mul(3).bfloat16()
    y = torch.randn(1, S, D, generator=g, device="cuda").bfloat16()
    norm = torch.nn.RMSNorm(D, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    stride = table.stride(0)
    out["floors_ms"] = {"norm_modulate": 2 * x.numel() * 2 / 4.3e12 * 1e3,
                        "add_norm_modulate": 4 * x.numel() * 2 / 4.3e12 * 1e3}
    for lname, rows in layouts.items():
        res = out[lname] = {}
        mod = FusedRowModulation(rows, True)
        idx = rows.to(torch.int32).contiguous()
        with torch.no_grad():
            want = mod.norm_modulate(norm, x, shift, scale)
            res["nm_prod"] = {"ms": bench(lambda: mod.norm_modulate(norm, x, shift, scale))}
            for rows_pp, warps, share, final in ((1, 8, False, True), (1, 8, False, False), (2, 8, False, False),
                                                 (2, 16, False, False), (2, 8, True, False), (2, 16, True, False),
                                                 (4, 16, True, False), (4, 32, True, False), (4, 16, False, False),
                                                 (8, 32, True, False)):
                o = torch.empty_like(x)

                def run():
                    _nm_kernel[(triton.cdiv(S, rows_pp),)](x, norm.weight, shift, scale, idx, o, S, S, 1e-5, stride,
                                                          D=D, ROWS=rows_pp, BLOCK=8192, SHARE=share, FINAL=final,
                                                          num_warps=warps)
                name = f"nm_r{rows_pp}_w{warps}_{'share' if share else 'gather'}{'_final' if final else ''}"
                try:
                    run()
                    torch.cuda.synchronize()
                    res[name] = {"ms": bench(run), "identical": (o == want).float().mean().item(),
                                 "max_abs": (o.float() - want.float()).abs().max().item()}
                except Exception as exc:  # noqa: BLE001
                    res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(lname, name, res[name], flush=True)
            wr, wo = mod.add_norm_modulate(x, gate, y, norm, shift, scale)
            res["anm_prod"] = {"ms": bench(lambda: mod.add_norm_modulate(x, gate, y, norm, shift, scale))}
            for rows_pp, warps, share in ((1, 8, False), (2, 16, True), (2, 16, False), (4, 16, True), (4, 32, True),
                                          (2, 8, True)):
                ro, o = torch.empty_like(x), torch.empty_like(x)

                def run():
                    _anm_kernel[(triton.cdiv(S, rows_pp),)](x, y, gate, norm.weight, shift, scale, idx, ro, o, S, S,
                                                           1e-5, stride, D=D, ROWS=rows_pp, BLOCK=8192, SHARE=share,
                                                           num_warps=warps)
                name = f"anm_r{rows_pp}_w{warps}_{'share' if share else 'gather'}"
                try:
                    run()
                    torch.cuda.synchronize()
                    res[name] = {"ms": bench(run), "residual_identical": torch.equal(ro, wr),
                                 "identical": (o == wo).float().mean().item()}
                except Exception as exc:  # noqa: BLE001
                    res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(lname, name, res[name], flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    out["fa3_context"] = fa3_context()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def clocks():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return str(exc)


def fa3_context():
    """FA3 bf16 at S alone, then inside a loop of the block's six bf16 GEMMs (as in the model)."""
    try:
        import fa3_fwd_interface as fa3
    except ImportError as exc:
        return {"error": str(exc)}
    g = torch.Generator("cuda").manual_seed(5)
    q, k, v = (torch.randn(1, S, 56, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    flops = 4 * S * S * 128 * 56
    res = {"clocks_idle": clocks()}
    ms = bench(lambda: fa3.flash_attn_func(q, k, v, causal=False), iters=20)
    res["alone_ms"], res["alone_tflops"] = ms, flops / ms / 1e9
    res["clocks_after_alone"] = clocks()
    h = torch.randn(S, 5376, generator=g, device="cuda").bfloat16()
    wq = torch.randn(7168, 5376, generator=g, device="cuda").bfloat16() * 0.01
    wo = torch.randn(5376, 7168, generator=g, device="cuda").bfloat16() * 0.01
    w1 = torch.randn(28672, 5376, generator=g, device="cuda").bfloat16() * 0.01
    w2 = torch.randn(5376, 14336, generator=g, device="cuda").bfloat16() * 0.01
    a_times, blocks = [], []
    for it in range(40):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        e[0].record()
        for _ in range(3):
            torch.nn.functional.linear(h, wq)
        e[1].record()
        fa3.flash_attn_func(q, k, v, causal=False)
        e[2].record()
        a = torch.nn.functional.linear(torch.randn_like(q.view(S, 7168)) if it < 0 else q.view(S, 7168), wo)
        u = torch.nn.functional.linear(a, w1)
        torch.nn.functional.linear(u[:, :14336], w2)
        e[3].record()
        e[3].synchronize()
        a_times.append(e[1].elapsed_time(e[2]))
        blocks.append(e[0].elapsed_time(e[3]))
        if it == 20:
            res["clocks_in_loop"] = clocks()
    res["in_loop_ms"] = statistics.median(a_times[5:])
    res["in_loop_tflops"] = flops / res["in_loop_ms"] / 1e9
    res["block_ms"] = statistics.median(blocks[5:])
    ms2 = bench(lambda: fa3.flash_attn_func(q, k, v, causal=False), iters=20)
    res["alone_again_ms"] = ms2
    res["clocks_end"] = clocks()
    print("fa3", res, flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1])
