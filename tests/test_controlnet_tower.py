"""The ControlNet tower inside the DiT's one forward, against a plain-PyTorch reference written from the model
card's description (the whole control stack runs first over the block-0 input, its skips are added after the named
DiT layers), on tiny random weights.

Tolerance: fp32 everywhere; the tower interleaves its blocks with the DiT's and adds skip * keep with `alpha` where
the reference adds strength * skip, which changes rounding only: rel L2 <= 1e-5.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.controlnet.tower import (ControlInjection, ControlTower, config_for, percent_to_sigma,
                                                spread)
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import ADALN_VECTORS, TINY
from h3_spark.h3_model.dit.layout import ImageBlock, adaln_rows
from h3_spark.h3_model.dit.model import H3DiT, apply_rope
from h3_spark.h3_model.pipeline.scheduler import CONDITION_VIDEO_T
from h3_spark.kernels.references import RowModulation
from oracle import rel_l2, text_tags

TOL = 1e-5
DIT = dataclasses.replace(TINY, num_layers=4)
CURVE = dataclasses.replace(DIT, adaln_curve_grid=9, time_embed_dim=8)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _dit(config, seed=1):
    model = H3DiT(config).eval()
    _randomize(model, seed)
    return model


def _tower(config, places=(0, 2), seed=2):
    tower = ControlTower(config_for(config, len(places), places=places), dtype=torch.float32).eval()
    _randomize(tower, seed)  # after_proj / before_proj random, not the zeros a fresh training run starts from
    return tower


@pytest.fixture(scope="module")
def case():
    lay = layout.build_ref2va(text_tags(6, (1, 3)), [ImageBlock(2, 4)], 3, 4, 6, 5)
    gen = torch.Generator().manual_seed(7)
    n_target = lay.video_indices.numel() - lay.num_condition_video_rows
    data = dict(
        hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
        audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
        encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen),
        token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
        audio_indices=lay.audio_indices, text_indices=lay.text_indices,
        output_video_rows=torch.arange(lay.num_condition_video_rows, lay.video_indices.numel()))
    hint = torch.randn(n_target, 49 * 4, generator=gen)
    return lay, data, hint


def _args(lay, data, t_video=0.3, t_audio=0.5):
    ts, idx = lay.row_timesteps(t_video, t_audio, max(t_video, CONDITION_VIDEO_T))
    return {**data, "timestep": ts, "timestep_indices": idx}


# ------------------------------------------------------------------------------------------ the reference
def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _ref_block(x, blk, table, rows, rope, heads, head_dim, eps, qk_eps):
    """One H3 block written out: AdaLN-modulated RMSNorm, QK-RMSNorm'd RoPE attention, SwiGLU, gated residuals."""
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (v[rows] for v in table.chunk(ADALN_VECTORS, dim=-1))
    h = _rms(x, blk.norm1.weight, eps) * (1 + scale_a) + shift_a
    b, s, _ = h.shape
    q, k, v = (F.linear(h, w).view(b, s, heads, head_dim) for w in
               (blk.attn.to_q.weight, blk.attn.to_k.weight, blk.attn.to_v.weight))
    q, k = _rms(q, blk.attn.norm_q.weight, qk_eps), _rms(k, blk.attn.norm_k.weight, qk_eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    x = x + gate_a * F.linear(o.reshape(b, s, -1), blk.attn.to_out[0].weight)
    h = _rms(x, blk.norm2.weight, eps) * (1 + scale_m) + shift_m
    value, gate = F.linear(h, blk.ff.net[0].proj.weight).chunk(2, dim=-1)
    return x + gate_m * F.linear(value * F.silu(gate), blk.ff.net[2].weight)


@torch.no_grad()
def reference(dit, tower, args, hint, strength):
    c = dit.config
    text = dit.encode_text(args["encoder_hidden_states"])
    x0 = dit.embed_rows(args["hidden_states"], args["audio_hidden_states"], text, args["video_indices"],
                        args["audio_indices"], args["text_indices"], args["position_ids"].shape[0])
    rope = dit.rope(args["position_ids"])
    rows = adaln_rows(args["timestep_indices"], args["token_tags"])
    a = dit.adaln_input(args["timestep"])
    # The control stack, all of it first (the card's order).
    hint_rows = torch.zeros(args["video_indices"].numel(), hint.shape[1])
    hint_rows[args["output_video_rows"]] = hint
    ctrl = x0.clone()
    ctrl[:, args["video_indices"]] = F.linear(hint_rows, tower.control_proj_in.weight, tower.control_proj_in.bias)
    first = tower.control_blocks[0]
    ctrl = F.linear(ctrl, first.before_proj.weight, first.before_proj.bias) + x0
    skips = []
    for blk in tower.control_blocks:
        table = F.linear(a, blk.adaln_proj.linear.weight, blk.adaln_proj.linear.bias).view(-1, 6 * c.hidden_size)
        ctrl = _ref_block(ctrl, blk, table, rows, rope, c.num_attention_heads, c.attention_head_dim, c.norm_eps,
                          c.qk_norm_eps)
        skip = F.linear(ctrl, blk.after_proj.weight, blk.after_proj.bias)
        skip[:, args["audio_indices"]] = 0
        skips.append(skip)
    # The DiT's stack with the skips added after the named layers.
    tables = dit.modulation(args["timestep"])
    mod = RowModulation(rows, True)
    x = x0
    for i, blk in enumerate(dit.transformer_blocks):
        x = blk(x, tables.blocks[i], mod, rope, dit.attention)
        if i in tower.config.places:
            x = x + strength * skips[tower.config.places.index(i)]
    return dit.heads(x, args["timestep_indices"], tables.final, args["video_indices"], args["audio_indices"],
                     args["output_video_rows"], None)


@pytest.mark.parametrize("config", [DIT, CURVE], ids=["full_adaln", "curve_adaln"])
@pytest.mark.parametrize("places", [(0, 2), (0, 1, 2, 3)], ids=["two_blocks", "every_layer"])
def test_tower_matches_the_reference(case, config, places):
    lay, data, hint = case
    dit, tower = _dit(config), _tower(config, places)
    args = _args(lay, data)
    dit.control = ControlInjection(tower, hint, strength=0.7)
    with torch.no_grad():
        got = dit(**args)
    want = reference(dit, tower, args, hint, 0.7)
    plain = _plain(dit, args)
    for g, w, p in zip(got, want, plain):
        assert rel_l2(g, w) <= TOL
        assert rel_l2(g, p) > 1e-3  # the control does change the output
    assert dit.control.evaluations == 1


def _plain(dit, args):
    control, dit.control = dit.control, None
    try:
        with torch.no_grad():
            return dit(**args)
    finally:
        dit.control = control


@pytest.mark.parametrize("strength,window,t_video", [
    (0.0, (0.0, 1.0), 0.3),  # strength 0
    (1.0, (0.5, 0.5), 0.3),  # an empty window
    (1.0, (0.6, 1.0), 0.02),  # the window starts later than this step (sigma 0.98 is above it)
    (1.0, (0.0, 0.2), 0.6),  # the window ended before this step
], ids=["strength0", "empty_window", "before_window", "after_window"])
def test_off_gives_the_uncontrolled_output_bit_for_bit(case, strength, window, t_video):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT)
    args = _args(lay, data, t_video)
    plain = _plain(dit, args)
    dit.control = ControlInjection(tower, hint, strength=strength, window=window, shift=3.0)
    with torch.no_grad():
        got = dit(**args)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert dit.control.evaluations == 0


def test_window_follows_the_shifted_sigma(case):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT)
    injection = ControlInjection(tower, hint, window=(0.0, 0.5), shift=3.0)
    sigma_end = percent_to_sigma(0.5, 3.0)
    assert sigma_end == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    assert injection.active(0.76) and injection.active(1.0) and not injection.active(0.74)
    dit.control = injection
    with torch.no_grad():
        dit(**_args(lay, data, 0.2))  # sigma 0.8: inside
        dit(**_args(lay, data, 0.3))  # sigma 0.7: outside
    assert injection.evaluations == 1


def test_audio_rows_take_no_skip(case):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT)
    args = _args(lay, data)
    dit.control = ControlInjection(tower, hint)
    runs = []
    begin = dit.control.begin

    def begin_spy(*a, **k):
        run = begin(*a, **k)
        after = run.after_block

        def after_spy(i, x, *rest):
            out = after(i, x, *rest)
            runs.append((i, x, out))
            return out

        run.after_block = after_spy
        return run

    dit.control.begin = begin_spy
    with torch.no_grad():
        dit(**args)
    audio, video = lay.audio_indices, lay.video_indices
    injected = [(i, x, out) for i, x, out in runs if i in tower.config.places]
    assert len(injected) == 2
    for _, before, after in injected:
        assert torch.equal(before[:, audio], after[:, audio])
        assert not torch.equal(before[:, video], after[:, video])


def test_precomputed_tables_survive_a_released_adaln(case):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT)
    args = _args(lay, data)
    dit.control = ControlInjection(tower, hint)
    with torch.no_grad():
        want = dit(**args)
        dit.precompute_modulation(args["timestep"].tolist())
        dit.release_adaln()
        got = dit(**args)
    assert rel_l2(got[0], want[0]) <= TOL and rel_l2(got[1], want[1]) <= TOL


def test_a_hint_for_another_canvas_is_refused(case):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT)
    dit.control = ControlInjection(tower, hint[:-1])
    with pytest.raises(InputError, match="the control hint has .* rows but the target video has"), torch.no_grad():
        dit(**_args(lay, data))


def test_bad_settings_are_refused():
    tower = _tower(DIT)
    with pytest.raises(InputError, match="control strength must be in"):
        ControlInjection(tower, torch.zeros(3, 196), strength=11)
    with pytest.raises(InputError, match="control end is a fraction"):
        ControlInjection(tower, torch.zeros(3, 196), window=(0.0, 1.5))
    with pytest.raises(InputError, match=r"the control hint must be \(rows, 196\)"):
        ControlInjection(tower, torch.zeros(3, 100))


def test_a_tower_for_another_dit_is_refused():
    wide = dataclasses.replace(DIT, hidden_size=32)
    with pytest.raises(CheckpointError, match="is for a DiT 32 wide"):
        config_for(wide, 2).check_fits(DIT)
    with pytest.raises(CheckpointError, match="pruned \\(curve-form\\) AdaLN"):
        config_for(CURVE, 2).check_fits(DIT)
    with pytest.raises(CheckpointError, match="injects after DiT layer 4 but the DiT has 4 layers"):
        config_for(DIT, 2, places=(0, 4)).check_fits(DIT)


def test_released_places():
    assert spread(5) == (0, 10, 20, 30, 40)
    assert spread(10) == tuple(range(0, 50, 5))
    assert spread(2, 4) == (0, 2)


def test_the_window_reads_the_free_target_rows_not_the_held_ones(case):
    lay, data, hint = case
    n = lay.video_indices.numel() - lay.num_condition_video_rows
    keep = torch.zeros(n, dtype=torch.bool)
    keep[:3] = True  # a noise mask holds the first target rows at the condition level (t = 0.999)
    held = lay.holding(keep, None)
    dit, tower = _dit(DIT), _tower(DIT)
    injection = ControlInjection(tower, hint, window=(0.0, 0.5), shift=3.0)  # active while sigma >= 0.75
    dit.control = injection
    with torch.no_grad():
        dit(**_args(held, data, 0.2))  # sigma 0.8 on the free rows: inside, though the held rows say 0.001
    assert injection.evaluations == 1


def test_a_tower_built_under_a_meta_device_holds_no_weights():
    """The file checks and writers read a full tower's shapes under torch.device("meta"); a tower that forced the CPU
    there initialised 2 GB of weights for each look (45 s)."""
    from h3_spark.h3_model.checkpoint.controlnet import synthetic_config
    from h3_spark.h3_model.dit.config import FULL

    with torch.device("meta"):
        tower = ControlTower(synthetic_config(FULL, union2=True, comfy=False), torch.float32)
    params = list(tower.parameters())
    assert params and all(p.is_meta for p in params)
    assert ControlTower(synthetic_config(FULL, union2=True, comfy=False), torch.float32, device="meta") \
        .control_proj_in.weight.is_meta
