"""The files ComfyUI's H3 workflow templates download, as tiny synthetic files under their real names, written by
make-checkpoint and read by the real loaders in their stored form: the pruned int8_convrot DiTs (FL2VA, Ref2VA,
FastH3 V2, FastH3 OmniRef and OmniRef's bf16 twin), the int8_convrot text encoder (the nvfp4_awq one's drop-in
swap) and the Turbo LoRAs; what inspect says of each; their bad forms.

Budgets: a LoRA merged onto a stored int8 layer is the layer's exact dequantized weight plus strength x B @ A
(fp32, relative L2 <= 1e-6, the oracle written out here on LightX2V's diffusers names); the ComfyUI and the
LightX2V Turbo files of one seed merge to identical weights (bit for bit); an int8_convrot gate is its bf16
draw within the per-row int8 rounding (relative L2 < 1 %, above 1e-4: it was rounded).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.cli import main
from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.checkpoint.fasth3 import is_fasth3
from h3_spark.h3_model.checkpoint.lora import LoraSpec, apply_loras
from h3_spark.h3_model.checkpoint.published import partition_from_name
from h3_spark.kernels.stored_linear import StoredLinear
from oracle import rel_l2

BASE = {"minimax_h3_fl2va_pruned_int8_convrot": "t2va", "minimax_h3_ref2va_pruned_int8_convrot": "ref2va"}
FAST = {"fastvideo_fasth3_8step_v2_pruned_int8_convrot": "t2va", "fasth3_omniref_8step_pruned_int8_convrot": "ref2va"}
OMNIREF_BF16 = "fasth3_omniref_8step_pruned_bf16"
TURBO = {"minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16": "t2va",
         "minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16": "t2va",
         "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16": "ref2va"}
SEED = 5


def _make(*argv) -> int:
    return main(["make-checkpoint", *map(str, argv)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    for name in BASE:
        assert _make(root / f"{name}.safetensors", "--layout", "comfy-pruned", "--format", "int8_convrot",
                     "--seed", SEED) == 0
    for name in FAST:
        assert _make(root / f"{name}.safetensors", "--fasth3", "--layout", "comfy-pruned", "--format",
                     "int8_convrot", "--quantize-gates", "--seed", SEED) == 0
    assert _make(root / f"{OMNIREF_BF16}.safetensors", "--fasth3", "--layout", "comfy-pruned", "--seed", SEED) == 0
    for i, name in enumerate(TURBO):
        assert _make(root / f"{name}.safetensors", "--component", "turbo", "--seed", i) == 0
        assert _make(root / f"{name}.released.safetensors", "--component", "turbo", "--layout", "released",
                     "--seed", i) == 0
    return root


def _path(files, name):
    return files / f"{name}.safetensors"


# ------------------------------------------------------------------------------------------ the DiTs
@pytest.mark.parametrize("name", list(BASE) + list(FAST) + [OMNIREF_BF16])
def test_each_dit_loads_in_its_stored_form(files, name):
    reader = open_dit(_path(files, name))
    reader.check()
    fast = name not in BASE
    assert reader.detected.layout == "comfy-pruned" and reader.config.curve_form
    assert reader.config.gate_compress == fast == is_fasth3(reader)
    model = load_dit(_path(files, name), stored=True)
    blocks = model.transformer_blocks
    assert all(isinstance(b.attn.to_q, StoredLinear) == name.endswith("int8_convrot") for b in blocks)
    gates = [b.attn.to_gate_compress for b in blocks]
    assert all(g is None for g in gates) if not fast else all(g is not None for g in gates)
    if fast:  # the published int8 files store the gates int8_convrot too; the bf16 twin keeps them bf16
        assert all(isinstance(g, StoredLinear) == name.endswith("int8_convrot") for g in gates)


def test_quantized_gates_are_the_bf16_gates_within_int8_rounding(files):
    """One seed, one model: OmniRef's int8 file and its bf16 twin hold the same gates, rounded two ways; the
    stored gate computes what its dequantized weight does."""
    int8 = load_dit(_path(files, "fasth3_omniref_8step_pruned_int8_convrot"))
    bf16 = load_dit(_path(files, OMNIREF_BF16))
    stored = load_dit(_path(files, "fasth3_omniref_8step_pruned_int8_convrot"), stored=True)
    x = torch.randn(1, 7, int8.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for a, b, s in zip(int8.transformer_blocks, bf16.transformer_blocks, stored.transformer_blocks):
        error = rel_l2(a.attn.to_gate_compress.weight, b.attn.to_gate_compress.weight)
        assert 1e-4 < error < 0.01, error
        assert rel_l2(s.attn.compress_gate(x), a.attn.compress_gate(x)) <= 1e-6


def test_fasth3_is_told_by_its_gates_without_the_config_metadata(files, tmp_path):
    """Our writer adds a `config` metadata entry; a repacked published file may not have one: the gates' names
    still make it FastH3, the table still makes it pruned, and the same model loads (the time MLP's sizes, which
    a pruned file has no tensor for, are all the entry adds)."""
    src = _path(files, "fastvideo_fasth3_8step_v2_pruned_int8_convrot")
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bare = tmp_path / src.name
    save_file(tensors, str(bare))
    reader = open_dit(bare)
    reader.check()
    assert reader.config.gate_compress and reader.config.curve_form
    ours, theirs = dict(load_dit(src).named_parameters()), dict(load_dit(bare).named_parameters())
    assert set(theirs) == set(ours) and all(torch.equal(p, ours[n]) for n, p in theirs.items())


@pytest.mark.parametrize("name, partition", [*BASE.items(), *FAST.items(), (OMNIREF_BF16, "ref2va"), *TURBO.items()])
def test_the_name_says_the_partition(files, name, partition):
    from h3_spark.nodes.engine import detect_partition

    assert partition_from_name(f"{name}.safetensors") == partition
    if name in TURBO:
        return
    assert detect_partition(_path(files, name), "auto") == partition  # the ComfyUI loader node's "auto"


# ------------------------------------------------------------------------------------------ the Turbo LoRAs
def _released_deltas(path):
    """LightX2V's file read by hand: diffusers parameter -> B @ A (alpha = rank in its header: scale 1)."""
    with safe_open(str(path), "pt") as f:
        assert float(f.metadata()["alpha"]) == f.get_tensor(next(k for k in f.keys() if "lora_A" in k)).shape[0]
        tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    return {k.replace(".lora_A.default.weight", ".weight"): tensors[k.replace("lora_A", "lora_B")] @ a
            for k, a in tensors.items() if ".lora_A." in k}


@pytest.mark.parametrize("dit", list(BASE) + list(FAST))
def test_turbo_loras_merge_onto_the_stored_pruned_int8_dit(files, dit):
    """The existing rule for a stored layer: a LoRA merges into its values, so each layer it touches becomes
    the dense linear of its exact dequantized weight plus the delta; the layers it does not touch (the gates,
    the AdaLN) stay as stored or as they were."""
    name = next(n for n, p in TURBO.items() if p == (FAST.get(dit) or BASE.get(dit)))
    base = dict(load_dit(_path(files, dit)).named_parameters())  # dequantized at load: the exact weights
    model = load_dit(_path(files, dit), stored=True)
    report = apply_loras(model, [LoraSpec(_path(files, name), 0.75)])
    deltas = _released_deltas(files / f"{name}.released.safetensors")
    assert report[0]["merged"] == len(deltas) and report[0]["replaced"] == 0
    params = dict(model.named_parameters())
    for param, delta in deltas.items():
        assert rel_l2(params[param], base[param] + 0.75 * delta) <= 1e-6, param
    untouched = [n for n in params if n not in deltas]
    assert any("adaln_proj" in n for n in untouched)
    assert all(torch.equal(params[n], base[n]) for n in untouched)
    assert all(not isinstance(b.attn.to_q, StoredLinear) for b in model.transformer_blocks)
    if dit in FAST:
        assert all(isinstance(b.attn.to_gate_compress, StoredLinear) for b in model.transformer_blocks)


def test_a_lora_in_the_pruned_adaln_basis_merges_onto_the_pruned_dit(files, tmp_path):
    """The form ComfyUI conversions give AdaLN adapters for a pruned DiT (the Turbo LoRAs have none): lora_A
    reads the curve table's k-wide coordinates, a diff_b carries the bias change."""
    dit = _path(files, "minimax_h3_ref2va_pruned_int8_convrot")
    gen = torch.Generator().manual_seed(3)
    a, b, db = torch.randn(3, 4, generator=gen), torch.randn(432, 3, generator=gen), torch.randn(432, generator=gen)
    path = tmp_path / "adaln.safetensors"
    save_file({"diffusion_model.blocks.1.adaln_proj.linear.lora_A.weight": a,
               "diffusion_model.blocks.1.adaln_proj.linear.lora_B.weight": b,
               "diffusion_model.blocks.1.adaln_proj.linear.diff_b": db}, str(path))
    model = load_dit(dit, stored=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_loras(model, [LoraSpec(path, 0.5)])
    params = dict(model.named_parameters())
    layer = "transformer_blocks.1.adaln_proj.linear"
    assert rel_l2(params[f"{layer}.weight"], before[f"{layer}.weight"] + 0.5 * b @ a) <= 1e-6
    assert rel_l2(params[f"{layer}.bias"], before[f"{layer}.bias"] + 0.5 * db) <= 1e-6
    assert all(torch.equal(p, before[n]) for n, p in params.items() if not n.startswith(layer))


def test_the_comfyui_and_lightx2v_turbo_files_merge_alike(files):
    dit = _path(files, "minimax_h3_fl2va_pruned_int8_convrot")
    name = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16"
    comfy, released = load_dit(dit, stored=True), load_dit(dit, stored=True)
    apply_loras(comfy, [LoraSpec(_path(files, name), 1.0)])
    apply_loras(released, [LoraSpec(files / f"{name}.released.safetensors", 1.0)])
    theirs = dict(released.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in comfy.named_parameters())


def test_the_turbo_file_has_the_published_layout(files):
    """ComfyUI's names under diffusion_model., fused qkv of three times the rank, bf16, no alpha, no AdaLN."""
    with safe_open(str(_path(files, "minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16")), "pt") as f:
        keys = set(f.keys())
        qkv = f.get_tensor("diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight")
        up = f.get_tensor("diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight")
        dtypes = {f.get_tensor(k).dtype for k in keys}
    assert all(k.startswith("diffusion_model.") for k in keys) and dtypes == {torch.bfloat16}
    assert not any(k.endswith(".alpha") or "adaln" in k for k in keys)
    assert qkv.shape[0] == 3 * 4 and up.shape == (3 * 32, 3 * 4)
    assert "diffusion_model.token_refiner.blocks.1.mlp.fc1.lora_B.weight" in keys


def test_turbo_full_preset_is_the_published_size():
    """Rank 128 on the six linears of 50 DiT and 2 refiner blocks, qkv fused block-diagonally, bf16: the 1.82 GiB
    of the published Ref2VA file (computed from the plan; nothing is written)."""
    from h3_spark.h3_model.checkpoint.turbo import TURBO_RANK, _comfy_groups
    from h3_spark.h3_model.dit.config import preset

    size = sum(g.nbytes for g in _comfy_groups(preset("full"), TURBO_RANK["full"], 0))
    assert size == 1_956_118_528 and round(size / 2 ** 30, 2) == 1.82


# ------------------------------------------------------------------------------------------ inspect
def _inspect(capsys, path, tmp_path):
    assert main(["inspect", str(path), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    name = path.name.removesuffix(".safetensors")
    return out, json.loads((tmp_path / f"{name}.inspect.json").read_text())


@pytest.mark.parametrize("name, says", [
    ("fastvideo_fasth3_8step_v2_pruned_int8_convrot",
     "by its file name: FastH3 V2 (FastVideo's T2VA/FL2VA student), 8 steps, the t2va/fl2va partition"),
    ("fasth3_omniref_8step_pruned_int8_convrot",
     "by its file name: FastH3 OmniRef (FastVideo's Ref2VA student), 8 steps, the ref2va partition"),
    ("minimax_h3_ref2va_pruned_int8_convrot", "by its file name: the ref2va partition")])
def test_inspect_names_each_dit(files, capsys, tmp_path, name, says):
    out, report = _inspect(capsys, _path(files, name), tmp_path)
    assert says in out
    assert report["fasth3"] == (name in FAST) and report["curve_form"] and report["complete"]
    assert report["quantization"]["formats"] == {"int8_convrot": 4 * 2 + 2 * (name in FAST)}
    assert "the tensors cannot tell the t2va/fl2va partition from the ref2va one" in out
    assert ("nor FastH3 V2 from FastH3 OmniRef" in out) == (name in FAST)


def test_inspect_names_a_turbo_lora(files, capsys, tmp_path):
    out, report = _inspect(capsys, _path(files, "minimax_h3_fl2v_turbo_4step_v1.0_768p_comfyui_bf16"), tmp_path)
    assert report["model"] == "lora" and report["prefix"] == "diffusion_model." and report["complete"]
    assert report["targets"] == {"attention q/k/v": {"layers": 4, "ranks": [12]},
                                 "attention out": {"layers": 4, "ranks": [4]},
                                 "feed-forward": {"layers": 8, "ranks": [4]}}
    assert report["name_says"] == {"family": "Turbo LoRA (few-step distillation)", "steps": 4, "version": "v1.0",
                                   "resolution": "768p", "partition": "t2va"}
    assert "no AdaLN adapter: merges onto a full or a pruned DiT alike" in out
    assert "alpha: none (alpha = rank: scale 1)" in out
    assert ("the tensors cannot tell what the LoRA was trained for (a Turbo LoRA is an ordinary LoRA of these "
            "targets); nor which partition it was trained on") in out


def test_inspect_says_which_adaln_a_lora_reads(tmp_path, capsys):
    """A pruned-DiT LoRA's AdaLN adapters read the curve table's width (Kijai's conversions: lora_A [r, k] and a
    diff_b bias delta); a full-AdaLN LoRA's the time embedding's."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "pruned_adaln.safetensors"
    save_file({"diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight": torch.randn(3, 4, generator=gen),
               "diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight": torch.randn(432, 3, generator=gen),
               "diffusion_model.blocks.0.adaln_proj.linear.diff_b": torch.randn(432, generator=gen)}, str(path))
    out, report = _inspect(capsys, path, tmp_path)
    assert report["adaln_input_widths"] == [4] and report["full deltas (.diff / .diff_b)"] == 1
    assert "AdaLN adapters read a 4-wide input" in out and "complete" in out


# ------------------------------------------------------------------------------------------ the text encoder
@pytest.mark.slow  # three text encoders written and loaded: ~5 s alone, over 10 s on a loaded 2-core machine
def test_the_int8_text_encoder_is_a_drop_in_swap_for_the_nvfp4_one(tmp_path, capsys):
    """The T2I template's note: swap qwen3vl_32b_minimax_h3_nvfp4_awq for ..._int8_convrot and nothing else. One
    seed's two files share the tokenizer folder and encode one prompt alike within their roundings."""
    from fixtures import qwen_tiny as Q
    from h3_spark.h3_model.text.encoder import TextEncoder

    if not Q.HAS_TORCHVISION:
        pytest.skip("transformers' Qwen3-VL processor needs torchvision")
    tokenizer = tmp_path / "tokenizer"
    outs = {}
    for fmt in ("nvfp4_awq", "int8_convrot", "bf16"):
        path = tmp_path / f"qwen3vl_32b_minimax_h3_{fmt}.safetensors"
        argv = ["--component", "text_encoder", "--format", fmt]
        if fmt == "nvfp4_awq":
            argv += ["--tokenizer-out", tokenizer]
        assert _make(path, *argv) == 0
        te = TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=tokenizer, layer=2)
        outs[fmt] = te.encode(te.prompts.t2va("a red fox runs")).embeds
    capsys.readouterr()
    assert 1e-4 < rel_l2(outs["int8_convrot"], outs["bf16"]) < 0.03
    assert rel_l2(outs["int8_convrot"], outs["bf16"]) < rel_l2(outs["nvfp4_awq"], outs["bf16"]) < 0.35
    out, report = _inspect(capsys, tmp_path / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors", tmp_path)
    assert report["model"] == "text_encoder" and report["quantization"]["formats"] == {"int8_convrot": 14}


# ------------------------------------------------------------------------------------------ bad input
def test_a_fasth3_file_missing_a_gate_is_refused_in_one_line(files, tmp_path):
    src = _path(files, "fasth3_omniref_8step_pruned_int8_convrot")
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("blocks.1.attn.to_gate_compress.")}
        metadata = f.metadata()
    gapped = tmp_path / src.name
    save_file(tensors, str(gapped), metadata=metadata)
    with pytest.raises(CheckpointError, match=rf"^{gapped}: 1 tensors missing, e\.g\. transformer_blocks\.1\.attn\."
                                              r"to_gate_compress\.weight \(file name: blocks\.1\.attn\."
                                              r"to_gate_compress\.weight\)$"):
        load_dit(gapped, stored=True)


def test_loras_whose_targets_the_dit_lacks_are_refused_in_one_line(files, tmp_path):
    pruned = _path(files, "minimax_h3_fl2va_pruned_int8_convrot")
    gen = torch.Generator().manual_seed(0)
    # A full-AdaLN LoRA (its A reads the time embedding, 16 wide in the tiny model) on the pruned DiT (4 wide).
    full = tmp_path / "full_adaln.safetensors"
    save_file({"diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight": torch.randn(2, 16, generator=gen),
               "diffusion_model.blocks.0.adaln_proj.linear.lora_B.weight": torch.randn(432, 2, generator=gen)},
              str(full))
    model = load_dit(pruned, stored=True)
    with pytest.raises(CheckpointError, match=rf"^{full}: transformer_blocks\.0\.adaln_proj\.linear\.weight delta "
                                              r"\(432, 16\) does not fit the weight \(432, 4\) \(a LoRA for full "
                                              r"checkpoints on a pruned one\?\)$"):
        apply_loras(model, [LoraSpec(full, 1.0)])
    # A gate LoRA on a DiT without gates, and a LoRA for more blocks than the DiT has.
    for name, layer in (("gate", "blocks.0.attn.to_gate_compress"), ("deep", "blocks.7.attn.out_proj")):
        path = tmp_path / f"{name}.safetensors"
        save_file({f"diffusion_model.{layer}.lora_A.weight": torch.randn(2, 24, generator=gen),
                   f"diffusion_model.{layer}.lora_B.weight": torch.randn(24, 2, generator=gen)}, str(path))
        with pytest.raises(CheckpointError, match=rf"^{path}: 1 LoRA tensors match no H3 layer, e\.g\. "
                                                  rf"diffusion_model\.{layer}$"):
            apply_loras(model, [LoraSpec(path, 1.0)])
    assert all(isinstance(b.attn.to_q, StoredLinear) for b in model.transformer_blocks)  # nothing was touched


@pytest.mark.parametrize("argv, message", [
    (["--quantize-gates", "--format", "int8_convrot"],
     "--quantize-gates applies to --fasth3 (the VSA gates are a FastH3 model's)"),
    (["--fasth3", "--quantize-gates"], "--quantize-gates stores the gates in --format: it takes a comfy layout "
                                       "and a quantized --format (int8_convrot for the published files)"),
    (["--fasth3", "--layout", "released"], "--fasth3 writes the diffusers, comfy, comfy-pruned layout, not released"),
    (["--fasth3", "--quantize-gates", "--format", "gguf:Q8_0"],
     "--quantize-gates is for the comfy_quant formats; a GGUF stores every 2-D weight whose rows its blocks fit, the "
     "VSA gates included"),
    (["--component", "turbo", "--format", "int8_convrot"],
     "--component turbo takes only --preset, --layout comfy|released, --seed and --force (the published Turbo "
     "LoRAs are one bf16 .safetensors file)"),
    (["--component", "turbo", "--layout", "comfy-pruned"], "--component turbo takes only --preset")])
def test_bad_make_checkpoint_requests_are_refused_in_one_line(tmp_path, capsys, argv, message):
    assert _make(tmp_path / "x.safetensors", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.safetensors").exists()


def test_a_turbo_lora_needs_a_safetensors_path(tmp_path):
    from h3_spark.h3_model.checkpoint.turbo import make_turbo_lora
    from h3_spark.h3_model.dit.config import TINY

    with pytest.raises(InputError, match=r"x\.bin: a Turbo LoRA is one file; give a path ending in \.safetensors$"):
        make_turbo_lora(tmp_path / "x.bin", TINY, rank=2)
