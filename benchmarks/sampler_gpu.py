"""res_multistep against euler at the same step count, side by side in one process; JSON into the --out folder.

Usage (repository root on the GPU machine; fa3-fwd for H3_ATTENTION=fa3):
    H3_ATTENTION=fa3 python3 benchmarks/sampler_gpu.py --out $OUT [--contract t2va-1344x768-124f] \
        [--evaluations 8,20] [--scheduler simple]
CPU check of the script (tiny random DiT, a 64x64 canvas):
    python3 benchmarks/sampler_gpu.py --preset tiny --device cpu --out /tmp/sampler

Synthetic random DiT weights built on the device by make-checkpoint's rule (measure/synthetic.synthetic_dit;
real H3 weights are not available here, and time does not depend on weight values), the contract's packed
layout and a random prompt embedding, the sampling loop the pipeline runs (pipeline/sampler.sample). For each
evaluation count, both samplers run from the same seed on the same scheduler's grid:
- seconds per step (the DiT forward plus the sampler's step; the first run of the process is a warm-up),
  median and all;
- the sampler's own step alone on the contract's rows (what res_multistep adds to Euler's step), median;
- the distance between the two runs' final latents, relative L2, video and audio apart: how far the second-order
  step moves the result at this many steps. Random weights make noise, so this says how different the two
  trajectories are on this model stand-in, not which one a real H3 prefers.
The result names the card (torch.cuda.get_device_name) and the software (measure/stamp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_CONTRACT = {"mode": "t2va", "width": 64, "height": 64, "frames": 124, "text_tokens": 16, "seed": 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"), help="the folder sampler_gpu.json goes to (default $OUT)")
    p.add_argument("--contract", default="t2va-1344x768-124f", help="benchmarks/NAME.json (full preset)")
    p.add_argument("--evaluations", default="8,20", help="comma-separated step counts (DiT evaluations)")
    p.add_argument("--scheduler", default="simple", help="the grid both samplers run on")
    p.add_argument("--video-shift", type=float, default=12.0)
    p.add_argument("--audio-shift", type=float, default=3.0)
    p.add_argument("--solver-repeats", type=int, default=20)
    p.add_argument("--preset", default="full", choices=["full", "tiny"], help="tiny: a CPU check of the script")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required when $OUT is not set")
    import_package()
    import torch

    from h3_spark.h3_model.dit.config import FULL, TINY
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.h3_model.pipeline.solvers import SAMPLERS, make_solver
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp
    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import rel_l2
    from h3_spark.measure.synthetic import describe, synthetic_dit

    record = stamp.stamp_before()
    device, cuda = args.device, args.device.startswith("cuda")
    config = FULL if args.preset == "full" else TINY
    dtype = torch.bfloat16 if cuda else torch.float32
    settings = KernelSettings.from_env() if cuda else KernelSettings(modulation_fusion="off",
                                                                       q_rms_rope_int8_fusion="off")
    model = synthetic_dit(config, dtype, device, seed=0)
    backends = apply_kernels(model, settings)
    contract = load_contract(ROOT / "benchmarks" / f"{args.contract}.json") if args.preset == "full" else TINY_CONTRACT
    shape = contract_shape(contract, config)
    lay = shape.layout
    prompt = torch.randn(1, lay.num_text, config.text_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    request = SamplingRequest(lay, prompt, shape.latent_frames, shape.latent_height, shape.latent_width,
                              shape.audio_latents)

    def run(sampler: str, schedule):
        return sample(model, request, schedule, torch.Generator().manual_seed(int(contract.get("seed", 0))),
                      device=device, sampler=sampler)

    def grid(evaluations: int):
        return JointSchedule.from_scheduler(args.scheduler, evaluations + 1, args.video_shift, args.audio_shift)

    run("euler", grid(2))  # warm-up: kernels, allocator, AdaLN tables
    runs = []
    for evaluations in [int(n) for n in args.evaluations.split(",") if n]:
        schedule = grid(evaluations)
        results = {name: run(name, schedule) for name in SAMPLERS}
        entry = {"evaluations": len(schedule), "scheduler": args.scheduler}
        for name, result in results.items():
            entry[name] = {"step_s_median": statistics.median(result.step_seconds),
                           "step_s_all": [round(s, 6) for s in result.step_seconds]}
        euler, res = results["euler"], results["res_multistep"]
        entry["res_multistep_vs_euler_video_rel_l2"] = rel_l2(res.video_latents, euler.video_latents)
        entry["res_multistep_vs_euler_audio_rel_l2"] = rel_l2(res.audio_latents, euler.audio_latents)
        runs.append(entry)
        print(json.dumps({k: (v if not isinstance(v, dict) else v["step_s_median"]) for k, v in entry.items()}),
              flush=True)
    result = {"benchmark": "sampler", "card": torch.cuda.get_device_name(device) if cuda else "cpu",
              "preset": args.preset, "contract": contract.get("name", "tiny 64x64, 124 frames"),
              "sequence_length": lay.sequence_length, "dtype": str(dtype).removeprefix("torch."),
              "shifts": [args.video_shift, args.audio_shift], "weights": describe(args.preset, text_encoder=False),
              "backends": backends, "runs": runs,
              "solver_step_s_median": solver_times(make_solver, grid(8), lay, config, device, args.solver_repeats),
              "stamp": stamp.stamp_after(record)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'sampler_gpu.json'}", flush=True)
    return 0


def solver_times(make_solver, schedule, lay, config, device: str, repeats: int) -> dict:
    """Each sampler's step alone (its second step: res_multistep's first is Euler's) on rows of the layout's target
    size, fp32 as the loop hands them over: median seconds."""
    import torch

    from h3_spark.h3_model.pipeline.solvers import SAMPLERS

    gen = torch.Generator().manual_seed(3)
    video_rows = lay.target_video_indices.numel()
    audio_rows = lay.audio_indices.numel() - lay.num_condition_audio_rows
    tensors = [torch.randn(rows, width, generator=gen).to(device) for rows, width in
               ((video_rows, config.video_patch_dim), (audio_rows, config.audio_in_channels))] * 2
    out = {}
    for name in SAMPLERS:
        times = []
        for _ in range(repeats):
            solver = make_solver(name, schedule)
            solver.step(0, tensors[0], tensors[2], tensors[1], tensors[3])
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            solver.step(1, tensors[0], tensors[2], tensors[1], tensors[3])
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


if __name__ == "__main__":
    sys.exit(main())
