"""The sparse attention's computed (query, key) pairs for a film window with and without its history (CPU).

Usage (repository root, any machine):
    python benchmarks/vsa_pairs_cpu.py --out receipts/cpu/vsa-history-pairs.json [--width 1344 --height 768]
        [--frames 294] [--sparsity 0.9] [--history 5,22,39]

Counted from the real layout (`dit/layout.build_t2va`) and the real tiling (`kernels/vsa_reference.tile_map`):
the rows before the target video (text, a history, guides) are prefix tiles, which attend to every key and
which every query keeps; a target tile keeps ceil((1 - sparsity) x video tiles) video tiles. Explains what a
window that goes on from the film costs under the fasth3 recipe, without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h3_spark.h3_model import geometry  # noqa: E402
from h3_spark.h3_model.dit.layout import GuideBlock, HistoryBlock, build_t2va, segments_before_video  # noqa: E402
from h3_spark.kernels.vsa_reference import tile_map, video_tiles_kept  # noqa: E402

TEXT_ROWS = 300  # a typical prompt's tokens; the text is a small part either way


def computed_pairs(width: int, height: int, frames: int, sparsity: float, history: int | None) -> dict:
    lf = geometry.video_latent_frames(frames)
    lh, lw = geometry.latent_size(height, width)
    audio = geometry.audio_latent_frames(frames)
    guides = (GuideBlock(0, 1, 0),) if history else ()  # a window that goes on: the last frame at frame 0
    past = HistoryBlock(geometry.video_latent_frames(history),
                        geometry.AUDIO_LATENTS_PER_SECOND * history // geometry.FPS) if history else None
    lay = build_t2va(torch.zeros(TEXT_ROWS, dtype=torch.long), lf, lh, lw, audio, guides=guides, history=past)
    tiles = tile_map(segments_before_video(lay), (lf, lh // 2, lw // 2), 64)
    sizes = tiles.sizes.double()
    prefix, video = sizes[:tiles.num_prefix_tiles], sizes[tiles.num_prefix_tiles:]
    keep = video_tiles_kept(sparsity, tiles.num_video_tiles)
    # Prefix queries see every key; a video query tile its prefix keys and `keep` video tiles (mean size).
    pairs = prefix.sum() * sizes.sum() + video.sum() * (prefix.sum() + keep * video.mean())
    return {"history_frames": history or 0, "rows": lay.sequence_length, "prefix_rows": int(prefix.sum()),
            "prefix_tiles": tiles.num_prefix_tiles, "video_tiles": tiles.num_video_tiles, "video_tiles_kept": keep,
            "computed_pairs": float(pairs), "dense_pairs": float(sizes.sum() ** 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, default=1344)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--frames", type=int, default=294)
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--history", default="5,22,39", help="history lengths to count (17k+5 frames)")
    args = p.parse_args(argv)
    rows = [computed_pairs(args.width, args.height, args.frames, args.sparsity, None)]
    rows += [computed_pairs(args.width, args.height, args.frames, args.sparsity, int(h))
             for h in args.history.split(",") if h]
    first = rows[0]["computed_pairs"]
    for row in rows:
        row["vs_first_window"] = round(row["computed_pairs"] / first, 3)
    result = {"canvas": f"{args.width}x{args.height}", "frames": args.frames, "sparsity": args.sparsity,
              "tile": 64, "text_rows": TEXT_ROWS, "windows": rows,
              "command": "python benchmarks/vsa_pairs_cpu.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([(r["history_frames"], r["vs_first_window"]) for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
