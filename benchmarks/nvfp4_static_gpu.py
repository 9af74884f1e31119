"""Static NVFP4 activation scales on one GPU (an H200: emulation only): JSON to --out.  NOT RUN YET.

Usage (repository root on the GPU machine):
    python3 benchmarks/nvfp4_static_gpu.py --out $OUT/nvfp4_static.json [--steps 3] [--skip-calibration]

- calibration and gate: the synthetic full-size DiT (random fan_in weights) and the synthetic Qwen3-VL-32B stand-in
  on the GPU, the DiT's block linears in the NVFP4 reference emulation (h3_model/engine/block_linears.emulate_nvfp4:
  FP4 GEMMs do not run on Hopper), t2va-960x544-124f's canvas with --steps sigma points; `--calibration-requests`
  requests calibrate, `--held-out` others are gated. Wall seconds of each, the gate's figures (ratios, drift
  against dynamic scales, verdict), the artifact under $OUT.
- the amax reduction a static scale removes: for each block GEMM input at S = 19,540 rows of the full model
  (q/k/v and fc1: hidden 5376; to_out: 56 x 128; fc2: the FFN width), the Triton encoder with the dynamic scale
  (two passes: amax, then encode) and with a static one (one pass), CUDA events, median; the bytes of both
  checked equal when the static scale is the input's own; per forward, the saving for the unfused path (each
  linear encodes its input) and for the fused producers (q/k/v share one encode, SwiGLU writes fc2's input).
Nothing of this was run when it was written; on Blackwell (native FP4 GEMMs) nothing could be measured at all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_gpu import bench, import_package  # noqa: E402

CONTRACT = Path(__file__).resolve().parent / "t2va-960x544-124f.json"


def amax_pass_cost(rows: int, repeats: int) -> dict:
    import torch

    from h3_spark.h3_model.dit.config import preset
    from h3_spark.kernels import nvfp4 as nv

    c = preset("full")
    widths = {"hidden (q/k/v, fc1)": c.hidden_size, "attention out (to_out)": c.num_attention_heads * c.attention_head_dim,
              "ffn (fc2)": c.ffn_dim}
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"rows": rows, "layers": c.num_layers, "per_input": {}}
    for what, k in widths.items():
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        dyn = nv.quantize_nvfp4(x)
        static = nv.StaticInput(dyn.global_scale.clone(), torch.zeros(1, dtype=torch.int32, device="cuda"))
        st = nv.quantize_nvfp4(x, static)
        identical = (torch.equal(dyn.packed, st.packed) and torch.equal(dyn.block_scales.view(torch.uint8),
                                                                          st.block_scales.view(torch.uint8)))
        t_dyn = bench(lambda: nv.quantize_nvfp4(x), repeats)
        t_static = bench(lambda: nv.quantize_nvfp4(x, static), repeats)
        out["per_input"][what] = {"k": k, "dynamic_ms": t_dyn, "static_ms": t_static, "saved_ms": t_dyn - t_static,
                                  "bytes_identical": identical, "saturated_blocks": int(static.saturated.item())}
    p = {w: v["saved_ms"] for w, v in out["per_input"].items()}
    hid, att, ffn = p["hidden (q/k/v, fc1)"], p["attention out (to_out)"], p["ffn (fc2)"]
    out["saved_ms_per_forward"] = {
        "unfused (q, k, v, to_out, fc1, fc2 each encode)": c.num_layers * (4 * hid + att + ffn),
        "fused producers (norm1 once for q/k/v, to_out, norm2 for fc1, SwiGLU for fc2)":
            c.num_layers * (2 * hid + att + ffn),
        "note": "the fused producers' amax pass recomputes the norm / SwiGLU, so their saving is a little larger "
                "than the plain encoder's measured here"}
    return out


def calibration_and_gate(args, out_dir: Path) -> dict:
    import torch

    from h3_spark.h3_model.dit.config import preset
    from h3_spark.h3_model.engine import static_scales as artifact
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.kernels import nvfp4_static
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import nvfp4_calibration as cal
    from h3_spark.measure.stamp import git_commit
    from h3_spark.measure.synthetic import synthetic_dit, synthetic_text_encoder

    contract = json.loads(CONTRACT.read_text())
    start = time.perf_counter()
    dit = synthetic_dit(preset("full"), torch.bfloat16, "cuda", seed=0)
    te = synthetic_text_encoder("full", "cuda", torch.bfloat16, 0)
    engine = Engine.of(dit=dit, text_encoder=te, device="cuda")
    sources = cal.prepare_model(engine, "dit")
    build_s = time.perf_counter() - start

    def request(i: int) -> GenerationRequest:
        return GenerationRequest(mode="t2va", prompt=f"{contract['prompt']} (take {i})", width=contract["width"],
                                 height=contract["height"], frames=contract["frames"], steps=args.steps, seed=i)

    calib = [request(i) for i in range(args.calibration_requests)]
    held = [request(1000 + i) for i in range(args.held_out)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    scales, figures = cal.calibrate(engine, "dit", calib, 1.0, print)
    calibrate_s = time.perf_counter() - t0
    header = {"format": artifact.FORMAT, "version": artifact.VERSION,
              "model": artifact.recipe_hash("synthetic:full:dit:seed=0:init=fan_in"), "partition": "t2va",
              "commit": git_commit(), "kernel_settings": KernelSettings.from_env().to_dict(), "device": "cuda",
              "dtype": "bfloat16", "linear_sources": sources, "excluded": [], "gate": None, **figures}
    path = out_dir / "nvfp4_static_scales.safetensors"
    artifact.write(path, header, scales)
    art = artifact.read(path)
    t0 = time.perf_counter()
    excluded, record = cal.gate(engine, "dit", art, held, 1.0, False, print)
    gate_s = time.perf_counter() - t0
    artifact.write(path, {**art.header, "gate": record, "excluded": sorted(excluded)}, art.scales)
    return {"contract": contract["name"], "steps": args.steps, "evaluations_per_request": args.steps - 1,
            "calibration_requests": len(calib), "held_out_requests": len(held), "build_s": build_s,
            "calibrate_s": calibrate_s, "gate_s": gate_s, "layers": len(nvfp4_static.nvfp4_linears(dit)),
            "gate": {k: v for k, v in record.items() if k != "ratios"}, "artifact": str(path),
            "note": "emulation: both operands dequantized and multiplied in fp32 per GEMM; the gate runs every "
                    "evaluation twice (static, then dynamic on the same inputs); the amax observer reads one "
                    "number back per linear call"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3, help="sigma points per request (steps - 1 evaluations)")
    p.add_argument("--calibration-requests", type=int, default=2)
    p.add_argument("--held-out", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-calibration", action="store_true", help="only the amax pass's cost")
    args = p.parse_args(argv)
    import_package()
    import torch

    from h3_spark.measure.stamp import software

    out = Path(args.out)
    result = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "software": software(), "blackwell": "not measured: no Blackwell GPU (native FP4 GEMMs) was available"}
    result["amax_pass"] = amax_pass_cost(json.loads(CONTRACT.read_text())["sequence_length"], args.repeats)
    out.write_text(json.dumps(result, indent=2))
    if not args.skip_calibration:
        result["calibration"] = calibration_and_gate(args, out.parent)
        out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
