"""`h3-spark comfyui-demo MODELS_DIR`: the tiny demo models where ComfyUI's loaders look for them.

Writes the demo set (random weights with the real names and formats, a few MB) into ComfyUI's models folder
under the names the h3-spark loaders list (diffusion_models/h3-demo-t2va/, text_encoders/h3-demo-qwen3vl/,
vae/h3-demo-video-vae/, ...). Then open the template "H3 Demo, Text to Video (no download)" in ComfyUI: it runs in seconds
on a CPU and shows the whole graph working without the ~130 GB of released weights (the video is noise).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="write the tiny demo models into ComfyUI's models folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models_dir", type=Path, help="ComfyUI's models folder (ComfyUI/models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p


def run(args) -> int:
    import sys

    from ..h3_model.engine.demo import install_comfyui_demo

    log = (lambda m: None) if args.quiet else (lambda m: print(f"h3-spark: {m}", file=sys.stderr, flush=True))
    written = install_comfyui_demo(args.models_dir, args.seed, log)
    if not args.quiet:
        print(json.dumps({"written": {k: str(v) for k, v in written.items()},
                          "workflow": "workflows/H3 Demo, Text to Video (no download).json",
                          "note": "tiny synthetic random weights: the video and sound are noise"}))
    return 0
