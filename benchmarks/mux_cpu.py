"""The mp4 encode that follows the VAE decode: how long it runs past the last decoded frame under each x264 preset,
and what each costs in size and quality; JSON to --out.

Usage (repository root; the host's cores are what is measured, so run it where the renders run):
    python3 benchmarks/mux_cpu.py --out $OUT/mux.json [--frames 124] [--repeats 2]
CPU smoke:
    python3 benchmarks/mux_cpu.py --frames 24 --width 320 --height 192 --interval 0 --out /tmp/mux.json

The frames are made here, 1344x768 by default: `smooth` moves sine gradients with a light grain (camera-like
content), `grain` adds heavy grain (what a DiT with random weights decodes to: the receipts' renders). They are
handed to `media.Mp4Stream` as a render hands them: chunks of --chunk frames every --interval seconds (the
default 18 frames / 0.62 s is the video VAE's pace on an H100 or H200 at 1344x768: 124 frames in 4.3 s), then
`finish` with 5 s of stereo sound. Per column (an x264 preset, crf 18):
- tail_s: seconds from the last chunk handed over to the finished file (what a render waits for after its
  decode: the "mux" of the receipts), median of --repeats;
- encode_s: seconds from the first chunk to the finished file;
- bytes and bytes_vs_first (the first column's size), keyframes;
- psnr_db: the file decoded back against the frames given (RGB, over 255).
The host (cores, model), PyAV's and FFmpeg's versions and the commit are stamped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLUMNS = ("medium", "faster", "veryfast")


def make_frames(kind: str, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    grain = {"smooth": 3.0, "grain": 24.0}[kind]
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        rgb = np.stack([np.sin(xx / 57 + t / 7) * 60 + np.cos(yy / 33 - t / 11) * 50 + 128,
                        np.sin((xx + yy) / 91 + t / 5) * 80 + 128,
                        np.cos(xx / 23 - t / 9) * np.sin(yy / 41 + t / 13) * 90 + 128], axis=-1)
        out[t] = np.clip(rgb + rng.normal(0.0, grain, rgb.shape), 0, 255).astype(np.uint8)
    return out


def encode(path: Path, frames: np.ndarray, preset: str, chunk: int, interval: float) -> dict:
    from h3_spark.h3_model.media import files as media

    sound = np.random.default_rng(1).uniform(-0.3, 0.3, (2, 32000 * 6)).astype(np.float32)
    start = time.perf_counter()
    with media.mp4_writer(path, preset=preset) as stream:
        for i in range(0, len(frames), chunk):
            if i:
                time.sleep(max(0.0, start + (i // chunk) * interval - time.perf_counter()))
            stream.add(frames[i:i + chunk])
        handed = time.perf_counter()
        stream.finish(sound)
    end = time.perf_counter()
    return {"tail_s": end - handed, "encode_s": end - start}


def check(path: Path, frames: np.ndarray) -> dict:
    import av

    with av.open(str(path)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        keyframes = sum(1 for p in container.demux(video=0) if p.size and p.is_keyframe)
    if decoded.shape != frames.shape:
        raise SystemExit(f"{path}: decoded {decoded.shape}, gave {frames.shape}")
    mse = float(np.mean((decoded.astype(np.float64) - frames.astype(np.float64)) ** 2))
    return {"psnr_db": round(10 * np.log10(255.0 ** 2 / mse), 3), "keyframes": keyframes,
            "bytes": path.stat().st_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=18)
    parser.add_argument("--interval", type=float, default=0.62)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--content", default="smooth,grain")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="x264 presets, comma-separated")
    args = parser.parse_args(argv)

    import av

    from h3_spark.measure import stamp

    record = stamp.stamp_before()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.content.split(","):
            frames = make_frames(kind, args.frames, args.height, args.width)
            rows, first = {}, None
            for column in args.columns.split(","):
                path = Path(tmp) / f"{kind}-{column}.mp4"
                runs = [encode(path, frames, column, args.chunk, args.interval)
                        for _ in range(args.repeats)]
                row = {"tail_s": round(statistics.median(r["tail_s"] for r in runs), 3),
                       "encode_s": round(statistics.median(r["encode_s"] for r in runs), 3),
                       "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs], **check(path, frames)}
                first = first or row["bytes"]
                row["bytes_vs_first"] = round(row["bytes"] / first, 4)
                rows[column] = row
                print(f"{kind} {column}: tail {row['tail_s']} s, encode {row['encode_s']} s, "
                      f"{row['bytes'] / 1e6:.2f} MB ({row['bytes_vs_first']}x), {row['psnr_db']} dB, "
                      f"{row['keyframes']} keyframes", file=sys.stderr, flush=True)
            results[kind] = rows
    out = {"what": "x264 encode past the last decoded frame, per preset",
           "frames": args.frames, "width": args.width, "height": args.height, "chunk": args.chunk,
           "interval_s": args.interval, "repeats": args.repeats, "crf": 18,
           "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": _cpu_model()},
           "pyav": av.__version__, "ffmpeg": {k: str(v) for k, v in av.library_versions.items()},
           "results": results, "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


if __name__ == "__main__":
    raise SystemExit(main())
