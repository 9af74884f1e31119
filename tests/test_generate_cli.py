"""`h3-spark generate` end to end on the built-in tiny synthetic models (real loaders, real pipeline)."""

import json
import math

import numpy as np
import pytest
import torch

from h3_spark.cli import main
from h3_spark.h3_model.media import files as media

pytest.importorskip("av")


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    # The fused Triton kernels would run in Triton's (slow) CPU interpreter; they have their own tests.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")


def _run(capsys, *argv):
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured


def test_default_is_the_demo_and_quiet_prints_nothing(demo_models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--steps", "2", "--width", "64", "--height", "64",
                     "--quiet")
    assert code == 0 and cap.out == "" and cap.err == ""
    assert (tmp_path / "h3-spark-demo.mp4").is_file()


def test_demo_t2va_writes_an_mp4(demo_models, tmp_path, capsys):
    out = tmp_path / "t2va.mp4"
    code, cap = _run(capsys, "--demo", "--demo-dir", str(demo_models), "--steps", "3", "--width", "64",
                     "--height", "64", "--out", str(out), "--save-latents", str(tmp_path / "lat.safetensors"),
                     "--progress")
    assert "step 2/2" in cap.err
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["mode"] == "t2va" and summary["frames"] == 124 and summary["evaluations"] == 2
    assert summary["audio_samples"] == 165600 and summary["exact"] is True
    assert summary["vae_attention"] == "sdpa"
    info = media.probe(out)
    assert info["video_codec"] == "h264" and info["audio_codec"] == "aac"
    assert info["frames"] == 124 and info["audio_duration"] == pytest.approx(124 / 24, abs=1e-3)  # every chunk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lat.safetensors", "t2va.mp4"]  # no partial file left
    assert (tmp_path / "lat.safetensors").is_file()


def test_demo_ref2va_with_image_and_audio_files(demo_models, tmp_path, capsys):
    from PIL import Image

    img = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(img)
    wav = tmp_path / "ref.wav"
    t = np.arange(32000 * 2) / 32000
    _write_wav(wav, np.sin(2 * math.pi * 330 * t).astype(np.float32))
    out = tmp_path / "ref2va.mp4"
    code, cap = _run(capsys, "--demo", "--demo-dir", str(demo_models), "--steps", "3", "--width", "64",
                     "--height", "64", "--ref", f"image:{img}", "--ref", f"audio:{wav}", "--prompt",
                     "<Picture 1> sings <Audio 1>", "--out", str(out), "--cache-mode", "easycache")
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["mode"] == "ref2va" and "step_cache" in summary["approximate_paths"]
    assert summary["exact"] is False  # a reused step is an approximation, whatever the kernels are
    assert out.is_file()


def test_demo_fl2va_with_an_empty_prompt(demo_models, tmp_path, capsys):
    from PIL import Image

    key = tmp_path / "key.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(key)
    lengths = []
    for prompt in ("", "x"):  # "x" is one token: the empty prompt really reached the presentation empty
        out = tmp_path / f"fl2va{len(prompt)}.mp4"
        code, cap = _run(capsys, "--demo", "--demo-dir", str(demo_models), "--steps", "2", "--width", "64",
                         "--height", "64", "--first-frame", str(key), "--prompt", prompt, "--out", str(out))
        assert code == 0, cap.err
        summary = json.loads(cap.out.strip().splitlines()[-1])
        assert summary["mode"] == "fl2va" and out.is_file()
        lengths.append(summary["sequence_length"])
    assert lengths[1] == lengths[0] + 1


def _write_wav(path, mono):
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=32000, layout="mono")
        frame = av.AudioFrame.from_ndarray((mono[None] * 32767).astype(np.int16), format="s16", layout="mono")
        frame.sample_rate = 32000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


@pytest.mark.parametrize("argv,message", [
    (["--ref", "picture:x.png", "--prompt", "p", "--out", "o.mp4"], "--ref must be KIND:PATH"),
    (["--prompt", "p", "--out", "o.avi"], "--out must end in .mp4"),
    (["--out", "o.mp4"], "--prompt is required (--prompt '' gives none, for fl2va and ref2va)"),
    (["--prompt", "", "--out", "o.mp4"], "t2va needs a prompt: it is all the text encoder reads"),
    (["--prompt", "p"], "--out is required"),
    (["--prompt", "p", "--out", "o.mp4", "--gpus", "0"], "--gpus must be at least 1"),
    (["--prompt", "p", "--out", "o.mp4", "--frames", "50"], "H3 generates 124..345 frames"),
    (["--prompt", "p", "--out", "o.mp4", "--models", "/nonexistent"], "no such model folder"),
    (["--prompt", "p", "--out", "o.mp4", "--ref", "image:/nonexistent.png"], "nonexistent.png"),
    (["--prompt", "p", "--out", "o.mp4"], "needs the transformer/ DiT"),
    (["--prompt", "p", "--out", "o.mp4", "--sigmas", "1,0.5,x"], "--sigmas must be comma-separated numbers"),
    (["--prompt", "p", "--out", "o.mp4", "--sigmas", "1,0.5,0.7,0"], "strictly decreasing"),
    # Checked before any model loads: the empty model folder would fail otherwise.
    (["--prompt", "p", "--out", "o.mp4", "--save-latents", "missing/l.safetensors"],
     "--save-latents missing/l.safetensors: no such folder missing"),
    (["--prompt", "p", "--out", "o.mp4", "--save-latents", "./o.mp4"],
     "--save-latents and --out both name o.mp4: the mp4 would replace the latents"),
    (["--prompt", "p", "--out", "o.mp4", "--save-latents", "."], "--save-latents . is a folder; give a file path"),
    (["--prompt", "p", "--out", "o.mp4", "--demo"],
     "--demo makes its own tiny models and would ignore --models: drop one or the other"),
    (["--prompt", "p", "--out", "o.mp4", "--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--prompt", "p", "--out", "o.mp4", "--attention", "bogus"],
     "--attention 'bogus' is not accepted; use one of: auto, sdpa"),
    (["--prompt", "p", "--out", "o.mp4", "--linear", "int4"],
     "--linear 'int4' is not accepted; use one of: auto, bf16, fp8, nvfp4"),
])
def test_generate_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "--models" not in argv:
        argv = [*argv, "--models", str(tmp_path)]  # an empty model folder: the real path, not the demo
    code, cap = _run(capsys, *argv)
    assert code == 2
    assert message in cap.err and "Traceback" not in cap.err


def test_turbo_sigmas(demo_models, tmp_path, capsys):
    out = tmp_path / "turbo.mp4"
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64", "--sigmas",
                     "1,0.75,0.5,0.25,0", "--out", str(out))
    assert code == 0, cap.err
    assert json.loads(cap.out.strip().splitlines()[-1])["evaluations"] == 4


@pytest.mark.parametrize("argv,steps", [([], 9), (["--steps", "50"], 50), (["--steps", "12"], 12)])
def test_demo_keeps_an_explicit_step_count(demo_models, tmp_path, capsys, monkeypatch, argv, steps):
    from h3_spark.errors import InputError
    from h3_spark.h3_model.pipeline.generation import Pipeline

    seen = []

    def stop(self, req, **kwargs):  # the request is all this test needs: no sampling
        seen.append(req.steps)
        raise InputError("stopped before sampling")

    monkeypatch.setattr(Pipeline, "generate", stop)
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64",
                     "--out", str(tmp_path / "o.mp4"), *argv)
    assert code == 2 and "stopped before sampling" in cap.err
    assert seen == [steps]


def test_generate_help_states_the_cpu_vae_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: $H3_VAE_DTYPE, else float16 on CUDA and float32 on the CPU)" in text
    assert "default 50, 9 with --demo" in text


def test_a_vram_budget_gives_the_same_latents(demo_models, tmp_path, capsys):
    """--vram-budget on the CPU (emulated): the text encoder's layers stream, the VAEs wait between their stages,
    the DiT plans within what is left; the latents equal the unbudgeted run's bit for bit."""
    from safetensors.torch import load_file

    latents = {}
    for name, extra in (("resident", []), ("budget", ["--vram-budget", "3GB", "--prefetch-depth", "1"])):
        code, cap = _run(capsys, "--demo", "--demo-dir", str(demo_models), "--steps", "3", "--width", "64",
                         "--height", "64", "--out", str(tmp_path / f"{name}.mp4"),
                         "--save-latents", str(tmp_path / f"{name}.safetensors"), *extra)
        assert code == 0, cap.err
        summary = json.loads(cap.out.strip().splitlines()[-1])
        latents[name] = load_file(str(tmp_path / f"{name}.safetensors"))
    plan = summary["vram_budget"]
    assert plan["budget_bytes"] < 3 * 10 ** 9 and plan["prefetch_depth"] == 1
    assert set(plan["reserved_for_other_stages"]) == {"text_encode", "vae"}
    assert all(torch.equal(latents["budget"][k], latents["resident"][k]) for k in ("video_latents", "audio_latents"))


def test_recipes_are_applied_and_stamped_in_the_summary(demo_models, tmp_path, capsys):
    out = tmp_path / "recipe.mp4"
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64", "--out", str(out),
                     "--recipe", "turbo:evaluations=3", "--recipe", "first-block-cache:threshold=0")
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["evaluations"] == 3 and summary["exact"] is False
    assert summary["recipes"] == [{"name": "turbo", "evaluations": 3, "video_shift": 6.0, "audio_shift": 3.0},
                                  {"name": "first-block-cache", "threshold": 0.0, "start": 0.0, "end": 1.0}]
    assert "recipe turbo" in summary["approximate_paths"] and "recipe first-block-cache" in summary["approximate_paths"]
    assert summary["step_cache"]["mode"] == "first_block" and summary["step_cache"]["computed"] == [0, 1, 2]


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "sparse"], "recipe sparse needs Sol-Attn: sol_attn"),
    (["--recipe", "turbo", "--steps", "12"], "recipe turbo sets the steps and the video shift: drop --steps"),
    (["--recipe", "first-block-cache", "--cache-mode", "h3_cache"], "drop --cache-mode"),
    (["--recipe", "nitro"], "unknown recipe 'nitro'"),
    (["--sampler", "dpmpp_2m"], "unknown sampler 'dpmpp_2m'; the samplers are euler, res_multistep"),
    (["--scheduler", "karras"], "unknown scheduler 'karras'; the schedulers are h3, simple, beta, normal"),
    (["--scheduler", "simple", "--sigmas", "1,0.5,0"],
     "scheduler simple makes a grid, and explicit sigmas are the grid: give one of the two"),
    (["--recipe", "fasth3-v2", "--sampler", "euler"],
     "recipe fasth3-v2 samples with res_multistep on simple, as its checkpoint was made to: drop --sampler"),
    (["--recipe", "omniref", "--scheduler", "beta"],
     "recipe omniref sets the sampling grid, the scheduler's: drop --scheduler"),
    (["--recipe", "omniref"], "recipe omniref runs a checkpoint distilled for ref2va, not t2va"),
])
def test_recipe_errors_come_before_loading(demo_models, tmp_path, capsys, monkeypatch, argv, message):
    from h3_spark.h3_model.engine.engine import Engine

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded before the recipe was checked"))
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64",
                     "--out", str(tmp_path / "o.mp4"), "--device", "cpu", *argv)
    assert code == 2 and message in cap.err and "Traceback" not in cap.err


def test_the_sampler_and_scheduler_flags_run_and_are_stamped(demo_models, tmp_path, capsys):
    """res_multistep on beta through the whole CLI: said in the summary; its first step is Euler's, its later ones
    are not, so the latents differ from euler's on the same grid."""
    from safetensors.torch import load_file

    latents = {}
    for sampler in ("euler", "res_multistep"):
        code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64", "--steps", "4",
                         "--sampler", sampler, "--scheduler", "beta", "--out", str(tmp_path / f"{sampler}.mp4"),
                         "--save-latents", str(tmp_path / f"{sampler}.safetensors"))
        assert code == 0, cap.err
        summary = json.loads(cap.out.strip().splitlines()[-1])
        assert (summary["sampler"], summary["scheduler"], summary["evaluations"]) == (sampler, "beta", 3)
        latents[sampler] = load_file(str(tmp_path / f"{sampler}.safetensors"))
    assert not torch.equal(latents["euler"]["video_latents"], latents["res_multistep"]["video_latents"])
    assert not torch.equal(latents["euler"]["audio_latents"], latents["res_multistep"]["audio_latents"])


def test_generate_help_lists_the_samplers_and_schedulers(capsys, monkeypatch):
    from h3_spark.h3_model.pipeline.scheduler import SCHEDULER_HELP
    from h3_spark.h3_model.pipeline.solvers import SAMPLER_HELP

    monkeypatch.setenv("COLUMNS", "4000")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, line in {**SAMPLER_HELP, **SCHEDULER_HELP}.items():
        assert f"{name}: {line}" in text, name


def test_preview_writes_a_strip_every_n_steps(demo_models, tmp_path, capsys):
    from PIL import Image

    previews = tmp_path / "previews"
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--width", "64", "--height", "64", "--steps", "6",
                     "--out", str(tmp_path / "p.mp4"), "--preview", str(previews), "--preview-every", "2")
    assert code == 0, cap.err
    assert sorted(p.name for p in previews.iterdir()) == ["step-002.png", "step-004.png", "step-005.png"]
    strip = Image.open(previews / "step-005.png")
    assert strip.mode == "RGB" and strip.size[0] > strip.size[1]  # frames side by side
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--out", str(tmp_path / "q.mp4"),
                     "--preview-every", "0")
    assert code == 2 and "--preview-every must be at least 1" in cap.err


def test_comfyui_demo_writes_the_folders_the_loaders_list(tmp_path, capsys):
    from h3_spark.h3_model.engine.demo import COMFY_FOLDERS

    models = tmp_path / "models"
    models.mkdir()
    (models / "vae").mkdir()
    (models / "vae" / "mine.safetensors").write_bytes(b"keep")
    assert main(["comfyui-demo", str(models)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["workflow"] == "workflows/H3 Demo, Text to Video (no download).json"
    for folder, name in COMFY_FOLDERS.values():
        assert any((models / folder / name).glob("*.safetensors")), name
    assert (models / "vae" / "mine.safetensors").read_bytes() == b"keep"  # the user's files stay
    assert main(["comfyui-demo", str(models), "--quiet"]) == 0  # again: replaced, not duplicated
    quiet = capsys.readouterr()
    assert (quiet.out, quiet.err) == ("", ""), quiet  # no line, and no library's progress bar either
    assert main(["comfyui-demo", str(tmp_path / "nope")]) == 2
    assert "no such folder (give ComfyUI's models folder" in capsys.readouterr().err


def test_the_summary_reports_host_memory_beside_the_gpus(demo_models, tmp_path, capsys, monkeypatch):
    """peak_host_memory_gb and host_memory next to peak_memory_gb: the process's resident set now and at its
    peak, and its cgroup v2's limit, peak and count (a fake tree here)."""
    from h3_spark.h3_model.engine import host_memory

    (tmp_path / "cgroup" / "job").mkdir(parents=True)
    for name, count in (("max", "max"), ("peak", "4567000000"), ("current", "2345000000")):
        (tmp_path / "cgroup" / "job" / f"memory.{name}").write_text(count + "\n")
    (tmp_path / "proc_cgroup").write_text("0::/job\n")
    monkeypatch.setattr(host_memory, "PROC_CGROUP", tmp_path / "proc_cgroup")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path / "cgroup")
    code, cap = _run(capsys, "--demo-dir", str(demo_models), "--steps", "2", "--width", "64", "--height", "64",
                     "--out", str(tmp_path / "h.mp4"))
    assert code == 0, cap.err
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["peak_memory_gb"] > 0  # on the CPU: the peak resident set, as before
    memory = summary["host_memory"]
    assert summary["peak_host_memory_gb"] == memory["peak_rss_gb"] >= memory["rss_gb"] > 0
    assert memory["cgroup"] == {"path": "/job", "limit_gb": None, "peak_gb": 4.567, "current_gb": 2.345}
