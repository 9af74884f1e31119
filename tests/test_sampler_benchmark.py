"""benchmarks/sampler_gpu.py on the CPU at the tiny preset: it runs both samplers on the same grid end to end and
writes its JSON (card, per-step seconds, the samplers' own step, the two runs' distance) into the --out folder."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("sampler_gpu")


def test_the_benchmark_runs_at_tiny_size_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--evaluations", "3,8",
                       "--solver-repeats", "3"]) == 0
    result = json.loads((tmp_path / "sampler_gpu.json").read_text())
    assert result["card"] == "cpu" and result["benchmark"] == "sampler" and result["sequence_length"] > 0
    assert [r["evaluations"] for r in result["runs"]] == [3, 8]
    for run in result["runs"]:
        for name in ("euler", "res_multistep"):
            assert len(run[name]["step_s_all"]) == run["evaluations"] and run[name]["step_s_median"] > 0
        # Same seed and grid, another step rule after the first step: the results differ, but not wildly.
        assert 0 < run["res_multistep_vs_euler_video_rel_l2"] < 1 and 0 < run["res_multistep_vs_euler_audio_rel_l2"] < 1
    assert set(result["solver_step_s_median"]) == {"euler", "res_multistep"}


def test_out_is_required_without_OUT(monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--device", "cpu"])
    assert "--out is required when $OUT is not set" in capsys.readouterr().err
