"""GGUF dequantization throughput per GGML type on the GPU (kernels/gguf_codec.py), beside the card's copy
bandwidth measured in the same run; JSON to --out.

Usage (repository root on the GPU machine; the gguf package for the i-quants' grids):
    python3 benchmarks/gguf_dequant_gpu.py --out $OUT/gguf_dequant.json [--types all] [--repeats 5]

Per type: one full-size DiT linear's worth of raw blocks (fc1 of a block, [2 x 14,336, 5,376] by default, as a
StoredLinear holds it: uint8 [rows, bytes per row]) of random bytes (the timing does not depend on the values),
dequantized into a bf16 output with `gguf_codec.dequantize_into` (the Triton kernels where they have the type,
the torch codec otherwise: each row names which), the call the stored-form linears make before
each GEMM. Reported: median milliseconds (CUDA events), GB/s of bf16 output written, GB/s of blocks read, and
the output rate as a fraction of the measured copy bandwidth (a device-to-device clone of a 4 GB tensor: bytes
read + written per second). The output rate is what bounds the just-in-time dequantization of a forward:
every weight is written once as bf16 and read once by the GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

GB = 1e9


def timed(fn, repeats: int) -> list[float]:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_bandwidth(repeats: int) -> dict:
    """Device-to-device clone of 4 GB: (read + write) bytes per second."""
    import torch

    src = torch.empty(int(4 * GB) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src), repeats)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, "s_median": statistics.median(times),
            "gb_per_s": round(moved / statistics.median(times) / GB, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--types", default="all", help="comma-separated GGML types, or all the codec keeps as blocks")
    p.add_argument("--rows", type=int, default=2 * 14336)
    p.add_argument("--cols", type=int, default=5376)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.kernels import gguf_codec
    from h3_spark.measure import stamp

    record = stamp.stamp_before()
    plain = ("F32", "F16", "BF16")
    types = [t for t in gguf_codec.SUPPORTED if t not in plain] if args.types == "all" else args.types.split(",")
    bandwidth = copy_bandwidth(args.repeats)
    print(json.dumps({"copy_bandwidth": bandwidth}), flush=True)
    out = torch.empty(args.rows, args.cols, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for name in types:
        width = gguf_codec.row_bytes(name, args.cols)
        raw = torch.randint(0, 256, (args.rows, width), dtype=torch.uint8, device="cuda", generator=gen)
        times = timed(lambda: gguf_codec.dequantize_into(out, raw, name), args.repeats)
        s = statistics.median(times)
        written = out.numel() * out.element_size()
        row = {"type": name, "dequantizer": gguf_codec.dequantizer(name, "cuda"), "shape": [args.rows, args.cols], "block_bytes": raw.numel(), "ms_median": s * 1e3,
               "ms_all": [t * 1e3 for t in times], "bf16_out_gb_per_s": round(written / s / GB, 1),
               "blocks_in_gb_per_s": round(raw.numel() / s / GB, 1),
               "traffic_fraction_of_copy_bandwidth": round((written + raw.numel()) / s / GB / bandwidth["gb_per_s"],
                                                           3)}
        runs.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)
        del raw
    result = {"benchmark": "gguf_dequant", "codec": "gguf_codec.dequantize_into: kernels/gguf_triton.py on CUDA "
              "for the types it has (each row's `dequantizer`), else the vectorized torch codec", "inputs": "random bytes as blocks (timing is value-independent)",
              "copy_bandwidth": bandwidth, "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
