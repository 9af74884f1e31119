"""`h3-spark trace-dit`: one DiT forward on stored inputs, velocities written for the oracle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..h3_model.engine.options import add_dtype_flag


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run one DiT forward on stored inputs (parity debugging)",
                       description="One DiT forward on inputs stored under diffusers' forward argument names; "
                                   "writes `sample` and `audio_sample` (all video and audio rows).")
    p.add_argument("--checkpoint", required=True, help="DiT checkpoint: diffusers folder or single file")
    p.add_argument("--inputs", required=True, help="safetensors file with the forward inputs")
    p.add_argument("--out", required=True, help="safetensors file to write the velocities to")
    add_dtype_flag(p, default="float32", help="DiT dtype (default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--partition", choices=["t2va", "ref2va"], default=None,
                   help="which DiT when the checkpoint folder holds both")
    return p


def dit_key(path: Path, partition: str | None) -> str:
    """The loader's name for the DiT to trace: --partition's; without it, the one DiT the path holds (a lone file
    reads the same either way), so a Ref2VA/transformer/ or transformer_ref/ folder needs no flag."""
    from ..h3_model.checkpoint.source import mode_partition, resolve_dit_folder

    if partition is None and path.is_dir():
        folder = resolve_dit_folder(path, None)  # a folder with both asks for --partition
        owner = mode_partition(path.parent) if folder == path and folder.name == "transformer" else None
        partition = "ref2va" if folder.name == "transformer_ref" or owner == "ref2va" else "t2va"
    return "dit_ref" if partition == "ref2va" else "dit"


def run(args) -> int:
    import torch
    from safetensors.torch import save_file

    from ..errors import InputError
    from ..h3_model.dit.trace import DTYPES, read_inputs, run_trace
    from ..h3_model.engine.loading import LoadOptions, component_loader

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {args.device} asked for, but this machine has no CUDA GPU")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise InputError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    inputs = read_inputs(args.inputs)
    path = Path(args.checkpoint)
    # Resident and as built: the trace runs the reference path, so no kernels are applied.
    options = LoadOptions(device=args.device, dtype=DTYPES[args.dtype], kernels=None)
    model = component_loader(dit_key(path, args.partition), path, options)()
    outputs, seconds = run_trace(model, inputs, args.device)
    save_file(outputs, args.out, metadata={"dtype": args.dtype, "device": args.device})
    print(json.dumps({"out": str(args.out), "sample": list(outputs["sample"].shape),
                      "audio_sample": list(outputs["audio_sample"].shape), "dtype": args.dtype,
                      "device": args.device, "seconds": round(seconds, 4)}))
    return 0
