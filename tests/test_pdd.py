"""Recipe pdd: PDD LoRA files (trunk + head bank), the per-step head weights, the mixed heads and the sampling.

The weights are checked against fractions worked out by hand from the bank's grid g(j) = s*u / (1 + (s-1)*u),
u = 1 - j/32 (video s = 12: g(j) = 12(32-j) / (384-11j); audio s = 3: g(j) = 3(32-j) / (96-2j)), to 1e-12
(the boundaries are fp64; a step's fp32 ends snap to them). The mixed head against a plain fp64 mean of the
heads' outputs: rel L2 <= 1e-6 (fp32 einsum). A forward through the bank against forwards through each head:
rel L2 <= 1e-5 (the same trunk, fp32 heads).

ComfyUI's converted layout (block 0 a whole head, block j > 0 head j - head 0, flattened into `set_weight` /
`set_bias`) against the released file of the same seed: the heads bit-equal (fp32 offsets of bf16 heads subtract
and add back exactly here; in general head 0 + (head j - head 0) in fp32 is within 2^-24 (2|h_j| + |h_0|) of
h_j, checked on fp32 heads); block 0 and the offsets stored in bf16 within 2^-8 (|h_j - h_0| + |h_0|) +
2^-23 |h_j|. The merged trunk and the sampled velocities: rel L2 <= 1e-6 (bit-equal here; the fused qkv pair
multiplies through zero blocks).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.errors import CheckpointError, H3Error, InputError
from h3_spark.h3_model.checkpoint.lora import LoraSpec, apply_loras
from h3_spark.h3_model.checkpoint.pdd import has_head_bank, make_pdd_lora
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.head_bank import HeadBank, HeadMix
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.h3_model.engine.recipes import apply_recipes, check_recipes, parse_recipes, pdd_heads, recipe_sampling
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.h3_model.pipeline.pdd import PddHeads, interval_boundaries, interval_weights
from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
from h3_spark.h3_model.pipeline.scheduler import JointSchedule, Schedule, custom_sigmas
from oracle import rel_l2

HEADS = 32


def _video_delta(j):  # exact g(j) - g(j+1) for video (shift 12), as fractions of the hand computation
    return {0: 1 / 373, 1: 192 / 67513, 2: 64 / 21177, 3: 32 / 9945}[j]


def test_trained_grid_weights_are_the_delta_t_shares_worked_by_hand():
    mixes = PddHeads(HEADS).mixes(JointSchedule.create(9, 12.0, 3.0))  # what recipe pdd samples
    assert len(mixes) == 8
    # Step 0 spans video intervals 0..3: g = 1, 372/373, 180/181, 116/117, 84/85; the step is 1/85 long.
    want = [85 / 373, 85 * 192 / 67513, 85 * 64 / 21177, 85 * 32 / 9945]
    assert mixes[0].video[:4] == pytest.approx(want, abs=1e-12) and not any(mixes[0].video[4:])
    # The last step, 12/19 -> 0, spans 28..31: g = 12/19, 36/65, 4/9, 12/43, 0.
    want = [96 / 1235 * 19 / 12, 64 / 585 * 19 / 12, 64 / 387 * 19 / 12, 19 / 43]
    assert mixes[7].video[28:] == pytest.approx(want, abs=1e-12) and not any(mixes[7].video[:28])
    # Audio (shift 3), step 0: g = 1, 93/94, 45/46, 29/30, 21/22; the step is 1/22 long.
    assert mixes[0].audio[:4] == pytest.approx([11 / 47, 264 / 1081, 88 / 345, 4 / 15], abs=1e-12)
    for k, mix in enumerate(mixes):  # each of the 8 steps spans its own 4 whole intervals
        for weights in (mix.video, mix.audio):
            assert [j for j, w in enumerate(weights) if w] == list(range(4 * k, 4 * k + 4))
            assert sum(weights) == pytest.approx(1.0, abs=1e-12)
    four = PddHeads(HEADS).mixes(JointSchedule.create(5, 12.0, 3.0))  # pdd:evaluations=4: 8 heads a step
    assert [j for j, w in enumerate(four[1].video) if w] == list(range(8, 16))


def test_a_step_off_the_grid_weights_each_interval_by_its_overlap():
    video = interval_boundaries(HEADS, 12.0)
    first = interval_weights(1.0, 0.99, video)  # ends inside interval 3 (84/85 = 0.98824 < 0.99 < 116/117)
    want = [_video_delta(0) / 0.01, _video_delta(1) / 0.01, _video_delta(2) / 0.01, (116 / 117 - 0.99) / 0.01]
    assert first[:4] == pytest.approx(want, abs=1e-12) and not any(first[4:])
    second = interval_weights(0.99, 0.0, video)
    assert second[3] == pytest.approx((0.99 - 84 / 85) / 0.99, abs=1e-12) and not any(second[:3])
    assert second[31] == pytest.approx(12 / 43 / 0.99, abs=1e-12) and sum(second) == pytest.approx(1.0, abs=1e-12)
    # An fp32 end 3e-8 off a boundary is that boundary: no neighbouring head gets a sliver.
    assert sum(w > 0 for w in interval_weights(1.0, 84 / 85 + 3e-8, video)) == 4
    mixes = PddHeads(HEADS).mixes(JointSchedule(Schedule(custom_sigmas([1.0, 0.99, 0.0])),
                                                Schedule(custom_sigmas([1.0, 0.5, 0.0]))))
    assert mixes[0].video[:4] == pytest.approx(want, rel=1e-5)  # the grid's fp32 0.99


def _bank(count=HEADS, config=TINY, seed=0):
    g = torch.Generator().manual_seed(seed)
    return HeadBank(torch.randn(count, config.video_patch_dim, config.hidden_size, generator=g),
                    torch.randn(count, config.video_patch_dim, generator=g),
                    torch.randn(count, config.audio_in_channels, config.hidden_size, generator=g),
                    torch.randn(count, config.audio_in_channels, generator=g))


def test_the_mixed_head_is_the_weighted_mean_of_the_heads_outputs():
    bank = _bank()
    mix = PddHeads(HEADS).mixes(JointSchedule.create(9, 12.0, 3.0))[2]
    h = torch.randn(37, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    video, audio = bank.mixed(mix)
    for head, weights, w, b in ((video, mix.video, bank.video_weight, bank.video_bias),
                                (audio, mix.audio, bank.audio_weight, bank.audio_bias)):
        reference = sum(wj * (h.double() @ w[j].double().T + b[j].double()) for j, wj in enumerate(weights))
        assert rel_l2(head(h), reference) <= 1e-6


def _forward_inputs(seed=1):
    lay = layout.build_t2va(torch.ones(5, dtype=torch.long), 3, 4, 4, 6, TINY.patch_size)
    gen = torch.Generator().manual_seed(seed)
    ts, idx = lay.row_timesteps(0.3, 0.6, 0.999)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen),
                timestep=ts, timestep_indices=idx, token_tags=lay.token_tags, position_ids=lay.position_ids.float(),
                video_indices=lay.video_indices, audio_indices=lay.audio_indices, text_indices=lay.text_indices)


@torch.no_grad()
def test_the_forward_with_a_head_mix_runs_the_banks_heads():
    torch.manual_seed(0)
    model = H3DiT(TINY).eval()
    model.head_bank = _bank(count=4)
    args = _forward_inputs()
    plain = model(**args)
    one_hot = model(**args, head_mix=HeadMix((0, 0, 1.0, 0), (0, 1.0, 0, 0)))
    # Head 2 (video) and head 1 (audio) as the DiT's own heads give the same velocities, bit for bit.
    swapped = H3DiT(TINY).eval()
    swapped.load_state_dict(model.state_dict())
    swapped.proj_out.weight.copy_(model.head_bank.video_weight[2])
    swapped.proj_out.bias.copy_(model.head_bank.video_bias[2])
    swapped.audio_proj_out.weight.copy_(model.head_bank.audio_weight[1])
    swapped.audio_proj_out.bias.copy_(model.head_bank.audio_bias[1])
    assert all(torch.equal(a, b) for a, b in zip(one_hot, swapped(**args)))
    assert not torch.equal(one_hot[0], plain[0])
    weights = (0.1, 0.2, 0.3, 0.4)
    mixed = model(**args, head_mix=HeadMix(weights, weights[::-1]))
    singles = [model(**args, head_mix=HeadMix(tuple(float(i == j) for i in range(4)),
                                              tuple(float(i == 3 - j) for i in range(4)))) for j in range(4)]
    for m in (0, 1):
        assert rel_l2(mixed[m], sum(w * s[m].double() for w, s in zip(weights, singles))) <= 1e-5
    with pytest.raises(H3Error, match="a head mix of 3 weights for a bank of 4 heads"):
        model(**args, head_mix=HeadMix((0.5, 0.5, 0), (1.0, 0, 0)))
    model.head_bank = None
    with pytest.raises(H3Error, match="a per-step head mix needs a head bank on the DiT"):
        model(**args, head_mix=HeadMix(weights, weights))


@pytest.fixture(scope="module")
def pdd_file(tmp_path_factory):
    """A synthetic PDD LoRA for the tiny DiT, made by make-checkpoint's own command."""
    from h3_spark.cli import main

    out = tmp_path_factory.mktemp("pdd") / "pdd-tiny.safetensors"
    assert main(["make-checkpoint", str(out), "--component", "pdd", "--preset", "tiny", "--seed", "3"]) == 0
    return out


@pytest.fixture(scope="module")
def comfy_pdd_file(tmp_path_factory):
    """The same seed's file as ComfyUI's converted layout, by make-checkpoint's own command."""
    from h3_spark.cli import main

    out = tmp_path_factory.mktemp("pdd") / "pdd-tiny-comfy.safetensors"
    assert main(["make-checkpoint", str(out), "--component", "pdd", "--layout", "comfy", "--seed", "3"]) == 0
    return out


def test_make_checkpoint_writes_the_published_names_and_shapes(pdd_file):
    with safe_open(str(pdd_file), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        dtypes = {f.get_tensor(k).dtype for k in keys}
    # 2 blocks x 7 pairs + 2 refiner blocks x 6 pairs, and the 4 bank tensors (728 at full size: 50 x 7 + 2 x 6).
    assert len(keys) == 2 * (2 * 7 + 2 * 6) + 4 and dtypes == {torch.bfloat16}
    assert shapes["proj_out.weight"] == (32, 16, 24) and shapes["proj_out.bias"] == (32, 16)
    assert shapes["audio_proj_out.weight"] == (32, 8, 24) and shapes["audio_proj_out.bias"] == (32, 8)
    assert shapes["transformer_blocks.1.adaln_proj.linear.lora_down"] == (4, 16)
    assert shapes["token_refiner.refiner_blocks.0.ff.net.0.proj.lora_up"] == (128, 4)
    assert "token_refiner.refiner_blocks.0.adaln_proj.linear.lora_down" not in keys
    assert (meta["pdd_num_steps"], meta["pdd_block_size"], meta["lora_rank"], meta["lora_alpha"]) == \
        ("32", "4", "4", "4.0")
    assert has_head_bank(pdd_file)


def test_a_pdd_lora_merges_its_trunk_and_installs_its_bank(pdd_file):
    torch.manual_seed(0)
    model = H3DiT(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = apply_loras(model, [LoraSpec(pdd_file)])[0]
    assert report["merged"] == 26 and report["head_bank"] == 32
    with safe_open(str(pdd_file), framework="pt") as f:
        t = {k: f.get_tensor(k).float() for k in f.keys()}
    params = dict(model.named_parameters())
    for layer in ("transformer_blocks.1.adaln_proj.linear", "token_refiner.refiner_blocks.0.ff.net.0.proj"):
        expected = before[f"{layer}.weight"] + 1.0 * (t[f"{layer}.lora_up"] @ t[f"{layer}.lora_down"])  # alpha 4/rank 4
        assert rel_l2(params[f"{layer}.weight"], expected) <= 1e-6
    assert torch.equal(params["proj_out.weight"], before["proj_out.weight"])  # the DiT's own heads stay
    assert torch.equal(model.head_bank.video_weight, t["proj_out.weight"])
    assert torch.equal(model.head_bank.audio_bias, t["audio_proj_out.bias"])


def _edited(tmp_path, pdd_file, name="bad.safetensors", drop=(), meta=None, **tensors):
    with safe_open(str(pdd_file), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        metadata = {**f.metadata(), **(meta or {})}
    t.update(tensors)
    path = tmp_path / name
    save_file(t, str(path), metadata)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda: dict(**{k: torch.randn(31, *s) for k, s in (("proj_out.weight", (16, 24)), ("proj_out.bias", (16,)),
                                                          ("audio_proj_out.weight", (8, 24)),
                                                          ("audio_proj_out.bias", (8,)))}),
     "the head bank holds 31 heads, but its metadata pdd_num_steps says 32"),
    (lambda: {"audio_proj_out.weight": torch.randn(31, 8, 24)},
     "the head bank's tensors disagree on the head count: proj_out.weight 32, proj_out.bias 32, "
     "audio_proj_out.weight 31, audio_proj_out.bias 32"),
    (lambda: {"proj_out.weight": torch.randn(32, 15, 24)},
     "proj_out.weight [32, 15, 24] does not fit this DiT's video head: [32, 16, 24] (32 heads of 16 outputs)"),
    (lambda: {"audio_proj_out.bias": torch.randn(32, 9)},
     "audio_proj_out.bias [32, 9] does not fit this DiT's audio head: [32, 8] (32 heads of 8 outputs)"),
    (lambda: {"proj_out.weight": torch.randn(32, 16, 48), "audio_proj_out.weight": torch.randn(32, 8, 48)},
     "the head bank is for a DiT of width 48 (proj_out.weight [32, 16, 48]), and this DiT is 24 wide"),
    (lambda: {"__drop__": ("audio_proj_out.bias",)},
     "a PDD head bank needs proj_out.weight, proj_out.bias, audio_proj_out.weight, audio_proj_out.bias; "
     "it lacks audio_proj_out.bias"),
    (lambda: {"__meta__": {"pdd_num_steps": "thirty-two"}},
     "metadata pdd_num_steps='thirty-two' is not a whole number"),
])
def test_a_bank_that_does_not_fit_the_dit_is_refused_before_any_weight_changes(tmp_path, pdd_file, edit, message):
    change = edit()
    path = _edited(tmp_path, pdd_file, drop=change.pop("__drop__", ()), meta=change.pop("__meta__", None), **change)
    model = H3DiT(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as err:
        apply_loras(model, [LoraSpec(path)])
    assert str(err.value) == f"{path}: {message}"
    assert model.head_bank is None and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_bank_without_metadata_must_hold_the_published_32_heads(tmp_path, pdd_file):
    bank = {k: torch.randn(16, *s) for k, s in (("proj_out.weight", (16, 24)), ("proj_out.bias", (16,)),
                                                ("audio_proj_out.weight", (8, 24)), ("audio_proj_out.bias", (8,)))}
    path = tmp_path / "bare.safetensors"
    save_file(bank, str(path))
    with pytest.raises(CheckpointError, match=r"holds 16 heads, but PDD banks hold 32 \(one per interval"):
        apply_loras(H3DiT(TINY), [LoraSpec(path)])


def test_one_bank_per_dit_at_strength_one(tmp_path, pdd_file):
    other = _edited(tmp_path, pdd_file, name="other.safetensors")
    with pytest.raises(CheckpointError, match=f"{pdd_file} and {other} both carry a PDD head bank: load one PDD LoRA"):
        apply_loras(H3DiT(TINY), [LoraSpec(pdd_file), LoraSpec(other)])
    with pytest.raises(InputError, match=r"a PDD LoRA \(it carries a head bank\) runs at strength 1, got 0.5"):
        apply_loras(H3DiT(TINY), [LoraSpec(pdd_file, 0.5)])
    with pytest.raises(InputError, match=r"runs at strength 1, got 0.5"):
        check_recipes(parse_recipes(["pdd"]), "cpu", None, loras=[LoraSpec(pdd_file, 0.5)])


def test_recipe_pdd_sets_the_trained_grid_and_refuses_what_conflicts(tmp_path, pdd_file):
    run = recipe_sampling(parse_recipes(["pdd"]), 49)
    assert (run.evaluations, run.video_shift, run.audio_shift, run.grid_from) == (8, 12.0, 3.0, "pdd")
    assert recipe_sampling(parse_recipes(["pdd:evaluations=4"]), 49).evaluations == 4
    assert parse_recipes(["pdd"])[0].describe() == {"name": "pdd", "evaluations": 8, "video_shift": 12.0,
                                                     "audio_shift": 3.0}
    cases = [(["pdd:evaluations=6"], {}, "recipe pdd: evaluations must be 4 or 8 (each then spans whole intervals "
                                         "of the bank), got 6"),
             (["pdd", "turbo"], {}, "recipes pdd and turbo both set the sampling grid: choose one"),
             (["pdd"], {"explicit_steps": True}, "recipe pdd sets the steps and the shifts its head bank was trained "
                                                 "for: drop --steps / --sigmas")]
    for texts, flags, message in cases:
        with pytest.raises(InputError) as err:
            check_recipes(parse_recipes(texts), "cpu", None, loras=[LoraSpec(pdd_file)], **flags)
        assert str(err.value) == message
    plain = tmp_path / "plain.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_down": torch.randn(2, 24),
               "transformer_blocks.0.attn.to_q.lora_up": torch.randn(32, 2)}, str(plain))
    with pytest.raises(InputError) as err:  # before loading: read from the files' headers
        check_recipes(parse_recipes(["pdd"]), "cpu", None, loras=[LoraSpec(plain)])
    assert str(err.value) == ("recipe pdd samples through a PDD LoRA's head bank (proj_out.weight [32, 96, 5376] and "
                              "its audio twin), and no LoRA carries one (LoRAs: plain.safetensors): load the PDD file "
                              "as a LoRA")
    with pytest.raises(InputError, match=f"{pdd_file} is a PDD LoRA \\(it carries a head bank\\): sample it with "
                                         "recipe pdd"):
        check_recipes([], "cpu", None, loras=[(str(pdd_file), 1.0)])
    with pytest.raises(InputError, match="no such LoRA file"):
        check_recipes(parse_recipes(["pdd"]), "cpu", None, loras=[LoraSpec(tmp_path / "gone.safetensors")])


def _sampling(model, **kwargs):
    lay = layout.build_t2va(torch.ones(5, dtype=torch.long), 3, 4, 4, 6, TINY.patch_size)
    req = SamplingRequest(lay, torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(2)), 3, 4, 4, 6)
    return sample(model, req, JointSchedule.create(9, 12.0, 3.0), torch.Generator().manual_seed(5), **kwargs)


def test_the_sampler_gives_each_step_its_mix_and_refuses_a_bank_without_the_recipe(pdd_file, monkeypatch):
    torch.manual_seed(0)
    model = H3DiT(TINY).eval()
    with pytest.raises(InputError, match="recipe pdd samples through a PDD LoRA's head bank, and the loaded DiT has "
                                         "none: load the PDD file as a LoRA"):
        apply_recipes(parse_recipes(["pdd"]), GenerationRequest(mode="t2va", prompt="x"), model, "cpu", None)
    with pytest.raises(InputError, match="and the DiT has none"):
        _sampling(model, head_schedule=PddHeads(HEADS))
    apply_loras(model, [LoraSpec(pdd_file)])
    with pytest.raises(InputError) as err:
        _sampling(model)
    assert str(err.value) == (f"the DiT carries a PDD head bank ({pdd_file}): sample it with recipe pdd, or load it "
                              "without that LoRA")
    seen = []
    mixed = HeadBank.mixed
    monkeypatch.setattr(HeadBank, "mixed", lambda self, mix: seen.append(mix) or mixed(self, mix))
    req = apply_recipes(parse_recipes(["pdd"]), GenerationRequest(mode="t2va", prompt="x"), model, "cpu", None)
    assert (req.steps, req.video_shift, req.audio_shift, req.head_schedule) == (9, 12.0, 3.0, PddHeads(HEADS))
    _sampling(model, head_schedule=req.head_schedule)
    assert seen == PddHeads(HEADS).mixes(JointSchedule.create(9, 12.0, 3.0))


def test_generate_recipe_pdd_runs_eight_steps_through_the_real_loaders(demo_models, pdd_file, comfy_pdd_file,
                                                                       tmp_path, capsys, monkeypatch):
    """Both layouts of one seed, through generate: the same steps, and the same velocities out of the heads."""
    from h3_spark.cli import main
    from h3_spark.h3_model.dit.head_bank import MixedHead

    pytest.importorskip("av")
    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    steps, velocities = [], []
    mixed, call = HeadBank.mixed, MixedHead.__call__
    monkeypatch.setattr(HeadBank, "mixed", lambda self, mix: steps.append(mix) or mixed(self, mix))
    monkeypatch.setattr(MixedHead, "__call__", lambda self, x: velocities.append(call(self, x)) or velocities[-1])
    runs = {}
    for name, lora in (("released", pdd_file), ("comfy", comfy_pdd_file)):
        steps.clear(), velocities.clear()
        out = tmp_path / f"pdd-{name}.mp4"
        code = main(["generate", "--demo-dir", str(demo_models), "--width", "64", "--height", "64", "--out", str(out),
                     "--recipe", "pdd", "--lora", str(lora)])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        summary = json.loads(cap.out.strip().splitlines()[-1])
        assert (summary["evaluations"], summary["video_shift"], summary["audio_shift"]) == (8, 12.0, 3.0)
        assert summary["recipes"] == [{"name": "pdd", "evaluations": 8, "video_shift": 12.0, "audio_shift": 3.0}]
        assert "recipe pdd" in summary["approximate_paths"] and out.is_file()
        assert steps == PddHeads(HEADS).mixes(JointSchedule.create(9, 12.0, 3.0))
        runs[name] = list(velocities)
    assert len(runs["comfy"]) == len(runs["released"]) == 16  # 8 steps x (video, audio)
    for a, b in zip(runs["comfy"], runs["released"]):
        assert rel_l2(a, b) <= 1e-6


def test_make_checkpoint_pdd_errors(tmp_path, capsys):
    from h3_spark.cli import main

    for argv, message in (([str(tmp_path / "p.safetensors"), "--format", "nvfp4"], "--component pdd takes only "
                           "--preset, --layout released|comfy, --seed and --force"),
                          ([str(tmp_path / "p.safetensors"), "--layout", "diffusers"], "--component pdd takes only "
                           "--preset, --layout released|comfy, --seed and --force"),
                          ([str(tmp_path / "p.gguf")], "a PDD LoRA is one file; give a path ending in .safetensors")):
        assert main(["make-checkpoint", *argv, "--component", "pdd"]) == 2
        assert message in capsys.readouterr().err


def test_make_pdd_lora_writes_a_full_size_header(tmp_path, monkeypatch):
    """The full preset's names and shapes (the header only: the 1.3 GB of values are not drawn here)."""
    from h3_spark.h3_model.checkpoint import pdd
    from h3_spark.h3_model.dit.config import FULL

    written = {}
    monkeypatch.setattr(pdd, "write_groups", lambda path, groups, metadata, progress: written.update(
        {name: shape for g in groups for name, _, shape in g.entries}) or 0)
    make_pdd_lora(tmp_path / "full.safetensors", FULL, rank=64)
    assert len(written) == 728  # as published
    assert written["proj_out.weight"] == (32, 96, 5376) and written["audio_proj_out.bias"] == (32, 32)
    assert written["transformer_blocks.49.adaln_proj.linear.lora_up"] == (96768, 64)
    assert written["transformer_blocks.0.attn.to_q.lora_down"] == (64, 5376)


def test_the_dit_loses_its_bank_with_its_lora(pdd_file):
    from h3_spark.h3_model.engine.shared_dit import use_loras

    torch.manual_seed(0)
    model = H3DiT(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    use_loras(model, [(str(pdd_file), 1.0)])
    assert model.head_bank is not None and pdd_heads(parse_recipes(["pdd"]), model) == PddHeads(HEADS)
    use_loras(model, [])
    assert model.head_bank is None and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_original_names_and_prefixes_read_as_the_bank(tmp_path, pdd_file):
    """ComfyUI's names for the heads (final_layer.video_out / audio_out) under diffusion_model., 3-D as published."""
    with safe_open(str(pdd_file), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    renamed = {("diffusion_model." + k.replace("audio_proj_out", "final_layer.audio_out")
                .replace("proj_out", "final_layer.video_out") if "proj_out" in k else k): v for k, v in t.items()}
    path = tmp_path / "comfy-names.safetensors"
    save_file(renamed, str(path), meta)
    model = H3DiT(TINY)
    apply_loras(model, [LoraSpec(path)])
    assert torch.equal(model.head_bank.video_weight, t["proj_out.weight"].float())


def test_the_bank_is_held_in_buffers_outside_the_state_dict(pdd_file):
    """No LoRA target or kernel plan sees the bank (not a parameter), no checkpoint writer stores it (not
    persistent), and it moves with the model (a buffer)."""
    model = H3DiT(TINY)
    apply_loras(model, [LoraSpec(pdd_file)])
    assert not any(n.startswith("head_bank.") for n, _ in model.named_parameters())
    assert not any(n.startswith("head_bank.") for n in model.state_dict())
    assert {n for n, _ in model.named_buffers() if n.startswith("head_bank.")} == {
        "head_bank.video_weight", "head_bank.video_bias", "head_bank.audio_weight", "head_bank.audio_bias"}


# ------------------------------------------------------------------------------ ComfyUI's converted layout
def _tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_the_converted_file_holds_head_0_and_offsets_on_comfyuis_names(comfy_pdd_file, pdd_file):
    t, meta = _tensors(comfy_pdd_file)
    released, _ = _tensors(pdd_file)
    bank = "diffusion_model.final_layer."
    assert {k: tuple(v.shape) for k, v in t.items() if k.startswith(bank)} == {
        bank + "video_out.set_weight": (32 * 16, 24), bank + "video_out.set_bias": (32 * 16,),
        bank + "audio_out.set_weight": (32 * 8, 24), bank + "audio_out.set_bias": (32 * 8,)}
    assert {t[k].dtype for k in t if k.startswith(bank)} == {torch.float32}
    # 2 blocks x (qkv_proj, out_proj, fc1, fc2, adaln_proj.linear) + 2 refiner blocks x 4, each A, B and alpha.
    assert len(t) == 3 * (2 * 5 + 2 * 4) + 4 and (meta["pdd_num_steps"], meta["pdd_block_size"]) == ("32", "4")
    qkv = "diffusion_model.blocks.1.attn.qkv_proj"
    assert t[f"{qkv}.lora_A.weight"].shape == (12, 24) and t[f"{qkv}.lora_B.weight"].shape == (96, 12)
    assert float(t[f"{qkv}.alpha"]) == 12.0 and float(t["diffusion_model.token_refiner.blocks.0.mlp.fc1.alpha"]) == 4.0
    assert has_head_bank(comfy_pdd_file)
    # ComfyUI's rule, worked here: head 0 is block 0, head j is block 0 + block j, in fp32.
    for flat, heads, outputs in (("video_out.set_weight", "proj_out.weight", 16),
                                 ("audio_out.set_bias", "audio_proj_out.bias", 8)):
        blocks = t[bank + flat].reshape(32, outputs, *t[bank + flat].shape[1:])
        want = released[heads].float()
        assert torch.equal(blocks[0], want[0])
        assert all(torch.equal(blocks[0] + blocks[j], want[j]) for j in range(1, 32))


def test_the_converted_file_reads_as_the_released_one(comfy_pdd_file, pdd_file):
    torch.manual_seed(0)
    released = H3DiT(TINY)
    comfy = H3DiT(TINY)
    comfy.load_state_dict(released.state_dict())
    report = apply_loras(comfy, [LoraSpec(comfy_pdd_file)])[0]
    apply_loras(released, [LoraSpec(pdd_file)])
    assert report["merged"] == 26 and report["head_bank"] == 32  # q, k and v of one fused pair: 26 deltas
    for name in ("video_weight", "video_bias", "audio_weight", "audio_bias"):
        assert torch.equal(getattr(comfy.head_bank, name), getattr(released.head_bank, name)), name
    ours = dict(comfy.named_parameters())
    for name, p in released.named_parameters():
        assert rel_l2(ours[name], p) <= 1e-6, name
    check_recipes(parse_recipes(["pdd"]), "cpu", None, loras=[LoraSpec(comfy_pdd_file)])  # told from its header
    a = _sampling(released.eval(), head_schedule=PddHeads(HEADS))
    b = _sampling(comfy.eval(), head_schedule=PddHeads(HEADS))
    assert rel_l2(b.video_latents, a.video_latents) <= 1e-6 and rel_l2(b.audio_latents, a.audio_latents) <= 1e-6


def test_offsets_add_back_to_the_heads_within_the_fp32_and_bf16_bounds():
    from h3_spark.h3_model.checkpoint.pdd import offset_blocks, whole_heads

    heads = torch.randn(32, 16, 24, generator=torch.Generator().manual_seed(4)) * torch.logspace(-6, 0, 24)
    back = whole_heads(offset_blocks(heads))
    assert torch.equal(back[0], heads[0])
    bound = 2.0 ** -24 * (2 * heads.abs() + heads[:1].abs())
    assert ((back - heads).abs() <= bound).all()
    assert not torch.equal(back, heads)  # fp32 heads of spread magnitudes do not all come back bit for bit
    stored = whole_heads(offset_blocks(heads).bfloat16())  # a converted file that kept its offsets in bf16
    bound = 2.0 ** -8 * ((heads - heads[:1]).abs() + heads[:1].abs()) + 2.0 ** -23 * heads.abs()
    assert ((stored - heads).abs() <= bound).all() and rel_l2(stored, heads) > 1e-4


def _converted(tmp_path, comfy_pdd_file, name="bad.safetensors", drop=(), meta=None, **tensors):
    t, metadata = _tensors(comfy_pdd_file)
    t = {k: v for k, v in t.items() if k not in drop}
    t.update({f"diffusion_model.final_layer.{k.replace('__', '.')}": v for k, v in tensors.items()})
    path = tmp_path / name
    save_file(t, str(path), {**metadata, **(meta or {})})
    return path


_V, _A = "diffusion_model.final_layer.video_out", "diffusion_model.final_layer.audio_out"


@pytest.mark.parametrize("edit, message", [
    (dict(video_out__set_weight=torch.randn(32 * 16 + 3, 24)),
     f"{_V}.set_weight [515, 24] is not a whole number of this DiT's video heads (515 rows, 16 per head)"),
    (dict(audio_out__set_bias=torch.randn(32 * 8 - 1)),
     f"{_A}.set_bias [255] is not a whole number of this DiT's audio heads (255 rows, 8 per head)"),
    (dict(video_out__set_weight=torch.randn(512, 48), audio_out__set_weight=torch.randn(256, 48)),
     f"the head bank is for a DiT of width 48 ({_V}.set_weight [512, 48]), and this DiT is 24 wide"),
    (dict(audio_out__set_weight=torch.randn(31 * 8, 24), audio_out__set_bias=torch.randn(31 * 8)),
     f"the head bank's tensors disagree on the head count: {_V}.set_weight 32, {_V}.set_bias 32, "
     f"{_A}.set_weight 31, {_A}.set_bias 31"),
    (dict(video_out__set_weight=torch.randn(16 * 16, 24), video_out__set_bias=torch.randn(16 * 16),
          audio_out__set_weight=torch.randn(16 * 8, 24), audio_out__set_bias=torch.randn(16 * 8)),
     "the head bank holds 16 heads, but its metadata pdd_num_steps says 32"),
    (dict(__drop__=(f"{_A}.set_bias",)),
     f"a PDD head bank needs {_V}.set_weight, {_V}.set_bias, {_A}.set_weight, {_A}.set_bias; it lacks {_A}.set_bias"),
    (dict(__drop__=(f"{_V}.set_weight",), **{"proj_out.weight": torch.randn(32, 16, 24)}),
     "the head bank mixes the released layout (proj_out.weight, proj_out.bias, audio_proj_out.weight, "
     "audio_proj_out.bias) with ComfyUI's flattened one (final_layer.video_out.set_weight, "
     "final_layer.video_out.set_bias, final_layer.audio_out.set_weight, final_layer.audio_out.set_bias): a file "
     "holds one"),
])
def test_a_converted_bank_that_does_not_fit_is_refused_before_any_weight_changes(tmp_path, comfy_pdd_file, edit,
                                                                                 message):
    edit = dict(edit)
    drop = edit.pop("__drop__", ())
    released = {k: edit.pop(k) for k in list(edit) if k.startswith("proj_out")}
    path = _converted(tmp_path, comfy_pdd_file, drop=drop, **edit)
    if released:
        t, meta = _tensors(path)
        save_file({**t, **released}, str(path), meta)
    model = H3DiT(TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as err:
        apply_loras(model, [LoraSpec(path)])
    assert str(err.value) == f"{path}: {message}"
    assert model.head_bank is None and all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_single_head_set_weight_is_not_a_bank(tmp_path):
    """ComfyUI treats a one-head set_weight as a plain head; we do not replace heads: it is refused as a bank of 1."""
    path = tmp_path / "one-head.safetensors"
    save_file({f"{_V}.set_weight": torch.randn(16, 24), f"{_V}.set_bias": torch.randn(16),
               f"{_A}.set_weight": torch.randn(8, 24), f"{_A}.set_bias": torch.randn(8)}, str(path))
    with pytest.raises(CheckpointError) as err:
        apply_loras(H3DiT(TINY), [LoraSpec(path)])
    assert str(err.value) == (f"{path}: the head bank holds 1 heads, but PDD banks hold 32 (one per interval of the "
                              "trained grid)")


def test_make_pdd_lora_writes_a_full_size_converted_header(tmp_path, monkeypatch):
    from h3_spark.h3_model.checkpoint import pdd
    from h3_spark.h3_model.dit.config import FULL

    written = {}
    monkeypatch.setattr(pdd, "write_groups", lambda path, groups, metadata, progress: written.update(
        {name: (dtype, shape) for g in groups for name, dtype, shape in g.entries}) or 0)
    make_pdd_lora(tmp_path / "full.safetensors", FULL, rank=64, layout="comfy")
    assert len(written) == 3 * (50 * 5 + 2 * 4) + 4
    assert written[f"{_V}.set_weight"] == ("F32", (32 * 96, 5376)) and written[f"{_A}.set_bias"] == ("F32", (32 * 32,))
    assert written["diffusion_model.blocks.49.attn.qkv_proj.lora_B.weight"] == ("BF16", (3 * 7168, 192))
    assert written["diffusion_model.token_refiner.blocks.1.mlp.fc2.lora_A.weight"] == ("BF16", (64, 14336))
    with pytest.raises(InputError, match="a PDD LoRA is written in the released or comfy layout, not diffusers"):
        make_pdd_lora(tmp_path / "x.safetensors", FULL, rank=64, layout="diffusers")
