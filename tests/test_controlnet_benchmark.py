"""benchmarks/controlnet_gpu.py: one CPU smoke run at tiny size writes the side-by-side result (plain and controlled
forwards, the tower active in every timed controlled forward)."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("controlnet_gpu")


@pytest.mark.slow
def test_a_cpu_smoke_run_writes_both_forwards(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    out = tmp_path / "cn.json"
    assert bench.main(["--out", str(out), "--preset", "tiny", "--device", "cpu", "--width", "64", "--height", "64",
                       "--budgets", "resident", "--repeats", "1", "--warmup", "0", "--workdir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["card"] == "cpu" and result["controlnet"]["blocks"] == 2 and result["canvas"] == [64, 64, 124]
    run, = result["runs"]
    assert run["plain_forward_s_median"] > 0 and run["controlled_forward_s_median"] > 0
    assert run["tower_evaluations_timed"] == 1 and run["tower_bytes"] > 0
