"""The H3 Fun ControlNet's cost per evaluation against the plain DiT, side by side in one process; JSON to --out.

Usage (repository root on the GPU machine; fa3-fwd for H3_ATTENTION=fa3; resident needs an H200's memory):
    python3 benchmarks/controlnet_gpu.py --out $OUT/controlnet.json [--budgets resident,24] [--union2]
CPU check of the script (tiny models, a small canvas):
    python3 benchmarks/controlnet_gpu.py --out /tmp/cn.json --preset tiny --device cpu --width 128 --height 64 \
        --budgets resident --repeats 1

The DiT: synthetic full-size random weights built on the device (measure/synthetic.py, the engine's own loader
and placement); the ControlNet: a synthetic file written by our make-checkpoint writer in Alibaba PAI's layout
(v1: 5 blocks after layers 0, 10, 20, 30, 40; --union2: 10 blocks every 5 layers; bf16) and loaded through
`Engine.load_controlnet` like `generate --controlnet` does. Per budget (resident, or a VRAM budget in GB under
which the DiT's blocks stream; the DiT is planned for the budget less the tower's streamed minimum, and the tower
keeps resident what the DiT's plan leaves and streams its other blocks, so the plain forward there streams as the
controlled one does and the ratio includes the tower's copies), at one sampled evaluation
of the 1344x768x124 contract (the tower active, strength 1):
- plain: the DiT forward with no control;
- controlled: the same forward with the control tower injecting after its layers.
Reported: median seconds of each, the ratio (the floor is about 1 + blocks / 50: +10 % for v1), peak GPU memory,
the tower's bytes. Time does not depend on weight values; random weights make noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="the JSON result: a file, or a folder (default $OUT)")
    p.add_argument("--contract", default="t2va-1344x768-124f")
    p.add_argument("--width", type=int, default=None, help="override the contract's canvas (the CPU check)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--budgets", default="resident,24",
                   help="comma-separated: resident, or a VRAM budget in GB (the DiT streams what does not fit)")
    p.add_argument("--union2", action="store_true", help="the Union 2.0 tower (10 blocks) instead of v1 (5)")
    p.add_argument("--preset", default="full", choices=["full", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--step", type=int, default=1, help="which evaluation of the contract's schedule is timed")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where the ControlNet file is written (default: a temp folder)")
    p.add_argument("--keep-adaln", action="store_true",
                   help="keep the DiT's AdaLN weights after the tables are precomputed (generate drops them by default)")
    args = p.parse_args(argv)
    import_package()
    import os

    import torch

    from h3_spark.h3_model.checkpoint.controlnet import random_getter, synthetic_config, write_controlnet
    from h3_spark.h3_model.controlnet.tower import ControlInjection
    from h3_spark.h3_model.dit.config import preset as dit_preset
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.h3_model.pipeline.sampler import schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp, synthetic
    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import make_inputs, time_call

    out = Path(args.out or os.environ.get("OUT") or ".")
    if out.suffix != ".json":
        out = out / "controlnet.json"
    record = stamp.stamp_before()
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    settings = KernelSettings.from_env()
    config = dit_preset(args.preset)
    contract = dict(load_contract(ROOT / "benchmarks" / f"{args.contract}.json").data)
    for key in ("width", "height", "frames"):
        if getattr(args, key) is not None:
            contract[key] = getattr(args, key)
    shape = contract_shape(contract, config)
    lay = shape.layout
    schedule = JointSchedule.create(contract["steps"])
    step = min(args.step, len(schedule) - 1)
    n_target = lay.video_indices.numel() - lay.num_condition_video_rows

    control_config = synthetic_config(config, union2=args.union2, comfy=False)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="h3-controlnet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"controlnet-{args.preset}-{control_config.version}.safetensors"
    file_bytes = write_controlnet(path, control_config, random_getter(control_config, 0, device), "released")
    hint = torch.randn(n_target, control_config.hint_dim, generator=torch.Generator().manual_seed(1))

    runs = []
    for budget_name in args.budgets.split(","):
        budget = None if budget_name == "resident" else int(float(budget_name) * 1e9)
        builders = synthetic.component_builders(args.preset, ["t2va"], device, dtype)
        options = LoadOptions(device=device, dtype=dtype, kernels=settings, vram_budget=budget,
                              plan_rows=lay.sequence_length)
        engine = Engine(options=options, overrides={"dit": builders["dit"]})
        engine.check_controlnet(path, ["t2va"])  # under a budget the DiT's plan leaves the tower its minimum
        engine.load(["t2va"], dit_only=True)
        engine.load_controlnet(path)
        dit, tower = engine.components.dit, engine.components.controlnet
        injection = ControlInjection(tower, hint, strength=1.0, window=(0.0, 1.0))
        inputs = make_inputs(shape, dit.config, device, contract["seed"], step, schedule)
        with torch.inference_mode():
            dit.control = injection  # the tower's AdaLN tables are precomputed with the DiT's
            dit.clear_modulation_cache()
            dit.precompute_modulation(schedule_timestep_values(lay, schedule))
            if not args.keep_adaln:  # as `generate` samples: the tables (the tower's too) are all that is needed
                dit.release_adaln()
            text = dit.encode_text(inputs["encoder_hidden_states"])
            kwargs = {**inputs, "encoder_hidden_states": None, "text_embeds": text,
                      "output_video_rows": torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(),
                                                        device=device),
                      "output_audio_rows": torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(),
                                                        device=device)}

            def plain():
                dit.control = None
                return dit(**kwargs)

            def controlled():
                dit.control = injection
                return dit(**kwargs)

            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            plain_t = time_call(plain, device, args.warmup, args.repeats)
            plain_peak = torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            before = injection.evaluations
            controlled_t = time_call(controlled, device, args.warmup, args.repeats)
            controlled_peak = torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None
            ran = injection.evaluations - before
        a, b = statistics.median(plain_t), statistics.median(controlled_t)
        # A streamed block's tensors are empty in their modules: its bytes are in the stream's host buffers.
        stream = tower.block_stream
        tower_bytes = (sum(t.numel() * t.element_size() for t in [*tower.parameters(), *tower.buffers()])
                       + (stream.host_bytes if stream is not None else 0))
        runs.append({"budget": budget_name, "sequence_length": lay.sequence_length, "evaluation": step,
                     "plain_forward_s_median": a, "plain_forward_s_all": plain_t,
                     "controlled_forward_s_median": b, "controlled_forward_s_all": controlled_t,
                     "controlled_over_plain": b / a, "tower_evaluations_timed": ran,
                     "plain_peak_gpu_gb": plain_peak, "controlled_peak_gpu_gb": controlled_peak,
                     "tower_bytes": tower_bytes,
                     "memory_plan": engine.memory_report("dit") if budget is not None else None,
                     "controlnet_plan": engine.memory_report("controlnet")})
        print(json.dumps({k: v for k, v in runs[-1].items()
                          if not k.endswith("_all") and k not in ("memory_plan", "controlnet_plan")}), flush=True)
        dit.control = None
        del engine, dit, tower, stream, injection, inputs, kwargs, text
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    card = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    result = {"benchmark": "controlnet", "card": card, "contract": args.contract,
              "canvas": [contract["width"], contract["height"], contract["frames"]],
              "controlnet": {"version": control_config.version, "blocks": control_config.blocks,
                             "places": list(control_config.places), "layout": "released (bf16)",
                             "file_bytes": file_bytes},
              "floor": 1 + control_config.blocks / config.num_layers,
              "weights": synthetic.describe(args.preset, text_encoder=False) + "; the ControlNet written by "
                         "checkpoint/controlnet.write_controlnet (make-checkpoint --component controlnet)",
              "runs": runs, "stamp": stamp.stamp_after(record)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
