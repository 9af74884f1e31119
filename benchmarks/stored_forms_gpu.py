"""A DiT file in its stored form (StoredLinear) against the same file dequantized at load; JSON to --out.

Usage (repository root on the GPU machine; fa3-fwd for H3_ATTENTION=fa3):
    python3 benchmarks/stored_forms_gpu.py --mode resident --checkpoint F --save DIR --out $OUT/resident.json
    python3 benchmarks/stored_forms_gpu.py --mode budget --vram-budget 24 --checkpoint F --save DIR --out ...
    python3 benchmarks/stored_forms_gpu.py --mode load --checkpoint F --out ...

The checkpoint is a synthetic full-size file written by `h3-spark make-checkpoint --device cuda` (random weights
under the real names and formats), read through the real reader and the engine's component loader.
- resident: loads the file stored (codes on the GPU), times each contract's sampled forward, saves its velocities
  under --save, then loads the same file dequantized at load (the old path) in the same process, times it and
  compares the velocities bit for bit; also times the just-in-time dequantization of one block's linears.
- budget: the process is capped at --vram-budget GB of the GPU before anything loads
  (`torch.cuda.set_per_process_memory_fraction`); the file is read stored into host memory (views of its
  memory map), each block configured on the device, the budget's plan places the first blocks and streams the rest
  from page-locked host memory; forwards are timed and their velocities compared with the resident run's.
- load: seconds and peak host memory of a stored load onto the GPU, nothing else.
--reference DIR: velocities saved by another file's resident run (the bf16 file of the same random weights, say):
each forward's velocity rel L2 against them is reported (a quantized file's drift from bf16 is its
quantization's). --skip-dequantized leaves out resident's second, dequantized-at-load model.
Every mode reports the process's peak host memory (VmHWM) and, inside a cgroup, the cgroup's limit and peak
(h3_model/engine/host_memory.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

GB = 1e9


def host_memory() -> dict:
    """The engine's own host-memory facts (VmRSS, VmHWM, the cgroup's limit and peak)."""
    from h3_spark.h3_model.engine.host_memory import host_memory as facts

    return facts()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["resident", "budget", "load"], required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save", help="folder for the resident run's velocities (written by resident, read by budget)")
    p.add_argument("--contracts", default="t2va-960x544-124f,t2va-1344x768-124f")
    p.add_argument("--vram-budget", type=float, default=None, help="GB (budget mode)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference", help="folder of another run's saved velocities to report the drift from")
    p.add_argument("--skip-dequantized", action="store_true",
                   help="resident: do not load the file a second time dequantized at load")
    args = p.parse_args(argv)
    import_package()
    import torch

    device = "cuda"
    cap = None
    if args.mode == "budget":
        # Before anything is placed: the cap must see what loading needs, not only the forward.
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_budget * GB / total), 0)
        cap = f"set_per_process_memory_fraction({args.vram_budget * GB / total:.4f}) = {args.vram_budget} GB at start"

    from h3_spark.h3_model.engine.loading import LoadOptions, component_loader
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.kernels.stored_linear import StoredLinear
    from h3_spark.measure import stamp

    record = {**stamp.stamp_before(), "mode": args.mode, "checkpoint": args.checkpoint,
              "checkpoint_bytes": Path(args.checkpoint).stat().st_size, "gpu_cap": cap,
              "weights": "synthetic full-size random weights written by h3-spark make-checkpoint --device cuda"}
    settings = KernelSettings.from_env()
    budget = int(args.vram_budget * GB) if args.vram_budget else None
    options = LoadOptions(device=device, dtype=torch.bfloat16, kernels=settings, vram_budget=budget)
    start = time.perf_counter()
    model = component_loader("dit", Path(args.checkpoint), options)()
    record["load_s"] = round(time.perf_counter() - start, 2)
    record["stored_linears"] = sum(isinstance(m, StoredLinear) for m in model.modules())
    record["host_after_read"] = host_memory()
    if args.mode == "load":
        torch.cuda.synchronize()
        record["gpu_allocated_gb"] = round(torch.cuda.memory_allocated() / GB, 2)
        record["host_memory"] = host_memory()
        return _write(args.out, stamp.stamp_after(record))
    contracts = args.contracts.split(",")
    if args.mode == "budget":
        from h3_spark.h3_model.engine.memory import configure_in_host, plan_dit
        from h3_spark.h3_model.engine.placement import place_dit

        start = time.perf_counter()
        record["kernels"] = _short(configure_in_host(model, settings, device))
        rows = max(_rows(c, model.config) for c in contracts)
        plan = plan_dit(model, budget, rows)
        place_dit(model, plan, device)
        record["place_s"] = round(time.perf_counter() - start, 2)
        record["plan"] = plan.describe()
        record["host_after_place"] = host_memory()
    else:
        record["kernels"] = _short(apply_kernels(model, settings))
        record["jit_dequant_block_ms"] = _jit_block_ms(model, device)
    record["stored"] = {c: _forward(model, c, device, args.repeats, args.save, "save" if args.mode == "resident"
                                    else "compare", args.reference) for c in contracts}
    if model.block_stream is not None:
        stats = model.block_stream.stats
        record["bytes_copied_per_forward_gb"] = round(stats.bytes_copied / max(1, stats.forwards) / GB, 2)
    if args.mode == "resident" and not args.skip_dequantized:
        del model
        torch.cuda.empty_cache()
        start = time.perf_counter()
        dense = component_loader("dit", Path(args.checkpoint),
                                 LoadOptions(device=device, dtype=torch.bfloat16, kernels=settings,
                                             stored_weights=False))()
        record["dense_load_s"] = round(time.perf_counter() - start, 2)
        apply_kernels(dense, settings)
        record["dequantized_at_load"] = {c: _forward(dense, c, device, args.repeats, args.save, "compare")
                                         for c in contracts}
        for c in contracts:
            record["stored"][c]["ratio_to_dequantized_at_load"] = round(
                record["stored"][c]["forward_s_median"] / record["dequantized_at_load"][c]["forward_s_median"], 4)
    record["peak_gpu_allocated_gb"] = round(torch.cuda.max_memory_allocated() / GB, 2)
    record["host_memory"] = host_memory()
    return _write(args.out, stamp.stamp_after(record))


def _rows(contract_name: str, config) -> int:
    from h3_spark.measure.contract import contract_shape, load_contract

    root = Path(__file__).resolve().parent
    return contract_shape(load_contract(root / f"{contract_name}.json"), config).layout.sequence_length


def _forward(model, contract_name: str, device: str, repeats: int, save: str | None, what: str,
             reference: str | None = None) -> dict:
    """The contract's sampled forward (schedule step 0): median seconds, and its velocities saved or compared."""
    import torch

    from h3_spark.h3_model.pipeline.sampler import schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import make_inputs, rel_l2, time_call

    contract = load_contract(Path(__file__).resolve().parent / f"{contract_name}.json")
    shape = contract_shape(contract, model.config)
    lay = shape.layout
    schedule = JointSchedule.create(contract["steps"])
    inputs = make_inputs(shape, model.config, device, 0, 0, schedule)
    with torch.inference_mode():
        model.clear_modulation_cache()
        model.precompute_modulation(schedule_timestep_values(lay, schedule))
        text = model.encode_text(inputs["encoder_hidden_states"])
        tv = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(), device=device)
        ta = torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(), device=device)
        kwargs = {**inputs, "encoder_hidden_states": None}

        def call():
            return model(**kwargs, text_embeds=text, output_video_rows=tv, output_audio_rows=ta)

        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = time_call(call, device, 1, repeats)
        video, audio = call()
    out = {"rows": lay.sequence_length, "forward_s_median": round(statistics.median(times), 4),
           "forward_s_all": [round(t, 4) for t in times],
           "peak_gpu_allocated_gb": round(torch.cuda.max_memory_allocated() / GB, 2) if cuda else None}
    if save:
        path = Path(save) / f"{contract_name}.pt"
        if what == "save":
            Path(save).mkdir(parents=True, exist_ok=True)
            torch.save({"video": video.cpu(), "audio": audio.cpu()}, path)
        elif path.exists():
            ref = torch.load(path)
            out["velocity_bit_identical_to_stored_resident"] = bool(
                torch.equal(ref["video"], video.cpu()) and torch.equal(ref["audio"], audio.cpu()))
            out["velocity_rel_l2_to_stored_resident"] = rel_l2(video.cpu(), ref["video"])
    path = Path(reference or "") / f"{contract_name}.pt"
    if reference and path.exists():
        ref = torch.load(path)
        out["video_rel_l2_vs_reference"] = rel_l2(video.cpu().float(), ref["video"].float())
        out["audio_rel_l2_vs_reference"] = rel_l2(audio.cpu().float(), ref["audio"].float())
        out["reference"] = str(reference)
    return out


def _jit_block_ms(model, device: str) -> dict:
    """Milliseconds to dequantize one block's linears into the scratch (what each block's forward adds)."""
    import torch

    from h3_spark.kernels.stored_linear import StoredLinear
    from h3_spark.measure.runner import time_call

    blk = model.transformer_blocks[1]
    layers = [m for n, m in blk.named_modules() if isinstance(m, StoredLinear) and not n.startswith("adaln")]
    if not layers:
        return {}
    outs = [torch.empty(m.shape, dtype=m.out_dtype, device=device) for m in layers]

    def dequantize_all():
        for m, o in zip(layers, outs):
            m.dequantize_into(o)

    times = time_call(dequantize_all, device, 2, 5)
    weights = sum(m.out_features * m.in_features for m in layers)
    return {"linears": len(layers), "format": layers[0].label, "weights": weights,
            "ms_median": round(statistics.median(times) * 1e3, 3),
            "bf16_written_gb_per_s": round(weights * 2 / statistics.median(times) / GB, 1)}


def _short(report: dict) -> dict:
    return {k: report.get(k) for k in ("attention", "linear", "exact")}


def _write(path: str, record: dict) -> int:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2, default=str))
    print(json.dumps({k: record.get(k) for k in ("mode", "load_s", "stored", "dequantized_at_load", "host_memory",
                                                 "jit_dequant_block_ms", "plan", "peak_gpu_allocated_gb")},
                     default=str)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
