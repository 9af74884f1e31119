"""A/B of one DiT forward between two trees of the package, in one lease: median seconds and the velocities.

Usage (repository root on the GPU machine; fa3-fwd installed for H3_ATTENTION=fa3 / fa3_fp8):
    python3 benchmarks/ab_forward_gpu.py --package-root ab/old --save /tmp/exact-old.pt --out $OUT/exact-old.json
    python3 benchmarks/ab_forward_gpu.py --save /tmp/exact-new.pt --out $OUT/exact-new.json
    python3 benchmarks/ab_forward_gpu.py --compare /tmp/exact-old.pt /tmp/exact-new.pt --out $OUT/exact-ab.json

`--package-root DIR` imports `h3_spark` from DIR (e.g. an older commit's package unpacked there); without it
the checkout's own package is imported. Both arms build the same synthetic full-size DiT (seed 0, fan-in
init, bf16, on the device), apply the kernels the H3_* variables ask for, and run the contract's sampled
forward (the target rows of its middle evaluation). The velocities are written with safetensors (never
pickle); `--compare` says whether two runs are bit-identical, and their rel L2 where they are not.
Only names that exist in both the old and the new layout of the package are imported, so one script serves
both arms; where the kernels' entry point moved, both homes are tried, and the one used is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where `apply_kernels` has lived: first the engine's home, then the older kernels/ home.
APPLY_KERNELS_HOMES = ("h3_spark.h3_model.engine.kernel_plan", "h3_spark.kernels.dispatch")


def _import_package(package_root: str | None):
    if package_root:
        sys.path.insert(0, str(Path(package_root).resolve()))
    else:
        sys.path.insert(0, str(ROOT))
    import h3_spark

    return Path(h3_spark.__file__).resolve().parent


def _apply_kernels():
    for home in APPLY_KERNELS_HOMES:
        try:
            module = importlib.import_module(home)
        except ImportError:
            continue
        if hasattr(module, "apply_kernels"):
            return module.apply_kernels, home
    raise SystemExit(f"no apply_kernels in any of {', '.join(APPLY_KERNELS_HOMES)}")


def forward(args) -> dict:
    package = _import_package(args.package_root)
    import torch
    from safetensors.torch import save_file

    from h3_spark.h3_model.dit.config import preset
    from h3_spark.h3_model.pipeline.sampler import schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import make_inputs, time_call
    from h3_spark.measure.synthetic import synthetic_dit

    apply_kernels, home = _apply_kernels()
    device = args.device
    contract = load_contract(ROOT / "benchmarks" / f"{args.contract}.json")
    model = synthetic_dit(preset(args.preset), torch.bfloat16, device, seed=0)
    report = apply_kernels(model, KernelSettings.from_env())
    shape = contract_shape(contract, model.config)
    lay = shape.layout
    schedule = JointSchedule.create(contract["steps"])
    step = len(schedule) // 2
    inputs = make_inputs(shape, model.config, device, contract["seed"], step, schedule)
    with torch.inference_mode():
        model.precompute_modulation(schedule_timestep_values(lay, schedule))
        text = model.encode_text(inputs["encoder_hidden_states"])
        target_v = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(), device=device)
        target_a = torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(), device=device)
        kwargs = {**inputs, "encoder_hidden_states": None}

        def sampled():
            return model(**kwargs, text_embeds=text, output_video_rows=target_v, output_audio_rows=target_a)

        video, audio = sampled()
        times = time_call(sampled, device, args.warmup, args.repeats)
    velocities = {"video": video.float().contiguous().cpu(), "audio": audio.float().contiguous().cpu()}
    save_file(velocities, args.save)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in velocities.values())).hexdigest()
    return {"contract": contract["name"], "package": str(package), "apply_kernels_from": home,
            "sequence_length": lay.sequence_length, "evaluation": step, "forward_s_median": statistics.median(times),
            "forward_s_all": times, "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None,
            "velocities_sha256": digest, "attention": report.get("attention"), "linear": report.get("linear"),
            "exact": report.get("exact"),
            "weights": f"synthetic random DiT (seed 0, fan-in init, bf16, preset {args.preset}) built on the device; "
                       "real H3 weights are not available here"}


def compare(a: str, b: str) -> dict:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    out = {"a": a, "b": b}
    for name in sorted(x):
        xa, yb = x[name].double(), y[name].double()
        out[name] = {"bit_identical": bool(x[name].shape == y[name].shape and (x[name] == y[name]).all()),
                     "rel_l2": ((xa - yb).norm() / yb.norm().clamp_min(1e-30)).item()}
    out["bit_identical"] = all(out[n]["bit_identical"] for n in sorted(x))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--package-root", help="a folder holding the h3_spark package to measure (default: this checkout)")
    p.add_argument("--contract", default="t2va-960x544-124f")
    p.add_argument("--save", help="where the velocities go (safetensors)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved velocity files instead")
    p.add_argument("--preset", default="full", help="full (the receipts) or tiny (a CPU check of the script)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if args.compare:
        result = compare(*args.compare)
    elif args.save:
        result = forward(args)
    else:
        p.error("give --save (a forward) or --compare A B")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("forward_s_all", "attention", "linear")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
