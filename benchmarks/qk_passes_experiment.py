"""Experiment behind docs/perf-notes.md (eighth session), kept so its receipt can be re-run (GPU only):

  python benchmarks/qk_passes_experiment.py OUT.json        (ONLY=passes|v_pass|forward, CANDIDATE=rotation|v_groups)

Question: the FP8 Q/K passes of the fast path (RMSNorm + RoPE + K smoothing + 128-wide Hadamard + e4m3
codes) take 0.7-1.0 ms where the unrotated pass takes ~0.25 ms; ncu found them latency-bound at low
occupancy, the rotation's dots and their operand layouts holding registers and shared memory (fifth
session). Does the rotation as fp32 butterflies (`qk_prep._butterflies`: log2(128) = 7 add/subtract
stages, no dot) do better, and with how many heads per program?

1. `passes`: the Q pass (bound scales) and the K pass (mean, then the write) at S = 19,540, 56 heads of 128,
   bf16, a strided view of a fused qkv as the model hands it over. Production (Kronecker dots, 32 tokens x
   4 warps), the dots at smaller tiles and butterfly launch shapes, timed round-robin over three rounds (the card's clock settles during the first:
   every variant runs once before any is timed), medians of the rounds' medians. Codes are compared with
   the reference (`reference_prepare_heads`, the same bf16 roundings before the rotation).
2. `v_pass`: fa3_fp8's V quantization (per-head absmax, then the codes: two passes, no norm or rotation) as
   production launches it (64 tokens x 8 warps, one head per program) and with the exact pass's head groups
   (32 x 4, 8 heads per program: `qk_prep.GROUP_UNROTATED`).
3. `forward`: whole fast t2va forwards (synthetic full-size weights, FP8 linears + fa3_fp8) alternating
   production and a candidate (CANDIDATE=rotation: the best other shape of item 1; v_groups: item 2's
   groups), three times each, in one process, then a kernel profile of one forward of each.
"""
import json
import os
import statistics
import sys
import time

import torch

import kernels_gpu  # beside this file: run as `python benchmarks/qk_passes_experiment.py`
from h3_spark.h3_model.dit import rope_tables
from h3_spark.kernels import qk_prep as Q

S = int(os.environ.get("SEQ", "19540"))
H, HD = 56, 128
ITERS = 20
# (rotation, tokens per program, warps, heads per program); ("dot", 32, 4, 1) is production. Register
# counts from ptxas (sm_90a, K write pass): production 255 with spills, butterflies 56 (4 x 4) to 207 (32 x 8).
PRODUCTION = ("dot", 32, 4, 1)
SHAPES = [PRODUCTION, ("dot", 16, 4, 1), ("dot", 8, 4, 1),
          ("butterfly", 4, 4, 1), ("butterfly", 8, 4, 1), ("butterfly", 8, 8, 1), ("butterfly", 16, 4, 1),
          ("butterfly", 16, 8, 1), ("butterfly", 32, 8, 1), ("butterfly", 8, 4, 2), ("butterfly", 8, 4, 4)]


def use(shape):
    """Switch the rotating passes to a launch shape (rotation, tokens, warps, heads)."""
    rotation, tokens, warps, heads = shape
    Q.BUTTERFLY = rotation == "butterfly"
    if Q.BUTTERFLY:
        Q.BUTTERFLY_TILE_TOKENS, Q.BUTTERFLY_WARPS, Q.BUTTERFLY_HEADS = tokens, warps, heads
    else:
        Q.KRONECKER_TILE_TOKENS, Q.HADAMARD_WARPS = tokens, warps


def name_of(shape) -> str:
    return "{}_s{}_w{}_h{}".format(*shape)


def inputs():
    g = torch.Generator("cuda").manual_seed(5)
    qkv = torch.randn(1, S, 3 * H * HD, generator=g, device="cuda").bfloat16()
    q = qkv[..., :H * HD].view(1, S, H, HD)
    k = (qkv[..., H * HD:2 * H * HD] + 0.5).view(1, S, H, HD)  # a common key offset for the smoothing to take
    w = (1 + 0.2 * torch.randn(HD, generator=g, device="cuda")).bfloat16()
    pos = torch.stack(torch.meshgrid(torch.arange(31), torch.arange(30), torch.arange(34), indexing="ij"), -1)
    cos, sin = (t.bfloat16().contiguous() for t in rope_tables(pos.reshape(-1, 3)[:S].cuda(), 16, 10000.0))
    return q, k, w, (cos, sin)


def agreement(got, want) -> dict:
    same = (got.data.view(torch.uint8) == want.data.view(torch.uint8)).float().mean().item()
    a, b = got.dequantize().double(), want.dequantize().double()
    return {"codes_equal": same, "rel_l2_vs_reference": ((a - b).norm() / b.norm()).item(),
            "scales_equal": bool(torch.allclose(got.scale, want.scale, rtol=1e-6, atol=0))}


def passes(out: dict) -> None:
    q, k, w, rope = inputs()
    opts = dict(hadamard=128, fmt="fp8", granularity="per_head_bound")
    calls = {"q": lambda: Q.prepare_heads(q, w, 1e-6, rope, **opts),
             "k": lambda: Q.prepare_heads(k, w, 1e-6, rope, smooth=True, **opts)}
    ref = {"q": Q.reference_prepare_heads(q, w, 1e-6, rope, **opts),
           "k": Q.reference_prepare_heads(k, w, 1e-6, rope, smooth=True, **opts)}
    res = out["passes"] = {"floor_ms": {"q": (2 + 1) * q.numel() / 4.3e12 * 1e3,
                                        "k": (2 + 2 + 1) * k.numel() / 4.3e12 * 1e3}}
    live = []
    for shape in SHAPES:
        use(shape)
        entry = res[name_of(shape)] = {"ms": {"q": [], "k": []}}
        try:
            for t in ("q", "k"):
                entry[t] = agreement(calls[t](), ref[t])
            torch.cuda.synchronize()
            live.append(shape)
        except Exception as exc:  # noqa: BLE001 - an experiment records what did not compile or run
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(name_of(shape), entry, flush=True)
    for _ in range(3):
        for shape in live:
            use(shape)
            for t in ("q", "k"):
                res[name_of(shape)]["ms"][t].append(kernels_gpu.bench(calls[t], ITERS, 3))
    for shape in live:
        entry = res[name_of(shape)]
        entry["median_ms"] = {t: statistics.median(v) for t, v in entry["ms"].items()}
        entry["q_plus_k_ms"] = entry["median_ms"]["q"] + entry["median_ms"]["k"]
        print(name_of(shape), entry["median_ms"], flush=True)
    best = min((s for s in live if s != PRODUCTION), key=lambda s: res[name_of(s)]["q_plus_k_ms"], default=None)
    res["best"] = None if best is None else list(best)
    use(PRODUCTION)


def v_pass(out: dict) -> None:
    g = torch.Generator("cuda").manual_seed(6)
    qkv = torch.randn(1, S, 3 * H * HD, generator=g, device="cuda").bfloat16()
    v = qkv[..., 2 * H * HD:].view(1, S, H, HD)
    opts = dict(norm=False, fmt="fp8", granularity="per_head")
    want = Q.reference_prepare_heads(v, None, 0.0, None, **opts)
    res = out["v_pass"] = {"floor_ms": (2 + 2 + 1) * v.numel() / 4.3e12 * 1e3, "production": {"ms": []},
                           "groups": {"ms": []}}
    for arm in ("production", "groups"):
        Q.GROUP_UNROTATED = arm == "groups"
        res[arm].update(agreement(Q.prepare_heads(v, None, 0.0, None, **opts), want))
    for _ in range(3):
        for arm in ("production", "groups"):
            Q.GROUP_UNROTATED = arm == "groups"
            res[arm]["ms"].append(kernels_gpu.bench(lambda: Q.prepare_heads(v, None, 0.0, None, **opts), ITERS, 3))
    Q.GROUP_UNROTATED = False
    for arm in ("production", "groups"):
        res[arm]["median_ms"] = statistics.median(res[arm]["ms"])
        print(arm, res[arm], flush=True)


def candidate(out: dict):
    """(name, switch on, switch off) for the forward A/B, or None."""
    which = os.environ.get("CANDIDATE", "rotation")
    if which == "v_groups":
        return which, lambda: setattr(Q, "GROUP_UNROTATED", True), lambda: setattr(Q, "GROUP_UNROTATED", False)
    best = out.get("passes", {}).get("best")
    if not best:
        return None
    return f"rotation {best}", lambda: use(tuple(best)), lambda: use(PRODUCTION)


def forward(out: dict) -> None:
    cand = candidate(out)
    if cand is None:
        out["forward"] = {"skipped": "no candidate (run the passes item first)"}
        return
    name, switch_on, switch_off = cand
    os.environ.update(H3_LINEAR="fp8", H3_ATTENTION="fa3_fp8")
    from h3_spark.bench.contract import contract_shape, load_contract
    from h3_spark.bench.profile import profile_call
    from h3_spark.bench.runner import make_inputs, rel_l2, time_call
    from h3_spark.bench.synthetic import synthetic_dit
    from h3_spark.h3_model.config import preset
    from h3_spark.h3_model.sampler import schedule_timestep_values
    from h3_spark.h3_model.scheduler import JointSchedule
    from h3_spark.kernels.dispatch import apply_kernels
    from h3_spark.kernels.settings import KernelSettings

    t0 = time.perf_counter()
    contract = load_contract(os.path.join(os.path.dirname(__file__), "t2va-960x544-124f.json"))
    model = synthetic_dit(preset("full"), torch.bfloat16, "cuda", seed=contract["seed"], init="fan_in")
    backends = apply_kernels(model, KernelSettings.from_env())
    shape = contract_shape(contract, model.config)
    schedule = JointSchedule.create(contract["steps"])
    inp = make_inputs(shape, model.config, "cuda", contract["seed"], len(schedule) // 2, schedule)
    lay = shape.layout
    res = out["forward"] = {"build_s": time.perf_counter() - t0, "candidate": name,
                            "linear": backends.get("linear", {}).get("format"),
                            "attention": backends.get("attention", {}).get("chosen")}
    with torch.inference_mode():
        model.precompute_modulation(schedule_timestep_values(lay, schedule))
        text = model.encode_text(inp["encoder_hidden_states"])
        kw = {**inp, "encoder_hidden_states": None, "text_embeds": text,
              "output_video_rows": torch.arange(lay.num_condition_video_rows, lay.video_indices.numel(), device="cuda"),
              "output_audio_rows": torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel(), device="cuda")}
        outputs = {}
        for arm in ("old", "new") * 3:
            (switch_on if arm == "new" else switch_off)()
            times = time_call(lambda: model(**kw), "cuda", 1, 3)
            res.setdefault(arm, []).append(statistics.median(times))
            if arm not in outputs:
                outputs[arm] = [o.float() for o in model(**kw)]
            print(arm, times, flush=True)
        res["velocity_rel_l2_new_vs_old"] = [rel_l2(a, b) for a, b in zip(outputs["new"], outputs["old"])]
        for arm in ("old", "new"):
            (switch_on if arm == "new" else switch_off)()
            res["profile_" + arm] = profile_call(lambda: model(**kw), "cuda")
    switch_off()


def main(path: str) -> None:
    out = {"S": S, "heads": H, "head_dim": HD, "device": torch.cuda.get_device_name(),
           "commit": os.environ.get("H3_GIT_COMMIT")}
    only = os.environ.get("ONLY")
    for fn in (passes, v_pass, forward):
        if only and fn.__name__ not in only.split(","):
            continue
        try:
            fn(out)
        except Exception as exc:  # noqa: BLE001
            out[fn.__name__ + "_error"] = f"{type(exc).__name__}: {exc}"[:500]
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
