"""The exact optimisations leave velocities unchanged.

Tolerances: segment modulation and RoPE caching are bit-identical (same elementwise ops);
anything that changes a GEMM's row count (batched AdaLN precompute, heads over a row subset,
MLP row chunks) may change BLAS blocking, so it is held to rel L2 <= 1e-6 in fp32.
"""

import pytest
import torch

from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.errors import H3Error
from h3_spark.h3_model.pipeline.scheduler import CONDITION_VIDEO_T, JointSchedule
from oracle import diffusers_dit, ours_from, ref_blocks, rel_l2, text_tags

TOL = 1e-6


@pytest.fixture(scope="module")
def setup():
    ref = diffusers_dit(TINY, seed=3)
    refs, *_ = ref_blocks([("image", 4, 6), ("video", 2, 4, 4, 5), ("audio", 3)])
    lay = layout.build_ref2va(text_tags(10, (1, 6)), refs, 7, 4, 6, 12)
    gen = torch.Generator().manual_seed(5)
    data = dict(
        hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
        audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
        encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen),
        token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
        audio_indices=lay.audio_indices, text_indices=lay.text_indices)
    return ref, lay, data


def _step_args(lay, data, t_video, t_audio):
    ts, idx = lay.row_timesteps(t_video, t_audio, max(t_video, CONDITION_VIDEO_T))
    return {**data, "timestep": ts, "timestep_indices": idx}


def _plain(ref):
    model = ours_from(ref, TINY)
    model.use_segments = False
    return model


def test_segments_equal_gather(setup):
    ref, lay, data = setup
    args = _step_args(lay, data, 0.3, 0.6)
    plain, fast = _plain(ref), ours_from(ref, TINY)
    assert fast.use_segments
    with torch.no_grad():
        a, b = plain(**args), fast(**args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_refiner_once_equals_per_step(setup):
    ref, lay, data = setup
    model = ours_from(ref, TINY)
    with torch.no_grad():
        text = model.encode_text(data["encoder_hidden_states"])
        for tv, ta in ((0.1, 0.2), (0.7, 0.9)):
            args = _step_args(lay, data, tv, ta)
            full = model(**args)
            cached = model(**{**args, "encoder_hidden_states": None}, text_embeds=text)
            assert torch.equal(full[0], cached[0]) and torch.equal(full[1], cached[1])


def test_precomputed_adaln_then_released(setup):
    ref, lay, data = setup
    schedule = JointSchedule.create(6)
    plain = _plain(ref)
    model = ours_from(ref, TINY)
    values = set()
    for i in range(len(schedule)):
        tv, ta = schedule.step_timesteps(i)
        values.update(lay.row_timesteps(tv, ta, max(tv, CONDITION_VIDEO_T))[0].tolist())
    model.precompute_modulation(values)
    before = sum(p.numel() for p in model.parameters())
    freed = model.release_adaln()
    after = sum(p.numel() for p in model.parameters())
    assert freed == (before - after) * 4 and after < before
    assert not hasattr(model.transformer_blocks[0], "adaln_proj") and not hasattr(model, "time_embedder")
    with torch.no_grad():
        for i in range(len(schedule)):
            args = _step_args(lay, data, *schedule.step_timesteps(i))
            expected, got = plain(**args), model(**args)
            assert rel_l2(got[0], expected[0]) <= TOL and rel_l2(got[1], expected[1]) <= TOL
        with pytest.raises(H3Error, match="were not precomputed and the AdaLN weights were released"):
            model(**_step_args(lay, data, 0.123, 0.456))


def test_release_needs_precompute(setup):
    ref, _, _ = setup
    with pytest.raises(H3Error, match="precompute_modulation must run"):
        ours_from(ref, TINY).release_adaln()


def test_heads_over_target_rows_only(setup):
    ref, lay, data = setup
    model = ours_from(ref, TINY)
    args = _step_args(lay, data, 0.4, 0.5)
    v_rows = torch.arange(lay.num_condition_video_rows, lay.video_indices.numel())
    a_rows = torch.arange(lay.num_condition_audio_rows, lay.audio_indices.numel())
    with torch.no_grad():
        full_v, full_a = model(**args)
        v, a = model(**args, output_video_rows=v_rows, output_audio_rows=a_rows)
    assert rel_l2(v, full_v[:, v_rows]) <= TOL and rel_l2(a, full_a[:, a_rows]) <= TOL
    assert v.shape[1] == lay.target_video_indices.numel()


def test_rope_cached_per_layout(setup):
    ref, lay, data = setup
    model = ours_from(ref, TINY)
    args = _step_args(lay, data, 0.4, 0.5)
    with torch.no_grad():
        first = model(**args)
        assert len(model._rope_cache) == 1
        second = model(**{**args, "position_ids": args["position_ids"].clone()})
    assert len(model._rope_cache) == 1
    assert torch.equal(first[0], second[0])


def test_rope_cache_under_inference_mode(setup):
    # Inference tensors have no version counter: the tables come from the content hash, and an in-place
    # change of the positions is seen.
    ref, lay, data = setup
    model = ours_from(ref, TINY)
    with torch.inference_mode():
        step = _step_args(lay, data, 0.4, 0.5)
        args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in step.items()}
        assert args["position_ids"].is_inference()
        first = model(**args)
        again = model(**args)
        cos = model.rope(args["position_ids"])[0].clone()
        args["position_ids"].add_(1.0)
        moved = model.rope(args["position_ids"])[0]
    assert torch.equal(first[0], again[0]) and len(model._rope_cache) == 2
    assert not torch.equal(cos, moved)


@pytest.mark.parametrize("chunks", [2, 3, 1000])
def test_mlp_chunks(setup, chunks):
    ref, lay, data = setup
    model = ours_from(ref, TINY)
    args = _step_args(lay, data, 0.4, 0.5)
    with torch.no_grad():
        expected = model(**args)
        got = model(**args, mlp_chunks=chunks)
    assert rel_l2(got[0], expected[0]) <= TOL and rel_l2(got[1], expected[1]) <= TOL


def test_mlp_chunks_refuse_an_activation_they_cannot_cut(setup):
    """The NVFP4 norm fusion hands the MLP a quantized activation object; chunking it must say what to do."""
    import types

    from h3_spark.errors import InputError

    ref, _, _ = setup
    mlp = ours_from(ref, TINY).transformer_blocks[0].ff
    packed = types.SimpleNamespace(shape=torch.Size([1, 8, TINY.hidden_size]))
    with pytest.raises(InputError, match="the MLP input is a SimpleNamespace, which cannot be split into row chunks: "
                                         "run with mlp_chunks 1, or set H3_RMS_ADALN_NVFP4_FUSION=off"):
        mlp(packed, chunks=2)


def test_forward_input_errors(setup):
    from h3_spark.errors import InputError

    ref, lay, data = setup
    model = ours_from(ref, TINY)
    args = _step_args(lay, data, 0.4, 0.5)
    cases = [
        ({"position_ids": args["position_ids"][:, :2]}, "position_ids must be \\(seq_len, 3\\)"),
        ({"token_tags": args["token_tags"][:-1]}, "token_tags must be"),
        ({"hidden_states": args["hidden_states"][:, :-1]}, "hidden_states must be \\(batch"),
        ({"audio_hidden_states": args["audio_hidden_states"][..., :3]}, "audio_hidden_states must be"),
        ({"timestep_indices": args["timestep_indices"] + 5}, "timestep_indices must lie in"),
        ({"token_tags": args["token_tags"] + 3}, "token_tags must be 0"),
        ({"video_indices": args["video_indices"].flip(0)[:-1], "hidden_states": args["hidden_states"][:, :-1]},
         "do not add up to seq_len"),
        ({"text_indices": args["text_indices"] * 0}, "cover every row exactly once"),
    ]
    for change, message in cases:
        with pytest.raises(InputError, match=message):
            model(**{**args, **change})
