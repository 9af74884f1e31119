"""Experiment behind docs/perf-notes.md (seventh session), kept so its receipt can be re-run (GPU only):

  python benchmarks/experiments/table_rows_experiment.py OUT.json

Question: do our row kernels lose their time re-reading the per-token tables? The production norm +
modulate reads, per token, the RMSNorm gain and one AdaLN shift and scale row (3 x D values) from L2 besides
its own row of x; the exact Q/K pass reads, per token and head, a RoPE cos and sin row besides its 128
values. Variants side by side with the production kernels, each checked bit for bit against them:
1. norm + modulate over tiles of T consecutive tokens that share one table row (a segment of the packed
   layout): the gain, 1 + scale and shift are loaded once per tile, then a loop over the tile's rows;
2. the exact Q/K pass (RMSNorm + partial RoPE) with HB heads per program: the cos / sin tile is loaded
   once and used for HB heads;
3. norm + modulate with the row in power-of-two pieces (5376 = 4096 + 1024 + 256) instead of one 8192-wide
   block with a third of its lanes masked (ONLY=split_items runs this item alone).
S = 19,540 tokens, D = 5376, 56 heads of 128, bf16, as the t2va contract.
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for kernels_gpu
import kernels_gpu  # noqa: E402
from h3_spark.h3_model.dit.model import rope_tables
from h3_spark.kernels._triton import rnd, rnd_store
from h3_spark.kernels.modulation import FusedRowModulation
from h3_spark.kernels.qk_prep import prepare_heads

S = int(os.environ.get("SEQ", "19540"))
D = 5376
H, HD, R = 56, 128, 96
ITERS = 30


def bench(fn):
    return kernels_gpu.bench(fn, ITERS, 3)


@triton.jit
def _nm_tiles(x_ptr, w_ptr, a_ptr, b_ptr, tiles_ptr, out_ptr, eps, tab_stride, D: tl.constexpr,
              T: tl.constexpr, BLOCK: tl.constexpr, KEEP_BF16: tl.constexpr):
    pid = tl.program_id(0)
    start = tl.load(tiles_ptr + pid * 3).to(tl.int64)
    count = tl.load(tiles_ptr + pid * 3 + 1)
    r = tl.load(tiles_ptr + pid * 3 + 2).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < D
    w = tl.load(w_ptr + c, mask=m, other=0.0)
    sc1 = rnd(1.0 + tl.load(b_ptr + r * tab_stride + c, mask=m, other=0.0).to(tl.float32), 1)
    sh = tl.load(a_ptr + r * tab_stride + c, mask=m, other=0.0)
    if KEEP_BF16:  # exact: 1 + scale was rounded to bf16 already
        sc1 = sc1.to(tl.bfloat16)
    else:
        w = w.to(tl.float32)
        sh = sh.to(tl.float32)
    for i in range(T):
        row = start + i
        mi = m & (i < count)
        x = tl.load(x_ptr + row * D + c, mask=mi, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        v = rnd(x * rstd * w.to(tl.float32), 1)
        o = rnd_store(rnd(v * sc1.to(tl.float32), 1) + sh.to(tl.float32), 1)
        tl.store(out_ptr + row * D + c, o.to(out_ptr.dtype.element_ty), mask=mi)


@triton.jit
def _qk_heads(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, S, R, eps, sxs, sxh, sos, soh, scs, HB: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    rmask = rows < S
    m = rmask[:, None] & (d < BLOCK_D)[None, :]
    half = R // 2
    partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
    rot = d < R
    tmask = rmask[:, None] & rot[None, :]
    c = tl.load(cos_ptr + rows[:, None] * scs + d[None, :], mask=tmask, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + rows[:, None] * scs + d[None, :], mask=tmask, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    w = tl.load(w_ptr + d).to(tl.float32)
    wp = tl.load(w_ptr + partner).to(tl.float32)
    for j in range(HB):
        h = pid_h * HB + j
        base = x_ptr + h * sxh
        x = tl.load(base + rows[:, None] * sxs + d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / BLOCK_D + eps)
        y = rnd(x * rstd[:, None] * w[None, :], 1)
        xp = tl.load(base + rows[:, None] * sxs + partner[None, :], mask=m, other=0.0).to(tl.float32)
        yp = rnd(xp * rstd[:, None] * wp[None, :], 1)
        a = rnd(y * c, 1)
        p = rnd((yp * sign[None, :]) * sn, 1)
        y = tl.where(rot[None, :], rnd(a + p, 1), y)
        tl.store(out_ptr + h * soh + rows[:, None] * sos + d[None, :], rnd_store(y, 1).to(tl.bfloat16), mask=m)


@triton.jit
def _nm_part(x_ptr, w_ptr, arow, brow, orow, row, c, rstd, D: tl.constexpr):
    m = c < D
    x = tl.load(x_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
    v = rnd(x * rstd * tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32), 1)
    sc = tl.load(brow + c, mask=m, other=0.0).to(tl.float32)
    sh = tl.load(arow + c, mask=m, other=0.0).to(tl.float32)
    o = rnd_store(rnd(v * rnd(1.0 + sc, 1), 1) + sh, 1)
    tl.store(orow + c, o.to(tl.bfloat16), mask=m)


@triton.jit
def _nm_split(x_ptr, w_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, S, eps, tab_stride, D: tl.constexpr,
              B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    # The row as up to three power-of-two pieces (5376 = 4096 + 1024 + 256): no idle lanes, where one
    # 8192-wide block leaves a third of them masked.
    row = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + row % S).to(tl.int64)
    c1 = tl.arange(0, B1)
    x1 = tl.load(x_ptr + row * D + c1, mask=c1 < D, other=0.0).to(tl.float32)
    acc = tl.sum(x1 * x1, axis=0)
    if B2 > 0:
        c2 = B1 + tl.arange(0, B2)
        x2 = tl.load(x_ptr + row * D + c2, mask=c2 < D, other=0.0).to(tl.float32)
        acc += tl.sum(x2 * x2, axis=0)
    if B3 > 0:
        c3 = B1 + B2 + tl.arange(0, B3)
        x3 = tl.load(x_ptr + row * D + c3, mask=c3 < D, other=0.0).to(tl.float32)
        acc += tl.sum(x3 * x3, axis=0)
    rstd = 1.0 / tl.sqrt_rn(acc / D + eps)
    arow = a_ptr + r * tab_stride
    brow = b_ptr + r * tab_stride
    orow = out_ptr + row * D
    _nm_part(x_ptr, w_ptr, arow, brow, orow, row, c1, rstd, D)
    if B2 > 0:
        _nm_part(x_ptr, w_ptr, arow, brow, orow, row, B1 + tl.arange(0, B2), rstd, D)
    if B3 > 0:
        _nm_part(x_ptr, w_ptr, arow, brow, orow, row, B1 + B2 + tl.arange(0, B3), rstd, D)


def norm_inputs(seed: int):
    """The t2va contract's packed rows (text, video, audio segments; one timestep: 3 table rows), an AdaLN
    table, x and an RMSNorm with gains away from 1."""
    g = torch.Generator("cuda").manual_seed(seed)
    rows = torch.cat([torch.full((256,), 1), torch.full((S - 256 - 1_240,), 0), torch.full((1_240,), 2)]).cuda()
    table = torch.randn(3, 6 * D, generator=g, device="cuda").mul(0.3).bfloat16()
    x = torch.randn(1, S, D, generator=g, device="cuda").mul(3).bfloat16()
    norm = torch.nn.RMSNorm(D, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return rows, table, x, norm


def split_items(out: dict) -> None:
    rows, table, x, norm = norm_inputs(5)
    shift, scale = table.chunk(6, dim=-1)[:2]
    mod = FusedRowModulation(rows, True)
    idx = rows.to(torch.int32).contiguous()
    res = out["norm_modulate_split"] = {"floor_ms": 2 * x.numel() * 2 / 4.3e12 * 1e3}
    with torch.no_grad():
        want = mod.norm_modulate(norm, x, shift, scale)
        res["production"] = {"ms": bench(lambda: mod.norm_modulate(norm, x, shift, scale))}
        for pieces in ((4096, 1024, 256), (4096, 2048, 0), (2048, 2048, 2048)):
            for warps in (4, 8, 16):
                o = torch.empty_like(x)

                def run():
                    _nm_split[(S,)](x, norm.weight, shift, scale, idx, o, S, 1e-5, table.stride(0), D=D,
                                    B1=pieces[0], B2=pieces[1], B3=pieces[2], num_warps=warps)
                name = f"split{'+'.join(str(p) for p in pieces if p)}_w{warps}"
                try:
                    run()
                    torch.cuda.synchronize()
                    res[name] = {"ms": bench(run), "elements_differing": int((o != want).sum()),
                                 "max_abs_diff": float((o.float() - want.float()).abs().max())}
                except Exception as exc:  # noqa: BLE001
                    res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(name, res[name], flush=True)


def segment_tiles(rows: torch.Tensor, t: int) -> torch.Tensor:
    """(start, count, table row) per tile of at most t consecutive tokens with one table row."""
    r = rows.cpu()
    change = torch.nonzero(r[1:] != r[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), r.numel()]
    tiles = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        for a in range(s, e, t):
            tiles.append((a, min(t, e - a), int(r[s])))
    return torch.tensor(tiles, dtype=torch.int32, device=rows.device)


def norm_modulate_items(out: dict) -> None:
    rows, table, x, norm = norm_inputs(3)
    shift, scale = table.chunk(6, dim=-1)[:2]
    mod = FusedRowModulation(rows, True)
    res = out["norm_modulate"] = {"floor_ms": 2 * x.numel() * 2 / 4.3e12 * 1e3}
    with torch.no_grad():
        want = mod.norm_modulate(norm, x, shift, scale)
        res["production"] = {"ms": bench(lambda: mod.norm_modulate(norm, x, shift, scale))}
        for t in (1, 2, 4, 8, 16, 32):
            tiles = segment_tiles(rows, t)
            for warps in (8, 16):
                for keep in (False, True):
                    o = torch.empty_like(x)

                    def run():
                        _nm_tiles[(tiles.shape[0],)](x, norm.weight, shift, scale, tiles, o, 1e-5,
                                                     table.stride(0), D=D, T=t, BLOCK=8192, KEEP_BF16=keep,
                                                     num_warps=warps)
                    name = f"tiles{t}_w{warps}{'_bf16' if keep else ''}"
                    try:
                        run()
                        torch.cuda.synchronize()
                        res[name] = {"ms": bench(run), "bit_identical": bool(torch.equal(o, want))}
                    except Exception as exc:  # noqa: BLE001 - an experiment records what did not run
                        res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(name, res[name], flush=True)


def qk_items(out: dict) -> None:
    g = torch.Generator("cuda").manual_seed(4)
    qkv = torch.randn(1, S, 3 * H * HD, generator=g, device="cuda").bfloat16()
    k = qkv[..., H * HD:2 * H * HD].view(1, S, H, HD)  # a strided view, as the model hands it over
    w = (1 + 0.2 * torch.randn(HD, generator=g, device="cuda")).bfloat16()
    pos = torch.stack(torch.meshgrid(torch.arange(31), torch.arange(30), torch.arange(34), indexing="ij"), -1)
    cos, sin = (t.bfloat16().contiguous() for t in rope_tables(pos.reshape(-1, 3)[:S].cuda(), 16, 10000.0))
    res = out["qk_exact"] = {"floor_ms": 2 * k.numel() * 2 / 4.3e12 * 1e3}
    want = prepare_heads(k, w, 1e-6, (cos, sin))
    res["production"] = {"ms": bench(lambda: prepare_heads(k, w, 1e-6, (cos, sin)))}
    for hb in (1, 2, 4, 7, 8):
        for bs, warps in ((32, 4), (64, 4), (64, 8)):
            o = torch.empty(1, S, H, HD, device="cuda", dtype=torch.bfloat16)

            def run():
                _qk_heads[(triton.cdiv(S, bs), H // hb)](k, w, cos, sin, o, S, R, 1e-6, k.stride(1), k.stride(2),
                                                         o.stride(1), o.stride(2), cos.stride(0), HB=hb,
                                                         BLOCK_S=bs, BLOCK_D=HD, num_warps=warps)
            name = f"heads{hb}_s{bs}_w{warps}"
            try:
                run()
                torch.cuda.synchronize()
                res[name] = {"ms": bench(run), "bit_identical": bool(torch.equal(o, want))}
            except Exception as exc:  # noqa: BLE001
                res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(name, res[name], flush=True)


def main(path: str) -> None:
    out = {"S": S, "D": D, "heads": H, "head_dim": HD, "device": torch.cuda.get_device_name(),
           "commit": os.environ.get("H3_GIT_COMMIT")}
    only = os.environ.get("ONLY")
    for fn in (norm_modulate_items, qk_items, split_items):
        if only and fn.__name__ != only:
            continue
        try:
            fn(out)
        except Exception as exc:  # noqa: BLE001
            out[fn.__name__] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
