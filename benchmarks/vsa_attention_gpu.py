"""FastH3's VSA attention (kernels/vsa.py) against FA3 and FA3 FP8, one call of the DiT's shape; JSON to --out.

Usage (repository root on the GPU machine, fa3-fwd installed):
    python3 benchmarks/vsa_attention_gpu.py --out $OUT/vsa_attention.json \
        [--contracts t2va-1344x768-124f,t2va-1344x768-345f] [--sparsities 0.9,0.8] [--repeats 5]

For each contract the packed layout its canvas makes (S = 37,966 at 124 frames, 104,222 at 345) is tiled as the
fasth3 recipe tiles it (segment-pure prefix tiles, then 64-row 3-D video tiles), and q, k, v of 56 heads of 128
channels in bf16 are drawn at random, q and k RMS-normalised per head as the DiT's QK norm leaves them, with a
random gate (the `to_gate_compress` branch). Reported per sparsity:
- milliseconds per call (CUDA events, medians): the whole VSA (pooling, coarse scores, top-k selection, the
  Triton block-sparse fine kernel, the gated coarse branch) and the fine kernel alone, beside FA3 and FA3 FP8
  (FP8 measured both quantizing its bf16 inputs and on pre-quantized heads);
- the fraction of the dense attention's Q.K / P.V work the fine kernel computes (selected query x key rows over
  S x S, from the selection itself);
- the fine kernel's error against the fp32 PyTorch reference with the same selection (on `--error-heads` heads:
  the reference materialises S x S scores per head), and the whole VSA against the reference's pipeline.
At sparsity 0 every tile is selected: the fine kernel is then dense attention, checked against FA3.
A candidate beside it, where it loads: FastVideo's sm_90 block-sparse kernel (`fastvideo_kernel`'s
ThunderKittens `block_sparse_fwd`), handed the same tiles and the same selection (q, k, v in tile order as
(B, H, n x tile, D) with zeros in the padding, our per-tile lists of key tiles and their counts, each tile's row
count), timed alone and with the tile-order copies, its output brought back to packed order and compared with our
fine kernel's (`fastvideo_sm90_*`); where it does not load, the receipt says why.
Random activations are not H3's: which tiles a trained model selects differs, the cost per selected tile does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 56, 128


def timed(fn, repeats: int) -> tuple[list[float], object]:
    import torch

    out = fn()  # warm-up (compiles the Triton kernel on first use)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, out


# Launch shapes the sweep tries for the fine kernel (64-row query blocks; key rows per step; one warpgroup's
# wgmma or two; software-pipeline depth). Measured and dropped (receipts/h100/vsa-attention-sweep-a5b26cb.json, H100):
# two key boxes a step with one softmax rescale (23.3 ms against 17.0 at sparsity 0.9), a branch-free padding
# bias instead of the last box's branch (18.0), P.V accumulated in the product (17.4), two warpgroups (27.6).
LAUNCHES = ([{"keys": 64, "num_warps": 4, "num_stages": 1}]
            + [{"keys": 64, "tma": True, "num_warps": 4, "num_stages": st} for st in (1, 2, 3, 4, 5)])


def sweep(run, lists_by_sparsity, repeats: int) -> list[dict]:
    """Median milliseconds of the fine kernel per launch shape and sparsity, and its output against the first
    shape's (relative L2: the variants differ in fp32 summation order only); a shape that fails to compile (shared
    memory) is recorded with its error."""
    rows, first = [], {}
    for launch in LAUNCHES:
        entry = dict(launch)
        for sparsity, (idx, num) in lists_by_sparsity:
            try:
                ms, out = timed(lambda: run(idx, num, launch), repeats)
                entry[f"ms_at_{sparsity}"] = statistics.median(ms)
                entry[f"rel_l2_vs_first_at_{sparsity}"] = rel_l2(out.float(), first.setdefault(sparsity, out).float())
            except Exception as exc:  # noqa: BLE001 - recorded in the receipt
                entry[f"error_at_{sparsity}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps({"sweep": entry}), flush=True)
        rows.append(entry)
    return rows


def fastvideo_block_sparse():
    """(FastVideo's sm_90 block-sparse forward, None), or (None, why it is not here)."""
    try:
        from fastvideo_kernel._C import fastvideo_kernel_ops
    except Exception as exc:  # noqa: BLE001 - recorded in the receipt
        return None, f"{type(exc).__name__}: {exc}"
    fwd = getattr(fastvideo_kernel_ops, "block_sparse_fwd", None)
    return (fwd, None) if fwd is not None else (None, "fastvideo_kernel_ops has no block_sparse_fwd (not built "
                                                      "for sm_90)")


def heads_in_tile_order(x, tiles):
    """(B, S, H, D) in packed order -> (B, H, n x tile, D) tile by tile, zeros in the padding: the candidate's
    layout."""
    b, _, h, d = x.shape
    out = x.new_zeros(b, tiles.num_tiles * tiles.tile, h, d).index_copy_(1, tiles.slot, x)
    return out.permute(0, 2, 1, 3).contiguous()


def packed_from_tile_order(o, tiles):
    """(B, H, n x tile, D) -> (B, S, H, D) in packed order (the padding dropped)."""
    return o.permute(0, 2, 1, 3)[:, tiles.slot]


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def computed_fraction(mask, tiles) -> float:
    """Selected (query row, key row) pairs over S x S, averaged over batch and heads."""
    import torch

    sizes = tiles.sizes.to(torch.float64)
    pairs = (mask.to(torch.float64) * sizes[:, None] * sizes[None, :]).sum((-1, -2))
    return (pairs.mean() / float(tiles.sequence_length) ** 2).item()


def layout_tiles(contract_name: str, tile: int):
    from h3_spark.h3_model.dit.config import FULL
    from h3_spark.h3_model.dit.layout import segments_before_video
    from h3_spark.kernels.vsa import tile_map
    from h3_spark.measure.contract import contract_shape, load_contract

    shape = contract_shape(load_contract(ROOT / "benchmarks" / f"{contract_name}.json"), FULL)
    patches = tuple(n // p for n, p in zip((shape.latent_frames, shape.latent_height, shape.latent_width),
                                           FULL.patch_size))
    return shape.layout.sequence_length, tile_map(segments_before_video(shape.layout), patches, tile), patches


def fastvideo_columns(fwd, q, k, v, lists, tiles, fine, repeats: int) -> dict:
    """The candidate on our tiles and selection: its kernel alone, with the copies into its layout, and its output
    against our fine kernel's (a failure is recorded, not raised)."""
    import torch

    idx, num = lists
    sizes = tiles.sizes.to(torch.int32)
    try:
        qt, kt, vt = (heads_in_tile_order(x, tiles) for x in (q, k, v))
        alone_ms, (o, _) = timed(lambda: fwd(qt, kt, vt, idx, num, sizes), repeats)
        copied_ms, _ = timed(lambda: fwd(*(heads_in_tile_order(x, tiles) for x in (q, k, v)), idx, num, sizes),
                             repeats)
        return {"fastvideo_sm90_ms_median": statistics.median(alone_ms), "fastvideo_sm90_ms_all": alone_ms,
                "fastvideo_sm90_with_copies_ms_median": statistics.median(copied_ms),
                "fastvideo_sm90_rel_l2_vs_fine": rel_l2(packed_from_tile_order(o, tiles).float(), fine.float())}
    except Exception as exc:  # noqa: BLE001 - recorded in the receipt
        return {"fastvideo_sm90_error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--contracts", default="t2va-1344x768-124f,t2va-1344x768-345f")
    p.add_argument("--sparsities", default="0.9,0.8")
    p.add_argument("--tile", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true",
                   help="also time the fine kernel under each launch shape of LAUNCHES (the one to put in FINE_LAUNCH)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one whole VSA call (with a gate) at each sparsity above 0: CUDA time per kernel")
    p.add_argument("--error-heads", type=int, default=2, help="heads the fp32 reference checks (S x S each)")
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.kernels.attention import resolve_attention
    from h3_spark.kernels.qk_prep import reference_prepare_heads
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.kernels.vsa import _fine, _pooled, fine_launch, selected_lists, vsa_attention
    from h3_spark.kernels.vsa_reference import fine_reference, select_tiles, vsa_reference
    from h3_spark.measure import stamp

    record = stamp.stamp_before()
    device = torch.device("cuda")
    candidate, candidate_missing = fastvideo_block_sparse()
    fa3, fa3_name = resolve_attention("fa3", device, KernelSettings())
    try:
        fp8, _ = resolve_attention("fa3_fp8", device, KernelSettings())
    except Exception as exc:  # recorded, not hidden: the receipt says why FP8 was not measured
        fp8, fp8_error = None, f"{type(exc).__name__}: {exc}"
    else:
        fp8_error = None
    runs = []
    for name in args.contracts.split(","):
        length, tiles, patches = layout_tiles(name, args.tile)
        tiles = tiles.to(device)
        gen = torch.Generator(device=device).manual_seed(length)

        def heads():
            return torch.randn(1, length, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)

        q, k, v = heads(), heads(), heads()
        q, k = (t / t.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(t.dtype) for t in (q, k))
        gate = (heads() * 0.1).to(torch.bfloat16)
        dense_ms, dense = timed(lambda: fa3(q, k, v), args.repeats)
        row = {"contract": name, "sequence_length": length, "video_patches": patches, "tile": args.tile,
               "tiles": tiles.num_tiles, "prefix_tiles": tiles.num_prefix_tiles,
               "fa3_ms_median": statistics.median(dense_ms), "fa3_ms_all": dense_ms}
        if fp8 is not None:
            fp8_ms, fp8_out = timed(lambda: fp8(q, k, v), args.repeats)
            # As the DiT hands them over with H3_ATTENTION=fa3_fp8: q and k quantized by the fused Q/K prep, v bf16.
            pre = [reference_prepare_heads(t, None, 0.0, None, norm=False, fmt="fp8", granularity="per_head")
                   for t in (q, k)]
            pre_ms, _ = timed(lambda: fp8(*pre, v), args.repeats)
            row.update({"fa3_fp8_ms_median": statistics.median(fp8_ms), "fa3_fp8_prequantized_ms_median":
                        statistics.median(pre_ms), "fa3_fp8_rel_l2_vs_fa3": rel_l2(fp8_out.float(), dense.float())})
            del pre, fp8_out
        else:
            row["fa3_fp8"] = fp8_error
        print(json.dumps({k_: v_ for k_, v_ in row.items() if not k_.endswith("_all")}), flush=True)
        scores = _pooled(q, tiles) @ _pooled(k, tiles).transpose(-1, -2) / HEAD_DIM ** 0.5
        row["by_sparsity"] = []
        sparsities = [0.0] + [float(x) for x in args.sparsities.split(",")]
        if args.sweep:
            row["launch_sweep"] = sweep(lambda idx, num, launch: _fine(q, k, v, idx, num, tiles, launch=launch),
                                        [(x, selected_lists(scores, tiles.num_prefix_tiles, x)) for x in sparsities],
                                        args.repeats)
        for sparsity in sparsities:
            mask = select_tiles(scores, tiles.num_prefix_tiles, sparsity)
            lists = selected_lists(scores, tiles.num_prefix_tiles, sparsity)
            vsa_ms, _ = timed(lambda: vsa_attention(q, k, v, gate, tiles, sparsity), args.repeats)
            fine_ms, fine = timed(lambda: _fine(q, k, v, *lists, tiles), args.repeats)
            h = args.error_heads
            sub = mask[:, :h].contiguous()
            want = fine_reference(q[:, :, :h], k[:, :, :h], v[:, :, :h], sub, tiles)
            entry = {"sparsity": sparsity, "vsa_ms_median": statistics.median(vsa_ms), "vsa_ms_all": vsa_ms,
                     "fine_kernel_ms_median": statistics.median(fine_ms), "fine_kernel_ms_all": fine_ms,
                     "computed_fraction": computed_fraction(mask, tiles),
                     "vsa_speedup_vs_fa3": row["fa3_ms_median"] / statistics.median(vsa_ms),
                     "fine_rel_l2_vs_reference_same_selection": rel_l2(fine[:, :, :h].float(), want.float()),
                     "fine_max_abs_vs_reference": (fine[:, :, :h].float() - want.float()).abs().max().item(),
                     "error_heads": h}
            if sparsity == 0.0:
                entry["fine_rel_l2_vs_fa3_dense"] = rel_l2(fine.float(), dense.float())
            else:
                whole = vsa_attention(q[:, :, :h], k[:, :, :h], v[:, :, :h], gate[:, :, :h], tiles, sparsity)
                ref = vsa_reference(q[:, :, :h], k[:, :, :h], v[:, :, :h], gate[:, :, :h], tiles, sparsity)
                entry["vsa_rel_l2_vs_reference_pipeline"] = rel_l2(whole.float(), ref.float())
                entry["vsa_rel_l2_vs_fa3_dense"] = rel_l2(
                    vsa_attention(q, k, v, None, tiles, sparsity).float(), dense.float())
                del whole, ref
            if args.profile and sparsity > 0:
                from h3_spark.measure.profile import profile_call

                entry["profile"] = profile_call(lambda: vsa_attention(q, k, v, gate, tiles, sparsity), "cuda", top=12)
            if candidate is not None:
                entry.update(fastvideo_columns(candidate, q, k, v, lists, tiles, fine, args.repeats))
            if "fa3_fp8_ms_median" in row:
                entry["vsa_speedup_vs_fa3_fp8"] = row["fa3_fp8_ms_median"] / entry["vsa_ms_median"]
            row["by_sparsity"].append(entry)
            print(json.dumps({k_: v_ for k_, v_ in entry.items() if not k_.endswith("_all") and k_ != "profile"}),
                  flush=True)
            del fine, want, mask
            torch.cuda.empty_cache()
        runs.append(row)
        del q, k, v, gate, dense, scores
        torch.cuda.empty_cache()
    result = {"benchmark": "vsa_attention", "dense_backend": fa3_name, "fine_launch": fine_launch(device),
              "fastvideo_sm90": "measured" if candidate is not None else candidate_missing,
              "heads": HEADS, "head_dim": HEAD_DIM,
              "inputs": "random bf16, q and k RMS-normalised per head, random gate (synthetic: not H3's attention "
                        "maps)", "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
