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
