"""Experiment behind docs/perf-notes.md (eighth session), kept so its receipt can be re-run (GPU only):

  python benchmarks/experiments/fa3_layout_experiment.py OUT.json

Question: FlashAttention-3 bf16 runs at ~653 TFLOP/s inside the exact forward against 674-685 alone
(sixth session). In the model Q and K come contiguous out of the Q/K pass while V is a strided view of
the fused qkv GEMM's output (row stride 3 x 7168). Does that V layout cost FA3 time? Timed round-robin
(five rounds, medians), S = 19,540, 56 heads of 128, bf16 random data:
- `v_view`: V a view of a (S, 3 x 7168) tensor, as the model hands it over;
- `v_contiguous`: the same V copied to its own (S, 56, 128) tensor (the copy not timed);
- `all_views`: Q and K views too.
"""
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for kernels_gpu
import kernels_gpu  # noqa: E402
from h3_spark.kernels.attention import fa3_module

S = int(os.environ.get("SEQ", "19540"))
H, HD = 56, 128


def main(path: str) -> None:
    fn = fa3_module().flash_attn_func
    g = torch.Generator("cuda").manual_seed(7)
    qkv = torch.randn(1, S, 3, H, HD, generator=g, device="cuda").bfloat16()
    views = [qkv[:, :, i] for i in range(3)]
    q, k = (t.contiguous() for t in views[:2])
    arms = {"v_view": (q, k, views[2]), "v_contiguous": (q, k, views[2].contiguous()), "all_views": tuple(views)}
    flops = 4 * S * S * H * HD
    out = {"S": S, "heads": H, "head_dim": HD, "device": torch.cuda.get_device_name(),
           "commit": os.environ.get("H3_GIT_COMMIT"), "ms": {a: [] for a in arms}}
    ref = fn(*arms["v_contiguous"], causal=False)
    ref = ref[0] if isinstance(ref, tuple) else ref
    for a, args in arms.items():
        o = fn(*args, causal=False)
        o = o[0] if isinstance(o, tuple) else o
        out.setdefault("identical_to_v_contiguous", {})[a] = bool(torch.equal(o, ref))
    for _ in range(5):
        for a, args in arms.items():
            out["ms"][a].append(kernels_gpu.bench(lambda: fn(*args, causal=False), 10, 2))
    out["median_ms"] = {a: statistics.median(v) for a, v in out["ms"].items()}
    out["tflops"] = {a: flops / (ms * 1e-3) / 1e12 for a, ms in out["median_ms"].items()}
    print(json.dumps({k: out[k] for k in ("median_ms", "tflops", "identical_to_v_contiguous")}), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
