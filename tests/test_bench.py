"""The bench runner end to end on the CPU (tiny synthetic model, tiny contract), and contract checks."""

import json
import os
from pathlib import Path

import pytest

from h3_spark.measure.contract import check_limits, contract_shape, load_contract
from h3_spark.cli import main
from h3_spark.h3_model.dit.config import FULL
from h3_spark.errors import InputError
from h3_spark.h3_model.media.files import x264_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["t2va-960x544-124f", "ref2va-960x544-124f", "t2va-640x352-124f", "t2va-1344x768-124f",
                                  "t2va-1344x768-345f", "ref2va-1344x768-124f"])
def test_contract_sequence_length_is_what_the_layout_builds(name):
    contract = load_contract(ROOT / "benchmarks" / f"{name}.json")
    shape = contract_shape(contract, FULL)
    assert shape.layout.sequence_length == contract["sequence_length"]
    assert contract["limits"]["sequence_length"]["equals"] == contract["sequence_length"]


def test_t2va_contract_matches_the_spec_count():
    # Spec §2.3 (a): S = 19,540 = 256 text + 414 audio + 18,870 video.
    shape = contract_shape(load_contract(ROOT / "benchmarks" / "t2va-960x544-124f.json"), FULL)
    assert (shape.layout.num_text, shape.layout.audio_indices.numel(), shape.layout.video_indices.numel()) == \
        (256, 414, 18870)


def test_bench_cpu_vs_diffusers(tmp_path, capsys, monkeypatch):
    # The fused Triton kernels would run in Triton's (slow) CPU interpreter; they have their own tests.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), "--synthetic",
                 "--preset", "tiny", "--dtype", "float32", "--device", "cpu", "--vs", "diffusers",
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["sequence_length"] == 178
    assert result["velocity_rel_l2_vs_diffusers"] <= 1e-5  # same fp32 numerics as the oracle
    assert len(result["diffusers"]["blockwise_rel_l2"]) == 2 and max(result["diffusers"]["blockwise_rel_l2"]) <= 1e-5
    assert result["dit_forward_s_median"] > 0 and len(result["dit_forward_s_all"]) == 2
    assert "synthetic" in result["weights"]
    assert result["stamp"]["software"]["torch"]
    assert all(v["ok"] for v in result["limits"].values())
    assert set(result["load_s"]) == {"dit_ref"}  # the DiT alone, built by the engine (its override)
    assert_host_memory(result)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out"] == str(out) and summary["peak_host_memory_gb"] == result["peak_host_memory_gb"]


def assert_host_memory(result: dict) -> None:
    """Every receipt carries host memory beside its GPU peak: at the end, right after loading, the cgroup's."""
    for key in ("host_memory", "host_memory_after_load"):
        assert set(result[key]) == {"rss_gb", "peak_rss_gb", "cgroup"}
    assert result["peak_host_memory_gb"] == result["host_memory"]["peak_rss_gb"] > 0
    assert 0 < result["host_memory_after_load"]["peak_rss_gb"] <= result["peak_host_memory_gb"]
    assert result["load_s"] and all(s >= 0 for s in result["load_s"].values())


def test_limits_verdicts():
    contract = load_contract(ROOT / "benchmarks" / "t2va-960x544-124f.json")
    verdicts = check_limits(contract, {"sequence_length": 19540, "peak_gpu_memory_gb": 99.0,
                                       "velocity_rel_l2_vs_diffusers": 0.05, "noise_floor_rel_l2": 0.04})
    assert verdicts["sequence_length"]["ok"] is True
    assert verdicts["peak_gpu_memory_gb"]["ok"] is False
    assert verdicts["velocity_rel_l2_vs_diffusers"]["ok"] is True
    assert verdicts["speedup_vs_diffusers"]["ok"] is None


def test_bad_contracts(tmp_path):
    with pytest.raises(InputError, match="no such contract file"):
        load_contract(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_contract(bad)
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(InputError, match="contract lacks mode"):
        load_contract(bad)


def test_bench_cli_errors(tmp_path, capsys):
    code = main(["bench", "--contract", str(tmp_path / "nope.json"), "--synthetic", "--out", str(tmp_path / "o.json"),
                 "--device", "cpu"])
    assert code == 2
    assert "no such contract file" in capsys.readouterr().err


def test_bench_with_a_model_folder_measures_every_stage(tmp_path, capsys, monkeypatch):
    from h3_spark.h3_model.engine.demo import TEXT_READ_LAYER, build_demo_models
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    models = build_demo_models(tmp_path / "demo")
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-t2va.json"), "--models", str(models),
                 "--text-encoder-layer", str(TEXT_READ_LAYER), "--dtype", "float32", "--device", "cpu",
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["limits"]["sequence_length"]["ok"] is True
    stages = result["generation"]["stage_s"]
    assert set(stages) == {"text_encode", "reference_encode", "sampling", "video_decode", "audio_decode", "mux"}
    assert all(v >= 0 for v in stages.values()) and stages["sampling"] > 0
    assert result["generation"]["frames"] == 124 and result["generation"]["evaluations"] == 2
    assert set(result["load_s"]) == {"dit", "text_encoder", "vae", "audio_vae"}
    assert_host_memory(result)
    # The generation keeps the receipts' older key beside its own reading.
    assert 0 < result["generation"]["peak_host_rss_gb"] and "cgroup" in result["generation"]["host_memory"]


def test_synthetic_generation_with_step_caches(tmp_path, capsys, monkeypatch):
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    contract = json.loads((ROOT / "tests" / "data" / "tiny-ref2va.json").read_text())
    contract.update(name="tiny-ref2va-124f", frames=124, steps=12, width=64, height=64)
    contract["limits"] = {"peak_gpu_memory_gb": {"max": 1.0}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(contract))
    contract["sequence_length"] = contract_shape(load_contract(path), FULL).layout.sequence_length
    path.write_text(json.dumps(contract))
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(path), "--synthetic", "--preset", "tiny", "--generation",
                 "--cache-modes", "easycache,h3_cache", "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    gen = json.loads(out.read_text())["generation"]
    assert set(gen["component_build_s"]) == {"dit_ref", "text_encoder", "vae", "audio_vae"}
    assert gen["frames"] == 124 and gen["evaluations"] == 11 and gen["latents_finite"]
    assert gen["prompt_cache_hit"] is False and gen["reference_cache_hits"] == 0  # measured as a new request
    assert set(gen["stage_s"]) == {"text_encode", "reference_encode", "sampling", "video_decode", "audio_decode", "mux"}
    # What the mux ran with, for the receipt: the preset as H3_X264_PRESET leaves it (veryfast unset).
    assert gen["mp4"] == {"codec": "libx264", "preset": x264_preset(), "crf": 18, "host_cpus": os.cpu_count()}
    for mode in ("easycache", "h3_cache"):
        c = gen["step_caches"][mode]
        assert c["computed_steps"] + c["reused_steps"] == 11
        # A reused step leaves a trace in the latents; none reused means the very same latents.
        assert (c["video_latents_rel_l2_vs_uncached"] > 0) == (c["reused_steps"] > 0)
        assert c["video_latents_rel_l2_vs_uncached"] < 1.0
        # the whole render again, from cold prompt/reference caches: every stage timed, mux included
        assert set(c["stage_s"]) == set(gen["stage_s"]) and c["total_s"] >= sum(c["stage_s"].values())
        assert c["sampling_s"] == c["stage_s"]["sampling"]
    assert gen["step_caches"]["easycache"]["reused_steps"] > 0


def test_bench_generation_with_recipes_renders_with_them_and_reports_memory_per_stage(tmp_path, capsys,
                                                                                      monkeypatch):
    """turbo + first-block-cache on the tiny models: the render runs turbo's evaluations through the cache,
    stamps both, and reports the decode's memory plan (no CUDA here: no per-stage GPU peaks)."""
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-t2va.json"), "--synthetic", "--preset",
                 "tiny", "--generation", "--recipe", "turbo:evaluations=5", "--recipe",
                 "first-block-cache:threshold=0.5", "--warmup", "0", "--repeats", "1", "--dtype", "float32",
                 "--device", "cpu", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    gen = json.loads(out.read_text())["generation"]
    assert gen["evaluations"] == 5 and len(gen["step_s_all"]) == 5
    assert [r["name"] for r in gen["recipes"]] == ["turbo", "first-block-cache"]
    assert gen["recipes"][0]["evaluations"] == 5
    cache = gen["step_cache"]
    assert len(cache["computed"]) + len(cache["reused"]) == 5 and cache["threshold"] == 0.5
    assert gen["stage_gpu_memory_gb"] is None and gen["peak_gpu_memory_gb"] is None
    plan = gen["video_decode_plan"]
    assert plan["device_peak"] == pytest.approx(plan["weights"] + plan["transient"] + plan["window"], abs=2e-3)
    assert plan["latent_frames"] > 0 and plan["host_buffer"] > 0


def test_a_fasth3_synthetic_render_runs_four_vsa_evaluations(tmp_path, capsys, monkeypatch):
    """--fasth3 gives the synthetic DiT non-zero VSA gates, so the fasth3 recipe renders with them: four
    evaluations, the recipe stamped, the weights described as FastH3's. Without --fasth3 the recipe refuses the
    gate-less model in one line."""
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    # The fused row kernels would run in Triton's CPU interpreter, minutes for nothing this test looks at.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    argv = ["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-t2va.json"), "--synthetic", "--preset",
            "tiny", "--generation", "--recipe", "fasth3", "--warmup", "0", "--repeats", "1", "--dtype", "float32",
            "--device", "cpu", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert "is not a FastH3 model" in capsys.readouterr().err
    from h3_spark.h3_model.engine.engine import Engine

    renders = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, req, *a, **k: renders.append(req) or real(self, req, *a, **k))
    assert main([*argv, "--fasth3"]) == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    gen = result["generation"]
    assert gen["evaluations"] == 4 and len(gen["step_s_all"]) == 4
    # The warm-up render ran the recipe as well (VSA's kernel compiles there, not in the measured render).
    assert len(renders) == 2 and all(r.steps == 5 and r.attention_schedule is not None for r in renders)
    assert gen["recipes"][0]["name"] == "fasth3" and gen["recipes"][0]["sparsity"] == 0.9
    assert "FastH3" in result["weights"]


@pytest.mark.parametrize("extra,message", [
    (["--generation"], "--generation builds synthetic components"),
    (["--synthetic", "--cache-modes", "easycache"], "--cache-modes needs a generation"),
    (["--synthetic", "--generation", "--cache-modes", "fastest"], "unknown cache mode(s) ['fastest']"),
    (["--synthetic", "--generation", "--vs", "exact"], "--vs exact measures DiT forwards only"),
    (["--synthetic", "--generation", "--recipe", "turbo", "--steps", "9"],
     "recipe turbo sets the steps and the video shift: leave --steps out"),
    (["--synthetic", "--generation", "--recipe", "first-block-cache", "--cache-modes", "easycache"],
     "--recipe with --cache-modes: the recipes' render is measured on its own"),
    (["--synthetic", "--generation", "--recipe", "sparse"], "recipe sparse needs Sol-Attn"),
    (["--fasth3"], "--fasth3 makes the synthetic DiT a FastH3 model: use it with --synthetic"),
    (["--synthetic", "--steps", "1"], "--steps must be at least 2, got 1"),
    (["--synthetic", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
])
def test_generation_flag_errors(tmp_path, capsys, extra, message):
    argv = ["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), "--device", "cpu",
            "--out", str(tmp_path / "o.json"), *extra]
    if "--synthetic" not in extra:
        argv += ["--checkpoint", str(tmp_path / "none.safetensors")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_vs_exact_reports_per_block_errors(tmp_path, capsys, monkeypatch):
    # The fused Triton kernels (exact to 1 ulp) run in Triton's CPU interpreter against the reference path.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "x.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), "--synthetic",
                 "--preset", "tiny", "--dtype", "float32", "--device", "cpu", "--vs", "exact",
                 "--out", str(out)])
    assert code == 0
    v = json.loads(out.read_text())["vs_exact"]
    assert len(v["per_block_rel_l2"]) == 2 and set(v["per_block_rel_l2"][0]) == {"attention", "ffn", "block"}
    assert 0 <= v["final_velocity_rel_l2_vs_exact"] <= 1e-5  # fp32: the fusions change rounding only
    assert v["verdict"] == "exact path" and v["exact_forward_s_median"] > 0
    assert_host_memory(json.loads(out.read_text()))


def test_promotion_verdicts():
    from h3_spark.measure.runner import promotion_verdict

    budget = json.loads((ROOT / "h3_spark" / "measure" / "quality_budget.json").read_text())
    assert promotion_verdict(0.5, 0.5, [], budget) == "exact path"
    assert promotion_verdict(0.01, 0.02, ["linear"], budget).startswith("eligible: linear")
    refused = promotion_verdict(0.389, 0.39, ["linear"], budget)
    assert refused.startswith("refused: linear outside the budget") and "0.3890" in refused


def _bench_errors(tmp_path, capsys, *extra):
    argv = ["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), *extra]
    if "--out" not in extra:
        argv += ["--out", str(tmp_path / "o.json")]
    code = main(argv)
    return code, capsys.readouterr().err


def _must_not_load(*args, **kwargs):
    raise AssertionError("a model was built before the flags were checked")


@pytest.mark.parametrize("source", [["--checkpoint", "none.safetensors"], ["--synthetic"]])
def test_bench_refuses_the_cpu_unless_asked(tmp_path, capsys, monkeypatch, source):
    # The help promises a GPU measurement: without one, only --device cpu or a tiny synthetic model run.
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("h3_spark.measure.synthetic.synthetic_dit", _must_not_load)  # a full-size model on the CPU
    code, err = _bench_errors(tmp_path, capsys, *source)
    assert code == 2 and "Traceback" not in err
    assert "bench measures on a CUDA GPU and this machine has none; pass --device cpu" in err


def test_a_tiny_synthetic_bench_runs_on_the_cpu_without_device(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    out = tmp_path / "r.json"
    code, err = _bench_errors(tmp_path, capsys, "--synthetic", "--preset", "tiny", "--dtype", "float32",
                              "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["device"] == "cpu"


class _BrokenModule(type(json)):
    """A module whose every attribute fails the way a half-installed package's import does."""

    def __getattr__(self, name):
        raise RuntimeError("operator torchvision::nms does not exist\nmore detail")


@pytest.mark.parametrize("extra,message", [
    (["--profile"], "--profile reports CUDA kernel time: it needs a CUDA device, not the CPU"),
    (["--out", "{tmp}"], "is a folder; give the path of the result JSON to write"),
    (["--out", "{tmp}/afile/r.json"], "afile is a file, not a folder"),
    (["--vs", "diffusers"], ("--vs diffusers needs diffusers==0.42.1 installed and importable "
                             "(RuntimeError: operator torchvision::nms does not exist)")),
    (["--attention", "bogus"], "--attention 'bogus' is not accepted; use one of: auto, sdpa"),
    (["--linear", "fp4"], "--linear 'fp4' is not accepted; use one of: auto, bf16, fp8, nvfp4"),
])
def test_bench_checks_flags_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    # The checkpoint does not exist: an error about it would mean the flag was checked only after loading.
    monkeypatch.setitem(__import__("sys").modules, "diffusers", _BrokenModule("diffusers"))
    (tmp_path / "afile").write_text("")
    extra = [x.format(tmp=tmp_path) for x in extra]
    code, err = _bench_errors(tmp_path, capsys, "--checkpoint", str(tmp_path / "none.safetensors"),
                              "--device", "cpu", *extra)
    assert code == 2 and "Traceback" not in err
    assert message in err and "none.safetensors" not in err


def test_parallel_gpu_names_a_bad_attention_as_the_flag(tmp_path, capsys, monkeypatch):
    import torch.distributed

    from h3_spark.measure import parallel_gpu

    def _must_not_start(*args, **kwargs):
        raise AssertionError("the process group was started before --attention was checked")

    # The contract does not exist either: an error about it would mean the flag was checked too late.
    monkeypatch.setattr(torch.distributed, "init_process_group", _must_not_start)
    with pytest.raises(SystemExit) as exited:
        parallel_gpu.main(["--contract", str(tmp_path / "none.json"), "--out", str(tmp_path / "r.json"),
                           "--attention", "warp"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "--attention 'warp' is not accepted; use one of: auto, sdpa" in err
    assert "H3_ATTENTION" not in err and "none.json" not in err


def test_parallel_gpu_flag_goes_on_top_of_the_h3_settings(tmp_path, monkeypatch):
    from h3_spark.measure import parallel_gpu

    monkeypatch.setenv("H3_ATTENTION", "fa3")
    monkeypatch.setenv("H3_LINEAR", "bf16")
    _, settings = parallel_gpu.parse_args(["--contract", "c.json", "--out", "r.json", "--attention", "sdpa"])
    assert (settings.attention, settings.linear) == ("sdpa", "bf16")
    # Without the flag the environment's choice stands (as for serve and generate).
    _, settings = parallel_gpu.parse_args(["--contract", "c.json", "--out", "r.json"])
    assert settings.attention == "fa3"


def test_a_checkpoint_made_here_is_named_synthetic_in_the_result(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3_spark.cli.bench import checkpoint_weights
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.dit.config import TINY

    made = tmp_path / "tiny-fp8.safetensors"
    make_dit_checkpoint(made, TINY, "fp8_scaled", "comfy", seed=3)
    assert checkpoint_weights(made) == (
        f"checkpoint {made}: synthetic random weights written by h3-spark make-checkpoint (seed 3, format "
        "fp8_scaled, layout comfy); real H3 weights are not available here")
    # The same tensors without our maker's note: a file we cannot vouch for is named only by its path.
    plain = tmp_path / "other.safetensors"
    bf16 = tmp_path / "tiny-bf16.safetensors"
    make_dit_checkpoint(bf16, TINY, "bf16", "comfy", seed=3)
    with safe_open(str(bf16), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "h3_spark"}
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(plain), metadata=meta)
    assert checkpoint_weights(plain) == f"checkpoint {plain}"


@pytest.mark.parametrize("extra,message", [
    (["--recipe", "sparse"], "--recipe measures a recipe's drift from the exact path (add --vs exact) or a render"),
    (["--recipe", "turbo", "--vs", "exact"], "bench --recipe takes sparse, the recipe that changes a forward"),
    (["--recipe", "sparse", "--vs", "exact"], "recipe sparse needs Sol-Attn"),
    (["--recipe", "sparse:tau=-1", "--vs", "exact"], "recipe sparse: tau must be >= 0.0"),
])
def test_bench_recipe_errors(tmp_path, capsys, extra, message):
    code, err = _bench_errors(tmp_path, capsys, "--synthetic", "--preset", "tiny", "--device", "cpu", *extra)
    assert code == 2 and message in err


def test_vs_exact_with_the_sparse_recipe_measures_its_schedule(tmp_path, capsys, monkeypatch):
    """The wiring, on the CPU: a stand-in for Sol-Attn (exact attention on halved keys, so it visibly differs)
    runs past the recipe's dense blocks only; the block-0 errors stay at the fast path's rounding."""
    from h3_spark.h3_model.engine import recipes
    from h3_spark.kernels.attention import sdpa

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(recipes, "sparse_backend", lambda recipe, device, settings: lambda q, k, v: sdpa(q, k * 0.5, v))
    out = tmp_path / "x.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), "--synthetic",
                 "--preset", "tiny", "--dtype", "float32", "--device", "cpu", "--vs", "exact",
                 "--recipe", "sparse:dense_blocks=1,dense_steps=1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    v = result["vs_exact"]
    assert result["evaluation"] == 1 and result["recipes"][0]["dense_blocks"] == 1
    assert v["per_block_rel_l2"][0]["attention"] <= 1e-5 < 1e-2 < v["per_block_rel_l2"][1]["attention"]
    assert "recipe sparse" in v["approximate_paths"] and v["verdict"] != "exact path"


def _record_load_dit(monkeypatch) -> list:
    """(calling module, device) of every load_dit call from now on: only the engine's loader may make them."""
    import sys

    from h3_spark.h3_model import checkpoint

    real, calls = checkpoint.load_dit, []

    def recording(*args, **kwargs):
        calls.append((sys._getframe(1).f_globals["__name__"], str(kwargs.get("device"))))
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_dit", recording)
    return calls


def _streaming_budget(path, contract_path, dtype) -> str:
    """A --vram-budget (in MB, to the byte) whose room holds the checkpoint's DiT with its blocks streamed but
    not resident: halfway between the two, plus the slack a budget keeps free (its 1 GB minimum, this small)."""
    from h3_spark.h3_model.checkpoint import load_dit
    from h3_spark.h3_model.engine import memory

    model = load_dit(path, dtype=dtype)
    rows = contract_shape(load_contract(contract_path), model.config).layout.sequence_length
    plan = memory.plan_dit(model, None, rows)
    room = (memory.streamed_minimum(plan) + plan.device_bytes) // 2
    return f"{(room + memory.SLACK_MIN) / 1e6:.6f}MB"


def test_bench_checkpoint_loads_configures_and_places_through_the_engine(tmp_path, capsys, monkeypatch):
    """--checkpoint --vram-budget on the CPU (the card emulated): the engine's loader reads the file into host
    memory, configures the kernels there and places what fits, the rest streams; bench never calls load_dit."""
    import torch

    from checkpoints import made_files
    from h3_spark.h3_model.dit.config import TINY
    from h3_spark.h3_model.engine import memory, placement

    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    contract = ROOT / "tests" / "data" / "tiny-t2va.json"
    path = made_files(tmp_path, TINY, ("bf16",), seed=4)["bf16"]
    budget = _streaming_budget(path, contract, torch.float32)
    calls, steps = _record_load_dit(monkeypatch), []
    for module, name in ((memory, "configure_in_host"), (placement, "place_dit")):
        def step(*args, real=getattr(module, name), name=name, **kwargs):
            steps.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, step)
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(contract), "--checkpoint", str(path), "--dtype", "float32",
                 "--device", "cpu", "--vram-budget", budget, "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert calls == [("h3_spark.h3_model.engine.loading", "cpu")] and steps == ["configure_in_host", "place_dit"]
    result = json.loads(out.read_text())
    plan = result["vram_budget"]
    assert plan["streamed_blocks"] >= 1 and plan["adaln_in_host_memory"] and plan["emulation"] is None
    assert plan["reserved_for_other_stages"] == {}  # a DiT alone: nothing kept for other stages
    assert plan["forwards_streamed"] == plan["forwards"] > 0 and plan["bytes_copied_per_forward"] > 0
    assert result["weights"].startswith(f"checkpoint {path}: synthetic random weights")
    assert set(result["load_s"]) == {"dit", "placement"} and result["backends"]["linear"]  # placed under a budget
    assert_host_memory(result)


def test_bench_checkpoint_vs_diffusers_builds_the_twin_from_the_engines_dit(tmp_path, capsys, monkeypatch):
    """No budget: the engine loads the ref2va contract's DiT (dit_ref) resident with no kernels, so the diffusers
    twin is built on the file's own weights; fp32 on both sides agrees as closely as the oracle does."""
    from checkpoints import made_files
    from h3_spark.h3_model.dit.config import TINY

    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    path = made_files(tmp_path, TINY, ("bf16",), seed=5)["bf16"]
    calls = _record_load_dit(monkeypatch)
    out = tmp_path / "r.json"
    code = main(["bench", "--contract", str(ROOT / "tests" / "data" / "tiny-ref2va.json"), "--checkpoint", str(path),
                 "--dtype", "float32", "--device", "cpu", "--vs", "diffusers", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert calls == [("h3_spark.h3_model.engine.loading", "cpu")]
    result = json.loads(out.read_text())
    assert result["velocity_rel_l2_vs_diffusers"] <= 1e-5 and "vram_budget" not in result
    assert set(result["load_s"]) == {"dit_ref"}
    assert_host_memory(result)


def test_a_missing_checkpoint_is_named_by_the_bench_flag(tmp_path, capsys):
    code, err = _bench_errors(tmp_path, capsys, "--checkpoint", str(tmp_path / "none.safetensors"), "--device", "cpu")
    assert code == 2 and f"--checkpoint {tmp_path / 'none.safetensors'}: no such file or folder" in err
    assert "--dit" not in err and "Traceback" not in err
