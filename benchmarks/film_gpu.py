"""Films past one generation on the GPU: seconds per window and in all, peak GPU memory per window; JSON to --out.

Usage (repository root on the GPU machine; fa3-fwd for H3_ATTENTION=fa3):
    H3_ATTENTION=fa3 python3 benchmarks/film_gpu.py --out $OUT/film.json --seconds 15,30,60 --steps 20 \
        [--recipe fasth3] [--width 1344 --height 768] [--vram-budget 24]

Synthetic full-size random weights built on the device (DiT, Qwen3-VL, both VAEs: real H3 weights are not
available here; time does not depend on weight values), the engine the CLI loads, and the CLI's window plan and
film renderer (`h3_model/compose/`), writing the mp4 as `generate --seconds` does. One engine serves every
length, measured in the order given, after a warm-up film of `--warmup-seconds` (2 by default; 0: none, and the
first film is also the warm-up: its kernels compile in its first window). The prompt and reference caches are
cleared before each measured film, so each encodes its prompt once as a user's first film would. Random weights
make noise: the point is the time per window and whether memory stays flat across windows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", default="15,30,60", help="comma-separated film lengths")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recipe", action="append", default=[], metavar="NAME[:key=value,...]")
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--vram-budget", default="auto",
                   help="GB the models may hold (streams the rest); auto (the default, as generate): resident when "
                        "everything fits the free GPU memory, else planned for it")
    p.add_argument("--preset", default="full", help="full (the receipts) or tiny (a CPU check of the script)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mp4-dir", default="/tmp/films", help="where the films are written (not returned)")
    p.add_argument("--warmup-seconds", type=float, default=2.0,
                   help="a film this long rendered first and not reported (0: none)")
    args = p.parse_args(argv)
    if args.warmup_seconds < 0:
        p.error(f"--warmup-seconds must be 0 or more, got {args.warmup_seconds:g}")
    import_package()
    import torch

    from h3_spark.h3_model.compose.film import Film, Shot, render_film
    from h3_spark.h3_model.compose.windows import frames_for_seconds, plan_film
    from h3_spark.h3_model.engine import cuda_allocator
    from h3_spark.h3_model.engine.recipes import apply_recipes, check_recipes, parse_recipes
    from h3_spark.h3_model.media import files as media
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp, synthetic

    record = stamp.stamp_before()
    device = args.device
    settings = KernelSettings.from_env()
    recipes = parse_recipes(args.recipe)
    fasth3 = any(r.name.startswith("fasth3") for r in recipes)
    check_recipes(recipes, device, settings)  # a recipe that sets the steps (turbo, fasth3) overrides --steps
    from h3_spark.h3_model.engine.memory import parse_budget

    budget = parse_budget(args.vram_budget)
    engine, load_s = synthetic.synthetic_components(args.preset, ["t2va"], device, torch.bfloat16 if device == "cuda" else torch.float32, kernels=settings,
                                                    vram_budget=budget, fasth3=fasth3)
    out_dir = Path(args.mp4_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, warmed = [], None
    films = [(float(s), False) for s in args.seconds.split(",") if s]
    for seconds, warmup in ([(args.warmup_seconds, True)] if args.warmup_seconds else []) + films:
        engine.clear_caches()  # each film encodes its prompt, as a user's first would
        frames = frames_for_seconds(seconds)
        plan = plan_film([frames])
        base = GenerationRequest("t2va", "A red fox trots across a snowy meadow at dawn.", width=args.width,
                                 height=args.height, steps=args.steps, seed=0)
        if recipes:
            base = apply_recipes(recipes, base, engine.components.dit, device, settings)
        peaks = []

        def generate(request):
            return engine.generate(request)

        def window_done(window, entry):
            peaks.append(entry.get("peak_gpu_memory_gb"))
            print(json.dumps({"film_s": seconds, "warmup": warmup, "window": window.index, "frames": window.frames,
                              "seconds": entry["seconds"], "timings": entry["timings"],
                              "peak_gb": entry.get("peak_gpu_memory_gb")}), flush=True)

        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        with media.mp4_writer(out_dir / f"film-{seconds:g}s.mp4") as stream:
            whole = Film(plan, [Shot(base.prompt, frames)], {}, None, args.width, args.height)
            film = render_film(generate, base, whole, on_frames=stream.add, on_window=window_done)
            stream.finish(film.audio)
        total = time.perf_counter() - started
        if warmup:
            warmed = {"seconds": seconds, "total_s": round(total, 3)}
            continue
        results.append({"seconds": seconds, "frames": film.frames, "audio_samples": int(film.audio.shape[1]),
                        "windows": film.info["windows"], "total_s": round(total, 3),
                        "window_s": [w["seconds"] for w in film.info["windows"]],
                        "peak_gpu_memory_gb_per_window": peaks})
        print(json.dumps({"seconds": seconds, "total_s": round(total, 3), "windows": len(plan.windows),
                          "peaks_gb": peaks}), flush=True)
    result = {"canvas": f"{args.width}x{args.height}", "steps": args.steps,
              "recipes": [r.describe() for r in recipes], "vram_budget": args.vram_budget,
              "auto_budget": engine.auto_budget, "cuda_allocator": cuda_allocator.chosen(),
              "attention": settings.attention, "linear": settings.linear,
              "weights": synthetic.describe(args.preset, fasth3=fasth3), "load_s": load_s,
              "warmup": warmed or "none: the first film is also the warm-up", "films": results,
              "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
