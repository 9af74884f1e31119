"""TAEH3 draft decode against the full video VAE at 1344x768, 124 frames (37 x 48 x 84 latents); JSON to --out.

Usage (repository root on the GPU machine):
    python3 benchmarks/taeh3_gpu.py --out $OUT/taeh3.json [--taeh3 taeh3.safetensors] [--repeats 3] [--chunk 8]

Both decoders take the same normalized latents. TAEH3 is `decode_draft` (fp16) in its two modes: in chunks of
--chunk latent frames (the default the pipeline uses) and the whole clip through each layer at once
(`chunk=None`; --skip-whole leaves it out); the JSON says whether their frames are equal (and by how many uint8
levels they differ if not) and gives the activation figure the module's formula predicts for each (128 x H x W
values a latent frame). TAEH3 is read from --taeh3 or, without it, a random full-size file written by
make-checkpoint's writer; the video VAE is the full-size one with random weights built on the device (speed and
memory do not depend on the weight values; real weights cannot be downloaded here), `decode_to_buffer` in fp16
with 256 px tiles. Per run: median seconds over --repeats (host clock around a synchronised call; uint8 frames on
the host), peak device memory of the call (CUDA's allocator peak, and that peak less what was allocated before the
call: the decode's own memory; on the CPU the process's peak RSS, which never goes down), and the frame shapes,
which must be equal. `--preset tiny --device cpu` runs the demo's VAE and a tiny TAEH3 (a smoke test of this
script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FULL_LATENTS = "37,48,84"  # 124 frames at 1344x768


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--taeh3", type=Path, default=None, help="a taeh3.safetensors (default: a random full-size one)")
    p.add_argument("--latent", default=FULL_LATENTS, help="latent frames, height, width (5n+2 frames)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tile-batch", type=int, default=8, help="the video VAE's tiles per decoder call")
    p.add_argument("--preset", choices=["full", "tiny"], default="full",
                   help="full: the released VAE and 24-channel TAEH3; tiny: the demo's VAE and a 4-channel TAEH3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--chunk", type=int, default=None, help="latent frames a chunked draft decodes at a time "
                   "(default: decode_draft's)")
    p.add_argument("--skip-whole", action="store_true", help="leave out TAEH3's whole-clip pass")
    p.add_argument("--skip-vae", action="store_true", help="time TAEH3 alone")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.latent.split(","))
    if len(shape) != 3 or min(shape) < 1 or shape[0] % 5 != 2:
        p.error(f"--latent must be FRAMES,HEIGHT,WIDTH with 5n+2 frames (the lengths the pipeline makes), got "
                f"{args.latent!r}")
    if args.chunk is not None and args.chunk < 1:
        p.error(f"--chunk must be at least 1 latent frame, got {args.chunk}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    args.latent_shape = shape
    return args


def _timed(fn, device: str, repeats: int) -> tuple[dict, object]:
    import torch

    cuda = device.startswith("cuda")
    out = fn()  # warm-up (kernel selection)
    del out  # the warm-up's frames are not held through the timed calls
    before = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        out = None
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    run = {"seconds_median": statistics.median(times), "seconds_all": times, "peak_memory_gb": peak / 1e9,
           "peak_memory_kind": "CUDA allocator peak" if cuda else "process peak RSS"}
    if cuda:
        run["peak_above_start_gb"] = (peak - before) / 1e9
    return run, out


def predicted_activation_gb(latent_frames: int, height: int, width: int, bytes_per_value: int) -> float:
    """The module's formula: the last stage's conv holds 128 x H x W values a latent frame (tiny_decoder.py)."""
    return latent_frames * 128 * height * width * bytes_per_value / 1e9


def main(argv=None) -> int:
    args = parse(argv)
    from kernels_gpu import import_package

    import_package()
    import torch

    from h3_spark.h3_model.engine.demo import DEMO_VAE
    from h3_spark.h3_model.vae import video_config
    from h3_spark.h3_model.vae.taeh3_synthetic import write_taeh3
    from h3_spark.h3_model.vae.tiny_decoder import DRAFT_CHUNK, decode_draft, load_tiny_decoder
    from h3_spark.measure import stamp
    from h3_spark.measure.synthetic import synthetic_video_vae

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("taeh3_gpu.py needs a CUDA GPU (or --device cpu for the smoke test)", file=sys.stderr)
        return 2
    record = stamp.stamp_before()
    config = video_config.FULL if args.preset == "full" else DEMO_VAE
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = args.taeh3 or write_taeh3(Path(tmp) / "taeh3.safetensors", args.preset, seed=0)
        taeh3 = load_tiny_decoder(path, device=args.device, dtype=dtype)
    t, h, w = args.latent_shape
    z = torch.randn(1, config.latent_channels, t, h, w, generator=torch.Generator().manual_seed(0)).to(args.device)
    result = {"benchmark": f"TAEH3 draft decode vs the full video VAE, {w * 16}x{h * 16}, latents {t}x{h}x{w}",
              "device": args.device, "dtype": str(dtype).removeprefix("torch."), "preset": args.preset,
              "taeh3": str(args.taeh3) if args.taeh3 else "random full-size file (make-checkpoint's writer)"}
    chunk = DRAFT_CHUNK if args.chunk is None else args.chunk
    size = torch.finfo(dtype).bits // 8
    runs = {}
    run, frames = _timed(lambda: decode_draft(z, taeh3, config, chunk=chunk), args.device, args.repeats)
    runs["chunked"] = {**run, "chunk": chunk, "frames_shape": list(frames.shape),
                       "predicted_activation_gb": predicted_activation_gb(min(chunk, t), h * 16, w * 16, size)}
    print(json.dumps({"taeh3_chunked": runs["chunked"]}), flush=True)
    if not args.skip_whole:
        run, whole = _timed(lambda: decode_draft(z, taeh3, config, chunk=None), args.device, args.repeats)
        runs["whole"] = {**run, "frames_shape": list(whole.shape),
                         "predicted_activation_gb": predicted_activation_gb(t, h * 16, w * 16, size)}
        result["chunked_equals_whole"] = torch.equal(frames, whole)
        result["chunked_vs_whole_max_uint8_levels"] = int((frames.int() - whole.int()).abs().max())
        print(json.dumps({"taeh3_whole": runs["whole"]}), flush=True)
        del whole
    result["taeh3_runs"] = runs
    del taeh3
    if not args.skip_vae:
        vae = synthetic_video_vae(config, args.device, dtype, seed=0)
        run, full = _timed(lambda: vae.decode_to_buffer(vae.denormalize(z), tile_size=256,
                                                        tile_batch=args.tile_batch)[0], args.device, args.repeats)
        result["vae_run"] = {**run, "frames_shape": list(full.shape), "tile_batch": args.tile_batch}
        result["same_frame_shape"] = list(full.shape) == list(frames.shape)
        result["taeh3_speedup"] = {mode: run["seconds_median"] / draft["seconds_median"]
                                   for mode, draft in runs.items()}
        print(json.dumps({"vae": result["vae_run"]}), flush=True)
    result["stamp"] = stamp.stamp_after(record)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("same_frame_shape", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
