"""The ControlNet's ComfyUI nodes: H3 ControlNet Loader and H3 ControlNet Apply, whose CONDITIONING the H3 Sampler
takes; the node graph gives the pipeline's latents bit for bit (fake ComfyUI, tiny models)."""

import pytest
import torch

from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint.controlnet import load_tower, random_getter, synthetic_config, write_controlnet
from h3_spark.h3_model.controlnet.hint import ControlRequest
from h3_spark.h3_model.dit.config import TINY
from test_nodes import FRAMES, H, STEPS, W, fake_comfy, load_all, models, node, pipeline_for  # noqa: F401


@pytest.fixture(scope="module")
def controlnet_file(models):  # noqa: F811
    folder = models / "models" / "model_patches"
    folder.mkdir(exist_ok=True)
    path = folder / "union-tiny.safetensors"
    config = synthetic_config(TINY, union2=False, comfy=False)
    write_controlnet(path, config, random_getter(config, 7), "released")
    return path


def _video(frames=10, h=48, w=80, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, h, w, 3), generator=g, dtype=torch.uint8).float() / 255  # on the u8 grid


@pytest.mark.slow
def test_graph_with_controlnet_equals_pipeline(models, controlnet_file, monkeypatch):  # noqa: F811
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    fake_comfy(monkeypatch, models)
    model, te, vae = load_all(models)
    cn = node("H3SparkControlNetLoader").load(controlnet_file.name)[0]
    cond, latent = node("H3SparkTextToVideo").encode(te, "a dancer", W, H, FRAMES)
    video = _video()
    controlled, = node("H3SparkControlNetApply").apply(cond, cn, vae, latent, 0.9, 0.0, 0.8, control_video=video)
    out = node("H3SparkSampler").sample(model, controlled, latent, 5, STEPS, 12.0, 3.0)[0]

    pipeline = pipeline_for(model, te, vae, "t2va")
    pipeline.c.controlnet = load_tower(controlnet_file, TINY, dtype=torch.float32)
    pipeline.decode = False
    req = GenerationRequest("t2va", "a dancer", width=W, height=H, frames=FRAMES, steps=STEPS + 1, seed=5,
                            control=ControlRequest(video=(video * 255).round().to(torch.uint8), strength=0.9, end=0.8))
    theirs = pipeline.generate(req)
    assert theirs.info["control"]["evaluations"] >= 1
    assert torch.equal(out["samples"][0], theirs.video_latents)
    plain = node("H3SparkSampler").sample(model, cond, latent, 5, STEPS, 12.0, 3.0)[0]
    assert not torch.equal(plain["samples"][0], out["samples"][0])


def test_strength_zero_or_no_input_leaves_the_conditioning(models, controlnet_file, monkeypatch):  # noqa: F811
    fake_comfy(monkeypatch, models)
    cn = node("H3SparkControlNetLoader").load(controlnet_file.name)[0]
    cond = [[torch.zeros(1, 3, TINY.text_dim), {"minimax_token_tags": torch.ones(3)}]]
    apply = node("H3SparkControlNetApply").apply
    assert apply(cond, cn, None, None, 0.0, 0.0, 1.0, control_video=_video()) == (cond,)
    assert apply(cond, cn, None, None, 1.0, 0.0, 1.0) == (cond,)


def test_bad_inputs_are_one_line(models, controlnet_file, monkeypatch):  # noqa: F811
    fake_comfy(monkeypatch, models)
    with pytest.raises(CheckpointError, match="holds the DiT \\(give it with --dit\\), not an H3 Fun ControlNet"):
        from h3_spark.nodes import engine

        engine.load_controlnet(models / "models" / "diffusion_models" / "tiny-t2va.safetensors")
    model, te, vae = load_all(models)
    cn = node("H3SparkControlNetLoader").load(controlnet_file.name)[0]
    cond, latent = node("H3SparkTextToVideo").encode(te, "a dancer", W, H, FRAMES)
    with pytest.raises(InputError, match="the inpaint mask is 32x32 but the canvas is 64x64"):
        node("H3SparkControlNetApply").apply(cond, cn, vae, latent, 1.0, 0.0, 1.0, mask=torch.ones(1, 32, 32))
    with pytest.raises(InputError, match="the inpaint mask is 32x32 but its source video is 80x48"):
        node("H3SparkControlNetApply").apply(cond, cn, vae, latent, 1.0, 0.0, 1.0, mask=torch.ones(1, 32, 32),
                                             source_video=_video())
