"""benchmarks/mux_cpu.py on small frames: each preset's file decodes to every frame given, and the JSON says what
each preset cost (the tail after the last chunk, size against the first column, PSNR, keyframes)."""

from __future__ import annotations

import json

from benchmark_scripts import load_benchmark

bench = load_benchmark("mux_cpu")


def test_the_benchmark_runs_on_small_frames(tmp_path):
    out = tmp_path / "mux.json"
    assert bench.main(["--frames", "20", "--width", "96", "--height", "64", "--chunk", "7", "--interval", "0",
                       "--repeats", "2", "--columns", "medium,veryfast", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["frames"] == 20 and result["host"]["cpus"] >= 1 and set(result["results"]) == {"smooth", "grain"}
    for rows in result["results"].values():
        assert list(rows) == ["medium", "veryfast"] and rows["medium"]["bytes_vs_first"] == 1.0
        for row in rows.values():
            assert len(row["runs"]) == 2 and 0 <= row["tail_s"] <= row["encode_s"] and row["keyframes"] >= 1
            assert row["bytes"] > 0 and row["bytes_vs_first"] == round(row["bytes"] / rows["medium"]["bytes"], 4)
    # Heavy grain costs x264 far more bits, and keeps less of the picture, than the smooth frames.
    smooth, grain = result["results"]["smooth"]["medium"], result["results"]["grain"]["medium"]
    assert grain["bytes"] > 2 * smooth["bytes"] and grain["psnr_db"] < smooth["psnr_db"] - 5


def test_grain_frames_are_reproducible_and_differ_from_smooth_ones():
    a, b = bench.make_frames("grain", 3, 16, 24), bench.make_frames("grain", 3, 16, 24)
    assert a.dtype.name == "uint8" and a.shape == (3, 16, 24, 3) and (a == b).all()
    assert (bench.make_frames("smooth", 3, 16, 24) != a).any()
