"""The sparse attention's computed (query, key) pairs for a film window with and without its history (CPU).

Usage (repository root, any machine):
    python benchmarks/vsa_pairs_cpu.py --out receipts/cpu/vsa-history-pairs.json [--width 1344 --height 768]
        [--seconds 15,60] [--sparsity 0.9] [--history 5,22,39]

For each film length, the plan's window that goes on (`compose/windows.plan_film`: its frames and history) is
set against a first window of the same length, with its history and first-frame guide tiled two ways:
- `dense_prefix` (the tiling before the context tiles): every row before the target is a dense tile, which
  attends to every key and which every query keeps;
- `context_tiles` (what the fasth3 recipes run now): the history's video and the guide's are 3-D tiles of their
  own, selected like the target's within the target's budget.
Counted from the real layout (`dit/layout.build_t2va`) and the real tiling (`kernels/vsa_reference.tile_map`):
- `computed_pairs`: real rows; a dense query row meets every row, a video query row the dense rows and `keep`
  video tiles of the mean video tile size (the selection is data-dependent; this is its expectation over a
  uniform choice);
- `kernel_pairs`: what the block-sparse kernels multiply, exactly: every query tile and every selected key tile
  is a padded block of `tile` rows, so it does not depend on which tiles are selected.
Explains what a window that goes on costs under the fasth3 recipes, without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h3_spark.h3_model import geometry  # noqa: E402
from h3_spark.h3_model.compose.windows import frames_for_seconds, plan_film  # noqa: E402
from h3_spark.h3_model.dit.layout import GuideBlock, HistoryBlock, build_t2va, segments_before_video  # noqa: E402
from h3_spark.kernels.vsa_reference import tile_map, tiles_selected  # noqa: E402

TEXT_ROWS = 300  # a typical prompt's tokens; the text is a small part either way
TILE = 64


def window_layout(width: int, height: int, frames: int, history: int):
    """A T2VA window of `frames` frames; with `history` frames, one that goes on (its history and the previous
    window's last frame as its first-frame guide, as compose/film.py conditions it)."""
    lf = geometry.video_latent_frames(frames)
    lh, lw = geometry.latent_size(height, width)
    audio = geometry.audio_latent_frames(frames)
    guides = (GuideBlock(0, 1, 0),) if history else ()
    past = HistoryBlock(geometry.video_latent_frames(history),
                        geometry.AUDIO_LATENTS_PER_SECOND * history // geometry.FPS) if history else None
    lay = build_t2va(torch.zeros(TEXT_ROWS, dtype=torch.long), lf, lh, lw, audio, guides=guides, history=past)
    return lay, (lf, lh // 2, lw // 2)


def count(layout, patches, sparsity: float) -> dict:
    tiles = tile_map(segments_before_video(layout), patches, TILE)
    sizes = tiles.sizes.double()
    prefix, video = sizes[:tiles.num_prefix_tiles], sizes[tiles.num_prefix_tiles:]
    keep = tiles_selected(sparsity, tiles.num_video_tiles, tiles.num_context_tiles)
    pairs = prefix.sum() * sizes.sum() + video.sum() * (prefix.sum() + keep * video.mean())
    n, p = tiles.num_tiles, tiles.num_prefix_tiles
    blocks = p * n + (n - p) * (p + keep)
    return {"rows": layout.sequence_length, "prefix_rows": int(prefix.sum()), "prefix_tiles": p,
            "context_tiles": tiles.num_context_tiles, "target_tiles": tiles.num_target_tiles,
            "video_tiles_kept": keep, "computed_pairs": float(pairs), "kernel_pairs": float(blocks * TILE * TILE),
            "dense_pairs": float(sizes.sum() ** 2)}


def film_rows(width: int, height: int, seconds: float, sparsity: float, history: int) -> dict:
    """The film's window that goes on (the plan's second), and a first window of its length."""
    windows = plan_film([frames_for_seconds(seconds)], history=history).windows
    frames = windows[1].frames
    first_layout, patches = window_layout(width, height, frames, 0)
    first = count(first_layout, patches, sparsity)
    on, _ = window_layout(width, height, frames, history)
    before = count(dataclasses.replace(on, context_video=()), patches, sparsity)  # every row before: dense
    after = count(on, patches, sparsity)
    row = {"film_seconds": seconds, "window_frames": frames, "history_frames": history, "first_window": first,
           "going_on": {"dense_prefix": before, "context_tiles": after}}
    for name, x in (("dense_prefix", before), ("context_tiles", after)):
        row["going_on"][name]["vs_first_window"] = {
            k: round(x[k] / first[k], 3) for k in ("computed_pairs", "kernel_pairs", "rows")}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--seconds", default="15,60", help="film lengths whose window that goes on is counted")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--history", default="5,22,39", help="history lengths to count (17k+5 frames; films take 22)")
    args = p.parse_args(argv)
    films = [film_rows(args.width, args.height, float(s), args.sparsity, int(h))
             for s in args.seconds.split(",") if s for h in args.history.split(",") if h]
    result = {"canvas": f"{args.width}x{args.height}", "sparsity": args.sparsity, "tile": TILE,
              "text_rows": TEXT_ROWS, "films": films,
              "command": "python benchmarks/vsa_pairs_cpu.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([(f["film_seconds"], f["window_frames"], f["history_frames"],
                       {k: v["vs_first_window"] for k, v in f["going_on"].items()}) for f in films], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
