"""H3_LINEAR=w4a8's integer GEMM against dequantize-then-bf16 and a dense bf16 GEMM, per DiT linear; JSON to --out.

Usage (repository root on the GPU machine):
    python3 benchmarks/w4a8_linear_gpu.py --out $OUT/w4a8_linear.json
    python3 benchmarks/w4a8_linear_gpu.py --device cpu --rows 64 --shapes small --out /tmp/w4a8.json   (smoke test)

Per linear of a block at the released width (hidden 5376, attention 56 x 128 = 7168, MLP 14336; q, k and v are
three 5376 -> 7168 GEMMs, out 7168 -> 5376, fc1 5376 -> 2 x 14336, fc2 14336 -> 5376), one asym_w4a8_int8 layer
(codebook variant, group 16, ConvRot 256, random N(0, 1/K) weights) on bf16 activations of --rows rows (37,966: the
packed sequence of t2va-1344x768-124f):
- `w4a8`: `W4A8Linear` (the activation rotated and quantized per token in PyTorch, torch._int_mm, the scales);
  `w4a8_int_mm` is its integer GEMM alone on the same codes, the share the rest of its forward adds;
- `w4a8_fused`: the same layer with the rotation and quantization in one Triton pass (`kernels/rotate_quantize.py`;
  on a device without Triton it is the PyTorch one again, and the row says which); `rotate_quantize` is that pass
  alone;
- `stored_bf16`: `StoredLinear`, the codes dequantized into the scratch, then the bf16 GEMM (what a w4a8 file
  runs by default); the scratch is told it holds nothing before each call, as a forward meets each layer once;
- `dense_bf16`: the bf16 GEMM on the dequantized weight alone (a bf16 file's linear).
Medians of --repeats calls after --warmup (CUDA events on a GPU), and each fast path's relative L2 against the
fp32 dequantize-then-matmul reference (`w4a8_reference`) on the same rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RELEASED_ROWS = 37_966  # t2va-1344x768-124f's packed sequence


def shapes(which: str) -> dict[str, tuple[int, int]]:
    """(out features N, in features K) per block linear, from the DiT config of `which`."""
    from h3_spark.h3_model.dit.config import FULL, DiTConfig

    c = FULL if which == "full" else DiTConfig(num_attention_heads=2, attention_head_dim=128, hidden_size=256,
                                               ffn_dim=512)
    h, inner, ffn = c.hidden_size, c.inner_dim, c.ffn_dim
    return {"to_q": (inner, h), "to_k": (inner, h), "to_v": (inner, h), "to_out": (h, inner),
            "fc1": (2 * ffn, h), "fc2": (h, ffn)}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    p.add_argument("--rows", type=int, default=RELEASED_ROWS, help=f"activation rows (default {RELEASED_ROWS})")
    p.add_argument("--shapes", choices=["full", "small"], default="full",
                   help="full: the released DiT's linears; small: 256-wide ones for a CPU smoke test")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.rows < 1 or args.repeats < 1 or args.warmup < 0:
        p.error(f"--rows and --repeats must be at least 1 and --warmup at least 0; got {args.rows}, {args.repeats}, "
                f"{args.warmup}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        p.error(f"--device must be cuda, cuda:N or cpu; got {args.device!r}")
    return args


def _layer(n: int, k: int, device, seed: int):
    import torch

    from h3_spark.h3_model.checkpoint.quant import quantize_w4a8
    from h3_spark.kernels.formats import FORMATS
    from h3_spark.kernels.stored_linear import StoredForm, StoredLinear

    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) / k ** 0.5
    tensors = FORMATS["asym_w4a8_int8"].held(quantize_w4a8(w, 16, 256, "codebook"))
    return StoredLinear(StoredForm("asym_w4a8_int8", (n, k), tensors, 256, group_size=16), torch.bfloat16)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(name: str, n: int, k: int, args, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from h3_spark.kernels import stored_linear
    from h3_spark.kernels.capability import triton_ready
    from h3_spark.kernels.linear_w4a8 import W4A8Linear, w4a8_reference
    from h3_spark.kernels.rotate_quantize import reference_rotate_quantize, rotate_quantize
    from h3_spark.measure.runner import time_call

    device = args.device
    stored = _layer(n, k, device, seed)
    fast = W4A8Linear.from_stored(stored)
    fused = W4A8Linear.from_stored(stored, use_triton=triton_ready(device))
    dense = stored.dequantized(torch.bfloat16)
    x = torch.randn(args.rows, k, generator=torch.Generator(device=device).manual_seed(seed + 1), device=device)
    x = x.to(torch.bfloat16)
    codes = torch.randint(-127, 128, (max(args.rows, 17), k), dtype=torch.int8, device=device)
    weight_t = fast.weight.t()

    def run_stored():
        stored_linear._SCRATCH.owner.clear()  # a forward meets each layer once: no dequantized copy waits for it
        return stored(x)

    quantize = rotate_quantize if fused.use_triton else reference_rotate_quantize
    calls = {"w4a8": lambda: fast(x), "w4a8_int_mm": lambda: torch._int_mm(codes, weight_t),
             "w4a8_fused": lambda: fused(x), "rotate_quantize": lambda: quantize(x, fused.convrot_group),
             "stored_bf16": run_stored, "dense_bf16": lambda: F.linear(x, dense)}
    row: dict = {"n": n, "k": k, "rows": args.rows, "w4a8_fused_quantizer": fused.source}
    with torch.inference_mode():
        for label, fn in calls.items():
            times = time_call(fn, device, args.warmup, args.repeats)
            row[f"{label}_ms_median"] = round(1e3 * statistics.median(times), 4)
        reference = w4a8_reference(x.float(), stored)
        row["w4a8_rel_l2"] = round(_rel(fast(x), reference), 6)
        row["w4a8_fused_rel_l2"] = round(_rel(fused(x), reference), 6)
        row["stored_bf16_rel_l2"] = round(_rel(run_stored(), reference), 6)
        del reference
    row["w4a8_over_stored_bf16"] = round(row["w4a8_ms_median"] / row["stored_bf16_ms_median"], 4)
    row["w4a8_over_dense_bf16"] = round(row["w4a8_ms_median"] / row["dense_bf16_ms_median"], 4)
    row["w4a8_fused_over_dense_bf16"] = round(row["w4a8_fused_ms_median"] / row["dense_bf16_ms_median"], 4)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from h3_spark.measure import stamp

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here; use --device cpu --rows 64 --shapes small")
    record = {**stamp.stamp_before(), "device": args.device, "rows": args.rows, "shapes": args.shapes,
              "repeats": args.repeats, "warmup": args.warmup,
              "weights": "random N(0, 1/K), asym_w4a8_int8 codebook variant, group 16, ConvRot 256",
              "activations": "N(0, 1) in bf16"}
    linears = {name: measure(name, n, k, args, seed) for seed, (name, (n, k)) in enumerate(shapes(args.shapes).items())}
    totals = {label: round(sum(r[f"{label}_ms_median"] for r in linears.values()), 3)
              for label in ("w4a8", "w4a8_int_mm", "w4a8_fused", "rotate_quantize", "stored_bf16", "dense_bf16")}
    record.update(linears=linears, block_ms=totals)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp.stamp_after(record), indent=2) + "\n")
    print(json.dumps({"block_ms": totals, "w4a8_rel_l2": {k: v["w4a8_rel_l2"] for k, v in linears.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
