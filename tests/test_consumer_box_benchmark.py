"""benchmarks/consumer_box_gpu.py: a CPU smoke run on the demo's tiny models writes the measured render's receipt
(a warm-up render of other steps first, the AdaLN tables of the measured schedule still computable after it), and
its refusals name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3_spark.errors import InputError

from benchmark_scripts import load_benchmark

bench = load_benchmark("consumer_box_gpu")


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    """The fused kernels' PyTorch references: Triton's CPU interpreter would spend seconds per pass."""
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def _generate(demo_models, out: Path, steps: int = 4) -> list[str]:
    return ["--models", str(demo_models), "--width", "128", "--height", "64", "--steps", str(steps), "--prompt",
            "a red fox", "--out", str(out), "--device", "cpu", "--text-encoder-layer", "2"]


def test_a_warm_render_after_a_shorter_one(demo_models, tmp_path):
    receipt = tmp_path / "resident.json"
    clip = tmp_path / "clip.mp4"
    assert bench.main(["--out", str(receipt), "--warmup-steps", "2", "--", *_generate(demo_models, clip)]) == 0
    result = json.loads(receipt.read_text())
    assert result["cold"] is False and result["warmup"]["steps"] == 2 and result["gpu_cap"] is None
    # The measured render is the 4-point schedule's (3 evaluations), not the warm-up's one.
    assert result["summary"]["evaluations"] == 3 and clip.stat().st_size > 0
    seconds = result["seconds"]
    assert 0 < seconds["stages_sum"] <= seconds["render"] < seconds["start_to_rendered"]
    assert 0 < seconds["start_to_imported"] < seconds["start_to_loaded"] < seconds["start_to_rendered"]
    assert "synthetic" in result["weights"] and "host_memory" in result["summary"]


def test_a_cold_render_is_the_processs_first(demo_models, tmp_path):
    receipt = tmp_path / "cold.json"
    assert bench.main(["--out", str(receipt), "--", *_generate(demo_models, tmp_path / "c.mp4", steps=3)]) == 0
    result = json.loads(receipt.read_text())
    assert result["cold"] is True and result["warmup"] is None and result["summary"]["evaluations"] == 2
    assert result["idle"] is None and result["seconds"]["idle"] is None


def test_idling_for_a_reader_that_is_not_there_says_why(demo_models, tmp_path):
    """The demo's models are resident (no budget): nothing streams, so nothing is read ahead, and the receipt says
    so instead of reporting a wait (the wait itself: tests/test_engine.py, the cramped host)."""
    receipt = tmp_path / "idle.json"
    assert bench.main(["--out", str(receipt), "--idle-until-read", "--",
                       *_generate(demo_models, tmp_path / "i.mp4", steps=3)]) == 0
    result = json.loads(receipt.read_text())
    assert result["idle"] == {"threads": 0, "waited_s": 0.0,
                              "why": "no page reader: the text layers do not stream"}
    assert result["seconds"]["idle"] == 0.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--out", "x.json", "--warmup-steps", "1", "--", "--prompt", "p"], "--warmup-steps must be 0 or at least 2"),
    (["--out", "x.json", "--gpu-cap", "0", "--", "--prompt", "p"], "--gpu-cap must be positive, got 0"),
    (["--out", "x.json"], "generate's flags go after `--`"),
])
def test_bad_flags_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_a_gpu_cap_needs_a_gpu(demo_models, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="--gpu-cap emulates a smaller GPU, and this machine has no CUDA GPU"):
        bench.main(["--out", str(tmp_path / "x.json"), "--gpu-cap", "24", "--",
                    *_generate(demo_models, tmp_path / "x.mp4")])


@pytest.mark.parametrize("case", ["film", "demo", "no models"])
def test_films_the_demo_and_no_model_files_are_refused(demo_models, tmp_path, case):
    argv = {"film": [*_generate(demo_models, tmp_path / "x.mp4"), "--seconds", "20"],
            "demo": ["--demo", "--out", str(tmp_path / "x.mp4")],
            "no models": ["--prompt", "a fox", "--out", str(tmp_path / "x.mp4")]}[case]
    with pytest.raises(InputError, match="one clip on one GPU from the model files given"):
        bench.main(["--out", str(tmp_path / "x.json"), "--", *argv])
    assert not (tmp_path / "x.json").exists()


def test_the_recipe_script_parses_and_calls_this_benchmark_with_its_flags():
    """benchmarks/consumer_box_gpu.sh (the GPU machine's recipe: files, resident, cold boxes) is valid bash, and the
    flags it hands this benchmark are ones its parser takes."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "consumer_box_gpu.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "--warmup-steps 2 --" in text and '--gpu-cap "$cap" "${idle[@]}" --' in text
    assert "idle=(--idle-until-read)" in text
    assert bench.parse(["--out", "x", "--idle-until-read", "--", "p"])[0].idle_until_read
    args, rest = bench.parse(["--out", "x.json", "--warmup-steps", "2", "--gpu-cap", "24", "--", "--prompt", "p"])
    assert (args.warmup_steps, args.gpu_cap, rest) == (2, 24.0, ["--prompt", "p"])
