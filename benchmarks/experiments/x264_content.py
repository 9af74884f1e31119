"""How much of the mux stage is the synthetic content: x264 (our mp4 writer, its defaults: crf 18, preset medium,
frame threads on every core) on frames like a random-weight render's (noise) against smooth moving frames.

    python3 benchmarks/experiments/x264_content.py --out x264.json [--frames 124] [--size 1344x768]

A render with random weights decodes to noise-like frames, which cost x264 far more than natural video (every
block is residual). No real video is used here: the smooth stand-in is a drifting sum of sinusoids plus mild
grain. Reported per content: seconds to encode the clip (`media.write_mp4`, audio included), frames per second,
bytes per frame.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels_gpu import import_package  # noqa: E402


def frames_of(kind: str, count: int, height: int, width: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    if kind == "noise":
        return torch.randint(0, 256, (count, height, width, 3), generator=gen, dtype=torch.uint8)
    t = torch.arange(count, dtype=torch.float32)[:, None, None, None]
    y = torch.linspace(0, 1, height)[None, :, None, None]
    x = torch.linspace(0, 1, width)[None, None, :, None]
    phase = torch.tensor([0.0, 2.1, 4.2])[None, None, None, :]
    wave = (torch.sin(2 * math.pi * (3 * x + 0.01 * t) + phase) + torch.sin(2 * math.pi * (2 * y - 0.007 * t) + phase))
    grain = torch.randn(count, height, width, 3, generator=gen) * 0.03
    return ((wave / 4 + 0.5 + grain).clamp(0, 1) * 255).round().to(torch.uint8)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=124)
    p.add_argument("--size", default="1344x768")
    args = p.parse_args(argv)
    import_package()
    import torch


    from h3_spark.h3_model.media.files import FPS, SAMPLE_RATE, write_mp4
    from h3_spark.measure import stamp

    width, height = (int(v) for v in args.size.split("x"))
    record = stamp.stamp_before()
    audio = torch.randn(2, round(args.frames / FPS * SAMPLE_RATE)) * 0.1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("noise", "smooth"):
            frames = frames_of(kind, args.frames, height, width)
            path = Path(tmp) / f"{kind}.mp4"
            start = time.perf_counter()
            write_mp4(path, frames, audio=audio)
            seconds = time.perf_counter() - start
            rows.append({"content": kind, "seconds": seconds, "fps": args.frames / seconds,
                         "bytes_per_frame": path.stat().st_size / args.frames})
            print(json.dumps(rows[-1]), flush=True)
    result = {"experiment": "x264_content", "frames": args.frames, "size": args.size, "rows": rows,
              "writer": "media.write_mp4 defaults (libx264 crf 18, preset medium, frame threads, AAC)",
              "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
