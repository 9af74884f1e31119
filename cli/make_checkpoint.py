"""`h3-spark make-checkpoint`: a random-weight checkpoint with the real names, layout and format."""

from __future__ import annotations

import argparse
import json
import sys
import time

# Which model a checkpoint is made for.
COMPONENTS = ("dit", "vae", "audio_vae")


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="write a deterministic random-weight checkpoint (tests, demos, benchmarks)",
                       description="Write random weights (normal / sqrt(fan_in), norms around 1) under the real "
                                   "tensor names, in a published layout and format, streamed tensor by tensor "
                                   "(the full preset never needs its 66 GB in RAM).")
    p.add_argument("out", help="output: a .safetensors file (comfy layouts) or a folder (diffusers)")
    p.add_argument("--component", choices=COMPONENTS, default="dit", help="which model to write")
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    p.add_argument("--format", choices=["bf16", "fp8_scaled", "nvfp4", "int8_convrot"], default="bf16",
                   help="DiT: storage of the 4 linears of every block; everything else stays bf16/fp32. "
                        "VAEs are written as published (video fp16 comfy / fp32 diffusers, audio fp32)")
    p.add_argument("--layout", choices=["comfy", "comfy-pruned", "diffusers"], default="comfy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="draw and quantize the DiT's tensors there (cuda: minutes instead of an hour for --preset "
                        "full); the random stream is the device's, so cpu and cuda files of one seed differ")
    p.add_argument("--quantize-refiner", action="store_true",
                   help="also quantize the token refiner's linears (ComfyUI files keep them bf16)")
    p.add_argument("--curve-grid", type=int, default=None,
                   help="comfy-pruned: rows of adaln_t_table (default 1025 full, 33 tiny)")
    p.add_argument("--curve-rank", type=int, default=None,
                   help="comfy-pruned: width k of adaln_t_table (default 8 full, 4 tiny)")
    return p


def _run_vae(args) -> int:
    from ..h3_model.errors import InputError
    from ..h3_model.vae_loading import write_audio_vae_checkpoint, write_vae_checkpoint

    if args.format != "bf16" or args.layout == "comfy-pruned" or args.quantize_refiner or args.curve_grid \
            or args.curve_rank:
        raise InputError(f"--component {args.component} takes only --preset, --layout comfy|diffusers and --seed "
                         "(the published VAE files are not quantized)")
    start = time.perf_counter()
    writer = write_vae_checkpoint if args.component == "vae" else write_audio_vae_checkpoint
    path = writer(args.out, args.preset, args.layout, args.seed)
    size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
    print(json.dumps({"out": str(path), "component": args.component, "preset": args.preset, "layout": args.layout,
                      "seed": args.seed, "bytes": size, "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def run(args) -> int:
    from ..h3_model.checkpoint.make import CURVE_DEFAULTS, make_dit_checkpoint
    from ..h3_model.config import preset
    from ..h3_model.errors import InputError

    if args.component != "dit":
        if args.device != "cpu":
            raise InputError("--device applies to the DiT; VAE checkpoints are drawn on the CPU")
        return _run_vae(args)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda asked for, but this machine has no CUDA GPU")
    elif args.device != "cpu":
        raise InputError(f"--device must be cpu or cuda[:N], got {args.device!r}")

    if args.layout != "comfy-pruned" and (args.curve_grid is not None or args.curve_rank is not None):
        raise InputError("--curve-grid/--curve-rank only apply to --layout comfy-pruned")
    grid, rank = CURVE_DEFAULTS[args.preset]
    curve = (args.curve_grid or grid, args.curve_rank or rank)
    start = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if sys.stderr.isatty() and (now - last[0] > 1.0 or done == total):
            last[0] = now
            print(f"\r  {done / 2 ** 30:.2f} / {total / 2 ** 30:.2f} GiB", end="", file=sys.stderr, flush=True)

    made = make_dit_checkpoint(args.out, preset(args.preset), args.format, args.layout, seed=args.seed,
                               quantize_refiner=args.quantize_refiner, curve=curve, progress=progress,
                               device=args.device)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary = {"out": str(made.path), "component": args.component, "preset": args.preset, "format": args.format,
               "layout": args.layout, "seed": args.seed, "device": args.device, "bytes": made.bytes,
               "seconds": round(time.perf_counter() - start, 3)}
    if made.curve_residual is not None:
        summary["curve_table"] = [made.config.adaln_curve_grid, made.config.time_embed_dim]
        summary["curve_fit_residual"] = made.curve_residual
    print(json.dumps(summary))
    return 0
