"""The `sparse` recipe's attention (comfy-kitchen Sol-Attn) against FA3, one call of the DiT's shape; JSON to --out.

Usage (repository root on the GPU machine, comfy-kitchen and fa3-fwd installed):
    python3 benchmarks/sparse_attention_gpu.py --out $OUT/sparse_attention.json [--lengths 37966,104222]
        [--taus 1.0] [--repeats 5]

For each packed length S (the released canvas: 37,966 rows at 124 frames, 104,222 at 345) and each tau: q, k, v
of 56 heads of 128 channels in bf16, random, with q and k RMS-normalised per head as the DiT's QK norm leaves
them. Both backends come from `kernels.attention.resolve_attention`, as the engine and the recipe make them.
Reported: median milliseconds per call (CUDA events), the speed-up, and the rel L2 of Sol-Attn's output
against FA3's. Random activations are not H3's: how much Sol-Attn routes away, and so its speed and error,
depends on the attention maps real weights make.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

HEADS, HEAD_DIM = 56, 128


def timed(fn, q, k, v, repeats: int) -> tuple[list[float], object]:
    import torch

    out = fn(q, k, v)  # warm-up
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q, k, v)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="37966,104222")
    p.add_argument("--taus", default="1.0")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.kernels.attention import resolve_attention
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp

    record = stamp.stamp_before()
    device = torch.device("cuda")
    dense, dense_name = resolve_attention("fa3", device, KernelSettings())
    runs = []
    for length in (int(x) for x in args.lengths.split(",")):
        gen = torch.Generator(device=device).manual_seed(length)

        def heads():
            return torch.randn(1, length, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)

        q, k, v = heads(), heads(), heads()
        q, k = (t / t.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(t.dtype) for t in (q, k))
        dense_ms, want = timed(dense, q, k, v, args.repeats)
        for tau in (float(x) for x in args.taus.split(",")):
            base = KernelSettings()
            sol = dataclasses.replace(base.sol, tau=tau, min_tokens=0, fallback="fa3")
            sparse, _ = resolve_attention("sol_attn", device, base.replace(attention="sol_attn", sol=sol))
            sparse_ms, got = timed(sparse, q, k, v, args.repeats)
            error = ((got.float() - want.float()).norm() / want.float().norm()).item()
            runs.append({"sequence_length": length, "tau": tau, "fa3_ms_median": statistics.median(dense_ms),
                         "fa3_ms_all": dense_ms, "sol_attn_ms_median": statistics.median(sparse_ms),
                         "sol_attn_ms_all": sparse_ms,
                         "speedup_vs_fa3": statistics.median(dense_ms) / statistics.median(sparse_ms),
                         "output_rel_l2_vs_fa3": error, "sol_attn": sparse.describe()})
            print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("_all") and k != "sol_attn"}),
                  flush=True)
        del q, k, v, want
        torch.cuda.empty_cache()
    result = {"benchmark": "sparse_attention", "dense_backend": dense_name, "heads": HEADS, "head_dim": HEAD_DIM,
              "inputs": "random bf16, q and k RMS-normalised per head (synthetic: not H3's attention maps)",
              "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
