"""One render of `h3-spark generate`, measured whole, on a card or a smaller box emulated on it; JSON to --out.

Usage (repository root on the GPU machine; the model files written first by `h3-spark make-checkpoint`):
    # the resident render, warm: a short render first (kernels compiled, caches filled), then the measured one
    python3 benchmarks/consumer_box_gpu.py --out $OUT/resident.json --warmup-steps 2 -- \\
        --dit DIT --text-encoder TE --tokenizer TOK --vae VAE --audio-vae AVAE \\
        --width 1344 --height 768 --frames 124 --steps 20 --prompt "..." --out /tmp/box.mp4
    # the consumer box from cold: this process inside a cgroup v2 with memory.max set (the caller's), the page
    # cache dropped first (the caller's), the GPU capped here before anything loads; the measured render is the
    # process's first
    python3 benchmarks/consumer_box_gpu.py --out $OUT/cold-24.json --gpu-cap 24 -- ... --vram-budget 24
    # a service's first request from cold: the text layers' page reader (H3_READ_THREADS) reads what the host's
    # page cache holds while the engine waits after its load, then the render
    H3_READ_THREADS=8 python3 benchmarks/consumer_box_gpu.py --out $OUT/cold-24-idle.json --gpu-cap 24 \
        --idle-until-read -- ... --vram-budget 24

Everything after `--` is `h3-spark generate`'s own flags, read by its parser and run through its own loading,
request and rendering code (one GPU; no films). `--gpu-cap GB` emulates a smaller card:
`torch.cuda.set_per_process_memory_fraction` at process start. The receipt: generate's JSON summary of the
measured render (stages, loads, plan, GPU peak, host memory with the cgroup's limit and peak) and this script's
wall-clock seconds: process start to imported (Python and torch) and to loaded (the summary's `load_s` splits the
load: each component, and under a budget `placement`, where a cold DiT's blocks are read), the measured render end
to end (text encode to the finished mp4), and in all. Each render's prompt is encoded anew (the prompt cache is
cleared after the warm-up), as a first request's would be. `--idle-until-read` waits after the load until the page
reader has read its window (the receipt's `idle`: seconds, layers and bytes read), as a service's first request
finds it when it comes after the load: a CLI render starts at once and reads its text layers on its own time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

START = time.perf_counter()

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402


def cap_gpu(gb: float) -> str:
    """The smaller card, set before any allocation; the receipt's line."""
    import torch

    from h3_spark.errors import InputError

    if not torch.cuda.is_available():
        raise InputError("--gpu-cap emulates a smaller GPU, and this machine has no CUDA GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, gb * 1e9 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return (f"torch.cuda.set_per_process_memory_fraction({fraction:.4f}) = {gb:g} GB of the "
            f"{torch.cuda.get_device_name(0)}'s {total / 1e9:.2f} GB, at process start")


def idle_until_read(engine) -> dict:
    """Wait for the text layers' page reader as a service idles after its load; what it read, or why no reader."""
    waited = engine.wait_text_read_ahead()
    if waited is not None:
        return waited
    plan = (engine.host_plan or {}).get("text_layers", {})
    why = plan.get("read_ahead", {}).get("why") or plan.get("why") or "the text layers do not stream"
    return {"threads": 0, "waited_s": 0.0, "why": f"no page reader: {why}"}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the receipt (JSON)")
    p.add_argument("--gpu-cap", type=float, default=None, metavar="GB", help="emulate a card of GB gigabytes")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="a render of this many sigma grid points first, not reported (0: the measured render is "
                        "the process's first)")
    p.add_argument("--idle-until-read", action="store_true",
                   help="after the load, wait for the text layers' page reader (H3_READ_THREADS) to read its window, "
                        "as a service idles before its first request")
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, generate_argv = p.parse_args(argv[:cut]), argv[cut + 1:]
    if args.gpu_cap is not None and args.gpu_cap <= 0:
        p.error(f"--gpu-cap must be positive, got {args.gpu_cap:g}")
    if args.warmup_steps < 0 or args.warmup_steps == 1:
        p.error(f"--warmup-steps must be 0 or at least 2 (grid points: 2 make one evaluation), got "
                f"{args.warmup_steps}")
    if not generate_argv:
        p.error("generate's flags go after `--` (the model files, canvas, steps, prompt and --out)")
    return args, generate_argv


def main(argv=None) -> int:
    args, generate_argv = parse(sys.argv[1:] if argv is None else argv)
    import_package()
    import torch

    from h3_spark.cli import build_parser
    from h3_spark.cli import generate as g
    from h3_spark.cli.compose import is_film
    from h3_spark.errors import InputError
    from h3_spark.h3_model.engine.options import given_model_flags
    from h3_spark.measure import stamp

    imported = time.perf_counter()
    record = stamp.stamp_before()
    cap = cap_gpu(args.gpu_cap) if args.gpu_cap is not None else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    gen = build_parser().parse_args(["generate", *generate_argv])
    gen._argv = ["generate", *generate_argv]
    if gen.demo or not given_model_flags(gen) or is_film(gen) or gen.gpus not in (None, 1):
        raise InputError("this benchmark renders one clip on one GPU from the model files given: no --demo (or no "
                         "model flags), films or --gpus")
    _, _, device = g.join_ranks(gen, 1)
    log = g.stderr_log(gen, 0)
    engine, req, options, _ = g.prepare(gen, device, 1, 0, 1, log)
    loaded = time.perf_counter()
    idle = idle_until_read(engine) if args.idle_until_read else None
    progress = g.progress_hook(gen, options.device, log)
    warmup = None
    if args.warmup_steps:
        started = time.perf_counter()
        # The warm-up keeps the AdaLN weights: the measured render then precomputes its own tables and releases
        # them, as generate's one render does.
        release, engine.pipeline.release_adaln = engine.pipeline.release_adaln, False
        try:
            g.render(gen, engine, dataclasses.replace(req, steps=args.warmup_steps), progress)
        finally:
            engine.pipeline.release_adaln = release
        warmup = {"steps": args.warmup_steps, "seconds": time.perf_counter() - started}
        engine.clear_caches()  # the measured render encodes its prompt, as a first request would
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the summary's GPU peak is the measured render's
    started = time.perf_counter()
    result = g.render(gen, engine, req, progress)
    render_s = time.perf_counter() - started
    summary = g.summarize(gen, engine, req, result, options, 1)
    receipt = {"benchmark": "consumer_box", "generate_argv": generate_argv, "gpu_cap": cap,
               "cold": not args.warmup_steps, "warmup": warmup, "idle": idle,
               "seconds": {"start_to_imported": imported - START, "start_to_loaded": loaded - START,
                           "idle": idle and idle["waited_s"], "render": render_s,
                           "stages_sum": sum(result.timings.values()),
                           "start_to_rendered": time.perf_counter() - START},
               "summary": summary,
               "weights": "synthetic random weights written by h3-spark make-checkpoint (real H3 weights are not "
                          "available here; time does not depend on weight values)",
               "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(receipt, indent=2))
    print(json.dumps({k: receipt[k] for k in ("gpu_cap", "cold", "warmup", "idle", "seconds")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
