"""DiT velocities against diffusers' MiniMaxH3Transformer3DModel on tiny random configs.

Tolerance: rel L2 <= 1e-5 in fp32 (the brief's bound; in practice the two agree bit for bit).
"""

import pytest
import torch

from h3_spark.h3_model.dit import layout
from oracle import CONFIGS, diffusers_dit, ours_from, ref_blocks, rel_l2, text_tags

TOL = 1e-5


def _inputs(lay: layout.Layout, config, t_video=0.3, t_audio=0.55, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ts, idx = lay.row_timesteps(t_video, t_audio, max(t_video, 0.999))
    return dict(
        hidden_states=torch.randn(batch, lay.video_indices.numel(), config.video_patch_dim, generator=gen),
        audio_hidden_states=torch.randn(batch, lay.audio_indices.numel(), config.audio_in_channels, generator=gen),
        encoder_hidden_states=torch.randn(batch, lay.num_text, config.text_dim, generator=gen),
        timestep=ts, timestep_indices=idx, token_tags=lay.token_tags, position_ids=lay.position_ids.float(),
        video_indices=lay.video_indices, audio_indices=lay.audio_indices, text_indices=lay.text_indices)


def _compare(config, lay, **kw):
    ref = diffusers_dit(config)
    ours = ours_from(ref, config)
    args = _inputs(lay, config, **kw)
    with torch.no_grad():
        expected = ref(**args)
        video, audio = ours(**args)
    assert video.dtype == audio.dtype == torch.float32
    assert video.shape == expected.sample.shape and audio.shape == expected.audio_sample.shape
    assert rel_l2(video, expected.sample) <= TOL
    assert rel_l2(audio, expected.audio_sample) <= TOL


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")], ids=["t2va", "fl2va-first",
                                                                                          "fl2va-last", "fl2va-both"])
def test_t2va_fl2va_velocities(config_name, anchors):
    config = CONFIGS[config_name]
    tags = text_tags(9, (2, 5) if anchors else None)
    lay = layout.build_t2va(tags, 7, 4, 6, 12, keyframes=anchors)
    _compare(config, lay)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("spec", [
    [("image", 6, 4)],
    [("video", 7, 4, 4, 11)],
    [("image", 4, 4), ("audio", 6)],
    [("image", 4, 6), ("video", 2, 4, 4, 5), ("audio", 3), ("image", 6, 4)],
], ids=["image", "video+soundtrack", "image+audio", "mixed"])
def test_ref2va_velocities(config_name, spec):
    config = CONFIGS[config_name]
    refs, *_ = ref_blocks(spec)
    lay = layout.build_ref2va(text_tags(12, (2, 8)), refs, 7, 4, 6, 12)
    _compare(config, lay, t_video=0.05, t_audio=0.2)


def test_batch_of_two_and_first_step():
    lay = layout.build_t2va(text_tags(5), 2, 4, 4, 3)
    _compare(CONFIGS["tiny"], lay, t_video=0.0, t_audio=0.0, batch=2)


def test_bfloat16_matches_diffusers_bfloat16():
    # Same mixed-precision recipe as the released checkpoint: fp32 islands, bf16 blocks.
    config = CONFIGS["tiny"]
    ref = diffusers_dit(config)
    lay = layout.build_t2va(text_tags(6), 2, 4, 4, 5, keyframes=("first",))
    args = _inputs(lay, config)
    ours = ours_from(ref, config, dtype=torch.bfloat16)
    ref = ref.to(torch.bfloat16)
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        getattr(ref, name).float()
    assert ours.proj_in.weight.dtype == torch.float32 and ours.time_embedder.linear_1.weight.dtype == torch.float32
    assert ours.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    with torch.no_grad():
        expected = ref(**args)
        video, audio = ours(**args)
    assert rel_l2(video, expected.sample) <= 1e-2
    assert rel_l2(audio, expected.audio_sample) <= 1e-2
