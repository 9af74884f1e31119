"""How much the random-weight init decides the quality figures (CPU, a few seconds per init); JSON to --out.

Usage (repository root, any machine):
    python3 benchmarks/experiments/synthetic_init_study.py --out study.json [--layers 50] [--hidden 384]

A 50-block DiT narrowed to --hidden (4 heads x 128) on the tiny T2VA contract's layout, in bf16, against
itself in fp32, against itself with the other exact attention (the noise floor), and with every block linear
through FP8 (per-token e4m3 activations x per-channel e4m3 weights, `fp8_linear_reference`), for two inits:
- normal_0.02 with the full-size gain: std 0.02 * sqrt(5376 / fan_in), i.e. what N(0, 0.02) does at the
  released width (the first H200 receipts' weights);
- fan_in: make-checkpoint's rule (unit-gain linears, AdaLN projections x 0.2), like a trained network.
The velocities' rel L2 for each: the floor and the FP8 error are properties of the weights as much as of the
kernels, so a quality budget needs weights that do not amplify rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for kernels_gpu
from kernels_gpu import import_package  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=50)
    p.add_argument("--hidden", type=int, default=384)
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.measure.contract import contract_shape, load_contract
    from h3_spark.measure.runner import make_inputs, rel_l2
    from h3_spark.measure.synthetic import synthetic_dit
    from h3_spark.h3_model.dit.config import FULL
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule
    from h3_spark.kernels import linear_fp8
    from h3_spark.kernels.attention import math_reference, sdpa

    cfg = dataclasses.replace(FULL, num_attention_heads=4, attention_head_dim=128, hidden_size=args.hidden,
                              ffn_dim=math.ceil(args.hidden * 8 / 3 / 64) * 64, num_layers=args.layers,
                              text_dim=256, time_embed_hidden_dim=args.hidden, time_embed_dim=args.hidden // 2)
    contract = load_contract(REPO / "tests" / "data" / "tiny-t2va.json")
    shape = contract_shape(contract, cfg)
    schedule = JointSchedule.create(contract["steps"])
    inputs = make_inputs(shape, cfg, "cpu", 0, len(schedule) // 2, schedule)

    def build(init: str, dtype):
        model = synthetic_dit(cfg, dtype, "cpu", seed=0, init="normal_0.02" if init == "normal_0.02" else "fan_in")
        if init == "normal_0.02":
            with torch.no_grad():
                for param in model.parameters():
                    if param.ndim == 2:
                        param.mul_(math.sqrt(FULL.hidden_size / param.shape[1]))
        return model

    def velocities(model, attention=sdpa, fp8=False):
        model.set_attention(attention)
        swapped = {}
        if fp8:
            for blk in model.transformer_blocks:
                for mod in (blk.attn.to_q, blk.attn.to_k, blk.attn.to_v, blk.attn.to_out[0], blk.ff.net[0].proj,
                            blk.ff.net[2]):
                    wq, ws = linear_fp8.quantize_weight(mod.weight.data)
                    swapped[mod] = mod.forward
                    mod.forward = lambda x, wq=wq, ws=ws: linear_fp8.fp8_linear_reference(x, wq, ws)
        try:
            with torch.no_grad():
                v, a = model(**inputs)
        finally:
            for mod, forward in swapped.items():
                mod.forward = forward
        return torch.cat([v.flatten(), a.flatten()]).double()

    result = {"sequence_length": shape.layout.sequence_length, "layers": args.layers, "hidden": args.hidden,
              "inits": {}}
    for init in ("normal_0.02", "fan_in"):
        truth = velocities(build(init, torch.float32))
        model = build(init, torch.bfloat16)
        exact = velocities(model)
        result["inits"][init] = {
            "bf16_vs_fp32": rel_l2(exact, truth),
            "noise_floor_sdpa_vs_math_attention": rel_l2(velocities(model, lambda q, k, v: math_reference(q, k, v)),
                                                         exact),
            "fp8_linears_vs_bf16_exact": rel_l2(velocities(model, fp8=True), exact),
        }
        print(init, json.dumps(result["inits"][init]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
