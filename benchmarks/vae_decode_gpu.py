"""Video VAE decode of the contract canvas (960x544, 124 frames) on one GPU, per tile batch; JSON to --out.

Usage (repository root on the GPU machine):
    python3 benchmarks/vae_decode_gpu.py --out $OUT/vae_decode.json [--tile-batches 1,4,8,15] [--repeats 3]

Full-size video VAE with random weights built on the device (the decode's speed does not depend on the
weight values; real weights cannot be downloaded here), fp16 decode, uint8 output, 256 px tiles. For each
kernel set (--kernels: attention backend, fused passes on/off) and tile batch: median seconds of
`decode_to_buffer` (host clock around a synchronised call: the buffer lands on the host), peak GPU memory
against `decode_memory_estimate`, the rel L2 of the frames against the first run's, and with --profile the
CUDA time per kernel group.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tile-batches", default="1,4,8,15")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latent", default="37,34,60", help="latent frames, height, width (124 f at 960x544)")
    p.add_argument("--kernels", default="sdpa:off",
                   help="comma-separated decoder kernel sets ATTENTION:FUSION (ATTENTION auto or an exact backend; "
                        "FUSION on|off: fused Q/K norm + RoPE and SwiGLU), each run at every tile batch, e.g. "
                        "sdpa:off,cudnn_sdpa:off,auto:on")
    p.add_argument("--profile", action="store_true", help="also record CUDA time per kernel group of one decode")
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.bench import stamp
    from h3_spark.bench.profile import profile_call
    from h3_spark.bench.synthetic import synthetic_video_vae
    from h3_spark.h3_model import video_vae
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.kernels.vae import apply_vae_kernels

    if not torch.cuda.is_available():
        print("vae_decode_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    record = stamp.stamp_before()
    t, h, w = (int(v) for v in args.latent.split(","))
    vae = synthetic_video_vae(video_vae.FULL, "cuda", torch.float16, seed=0)
    z = torch.randn(1, vae.config.latent_channels, t, h, w, generator=torch.Generator().manual_seed(0)).cuda()
    reference = None
    runs = []
    for kernel_set, batch in ((k, int(b)) for k in args.kernels.split(",") for b in args.tile_batches.split(",")):
        attention, _, fusion = kernel_set.partition(":")
        fused = {"on": "exact", "off": "off"}[fusion or "off"]
        settings = KernelSettings(modulation_fusion=fused, q_rms_rope_int8_fusion="auto" if fused == "exact" else "off")
        report = apply_vae_kernels(vae, settings, attention=None if attention == "auto" else attention)
        vae.decode_to_buffer(z, tile_batch=batch)  # warm-up (cuDNN / kernel selection for this batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            frames = vae.decode_to_buffer(z, tile_batch=batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        frames = frames.float()
        if reference is None:
            reference = frames
        err = ((frames - reference).norm() / reference.norm()).item()
        estimate = video_vae.decode_memory_estimate(vae.config, t, h, w, tile_batch=batch)
        profile = None
        if args.profile:
            profile = profile_call(lambda: vae.decode_to_buffer(z, tile_batch=batch), "cuda", top=12)
        runs.append({"kernels": kernel_set, "kernel_report": report, "profile": profile,
                     "tile_batch": batch, "decode_s_median": statistics.median(times), "decode_s_all": times,
                     "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
                     "estimated_device_peak_gb": estimate["device_peak"] / 1e9,
                     "frames_rel_l2_vs_first_run": err,
                     "max_abs_diff_uint8": (frames - reference).abs().max().item()})
        brief = {k: v for k, v in runs[-1].items() if k != "profile"}
        if profile:
            brief["profile_groups_ms"] = {g: round(v["ms"], 1) for g, v in profile["groups"].items()}
            brief["top"] = [(k["name"][:60], round(k["ms"], 1)) for k in profile["top_kernels"][:8]]
        print(json.dumps(brief), flush=True)
    result = {"benchmark": "video VAE decode 960x544x124 (fp16, 256 px tiles, uint8 out)",
              "latent_shape": [1, vae.config.latent_channels, t, h, w], "frames": int(reference.shape[1]),
              "weights": "synthetic random full-size video VAE built on the device (real weights are not "
                         "available here; decode timing does not depend on weight values)",
              "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
