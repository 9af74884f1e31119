"""The video VAE against the diffusers oracle (AutoencoderKLMiniMaxH3), plus its loaders/writers.

Error budget for every fp32 oracle comparison: relative L2 <= 1e-5 (the paths are the same
arithmetic; observed differences are 0 or a few 1e-7 from conv summation order).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.h3_model.vae import loading as vae_loading

from h3_spark.h3_model.vae import synthetic as vae_synthetic
from h3_spark.h3_model.vae import video as video_vae
from h3_spark.h3_model.vae import video_config
from h3_spark.h3_model.vae import video_tiling
from h3_spark.errors import CheckpointError, InputError
from h3_spark.kernels.settings import DEFAULT_TILE_BATCH, vae_tile_batch
from oracle import randomize_vae_

FP32_BUDGET = 1e-5
FP16_BUDGET = 5e-3  # fp16 decoder linears vs the fp32 oracle
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def with_stats(cfg: video_config.VideoVAEConfig, seed: int) -> video_config.VideoVAEConfig:
    gen = torch.Generator().manual_seed(seed)
    c = cfg.latent_channels
    return dataclasses.replace(cfg, latents_mean=tuple((0.5 * torch.randn(c, generator=gen)).tolist()),
                               latents_std=tuple((0.5 + torch.rand(c, generator=gen)).tolist()))


def diffusers_kwargs(cfg: video_config.VideoVAEConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if not k.startswith("_")}


# The spec's tiny config (4x spatial), and a 16x variant so the default 256 px tiles really tile.
TINY = with_stats(video_config.TINY, 1)
TINY16 = with_stats(dataclasses.replace(
    video_config.TINY, block_out_channels=(8, 16, 16, 16), spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(2, 2, 1, 1)), 2)


def build_oracle(cfg: video_config.VideoVAEConfig, folder, seed: int):
    ref = AutoencoderKLMiniMaxH3(**diffusers_kwargs(cfg)).eval()
    randomize_vae_(ref, seed)
    ref.save_pretrained(folder / "vae")
    ours = vae_loading.load_video_vae(folder, decode_dtype=torch.float32)
    return ref, ours


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_oracle(TINY, tmp_path_factory.mktemp("tiny"), 10)


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    return build_oracle(TINY16, tmp_path_factory.mktemp("tiny16"), 11)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---- structure -------------------------------------------------------------------------------


def test_state_dict_keys_and_shapes_equal_diffusers(tiny):
    ref, ours = tiny
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
           {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        full_ref, full_ours = AutoencoderKLMiniMaxH3(), video_vae.VideoVAE(video_config.FULL)
    assert {k: tuple(v.shape) for k, v in full_ours.state_dict().items()} == \
           {k: tuple(v.shape) for k, v in full_ref.state_dict().items()}
    assert len(full_ours.state_dict()) == 703


def test_config_field_names_and_full_defaults_equal_diffusers():
    with torch.device("meta"):
        ref = AutoencoderKLMiniMaxH3()
    ref_config = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    ours = diffusers_kwargs(video_config.FULL)
    assert ours.keys() == ref_config.keys()
    assert ours == {k: list(v) if isinstance(v, tuple) else v for k, v in ref_config.items()}
    assert video_config.VideoVAEConfig.from_dict(video_config.TINY.to_dict()) == video_config.TINY


def test_randomised_oracle_has_no_zero_residual_scales(tiny):
    ref, _ = tiny
    scales = [p for n, p in ref.named_parameters() if n.endswith(("scale1", "scale2"))]
    assert scales and all(bool((s != 0).all()) for s in scales)


def test_geometry_of_the_released_config():
    full = video_config.FULL
    assert (full.spatial_ratio, full.temporal_ratio) == (16, 4)
    assert (full.tokens_chunk_size, full.token_overlap, full.frame_pre_padding, full.frame_overlap) == (5, 2, 3, 5)
    assert video_tiling.encoded_num_frames(full, 124) == 37
    assert video_tiling.encoded_num_frames(full, 1) == 1
    plan = video_tiling.temporal_plan(full, 37)
    assert (plan.num_chunks, plan.window, plan.num_frames) == (7, 7, 124)
    assert video_tiling.split_tiles(544, 256, 64, 16) == video_tiling.TileAxis((0, 144, 288), (256,) * 3, (112, 112))
    assert video_tiling.split_tiles(960, 256, 64, 16).overlaps == (80, 80, 80, 80)
    assert video_tiling.split_tiles(200, 256, 64, 16) == video_tiling.TileAxis((0,), (200,), ())


# ---- encode ----------------------------------------------------------------------------------


# 17n+5; ones that need the repeat-last padding (10, 3, 35: a last clip of 1); 17 (no padding); 26 (a last clip
# of 9, whose frames past its 5th reach no kept latent).
@pytest.mark.parametrize("frames", [22, 10, 3, 17, 26, 35])
def test_encode_mean_logvar_and_sample_match_oracle(tiny, frames):
    ref, ours = tiny
    x = randn(1, 3, frames, 32, 48, seed=frames)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    got = ours.encode(x)
    assert got.mean.shape == expected.mean.shape
    assert rel_l2(got.mean, expected.mean) <= FP32_BUDGET
    assert rel_l2(got.logvar, expected.logvar) <= FP32_BUDGET
    sample = got.sample(torch.Generator().manual_seed(7))
    assert rel_l2(sample, expected.sample(torch.Generator().manual_seed(7))) <= FP32_BUDGET
    assert rel_l2(sample, got.mean) > 1e-3  # the noise really is there


@pytest.mark.parametrize("frames, encoded", [(22, [17, 5]), (17, [5]), (26, [17, 5]), (35, [17, 17, 5]),
                                             (3, [5])])
def test_the_last_clip_is_encoded_from_the_frames_its_kept_latents_see(tiny, monkeypatch, frames, encoded):
    _, ours = tiny
    assert ours.config.tail_clip_frames == 5  # (5 latents a clip - 3 dropped - 1) x 4 + 1
    seen = []
    real = ours._encode_tiled
    monkeypatch.setattr(ours, "_encode_tiled", lambda x, *a: seen.append(x.shape[2]) or real(x, *a))
    x = randn(1, 3, frames, 16, 16, seed=frames)
    latents = ours.encode(x).mean.shape[2]
    assert seen == encoded
    assert latents == 5 * (len(encoded) - 1) + 2
    # What the last clip's frames past its 5th hold does not matter (26 frames: 4 of them; the oracle test above
    # shows the released encoder keeps the same latents with them).
    past = (frames - 1) // 17 * 17 + 5
    if past < frames:
        changed = x.clone()
        changed[:, :, past:] = randn(1, 3, frames - past, 16, 16, seed=99)
        assert torch.equal(ours.encode(changed).mean, ours.encode(x).mean)


@pytest.mark.parametrize("frames", [3, 22, 26, 35])
def test_the_trimmed_last_clip_gives_the_padded_encodes_bits(tiny, frames):
    """The old way, every clip padded to 17 frames and token_drop's latents cut after: the kept latents are the
    same fp32 bits on the CPU (the same sums; a GPU may pick another convolution algorithm for a shorter clip)."""
    _, ours = tiny
    x = randn(1, 3, frames, 16, 16, seed=frames + 1)
    pad = (-frames) % 17
    padded = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
    moments = torch.cat([ours._encode_tiled(padded[:, :, s:s + 17], 256, 64) for s in range(0, padded.shape[2], 17)],
                        dim=2)[:, :, :-3]
    got = ours.encode(x)
    assert torch.equal(got.mean, video_vae.VideoPosterior.from_moments(moments).mean)
    assert torch.equal(got.logvar, video_vae.VideoPosterior.from_moments(moments).logvar)


def test_encode_with_default_tiling_matches_oracle(tiny16):
    ref, ours = tiny16
    # One frame keeps this cheap; 288 x 320 px gives 2 x 2 tiles with overlaps widened to 224 / 192.
    x = randn(1, 3, 1, 288, 320, seed=3)
    with torch.no_grad():
        expected = ref.encode(x).latent_dist.mean
    assert rel_l2(ours.encode(x).mean, expected) <= FP32_BUDGET


def test_tiled_video_encode_matches_oracle(tiny):
    ref, ours = tiny
    x = randn(1, 3, 22, 36, 52, seed=19)
    ref.enable_tiling(24, 24, 8, 8)
    try:
        with torch.no_grad():
            expected = ref.encode(x).latent_dist.mean
    finally:
        ref.enable_tiling(256, 256, 64, 64)
    assert rel_l2(ours.encode(x, tile_size=24, tile_min_overlap=8).mean, expected) <= FP32_BUDGET


def test_single_frame_encode_2d_shortcut_is_exact(tiny, monkeypatch):
    ref, ours = tiny
    x = randn(1, 3, 1, 32, 48, seed=4)
    full_path = ours.encode(x, single_frame_2d=False).mean
    with torch.no_grad():
        expected = ref.encode(x).latent_dist
    # Prove the shortcut never touches a 3-D conv.
    monkeypatch.setattr(torch.nn.functional, "conv3d", lambda *a, **k: pytest.fail("conv3d on one frame"))
    shortcut = ours.encode(x)
    assert shortcut.mean.shape == (1, 4, 1, 8, 12)
    assert rel_l2(shortcut.mean, full_path) <= FP32_BUDGET  # same sums, other order
    assert rel_l2(shortcut.mean, expected.mean) <= FP32_BUDGET
    assert rel_l2(shortcut.logvar, expected.logvar) <= FP32_BUDGET


def test_encode_condition_matches_the_pipeline_recipe(tiny):
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    ref, ours = tiny
    frames = torch.randint(0, 256, (22, 32, 48, 3), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    with torch.no_grad():
        expected = encode_vae_condition(ref, frames.permute(3, 0, 1, 2)[None], IMAGENET_MEAN, IMAGENET_STD, 42)
    got = video_vae.encode_condition(ours, frames)
    assert rel_l2(got, expected) <= FP32_BUDGET
    image = video_vae.encode_condition(ours, frames[0])
    assert image.shape == (1, 4, 1, 8, 12)


# ---- decode ----------------------------------------------------------------------------------


def test_decode_with_default_tiling_matches_oracle(tiny16):
    ref, ours = tiny16
    z = randn(1, 4, 7, 18, 34, seed=6)  # 288 x 544 px: 2 x 3 tiles
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = ours.decode(z)
    assert got.shape == expected.shape == (1, 3, 22, 288, 544)
    assert rel_l2(got, expected) <= FP32_BUDGET


def test_decode_untiled_matches_oracle_and_differs_from_tiled(tiny16):
    ref, ours = tiny16
    z = randn(1, 4, 7, 18, 34, seed=7)
    ref.disable_tiling()
    try:
        with torch.no_grad():
            expected = ref.decode(z).sample
    finally:
        ref.enable_tiling()
    got = ours.decode(z, tile_size=None)
    assert rel_l2(got, expected) <= FP32_BUDGET
    assert rel_l2(ours.decode(z), expected) > 1e-3


def test_decode_37_latent_frames_gives_124_frames_like_oracle(tiny):
    ref, ours = tiny
    z = randn(1, 4, 37, 8, 12, seed=8)
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = ours.decode(z)
    assert got.shape == expected.shape == (1, 3, 124, 32, 48)
    assert rel_l2(got, expected) <= FP32_BUDGET


@pytest.mark.parametrize("frames", [3, 4, 8])  # padded up to whole windows, then trimmed
def test_decode_other_lengths_match_oracle(tiny, frames):
    ref, ours = tiny
    z = randn(1, 4, frames, 6, 8, seed=frames)
    with torch.no_grad():
        expected = ref.decode(z).sample
    got = ours.decode(z)
    assert got.shape == expected.shape
    assert got.shape[2] == video_tiling.decoded_num_frames(TINY, frames)
    assert rel_l2(got, expected) <= FP32_BUDGET


def test_small_tiles_match_oracle(tiny):
    ref, ours = tiny
    z = randn(1, 4, 7, 9, 13, seed=9)
    ref.enable_tiling(16, 16, 8, 8)
    try:
        with torch.no_grad():
            expected = ref.decode(z).sample
    finally:
        ref.enable_tiling(256, 256, 64, 64)
    assert rel_l2(ours.decode(z, tile_size=16, tile_min_overlap=8), expected) <= FP32_BUDGET


@pytest.mark.parametrize("tile_batch", [2, 4, 100])
def test_batched_tiles_match_one_tile_at_a_time(tiny, tile_batch):
    # 9 x 13 latents with 16 px tiles: a grid of several rows and columns that batches split unevenly.
    _, ours = tiny
    z = randn(2, 4, 7, 9, 13, seed=19)
    one = ours.decode(z, tile_size=16, tile_min_overlap=8, tile_batch=1)
    many = ours.decode(z, tile_size=16, tile_min_overlap=8, tile_batch=tile_batch)
    assert rel_l2(many, one) <= 1e-6
    assert rel_l2(many[1:], one[1:]) <= 1e-6  # the second video is not mixed up with the first


def test_tile_batch_comes_from_the_environment(tiny, monkeypatch):
    _, ours = tiny
    z = randn(1, 4, 7, 9, 13, seed=20)
    calls = []
    decoder = ours.decoder
    original = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda x, *a, **k: calls.append(x.shape[0]) or original(x, *a, **k))
    monkeypatch.setenv("H3_VAE_TILE_BATCH", "5")
    ours.tile_batch = vae_tile_batch()  # what every front door does with the variable
    try:
        ours.decode(z, tile_size=16, tile_min_overlap=8)
    finally:
        ours.tile_batch = DEFAULT_TILE_BATCH
    r = ours.config.spatial_ratio
    tiles = len(video_tiling.split_tiles(9 * r, 16, 8, r).starts) * len(video_tiling.split_tiles(13 * r, 16, 8, r).starts)
    per_window = [5] * (tiles // 5) + ([tiles % 5] if tiles % 5 else [])
    assert tiles > 5 and calls == per_window * (len(calls) // len(per_window))
    monkeypatch.setenv("H3_VAE_TILE_BATCH", "many")
    with pytest.raises(InputError, match="H3_VAE_TILE_BATCH='many': expected a whole number of tiles"):
        vae_tile_batch()
    monkeypatch.delenv("H3_VAE_TILE_BATCH")
    with pytest.raises(InputError, match="tile_batch must be a whole number of tiles >= 1, got 0"):
        ours.decode(z, tile_size=16, tile_min_overlap=8, tile_batch=0)


def test_batched_tiles_raise_the_memory_estimate_by_the_batch():
    one = video_vae.decode_memory_estimate(video_config.FULL, 37, 34, 60, tile_batch=1)
    four = video_vae.decode_memory_estimate(video_config.FULL, 37, 34, 60, tile_batch=4)
    allt = video_vae.decode_memory_estimate(video_config.FULL, 37, 34, 60, tile_batch=1000)
    assert 4 * one["transient"] < four["transient"] < 5 * one["transient"]
    assert allt["transient"] == video_vae.decode_memory_estimate(video_config.FULL, 37, 34, 60, tile_batch=15)["transient"]
    assert four["weights"] == one["weights"] and four["window"] == one["window"]


def test_decode_to_buffer_writes_pipeline_pixels_into_one_host_buffer(tiny):
    ref, ours = tiny
    z = randn(1, 4, 12, 8, 12, seed=12)
    with torch.no_grad():
        video = ref.decode(z).sample
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1, 1)
    unit = (video * std + mean).clamp(0, 1).permute(0, 2, 3, 4, 1)
    buffer = torch.empty(ours.decoded_shape(z.shape), dtype=torch.uint8)
    got = ours.decode_to_buffer(z, out=buffer)
    assert got.data_ptr() == buffer.data_ptr()
    assert (got.int() - (unit * 255).round().int()).abs().max() <= 1
    half = ours.decode_to_buffer(z, out_dtype=torch.float16)
    assert half.dtype == torch.float16 and (half.float() - unit).abs().max() <= 1e-3
    # Chunks handed out while decoding: in frame order, together the whole buffer, each already final.
    chunks = []
    again = ours.decode_to_buffer(z, on_frames=lambda c: chunks.append(c.clone()))
    assert len(chunks) > 1 and all(c.shape[0] == 1 for c in chunks)
    assert torch.equal(torch.cat(chunks, dim=1), again) and torch.equal(again, got)


@pytest.mark.gpu
def test_a_gpu_decode_lands_the_same_bytes_in_pageable_and_page_locked_buffers(tmp_path):
    """On a GPU a pageable buffer is filled through a page-locked chunk (the driver's own staging was 0.31 s of a
    1344x768x124 decode on an H100): the bytes are those a page-locked buffer gets directly, chunk by chunk."""
    ref = AutoencoderKLMiniMaxH3(**diffusers_kwargs(TINY)).eval()
    randomize_vae_(ref, 10)
    ref.save_pretrained(tmp_path / "vae")
    ours = vae_loading.load_video_vae(tmp_path, decode_dtype=torch.float32, device="cuda")
    z = randn(1, 4, 12, 8, 12, seed=12)
    pageable = torch.empty(ours.decoded_shape(z.shape), dtype=torch.uint8)
    pinned = torch.empty(ours.decoded_shape(z.shape), dtype=torch.uint8, pin_memory=True)
    chunks = []
    ours.decode_to_buffer(z, out=pageable, on_frames=lambda c: chunks.append(c.clone()))
    ours.decode_to_buffer(z, out=pinned)
    assert not pageable.is_pinned() and torch.equal(pageable, pinned)
    assert len(chunks) > 1 and torch.equal(torch.cat(chunks, dim=1), pinned)


def test_fp16_decode_is_within_budget(tiny, tmp_path):
    ref, _ = tiny
    ref.save_pretrained(tmp_path / "vae")
    half = vae_loading.load_video_vae(tmp_path)
    assert half.decode_dtype == torch.float16
    assert half.decoder.transformer_blocks[0].attn.to_q.weight.dtype == torch.float16
    assert half.decoder.transformer_blocks[0].scale1.dtype == torch.float32
    assert half.encoder.conv_in.weight.dtype == torch.float32
    z = randn(1, 4, 7, 8, 12, seed=13)
    with torch.no_grad():
        expected = ref.decode(z).sample
    assert rel_l2(half.decode(z), expected) <= FP16_BUDGET


def test_latent_normalisation_uses_config_stats(tiny):
    _, ours = tiny
    z = randn(1, 4, 3, 2, 2, seed=14)
    mean = torch.tensor(TINY.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(TINY.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(ours.normalize(z), (z - mean) / std)
    assert torch.allclose(ours.denormalize(ours.normalize(z)), z, atol=1e-6)


def test_memory_figures_in_docstring_are_the_computed_ones():
    estimate = video_vae.decode_memory_estimate(video_config.FULL, 37, 34, 60)
    doc = video_vae.__doc__.replace(",", "")
    for key in ("weights", "transient", "window", "device_peak", "host_buffer"):
        assert f"{estimate[key]} B" in doc, key


# ---- bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, dtype, message", [
    ((1, 4, 22, 32, 48), torch.float32, "expects float (B, 3, F, H, W)"),
    ((1, 3, 32, 48), torch.float32, "expects float (B, 3, F, H, W)"),
    ((1, 3, 22, 32, 48), torch.int64, "expects float"),
    ((1, 3, 22, 30, 48), torch.float32, "H and W divisible by 4"),
])
def test_encode_rejects_bad_pixels(tiny, shape, dtype, message):
    _, ours = tiny
    with pytest.raises(InputError, match=re.escape(message)):
        ours.encode(torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("shape, message", [
    ((1, 5, 7, 8, 12), "video latents must be float (B, 4, T, h, w)"),
    ((4, 7, 8, 12), "video latents must be float"),
    ((1, 4, 2, 8, 12), "need at least 3 frames to decode, got 2"),
])
def test_decode_rejects_bad_latents(tiny, shape, message):
    _, ours = tiny
    with pytest.raises(InputError, match=re.escape(message)):
        ours.decode(randn(*shape, seed=0))


def test_bad_tiling_buffers_and_dtypes_are_refused(tiny):
    _, ours = tiny
    z = randn(1, 4, 7, 8, 12, seed=1)
    with pytest.raises(InputError, match="tile size 30 px must be a multiple of 4"):
        ours.decode(z, tile_size=30)
    with pytest.raises(InputError, match="larger than the 64 px minimum overlap"):
        ours.encode(randn(1, 3, 1, 32, 48, seed=1), tile_size=64)
    with pytest.raises(InputError, match="buffer dtype must be uint8 or float16"):
        ours.decode_to_buffer(z, out_dtype=torch.float32)
    with pytest.raises(InputError, match=re.escape("decode buffer must be uint8/float16 (1, 22, 32, 48, 3)")):
        ours.decode_to_buffer(z, out=torch.empty(1, 21, 32, 48, 3, dtype=torch.uint8))
    with pytest.raises(InputError, match="decode dtype must be float16 or float32"):
        ours.set_decode_dtype(torch.bfloat16)
    with pytest.raises(InputError, match="frames must be uint8"):
        video_vae.frames_to_vae_input(torch.zeros(2, 8, 8, 3))


def test_invalid_configs_are_refused():
    with pytest.raises(CheckpointError, match="rotary width .* = 9 must be a positive multiple of 6"):
        dataclasses.replace(video_config.TINY, decoder_attention_head_dim=12)
    with pytest.raises(CheckpointError, match="not divisible by norm_num_groups"):
        dataclasses.replace(video_config.TINY, norm_num_groups=3)
    with pytest.raises(CheckpointError, match="need 4 values, got 3/4"):
        dataclasses.replace(video_config.TINY, latents_mean=(0.0,) * 3)
    with pytest.raises(CheckpointError, match="unknown video VAE preset 'huge'"):
        video_config.preset("huge")


# ---- loading ---------------------------------------------------------------------------------


def test_loads_component_folder_parent_folder_and_shards(tiny, tmp_path):
    ref, ours = tiny
    ref.save_pretrained(tmp_path / "sharded" / "vae", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "vae" / vae_loading.INDEX_NAME).is_file()
    sharded = vae_loading.load_video_vae(tmp_path / "sharded" / "vae", decode_dtype=torch.float32)
    z = randn(1, 4, 7, 8, 12, seed=15)
    assert torch.equal(sharded.decode(z), ours.decode(z))
    assert sharded.config == ours.config == TINY


def comfy_state_dict(ref: AutoencoderKLMiniMaxH3, heads: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """diffusers weights under ComfyUI's names, written here from what comfy/ldm/minimax/vae.py does
    (independent of the package's own converter): qkv rows per head [q_h; k_h; v_h]; w1 rows
    [gate; value]; nin_shortcut, down.{i}.block.{j}, downsample, x_embedder, to_out."""
    sd = ref.state_dict()
    out = {}
    for name, t in sd.items():
        m = re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", name)
        if m:
            name = f"encoder.down.{m[1]}.block.{m[2]}.{m[3].replace('conv_shortcut', 'nin_shortcut')}"
        m = re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", name)
        if m:
            name = f"encoder.down.{m[1]}.downsample.{m[2]}"
        name = name.replace("decoder.proj_in.", "decoder.x_embedder.").replace(".to_out.0.", ".to_out.")
        if ".attn.to_k." in name or ".attn.to_v." in name:
            continue
        if ".attn.to_q." in name:
            q, k, v = (sd[name.replace("to_q", p)] for p in ("to_q", "to_k", "to_v"))
            split = [x.reshape(heads, -1, *x.shape[1:]) for x in (q, k, v)]
            t = torch.cat(split, dim=1).reshape(-1, *q.shape[1:])
            name = name.replace(".to_q.", ".to_qkv.")
        if ".ff.net.0.proj." in name:
            value, gate = t.chunk(2)
            t, name = torch.cat([gate, value]), name.replace(".ff.net.0.proj.", ".ff.w1.")
        out[name.replace(".ff.net.2.", ".ff.w2.")] = t.to(dtype).contiguous()
    dim = ref.config.decoder_num_attention_heads * ref.config.decoder_attention_head_dim
    out["decoder.mask_token"] = torch.randn(1, 1, dim).to(dtype)
    out["latents_mean"] = torch.tensor(ref.config.latents_mean)
    out["latents_std"] = torch.tensor(ref.config.latents_std)
    return out


def test_comfy_single_file_loads_and_matches_oracle(tiny, tmp_path):
    ref, _ = tiny
    path = tmp_path / "minimax_h3_video_vae.safetensors"
    save_file(comfy_state_dict(ref, TINY.decoder_num_attention_heads, torch.float32), str(path))
    # A tiny model's strides leave no trace in its tensors, so its config is passed in.
    ours = vae_loading.load_video_vae(path, decode_dtype=torch.float32, config=video_config.TINY)
    assert ours.config.latents_mean == pytest.approx(TINY.latents_mean)
    z = randn(1, 4, 7, 8, 12, seed=16)
    x = randn(1, 3, 22, 32, 48, seed=17)
    with torch.no_grad():
        assert rel_l2(ours.decode(z), ref.decode(z).sample) <= FP32_BUDGET
        assert rel_l2(ours.encode(x).mean, ref.encode(x).latent_dist.mean) <= FP32_BUDGET
    save_file(comfy_state_dict(ref, TINY.decoder_num_attention_heads, torch.float16), str(path))
    half = vae_loading.load_video_vae(path, config=video_config.TINY)
    assert half.encoder.conv_in.weight.dtype == torch.float32  # fp16 file, fp32 encoder
    with torch.no_grad():
        assert rel_l2(half.decode(z), ref.decode(z).sample) <= FP16_BUDGET


def test_full_config_is_inferred_from_comfy_names():
    shapes = {}
    for name, shape, _ in vae_synthetic.plan_vae_checkpoint("full", "comfy"):
        for new, tensor in vae_loading.comfy_to_diffusers_video(name, torch.empty(shape, device="meta"), 32):
            shapes[new] = tuple(tensor.shape)
    assert shapes == {n: s for n, s, _ in vae_synthetic.plan_vae_checkpoint("full", "diffusers")}
    assert vae_loading.infer_video_config(shapes) == video_config.FULL
    assert len(vae_synthetic.plan_vae_checkpoint("full")) == 703


def test_loader_errors_name_the_problem(tiny, tmp_path):
    ref, _ = tiny
    with pytest.raises(CheckpointError, match="no such file or folder"):
        vae_loading.load_video_vae(tmp_path / "missing")
    (tmp_path / "vae.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="only .safetensors checkpoints are loaded"):
        vae_loading.load_video_vae(tmp_path / "vae.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a diffusers vae/ folder"):
        vae_loading.load_video_vae(tmp_path / "empty")
    save_file({"pre_block.attn.zero_k_bias": torch.zeros(4)}, str(tmp_path / "audio.safetensors"))
    with pytest.raises(CheckpointError, match="this is the audio VAE"):
        vae_loading.load_video_vae(tmp_path / "audio.safetensors")
    save_file({"decoder.proj_out.weight": torch.ones(2, 2), "decoder.proj_out.comfy_quant": torch.ones(1)},
              str(tmp_path / "quant.safetensors"))
    # A quantized file is read now (ComfyUI's int8_convrot one: tests/test_video_vae_int8.py, with its refusals);
    # this one holds no video VAE at all.
    with pytest.raises(CheckpointError, match="not an H3 video VAE"):
        vae_loading.load_video_vae(tmp_path / "quant.safetensors")
    sd = {k: v for k, v in ref.state_dict().items() if k != "decoder.proj_out.bias"}
    save_file(sd, str(tmp_path / "partial.safetensors"))
    with pytest.raises(CheckpointError, match="1 missing .*decoder.proj_out.bias"):
        vae_loading.load_video_vae(tmp_path / "partial.safetensors", config=TINY)
    with pytest.raises(CheckpointError, match=r"encoder\.conv_in\.\w+ has shape \(8,"):
        vae_loading.load_video_vae(tmp_path / "partial.safetensors",
                                   config=dataclasses.replace(TINY, block_out_channels=(16, 16, 16)))
    with pytest.raises(CheckpointError, match="cannot infer this video VAE's strides"):
        vae_loading.load_video_vae(tmp_path / "partial.safetensors")


# ---- writing ---------------------------------------------------------------------------------


def test_written_checkpoints_load_in_diffusers_and_match_ours(tmp_path):
    folder = vae_synthetic.write_vae_checkpoint(tmp_path / "vae", "tiny", "diffusers", seed=5)
    comfy = vae_synthetic.write_vae_checkpoint(tmp_path / "vae.safetensors", "tiny", "comfy", seed=5)
    ref = AutoencoderKLMiniMaxH3.from_pretrained(folder).eval()
    ours = vae_loading.load_video_vae(tmp_path, decode_dtype=torch.float32)
    from_comfy = vae_loading.load_video_vae(comfy, decode_dtype=torch.float32)
    assert from_comfy.config == ours.config and ours.config.latents_std != video_config.TINY.latents_std
    z = randn(1, 4, 7, 8, 12, seed=18)
    with torch.no_grad():
        expected = ref.decode(z).sample
    assert rel_l2(ours.decode(z), expected) <= FP32_BUDGET
    assert rel_l2(from_comfy.decode(z), expected) <= FP16_BUDGET  # the comfy file is fp16
    with safe_open(str(comfy), "pt") as f:
        assert f.get_tensor("encoder.down.1.block.0.nin_shortcut.weight").dtype == torch.float16
        assert json.loads(f.metadata()["config"])["block_out_channels"] == [8, 16, 16]
        assert all(bool((f.get_tensor(k) != 0).all()) for k in f.keys())


def test_writer_is_deterministic_per_seed(tmp_path):
    a = vae_synthetic.write_vae_checkpoint(tmp_path / "a", "tiny", seed=1) / vae_loading.WEIGHTS_NAME
    b = vae_synthetic.write_vae_checkpoint(tmp_path / "b", "tiny", seed=1) / vae_loading.WEIGHTS_NAME
    c = vae_synthetic.write_vae_checkpoint(tmp_path / "c", "tiny", seed=2) / vae_loading.WEIGHTS_NAME
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    with pytest.raises(CheckpointError, match="unknown checkpoint layout 'ckpt'"):
        vae_synthetic.write_vae_checkpoint(tmp_path / "d", "tiny", "ckpt")
    with pytest.raises(CheckpointError, match="must end in .safetensors"):
        vae_synthetic.write_vae_checkpoint(tmp_path / "d.bin", "tiny", "comfy")
