"""Video VAE decode of the contract canvas (960x544, 124 frames) on one GPU, per tile batch; JSON to --out.

Usage (repository root on the GPU machine):
    python3 benchmarks/vae_decode_gpu.py --out $OUT/vae_decode.json [--tile-batches 1,4,8,15] [--repeats 3]

Full-size video VAE with random weights built on the device (the decode's speed does not depend on the
weight values; real weights cannot be downloaded here), uint8 output, 256 px tiles. For each decoder dtype
(--dtypes), kernel set (--kernels: attention backend, fused passes on/off) and tile batch: median seconds of
`decode_to_buffer` (host clock around a synchronised call: the buffer lands on the host), peak GPU memory
against `decode_memory_estimate`, the rel L2 of the frames against the first run's (and against the float32
decode's when one ran), and with --profile the CUDA time per kernel group.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402


def measure(vae, z, kernel_set: str, batch: int, args) -> tuple:
    """One kernel set and tile batch: (run record, the decoded frames as float)."""
    import torch

    from h3_spark.measure.profile import profile_call
    from h3_spark.h3_model.vae import video as video_vae
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.h3_model.engine.kernel_plan import apply_vae_kernels

    attention, _, fusion = kernel_set.partition(":")
    fused = {"on": "exact", "off": "off", "on-eager-residual": "exact"}[fusion or "off"]
    settings = KernelSettings(modulation_fusion=fused, q_rms_rope_int8_fusion="auto" if fused == "exact" else "off")
    report = apply_vae_kernels(vae, settings, attention=None if attention == "auto" else attention)
    if fusion == "on-eager-residual":  # the fused passes but the residual step: that fusion measured on its own
        for block in vae.decoder.transformer_blocks:
            block.residual_norm = None
        report["residual_norm"] = "pytorch-reference"
    vae.decode_to_buffer(z, tile_batch=batch)  # warm-up (cuDNN / kernel selection for this batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        frames = vae.decode_to_buffer(z, tile_batch=batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    t, h, w = z.shape[2:]
    estimate = video_vae.decode_memory_estimate(vae.config, t, h, w, tile_batch=batch)
    profile = profile_call(lambda: vae.decode_to_buffer(z, tile_batch=batch), "cuda", top=12) if args.profile else None
    run = {"kernels": kernel_set, "kernel_report": report, "profile": profile, "tile_batch": batch,
           "decode_s_median": statistics.median(times), "decode_s_all": times,
           "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
           "estimated_device_peak_gb": estimate["device_peak"] / 1e9}
    return run, frames.float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tile-batches", default="1,4,8,15")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latent", default="37,34,60", help="latent frames, height, width (124 f at 960x544)")
    p.add_argument("--kernels", default="sdpa:off",
                   help="comma-separated decoder kernel sets ATTENTION:FUSION (ATTENTION auto or an exact backend; "
                        "FUSION on|off: fused Q/K norm + RoPE, SwiGLU and the residual step; on-eager-residual: "
                        "all but the residual step), each run at every tile batch, e.g. "
                        "sdpa:off,cudnn_sdpa:off,auto:on,auto:on-eager-residual")
    p.add_argument("--profile", action="store_true", help="also record CUDA time per kernel group of one decode")
    p.add_argument("--dtypes", default="float16", help="comma-separated decoder dtypes: float16, float32")
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.measure import stamp
    from h3_spark.measure.synthetic import synthetic_video_vae
    from h3_spark.h3_model.vae import video_config

    if not torch.cuda.is_available():
        print("vae_decode_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    record = stamp.stamp_before()
    t, h, w = (int(v) for v in args.latent.split(","))
    z = torch.randn(1, video_config.FULL.latent_channels, t, h, w, generator=torch.Generator().manual_seed(0)).cuda()
    runs, outputs = [], []
    for dtype_name in args.dtypes.split(","):
        torch.cuda.empty_cache()
        # the same seed in every dtype: the same weights, rounded to it
        vae = synthetic_video_vae(video_config.FULL, "cuda", getattr(torch, dtype_name), seed=0)
        for kernel_set in args.kernels.split(","):
            for batch in (int(b) for b in args.tile_batches.split(",")):
                run, frames = measure(vae, z, kernel_set, batch, args)
                run["dtype"] = dtype_name
                reference = outputs[0] if outputs else frames
                run["frames_rel_l2_vs_first_run"] = ((frames - reference).norm() / reference.norm()).item()
                run["max_abs_diff_uint8"] = (frames - reference).abs().max().item()
                runs.append(run)
                outputs.append(frames)
                brief = {k: v for k, v in run.items() if k != "profile"}
                if run["profile"]:
                    brief["profile_groups_ms"] = {g: round(v["ms"], 1) for g, v in run["profile"]["groups"].items()}
                    brief["top"] = [(k["name"][:60], round(k["ms"], 1)) for k in run["profile"]["top_kernels"][:8]]
                print(json.dumps(brief), flush=True)
        del vae
    exact = next((f for r, f in zip(runs, outputs) if r["dtype"] == "float32"), None)
    if exact is not None:
        for run, frames in zip(runs, outputs):
            run["frames_vs_float32"] = {"rel_l2": ((frames - exact).norm() / exact.norm()).item(),
                                        "max_abs_diff_uint8": (frames - exact).abs().max().item(),
                                        "fraction_equal": (frames == exact).float().mean().item()}
    result = {"benchmark": f"video VAE decode 960x544x124 ({args.dtypes}, 256 px tiles, uint8 out)",
              "latent_shape": list(z.shape), "frames": int(outputs[0].shape[1]),
              "weights": "synthetic random full-size video VAE built on the device (real weights are not "
                         "available here; decode timing does not depend on weight values)",
              "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
