"""GGUF files: the DiT and text encoder GGUFs read as published, written by make-checkpoint, refused when broken.

Oracle: gguf-py itself (`gguf.GGUFReader` for the file's tensors, `gguf.quants.dequantize` for their values,
`gguf.get_tensor_name_map` for llama.cpp's Qwen3-VL names), never our reader. Claims, each checked bit for bit
(torch.equal) unless said otherwise:
- a tiny DiT written by `make-checkpoint --format gguf:<TYPE>` for every legacy block type (Q8_0, Q5_1, Q5_0,
  Q4_1, Q4_0) and the K-quants Q4_K and Q2_K (on a model whose rows are whole 256-value super-blocks) gives,
  loaded with `stored=True`, the velocities of an H3DiT holding the same tensors dequantized by gguf (fp32 and bf16), and so does `stored=False`; its block layers are StoredLinears of format gguf whose
  codes (q, k, v cut from the fused QKV included) are views of the file's memory map;
- inspect reports the file's version, architecture and every tensor's type and bytes; the engine loads and
  generates with it, stored and dequantized at load giving the same latents;
- the full preset's plan (nothing drawn) has the published pruned files' 532 tensors and their sizes (Q8_0, Q5_0,
  BF16 exactly; the published Q4_K and Q2_K files are mixes, ours one type: within 0.05 GiB);
- a tiny Qwen3-VL in a llama.cpp-named GGUF (F16, Q8_0), without a vision tower, encodes a T2VA prompt as the
  same weights in a dense single file do; an image presentation fails naming the missing tower;
- a text encoder GGUF written by `make-checkpoint --component text_encoder --format gguf:<X>` (tiny, and a tiny
  model whose rows are whole super-blocks, in the Q4_K_M and Q2_K_M mixes) holds gguf's own llama.cpp names and
  llama.cpp's mix rules' types, and encodes as a dense single file of gguf's dequantization of its tensors;
- every broken file fails in one line naming the file and the tensor (a file declaring another architecture:
  test_gguf_mislabelled.py).
"""

import dataclasses
import json
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from h3_spark.cli import main  # noqa: E402
from h3_spark.errors import CheckpointError, InputError  # noqa: E402
from h3_spark.h3_model.checkpoint import keymap, load_dit, open_dit  # noqa: E402
from h3_spark.h3_model.checkpoint.gguf_source import GgufSource  # noqa: E402
from h3_spark.h3_model.checkpoint.gguf_writer import writable_types  # noqa: E402
from h3_spark.h3_model.checkpoint.inspect import inspect_checkpoint  # noqa: E402
from h3_spark.h3_model.checkpoint.dit_reader import expected_shapes  # noqa: E402
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint  # noqa: E402
from h3_spark.h3_model.dit import layout  # noqa: E402
from h3_spark.h3_model.dit.config import TINY  # noqa: E402
from h3_spark.h3_model.dit.model import H3DiT  # noqa: E402
from h3_spark.kernels.stored_linear import StoredLinear  # noqa: E402
from oracle import text_tags  # noqa: E402

LEGACY_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
K_TYPES = ("Q4_K", "Q2_K")
# TINY's 24-wide hidden state is not whole 32-value blocks (its QKV and fc1 fall back to F16, as published files
# do for such rows); this tiny model's rows all are, so every linear, the fused QKV and fc1 included, is blocks.
ALIGNED = dataclasses.replace(TINY, hidden_size=64, text_dim=32, time_embed_dim=32)
# The same for the K-quants' super-blocks of 256: every block linear's rows (hidden, attention width, ffn).
K_ALIGNED = dataclasses.replace(TINY, hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_dim=256,
                                text_dim=32, time_embed_dim=32)


def test_make_checkpoint_writes_the_legacy_blocks_and_the_k_quants():
    assert set(writable_types()) == {"F32", "F16", "BF16", *LEGACY_TYPES, "Q6_K", "Q5_K", *K_TYPES, "Q3_K"}


# ------------------------------------------------------------------------------------------ the oracle
def _gguf_values(path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized by gguf to fp32, in PyTorch order (GGUF's dims reversed)."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        out[t.name] = torch.from_numpy(values).reshape(shape)
    return out


def _oracle_dit(path, dtype):
    """An H3DiT holding the file's tensors as gguf dequantizes them (ComfyUI's stacked QKV split, fc1's halves
    swapped to diffusers' [value; gate]), cast to the model's dtypes by load_state."""
    config = open_dit(path).config
    inner = config.num_attention_heads * config.attention_head_dim
    state = {}
    for name, value in _gguf_values(path).items():
        if name == "rope.inv_freq":
            continue
        if name == "adaln_t_table":
            state[name] = value
            continue
        layer, _, param = name.rpartition(".")
        target = keymap.original_layer_to_diffusers(layer)
        if target.endswith(".attn.to_qkv"):
            base = target[: -len("to_qkv")]
            for part, rows in zip(("to_q", "to_k", "to_v"), value.split(inner)):
                state[f"{base}{part}.{param}"] = rows
        elif target.endswith(".ff.net.0.proj"):
            gate, val = value.chunk(2)
            state[f"{target}.{param}"] = torch.cat([val, gate])
        else:
            state[f"{target}.{param}"] = value
    model = H3DiT(config, dtype=dtype, device="meta")
    model.load_state(state.items())
    return model.eval()


def _velocity(model, dtype):
    c = model.config
    lay = layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, lay.video_indices.numel(), c.video_patch_dim, generator=gen),
                  audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), c.audio_in_channels, generator=gen),
                  encoder_hidden_states=torch.randn(1, lay.num_text, c.text_dim, generator=gen).to(dtype),
                  token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                  audio_indices=lay.audio_indices, text_indices=lay.text_indices)
    ts, idx = lay.row_timesteps(0.7, 0.4, 0.999)
    with torch.no_grad():
        return model(**inputs, timestep=ts, timestep_indices=idx)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(config name, GGML type) -> a GGUF DiT written by make-checkpoint; TINY's Q8_0 through the CLI."""
    root = tmp_path_factory.mktemp("gguf_dit")
    out = {}
    for t in LEGACY_TYPES:
        out["aligned", t] = make_dit_checkpoint(root / f"aligned_{t}.gguf", ALIGNED, f"gguf:{t}", "comfy", seed=3).path
    for t in K_TYPES:
        out["k_aligned", t] = make_dit_checkpoint(root / f"k_aligned_{t}.gguf", K_ALIGNED, f"gguf:{t}", "comfy",
                                                  seed=3).path
    out["pruned", "Q8_0"] = make_dit_checkpoint(root / "pruned_Q8_0.gguf", ALIGNED, "gguf:Q8_0", "comfy-pruned",
                                                seed=3, curve=(33, 4)).path
    for t in ("Q8_0", "Q4_0"):
        out["tiny", t] = root / f"tiny_{t}.gguf"
        assert main(["make-checkpoint", "--format", f"gguf:{t}", "--seed", "3", str(out["tiny", t])]) == 0
    return out


@pytest.mark.parametrize("key", [("aligned", t) for t in LEGACY_TYPES] + [("k_aligned", t) for t in K_TYPES]
                         + [("pruned", "Q8_0"), ("tiny", "Q8_0"), ("tiny", "Q4_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_dit_velocities_equal_gguf_dequantized_weights(made, key, dtype, capsys):
    capsys.readouterr()
    path = made[key]
    want = _velocity(_oracle_dit(path, dtype), dtype)
    stored = load_dit(path, dtype=dtype, stored=True)
    assert _equal(_velocity(stored, dtype), want)
    assert _equal(_velocity(load_dit(path, dtype=dtype, stored=False), dtype), want)
    linears = [m for m in stored.modules() if isinstance(m, StoredLinear)]
    assert linears and {(m.format, m.gguf_type, m.weight.dtype) for m in linears} == {("gguf", key[1], torch.uint8)}
    if key[0] != "tiny":  # every block linear is blocks: the fused QKV's parts and fc1 (its halves swapped at use)
        blk = stored.transformer_blocks[0]
        assert all(isinstance(m, StoredLinear) for m in (blk.attn.to_q, blk.attn.to_k, blk.attn.to_v,
                                                         blk.ff.net[0].proj, blk.ff.net[2], blk.attn.to_out[0]))
        assert blk.ff.net[0].proj.swap_halves


def test_a_bare_prefixed_gguf_reads_as_the_same_model(made, tmp_path):
    """stable-diffusion.cpp's files (unsloth's, leejet's) carry no key/values, and its converter prefixes
    `model.diffusion_model.` when handed the file as a diffusion model: the same tensors read the same."""
    path = made["aligned", "Q5_1"]
    bare = _rewrite(path, tmp_path / "bare.gguf", prefix="model.diffusion_model.", bare=True)
    source = GgufSource(bare)
    assert source.architecture is None and source.metadata == {}
    assert open_dit(bare).detected.prefix == "model.diffusion_model."
    for dtype in (torch.float32, torch.bfloat16):
        assert _equal(_velocity(load_dit(bare, dtype=dtype, stored=True), dtype),
                      _velocity(load_dit(path, dtype=dtype, stored=True), dtype))


def test_gguf_codes_are_views_of_the_file(made):
    path = made["aligned", "Q4_0"]
    model = load_dit(path, dtype=torch.bfloat16, stored=True)
    maps = [line.split() for line in open("/proc/self/maps") if str(path) in line]
    ranges = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
    for codes in (model.transformer_blocks[1].attn.to_k.weight, model.transformer_blocks[0].ff.net[0].proj.weight):
        assert any(a <= codes.data_ptr() < b for a, b in ranges), "the blocks were copied out of the file's mapping"


def test_a_gguf_dit_streams_its_blocks(made):
    """Streamed block by block (every block through host buffers and slots), the blocks packed as GGML bytes."""
    from h3_spark.h3_model.engine.memory import plan_dit
    from h3_spark.h3_model.engine.placement import place_dit

    path = made["aligned", "Q4_0"]
    want = _velocity(load_dit(path, dtype=torch.bfloat16, stored=True), torch.bfloat16)
    streamed = load_dit(path, dtype=torch.bfloat16, stored=True)
    plan = plan_dit(streamed, None, 64)
    plan.resident_blocks, plan.adaln_on_host = 0, True
    place_dit(streamed, plan, "cpu")
    stream = streamed.block_stream
    assert stream is not None and len(stream.units) == ALIGNED.num_layers
    assert torch.uint8 in {e.dtype for u in stream.units.values() for e in u.entries}
    assert _equal(_velocity(streamed, torch.bfloat16), want)


def test_gguf_source_shapes_are_pytorch_order(made):
    """GGUF stores a [N, K] weight as ne = [K, N]: the source reports [N, K], and raw rows of K / 32 blocks."""
    source = GgufSource(made["aligned", "Q8_0"])
    reader = gguf.GGUFReader(made["aligned", "Q8_0"])
    ne = {t.name: tuple(int(d) for d in t.shape.tolist()) for t in reader.tensors}
    e = source.entry("blocks.0.attn.qkv_proj.weight")
    assert ne[e.name] == (64, 96) and e.shape == (96, 64) and e.dtype == "Q8_0"
    raw = source.get(e.name)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (96, 2 * 34)
    bias = source.get("blocks.0.adaln_proj.linear.bias")
    want = expected_shapes(ALIGNED)["transformer_blocks.0.adaln_proj.linear.bias"]
    assert bias.dtype == torch.float32 and tuple(bias.shape) == want
    assert source.architecture == "minimax_h3" and source.header.version == 3


# ------------------------------------------------------------------------------------------ reports, engine
def test_inspect_reports_a_gguf_dit(made, tmp_path, capsys):
    path = made["aligned", "Q8_0"]
    report = inspect_checkpoint(path)
    g = report["gguf"]
    reader = gguf.GGUFReader(path)
    assert report["model"] == "dit" and report["layout"] == "comfy" and report["complete"]
    assert g["version"] == 3 and g["architecture"] == "minimax_h3"
    assert {n: t["type"] for n, t in g["tensors"].items()} == {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n: t["bytes"] for n, t in g["tensors"].items()} == {t.name: int(t.n_bytes) for t in reader.tensors}
    qkv = report["layers"]["blocks.0.attn.qkv_proj"]
    assert qkv["format"] == "gguf Q8_0" and qkv["logical_shape"] == [96, 64]
    assert qkv["stored"] == {"type": "Q8_0", "bytes": 96 * 68, "row_bytes": 68, "block": {"values": 32, "bytes": 34}}
    assert qkv["loaded_as"].startswith("GGML blocks") and report["gguf_dequantized_at_load"] == []
    assert report["layers"]["blocks.0.norm1"]["format"] == "fp32"
    assert report["quantization"]["formats"] == {"gguf Q8_0": sum(t.tensor_type.name == "Q8_0" for t in reader.tensors)}
    assert main(["inspect", str(path), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3, general.architecture minimax_h3" in out and "gguf Q8_0 x" in out and "  complete" in out
    assert json.loads((tmp_path / "aligned_Q8_0.inspect.json").read_text())["gguf"]["tensor_types"] == g["tensor_types"]


def test_inspect_names_what_a_gguf_dit_lacks(made, tmp_path):
    bad = _rewrite(made["aligned", "Q8_0"], tmp_path / "lacking.gguf", drop=("blocks.1.mlp.fc2.weight",))
    report = inspect_checkpoint(bad)
    assert not report["complete"] and report["missing"] == ["transformer_blocks.1.ff.net.2.weight"]
    assert "blocks.1.mlp.fc2.weight" not in report["gguf"]["tensors"]
    with pytest.raises(CheckpointError, match=r"lacking.gguf: 1 tensors missing, e.g. transformer_blocks.1.ff.net.2."
                                              r"weight \(file name: blocks.1.mlp.fc2.weight\)$"):
        load_dit(bad)


def test_the_engine_loads_and_generates_with_a_gguf_dit(tmp_path):
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.h3_model.engine.paths import ComponentPaths
    from h3_spark.h3_model.pipeline.generation import GenerationRequest
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import synthetic

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    builders = synthetic.component_builders("tiny", ["t2va"], "cpu", torch.float32, torch.float32, text_layer=2)
    dit = tmp_path / "minimax_h3_fl2va-Q8_0.gguf"
    make_dit_checkpoint(dit, builders["dit"]().config, "gguf:Q8_0", "comfy", seed=5)
    others = {k: v for k, v in builders.items() if k != "dit"}
    kernels = KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off")

    def engine(**options):
        opts = LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2, kernels=kernels,
                           **options)
        return Engine(ComponentPaths(dit=dit), opts, overrides=others).load(["t2va"])

    req = GenerationRequest(mode="t2va", prompt="a boat", width=64, height=64, frames=124, steps=2)
    stored = engine()
    assert any(isinstance(m, StoredLinear) and m.format == "gguf" for m in stored.components.dit.modules())
    got = stored.generate(req)
    want = engine(stored_weights=False).generate(req)
    assert torch.equal(got.video_latents, want.video_latents) and torch.equal(got.audio_latents, want.audio_latents)


def test_full_preset_plan_matches_the_published_pruned_files():
    """unsloth/MiniMax-H3-GGUF's pruned files: 532 tensors; Q8_0 19.94 / 19.97 GiB and Q5_0 12.94 / 12.97 GiB
    (ref2va / fl2va), Comfy-Org's pruned bf16 file 37.46 GiB. The fl2va Q4_K (10.64 GiB) and Q2_K (6.26 GiB) are
    llama.cpp mixes (some tensors at higher types); ours are one type, 10.61 and 6.23 GiB. Planned from shapes,
    nothing drawn."""
    from h3_spark.h3_model.checkpoint.comfy_layout import comfy_groups
    from h3_spark.h3_model.checkpoint.gguf_writer import plan
    from h3_spark.h3_model.checkpoint.make import pruned_config
    from h3_spark.h3_model.checkpoint.pruned import CurveFit
    from h3_spark.h3_model.dit.config import FULL

    def no_draw(name):
        raise AssertionError(f"planning drew {name}")

    d = FULL.time_embed_dim
    fit = CurveFit(torch.zeros(1025, 8), torch.zeros(d, 8, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                   torch.zeros(8, dtype=torch.float64))
    groups = comfy_groups(pruned_config(FULL, 1025, 8), no_draw, "bf16", fit=fit)
    published = {"Q8_0": (19.94, 19.97), "Q5_0": (12.94, 12.97), "BF16": (37.46, 37.46), "Q4_K": (10.64, 10.64),
                 "Q2_K": (6.26, 6.26)}
    for t, (low, high) in published.items():
        tensors = [x for _, ts in plan(groups, t) for x in ts]
        gib = sum(x.nbytes for x in tensors) / 2 ** 30
        assert len(tensors) == 532 and low - 0.05 < gib < high + 0.05, (t, gib)


def test_the_writer_puts_every_tensor_info_first_then_streams_layer_by_layer(tmp_path):
    """GGUF's tensor infos precede the data: they are on disk before the first layer is drawn, and each layer is
    drawn only at its turn, the previous one's tensors already gone (what lets a full-size file stream)."""
    import weakref

    from h3_spark.h3_model.checkpoint.comfy_layout import comfy_groups
    from h3_spark.h3_model.checkpoint.gguf_writer import write_gguf
    from h3_spark.h3_model.checkpoint.synthetic import random_param
    from h3_spark.h3_model.checkpoint.writer import Group

    shapes = expected_shapes(TINY)
    out = tmp_path / "streamed.gguf"
    partial = tmp_path / "streamed.gguf.partial"
    seen, alive = [], []

    def watched(group):
        def make():
            seen.append(partial.stat().st_size)
            assert not any(ref() is not None for ref in alive), "an earlier layer's tensors are still held"
            tensors = group.make()
            alive.extend(weakref.ref(t) for t in tensors.values())
            return tensors
        return Group(group.entries, make)

    groups = comfy_groups(TINY, lambda n: random_param(n, shapes[n], 0), "bf16")
    write_gguf(out, [watched(g) for g in groups], "Q8_0", {"maker": "test"})
    header = GgufSource(out).header.header_size
    assert len(seen) == len(groups) and seen[0] >= header - 32 and seen == sorted(seen)


# ------------------------------------------------------------------------------------------ text encoder
@pytest.fixture(scope="module")
def te_files(tmp_path_factory):
    """The tiny Qwen3-VL (text/stand_in.py) as llama.cpp writes a Qwen3-VL text GGUF (gguf's own name map, no
    vision tower: that is the mmproj file's), F16 and Q8_0, each beside a dense single file of the same weights
    (gguf's dequantized values, plus the bf16 file's tower, which a T2VA prompt never reaches)."""
    from safetensors.torch import load_file, save_file

    from h3_spark.h3_model.text import synthetic as S
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    root = tmp_path_factory.mktemp("gguf_te")
    made = S.write_text_encoder(root / "te.safetensors", "tiny", "bf16", seed=2, tokenizer_dir=root / "tok")
    weights = load_file(made.path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, made.layers)
    out = {"tokenizer": root / "tok", "layers": made.layers}
    for t in ("F16", "Q8_0"):
        writer = gguf.GGUFWriter(root / f"te_{t}.gguf", "qwen3vl")
        writer.add_block_count(made.layers)
        dense = {}
        for name, value in weights.items():
            if name.startswith("visual."):
                dense[name] = value
                continue
            base, _, suffix = name.rpartition(".")
            data = value.float().numpy()
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]
            kind = gguf.GGMLQuantizationType["F32" if data.ndim == 1 else t if data.shape[-1] % block == 0 else "F16"]
            stored = quants.quantize(data, kind)
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", stored, raw_dtype=kind)
            values = np.array(quants.dequantize(stored, kind), dtype=np.float32)
            dense[name] = torch.from_numpy(values).reshape(value.shape)
        # What llama.cpp writes beyond the layers the DiT reads: the final norm and the LM head (never read).
        hidden = weights["model.embed_tokens.weight"].shape
        writer.add_tensor("output_norm.weight", np.ones(hidden[1], np.float32))
        writer.add_tensor("output.weight", np.zeros(hidden, np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        save_file(dense, str(root / f"te_{t}.dense.safetensors"))
        out[t] = root / f"te_{t}.gguf"
    return out


def _te(path, files, stored=False):
    from h3_spark.h3_model.text.encoder import TextEncoder

    return TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=files["tokenizer"],
                                       layer=files["layers"], stored=stored)


@pytest.mark.parametrize("kind", ["F16", "Q8_0"])
def test_a_llama_cpp_text_gguf_encodes_as_its_dense_weights(te_files, kind):
    dense = _te(te_files[kind].with_name(f"te_{kind}.dense.safetensors"), te_files)
    want = dense.encode("a paper boat <d>drifts</d> in the rain").embeds
    for stored in (False, True):
        te = _te(te_files[kind], te_files, stored)
        assert not te.vision_tower and dense.vision_tower
        assert torch.equal(te.encode("a paper boat <d>drifts</d> in the rain").embeds, want)
        blocks = [m for m in te.model.modules() if isinstance(m, StoredLinear)]
        assert bool(blocks) == (stored and kind == "Q8_0") and all(m.gguf_type == "Q8_0" for m in blocks)


def test_an_image_presentation_needs_the_vision_tower(te_files):
    te = _te(te_files["Q8_0"], te_files)
    frame = torch.zeros(64, 64, 3, dtype=torch.uint8)
    with pytest.raises(InputError) as err:
        te.encode(te.prompts.fl2va("a boat", [frame]))
    assert str(err.value) == (f"the text encoder {te_files['Q8_0']} has no vision tower (a GGUF without its mmproj): "
                              "Ref2VA image and video references and FL2VA keyframes need Qwen3-VL's vision tower; "
                              "give its llama.cpp vision file (--text-encoder-vision mmproj-....gguf, or one "
                              "mmproj*.gguf beside it) or load a file that holds the tower (visual.*: ComfyUI's single "
                              "file)")
    report = inspect_checkpoint(te_files["Q8_0"])
    assert report["model"] == "text_encoder" and report["complete"] and not report["structure"]["vision_tower"]
    # Six linears a layer and the embedding; down_proj's 48-value rows are not whole blocks (F16).
    assert report["quantization"]["formats"] == {"gguf Q8_0": 6 * te_files["layers"] + 1}


# ------------------------------------------------------------------------------------------ text encoder, written
def _k_aligned_te():
    """The tiny Qwen3-VL widened so that every text linear's rows are whole 256-value super-blocks (4 query heads
    on 1 KV head: Q2_K_M's attn_v rule takes Q4_K at 4 or more)."""
    from h3_spark.h3_model.text import stand_in
    from h3_spark.h3_model.text import synthetic as S

    tok = stand_in.make_tokenizer()
    text = dict(stand_in.TINY_TEXT, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                                 "mrope_interleaved": True})
    vision = dict(stand_in.TINY_VISION, out_hidden_size=256)
    layers = stand_in.TEXT_READ_LAYER
    return S.Preset("tiny", layers, tok, stand_in.make_processor(tok), stand_in.text_config(tok, layers, text, vision))


def _dense_of_gguf(path, shapes, tower, layers):
    """ComfyUI's names -> gguf's dequantization of the file's tensors (names mapped by gguf's own table), plus
    the bf16 tower the GGUF leaves to its mmproj."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, layers)
    to_comfy = {}
    for name in shapes:
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is not None:
            to_comfy[f"{target}.{suffix}"] = name
    values = _gguf_values(path)
    assert set(values) <= set(to_comfy), set(values) - set(to_comfy)
    return {**{to_comfy[n]: v for n, v in values.items()}, **tower}


@pytest.fixture(scope="module")
def te_written(tmp_path_factory):
    """(preset, scheme) -> (GGUF, its dense twin, tokenizer folder): tiny files through the CLI, the
    super-block-aligned model through the writer."""
    from safetensors.torch import save_file

    from h3_spark.h3_model.text import synthetic as S
    from h3_spark.h3_model.text.gguf_writer import write_text_encoder_gguf
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    root = tmp_path_factory.mktemp("gguf_te_written")
    out = {}
    for preset_name, scheme in (("tiny", "Q8_0"), ("tiny", "Q4_K_M"), ("aligned", "Q4_K_M"), ("aligned", "Q2_K_M")):
        path = root / f"{preset_name}_{scheme}.gguf"
        if preset_name == "tiny":
            assert main(["make-checkpoint", "--component", "text_encoder", "--format", f"gguf:{scheme}", "--seed", "2",
                         str(path)]) == 0
            chosen = S.preset("tiny")
        else:
            chosen = _k_aligned_te()
            write_text_encoder_gguf(path, chosen, f"gguf:{scheme}", seed=2)
        shapes = S.stored_shapes(chosen.config)
        tower = {n: S.random_tensor(n, shape, 2).to(torch.bfloat16) for n, shape in shapes.items()
                 if n.startswith("visual.")}
        dense = path.with_suffix(".dense.safetensors")
        save_file(_dense_of_gguf(path, shapes, tower, chosen.layers), str(dense))
        out[preset_name, scheme] = (path, dense, path.with_name(path.stem + ".tokenizer"), chosen.layers)
    return out


def _te_at(path, tokenizer, layers, stored=False):
    from h3_spark.h3_model.text.encoder import TextEncoder

    return TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=tokenizer, layer=layers,
                                       stored=stored)


@pytest.mark.parametrize("key", [("tiny", "Q8_0"), ("tiny", "Q4_K_M"), ("aligned", "Q4_K_M"), ("aligned", "Q2_K_M")])
def test_a_written_text_gguf_encodes_as_gguf_dequantizes_it(te_written, key, capsys):
    capsys.readouterr()
    path, dense, tokenizer, layers = te_written[key]
    prompt = "a paper boat <d>drifts</d> in the rain"
    want = _te_at(dense, tokenizer, layers).encode(prompt).embeds
    for stored in (False, True):
        te = _te_at(path, tokenizer, layers, stored)
        assert not te.vision_tower and torch.equal(te.encode(prompt).embeds, want)
        kept = {m.gguf_type for m in te.model.modules() if isinstance(m, StoredLinear)}
        assert bool(kept) == stored


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_the_mixes_follow_llama_cpps_rules(te_written):
    """Q4_K_M: attn_v and ffn_down Q6_K in use_more_bits' layers (of 2: layer 1); Q2_K_M: attn_v Q4_K (4 query
    heads a KV head), attn_output and ffn_down Q3_K; the rest the base type; norms F32. Tiny's 32-wide rows take
    llama.cpp's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0), its 48-wide ffn_down F16."""
    q4 = _types(te_written["aligned", "Q4_K_M"][0])
    assert {n: t for n, t in q4.items() if t == "Q6_K"} == {"blk.1.attn_v.weight": "Q6_K",
                                                            "blk.1.ffn_down.weight": "Q6_K"}
    assert {t for n, t in q4.items() if n.endswith("norm.weight")} == {"F32"}
    assert set(q4.values()) == {"Q4_K", "Q6_K", "F32"} and q4["token_embd.weight"] == "Q4_K"
    q2 = _types(te_written["aligned", "Q2_K_M"][0])
    for layer in (0, 1):
        assert [q2[f"blk.{layer}.{p}.weight"] for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                          "ffn_up", "ffn_down")] == \
            ["Q2_K", "Q2_K", "Q4_K", "Q3_K", "Q2_K", "Q2_K", "Q3_K"]
    tiny = _types(te_written["tiny", "Q4_K_M"][0])
    assert tiny["blk.0.attn_v.weight"] == "Q5_0" and tiny["blk.1.attn_v.weight"] == "Q8_0"
    assert tiny["blk.1.ffn_down.weight"] == "F16" and tiny["token_embd.weight"] == "Q5_0"
    from h3_spark.h3_model.text.gguf_writer import use_more_bits

    # llama.cpp's Q4_K_M of a 64-layer model gives 32 layers more bits; of the 50 H3 reads, 25.
    assert sum(map(lambda i: use_more_bits(i, 64), range(64))) == 32
    assert [i for i in range(50) if use_more_bits(i, 50)] == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35,
                                                              38, 41, 43, 44, 45, 46, 47, 48, 49]


def test_a_written_text_gguf_holds_llama_cpps_keys(te_written):
    source = GgufSource(te_written["aligned", "Q2_K_M"][0])
    assert source.architecture == "qwen3vl"
    assert [source.field(k) for k in ("qwen3vl.block_count", "qwen3vl.embedding_length",
                                      "qwen3vl.feed_forward_length", "qwen3vl.attention.head_count",
                                      "qwen3vl.attention.head_count_kv", "qwen3vl.rope.dimension_sections",
                                      "general.file_type")] == [2, 256, 256, 4, 1, [12, 10, 10, 0],
                                                                int(gguf.LlamaFileType.MOSTLY_Q2_K)]
    assert source.field("qwen3vl.rope.freq_base") == 10000.0
    assert not any(k.startswith(("visual", "v.")) for k in source.keys)


def test_a_written_text_gguf_needs_no_config_json(te_written, tmp_path):
    """Without the model's config.json the reader builds the model from the file: its shapes and the qwen3vl.*
    keys (RoPE base 10000 and sections [12, 10, 10] here, not Qwen3-VL-32B's defaults) must be what was written."""
    import shutil

    path, _, tokenizer, layers = te_written["aligned", "Q2_K_M"]
    bare = tmp_path / "tok"
    shutil.copytree(tokenizer, bare)
    (bare / "config.json").unlink()
    prompt = "a paper boat <d>drifts</d> in the rain"
    assert torch.equal(_te_at(path, bare, layers).encode(prompt).embeds,
                       _te_at(path, tokenizer, layers).encode(prompt).embeds)


def test_full_text_gguf_plan():
    """50 layers (what H3 reads; no LM head): Q4_K_M 14.00 GiB, Q2_K_M 8.57 GiB. The published text GGUFs
    (Q4_K_M 17.0, Q2_K_M 12.2) are not the same cut: a 64-layer llama.cpp conversion with its LM head would be
    18.4 and 11.5 GiB by the same rules."""
    from h3_spark.h3_model.text import synthetic as S
    from h3_spark.h3_model.text.gguf_writer import planned_bytes
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    full = S.preset("full")
    assert round(planned_bytes(full, "gguf:Q4_K_M") / 2 ** 30, 2) == 14.00
    assert round(planned_bytes(full, "gguf:Q2_K_M") / 2 ** 30, 2) == 8.57


@pytest.mark.parametrize("argv, message", [
    (["--format", "gguf:Q4_K_S", "x.gguf"], "--format gguf:Q4_K_S: a GGUF text encoder is written as gguf:F32, "
                                            "gguf:F16, gguf:BF16, gguf:Q8_0, "),
    (["--format", "gguf:Q4_K_M", "x.safetensors"], "x.safetensors: a GGUF text encoder is one file; give a path "
                                                   "ending in .gguf"),
    (["--format", "gguf:Q4_K_M", "--layout", "comfy-pruned", "x.gguf"], "--component text_encoder takes only"),
])
def test_a_bad_text_gguf_request_is_refused(tmp_path, capsys, argv, message):
    *options, name = argv
    code = main(["make-checkpoint", "--component", "text_encoder", *options, str(tmp_path / name)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------ paths, nodes
def test_a_gguf_in_a_component_folder_stands_for_it(tmp_path):
    from h3_spark.h3_model.engine.paths import ComponentPaths

    (tmp_path / "transformer").mkdir()
    dit = tmp_path / "transformer" / "minimax_h3_fl2va_pruned-Q4_K.gguf"
    dit.write_bytes(b"GGUF")
    (tmp_path / "text_encoder").mkdir()
    te = tmp_path / "text_encoder" / "Qwen3VL-32B-Q4_K_M.gguf"
    te.write_bytes(b"GGUF")
    (tmp_path / "text_encoder" / "mmproj-Qwen3VL-32B-Q8_0.gguf").write_bytes(b"GGUF")
    paths = ComponentPaths(models=tmp_path)
    assert paths.resolve("dit") == dit and paths.resolve("text_encoder") == te
    assert ComponentPaths(dit=dit).resolve("dit") == dit
    (tmp_path / "transformer" / "minimax_h3_fl2va_pruned-Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(InputError, match=r"transformer: holds 2 GGUF files \(.*\); choose one with --dit$"):
        paths.resolve("dit")


def test_the_loaders_list_gguf_files(tmp_path, monkeypatch):
    """ComfyUI lists only its own extensions (no .gguf) for diffusion_models (models/unet + models/diffusion_models)
    and text_encoders (models/text_encoders + models/clip)."""
    import sys
    import types

    from h3_spark.nodes import host

    folders = {"diffusion_models": [tmp_path / "unet", tmp_path / "diffusion_models"],
               "text_encoders": [tmp_path / "text_encoders", tmp_path / "clip"]}
    for roots in folders.values():
        for root in roots:
            root.mkdir()
    (tmp_path / "unet" / "minimax_h3_ref2va_pruned-Q4_K.gguf").write_bytes(b"GGUF")
    (tmp_path / "diffusion_models" / "minimax_h3_fl2va_bf16.safetensors").write_bytes(b"x")
    (tmp_path / "clip" / "sub").mkdir()
    (tmp_path / "clip" / "sub" / "qwen3vl_32b_minimax_h3-Q4_K_M.gguf").write_bytes(b"GGUF")
    fake = types.ModuleType("folder_paths")
    fake.get_folder_paths = lambda key: [str(p) for p in folders[key]]
    fake.get_filename_list = lambda key: sorted(p.relative_to(r).as_posix() for r in folders[key]
                                                for p in r.rglob("*.safetensors"))
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    assert host.model_choices("diffusion_models") == ["minimax_h3_fl2va_bf16.safetensors",
                                                      "minimax_h3_ref2va_pruned-Q4_K.gguf"]
    assert host.model_choices("text_encoders", folders=True) == ["sub/qwen3vl_32b_minimax_h3-Q4_K_M.gguf"]


# ------------------------------------------------------------------------------------------ broken files
def _rewrite(src, dst, *, arch="minimax_h3", extra=None, prefix="", bare=False, drop=()):
    """The file's tensors again (their stored bytes), under another architecture (`bare`: no key/values at all, as
    stable-diffusion.cpp writes), names prefixed, `drop` left out, `extra` tensors added."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch)
    if bare:
        writer.kv_data[0].clear()
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        writer.add_tensor(prefix + t.name, data, raw_dtype=raw)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _info_offset(path, name) -> tuple[int, int]:
    """Absolute offsets of a tensor's first dim and of its type id in the tensor-info table (GGUF's layout:
    u64 name length, name, u32 n_dims, u64 dims, u32 type, u64 offset)."""
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == name)
    dims = t.field.offset + 8 + len(name.encode()) + 4
    return dims, dims + 8 * len(t.shape)


def _patched(src, dst, at, fmt, value):
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, at, value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def broken(made, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    good = made["aligned", "Q8_0"]
    name = "blocks.0.attn.out_proj.weight"
    dims, kind = _info_offset(good, name)
    data = good.read_bytes()
    source = GgufSource(good)
    last = source.file_order()[-1]  # a download cut short inside the last tensor
    cut = root / "cut.gguf"
    cut.write_bytes(data[:source.entry(last).begin + 2])
    short = root / "short.gguf"
    short.write_bytes(data[:40])
    magic = root / "magic.gguf"
    magic.write_bytes(b"GGUX" + data[4:])
    return {
        "truncated": (cut, f"{cut}: truncated: tensor {last} "),
        "header": (short, f"{short}: the GGUF header is truncated or malformed ("),
        "magic": (magic, f"{magic}: not a GGUF file: it starts with b'GGUX', not the magic b'GGUF'"),
        "version": (_patched(good, root / "v1.gguf", 4, "<I", 1),
                    f"{root / 'v1.gguf'}: GGUF version 1; the installed gguf package reads versions 2, 3"),
        "type": (_patched(good, root / "type.gguf", kind, "<I", 99),
                 f"{root / 'type.gguf'}: tensor {name} has GGML type id 99, which the installed gguf package does "
                 "not know"),
        "rows": (_patched(good, root / "rows.gguf", dims, "<Q", 33),
                 f"{root / 'rows.gguf'}: tensor {name} is Q8_0 with rows of 33 values, not whole Q8_0 blocks of 32: "
                 "its bytes do not match its type and shape"),
        "bytes": (_patched(good, root / "bytes.gguf", dims + 8, "<Q", 128),
                  f"{root / 'bytes.gguf'}: tensor {name} is Q8_0 [128, 32] (4352 bytes) but 2176 bytes lie before the "
                  "next tensor ("),
        "unexpected name": (_rewrite(good, root / "extra.gguf",
                                     extra={"blocks.0.attn.extra.weight": np.zeros((4, 32), np.float32)}),
                            f"{root / 'extra.gguf'}: 1 tensors fit no DiT name, e.g. blocks.0.attn.extra.weight"),
        "integer weight": (_rewrite(good, root / "int8.gguf",
                                    extra={"blocks.0.attn.out_proj.weight_scale": np.ones(64, np.float32)}),
                           f"{root / 'int8.gguf'}: blocks.0.attn.out_proj.weight_scale is not a GGUF DiT tensor: GGML "
                           "blocks carry their own scales"),
    }


@pytest.mark.parametrize("case", ["truncated", "header", "magic", "version", "type", "rows", "bytes", "unexpected name",
                                  "integer weight"])
def test_a_broken_gguf_fails_in_one_line(broken, case):
    path, message = broken[case]
    with pytest.raises(CheckpointError) as err:
        load_dit(path)
    text = str(err.value)
    assert text.startswith(message) and "\n" not in text, text


def test_a_dit_gguf_is_not_a_text_encoder(made, te_files):
    from h3_spark.h3_model.text.encoder import TextEncoder

    with pytest.raises(CheckpointError, match=r"general.architecture is 'minimax_h3', a DiT GGUF, not the Qwen3-VL "
                                              r"text encoder \(which declares qwen3vl or nothing\)$"):
        TextEncoder.from_pretrained(made["aligned", "Q8_0"], dtype=torch.float32, device="cpu",
                                    tokenizer=te_files["tokenizer"], layer=2)


def test_an_unexpected_text_encoder_tensor_is_named(te_files, tmp_path):
    bad = _rewrite(te_files["F16"], tmp_path / "te_extra.gguf", arch="qwen3vl",
                   extra={"blk.0.attn_qkv.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(CheckpointError, match=r"te_extra.gguf: blk.0.attn_qkv.weight is not a parameter of this "
                                              r"Qwen3-VL$"):
        _te(bad, te_files)
