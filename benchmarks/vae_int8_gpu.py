"""ComfyUI's int8_convrot video VAE against the fp16 one, side by side in one process: decode time, peak GPU memory,
pixel difference; JSON to --out.

Usage (repository root on the GPU machine):
    python3 benchmarks/vae_int8_gpu.py --out $OUT/vae_int8.json [--repeats 3] [--workdir DIR]
CPU smoke (tiny VAE, a few latent frames):
    python3 benchmarks/vae_int8_gpu.py --tiny --device cpu --out /tmp/vae_int8.json

Both files are written first by our own `h3-spark make-checkpoint --component vae` from the same seed and preset
(full: the released geometry), the fp16 one as published and the int8_convrot one as ComfyUI's
minimax_h3_video_vae_int8_convrot (the decoder blocks' 144 linears int8 + ConvRot, quantized from the fp16 file's
values), so the two are the same model up to the int8 rounding. Each is read by the video VAE loader as a front
door reads it and decoded (fp16 decoder, 256 px tiles, uint8 frames) from one random latent of 1344x768x124
(37 x 48 x 84 latents) by default; the kernels are the engine's for the VAE (`apply_vae_kernels`, as the nodes set
them). Columns (--columns):
- fp16: the fp16 file;
- int8: the int8_convrot file as loaded by default, its decoder linears held as stored (StoredLinear) and dequantized
  at use before each GEMM: the path measured;
- int8_at_load: the same file dequantized at load (plain fp16 linears): a check that the stored path gives its
  frames bit for bit on this device (`frames_equal_int8`), and what holding the codes saves;
- int8_gemm (opt-in, never a default of the product): the stored codes run as an integer GEMM, each decoder linear
  swapped for `W4A8Linear.from_int8_convrot` (activations rotated and quantized per token to int8 in one Triton
  pass where Triton runs (`kernels/rotate_quantize.py`; the H100 receipt of 2026-12-07 predates it), `torch._int_mm`,
  as ComfyUI's own int8 linears compute); its error is the activations' int8 rounding, reported against the fp16
  column and against the int8 column (`frames_vs_int8`);
- fp8 (opt-in, H3_VAE_LINEAR=fp8; CUDA only): the fp16 file with the decoder blocks' linears as FP8 e4m3 GEMMs
  (`kernels/vae.py`: per-channel weights, per-token activations, q/k/v sharing one quantized input);
- int8_fp8 (the same, CUDA only): the int8_convrot file's stored linears dequantized exactly, then FP8.
The default columns are all of them on a GPU and the four without FP8 on the CPU.
Each column: median seconds of `decode_to_buffer` (host clock around a synchronised call), peak GPU memory of the
decode and the weights' bytes on the device, and the frames against the fp16 column's (PSNR over 255, max abs
difference in uint8 levels, rel L2). The card's name and the software are stamped. Only one model is on the
device at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

COLUMNS = ("fp16", "int8", "int8_at_load", "int8_gemm", "fp8", "int8_fp8")
FP8_COLUMNS = ("fp8", "int8_fp8")  # H3_VAE_LINEAR=fp8: Hopper or newer
FULL_LATENT = "37,48,84"  # 124 frames at 1344x768
TINY_LATENT = "3,4,4"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.environ.get("OUT")
    p.add_argument("--out", default=str(Path(default_out) / "vae_int8.json") if default_out else None,
                   required=default_out is None, help="the JSON result (default $OUT/vae_int8.json)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the CPU smoke)")
    p.add_argument("--tiny", action="store_true", help="the tiny preset and a tiny latent (CPU smoke)")
    p.add_argument("--latent", default=None, help=f"latent frames,height,width (default {FULL_LATENT}, tiny "
                                                  f"{TINY_LATENT})")
    p.add_argument("--columns", default=None, help=f"comma-separated, of {', '.join(COLUMNS)} (default: all on a GPU, "
                                                  f"the ones without FP8 on the CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="the checkpoints' seed (the latent's is fixed)")
    p.add_argument("--workdir", default=None,
                   help="where the two checkpoints are written (default a temporary folder, removed after); files "
                        "already there from the same seed and preset are reused")
    args = p.parse_args(argv)
    if args.columns is None:
        args.columns = ",".join(c for c in COLUMNS if args.device != "cpu" or c not in FP8_COLUMNS)
    columns = args.columns.split(",")
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown or not columns:
        p.error(f"--columns takes {', '.join(COLUMNS)}; got {args.columns!r}")
    fp8 = [c for c in columns if c in FP8_COLUMNS]
    if fp8 and args.device == "cpu":
        p.error(f"--columns {','.join(fp8)} run FP8 GEMMs (H3_VAE_LINEAR=fp8), which need a Hopper or newer GPU; "
                f"not --device cpu")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be at least 1 and --warmup at least 0; got {args.repeats}, {args.warmup}")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        p.error(f"--device must be cuda, cuda:N or cpu; got {args.device!r}")
    latent = args.latent or (TINY_LATENT if args.tiny else FULL_LATENT)
    try:
        args.latent_size = tuple(int(v) for v in latent.split(","))
    except ValueError:
        args.latent_size = ()
    if len(args.latent_size) != 3 or min(args.latent_size) < 1:
        p.error(f"--latent takes three positive integers (frames,height,width); got {latent!r}")
    args.columns = columns
    return args


def write_checkpoints(folder: Path, preset: str, seed: int) -> dict[str, Path]:
    """The fp16 and int8_convrot files, by `h3-spark make-checkpoint` itself (reused when already there)."""
    from h3_spark.cli import main as cli

    files = {"fp16": folder / f"video_vae_{preset}_seed{seed}_fp16.safetensors",
             "int8": folder / f"video_vae_{preset}_seed{seed}_int8_convrot.safetensors"}
    for kind, path in files.items():
        if path.is_file():
            continue
        argv = ["make-checkpoint", str(path), "--component", "vae", "--preset", preset, "--seed", str(seed)]
        if kind == "int8":
            argv += ["--format", "int8_convrot"]
        start = time.perf_counter()
        if cli(argv) != 0:
            raise SystemExit(f"make-checkpoint failed for {path}")
        print(json.dumps({"wrote": str(path), "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return files


def measure(column: str, path: Path, z, args) -> tuple[dict, "object"]:
    """Load one column's model on the device, decode `args.warmup + args.repeats` times; (record, frames)."""
    import torch

    from h3_spark.h3_model.engine.kernel_plan import apply_vae_kernels
    from h3_spark.h3_model.engine.memory import tensor_bytes
    from h3_spark.h3_model.vae.loading import load_video_vae
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.kernels.stored_linear import StoredLinear, release_scratch, scratch_bytes

    cuda = args.device.startswith("cuda")
    start = time.perf_counter()
    vae = load_video_vae(path, device=args.device, decode_dtype=torch.float16, stored=column != "int8_at_load")
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    settings = KernelSettings.from_env()
    if column in FP8_COLUMNS:
        settings = settings.replace(vae_linear="fp8")
    kernels = apply_vae_kernels(vae, settings)
    stored = sum(isinstance(m, StoredLinear) for m in vae.modules())
    if column == "int8_gemm":
        integer_gemm(vae)
    for _ in range(args.warmup):
        vae.decode_to_buffer(z)
    if cuda:
        torch.cuda.synchronize(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
    times, frames = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        frames = vae.decode_to_buffer(z)
        if cuda:
            torch.cuda.synchronize(args.device)
        times.append(time.perf_counter() - start)
    record = {"column": column, "file": path.name, "load_s": round(load_s, 3), "stored_linears": stored,
              "decode_s_median": statistics.median(times), "decode_s_all": times,
              "weights_gb": tensor_bytes(vae) / 1e9, "scratch_gb": scratch_bytes(vae) / 1e9,
              "peak_gpu_memory_gb": torch.cuda.max_memory_allocated(args.device) / 1e9 if cuda else None,
              "kernels": kernels}
    del vae
    release_scratch()
    if cuda:
        torch.cuda.empty_cache()
    return record, frames


def integer_gemm(vae) -> None:
    """The opt-in column's model: every stored decoder linear swapped for the integer GEMM on its codes."""
    from h3_spark.kernels.capability import triton_ready
    from h3_spark.kernels.linear_w4a8 import W4A8Linear
    from h3_spark.kernels.stored_linear import StoredLinear

    for name, module in list(vae.decoder.named_modules()):
        if isinstance(module, StoredLinear):
            fast = W4A8Linear.from_int8_convrot(module, use_triton=triton_ready(module.weight.device))
            vae.decoder.set_submodule(name, fast)


def compare(frames, reference) -> dict:
    """Frames (uint8) against the fp16 column's: PSNR over 255, max abs in uint8 levels, rel L2, share equal."""
    a, b = frames.float(), reference.float()
    mse = (a - b).pow(2).mean().item()
    return {"psnr_db": math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse),
            "max_abs_uint8": (a - b).abs().max().item(), "rel_l2": ((a - b).norm() / b.norm()).item(),
            "fraction_equal": (a == b).float().mean().item()}


def main(argv=None) -> int:
    args = parse(argv)
    import_package()
    import torch

    from h3_spark.measure import stamp

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("vae_int8_gpu.py: --device cuda asked for, but this machine has no CUDA GPU (--tiny --device cpu "
              "for the smoke run)", file=sys.stderr)
        return 2
    record = stamp.stamp_before()
    preset = "tiny" if args.tiny else "full"
    with tempfile.TemporaryDirectory(prefix="vae_int8_") as scratch:
        folder = Path(args.workdir) if args.workdir else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        files = write_checkpoints(folder, preset, args.seed)
        from h3_spark.h3_model.vae.loading import video_identity

        identity = video_identity(files["int8"])
        t, h, w = args.latent_size
        gen = torch.Generator().manual_seed(1234)
        z = torch.randn(1, identity.config.latent_channels, t, h, w, generator=gen).to(args.device)
        runs, outputs = [], {}
        for column in args.columns:
            run, frames = measure(column, files["fp16" if column in ("fp16", "fp8") else "int8"], z, args)
            outputs[column] = frames
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "kernels"}), flush=True)
        sizes = {kind: path.stat().st_size for kind, path in files.items()}
    for run in runs:
        if "fp16" in outputs:
            run["frames_vs_fp16"] = compare(outputs[run["column"]], outputs["fp16"])
        if run["column"] == "int8_at_load" and "int8" in outputs:
            run["frames_equal_int8"] = bool(torch.equal(outputs["int8"], outputs["int8_at_load"]))
        if run["column"] == "int8_gemm" and "int8" in outputs:
            run["frames_vs_int8"] = compare(outputs["int8_gemm"], outputs["int8"])
    speed = {}
    by = {r["column"]: r for r in runs}
    if "fp16" in by and "int8" in by:
        speed["int8_over_fp16_time"] = by["int8"]["decode_s_median"] / by["fp16"]["decode_s_median"]
        if cuda:
            speed["int8_minus_fp16_peak_gb"] = by["int8"]["peak_gpu_memory_gb"] - by["fp16"]["peak_gpu_memory_gb"]
    for column in ("int8_gemm", *FP8_COLUMNS):
        if "fp16" in by and column in by:
            speed[f"{column}_over_fp16_time"] = by[column]["decode_s_median"] / by["fp16"]["decode_s_median"]
    frames = next(iter(outputs.values()))
    result = {
        "benchmark": f"video VAE decode, int8_convrot (dequantized at use) vs fp16, {preset} preset, latent "
                     f"{t}x{h}x{w} -> {frames.shape[1]} frames at {frames.shape[3]}x{frames.shape[2]}",
        "device": args.device, "card": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "latent_shape": list(z.shape), "frames_shape": list(frames.shape), "repeats": args.repeats,
        "warmup": args.warmup, "seed": args.seed, "file_bytes": sizes,
        "int8_file": identity.weights,
        "weights": f"synthetic {preset} video VAE written by h3-spark make-checkpoint (random weights, seed "
                   f"{args.seed}); decode timing does not depend on the values",
        "runs": runs, "summary": speed, "stamp": stamp.stamp_after(record),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({"out": str(out), **speed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
