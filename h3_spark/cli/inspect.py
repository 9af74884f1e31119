"""`h3-spark inspect`: what a checkpoint holds, from its headers alone (seconds on a 60 GB file): safetensors
files and folders, and GGUF files (their version, architecture and every tensor's GGML type and bytes); whether the
loader takes it; a JSON report only into --out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="report a checkpoint's layout, formats and completeness (headers only)",
                       description="Read safetensors or GGUF headers and metadata (never the weights) and report "
                                   "the model, layout, per-layer quantization (a GGUF's per-tensor GGML types and "
                                   "bytes), packed vs logical shapes, scales, dtype histogram, parameter count and "
                                   "what is missing or left over; then runs the loader's own check of the files "
                                   "(what generate and serve refuse before reading any weight) and says which one "
                                   "fails. Prints a summary; with --out, also writes "
                                   "<out>/<name>[.<partition>].inspect.json.")
    p.add_argument("checkpoint", help=".safetensors or .gguf file, a diffusers folder, or a folder of the official "
                                      "download (its root, FL2VA/, Ref2VA/ or a component folder in them)")
    p.add_argument("--out", default=None, help="write the JSON report into this folder (created if missing); "
                                               "without it nothing is written")
    p.add_argument("--partition", choices=["t2va", "fl2va", "ref2va"], default=None,
                   help="which DiT when the folder holds two: the official download's root (FL2VA/ and "
                        "Ref2VA/) or the older transformer/ and transformer_ref/ (also named in the report's file "
                        "name)")
    p.add_argument("--qkv-layout", choices=["auto", "stacked", "interleaved"], default="auto",
                   help="how an original-named file's fused QKV is ordered (the tensors cannot tell): auto reads a "
                        "folder's config.json (MiniMaxAI's transformer/ folders: interleaved), else stacked")
    return p


def report_name(path: Path, partition: str | None = None) -> str:
    """The report's file name. A partition is part of it: one folder's t2va and ref2va DiTs are different
    checkpoints, and the second report must not replace the first."""
    name = path.name
    for suffix in (".safetensors", ".gguf"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    name = name or "checkpoint"
    return f"{name}.{partition}" if partition else name


def report_folder(out: str) -> Path:
    from ..errors import InputError
    from ..h3_model.engine.flags import file_in_the_way

    folder = Path(out)
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise InputError(f"--out {folder}: {blocking} is a file; --out names the folder for the report")
    return folder


def run(args) -> int:
    from ..h3_model.checkpoint.inspect import inspect_checkpoint, summary_lines

    out_dir = report_folder(args.out) if args.out is not None else None  # checked before the files are read
    report = inspect_checkpoint(args.checkpoint, partition=args.partition, qkv_layout=args.qkv_layout)
    for line in summary_lines(report):
        print(line)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / f"{report_name(Path(args.checkpoint).resolve(), args.partition)}.inspect.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"  report: {out}")
    return 0
