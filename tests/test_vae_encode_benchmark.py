"""benchmarks/vae_encode_gpu.py: its columns are checked, and a CPU smoke run on the tiny VAE writes each column's
time and its latents against the first column's (identical settings give identical latents; another tiling differs
a little, within the tiled-vs-untiled difference the VAE tests allow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("vae_encode_gpu",
                                               Path(__file__).resolve().parents[1] / "benchmarks" / "vae_encode_gpu.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("column", ["fp64:256", "bf16", "bf16:wide"])
def test_bad_columns_are_named(column):
    with pytest.raises(SystemExit, match=rf"^a column is fp32\|autocast\|bf16:TILE, got '{column}'$"):
        bench.parse_column(column)


def test_a_cpu_smoke_run_writes_every_column(tmp_path):
    out = tmp_path / "encode.json"
    assert bench.main(["--device", "cpu", "--tiny", "--frames", "22", "--width", "128", "--height", "80",
                       "--columns", "fp32:96,fp32:96,fp32:0", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    first, same, untiled = result["runs"]
    assert [r["column"] for r in result["runs"]] == ["fp32:96", "fp32:96", "fp32:0"]
    # 22 frames -> 7 latent frames; the tiny VAE is 4x spatial.
    assert first["latent_shape"] == [1, 4, 7, 20, 32] and all(r["encode_s_median"] > 0 for r in result["runs"])
    assert same["rel_l2_vs_first"] == 0.0
    assert 0 < untiled["rel_l2_vs_first"] < 0.5
    assert result["config"] == "tiny" and "synthetic" in result["weights"]
