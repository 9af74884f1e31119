"""LoRA merging against diffusers' own LoRA key conversion (the oracle for names, splits and alpha).

Expected weights are W + strength * B @ A with diffusers' converted (alpha-folded) A/B;
tolerance rel L2 <= 1e-6 in fp32.
"""

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

from h3_spark.h3_model.dit.config import TINY
from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint.lora import LoraSpec, apply_loras
from oracle import diffusers_dit, ours_from, rel_l2

RANK = 3
# diffusers' converter assumes the released 128-wide heads for DiffSynth's interleaved qkv.
WIDE_HEADS = dataclasses.replace(TINY, attention_head_dim=128)


def _layers(c):  # original layer name -> (out, in)
    return {
        "blocks.0.attn.qkv_proj": (3 * c.inner_dim, c.hidden_size),
        "blocks.1.attn.out_proj": (c.hidden_size, c.inner_dim),
        "blocks.0.mlp.fc1": (2 * c.ffn_dim, c.hidden_size),
        "blocks.1.mlp.fc2": (c.hidden_size, c.ffn_dim),
        "blocks.1.adaln_proj.linear": (18 * c.hidden_size, c.time_embed_dim),
        "token_refiner.blocks.1.attn.qkv_proj": (3 * c.inner_dim, c.hidden_size),
        "final_layer.video_out": (c.video_patch_dim, c.hidden_size),
    }


def _pairs(style, config, seed=0, alpha=None):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer, (n, k) in _layers(config).items():
        a, b = torch.randn(RANK, k, generator=gen), torch.randn(n, RANK, generator=gen)
        if style == "aitoolkit":
            out[f"diffusion_model.{layer}.lora_A.weight"], out[f"diffusion_model.{layer}.lora_B.weight"] = a, b
        elif style == "kohya":
            out[f"{layer}.lora_down.weight"], out[f"{layer}.lora_up.weight"] = a, b
            out[f"{layer}.alpha"] = torch.tensor(float(alpha))
        elif style == "musubi":
            flat = "lora_unet_" + layer.replace(".", "_")
            out[f"{flat}.lora_down.weight"], out[f"{flat}.lora_up.weight"] = a, b
        elif style == "diffsynth":
            out[f"{layer}.lora_A.default.weight"], out[f"{layer}.lora_B.default.weight"] = a, b
    return out


def _expected(model, tensors, strength):
    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(dict(tensors))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for key, a in converted.items():
        if ".lora_A." not in key:
            continue
        layer = key.removeprefix("transformer.").rsplit(".lora_A.", 1)[0]
        b = converted[key.replace(".lora_A.", ".lora_B.")]
        expected[f"{layer}.weight"] += strength * (b.float() @ a.float())
    return expected


@pytest.mark.parametrize("style,alpha", [("aitoolkit", None), ("kohya", 1.5), ("musubi", None), ("diffsynth", None)])
def test_merge_matches_diffusers_conversion(tmp_path, style, alpha):
    config = WIDE_HEADS if style == "diffsynth" else TINY
    model = ours_from(diffusers_dit(config), config)
    tensors = _pairs(style, config, alpha=alpha)
    path = tmp_path / f"{style}.safetensors"
    save_file(tensors, str(path))
    expected = _expected(model, tensors, 0.7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reports = apply_loras(model, [LoraSpec(path, 0.7)])
    assert reports[0]["merged"] == 11  # 7 layers, two fused qkv split into three each
    changed = 0
    for name, param in model.named_parameters():
        assert rel_l2(param, expected[name]) <= 1e-6, name
        changed += not torch.equal(param, before[name])
    assert changed == 11


def test_metadata_alpha_scales(tmp_path):
    model = ours_from(diffusers_dit(TINY), TINY)
    before = model.transformer_blocks[1].ff.net[2].weight.detach().clone()
    tensors = {"blocks.1.mlp.fc2.lora_A.weight": torch.randn(4, TINY.ffn_dim),
               "blocks.1.mlp.fc2.lora_B.weight": torch.randn(TINY.hidden_size, 4)}
    path = tmp_path / "a.safetensors"
    save_file(tensors, str(path), metadata={"alpha": "2"})
    apply_loras(model, [LoraSpec(path, 1.0)])
    want = before + 0.5 * tensors["blocks.1.mlp.fc2.lora_B.weight"] @ tensors["blocks.1.mlp.fc2.lora_A.weight"]
    assert rel_l2(model.transformer_blocks[1].ff.net[2].weight, want) <= 1e-6


def test_pruned_replacement_tensors_stack(tmp_path):
    from h3_spark.h3_model.dit.model import H3DiT

    config = dataclasses.replace(TINY, adaln_curve_grid=9, time_embed_dim=4)
    model = H3DiT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    base = model.transformer_blocks[0].adaln_proj.linear.weight.detach().clone()
    shape = tuple(base.shape)
    new1, new2 = torch.randn(shape), torch.randn(shape)
    p1, p2 = tmp_path / "p1.safetensors", tmp_path / "p2.safetensors"
    save_file({"blocks.0.adaln_proj.linear.weight": new1}, str(p1))
    save_file({"diffusion_model.blocks.0.adaln_proj.linear.set_weight": new2}, str(p2))
    reports = apply_loras(model, [LoraSpec(p1, 1.0), LoraSpec(p2, 0.5)])
    assert [r["replaced"] for r in reports] == [1, 1]
    want = base + 1.0 * (new1 - base) + 0.5 * (new2 - base)
    assert rel_l2(model.transformer_blocks[0].adaln_proj.linear.weight, want) <= 1e-6


def test_spec_parsing():
    assert LoraSpec.parse("a/b.safetensors:0.5") == LoraSpec(__import__("pathlib").Path("a/b.safetensors"), 0.5)
    assert LoraSpec.parse("turbo.safetensors").strength == 1.0
    assert str(LoraSpec.parse("C:/x/y.safetensors").path) == "C:/x/y.safetensors"


def test_lora_errors(tmp_path):
    model = ours_from(diffusers_dit(TINY), TINY)
    with pytest.raises(InputError, match="no such LoRA file"):
        apply_loras(model, [LoraSpec(tmp_path / "missing.safetensors")])
    pickle = tmp_path / "x.pt"
    pickle.write_bytes(b"\x80\x04")
    with pytest.raises(InputError, match="pickle files are refused"):
        apply_loras(model, [LoraSpec(pickle)])
    bad = tmp_path / "bad.safetensors"
    save_file({"blocks.0.attn.nope.lora_A.weight": torch.randn(2, 3), "blocks.0.attn.nope.lora_B.weight":
               torch.randn(3, 2)}, str(bad))
    with pytest.raises(CheckpointError, match="match no H3 layer"):
        apply_loras(model, [LoraSpec(bad)])
    wrong = tmp_path / "wrong.safetensors"
    save_file({"blocks.1.adaln_proj.linear.lora_A.weight": torch.randn(2, 99),
               "blocks.1.adaln_proj.linear.lora_B.weight": torch.randn(18 * TINY.hidden_size, 2)}, str(wrong))
    with pytest.raises(CheckpointError, match="does not fit"):
        apply_loras(model, [LoraSpec(wrong)])
    full_on_pruned = tmp_path / "full.safetensors"
    save_file({"blocks.0.adaln_proj.linear.weight": torch.randn(5, 5)}, str(full_on_pruned))
    with pytest.raises(CheckpointError, match="pruned-checkpoint LoRAs need a pruned checkpoint"):
        apply_loras(model, [LoraSpec(full_on_pruned)])


@pytest.mark.parametrize("layer,original", [
    ("diffusion_model.blocks.0.mlp.fc1", "blocks.0.mlp.fc1"),
    ("lora_unet_token_refiner_blocks_1_mlp_fc1", "token_refiner.blocks.1.mlp.fc1"),
])
def test_diff_on_original_fc1_equals_the_same_delta_as_a_pair(tmp_path, layer, original):
    """A full `.diff` is the product B @ A of a full-rank pair (B = diff, A = I); diffusers' conversion of
    that pair (which swaps fc1's [gate; value] halves) is the oracle for where the diff must land."""
    c = TINY
    model = ours_from(diffusers_dit(c), c)
    diff = torch.randn(2 * c.ffn_dim, c.hidden_size, generator=torch.Generator().manual_seed(3))
    pair = {f"{original}.lora_A.weight": torch.eye(c.hidden_size), f"{original}.lora_B.weight": diff}
    expected = _expected(model, pair, 0.6)
    path = tmp_path / "diff.safetensors"
    save_file({f"{layer}.diff": diff}, str(path))
    apply_loras(model, [LoraSpec(path, 0.6)])
    for name, param in model.named_parameters():
        assert rel_l2(param, expected[name]) <= 1e-6, name


def test_diff_on_diffusers_named_proj_is_not_swapped_and_diff_b_is(tmp_path):
    from h3_spark.h3_model.checkpoint.lora import plan_lora

    c = TINY
    model = ours_from(diffusers_dit(c), c)
    before = model.transformer_blocks[1].ff.net[0].proj.weight.detach().clone()
    diff = torch.randn(2 * c.ffn_dim, c.hidden_size, generator=torch.Generator().manual_seed(4))
    path = tmp_path / "diffusers_diff.safetensors"
    save_file({"transformer.transformer_blocks.1.ff.net.0.proj.diff": diff}, str(path))
    apply_loras(model, [LoraSpec(path, 1.0)])
    assert rel_l2(model.transformer_blocks[1].ff.net[0].proj.weight, before + diff) <= 1e-6
    # fc1 has no bias in H3, so a bias delta is refused at merge time; its halves swap like the weight's.
    bias = torch.randn(2 * c.ffn_dim, generator=torch.Generator().manual_seed(5))
    (op,), unmatched = plan_lora(model, {"blocks.0.mlp.fc1.diff_b": bias}, {})
    assert not unmatched and op.param == "transformer_blocks.0.ff.net.0.proj.bias"
    assert torch.equal(op.compute(), torch.cat([bias[c.ffn_dim:], bias[:c.ffn_dim]]))
    save_file({"blocks.0.mlp.fc1.diff_b": bias}, str(tmp_path / "bias.safetensors"))
    with pytest.raises(CheckpointError, match=r"transformer_blocks\.0\.ff\.net\.0\.proj\.bias is not a parameter"):
        apply_loras(model, [LoraSpec(tmp_path / "bias.safetensors")])


# ------------------------------------------------------------------------------------------ published Turbo LoRAs
# Key layouts read from their public sources (research notes: the loaders of ModelTC/Minimax-H3-Turbo and
# zml/zml examples/minimax_h3; diffusers' H3 LoRA converter for the name map). The expected merge is written
# out per layer in plain torch: W + strength * alpha / rank * B @ A on our diffusers-named parameters.
def _turbo_lightx2v(c, rank, gen):
    """LightX2V's Turbo LoRA: a PEFT dump on diffusers names (`.lora_A.default.weight`), q/k/v split, the DiT and
    refiner blocks' attention and feed-forward, no prefix, no AdaLN adapters, alpha in the header."""
    shapes = {"attn.to_q": (c.inner_dim, c.hidden_size), "attn.to_k": (c.inner_dim, c.hidden_size),
              "attn.to_v": (c.inner_dim, c.hidden_size), "attn.to_out.0": (c.hidden_size, c.inner_dim),
              "ff.net.0.proj": (2 * c.ffn_dim, c.hidden_size), "ff.net.2": (c.hidden_size, c.ffn_dim)}
    out, merges = {}, []
    blocks = [f"transformer_blocks.{i}" for i in range(c.num_layers)] + ["token_refiner.refiner_blocks.0",
                                                                          "token_refiner.refiner_blocks.1"]
    for block in blocks:
        for layer, (n, k) in shapes.items():
            a, b = torch.randn(rank, k, generator=gen), torch.randn(n, rank, generator=gen)
            out[f"{block}.{layer}.lora_A.default.weight"], out[f"{block}.{layer}.lora_B.default.weight"] = a, b
            merges.append((f"{block}.{layer}.weight", b @ a))
    return out, merges


def _turbo_native(c, rank, adaln_rank, gen):
    """The community Turbo LoRA zml runs: original names with a `diffusion_model.` prefix, fused qkv (B stacked
    [q; k; v]), fc1 in the original [gate; value] order, every AdaLN projection and the final one, alpha == rank."""
    out, merges = {}, []
    inner, hidden, ffn = c.inner_dim, c.hidden_size, c.ffn_dim

    def add(name, n, k, r):
        a, b = torch.randn(r, k, generator=gen), torch.randn(n, r, generator=gen)
        out[f"diffusion_model.{name}.lora_A.weight"], out[f"diffusion_model.{name}.lora_B.weight"] = a, b
        return a, b

    for ours, native in [(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(c.num_layers)] + \
            [(f"token_refiner.refiner_blocks.{i}", f"token_refiner.blocks.{i}") for i in range(2)]:
        a, b = add(f"{native}.attn.qkv_proj", 3 * inner, hidden, rank)
        for j, part in enumerate(("to_q", "to_k", "to_v")):
            merges.append((f"{ours}.attn.{part}.weight", b[j * inner:(j + 1) * inner] @ a))
        a, b = add(f"{native}.attn.out_proj", hidden, inner, rank)
        merges.append((f"{ours}.attn.to_out.0.weight", b @ a))
        a, b = add(f"{native}.mlp.fc1", 2 * ffn, hidden, rank)
        merges.append((f"{ours}.ff.net.0.proj.weight", torch.cat([b[ffn:], b[:ffn]]) @ a))  # [gate; value] -> ours
        a, b = add(f"{native}.mlp.fc2", hidden, ffn, rank)
        merges.append((f"{ours}.ff.net.2.weight", b @ a))
        if native.startswith("blocks."):
            a, b = add(f"{native}.adaln_proj.linear", 18 * hidden, c.time_embed_dim, adaln_rank)
            merges.append((f"{ours}.adaln_proj.linear.weight", b @ a))
    a, b = add("final_layer.adaln_proj.linear", 2 * hidden, c.time_embed_dim, adaln_rank)
    merges.append(("norm_out.linear.weight", b @ a))
    return out, merges


@pytest.mark.parametrize("layout", ["lightx2v", "native"])
def test_published_turbo_lora_layouts_merge_as_written(tmp_path, layout):
    model = ours_from(diffusers_dit(TINY), TINY)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(7)
    if layout == "lightx2v":
        tensors, merges = _turbo_lightx2v(TINY, 8, gen)
        metadata, scale = {"alpha": "2"}, 2 / 8  # the header's alpha over the rank
    else:
        tensors, merges = _turbo_native(TINY, 6, 2, gen)
        metadata, scale = None, 1.0  # alpha == rank
    path = tmp_path / f"turbo_{layout}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    apply_loras(model, [LoraSpec(path, 0.8)])
    params = dict(model.named_parameters())
    touched = set()
    for name, delta in merges:
        want = before[name] + 0.8 * scale * delta
        assert rel_l2(params[name], want) <= 1e-6, name
        touched.add(name)
    assert all(torch.equal(params[n], before[n]) for n in before if n not in touched)  # nothing else moved
