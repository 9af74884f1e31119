"""Every fast kernel path against its reference at real H3 shapes, on one GPU; JSON to --out.

Usage (repository root on the GPU machine; optional wheels installed into /tmp/site first):
    python3 benchmarks/kernels_gpu.py --out $OUT/kernels_gpu.json [--seq 20480] [--iters 10] [--skip-pytest]

For each item: errors against the reference on fresh random inputs, then median CUDA-event times of the fast
path and the reference side by side. An item that cannot run here records "unavailable: <reason>"; an item
that breaks records "error: <exception>" and the run goes on. Total runtime is bounded (--budget seconds,
default 220): items left when it runs out record "skipped: time budget".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_package():
    """Make the checkout's `h3_spark/` importable without installing it (the GPU machine runs a bare copy)."""
    try:
        import h3_spark  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))


import_package()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from h3_spark.kernels.capability import KernelUnavailable  # noqa: E402

RESULTS: dict = {"items": {}}
START = time.time()
ARGS = None


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bench(fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over `iters` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def item(name: str):
    """Decorator: run one measurement, store its dict or why it could not run; never stop the whole run."""

    def wrap(fn):
        def run():
            if ARGS.only and name not in ARGS.only.split(","):
                return
            if time.time() - START > ARGS.budget:
                RESULTS["items"][name] = {"status": "skipped: time budget"}
                return
            t0 = time.time()
            try:
                out = fn()
                out = {"status": "ok", **(out or {})}
            except KernelUnavailable as exc:
                out = {"status": f"unavailable: {exc}"}
            except ImportError as exc:
                out = {"status": f"unavailable: {exc}"}
            except Exception as exc:  # one broken path must not hide the others
                out = {"status": f"error: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            out["wall_s"] = round(time.time() - t0, 2)
            RESULTS["items"][name] = out
            torch.cuda.empty_cache()
            print(f"[{time.time() - START:6.1f}s] {name}: {short(out)}", flush=True)

        ITEMS.append(run)
        return run

    return wrap


def short(d: dict) -> str:
    keep = {k: v for k, v in d.items() if k not in ("traceback", "report")}
    return json.dumps(keep, default=str)[:400]


ITEMS: list = []


# ------------------------------------------------------------------------------------------ attention
def attention_inputs():
    g = torch.Generator("cuda").manual_seed(0)
    s, h, d = ARGS.seq, ARGS.heads, ARGS.head_dim
    return [torch.randn(1, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


_ATT = {}


def attention_reference():
    """SDPA in fp32 on the first 4 heads (memory-efficient kernel): the error reference for every backend."""
    if "ref" not in _ATT:
        q, k, v = attention_inputs()
        _ATT["qkv"] = (q, k, v)
        hs = slice(0, 4)
        ref = F.scaled_dot_product_attention(*(t[:, :, hs].float().transpose(1, 2) for t in (q, k, v)))
        _ATT["ref"] = ref.transpose(1, 2)
        _ATT["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                        v.transpose(1, 2)), ARGS.iters)
    return _ATT["qkv"], _ATT["ref"]


def attention_item(name: str, settings_kw: dict | None = None):
    @item(f"attention/{name}")
    def run():
        from h3_spark.kernels.attention import resolve_attention
        from h3_spark.kernels.settings import KernelSettings, SolSettings

        settings = KernelSettings(head_slice_backend="cudnn_sdpa",
                                  sol=SolSettings(fallback="cudnn_sdpa"), **(settings_kw or {}))
        fn, chosen = resolve_attention(name, "cuda", settings)
        (q, k, v), ref = attention_reference()
        out = fn(q, k, v)
        err = rel_l2(out[:, :, :4], ref)
        ms = bench(lambda: fn(q, k, v), ARGS.iters)
        flops = 4 * ARGS.seq ** 2 * ARGS.head_dim * ARGS.heads
        return {"chosen": chosen, "exact": fn.exact, "rel_l2_vs_fp32": err, "ms": ms, "tflops": flops / ms / 1e9,
                "sdpa_default_ms": _ATT["sdpa_ms"], "speedup_vs_sdpa": _ATT["sdpa_ms"] / ms,
                "report": fn.describe()}

    return run


for _name in ("sdpa", "cudnn_sdpa", "fa3", "fa3_fp8", "sage2", "sage2-quality", "ck_int8", "sol_attn",
              "kj_head_sliced", "auto"):
    attention_item(_name)


@item("attention/fa3_fp8+fused_qk_prep")
def fa3_fp8_with_prep():
    """The low-bit path as the model runs it: raw q/k -> fused norm/RoPE/smooth/Hadamard/FP8 -> FA3 FP8."""
    from h3_spark.h3_model.dit.model import Attention, reference_qk_prep, rope_tables
    from h3_spark.kernels.attention import resolve_attention
    from h3_spark.kernels.qk_prep import FusedQKPrep

    fn, _ = resolve_attention("fa3_fp8", "cuda")
    exact, _ = resolve_attention("cudnn_sdpa", "cuda")
    (q, k, v), _ = attention_reference()
    a = Attention(16, ARGS.heads, ARGS.head_dim, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        a.norm_q.weight.uniform_(0.5, 1.5)
        a.norm_k.weight.uniform_(0.5, 1.5)
    rope = rope_tables(torch.randint(0, 64, (ARGS.seq, 3), device="cuda").float(), 16, 10000.0)
    out = {}
    with torch.no_grad():
        qr, kr = reference_qk_prep(a, q, k, rope)
        ref = exact(qr, kr, v)
        for label, hook in (("fp8_smooth_hadamard128", FusedQKPrep("fp8", True, 128)),
                            ("fp8_plain", FusedQKPrep("fp8", False, 0))):
            qp, kp = hook(a, q, k, rope)
            o = fn(qp, kp, v)
            out[label] = {"rel_l2_vs_exact_bf16": rel_l2(o, ref),
                          "prep_ms": bench(lambda: hook(a, q, k, rope), ARGS.iters),
                          "prep_plus_attention_ms": bench(lambda: fn(*hook(a, q, k, rope), v), ARGS.iters)}
        out["reference_prep_plus_cudnn_ms"] = bench(lambda: exact(*reference_qk_prep(a, q, k, rope), v), ARGS.iters)
    return out


# ------------------------------------------------------------------------------------------ Q/K preparation
@item("qk_prep")
def qk_prep():
    from h3_spark.h3_model.dit.model import rope_tables
    from h3_spark.kernels.qk_prep import prepare_heads, reference_prepare_heads

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, ARGS.seq, ARGS.heads, ARGS.head_dim, generator=g, device="cuda").mul(2).bfloat16()
    w = torch.rand(ARGS.head_dim, generator=g, device="cuda").add(0.5).bfloat16()
    rope = rope_tables(torch.randint(0, 64, (ARGS.seq, 3), device="cuda").float(), 16, 10000.0)
    out = {}
    for label, kw in (("bf16_exact", {}),
                      ("fp8_per_head_smooth_had128", dict(smooth=True, hadamard=128, fmt="fp8")),
                      ("fp8_per_head_bound_smooth_had128", dict(smooth=True, hadamard=128, fmt="fp8",
                                                                granularity="per_head_bound")),
                      ("fp8_per_head_had128_q", dict(hadamard=128, fmt="fp8")),
                      ("fp8_per_head_bound_had128_q", dict(hadamard=128, fmt="fp8", granularity="per_head_bound")),
                      ("fp8_v_no_norm", dict(norm=False, fmt="fp8")),
                      ("int8_per_block_smooth_had128", dict(smooth=True, hadamard=128, fmt="int8",
                                                            granularity="per_block")),
                      ("bf16_had128_for_sage", dict(hadamard=128))):
        tables = None if label.startswith("fp8_v") else rope  # V: no norm, no RoPE, as the model quantizes it
        a = prepare_heads(x, w, 1e-5, tables, **kw)
        b = reference_prepare_heads(x, w, 1e-5, tables, **kw)
        if isinstance(a, torch.Tensor):
            r = {"identical_fraction": (a == b).float().mean().item(), "rel_l2": rel_l2(a, b)}
        else:
            same = (a.data.view(torch.uint8) == b.data.view(torch.uint8)).float().mean().item()
            r = {"identical_codes": same, "dequant_rel_l2_vs_ref": rel_l2(a.dequantize(), b.dequantize()),
                 "dequant_rel_l2_vs_unquantized": rel_l2(a.dequantize(),
                                                         reference_prepare_heads(x, w, 1e-5, tables,
                                                                                 norm=kw.get("norm", True),
                                                                                 smooth=kw.get("smooth", False),
                                                                                 hadamard=kw.get("hadamard", 0))
                                                         .float())}
        r["fused_ms"] = bench(lambda: prepare_heads(x, w, 1e-5, tables, **kw), ARGS.iters)
        r["reference_ms"] = bench(lambda: reference_prepare_heads(x, w, 1e-5, tables, **kw), ARGS.iters)
        out[label] = r
    return out


@item("hadamard_shapes")
def hadamard_shapes():
    """The rotating Q/K passes (FP8, per-head scales, K smoothing, Hadamard 128) over launch choices: tokens
    per program and warps."""
    from h3_spark.h3_model.dit.model import rope_tables
    from h3_spark.kernels import qk_prep as qk

    g = torch.Generator("cuda").manual_seed(8)
    x = torch.randn(1, ARGS.seq, ARGS.heads, ARGS.head_dim, generator=g, device="cuda").mul(2).bfloat16()
    w = torch.rand(ARGS.head_dim, generator=g, device="cuda").add(0.5).bfloat16()
    rope = tuple(t.bfloat16() for t in rope_tables(torch.randint(0, 64, (ARGS.seq, 3), device="cuda").float(),
                                                   16, 10000.0))
    kw = dict(smooth=True, hadamard=128, fmt="fp8")
    want = qk.reference_prepare_heads(x, w, 1e-5, rope, **kw)
    saved = (qk.HADAMARD_TILE_TOKENS, qk.HADAMARD_WARPS)
    out = {}
    try:
        for tile in (32, 64, 128):
            for warps in (2, 4, 8):
                qk.HADAMARD_TILE_TOKENS, qk.HADAMARD_WARPS = tile, warps
                label = f"{tile}x{warps}"
                try:
                    got = qk.prepare_heads(x, w, 1e-5, rope, **kw)
                    out[label] = {"ms": bench(lambda: qk.prepare_heads(x, w, 1e-5, rope, **kw), ARGS.iters),
                                  "identical_codes": (got.data.view(torch.uint8) == want.data.view(torch.uint8))
                                  .float().mean().item(),
                                  "dequant_rel_l2_vs_ref": rel_l2(got.dequantize(), want.dequantize())}
                except Exception as exc:  # a launch shape the compiler refuses is a result too
                    out[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        qk.HADAMARD_TILE_TOKENS, qk.HADAMARD_WARPS = saved
    out["exact_one_pass_ms"] = bench(lambda: qk.prepare_heads(x, w, 1e-5, rope), ARGS.iters)
    out["floor_one_pass_ms"] = 2 * x.numel() * 2 / 4.3e12 * 1e3
    return out


@item("int8_qk_attention_quality")
def int8_qk_quality():
    """INT8 Q/K (per-block scales, K smoothing, Hadamard 128) dequantized into exact SDPA: the QK quantization
    error alone, as a quality gate for an INT8-QK kernel."""
    from h3_spark.kernels.qk_prep import reference_prepare_heads

    (q, k, v), _ = attention_reference()
    hs = slice(0, 8)
    q, k, v = (t[:, :, hs].contiguous() for t in (q, k, v))
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    out = {}
    for label, kw in (("plain", {}), ("smooth", dict(smooth=True)), ("smooth_had128", dict(smooth=True, hadamard=128))):
        qq = reference_prepare_heads(q, None, 0.0, None, norm=False, fmt="int8", granularity="per_block",
                                     hadamard=kw.get("hadamard", 0)).dequantize(torch.bfloat16)
        kk = reference_prepare_heads(k, None, 0.0, None, norm=False, fmt="int8", granularity="per_block",
                                     **kw).dequantize(torch.bfloat16)
        o = F.scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        out[label] = rel_l2(o, exact)
    return {"rel_l2_vs_bf16_sdpa": out}


# ------------------------------------------------------------------------------------------ modulation
@item("modulation")
def modulation():
    from h3_spark.kernels.references import RowModulation
    from h3_spark.kernels.modulation import FusedRowModulation

    d, s = ARGS.hidden, ARGS.seq
    g = torch.Generator("cuda").manual_seed(2)
    rows = torch.cat([torch.full((300,), 1), torch.full((1200,), 0), torch.full((400,), 5),
                      torch.full((s - 1900,), 3)]).cuda()
    table = torch.randn(9, 6 * d, generator=g, device="cuda").mul(0.3).bfloat16()
    shift, scale, gate, *_ = table.chunk(6, dim=-1)
    x = torch.randn(1, s, d, generator=g, device="cuda").mul(3).bfloat16()
    y = torch.randn(1, s, d, generator=g, device="cuda").bfloat16()
    norm = torch.nn.RMSNorm(d, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref, fused = RowModulation(rows, True), FusedRowModulation(rows, True)
    out = {}
    with torch.no_grad():
        a, b = fused.norm_modulate(norm, x, shift, scale), ref.norm_modulate(norm, x, shift, scale)
        ulp = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)).max().item()
        out["norm_modulate"] = {"identical_fraction": (a == b).float().mean().item(), "max_rel_diff": ulp,
                                "fused_ms": bench(lambda: fused.norm_modulate(norm, x, shift, scale), ARGS.iters),
                                "reference_ms": bench(lambda: ref.norm_modulate(norm, x, shift, scale), ARGS.iters)}
        a, b = fused.gated_add(x, gate, y), ref.gated_add(x, gate, y)
        out["gated_add"] = {"bit_identical": torch.equal(a, b),
                            "fused_ms": bench(lambda: fused.gated_add(x, gate, y), ARGS.iters),
                            "reference_ms": bench(lambda: ref.gated_add(x, gate, y), ARGS.iters)}
    bytes_nm = 2 * x.numel() * 2
    out["norm_modulate"]["fused_GBps"] = bytes_nm / out["norm_modulate"]["fused_ms"] / 1e6
    # Memory-bound floors at 4.3 TB/s: norm_modulate reads x and writes h; gated_add reads x, y, writes x.
    for name, nbytes in (("norm_modulate", bytes_nm), ("gated_add", 3 * x.numel() * 2)):
        out[name]["memory_floor_ms"] = nbytes / 4.3e12 * 1e3
        out[name]["fused_vs_floor"] = out[name]["fused_ms"] / out[name]["memory_floor_ms"]
    return out


@item("fused_producers")
def fused_producers():
    """One-pass row kernels against the passes they replace, S = --seq: the gated residual + RMSNorm +
    modulate pair, and SwiGLU writing e4m3 rows against fused_swiglu + quantize_rows."""
    from h3_spark.kernels.linear_fp8 import quantize_rows
    from h3_spark.kernels.modulation import FusedRowModulation
    from h3_spark.kernels.swiglu import fused_swiglu, swiglu_rows_fp8

    d, s = ARGS.hidden, ARGS.seq
    g = torch.Generator("cuda").manual_seed(7)
    rows = torch.randint(0, 9, (s,), generator=g, device="cuda").sort().values
    shift, scale, gate, *_ = torch.randn(9, 6 * d, generator=g, device="cuda").mul(0.3).bfloat16().chunk(6, dim=-1)
    x = torch.randn(1, s, d, generator=g, device="cuda").mul(3).bfloat16()
    y = torch.randn(1, s, d, generator=g, device="cuda").bfloat16()
    norm = torch.nn.RMSNorm(d, eps=1e-5).to("cuda", torch.bfloat16)
    mod = FusedRowModulation(rows, True)
    out = {}
    with torch.no_grad():
        def pair():
            r = mod.gated_add(x, gate, y)
            return r, mod.norm_modulate(norm, r, shift, scale)

        r0, h0 = pair()
        r1, h1 = mod.add_norm_modulate(x, gate, y, norm, shift, scale)
        out["add_norm_modulate"] = {
            "residual_bit_identical": torch.equal(r0, r1), "rows_identical": (h0 == h1).float().mean().item(),
            "two_passes_ms": bench(pair, ARGS.iters),
            "one_pass_ms": bench(lambda: mod.add_norm_modulate(x, gate, y, norm, shift, scale), ARGS.iters),
            "memory_floor_ms": 4 * x.numel() * 2 / 4.3e12 * 1e3}
        out["quantize_rows_hidden_ms"] = bench(lambda: quantize_rows(h1.view(-1, d)), ARGS.iters)
        up = torch.randn(s, 2 * 14336, generator=g, device="cuda").mul(2).bfloat16()
        qa, sa = quantize_rows(fused_swiglu(up))
        qb, sb = swiglu_rows_fp8(up)
        out["swiglu_fp8"] = {
            "codes_identical": (qa.view(torch.uint8) == qb.view(torch.uint8)).float().mean().item(),
            "scales_identical": torch.equal(sa, sb),
            "two_passes_ms": bench(lambda: quantize_rows(fused_swiglu(up)), ARGS.iters),
            "one_pass_ms": bench(lambda: swiglu_rows_fp8(up), ARGS.iters),
            "memory_floor_ms": (up.numel() * 2 + up.numel() // 2) / 4.3e12 * 1e3}
    for r in out.values():
        if isinstance(r, dict):
            r["one_pass_vs_floor"] = r["one_pass_ms"] / r["memory_floor_ms"]
    return out


@item("launch_shapes")
def launch_shapes():
    """The fused passes' launch shapes side by side: modulation (columns per step, warps; a step as wide as
    the row reads it once) and the Q/K kernel (warps; RoPE tables in fp32 or in the activation dtype)."""
    from h3_spark.h3_model.dit.model import rope_tables
    from h3_spark.kernels.references import RowModulation
    from h3_spark.kernels import modulation as mod
    from h3_spark.kernels import qk_prep as qk

    d, s = ARGS.hidden, ARGS.seq
    g = torch.Generator("cuda").manual_seed(6)
    rows = torch.randint(0, 9, (s,), generator=g, device="cuda").sort().values
    table = torch.randn(9, 6 * d, generator=g, device="cuda").mul(0.3).bfloat16()
    shift, scale, gate, *_ = table.chunk(6, dim=-1)
    x = torch.randn(1, s, d, generator=g, device="cuda").mul(3).bfloat16()
    y = torch.randn(1, s, d, generator=g, device="cuda").bfloat16()
    norm = torch.nn.RMSNorm(d, eps=1e-5).to("cuda", torch.bfloat16)
    ref = RowModulation(rows, True)
    out = {"modulation": {}, "qk_prep": {}}
    saved = (mod.BLOCK, mod.NUM_WARPS, qk.NUM_WARPS)
    try:
        with torch.no_grad():
            want_nm, want_ga = ref.norm_modulate(norm, x, shift, scale), ref.gated_add(x, gate, y)
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)):
                mod.BLOCK, mod.NUM_WARPS = block, warps
                fused = mod.FusedRowModulation(rows, True)
                out["modulation"][f"{block}x{warps}"] = {
                    "norm_modulate_ms": bench(lambda: fused.norm_modulate(norm, x, shift, scale), ARGS.iters),
                    "gated_add_ms": bench(lambda: fused.gated_add(x, gate, y), ARGS.iters),
                    "norm_modulate_identical": (fused.norm_modulate(norm, x, shift, scale) == want_nm).float().mean().item(),
                    "gated_add_bit_identical": torch.equal(fused.gated_add(x, gate, y), want_ga)}
            mod.BLOCK, mod.NUM_WARPS = saved[:2]
            h = torch.randn(1, s, ARGS.heads, ARGS.head_dim, generator=g, device="cuda").mul(2).bfloat16()
            w = torch.rand(ARGS.head_dim, generator=g, device="cuda").add(0.5).bfloat16()
            rope = rope_tables(torch.randint(0, 64, (s, 3), device="cuda").float(), 16, 10000.0)
            half = tuple(t.bfloat16() for t in rope)
            want = qk.reference_prepare_heads(h, w, 1e-5, rope)
            for warps in (4, 8, 16):
                qk.NUM_WARPS = warps
                for label, tables in (("fp32_tables", rope), ("bf16_tables", half)):
                    out["qk_prep"][f"warps{warps}_{label}"] = {
                        "ms": bench(lambda: qk.prepare_heads(h, w, 1e-5, tables), ARGS.iters),
                        "identical": (qk.prepare_heads(h, w, 1e-5, tables) == want).float().mean().item()}
    finally:
        mod.BLOCK, mod.NUM_WARPS, qk.NUM_WARPS = saved
    out["floors_ms"] = {"norm_modulate": 2 * x.numel() * 2 / 4.3e12 * 1e3, "gated_add": 3 * x.numel() * 2 / 4.3e12 * 1e3,
                        "qk_prep": 2 * h.numel() * 2 / 4.3e12 * 1e3}
    return out


@item("swiglu")
def swiglu():
    from h3_spark.kernels.swiglu import fused_swiglu, reference_swiglu

    g = torch.Generator("cuda").manual_seed(3)
    up = torch.randn(1, ARGS.seq, 2 * 14336, generator=g, device="cuda").mul(2).bfloat16()
    a, b = fused_swiglu(up), reference_swiglu(up)
    out = {"identical_fraction": (a == b).float().mean().item(),
           "max_abs_diff": (a.float() - b.float()).abs().max().item(),
           "fused_ms": bench(lambda: fused_swiglu(up), ARGS.iters),
           "reference_ms": bench(lambda: reference_swiglu(up), ARGS.iters),
           "memory_floor_ms": (up.numel() + up.numel() // 2) * 2 / 4.3e12 * 1e3}
    out["fused_vs_floor"] = out["fused_ms"] / out["memory_floor_ms"]
    return out


# ------------------------------------------------------------------------------------------ linears
GEMMS = {"to_q|to_k|to_v": (5376, 7168), "to_out": (7168, 5376), "fc1": (5376, 28672), "fc2": (14336, 5376)}


@item("qkv_projection_bf16")
def qkv_projection_bf16():
    """The exact path's Q/K/V projections: three GEMMs (the checkpoint's layout) against one GEMM on the
    concatenated weight, at the model's sequence length (--seq)."""
    g = torch.Generator("cuda").manual_seed(5)
    k, n = GEMMS["to_q|to_k|to_v"]
    x = torch.randn(ARGS.seq, k, generator=g, device="cuda").bfloat16()
    ws = [torch.randn(n, k, generator=g, device="cuda").mul(k ** -0.5).bfloat16() for _ in range(3)]
    fused = torch.cat(ws)
    three = bench(lambda: [torch.nn.functional.linear(x, w) for w in ws], ARGS.iters)
    one = bench(lambda: torch.nn.functional.linear(x, fused), ARGS.iters)
    flops = 2 * ARGS.seq * k * n * 3
    same = torch.equal(torch.nn.functional.linear(x, fused)[:, n:2 * n], torch.nn.functional.linear(x, ws[1]))
    out = {"three_gemms_ms": three, "one_fused_gemm_ms": one, "fused_speedup": three / one,
           "three_tflops": flops / three / 1e9, "fused_tflops": flops / one / 1e9, "fused_bit_identical": same}
    for label, (kk, nn) in GEMMS.items():
        w = torch.randn(nn, kk, generator=g, device="cuda").mul(kk ** -0.5).bfloat16()
        xx = x if kk == k else torch.randn(ARGS.seq, kk, generator=g, device="cuda").bfloat16()
        ms = bench(lambda: torch.nn.functional.linear(xx, w), ARGS.iters)
        out[f"{label}_ms"] = ms
        out[f"{label}_tflops"] = 2 * ARGS.seq * kk * nn / ms / 1e9
    return out


@item("linear_fp8")
def linear_fp8():
    from h3_spark.kernels.capability import require_cuda
    from h3_spark.kernels.linear_fp8 import Fp8Linear, quantize_rows, reference_quantize_rows

    require_cuda("H3_LINEAR=fp8", "cuda", minimum=(9, 0))
    m = ARGS.seq
    g = torch.Generator("cuda").manual_seed(3)
    out = {}
    for label, (k, n) in GEMMS.items():
        lin = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=g)
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        f8 = Fp8Linear.from_linear(lin)
        with torch.no_grad():
            y_bf16, y_fp8 = lin(x), f8(x)
            rows = slice(0, 2048)  # fp32 reference on a row subset keeps memory small
            xq, sx = reference_quantize_rows(x[rows])
            ref = ((xq.float() * sx) @ f8.dequantized_weight().t())
            xq_t, sx_t = quantize_rows(x)
            xq_r, sx_r = reference_quantize_rows(x)
            r = {"rel_l2_vs_fp8_reference": rel_l2(y_fp8[rows], ref), "rel_l2_vs_bf16": rel_l2(y_fp8, y_bf16),
                 "quantizer_bit_identical": bool(torch.equal(xq_t.view(torch.uint8), xq_r.view(torch.uint8))
                                                 and torch.equal(sx_t, sx_r)),
                 "bf16_ms": bench(lambda: lin(x), ARGS.iters), "fp8_ms": bench(lambda: f8(x), ARGS.iters),
                 "scaled_mm_only_ms": bench(lambda: torch._scaled_mm(xq_t, f8.weight.t(), scale_a=sx_t,
                                                                     scale_b=f8.weight_scale,
                                                                     out_dtype=torch.bfloat16), ARGS.iters),
                 "quantize_rows_ms": bench(lambda: quantize_rows(x), ARGS.iters),
                 "reference_quantize_ms": bench(lambda: reference_quantize_rows(x), ARGS.iters)}
        flops = 2 * m * k * n
        r["bf16_tflops"] = flops / r["bf16_ms"] / 1e9
        r["fp8_tflops_incl_quant"] = flops / r["fp8_ms"] / 1e9
        r["speedup"] = r["bf16_ms"] / r["fp8_ms"]
        out[label] = r
        del lin, f8, x, y_bf16, y_fp8, xq_t, xq_r
        torch.cuda.empty_cache()
    return out


@item("nvfp4")
def nvfp4():
    """On Hopper the FP4 GEMM cannot run (recorded); the activation quantizers still compile (software e2m1)
    and are compared byte for byte with comfy-kitchen's quantizer."""
    from h3_spark.kernels import nvfp4 as nv
    from h3_spark.kernels.dispatch import resolve_linear
    from h3_spark.kernels.settings import KernelSettings

    out = {}
    try:
        out["resolve_H3_LINEAR=nvfp4"] = resolve_linear(KernelSettings(linear="nvfp4"), torch.device("cuda"),
                                                        "nvfp4")[1]
    except KernelUnavailable as exc:
        out["resolve_H3_LINEAR=nvfp4"] = f"unavailable: {exc}"
    import comfy_kitchen as ck

    g = torch.Generator("cuda").manual_seed(4)
    x = torch.randn(ARGS.seq, ARGS.hidden, generator=g, device="cuda").mul(2).bfloat16()
    a = nv.quantize_nvfp4(x)
    q, s = ck.quantize_nvfp4(x, a.global_scale)
    out["quantize_vs_comfy_kitchen_identical_bytes"] = (a.packed == q).float().mean().item()
    out["scales_identical"] = bool(torch.equal(a.block_scales.view(torch.uint8), s.view(torch.uint8)))
    out["ours_ms"] = bench(lambda: nv.quantize_nvfp4(x, a.global_scale), ARGS.iters)
    out["comfy_kitchen_ms"] = bench(lambda: ck.quantize_nvfp4(x, a.global_scale), ARGS.iters)
    fc1 = torch.randn(ARGS.seq, 2 * 14336, generator=g, device="cuda").bfloat16()
    act = nv.swiglu_quantize_nvfp4(fc1)
    q, s = ck.quantize_nvfp4(nv.reference_swiglu(fc1), act.global_scale)
    out["swiglu_fused_identical_bytes"] = (act.packed == q).float().mean().item()
    out["swiglu_fused_ms"] = bench(lambda: nv.swiglu_quantize_nvfp4(fc1), ARGS.iters)
    out["swiglu_unfused_ms"] = bench(lambda: ck.quantize_nvfp4(nv.reference_swiglu(fc1), act.global_scale),
                                     ARGS.iters)
    return out


# ------------------------------------------------------------------------------------------ the model
@item("apply_kernels_model")
def model_level():
    """A 2-block full-width DiT at S ~ 4.7k: velocities and forward time per configuration vs all-off."""
    from h3_spark.h3_model.dit import layout
    from h3_spark.h3_model.dit.config import DiTConfig
    from h3_spark.h3_model.dit.model import H3DiT
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings

    torch.manual_seed(0)
    cfg = DiTConfig(num_layers=2, num_refiner_layers=1)
    model = H3DiT(cfg, dtype=torch.bfloat16, device="cuda").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    lay = layout.build_t2va(torch.ones(256, dtype=torch.long), 8, 34, 60, 200)
    ts, idx = lay.row_timesteps(0.5, 0.5, 0.5)
    g = torch.Generator("cuda").manual_seed(5)
    args = dict(hidden_states=torch.randn(1, lay.video_indices.numel(), cfg.video_patch_dim, generator=g, device="cuda"),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), cfg.audio_in_channels, generator=g,
                                                device="cuda"),
                encoder_hidden_states=torch.randn(1, lay.num_text, cfg.text_dim, generator=g, device="cuda"),
                token_tags=lay.token_tags.cuda(), position_ids=lay.position_ids.float().cuda(),
                video_indices=lay.video_indices.cuda(), audio_indices=lay.audio_indices.cuda(),
                text_indices=lay.text_indices.cuda(), timestep=ts.cuda(), timestep_indices=idx.cuda())
    out = {"seq": int(lay.position_ids.shape[0])}
    configs = [("reference_all_off", KernelSettings(attention="sdpa", modulation_fusion="off",
                                                    q_rms_rope_int8_fusion="off", linear="bf16")),
               ("auto", KernelSettings()),
               ("fa3_fp8+fp8_linears", KernelSettings(attention="fa3_fp8", linear="fp8"))]
    ref = None
    for label, settings in configs:
        try:
            report = apply_kernels(model, settings)
        except KernelUnavailable as exc:
            out[label] = f"unavailable: {exc}"
            continue
        with torch.no_grad():
            v, a = model(**args)
            ms = bench(lambda: model(**args), max(3, ARGS.iters // 2), warmup=1)
        entry = {"forward_ms": ms, "report": report}
        if ref is None:
            ref = (v, a)
        else:
            entry["video_rel_l2_vs_reference"] = rel_l2(v, ref[0])
            entry["audio_rel_l2_vs_reference"] = rel_l2(a, ref[1])
        out[label] = entry
    return out


@item("pytest_gpu")
def pytest_gpu():
    if ARGS.skip_pytest:
        return {"skipped": "--skip-pytest"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_kernels_gpu.py",
           "--import-mode=importlib", "-o", "addopts="]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    return {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}


def main(argv=None) -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--seq", type=int, default=20480)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=5376)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget", type=float, default=220.0, help="seconds after which remaining items are skipped")
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--only", default="", help="comma-separated item names to run (default: all)")
    ARGS = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    RESULTS["device"] = {"name": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
                         "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "fa3_fwd_interface", "flash_attn_interface", "sageattention", "comfy_kitchen"):
        try:
            m = __import__(mod)
            RESULTS["device"][mod] = getattr(m, "__version__", "importable")
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            RESULTS["device"][mod] = f"not importable: {type(exc).__name__}: {exc}"[:300]
    RESULTS["args"] = vars(ARGS)
    try:
        for run in ITEMS:
            run()
    finally:
        RESULTS["total_s"] = round(time.time() - START, 1)
        Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.out).write_text(json.dumps(RESULTS, indent=1, default=str))
        print(f"wrote {ARGS.out} ({RESULTS['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
