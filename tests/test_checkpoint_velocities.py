"""Velocities of every stored format and layout against the fp32 model the files were made from.

The "fp32 original" is `random_state(TINY, seed)` loaded into an fp32 H3DiT; make-checkpoint
stores that model. Inputs: an FL2VA layout (text, a keyframe, audio, video), at the timesteps of a
9-point joint schedule. Budgets are relative L2 over video and audio velocities (measured on this
tiny model in brackets; the bf16 storage of the unquantized layers is in every number):
- layout change (comfy vs diffusers, bf16): bit-identical velocities;
- bf16 <= 5e-3 [2.1e-3]; int8_convrot <= 5e-3 [2.1e-3]; fp8_scaled <= 1e-2 [3.3e-3];
  nvfp4 <= 3e-2 [9.4e-3];
- pruned (curve form, fitted in fp32 with a [33, 4] table) vs full AdaLN, both fp32:
  <= 2e-5 at the schedule's timesteps [2.4e-6], <= 5e-6 at grid points [6.3e-7];
  the pruned file stores exactly that fit.
"""

import pytest
import torch

from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.checkpoint import load_dit, open_dit, pruned
from h3_spark.h3_model.checkpoint.make import CURVE_DEFAULTS, curve_fit_for, make_dit_checkpoint, pruned_config
from h3_spark.h3_model.checkpoint.synthetic import random_state
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.model import H3DiT
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from oracle import rel_l2, text_tags

SEED = 11
BUDGET = {"bf16": 5e-3, "int8_convrot": 5e-3, "fp8_scaled": 1e-2, "nvfp4": 3e-2}
PRUNED_SCHEDULE_TOL = 2e-5
PRUNED_GRID_TOL = 5e-6


@pytest.fixture(scope="module")
def lay():
    return layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))


@pytest.fixture(scope="module")
def inputs(lay):
    gen = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen),
                token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                audio_indices=lay.audio_indices, text_indices=lay.text_indices)


def _timesteps(lay, steps=9):
    sched = JointSchedule.create(steps)
    for i in range(len(sched)):
        tv, ta = sched.step_timesteps(i)
        yield lay.row_timesteps(tv, ta, max(tv, 0.999))


def _velocities(model, inputs, lay, timesteps=None):
    out = []
    with torch.no_grad():
        for ts, idx in timesteps or _timesteps(lay):
            out.append(model(**inputs, timestep=ts, timestep_indices=idx))
    return out


def _worst(a, b):
    return max(max(rel_l2(v1, v0), rel_l2(a1, a0)) for (v1, a1), (v0, a0) in zip(a, b))


@pytest.fixture(scope="module")
def original():
    model = H3DiT(TINY, device="meta")
    model.load_state(random_state(TINY, SEED), device="cpu")
    return model.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("velocities")
    out = {("diffusers", "bf16"): root / "diffusers"}
    make_dit_checkpoint(out[("diffusers", "bf16")], TINY, "bf16", "diffusers", seed=SEED)
    for fmt in BUDGET:
        for lay_name in ("comfy", "comfy-pruned"):
            out[(lay_name, fmt)] = root / f"{lay_name}-{fmt}.safetensors"
            make_dit_checkpoint(out[(lay_name, fmt)], TINY, fmt, lay_name, seed=SEED, curve=CURVE_DEFAULTS["tiny"])
    return out


def test_layout_change_is_exact(files, inputs, lay):
    comfy = load_dit(files[("comfy", "bf16")])
    diffusers = load_dit(files[("diffusers", "bf16")])
    for (v1, a1), (v0, a0) in zip(_velocities(comfy, inputs, lay), _velocities(diffusers, inputs, lay)):
        assert torch.equal(v1, v0) and torch.equal(a1, a0)


@pytest.mark.parametrize("fmt", list(BUDGET))
def test_format_velocities_within_budget(files, original, inputs, lay, fmt):
    reference = _velocities(original, inputs, lay)
    loaded = load_dit(files[("comfy", fmt)])
    err = _worst(_velocities(loaded, inputs, lay), reference)
    assert err <= BUDGET[fmt], f"{fmt}: rel L2 {err:.2e} > {BUDGET[fmt]:.0e}"
    # Loading in bf16 runs too (the dequantized weights are cast once, at load).
    bf16 = load_dit(files[("comfy", fmt)], dtype=torch.bfloat16)
    assert _worst(_velocities(bf16, inputs, lay), reference) < 0.1


def _fitted_pruned_model(fit) -> H3DiT:
    """The fp32 curve-form model: the original with every AdaLN projection fitted, no storage rounding."""
    full = dict(random_state(TINY, SEED))

    def tensors():
        for name, t in full.items():
            if name.startswith("time_embedder.") or name.endswith("adaln_proj.linear.bias") \
                    or name == "norm_out.linear.bias":
                continue  # the time MLP is gone; biases are emitted with their weights
            if name.endswith("adaln_proj.linear.weight") or name == "norm_out.linear.weight":
                bias = name[: -len("weight")] + "bias"
                w, b = pruned.project(t, full[bias], fit)
                yield name, w
                yield bias, b
            else:
                yield name, t
        yield "adaln_t_table", fit.table

    grid, rank = CURVE_DEFAULTS["tiny"]
    model = H3DiT(pruned_config(TINY, grid, rank), device="meta")
    model.load_state(tensors(), device="cpu")
    return model.eval()


def test_pruned_matches_full_adaln(files, original, inputs, lay):
    grid, rank = CURVE_DEFAULTS["tiny"]
    fit = curve_fit_for(TINY, SEED, grid, rank)
    fitted = _fitted_pruned_model(fit)
    err = _worst(_velocities(fitted, inputs, lay), _velocities(original, inputs, lay))
    assert err <= PRUNED_SCHEDULE_TOL, f"schedule timesteps: {err:.2e}"
    on_grid = [(torch.tensor([i / (grid - 1)]), torch.zeros(lay.sequence_length, dtype=torch.long))
               for i in range(0, grid, 4)]
    err = _worst(_velocities(fitted, inputs, lay, on_grid), _velocities(original, inputs, lay, on_grid))
    assert err <= PRUNED_GRID_TOL, f"grid points: {err:.2e}"
    # The pruned file stores exactly this fit (table and AdaLN in fp32), whatever the block format.
    for fmt in BUDGET:
        loaded = load_dit(files[("comfy-pruned", fmt)])
        assert torch.equal(loaded.adaln_t_table, fitted.adaln_t_table)
        for i, block in enumerate(loaded.transformer_blocks):
            assert torch.equal(block.adaln_proj.linear.weight, fitted.transformer_blocks[i].adaln_proj.linear.weight)
            assert torch.equal(block.adaln_proj.linear.bias, fitted.transformer_blocks[i].adaln_proj.linear.bias)
        assert torch.equal(loaded.norm_out.linear.weight, fitted.norm_out.linear.weight)
    # And the pruned bf16 file runs as close to the original as the full bf16 file does.
    pruned_bf16 = load_dit(files[("comfy-pruned", "bf16")])
    assert _worst(_velocities(pruned_bf16, inputs, lay), _velocities(original, inputs, lay)) <= BUDGET["bf16"]


def test_pruned_reader_reports_curve_form(files):
    reader = open_dit(files[("comfy-pruned", "nvfp4")])
    assert reader.detected.layout == "comfy-pruned"
    assert reader.config.adaln_curve_grid == 33 and reader.config.time_embed_dim == 4
    assert {s.label for s in reader.quantized_layers().values()} == {"nvfp4"}
