"""The denoising loop against diffusers' modular denoise blocks (same seed, same tiny DiT).

Tolerance: rel L2 <= 1e-5 in fp32 on the final latents of a 4-evaluation loop.
"""

import threading

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import SequentialPipelineBlocks
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
    MiniMaxH3CoreDenoiseStep,
    MiniMaxH3DecodeStep,
    MiniMaxH3FL2VACoreDenoiseStep,
    MiniMaxH3Ref2VACoreDenoiseStep,
)

from h3_spark.h3_model import geometry
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import DiTConfig
from h3_spark.h3_model.pipeline.sampler import Cancelled, SamplingRequest, sample, schedule_timestep_values
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from oracle import diffusers_dit, ours_from, rel_l2

# in_channels/audio_in_channels match the tiny VAEs of the spec recipe.
CONFIG = DiTConfig(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1,
                   ffn_dim=64, in_channels=4, audio_in_channels=8, text_dim=24, freq_dim=32,
                   time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)
H, W, FRAMES, STEPS = 32, 48, 124, 5
LF, LH, LW, NA = geometry.video_latent_frames(FRAMES), H // 4, W // 4, geometry.audio_latent_frames(FRAMES)


def _tiny_vaes():
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, spatial_downsample_factors=(2, 2, 1),
        temporal_downsample_factors=(2, 2, 1), norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
        decoder_attention_head_dim=8, decoder_num_register_tokens=2, decoder_ffn_mult=2, clip_length=17, token_drop=3,
        latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    audio = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2, encoder_rates=(2, 4, 4, 5, 5), latent_dim=16, latent_channels=8, num_attention_heads=2,
        decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return vae, audio


def _diffusers_latents(core, transformer_name, ref, prompt, tags, seed, **extra):
    # The decode step is there for its components: the pipeline reads latent channels and compression from the VAEs.
    pipe = SequentialPipelineBlocks.from_blocks_dict({"denoise": core, "decode": MiniMaxH3DecodeStep()}).init_pipeline()
    vae, audio_vae = _tiny_vaes()
    pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
                           vae=vae, audio_vae=audio_vae, **{transformer_name: ref})
    state = pipe(generator=torch.Generator().manual_seed(seed), prompt_embeds=prompt, text_token_tags=tags,
                 height=H, width=W, num_frames=FRAMES, num_inference_steps=STEPS, output=["latents", "audio_latents"],
                 **extra)
    return state["latents"], state["audio_latents"]


@pytest.fixture(scope="module")
def models():
    ref = diffusers_dit(CONFIG, seed=11)
    return ref, ours_from(ref, CONFIG)


def _ours(model, lay, prompt, seed, **kw):
    req = SamplingRequest(lay, prompt, LF, LH, LW, NA, **kw)
    return sample(model, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(seed))


def test_t2va_loop_matches_diffusers(models):
    ref, ours = models
    prompt, tags = torch.randn(1, 9, 24), torch.ones(9, dtype=torch.long)
    v_ref, a_ref = _diffusers_latents(MiniMaxH3CoreDenoiseStep(), "transformer", ref, prompt, tags, 3)
    res = _ours(ours, layout.build_t2va(tags, LF, LH, LW, NA), prompt, 3)
    assert res.video_latents.shape == v_ref.shape and res.audio_latents.shape == a_ref.shape
    assert rel_l2(res.video_latents, v_ref) <= 1e-5 and rel_l2(res.audio_latents, a_ref) <= 1e-5
    assert len(res.step_seconds) == STEPS - 1


def test_fl2va_loop_matches_diffusers(models):
    ref, ours = models
    prompt, tags = torch.randn(1, 9, 24), torch.ones(9, dtype=torch.long)
    tags[1:4] = 0
    conds = [torch.randn(1, 4, 1, LH, LW), torch.randn(1, 4, 1, LH, LW)]
    v_ref, a_ref = _diffusers_latents(MiniMaxH3FL2VACoreDenoiseStep(), "transformer", ref, prompt, tags, 4,
                                      keyframe_anchors=("first", "last"), condition_latents=conds)
    lay = layout.build_t2va(tags, LF, LH, LW, NA, keyframes=("first", "last"))
    res = _ours(ours, lay, prompt, 4, condition_latents=conds)
    assert rel_l2(res.video_latents, v_ref) <= 1e-5 and rel_l2(res.audio_latents, a_ref) <= 1e-5


def test_ref2va_loop_matches_diffusers(models):
    ref, ours = models
    prompt, tags = torch.randn(1, 12, 24), torch.ones(12, dtype=torch.long)
    tags[2:6] = 0
    image_latent = torch.randn(1, 4, 1, 8, 8)
    audio_rows = torch.randn(2 * 10, 8)
    refs = [MiniMaxH3ImageReference(image=None), MiniMaxH3AudioReference(audio=torch.zeros(2, 8000))]
    v_ref, a_ref = _diffusers_latents(MiniMaxH3Ref2VACoreDenoiseStep(), "transformer_ref", ref, prompt, tags, 5,
                                      normalized_references=refs, condition_latents=[image_latent],
                                      audio_condition_latents=[audio_rows])
    lay = layout.build_ref2va(tags, [layout.ImageBlock(8, 8), layout.AudioBlock(10)], LF, LH, LW, NA)
    res = _ours(ours, lay, prompt, 5, condition_latents=[image_latent], audio_condition_rows=[audio_rows])
    assert rel_l2(res.video_latents, v_ref) <= 1e-5 and rel_l2(res.audio_latents, a_ref) <= 1e-5


def test_released_adaln_gives_same_latents(models):
    ref, _ = models
    model = ours_from(ref, CONFIG)
    prompt, tags = torch.randn(1, 5, 24), torch.ones(5, dtype=torch.long)
    lay = layout.build_t2va(tags, LF, LH, LW, NA)
    expected = _ours(model, lay, prompt, 9)
    model.precompute_modulation(schedule_timestep_values(lay, JointSchedule.create(STEPS)))
    model.release_adaln()
    got = _ours(model, lay, prompt, 9)
    assert rel_l2(got.video_latents, expected.video_latents) <= 1e-6


def test_progress_and_cancel(models):
    _, ours = models
    prompt, tags = torch.randn(1, 5, 24), torch.ones(5, dtype=torch.long)
    lay = layout.build_t2va(tags, LF, LH, LW, NA)
    cancel, seen = threading.Event(), []

    def on_step(info):
        seen.append((info.index, info.total))
        if info.index == 1:
            cancel.set()

    req = SamplingRequest(lay, prompt, LF, LH, LW, NA)
    with pytest.raises(Cancelled, match="cancelled during step 3 of 4|cancelled before step 3 of 4"):
        sample(ours, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(0), on_step=on_step, cancel=cancel)
    assert seen == [(0, 4), (1, 4)]


def test_condition_mismatch_is_reported(models):
    _, ours = models
    prompt, tags = torch.randn(1, 5, 24), torch.ones(5, dtype=torch.long)
    lay = layout.build_t2va(tags, LF, LH, LW, NA, keyframes=("first",))
    req = SamplingRequest(lay, prompt, LF, LH, LW, NA, condition_latents=[torch.randn(1, 4, 1, LH * 2, LW)])
    with pytest.raises(Exception, match="canvas and conditioning disagree"):
        sample(ours, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(0))


def test_one_shot_release_keeps_latents_and_frees_the_adaln(models):
    ref, _ = models
    prompt, tags = torch.randn(1, 5, 24), torch.ones(5, dtype=torch.long)
    lay = layout.build_t2va(tags, LF, LH, LW, NA)
    kept, released = ours_from(ref, CONFIG), ours_from(ref, CONFIG)
    before = sum(p.numel() for p in released.parameters())
    req = SamplingRequest(lay, prompt, LF, LH, LW, NA)
    a = sample(kept, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(2))
    b = sample(released, req, JointSchedule.create(STEPS), torch.Generator().manual_seed(2), release_adaln=True)
    assert torch.equal(a.video_latents, b.video_latents) and torch.equal(a.audio_latents, b.audio_latents)
    assert released.adaln_released and sum(p.numel() for p in released.parameters()) < before
    # A resident model keeps one schedule's tables at a time, not every schedule it has served.
    sample(kept, req, JointSchedule.create(STEPS + 2), torch.Generator().manual_seed(2))
    assert set(kept._modulation_cache) == schedule_timestep_values(lay, JointSchedule.create(STEPS + 2))


def test_the_last_steps_denoised_estimate_is_the_result_and_previews_show_its_layout():
    """StepInfo.denoised: x - sigma_next * v; after the last step sigma is 0, so it is the final latent itself.
    The preview of a latent with a bright left half shows two halves apart."""
    from h3_spark.h3_model.checkpoint.synthetic import random_state
    from h3_spark.h3_model.dit.config import TINY
    from h3_spark.h3_model.dit.layout import build_t2va
    from h3_spark.h3_model.dit.model import H3DiT
    from h3_spark.h3_model.pipeline.preview import latent_frames, preview_image
    from h3_spark.h3_model.pipeline.sampler import SamplingRequest, sample
    from h3_spark.h3_model.pipeline.scheduler import JointSchedule

    model = H3DiT(TINY, device="meta")
    model.load_state(random_state(TINY, 6), device="cpu")
    tags = torch.ones(5, dtype=torch.long)
    prompt = torch.randn(1, 5, TINY.text_dim, generator=torch.Generator().manual_seed(3))
    lf, lh, lw, na = 7, 4, 6, 40
    req = SamplingRequest(build_t2va(tags, lf, lh, lw, na, TINY.patch_size), prompt, lf, lh, lw, na)
    seen = []
    result = sample(model.eval(), req, JointSchedule.create(4), torch.Generator().manual_seed(2),
                    on_step=lambda s: seen.append(s.denoised()))
    final = latent_frames(seen[-1], TINY.in_channels, lf, lh, lw, TINY.patch_size)
    assert torch.equal(final, result.video_latents[0].float())
    latents = torch.randn(TINY.in_channels, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    latents[:5, :, :, :4] += 3.0
    image = preview_image(latents, max_size=64)
    assert image.dtype == torch.uint8 and tuple(image.shape) == (64, 64, 3)
    left, right = image[:, :32].float().mean(), image[:, 32:].float().mean()
    assert abs(left - right) > 40
    with pytest.raises(ValueError, match="a preview needs"):
        preview_image(torch.zeros(2, 1, 4, 4))
