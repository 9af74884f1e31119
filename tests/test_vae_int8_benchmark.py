"""benchmarks/vae_int8_gpu.py: its flags, and one CPU smoke run at the tiny preset whose JSON holds every column, the
stored path's frames equal to the dequantized-at-load ones, and the int8 frames close to the fp16 file's (PSNR over
255 above 40 dB on this tiny model; measured 61); the opt-in integer-GEMM column within 35 dB of both."""

from __future__ import annotations

import json
import math

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("vae_int8_gpu")


def test_defaults_are_the_released_canvas(monkeypatch):
    monkeypatch.setenv("OUT", "/results")
    args = bench.parse([])
    assert args.out == "/results/vae_int8.json" and args.device == "cuda" and args.latent_size == (37, 48, 84)
    assert args.columns == ["fp16", "int8", "int8_at_load", "int8_gemm", "fp8", "int8_fp8"]
    assert (args.repeats, args.warmup) == (3, 1)
    assert bench.parse(["--tiny", "--out", "x"]).latent_size == (3, 4, 4)
    # FP8 GEMMs need a Hopper GPU: the CPU smoke leaves those columns out unless asked for (then refused).
    assert bench.parse(["--out", "x", "--device", "cpu"]).columns == ["fp16", "int8", "int8_at_load", "int8_gemm"]


@pytest.mark.parametrize("argv, message", [
    (["--out", "x", "--columns", "fp16,int4"],
     "--columns takes fp16, int8, int8_at_load, int8_gemm, fp8, int8_fp8; got 'fp16,int4'"),
    (["--out", "x", "--device", "cpu", "--columns", "fp16,fp8,int8_fp8"],
     "--columns fp8,int8_fp8 run FP8 GEMMs (H3_VAE_LINEAR=fp8), which need a Hopper or newer GPU; not --device cpu"),
    (["--out", "x", "--repeats", "0"], "--repeats must be at least 1 and --warmup at least 0; got 0, 1"),
    (["--out", "x", "--device", "mps"], "--device must be cuda, cuda:N or cpu; got 'mps'"),
    (["--out", "x", "--latent", "3,4"], "--latent takes three positive integers (frames,height,width); got '3,4'"),
])
def test_bad_flags_are_named(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit):
        bench.parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow  # 20 s on the shared 2-core machine, most of it torch's first meta-tensor dispatch
def test_a_cpu_smoke_run_writes_every_column(tmp_path):
    out = tmp_path / "vae_int8.json"
    assert bench.main(["--tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--workdir",
                       str(tmp_path / "files"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["card"] == "cpu" and result["frames_shape"] == [1, 9, 16, 16, 3]
    assert result["int8_file"] == "int8_convrot decoder linears (4), the rest floats as stored"
    runs = {r["column"]: r for r in result["runs"]}
    assert set(runs) == {"fp16", "int8", "int8_at_load", "int8_gemm"}
    assert runs["int8"]["stored_linears"] == 6 and runs["int8_at_load"]["stored_linears"] == 0
    assert runs["int8_at_load"]["frames_equal_int8"] is True
    assert runs["fp16"]["frames_vs_fp16"]["max_abs_uint8"] == 0
    close = runs["int8"]["frames_vs_fp16"]
    assert 40 < close["psnr_db"] < math.inf and 0 < close["max_abs_uint8"] <= 4 and close["rel_l2"] < 0.01
    assert all(r["decode_s_median"] > 0 for r in runs.values()) and result["summary"]["int8_over_fp16_time"] > 0
    # The opt-in integer GEMM: the activations' int8 rounding on top (measured 61 dB against the int8 column).
    assert 35 < runs["int8_gemm"]["frames_vs_int8"]["psnr_db"] < math.inf
    assert runs["int8_gemm"]["frames_vs_fp16"]["psnr_db"] > 35
    assert runs["int8"]["weights_gb"] < runs["fp16"]["weights_gb"]
    # The files are make-checkpoint's, kept in --workdir and reused by a second run.
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [
        "video_vae_tiny_seed0_fp16.safetensors", "video_vae_tiny_seed0_int8_convrot.safetensors"]
