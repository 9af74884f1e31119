"""The Qwen3-VL text encoder (h3_model/text_encoder.py): truncation, loaders, cache, errors.

Oracles: transformers' full Qwen3VLForConditionalGeneration with `output_hidden_states=True`
(hidden_states[layer]) and diffusers 0.42.1's text-encoder steps, on a tiny random Qwen3-VL
(4 decoder layers, hidden_states[2] read, DeepStack into decoder layers 0 and 1; see
tests/fixtures/qwen_tiny.py). Error budget in fp32: exact equality. The truncated model runs the
same operations on the same inputs as the full one, so nothing but bit-identical is accepted; the
quantized files are compared with the full model carrying the same dequantized weights, also
exactly, plus a loose sanity bound against the unquantized model.
"""

import types

import pytest
import torch
from safetensors.torch import save_file

from fixtures import qwen_tiny as Q
from h3_spark.errors import CheckpointError, H3Error, InputError
from h3_spark.h3_model.text.prompt import Presentation
from h3_spark.h3_model.text.encoder import EncodedPrompt, TextEncoder, _config_from_shapes

needs_tv = pytest.mark.skipif(not Q.HAS_TORCHVISION, reason="transformers' Qwen3-VL processor needs torchvision")
LAYER = Q.READ_LAYER
KEYFRAMES = [Q.image(40, 56, 1), Q.image(40, 56, 2)]
REFERENCES = [("image", Q.image(32, 48, 3)), ("video", Q.video(30, 32, 40, 4), True), ("audio",),
              ("video", Q.video(13, 24, 40, 6), False)]
PROMPTS = {"t2va": "the cat <d>says</d> hi", "fl2va": "the sec", "ref2va": "the end"}
# Sanity bounds (rel L2 of layer-2 states against the unquantized model) for the tiny random model.
QUANT_SANITY = {"fp8_scaled": 0.1, "fp8_legacy": 0.1, "fp8_metadata": 0.1, "int8_convrot": 0.05, "nvfp4_awq": 0.35}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not Q.HAS_TORCHVISION:
        pytest.skip("transformers' Qwen3-VL processor needs torchvision")
    root = tmp_path_factory.mktemp("qwen")
    tok = Q.make_tokenizer()
    proc = Q.make_processor(tok)
    model = Q.make_reference_model(tok)
    Q.save_hf_folder(root / "hf", model, proc)
    Q.tokenizer_folder(root / "tok", proc, model.config)
    return types.SimpleNamespace(root=root, tok=tok, proc=proc, model=model)


@pytest.fixture(scope="module")
def encoder(tiny):
    return TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cpu", layer=LAYER)


def _present(te, mode):
    if mode == "t2va":
        return te.prompts.t2va(PROMPTS[mode])
    if mode == "fl2va":
        return te.prompts.fl2va(PROMPTS[mode], KEYFRAMES)
    return te.prompts.ref2va(PROMPTS[mode], [Q.ours_reference(r) for r in REFERENCES])


def _reference(tiny, p, model=None, layer=LAYER):
    return Q.reference_hidden(model or tiny.model, tiny.proc, p.token_ids.tolist(), p.vision, layer)


# ------------------------------------------------------------------ truncation and parity
@needs_tv
@pytest.mark.parametrize("mode", ["t2va", "fl2va", "ref2va"])
def test_truncated_model_equals_full_hidden_state(tiny, encoder, mode):
    p = _present(encoder, mode)
    out = encoder.encode(p)
    assert out.embeds.shape == (1, len(p), 32) and out.embeds.dtype == torch.float32
    assert torch.equal(out.embeds, _reference(tiny, p))
    assert torch.equal(out.tags, p.tags) and out.token_hash == p.token_hash


@needs_tv
@pytest.mark.parametrize("mode", ["t2va", "fl2va", "ref2va"])
def test_embeddings_equal_diffusers(tiny, encoder, mode):
    theirs = Q.diffusers_run(mode, tiny.model, tiny.tok, tiny.proc, PROMPTS[mode], keyframes=KEYFRAMES,
                             references=REFERENCES)
    out = encoder.encode(_present(encoder, mode))
    assert torch.equal(out.embeds, theirs["embeds"])
    assert torch.equal(out.tags, theirs["tags"])


@needs_tv
def test_truncation_drops_layers_norm_and_head(encoder, tiny):
    lm = encoder.model.language_model
    assert len(lm.layers) == LAYER and encoder.model.config.text_config.num_hidden_layers == LAYER
    assert isinstance(lm.norm, torch.nn.Identity)
    names = [n for n, _ in encoder.model.named_parameters()]
    assert not any(n.startswith("lm_head") or n.startswith("language_model.norm") for n in names)
    assert not any(n.startswith(f"language_model.layers.{LAYER}.") for n in names)
    assert encoder.hidden_size == 32 and encoder.resident


@needs_tv
@pytest.mark.parametrize("layer", [1, 3])
def test_layer_is_configurable(tiny, layer):
    # Layer 1 is read right where DeepStack adds to the stream: the state is the layer's own output.
    te = TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cpu", layer=layer)
    p = _present(te, "ref2va")
    assert len(te.model.language_model.layers) == layer
    assert torch.equal(te.encode(p).embeds, _reference(tiny, p, layer=layer))


@needs_tv
def test_bfloat16_embeddings(tiny, encoder):
    te = TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.bfloat16, device="cpu", layer=LAYER)
    p = _present(te, "fl2va")
    out = te.encode(p)
    assert out.embeds.dtype == torch.bfloat16
    assert Q.rel_l2(out.embeds, encoder.encode(p).embeds) < 3e-2  # bf16 weights and activations


@needs_tv
def test_diffusers_folder_layout(tiny):
    root = tiny.root / "diffusers"
    tiny.model.save_pretrained(root / "text_encoder")
    tiny.tok.save_pretrained(root / "tokenizer")
    tiny.proc.save_pretrained(root / "processor")
    # The root, its text_encoder/ alone, or text_encoder/ + tokenizer/ (as the pipeline passes them).
    for path, tokenizer in ((root, None), (root / "text_encoder", None), (root / "text_encoder", root / "tokenizer")):
        te = TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tokenizer)
        p = _present(te, "fl2va")
        assert torch.equal(te.encode(p).embeds, _reference(tiny, p))
    # A ComfyUI file with the diffusers tokenizer/ folder: processor and config.json are found beside it.
    path = tiny.root / "comfy_diffusers_tok.safetensors"
    save_file(Q.comfy_state_dict(tiny.model, LAYER), path)
    te = TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=root / "tokenizer")
    assert torch.equal(te.encode(p).embeds, _reference(tiny, p))


# ------------------------------------------------------------------ ComfyUI single files
@needs_tv
@pytest.mark.parametrize("prefix", ["", "text_encoders.qwen3vl_32b.transformer."])
@pytest.mark.parametrize("stored_layers", [LAYER, LAYER + 1])
def test_comfy_single_file(tiny, prefix, stored_layers):
    path = tiny.root / f"comfy_{stored_layers}_{bool(prefix)}.safetensors"
    save_file(Q.comfy_state_dict(tiny.model, stored_layers, prefix), path)
    te = TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")
    assert len(te.model.language_model.layers) == LAYER
    p = _present(te, "ref2va")
    assert torch.equal(te.encode(p).embeds, _reference(tiny, p))


@needs_tv
def test_comfy_single_file_bf16_storage(tiny, encoder):
    path = tiny.root / "comfy_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in Q.comfy_state_dict(tiny.model, LAYER).items()}, path)
    te = TextEncoder.from_pretrained(path, dtype=torch.bfloat16, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")
    assert all(p.dtype == torch.bfloat16 for p in te.model.parameters())
    assert te.model.language_model.rotary_emb.inv_freq.dtype == torch.float32  # as transformers keeps it
    p = _present(te, "t2va")
    assert Q.rel_l2(te.encode(p).embeds, encoder.encode(p).embeds) < 3e-2


@needs_tv
@pytest.mark.parametrize("fmt", Q.QUANT_FORMATS)
def test_comfy_quantized_file(tiny, fmt):
    stored, metadata, dequantized = Q.quantize_comfy(Q.comfy_state_dict(tiny.model, LAYER), fmt)
    path = tiny.root / f"comfy_{fmt}.safetensors"
    save_file(stored, path, metadata=metadata)
    te = TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")
    p = _present(te, "fl2va")
    out = te.encode(p).embeds
    assert torch.equal(out, _reference(tiny, p, model=Q.with_weights(tiny.model, dequantized)))
    assert Q.rel_l2(out, _reference(tiny, p)) < QUANT_SANITY[fmt]


@needs_tv
@pytest.mark.parametrize("fmt", Q.QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comfy_quantized_file_kept_stored(tiny, fmt, dtype):
    """Kept as stored (StoredLinear, dequantized at use), a quantized file encodes to the bits of the same file
    dequantized at load; the decoder layers hold the stored codes, and the embeddings are unchanged."""
    from h3_spark.kernels.stored_linear import StoredLinear

    stored, metadata, _ = Q.quantize_comfy(Q.comfy_state_dict(tiny.model, LAYER), fmt)
    path = tiny.root / f"comfy_{fmt}_kept.safetensors"
    save_file(stored, path, metadata=metadata)
    args = dict(dtype=dtype, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")
    dense = TextEncoder.from_pretrained(path, **args)
    kept = TextEncoder.from_pretrained(path, stored=True, **args)
    layers = [m for m in kept.model.language_model.layers.modules() if isinstance(m, StoredLinear)]
    assert len(layers) == 7 * LAYER and {m.out_dtype for m in layers} == {dtype}
    assert {m.weight.dtype for m in layers} <= {torch.int8, torch.uint8, torch.float8_e4m3fn}
    for mode in ("t2va", "ref2va"):
        p = _present(kept, mode)
        assert torch.equal(kept.encode(p).embeds, dense.encode(p).embeds)


@needs_tv
def test_layer_declared_by_marker_and_metadata_alike_loads(tiny):
    import json

    stored, _, _ = Q.quantize_comfy(Q.comfy_state_dict(tiny.model, LAYER), "fp8_scaled")
    layers = {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist())) for k, v in stored.items()
              if k.endswith(".comfy_quant")}
    marked, both = tiny.root / "marked.safetensors", tiny.root / "marked_and_metadata.safetensors"
    save_file(stored, marked)
    save_file(stored, both, metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    load = lambda path: TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER,
                                                   tokenizer=tiny.root / "tok")
    for (name, a), (_, b) in zip(load(both).model.named_parameters(), load(marked).model.named_parameters()):
        assert torch.equal(a, b), name
    layer = next(iter(layers))
    save_file(stored, tiny.root / "disagree.safetensors", metadata={"_quantization_metadata": json.dumps(
        {"layers": {**layers, layer: {"format": "float8_e5m2"}}})})
    with pytest.raises(CheckpointError, match=rf"^{layer}: \.comfy_quant \(fp8_scaled\) and _quantization_metadata "
                                              r"\(fp8_e5m2_scaled\) disagree$"):
        load(tiny.root / "disagree.safetensors")


def test_config_from_shapes_is_qwen3vl_32b():
    # The published 50-layer file's shapes (ComfyUI detects it by these); no config.json next to it.
    shapes = {"language_model.layers.0.self_attn.q_norm.weight": (128,),
              "language_model.layers.0.self_attn.q_proj.weight": (8192, 5120),
              "language_model.layers.0.self_attn.k_proj.weight": (1024, 5120),
              "language_model.layers.0.input_layernorm.weight": (5120,),
              "language_model.layers.0.mlp.up_proj.weight": (25600, 5120),
              "language_model.embed_tokens.weight": (151936, 5120),
              "visual.blocks.0.norm1.weight": (1152,), "visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
              "visual.blocks.0.mlp.linear_fc1.weight": (4304, 1152), "visual.merger.linear_fc1.weight": (4608, 4608),
              "visual.merger.linear_fc2.weight": (5120, 4608), "visual.pos_embed.weight": (2304, 1152)}
    counts = {r"^visual\.deepstack_merger_list\.(\d+)\.": 3, r"^visual\.blocks\.(\d+)\.": 27}
    weights = types.SimpleNamespace(path="qwen.safetensors", num_layers=50, shape=shapes.get, count=counts.get)
    ids = {"<|image_pad|>": 151655, "<|video_pad|>": 151656, "<|vision_start|>": 151652, "<|vision_end|>": 151653}
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda toks: [ids[t] for t in toks])
    transformers = pytest.importorskip("transformers")
    config = _config_from_shapes(transformers, weights, tokenizer)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.head_dim, text.vocab_size) == (5120, 25600, 50, 64, 8, 128, 151936)
    assert text.rope_parameters["rope_theta"] == 5e6 and text.rope_parameters["mrope_section"] == [24, 20, 20]
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.patch_size, vision.spatial_merge_size,
            vision.out_hidden_size, list(vision.deepstack_visual_indexes)) == (27, 1152, 16, 16, 2, 5120, [8, 16, 24])
    assert config.image_token_id == 151655 and config.video_token_id == 151656


@needs_tv
def test_comfy_file_without_config_needs_qwen3vl_shapes(tiny):
    # The tiny model is not Qwen3-VL-32B-shaped, so without a config.json it must be refused.
    bare = tiny.root / "tok_bare"
    Q.tokenizer_folder(bare, tiny.proc)
    path = tiny.root / "comfy_noconfig.safetensors"
    save_file(Q.comfy_state_dict(tiny.model, LAYER), path)
    with pytest.raises(CheckpointError, match="head size 8 is not Qwen3-VL's 128; put the model's config.json"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=bare)


# ------------------------------------------------------------------ cache and residency
@needs_tv
def test_identical_prompts_are_encoded_once(tiny):
    te = TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cpu", layer=LAYER, cache_size=2)
    calls = []
    te.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    first = te.encode(te.prompts.fl2va("x", KEYFRAMES))
    again = te.encode(te.prompts.fl2va("x", [k.clone() for k in KEYFRAMES]))  # built anew, same content
    assert len(calls) == 1 and te.cache_hits == 1
    assert torch.equal(first.embeds, again.embeds) and first.token_hash == again.token_hash
    te.encode("x")  # a plain string is a T2VA prompt
    te.encode(te.prompts.t2va("y"))  # evicts the FL2VA entry (LRU, size 2)
    te.encode(te.prompts.t2va("x"))  # still cached
    assert len(calls) == 3 and te.cache_hits == 2
    te.encode(te.prompts.fl2va("x", KEYFRAMES))
    assert len(calls) == 4
    te.clear_cache()
    te.encode(te.prompts.t2va("x"))
    assert len(calls) == 5


@needs_tv
def test_offload_on_cpu_keeps_the_model_resident(encoder):
    encoder.offload()
    assert encoder.resident
    assert isinstance(encoder.encode("hi"), EncodedPrompt)


@pytest.fixture
def exact_cuda():
    """GPU-vs-CPU comparisons without TF32 (cuDNN uses it for the vision tower's Conv3d by default)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@needs_tv
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_frees_the_gpu_and_reloads(tiny, encoder, exact_cuda):
    te = TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cuda", layer=LAYER)
    p = _present(te, "ref2va")
    first = te.encode(p)
    assert first.embeds.is_cuda
    te.offload()
    assert not te.resident and all(q.device.type == "cpu" for q in te.model.parameters())
    again = te.encode(p)  # a cache hit: the model stays on the CPU
    assert again.embeds.is_cuda and not te.resident
    other = te.encode("something else")  # a miss moves the model back
    assert te.resident and other.embeds.is_cuda
    assert Q.rel_l2(first.embeds.cpu(), encoder.encode(p).embeds) < 1e-5  # GPU kernels differ from CPU ones


@pytest.mark.gpu
@needs_tv
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["int8_convrot", "nvfp4_awq"])
def test_quantized_file_dequantizes_on_the_gpu(tiny, fmt, exact_cuda):
    stored, metadata, _ = Q.quantize_comfy(Q.comfy_state_dict(tiny.model, LAYER), fmt)
    path = tiny.root / f"gpu_{fmt}.safetensors"
    save_file(stored, path, metadata=metadata)
    load = lambda device: TextEncoder.from_pretrained(path, dtype=torch.float32, device=device, layer=LAYER,
                                                     tokenizer=tiny.root / "tok")
    gpu, cpu = load("cuda"), load("cpu")
    assert all(q.is_cuda for q in gpu.model.parameters())
    for (name, a), (_, b) in zip(gpu.model.named_parameters(), cpu.model.named_parameters()):
        assert torch.allclose(a.cpu(), b, rtol=1e-6, atol=1e-7), name  # same dequantization, other device
    p = _present(gpu, "fl2va")
    assert Q.rel_l2(gpu.encode(p).embeds.cpu(), cpu.encode(p).embeds) < 1e-5


# ------------------------------------------------------------------ bad inputs
def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such file or folder"):
        TextEncoder.from_pretrained(tmp_path / "nope", dtype=torch.float32, device="cpu")


def test_single_file_needs_a_tokenizer_folder(tmp_path):
    path = tmp_path / "te.safetensors"
    save_file({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, path)
    with pytest.raises(InputError, match=r"single-file text encoder and holds no tokenizer or processor: pass "
                                         r"tokenizer=<folder> \(CLI: --tokenizer\)"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointError, match="toks: no such tokenizer folder"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=tmp_path / "toks")
    (tmp_path / "toks").mkdir()
    (tmp_path / "toks" / "vocab.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no Qwen3-VL processor config \(processor_config.json or "
                                              r"preprocessor_config.json\)"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=tmp_path / "toks")


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02not really")
    with pytest.raises(CheckpointError, match=r"only pickle weights \(pytorch_model.bin\); pickle files are not"):
        TextEncoder.from_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointError, match="pickle checkpoints are not loaded"):
        TextEncoder.from_pretrained(tmp_path / "pytorch_model.bin", dtype=torch.float32, device="cpu",
                                    tokenizer=tmp_path)


@needs_tv
def test_too_few_layers(tiny):
    with pytest.raises(CheckpointError, match=r"has 4 decoder layers; reading hidden_states\[5\] needs at least 5"):
        TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cpu", layer=5)
    path = tiny.root / "comfy_short.safetensors"
    save_file(Q.comfy_state_dict(tiny.model, 2), path)
    with pytest.raises(CheckpointError, match=r"has 2 decoder layers; reading hidden_states\[3\] needs at least 3"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=3, tokenizer=tiny.root / "tok")
    with pytest.raises(InputError, match="layer must be at least 1"):
        TextEncoder.from_pretrained(tiny.root / "hf", dtype=torch.float32, device="cpu", layer=0)


@needs_tv
def test_wrong_files_are_named(tiny, tmp_path):
    dit = tmp_path / "dit.safetensors"
    save_file({"video_patch_proj.weight": torch.ones(2, 2), "audio_patch_proj.weight": torch.ones(2, 2)}, dit)
    with pytest.raises(CheckpointError, match="is a dit checkpoint, not the Qwen3-VL text encoder"):
        TextEncoder.from_pretrained(dit, dtype=torch.float32, device="cpu", tokenizer=tiny.root / "tok")
    odd = tmp_path / "odd.safetensors"
    state = Q.comfy_state_dict(tiny.model, LAYER)
    state["visual.extra_head.weight"] = torch.ones(2, 2)
    save_file(state, odd)
    with pytest.raises(CheckpointError, match="visual.extra_head.weight is not a parameter of this Qwen3-VL"):
        TextEncoder.from_pretrained(odd, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")
    short = tmp_path / "short.safetensors"
    save_file({k: v for k, v in state.items() if "deepstack_merger_list.1." not in k and "extra" not in k}, short)
    with pytest.raises(CheckpointError, match=r"6 tensors missing, e.g. visual.deepstack_merger_list.1"):
        TextEncoder.from_pretrained(short, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tiny.root / "tok")


@needs_tv
def test_tokenizer_of_another_model_is_refused(tiny, tmp_path):
    config = Q.tiny_config(tiny.tok)
    config.image_token_id = 3
    Q.tokenizer_folder(tmp_path / "tok", tiny.proc, config)
    path = tmp_path / "te.safetensors"
    save_file(Q.comfy_state_dict(tiny.model, LAYER), path)
    with pytest.raises(CheckpointError, match="vision token ids .* differ from the model config's"):
        TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", layer=LAYER, tokenizer=tmp_path / "tok")


@needs_tv
def test_encode_takes_presentations(encoder):
    with pytest.raises(InputError, match="encode takes a Presentation .* got list"):
        encoder.encode([1, 2, 3])
    assert isinstance(encoder.prompts.t2va("a"), Presentation)


def test_errors_are_h3_errors():
    assert issubclass(CheckpointError, H3Error) and issubclass(InputError, H3Error)


@pytest.mark.parametrize("failure, message", [
    (ImportError("No module named 'torchvision'"), r"needs torchvision \(transformers' Qwen3-VL video processor"),
    (RuntimeError("operator torchvision::nms does not exist"),
     r"torchvision does not import \(RuntimeError: operator torchvision::nms does not exist\); it must be the "
     r"build that matches torch"),
])
def test_unusable_torchvision_is_named(monkeypatch, failure, message):
    from h3_spark.h3_model.text import encoder as text_encoder

    real = text_encoder.importlib.import_module

    def fake(name, *args):
        if name == "torchvision":
            raise failure
        return real(name, *args)

    monkeypatch.setattr(text_encoder.importlib, "import_module", fake)
    with pytest.raises(H3Error, match=message):
        text_encoder._transformers()
