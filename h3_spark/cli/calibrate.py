"""`h3-spark calibrate`: static NVFP4 activation scales for a DiT, and the gate that promotes them.

    h3-spark calibrate --requests calib.json --out scales.safetensors (--synthetic tiny | --dit F --text-encoder T)
    h3-spark calibrate --verify scales.safetensors --requests held_out.json [--limit 1.0] [--exclude-failing] (same model)

Everything the user gave is checked before any model is built: the requests (canvases, lengths, steps, prompts
as the engine checks them), and for --verify the artifact (readable, its content hash, the model hash and
partition it was calibrated on, held-out requests new and on calibrated shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..h3_model.engine.flags import check_device
from ..h3_model.engine.options import add_dtype_flag

PARTITION, KEY = "t2va", "dit"  # calibration requests are t2va: the t2va/fl2va DiT


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="calibrate static NVFP4 activation scales, or gate (--verify) an artifact",
                       description="Runs the DiT's sampling on requests with NVFP4 linears in the reference "
                                   "emulation (any device) and records per block linear the activation amax; writes "
                                   "an artifact of static global scales (safetensors + JSON header). --verify runs "
                                   "held-out requests and promotes the artifact only when every static layer's "
                                   "observed amax is within --limit of its static range and the velocity drift "
                                   "against dynamic scales is within the package's quality budget "
                                   "(h3_spark/measure/quality_budget.json). Use a promoted artifact with "
                                   "H3_NVFP4_STATIC_SCALES=PATH (h3_spark/kernels/README.md).")
    p.add_argument("--requests", type=Path, required=True,
                   help="JSON {\"requests\": [{\"prompt\", \"width\", \"height\", \"frames\", \"steps\", \"seed\"}, "
                        "...]} (t2va): calibration requests, or with --verify the held-out ones")
    p.add_argument("--out", type=Path, default=None,
                   help="the artifact to write (calibration); with --verify: where to write the verified artifact "
                        "(default: in place)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument("--margin", type=float, default=1.0,
                   help="static range = margin x the largest amax calibrated (>= 1.0; default 1.0)")
    p.add_argument("--verify", type=Path, default=None, metavar="ARTIFACT",
                   help="run the promotion gate on this artifact with the held-out --requests")
    p.add_argument("--limit", type=float, default=1.0,
                   help="--verify: the largest observed amax / static range a static layer may show (default 1.0)")
    p.add_argument("--exclude-failing", action="store_true",
                   help="--verify: layers over --limit become dynamic (listed in the artifact) instead of refusing")
    src = p.add_argument_group("the DiT (t2va partition) and the text encoder")
    src.add_argument("--synthetic", choices=["tiny"], default=None,
                     help="the demo's tiny random text encoder and DiT (at hidden width 32, which NVFP4 "
                          "linears take), built on the spot (tests)")
    src.add_argument("--seed", type=int, default=0, help="--synthetic: the weights' seed")
    src.add_argument("--models", type=Path, default=None, help="a model folder (its t2va DiT and text encoder)")
    src.add_argument("--dit", type=Path, default=None, help="the t2va/fl2va DiT file or folder")
    src.add_argument("--text-encoder", type=Path, default=None)
    src.add_argument("--tokenizer", type=Path, default=None)
    src.add_argument("--text-encoder-layer", type=int, default=50, help="the Qwen3-VL layer the DiT reads")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    add_dtype_flag(p, default="bfloat16")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def run(args) -> int:
    from ..errors import InputError
    from ..h3_model.engine import static_scales as artifact
    from ..measure import nvfp4_calibration as cal

    log = (lambda message: None) if args.quiet else (lambda message: print(message, file=sys.stderr))
    verifying = args.verify is not None
    if not verifying and args.out is None:
        raise InputError("give --out ARTIFACT to calibrate, or --verify ARTIFACT to gate one")
    if not verifying and (args.limit != 1.0 or args.exclude_failing):
        raise InputError("--limit and --exclude-failing belong to --verify")
    if verifying and args.margin != 1.0:
        raise InputError("--margin belongs to calibration (the artifact's scales are verified as they are)")
    cal.check_limit(args.limit)
    cal.check_margin(args.margin)
    out = args.out if args.out is not None else args.verify
    check_out(out, args.force or (verifying and args.out is None))
    requests = cal.read_requests(args.requests, "held-out" if verifying else "calibration")
    paths = model_paths(args)
    identity = model_identity(args, paths)
    art = None
    if verifying:
        art = artifact.read(args.verify, "--verify")
        artifact.check_model(art, identity, PARTITION, "--verify")
        cal.check_held_out(art, requests, f"held-out file {args.requests}")
    device = check_device(args.device)

    engine = build_engine(args, paths, device)
    model = getattr(engine.components, KEY)
    sources = cal.prepare_model(engine, KEY)
    from ..kernels import nvfp4_static

    shapes = nvfp4_static.layer_shapes(model)
    if verifying:
        artifact.check_layers(art, shapes, "--verify")
        excluded, record = cal.gate(engine, KEY, art, requests, args.limit, args.exclude_failing, log)
        header = {**art.header, "gate": {**record, "commit": commit()}, "excluded": sorted(excluded)}
        artifact.write(out, header, art.scales)
        summary = {"artifact": str(out), "verdict": record["verdict"], "why": record["why"],
                   "static_layers": record["static_layers"], "excluded_layers": len(excluded),
                   "failing_layers": record["failing_layers"], "max_ratio": record["max_ratio"],
                   "velocity_drift_max": record["velocity_drift"]["max"], "budget": record["velocity_drift"]["budget"],
                   "seconds": record["seconds"]}
    else:
        scales, figures = cal.calibrate(engine, KEY, requests, args.margin, log)
        header = {"format": artifact.FORMAT, "version": artifact.VERSION, "model": identity,
                  "partition": PARTITION, "commit": commit(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
                  "kernel_settings": kernel_settings(), "device": device, "dtype": args.dtype,
                  "emulation": "NVFP4 reference emulation (kernels/nvfp4.py reference_activation, "
                               "nvfp4_linear_reference)",
                  "linear_sources": sources, "excluded": [], "gate": None, **figures}
        artifact.write(out, header, scales)
        summary = {"artifact": str(out), "layers": len(scales), "shapes": [artifact.shape_name(s) for s in
                                                                           figures["shapes"]],
                   **figures["calibration"]}
    print(json.dumps(summary))
    return 0 if not verifying or summary["verdict"] == "promoted" else 1


def check_out(path: Path, replace: bool) -> None:
    from ..errors import InputError

    if path.is_dir():
        raise InputError(f"--out {path} is a folder; give the artifact's file name")
    if not path.parent.is_dir():
        raise InputError(f"--out {path}: the folder {path.parent} does not exist")
    if path.exists() and not replace:
        raise InputError(f"--out {path} exists; add --force to replace it")


def model_paths(args):
    from ..errors import InputError
    from ..h3_model.engine.paths import ComponentPaths

    given = [f for f in ("models", "dit", "text_encoder", "tokenizer") if getattr(args, f) is not None]
    if args.synthetic is not None:
        if given:
            raise InputError(f"--synthetic builds its own models; drop --{given[0].replace('_', '-')}")
        return None
    if args.seed != 0:
        raise InputError("--seed belongs to --synthetic")
    paths = ComponentPaths(models=args.models, dit=args.dit, text_encoder=args.text_encoder, tokenizer=args.tokenizer)
    paths.check_models()
    for name, flag in (("dit", "--dit"), ("text_encoder", "--text-encoder")):
        if paths.resolve(name) is None:
            raise InputError(f"the {name.replace('_', ' ')} is needed: pass --models or {flag} (or --synthetic tiny)")
    return paths


def model_identity(args, paths) -> dict:
    from ..h3_model.engine import static_scales as artifact

    if paths is None:
        return artifact.recipe_hash(synthetic_recipe(args.synthetic, args.seed))
    return artifact.model_hash(paths.resolve("dit"))


def synthetic_recipe(preset: str, seed: int) -> str:
    """What names a synthetic DiT: the engine's synthetic builders draw it from exactly these."""
    return f"synthetic:{preset}:dit-hidden-32:seed={seed}:init=fan_in"


def build_engine(args, paths, device: str):
    import torch

    from ..h3_model.engine.engine import Engine
    from ..h3_model.engine.loading import LoadOptions, component_loader

    dtype = getattr(torch, args.dtype)
    if paths is None:
        from ..measure.synthetic import synthetic_dit, synthetic_text_encoder, tiny_nvfp4_config

        dit = synthetic_dit(tiny_nvfp4_config(), dtype, device, seed=args.seed)
        return Engine.of(dit=dit, text_encoder=synthetic_text_encoder("tiny", device, dtype, args.seed), device=device)
    opts = LoadOptions(device=device, dtype=dtype, kernels=None, text_layer=args.text_encoder_layer)
    dit = component_loader("dit", paths.resolve("dit"), opts)()
    text = component_loader("text_encoder", paths.resolve("text_encoder"), opts, paths.resolve("tokenizer"))()
    return Engine.of(dit=dit, text_encoder=text, device=device)


def commit() -> str | None:
    from ..measure.stamp import git_commit

    return git_commit()


def kernel_settings() -> dict:
    from ..kernels.settings import KernelSettings

    return KernelSettings.from_env().to_dict()
