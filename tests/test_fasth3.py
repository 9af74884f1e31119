"""FastH3 (FastVideo's DMD2 students of H3): its checkpoints and their VSA gates, the model with and without the
gates, and the recipes fasth3 / fasth3-8step: their grids, a tiny generation through the engine, and every
set-up error.

Error budget: the dense forward ignores the gates bit for bit; VSA at sparsity 0 with zero gates is the dense
forward within 1e-5 (fp32, relative L2, through two blocks).
"""

import dataclasses
import json

import pytest
import torch

from h3_spark.errors import H3Error, InputError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.checkpoint.dit_config import config_from_diffusers_shapes
from h3_spark.h3_model.checkpoint.dit_reader import expected_shapes
from h3_spark.h3_model.checkpoint.fasth3 import fasth3_config, is_fasth3, make_fasth3_checkpoint
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.dit.config import FULL, TINY, DiTConfig
from h3_spark.h3_model.dit.layout import build_t2va
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.h3_model.engine.recipes import (VsaSchedule, apply_recipes, check_recipes, parse_recipes,
                                              recipe_sampling)
from h3_spark.h3_model.pipeline.generation import GenerationRequest, schedule_of
from h3_spark.kernels.settings import KernelSettings
from oracle import forward_args, rel_l2, text_tags


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fasth3")
    make_fasth3_checkpoint(root / "fast", TINY, seed=2)
    make_fasth3_checkpoint(root / "fast.safetensors", TINY, layout="comfy", seed=2)
    make_dit_checkpoint(root / "base", TINY, "bf16", "diffusers", seed=2)
    return root


@pytest.fixture(scope="module")
def fast(files):
    return load_dit(files / "fast")


@pytest.fixture(scope="module")
def base(files):
    return load_dit(files / "base")


def _req(**kw):
    return GenerationRequest(mode="t2va", prompt="a fox", **kw)


# ------------------------------------------------------------------------------------------ checkpoints
def test_a_fasth3_folder_is_told_by_its_gates(files, fast, base):
    # FastVideo's config.json has no gate field (diffusers' transformer has none); the names tell.
    assert "gate_compress" not in json.loads((files / "fast" / "config.json").read_text())
    reader = open_dit(files / "fast")
    assert reader.config.gate_compress and is_fasth3(reader) and is_fasth3(reader.source)
    assert not is_fasth3(open_dit(files / "base")) and not base.config.gate_compress
    assert is_fasth3(["model.diffusion_model.blocks.3.attn.to_gate_compress.weight"])
    assert not is_fasth3(["token_refiner.refiner_blocks.0.attn.to_q.weight"])
    gates = [b.attn.to_gate_compress.weight for b in fast.transformer_blocks]
    assert all(g.shape == (32, 24) and g.abs().sum() > 0 for g in gates)  # random, non-zero
    assert all(b.attn.to_gate_compress is None for b in fast.token_refiner.refiner_blocks)
    # The rest of the model is the base model's of the same seed.
    base_state = base.state_dict()
    assert all(torch.equal(v, base_state[k]) for k, v in fast.state_dict().items() if "to_gate_compress" not in k)


def test_a_sharded_fasth3_folder_is_told_by_its_index(files, fast, tmp_path):
    """FastVideo's exports are sharded: the weight map of the index names the gates."""
    import shutil

    from h3_spark.h3_model.checkpoint.safetensors_header import read_header

    folder = tmp_path / "transformer"
    folder.mkdir()
    shard = "diffusion_pytorch_model-00001-of-00001.safetensors"
    shutil.copy(files / "fast" / "diffusion_pytorch_model.safetensors", folder / shard)
    shutil.copy(files / "fast" / "config.json", folder / "config.json")
    names = read_header(folder / shard).tensors
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {name: shard for name in names}}))
    assert open_dit(folder).config.gate_compress
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in load_dit(folder).state_dict().items())


def test_the_comfy_layout_holds_the_same_fasth3_model(files, fast):
    reader = open_dit(files / "fast.safetensors")
    assert reader.config.gate_compress and is_fasth3(reader)
    assert json.loads(reader.source.metadata["config"])["transformer"]["gate_compress"] is True
    comfy = load_dit(files / "fast.safetensors")
    assert all(torch.equal(v, fast.state_dict()[k]) for k, v in comfy.state_dict().items())


def test_configs_without_the_gate_read_and_write_as_before():
    assert "gate_compress" not in TINY.to_dict()
    assert fasth3_config(TINY).to_dict()["gate_compress"] is True
    assert DiTConfig.from_dict(fasth3_config(TINY).to_dict()) == fasth3_config(TINY)
    with pytest.raises(H3Error, match="gate_compress must be true or false, got 'yes'"):
        DiTConfig(gate_compress="yes")
    # A bare diffusers state dict (no config.json) is sized from its shapes, the gates from their names.
    shapes = expected_shapes(fasth3_config(FULL))
    assert config_from_diffusers_shapes(list(shapes), shapes.get) == fasth3_config(FULL)
    plain = expected_shapes(FULL)
    assert config_from_diffusers_shapes(list(plain), plain.get) == FULL


def test_a_config_that_says_no_gates_refuses_the_gates(files, tmp_path):
    import shutil

    shutil.copytree(files / "fast", tmp_path / "fast")
    config = json.loads((tmp_path / "fast" / "config.json").read_text())
    (tmp_path / "fast" / "config.json").write_text(json.dumps({**config, "gate_compress": False}))
    with pytest.raises(H3Error, match=r"2 unexpected tensors for this DiT config, e\.g\. transformer_blocks\.0\.attn"
                                      r"\.to_gate_compress\.weight"):
        load_dit(tmp_path / "fast")


# ------------------------------------------------------------------------------------------ the model
def _args():
    lay = build_t2va(text_tags(9, (1, 5)), 5, 4, 6, 10, TINY.patch_size)
    return lay, forward_args(TINY, lay, seed=3)


def test_the_dense_forward_ignores_the_gates(fast, base):
    _, args = _args()
    with torch.no_grad():
        got, want = fast(**args), base(**args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_zero_gates_under_vsa_at_sparsity_zero_are_the_dense_forward(fast, base):
    lay, args = _args()
    zeroed = H3DiT(fast.config, device="meta")
    zeroed.load_state(((k, torch.zeros_like(v) if "to_gate_compress" in k else v)
                       for k, v in fast.state_dict().items()), device="cpu")
    zeroed.eval()
    schedule = VsaSchedule(0.0, 64, "pytorch", TINY.patch_size).for_layout(lay, (5, 4, 6))
    zeroed.attention_schedule, zeroed.sampling_step = schedule, 0
    with torch.no_grad():
        got, want = zeroed(**args), base(**args)
    assert schedule.attention.calls == TINY.num_layers and schedule.attention.gated_calls == 0  # zero: skipped
    assert rel_l2(got[0], want[0]) <= 1e-5 and rel_l2(got[1], want[1]) <= 1e-5
    # The trained (here random) gates add their coarse branch.
    gated = VsaSchedule(0.0, 64, "pytorch", TINY.patch_size).for_layout(lay, (5, 4, 6))
    fast.attention_schedule, fast.sampling_step = gated, 0
    try:
        with torch.no_grad():
            moved = fast(**args)
    finally:
        fast.attention_schedule, fast.sampling_step = None, None
    assert gated.attention.gated_calls == TINY.num_layers and rel_l2(moved[0], want[0]) > 1e-3


# ------------------------------------------------------------------------------------------ the recipes
def test_fasth3_samples_the_five_point_grid_at_the_release_shifts(fast):
    req = apply_recipes(parse_recipes(["fasth3"]), _req(steps=30), fast, "cpu", KernelSettings())
    schedule = schedule_of(req)
    assert len(schedule) == 4 and (req.video_shift, req.audio_shift) == (12.0, 3.0)
    # t = 1000, 750, 500, 250 -> 0 before the shifts.
    assert torch.allclose(schedule.video.sigmas, torch.tensor([1, 36 / 37, 12 / 13, 0.8, 0]), atol=1e-6)
    assert torch.allclose(schedule.audio.sigmas, torch.tensor([1, 0.9, 0.75, 0.5, 0]), atol=1e-6)
    assert isinstance(req.attention_schedule, VsaSchedule) and req.attention_schedule.fine == "pytorch"
    assert req.recipes == [{"name": "fasth3", "sparsity": 0.9, "tile": 64, "evaluations": 4, "video_shift": 12.0,
                            "audio_shift": 3.0}]


def test_fasth3_8step_samples_its_trained_rungs(fast):
    req = apply_recipes(parse_recipes(["fasth3-8step"]), _req(), fast, "cpu", KernelSettings())
    schedule = schedule_of(req)
    rungs = torch.tensor([999, 874, 749, 624, 500, 375, 250, 125]) / 1000
    for sigmas, shift in ((schedule.video.sigmas, 10.0), (schedule.audio.sigmas, 3.0)):
        assert torch.allclose(sigmas, torch.cat([shift * rungs / (1 + (shift - 1) * rungs), torch.zeros(1)]),
                              atol=1e-6)
    assert len(schedule) == 8 and req.attention_schedule.sparsity == 0.8
    assert req.recipes[0]["rungs"] == [999, 874, 749, 624, 500, 375, 250, 125]
    run = recipe_sampling(parse_recipes(["fasth3-8step", "first-block-cache"]), 49)
    assert run.evaluations == 8 and run.step_cache.evaluations == 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from h3_spark.h3_model.engine import demo
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions, component_loader
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable
    from h3_spark.measure import synthetic

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    path = tmp_path_factory.mktemp("fasth3_engine") / "transformer"
    make_fasth3_checkpoint(path, demo.DIT_CONFIG, seed=5)
    options = LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                          kernels=KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    builders = synthetic.component_builders("tiny", ["t2va"], "cpu", torch.float32, torch.float32, text_layer=2)
    builders["dit"] = component_loader("dit", path, options)
    return Engine(options=options, overrides=builders).load(["t2va"])


def test_fasth3_runs_a_generation_in_four_evaluations_of_vsa(engine, monkeypatch):
    bound = []
    for_layout = VsaSchedule.for_layout
    monkeypatch.setattr(VsaSchedule, "for_layout", lambda self, *a: bound.append(for_layout(self, *a)) or bound[-1])
    dit = engine.components.dit
    req = _req(width=64, height=64, frames=124, seed=1)
    result = engine.generate(apply_recipes(parse_recipes(["fasth3"]), req, dit, "cpu", KernelSettings()))
    assert result.info["evaluations"] == 4 and len(result.info["step_seconds"]) == 4
    assert result.info["recipes"][0]["name"] == "fasth3" and result.info["recipes"][0]["sparsity"] == 0.9
    vsa = bound[0].attention
    assert vsa.calls == vsa.gated_calls == 4 * dit.config.num_layers and vsa.tiles.num_video_tiles > 1
    assert torch.isfinite(result.video_latents).all() and torch.isfinite(result.audio_latents).all()
    assert dit.attention_schedule is None  # for that run only
    dense = engine.generate(dataclasses.replace(req, steps=5))  # the same grid, dense attention
    assert not torch.equal(dense.video_latents, result.video_latents)


def test_fasth3_runs_inside_a_films_windows(engine, monkeypatch):
    """Each window of a film runs the recipe's 4 VSA evaluations; a window that goes on tiles its history and
    first-frame guide as context tiles of their own, in 3-D on the target's grid and selected like the target's
    within the target's budget (the same target tiles; its history's sound dense tiles of its own)."""
    from h3_spark.h3_model.compose.film import Film, Shot, render_film
    from h3_spark.h3_model.compose.windows import plan_film

    bound = []
    for_layout = VsaSchedule.for_layout
    monkeypatch.setattr(VsaSchedule, "for_layout", lambda self, *a: bound.append(for_layout(self, *a)) or bound[-1])
    dit = engine.components.dit
    base = apply_recipes(parse_recipes(["fasth3"]), _req(width=64, height=64, seed=1), dit, "cpu", KernelSettings())
    plan = plan_film([400])
    chunks = []
    result = render_film(engine.generate, base, Film(plan, [Shot(base.prompt, 400)], {}, None, 64, 64),
                         on_frames=chunks.append)
    assert sum(c.shape[0] for c in chunks) == 400 and len(result.info["windows"]) == 2
    first, second = (b.attention for b in bound)
    assert first.calls == second.calls == 4 * dit.config.num_layers
    assert second.tiles.num_target_tiles == first.tiles.num_target_tiles and first.tiles.num_context_tiles == 0
    # 64x64: 2x2 patches a frame, one 4x4x4 tile per 4 latent frames; 22 history frames (7 latents) and the
    # guide's still are 8 frames: 2 context tiles of 16 rows.
    assert second.tiles.num_context_tiles == 2 and second.tiles.sizes[second.tiles.num_prefix_tiles:][:2].tolist() == [
        16, 16]
    # The text, then the history's sound (36 latents x 2 channels: 72 rows) as two more dense tiles.
    assert second.tiles.sizes[:3].tolist() == [5, 64, 8]
    assert second.tiles.num_prefix_tiles == first.tiles.num_prefix_tiles + 2
    assert "context_tiles" not in first.describe() and second.describe()["context_tiles"] == 2


# ------------------------------------------------------------------------------------------ set-up errors
@pytest.mark.parametrize("texts, message", [
    (["fasth3:sparsity=1"], r"^recipe fasth3: sparsity must be in \[0, 1\), got 1\.0$"),
    (["fasth3:sparsity=-0.1"], r"^recipe fasth3: sparsity must be in \[0, 1\), got -0\.1$"),
    (["fasth3-8step:sparsity=nan"], r"^recipe fasth3-8step: sparsity must be in \[0, 1\), got nan$"),
    (["fasth3:sparsity=most"], r"^recipe fasth3: sparsity must be a number, got 'most'$"),
    (["fasth3:tile=32"], r"^recipe fasth3: tile must be 64, 128, 256 \(rows per VSA tile, the sizes its kernel has; "
                         r"FastH3 was trained with 64\), got 32$"),
    (["fasth3:steps=8"], r"^recipe fasth3 takes sparsity, tile \(as key=value\), got 'steps=8'; "
                         r"FastH3-8-Step-V2 is recipe fasth3-8step$"),
    (["fasth3", "fasth3-8step"], r"^recipes fasth3 and fasth3-8step both set the sampling grid and the attention"),
    (["fasth3", "turbo"], r"^recipes fasth3 and turbo both set the sampling grid: choose one$"),
    (["sol-engine", "fasth3-8step"], r"^recipes fasth3-8step and sparse both set the attention: choose one$"),
])
def test_bad_fasth3_recipes_are_refused_in_one_line(texts, message):
    with pytest.raises(InputError, match=message):
        parse_recipes(texts)


def test_fasth3_set_up_checks():
    recipes = parse_recipes(["fasth3"])
    with pytest.raises(InputError, match=r"^recipe fasth3 sets the steps and the shifts the distilled model was "
                                         r"trained with \(4 evaluations\): drop --steps / --sigmas$"):
        check_recipes(recipes, "cpu", KernelSettings(), explicit_steps=True)
    with pytest.raises(InputError, match=r"^recipe fasth3 runs VSA on bf16 heads, but attention fa3_fp8 quantizes "
                                         r"Q/K/V to FP8 before any block sees them: run the recipe with attention "
                                         r"fa3 or sdpa"):
        check_recipes(recipes, "cuda", KernelSettings().replace(attention="fa3_fp8"))
    check_recipes(parse_recipes(["fasth3", "first-block-cache"]), "cpu", KernelSettings())


def test_triton_missing_on_cuda_is_said(monkeypatch):
    from h3_spark.kernels import capability

    def missing(what, *args):
        raise capability.KernelUnavailable(f"{what} needs Triton, which is not installed")

    monkeypatch.setattr(capability, "require_triton", missing)
    with pytest.raises(InputError, match=r"^recipe fasth3's block-sparse kernel needs Triton, which is not"):
        check_recipes(parse_recipes(["fasth3"]), "cuda", KernelSettings())


def test_a_model_without_gates_is_not_a_fasth3_model(files, base):
    with pytest.raises(InputError, match=rf"^recipe fasth3: {files / 'base'} is not a FastH3 model: no "
                                         r"attn\.to_gate_compress weights \(the VSA gates FastH3 is distilled "
                                         r"with\); load a FastH3 checkpoint, or ask for fasth3:sparsity=0"):
        apply_recipes(parse_recipes(["fasth3"]), _req(), base, "cpu", KernelSettings())
    # Asked for by name, sparsity 0 samples the grid with the model's own dense attention.
    req = apply_recipes(parse_recipes(["fasth3-8step:sparsity=0"]), _req(), base, "cpu", KernelSettings())
    assert req.attention_schedule is None and len(schedule_of(req)) == 8


def test_the_vsa_schedule_needs_the_request():
    with pytest.raises(H3Error, match="the fasth3 attention tiles one request's packed sequence: it runs through "
                                      "the sampler"):
        VsaSchedule(0.9, 64, "pytorch", TINY.patch_size).at(0, 0)


def test_make_checkpoint_and_inspect_know_fasth3(tmp_path, capsys):
    """make-checkpoint --fasth3 writes the gates (diffusers and comfy, any block format, the gates bf16);
    inspect says a FastH3 model is one, and a base model is not; the released layout is refused (the pruned one,
    the templates' FastH3 files, is tests/test_template_files.py's)."""
    from h3_spark.cli import main

    for out, extra in ((tmp_path / "fast", ["--layout", "diffusers"]),
                       (tmp_path / "fast.safetensors", ["--format", "int8_convrot"])):
        assert main(["make-checkpoint", str(out), "--fasth3", *extra]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fasth3"] is True
        assert is_fasth3(open_dit(out))
        assert main(["inspect", str(out)]) == 0
        assert "FastH3 (distilled, VSA gates in every block): run it with --recipe fasth3" in capsys.readouterr().out
    base = tmp_path / "base.safetensors"
    assert main(["make-checkpoint", str(base)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(base)]) == 0
    assert "FastH3" not in capsys.readouterr().out
    assert main(["make-checkpoint", str(tmp_path / "p"), "--fasth3", "--layout", "released"]) == 2
    assert "--fasth3 writes the diffusers, comfy, comfy-pruned layout, not released" in capsys.readouterr().err
    assert main(["make-checkpoint", str(tmp_path / "v.safetensors"), "--fasth3", "--component", "vae"]) == 2
    assert "--fasth3 applies to --component dit" in capsys.readouterr().err


def test_the_gate_reads_an_fp8_quantized_attention_input():
    """With FP8 linears the fused modulation hands the attention its input as FP8 rows (shared by q, k and v);
    the gate, a plain linear, reads the values those codes stand for (this failed on the H200: linear() got
    an Fp8Rows)."""
    from h3_spark.h3_model.dit.model import Attention
    from h3_spark.kernels.linear_fp8 import Fp8Rows

    torch.manual_seed(3)
    attn = Attention(24, 2, 16, 1e-6, gate_compress=True)
    x = torch.randn(1, 5, 24)
    scale = x.abs().amax(-1, keepdim=True).reshape(-1, 1) / 448.0
    rows = Fp8Rows((x.reshape(-1, 24) / scale).to(torch.float8_e4m3fn), scale, x.shape)
    got = attn.compress_gate(rows)
    want = attn.to_gate_compress(rows.dequantize(torch.float32)).view(1, 5, 2, 16)
    assert got is not None and torch.equal(got, want)
    assert rel_l2(got, attn.compress_gate(x)) < 0.05  # the e4m3 rounding of the input, no more


# ------------------------------------------------------------------------------------------ the templates' recipes
def test_fasth3_v2_samples_res_multistep_on_simple_with_dense_attention_first(fast):
    """Comfy-Org's FastH3 V2 template: 8 steps of res_multistep on simple at 10/3, VSA keeping 10 % from 20 % of
    the schedule on: the simple grid's sigmas 1 and shift(0.875) = 0.986 lie above shift(0.8) = 0.976, so the
    first 2 evaluations keep the model's own attention."""
    from h3_spark.h3_model.pipeline.scheduler import scheduler_sigmas

    req = apply_recipes(parse_recipes(["fasth3-v2"]), _req(), fast, "cpu", KernelSettings())
    assert (req.sampler, req.scheduler, req.steps, req.video_shift, req.audio_shift) == (
        "res_multistep", "simple", 9, 10.0, 3.0)
    assert torch.equal(schedule_of(req).video.sigmas, scheduler_sigmas("simple", 8, 10.0))
    vsa = req.attention_schedule
    assert vsa.sparsity == 0.9 and vsa.tile == 64 and vsa.dense_steps == 2
    assert vsa.at(0, 0) is fast.attention and vsa.at(1, 5) is fast.attention
    with pytest.raises(H3Error, match="binds it to the request"):
        vsa.at(2, 0)  # VSA from the third evaluation on, once bound to a request
    assert req.recipes == [{"name": "fasth3-v2", "sparsity": 0.9, "start": 0.2, "tile": 64, "evaluations": 8,
                            "video_shift": 10.0, "audio_shift": 3.0, "sampler": "res_multistep",
                            "scheduler": "simple"}]


def test_omniref_samples_euler_on_simple_with_vsa_from_the_start(fast):
    req = apply_recipes(parse_recipes(["omniref"]), dataclasses.replace(_req(), mode="ref2va"), fast, "cpu",
                        KernelSettings())
    assert (req.sampler, req.scheduler, req.steps, req.video_shift, req.audio_shift) == (
        "euler", "simple", 9, 12.0, 3.0)
    assert req.attention_schedule.dense_steps == 0 and req.attention_schedule.sparsity == 0.9
    with pytest.raises(InputError, match=r"^recipe omniref runs a checkpoint distilled for ref2va, not t2va$"):
        apply_recipes(parse_recipes(["omniref"]), _req(), fast, "cpu", KernelSettings())
    with pytest.raises(InputError, match=r"^recipe fasth3-v2 runs a checkpoint distilled for t2va and fl2va, not "
                                         r"ref2va; FastH3 OmniRef is recipe omniref$"):
        apply_recipes(parse_recipes(["fasth3-v2"]), dataclasses.replace(_req(), mode="ref2va"), fast, "cpu",
                      KernelSettings())


@pytest.mark.parametrize("text, dense", [("fasth3-v2", 2), ("fasth3-v2:start=0", 0), ("fasth3-v2:start=1", 8),
                                         ("omniref", 0), ("omniref:start=0.4", 4), ("fasth3", 0)])
def test_the_vsa_start_counts_the_evaluations_above_its_sigma(text, dense):
    from h3_spark.h3_model.engine.recipes import vsa_dense_steps

    assert vsa_dense_steps(parse_recipes([text])[0]) == dense


def test_the_references_are_sink_tiles():
    """An OmniRef request's reference rows (an image and a sound before the target) are prefix tiles of their own:
    every query tile keeps them at any sparsity, and they keep every key tile."""
    from h3_spark.h3_model.dit.layout import AudioBlock, ImageBlock, build_ref2va, segments_before_video
    from h3_spark.kernels.vsa_reference import select_tiles, tile_map

    layout = build_ref2va(text_tags(20), [ImageBlock(8, 8), AudioBlock(6)], 9, 16, 16, 9)
    tiles = tile_map(segments_before_video(layout), (9, 8, 8), 64)
    refs = layout.video_indices[:layout.num_condition_video_rows]
    ref_audio = layout.audio_indices[:layout.num_condition_audio_rows]
    assert bool((tiles.row_tile[torch.cat([refs, ref_audio])] < tiles.num_prefix_tiles).all())
    # Text (20 rows), the image (16) and one audio run (the sound's 12 rows, then the target audio's 18): a tile each.
    assert tiles.sizes[:tiles.num_prefix_tiles].tolist() == [20, 16, 30]
    scores = torch.randn(1, 2, tiles.num_tiles, tiles.num_tiles)
    mask = select_tiles(scores, tiles.num_prefix_tiles, 0.9)
    assert bool(mask[..., :tiles.num_prefix_tiles].all()) and bool(mask[:, :, :tiles.num_prefix_tiles].all())
    assert not bool(mask[:, :, tiles.num_prefix_tiles:, tiles.num_prefix_tiles:].all())


@pytest.mark.parametrize("texts, message", [
    (["fasth3-v2", "fasth3"], r"^recipes fasth3-v2 and fasth3 both set the sampling grid and the attention"),
    (["omniref", "fasth3-v2"], r"^recipes omniref and fasth3-v2 both set the sampling grid and the attention"),
    (["pdd", "omniref"], r"^recipes pdd and omniref both set the sampling grid: choose one$"),
    (["fasth3-v2:start=1.5"], r"^recipe fasth3-v2: start must be 0.0..1.0, got 1.5$"),
    (["omniref:steps=4"], r"^recipe omniref takes sparsity, start, tile \(as key=value\), got 'steps=4'$"),
])
def test_bad_template_recipes_are_refused_in_one_line(texts, message):
    with pytest.raises(InputError, match=message):
        parse_recipes(texts)


def test_the_template_recipes_refuse_a_sampler_or_scheduler_given_by_hand():
    from h3_spark.h3_model.engine.recipes import check_conflicts

    common = {"step_cache": False, "explicit_steps": False, "cache_fix": "", "steps_fix": ""}
    with pytest.raises(InputError, match=r"^recipe fasth3-v2 samples with res_multistep on simple, as its checkpoint "
                                         r"was made to: drop --sampler$"):
        check_conflicts(parse_recipes(["fasth3-v2"]), explicit_sampler=True, **common)
    with pytest.raises(InputError, match=r"^recipe omniref sets the sampling grid, the scheduler's: drop --scheduler$"):
        check_conflicts(parse_recipes(["omniref"]), explicit_scheduler=True, **common)
    with pytest.raises(InputError, match=r"^recipe turbo sets the sampling grid, the scheduler's"):
        check_conflicts(parse_recipes(["turbo"]), explicit_scheduler=True, **common)
    # A recipe without a sampler of its own samples with the one asked for.
    check_conflicts(parse_recipes(["fasth3", "first-block-cache"]), explicit_sampler=True, **common)


def test_fasth3_v2_runs_a_generation_dense_then_vsa(engine, monkeypatch):
    bound = []
    for_layout = VsaSchedule.for_layout
    monkeypatch.setattr(VsaSchedule, "for_layout", lambda self, *a: bound.append(for_layout(self, *a)) or bound[-1])
    dit = engine.components.dit
    req = _req(width=64, height=64, frames=124, seed=1)
    result = engine.generate(apply_recipes(parse_recipes(["fasth3-v2"]), req, dit, "cpu", KernelSettings()))
    assert result.info["evaluations"] == 8 and (result.info["sampler"], result.info["scheduler"]) == (
        "res_multistep", "simple")
    vsa = bound[0].attention
    assert vsa.calls == vsa.gated_calls == 6 * dit.config.num_layers  # evaluations 3..8
    assert torch.isfinite(result.video_latents).all() and torch.isfinite(result.audio_latents).all()
