"""One DiT forward with and without the recipes that change a forward, side by side in one process; JSON to --out.

Usage (repository root on the GPU machine; comfy-kitchen for `sparse`, fa3-fwd for H3_ATTENTION=fa3):
    H3_ATTENTION=fa3 python3 benchmarks/recipe_forward_gpu.py --out $OUT/recipe_forward.json \
        --contracts t2va-1344x768-124f,t2va-1344x768-345f [--repeats 2]

Synthetic full-size random weights built on the device, the kernels H3_* asks for. Per contract, at the
sampled forward of evaluation `dense_steps` (the first one the sparse recipe makes sparse):
- base: the model's own attention in every block;
- sparse: the recipe's schedule (its first `dense_blocks` blocks dense, Sol-Attn in the others);
- first-block-cache reuse: a forward whose cache answers after the first block (the cost of a reused step).
Reported: median seconds, the ratio to base, and the rel L2 of the sparse forward's velocities against base.
The turbo recipe changes the number of forwards, not a forward; the step caches' reuse rates depend on real
weights. Random weights do not make H3's attention maps: Sol-Attn's routing, speed and error will differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import import_package  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--contracts", default="t2va-1344x768-124f,t2va-1344x768-345f")
    p.add_argument("--recipe", default="sparse", help="the sparse recipe and its values (NAME[:k=v,...])")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.h3_model.dit.config import FULL
    from h3_spark.h3_model.engine.recipes import SparseSchedule, parse_recipes, sparse_backend
    from h3_spark.h3_model.pipeline.sampler import schedule_timestep_values
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.h3_model.pipeline.step_cache import make_step_cache
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import stamp
    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import make_inputs, rel_l2, time_call
    from h3_spark.measure.synthetic import describe, synthetic_dit

    record = stamp.stamp_before()
    device = "cuda"
    settings = KernelSettings.from_env()
    model = synthetic_dit(FULL, torch.bfloat16, device, seed=0)
    report = apply_kernels(model, settings)
    recipe, = parse_recipes([args.recipe])
    schedule_attn = SparseSchedule(model.attention, sparse_backend(recipe, device, settings),
                                   recipe.params["dense_steps"], recipe.params["dense_blocks"])
    step = recipe.params["dense_steps"]
    runs = []
    for name in args.contracts.split(","):
        contract = load_contract(ROOT / "benchmarks" / f"{name}.json")
        shape = contract_shape(contract, FULL)
        lay = shape.layout
        schedule = JointSchedule.create(contract["steps"])
        inputs = make_inputs(shape, FULL, device, contract["seed"], min(step, len(schedule) - 1), schedule)
        with torch.inference_mode():
            model.clear_modulation_cache()
            model.precompute_modulation(schedule_timestep_values(lay, schedule))
            text = model.encode_text(inputs["encoder_hidden_states"])
            kwargs = {**inputs, "encoder_hidden_states": None, "text_embeds": text,
                      "output_video_rows": torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(),
                                                        device=device),
                      "output_audio_rows": torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(),
                                                        device=device)}
            base_t = time_call(lambda: model(**kwargs), device, 1, args.repeats)
            base = model(**kwargs)
            model.attention_schedule, model.sampling_step = schedule_attn, step
            try:
                sparse_t = time_call(lambda: model(**kwargs), device, 1, args.repeats)
                sparse = model(**kwargs)
            finally:
                model.attention_schedule, model.sampling_step = None, None
            cache = make_step_cache("first_block", 1e9, 0.0, 1.0, evaluations=1 + 2 * (args.repeats + 1))
            cache.velocities(0, None, None, lambda **kw: model(**kwargs, **kw))  # computed: stores the residuals

            def reused():
                return cache.velocities(cache._next, None, None, lambda **kw: model(**kwargs, **kw))

            reuse_t = time_call(reused, device, 1, args.repeats)
        b, s, r = (statistics.median(t) for t in (base_t, sparse_t, reuse_t))
        runs.append({"contract": name, "sequence_length": lay.sequence_length, "evaluation": step,
                     "base_forward_s_median": b, "base_forward_s_all": base_t,
                     "sparse_forward_s_median": s, "sparse_forward_s_all": sparse_t, "sparse_speedup": b / s,
                     "sparse_video_rel_l2_vs_base": rel_l2(sparse[0].float(), base[0].float()),
                     "sparse_audio_rel_l2_vs_base": rel_l2(sparse[1].float(), base[1].float()),
                     "first_block_reuse_forward_s_median": r, "first_block_reuse_speedup": b / r,
                     "reused_steps": cache.reused})
        print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("_all")}), flush=True)
        del inputs, kwargs, base, sparse, cache
        torch.cuda.empty_cache()
    result = {"benchmark": "recipe_forward", "recipe": recipe.describe(), "weights": describe("full"),
              "backends": report, "sol_attn": schedule_attn.sparse.describe(), "runs": runs,
              "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
