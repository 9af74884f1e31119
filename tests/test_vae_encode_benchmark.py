"""benchmarks/vae_encode_gpu.py: its columns are checked, and a CPU smoke run on the tiny VAE writes each column's
time and its latents against the first column's (identical settings give identical latents; another tiling differs
a little, within the tiled-vs-untiled difference the VAE tests allow)."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("vae_encode_gpu")


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


def test_a_column_the_canvas_cannot_take_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    """An untiled fp32 encode of 1344x768 failed in a convolution's padding on the H100 ("input tensor must fit
    into 32-bit index math") and the whole receipt was lost; now that column names its error and the rest run."""
    from h3_spark.h3_model.vae.video import VideoVAE

    encode = VideoVAE.encode

    def too_large_untiled(self, x, tile_size=None, **kw):
        if tile_size is None:
            raise RuntimeError("input tensor must fit into 32-bit index math")
        return encode(self, x, tile_size=tile_size, **kw)

    monkeypatch.setattr(VideoVAE, "encode", too_large_untiled)
    out = tmp_path / "encode.json"
    assert bench.main(["--device", "cpu", "--tiny", "--frames", "22", "--width", "128", "--height", "80",
                       "--columns", "fp32:96,fp32:0,fp32:96", "--repeats", "1", "--out", str(out)]) == 0
    first, untiled, last = json.loads(out.read_text())["runs"]
    assert untiled == {"column": "fp32:0", "error": "RuntimeError: input tensor must fit into 32-bit index math"}
    assert last["rel_l2_vs_first"] == 0.0 and first["encode_s_median"] > 0
