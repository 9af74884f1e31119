"""Sequence-parallel DiT on several GPUs vs one: parity and speed for a contract (run under torchrun).

    torchrun --nproc_per_node N -m h3_spark.measure.parallel_gpu --contract benchmarks/t2va-960x544-124f.json \\
        --out result.json

Every rank builds the same synthetic full-size weights (seeded), runs the contract's forward alone
(the one-GPU baseline, timed on every rank at once) and then split over all ranks; rank 0 writes
the medians, the speed-up and the rel L2 of the split velocities against the one-GPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from ..h3_model.dit.config import preset
from ..h3_model.dit.parallel import split_over_ranks
from ..h3_model.pipeline.scheduler import JointSchedule
from . import stamp
from .contract import contract_shape, load_contract
from .runner import make_inputs, rel_l2, time_call
from .synthetic import synthetic_dit


def parse_args(argv: list[str] | None = None):
    """The arguments and the kernel settings they give. Checked here, before any process group or model,
    so a bad flag stops every rank at once with an error that names the flag."""
    from ..errors import H3Error
    from ..kernels.settings import kernel_settings

    p = argparse.ArgumentParser()
    p.add_argument("--contract", required=True)
    p.add_argument("--preset", default="full")
    p.add_argument("--attention", default=None, help="default: H3_ATTENTION, else auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        settings = kernel_settings(args.attention, None)
    except H3Error as exc:
        p.error(str(exc))
    return args, settings


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = stamp.stamp_before() if rank == 0 else None

    from ..h3_model.engine.kernel_plan import apply_kernels

    contract = load_contract(args.contract)
    model = synthetic_dit(preset(args.preset), torch.bfloat16 if cuda else torch.float32, device, seed=0)
    report = apply_kernels(model, settings)
    shape = contract_shape(contract, model.config)
    schedule = JointSchedule.create(contract["steps"])
    inputs = make_inputs(shape, model.config, device, contract["seed"], len(schedule) // 2, schedule)
    with torch.inference_mode():
        single = model(**inputs)
        single_times = time_call(lambda: model(**inputs), device, 1, args.repeats)
        split_over_ranks(model)
        split = model(**inputs)
        dist.barrier()
        split_times = time_call(lambda: model(**inputs), device, 1, args.repeats)
    if rank == 0:
        one, many = statistics.median(single_times), statistics.median(split_times)
        result = {
            "contract": contract["name"], "world_size": world, "sequence_length": shape.layout.sequence_length,
            "weights": "synthetic random N(0, 0.02) full-size weights built on each GPU (same seed)",
            "backends": report, "one_gpu_forward_s_median": one, "one_gpu_forward_s_all": single_times,
            "split_forward_s_median": many, "split_forward_s_all": split_times, "speedup": one / many,
            "efficiency": one / many / world,
            "velocity_rel_l2_split_vs_one_gpu": rel_l2(torch.cat([split[0].flatten(), split[1].flatten()]),
                                                       torch.cat([single[0].flatten(), single[1].flatten()])),
            "peak_gpu_memory_gb_rank0": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "stamp": stamp.stamp_after(record),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("world_size", "sequence_length", "one_gpu_forward_s_median",
                                                  "split_forward_s_median", "speedup",
                                                  "velocity_rel_l2_split_vs_one_gpu")}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
