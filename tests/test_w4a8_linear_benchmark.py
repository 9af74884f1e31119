"""benchmarks/w4a8_linear_gpu.py: its flags, its shapes (the released DiT's block linears), and one CPU smoke run at
tiny shapes whose JSON holds every path's median and the integer GEMM's error within the per-linear budget (1.5 %
rel L2 against the fp32 dequantize-then-matmul reference, as tests/test_linear_w4a8.py)."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("w4a8_linear_gpu")


def test_the_full_shapes_are_the_released_dits_linears():
    assert bench.shapes("full") == {"to_q": (7168, 5376), "to_k": (7168, 5376), "to_v": (7168, 5376),
                                    "to_out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
    args = bench.parse(["--out", "x.json"])
    assert (args.device, args.rows, args.shapes, args.repeats) == ("cuda", 37_966, "full", 10)


@pytest.mark.parametrize("argv, message", [
    (["--out", "x", "--rows", "0"], "--rows and --repeats must be at least 1 and --warmup at least 0; got 0, 10, 3"),
    (["--out", "x", "--device", "mps"], "--device must be cuda, cuda:N or cpu; got 'mps'"),
    (["--out", "x", "--shapes", "huge"], "argument --shapes: invalid choice: 'huge'"),
])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse(argv)
    assert message in capsys.readouterr().err


def test_a_cpu_smoke_run_writes_every_path(tmp_path):
    out = tmp_path / "w4a8.json"
    assert bench.main(["--device", "cpu", "--rows", "64", "--shapes", "small", "--repeats", "1", "--warmup", "0",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["linears"]) == {"to_q", "to_k", "to_v", "to_out", "fc1", "fc2"}
    for row in record["linears"].values():
        assert row["rows"] == 64 and all(row[f"{p}_ms_median"] > 0 for p in ("w4a8", "w4a8_int_mm", "stored_bf16",
                                                                              "dense_bf16"))
        assert 1e-4 < row["w4a8_rel_l2"] < 0.015 and row["stored_bf16_rel_l2"] < 0.01
