"""Video VAE encode of a film window's history (22 frames at 1344x768): where its time goes, and what cuts it.

A window that goes on from a film encodes the 22 frames before the previous window's last one (`compose/film.py`):
on an 80 GB H100 that took 4.65 s of a 56.2 s window (`receipts/h100/film-fasth3-15s-60s-auto-80b6066.json`), the
part of the history tax that is not attention. The encoder runs in fp32 over 256 px tiles. Columns, each on the
same frames and weights (`--columns`, comma-separated):

  fp32:T          the encoder as it runs (fp32, TF32 convolutions as torch allows them), T px tiles (0: untiled)
  autocast:T      fp32 weights, the convolutions under bf16 autocast (norms stay fp32)
  bf16:T          a bf16 copy of the encoder's weights under bf16 autocast

Each column: the median seconds of `--repeats` encodes after one warm-up, peak GPU memory, and its posterior mean
against the first column's (relative L2, max abs). Synthetic random full-size weights (time does not depend on
weight values; the errors of trained weights are not measured here).

    python3 benchmarks/vae_encode_gpu.py --out /tmp/encode.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

COLUMNS = "fp32:256,autocast:256,bf16:256,fp32:512,bf16:512,fp32:0,bf16:0"  # untiled fp32 fails at 1344x768


def parse_column(text: str) -> tuple[str, int]:
    kind, _, tile = text.partition(":")
    if kind not in ("fp32", "autocast", "bf16") or not tile.isdigit():
        raise SystemExit(f"a column is fp32|autocast|bf16:TILE, got {text!r}")
    return kind, int(tile)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=22)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--columns", default=COLUMNS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny (a check of the script)")
    p.add_argument("--tiny", action="store_true", help="the tiny VAE config (CPU check)")
    args = p.parse_args(argv)
    columns = [parse_column(c) for c in args.columns.split(",") if c]
    import_package()
    import torch

    from h3_spark.h3_model.vae import video_config
    from h3_spark.h3_model.vae.video import frames_to_vae_input
    from h3_spark.measure import stamp
    from h3_spark.measure.synthetic import synthetic_video_vae

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    record = stamp.stamp_before()
    cfg = video_config.TINY if args.tiny else video_config.FULL
    vae = synthetic_video_vae(cfg, str(device), torch.float16, seed=0)
    frames = torch.randint(0, 256, (args.frames, args.height, args.width, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    x = frames_to_vae_input(frames).to(device)
    fp32_encoder = vae.encoder
    bf16_encoder = copy.deepcopy(fp32_encoder).to(torch.bfloat16)

    def encode(kind: str, tile: int) -> torch.Tensor:
        vae.encoder = bf16_encoder if kind == "bf16" else fp32_encoder
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if kind != "fp32"
                    else contextlib.nullcontext())
        try:
            with autocast:
                return vae.encode(x, tile_size=tile or None).mean.float()
        finally:
            vae.encoder = fp32_encoder

    runs, reference = [], None
    for kind, tile in columns:
        try:
            encode(kind, tile)  # warm-up (cuDNN picks its algorithms)
        except RuntimeError as exc:  # a column this canvas cannot take (untiled fp32 at 1344x768 on the H100:
            # "input tensor must fit into 32-bit index math" in a convolution's padding): recorded, the rest run
            run = {"column": f"{kind}:{tile}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            runs.append(run)
            print(json.dumps(run), flush=True)
            if cuda:
                torch.cuda.empty_cache()
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            mean = encode(kind, tile)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        reference = mean if reference is None else reference
        run = {"column": f"{kind}:{tile}", "encode_s_median": statistics.median(seconds), "encode_s_all": seconds,
               "latent_shape": list(mean.shape),
               "rel_l2_vs_first": ((mean - reference).norm() / reference.norm()).item(),
               "max_abs_vs_first": (mean - reference).abs().max().item()}
        if cuda:
            run["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "encode_s_all"}), flush=True)
    result = {"benchmark": f"video VAE encode of {args.frames} frames at {args.width}x{args.height} (a film "
                           "window's history)", "config": "tiny" if args.tiny else "full",
              "weights": "synthetic random video VAE built on the device (real weights are not available here)",
              "runs": runs, "stamp": stamp.stamp_after(record)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
