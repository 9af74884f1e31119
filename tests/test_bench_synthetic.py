"""Synthetic models: the released geometry (checked on the meta device) and tiny ones that run here."""

import pytest
import torch

from h3_spark.measure import synthetic
from h3_spark.errors import InputError


@pytest.fixture(scope="module")
def transformers_ready():
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")


def test_full_text_encoder_geometry_is_qwen3vl_32b_cut_at_layer_50(transformers_ready):
    from transformers import Qwen3VLModel

    from h3_spark.h3_model.engine import demo

    tok = demo.make_tokenizer()
    config = demo.text_config(tok, layers=50, text=synthetic.QWEN3VL_32B_TEXT, vision=synthetic.QWEN3VL_32B_VISION,
                              vocab_size=synthetic.QWEN3VL_VOCAB)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    layers = sum(p.numel() for p in model.language_model.layers.parameters())
    # 50 of Qwen3-VL-32B's 64 decoder layers (~488 M parameters each), its 0.78 B embedding, a ~0.6 B ViT.
    assert len(model.language_model.layers) == 50
    assert 50 * 480e6 < layers < 50 * 495e6
    assert model.language_model.embed_tokens.weight.shape == (151936, 5120)
    assert 0.5e9 < sum(p.numel() for p in model.visual.parameters()) < 0.7e9


def test_full_processor_makes_510_vision_tokens_for_a_contract_reference(transformers_ready):
    from h3_spark.h3_model.engine import demo

    proc = demo.make_processor(demo.make_tokenizer(), patch_size=16, image_pixels=synthetic.QWEN3VL_PIXELS,
                               video_pixels=synthetic.QWEN3VL_PIXELS)
    image = torch.randint(0, 256, (544, 960, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    grid = proc.image_processor(images=[image.numpy()], return_tensors="pt")["image_grid_thw"][0]
    assert int(grid.prod()) // 4 == 510  # (544 / 32) * (960 / 32): one token per merged 2 x 2 patch of 16 px


def test_tiny_components_are_random_deterministic_and_finite(transformers_ready):
    a, b, c = (synthetic.synthetic_components("tiny", ["t2va"], "cpu", torch.float32, torch.float32,
                                              seed=seed)[0].components for seed in (3, 3, 4))
    assert a.dit_ref is None and a.dit is not None
    for name in ("vae", "audio_vae"):
        pa, pb, pc = (dict(getattr(x, name).named_parameters()) for x in (a, b, c))
        for key in list(pa)[:20]:
            assert torch.equal(pa[key], pb[key]) and pa[key].abs().sum() > 0
        assert any(not torch.equal(pa[k], pc[k]) for k in pa)
    emb = a.text_encoder.encode("a paper boat").embeds
    assert emb.shape[-1] == a.dit.config.text_dim and emb.isfinite().all() and emb.std() > 0


@pytest.mark.parametrize("args,message", [
    (("huge", ["t2va"]), "synthetic preset must be one of full, tiny, got 'huge'"),
    (("tiny", ["t3va"]), "synthetic modes must be among t2va, fl2va, ref2va, got ['t3va']"),
    (("tiny", []), "synthetic modes must be among"),
])
def test_bad_synthetic_requests(args, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        synthetic.component_builders(*args, device="cpu", dtype=torch.float32)


def test_synthetic_dit_fan_in_init_follows_make_checkpoints_rule():
    import dataclasses

    from h3_spark.h3_model.dit.config import FULL

    config = dataclasses.replace(FULL, num_attention_heads=2, attention_head_dim=128, hidden_size=512, ffn_dim=1024,
                                 num_layers=2, text_dim=64, time_embed_hidden_dim=256, time_embed_dim=128)
    model = synthetic.synthetic_dit(config, torch.float32, "cpu", seed=1)
    blk = model.transformer_blocks[0]
    # unit-gain linears: std 1/sqrt(fan_in); AdaLN projections five times smaller; RMSNorm gains around 1
    assert blk.attn.to_q.weight.std().item() == pytest.approx(512 ** -0.5, rel=0.02)
    assert blk.ff.net[2].weight.std().item() == pytest.approx(1024 ** -0.5, rel=0.02)
    assert blk.adaln_proj.linear.weight.std().item() == pytest.approx(0.2 * 128 ** -0.5, rel=0.02)
    assert blk.norm1.weight.mean().item() == pytest.approx(1.0, abs=0.02)
    old = synthetic.synthetic_dit(config, torch.float32, "cpu", seed=1, init="normal_0.02")
    assert old.transformer_blocks[0].attn.to_q.weight.std().item() == pytest.approx(0.02, rel=0.02)
    with pytest.raises(InputError, match="synthetic DiT init must be one of fan_in, normal_0.02, got 'zeros'"):
        synthetic.synthetic_dit(config, torch.float32, "cpu", init="zeros")


def test_synthetic_builders_size_themselves_as_they_build(transformers_ready):
    """`--vram-budget auto` plans synthetic models from their configs (an 80 GB card could not hold the full set
    and ran out of memory while placing it): each builder's planned bytes equal the parameter bytes of the model
    it builds."""
    builders = synthetic.component_builders("tiny", ["t2va"], "cpu", torch.bfloat16, torch.float16, seed=2)
    for name, builder in builders.items():
        model = builder()
        module = getattr(model, "model", model)  # the text encoder wraps its Qwen3-VL module
        built = sum(p.numel() * p.element_size() for p in module.parameters())
        assert builder.planned_bytes() == built, name


def test_auto_budget_plans_the_full_synthetic_set_for_an_80_gb_card(monkeypatch, transformers_ready):
    """The full-size set (DiT 70 GB, text encoder 52 GB, VAEs 6 GB in bf16/fp16) is sized from the configs alone;
    with 80 GB free, auto chooses streaming under 95 % of it; with 150 GB free, resident. Nothing is built."""
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.h3_model.engine.memory import AUTO_FREE_FRACTION, planned_bytes

    builders = synthetic.component_builders("full", ["t2va"], "cuda", torch.bfloat16, torch.float16, fasth3=True)
    need = planned_bytes(builders, LoadOptions(device="cuda", dtype=torch.bfloat16))
    assert 125e9 < need < 140e9
    for free, chose in ((80 * 10 ** 9, "streaming"), (150 * 10 ** 9, "resident")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, free))
        engine = Engine(options=LoadOptions(device="cuda", dtype=torch.bfloat16, vram_budget="auto"),
                        overrides=builders)
        engine._resolve_auto_budget(builders)
        assert engine.auto_budget["chose"] == chose and engine.auto_budget["planned_bytes"] == need
        assert engine.options.vram_budget == (int(free * AUTO_FREE_FRACTION) if chose == "streaming" else None)


def test_bench_generation_under_a_budget_loads_and_places(tmp_path, transformers_ready):
    """`bench --synthetic --generation --vram-budget GB --host-budget GB` handed synthetic_components a keyword it
    did not take (TypeError before anything ran): the bench's own flags, through its own preflight and loader,
    now build the tiny set and place it under the budget, checked against the host budget."""
    from pathlib import Path

    from h3_spark.cli import bench
    from h3_spark.cli import build_parser

    contract = Path(__file__).parent / "data" / "tiny-t2va.json"
    args = build_parser().parse_args(["bench", "--contract", str(contract), "--synthetic", "--preset", "tiny",
                                      "--device", "cpu", "--generation", "--vram-budget", "4", "--host-budget", "16",
                                      "--out", str(tmp_path / "r.json")])
    device, contract, _, _, _ = bench.preflight(args)
    args.plan_rows = bench._contract_rows(args, contract)
    model, engine, weights = bench.load_model(args, contract, device, torch.float32)
    assert engine.options.vram_budget == 4 * 10 ** 9 and engine.options.host_budget == 16 * 10 ** 9
    assert engine.memory_plans["dit"] is not None and engine.host_plan is not None
    assert engine.components.vae is not None and model is engine.components.dit
    assert weights.startswith("synthetic random weights, preset tiny")


def test_bench_refuses_auto_for_dit_forwards(tmp_path, capsys):
    from h3_spark.cli import main

    code = main(["bench", "--contract", "benchmarks/t2va-640x352-124f.json", "--synthetic", "--preset", "tiny",
                 "--device", "cpu", "--vram-budget", "auto", "--out", str(tmp_path / "r.json")])
    assert code == 2
    assert "auto (generate's placement) only with --generation" in capsys.readouterr().err


@pytest.mark.parametrize("budget, warmup, seconds", [("auto", "0", "5"), ("4", "1", "1")])
def test_the_film_benchmark_runs_on_the_cpu_under_each_budget_form(tmp_path, monkeypatch, budget, warmup, seconds,
                                                                   transformers_ready):
    """benchmarks/film_gpu.py takes --vram-budget as generate does (auto by default, or a size): a tiny film through
    its whole path on the CPU, the budget it ran under in the result; a warm-up film is rendered first and kept out
    of the films."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "film_gpu.py"
    spec = importlib.util.spec_from_file_location("film_gpu", script)
    film_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(film_gpu)
    out = tmp_path / "film.json"
    # The PyTorch references: Triton's interpreter would spend most of the test in the fused passes.
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    assert film_gpu.main(["--out", str(out), "--seconds", seconds, "--steps", "2", "--width", "64", "--height", "64",
                          "--preset", "tiny", "--device", "cpu", "--vram-budget", budget,
                          "--mp4-dir", str(tmp_path / "films"), "--warmup-seconds", warmup]) == 0
    result = json.loads(out.read_text())
    assert result["vram_budget"] == budget and len(result["films"]) == 1
    assert result["films"][0]["frames"] == int(seconds) * 24
    if warmup == "0":
        assert result["warmup"] == "none: the first film is also the warm-up"
    else:
        assert result["warmup"]["seconds"] == 1.0 and result["warmup"]["total_s"] > 0
    assert (tmp_path / "films" / f"film-{seconds}s.mp4").stat().st_size > 0


def test_the_film_benchmark_refuses_a_negative_warm_up(capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "film_gpu.py"
    spec = importlib.util.spec_from_file_location("film_gpu", script)
    film_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(film_gpu)
    with pytest.raises(SystemExit):
        film_gpu.main(["--out", "x.json", "--warmup-seconds", "-1"])
    assert "--warmup-seconds must be 0 or more, got -1" in capsys.readouterr().err
