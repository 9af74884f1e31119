"""Quantized layers kept in their stored form (`StoredLinear`) against the same layers dequantized at load.

Oracle: `load_dit(path)` (every layer dequantized at load, the reader's old and default path) and
`checkpoint.quant.dequantize`. Claims, each checked bit for bit (torch.equal), on random weights:
- each format's just-in-time dequantization (fp8_scaled, int8, int8_convrot, NVFP4, AWQ pre_quant_scale,
  fc1's swapped halves, row chunks smaller than the layer) equals the load-time dequantization;
- a DiT loaded with `stored=True` from every quantized format gives the velocities of the same file loaded
  dequantized, in fp32 and bf16; its quantized linears are StoredLinears holding the file's dtypes, and on
  the CPU their codes are views of the memory-mapped file (no host copy);
- a streamed DiT (its blocks packed into host buffers, visiting through two slots) from stored codes gives
  the resident stored model's velocities, and packs the stored bytes, not bf16 ones.
"""

import pytest
import torch

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint import load_dit, open_dit
from h3_spark.h3_model.checkpoint.quant import QuantSpec, dequantize, fold_pre_quant_scale
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.dit.config import TINY
from h3_spark.kernels import nvfp4_codec as nvfp4
from h3_spark.kernels import stored_codec
from h3_spark.kernels.stored_linear import StoredForm, StoredLinear, scratch_bytes
from checkpoints import made_files
from oracle import text_tags

FORMATS = ("fp8_scaled", "int8_convrot", "nvfp4")


def _random_layer(fmt: str, n: int, k: int, gen: torch.Generator):
    """(QuantSpec, stored tensors) of a random weight in `fmt`, as the writers quantize it."""
    from h3_spark.h3_model.checkpoint.quant import convrot_group_for, quantize_fp8, quantize_int8_rows

    w = torch.randn(n, k, generator=gen) * 0.05
    if fmt == "fp8_scaled":
        q, s = quantize_fp8(w)
        return QuantSpec("float8_e4m3fn"), {"weight": q, "weight_scale": s}
    if fmt in ("int8", "int8_convrot"):
        group = convrot_group_for(k) if fmt == "int8_convrot" else None
        q, s = quantize_int8_rows(w, group)
        return QuantSpec("int8_tensorwise", convrot=group is not None, convrot_groupsize=group or 256), \
            {"weight": q, "weight_scale": s}
    packed, scales, g = nvfp4.quantize(w)
    return QuantSpec("nvfp4"), {"weight": packed, "weight_scale": scales, "weight_scale_2": g}


def _form(spec: QuantSpec, tensors: dict, shape, swap=False) -> StoredForm:
    tensors = dict(tensors)
    if spec.format == "nvfp4":
        tensors["weight_scale"] = stored_codec.plain_nvfp4_scales(tensors["weight_scale"], *tensors["weight"].shape)
    return StoredForm(spec.format, shape, tensors, spec.convrot_groupsize if spec.convrot else None, swap)


@pytest.mark.parametrize("fmt", ["fp8_scaled", "int8", "int8_convrot", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("awq", [False, True])
def test_jit_dequantization_equals_load_time(fmt, dtype, awq, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n, k = 96, 256
    spec, tensors = _random_layer(fmt, n, k, gen)
    if awq:
        tensors["pre_quant_scale"] = torch.exp(torch.randn(k, generator=gen) * 0.3)
    want = dequantize(spec, tensors, (n, k), dtype, "layer")
    if awq:
        want = fold_pre_quant_scale(want, tensors["pre_quant_scale"])
    # Chunks of 40 rows: the last one is partial, so chunk boundaries are exercised.
    monkeypatch.setattr(stored_codec, "CHUNK_ROWS", 40)
    layer = StoredLinear(_form(spec, tensors, (n, k)), dtype)
    assert torch.equal(layer.dequantized(), want)
    x = torch.randn(5, k, generator=gen).to(dtype)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, want))


@pytest.mark.parametrize("fmt", ["fp8_scaled", "int8_convrot", "nvfp4"])
def test_swapped_halves_are_swapped_at_use(fmt):
    gen = torch.Generator().manual_seed(4)
    spec, tensors = _random_layer(fmt, 64, 64, gen)
    want = dequantize(spec, tensors, (64, 64), torch.float32, "fc1")
    layer = StoredLinear(_form(spec, tensors, (64, 64), swap=True), torch.float32)
    assert torch.equal(layer.dequantized(), torch.cat([want[32:], want[:32]]))
    # The codes a low-bit linear starts from are in the model's row order too.
    stored = layer.stored_tensors()
    if stored is not None:
        again = StoredLinear(_form(spec, {k: v for k, v in stored.items() if k != "format"}, (64, 64)),
                             torch.float32)
        assert torch.equal(again.dequantized(), layer.dequantized())


def test_scratch_is_reused_and_owned():
    gen = torch.Generator().manual_seed(5)
    a = StoredLinear(_form(*_random_layer("int8", 32, 64, gen), (32, 64)), torch.float32)
    b = StoredLinear(_form(*_random_layer("int8", 48, 64, gen), (48, 64)), torch.float32)
    x = torch.randn(3, 64, generator=gen)
    ya, yb, ya2 = a(x), b(x), a(x)
    # b's weight overwrote the scratch a had used; a dequantizes again rather than reading b's values.
    assert torch.equal(ya, ya2) and not torch.equal(ya, yb[:, :32])
    assert scratch_bytes(torch.nn.ModuleList([a, b])) >= 48 * 64 * 4


def test_stored_form_errors():
    gen = torch.Generator().manual_seed(6)
    spec, tensors = _random_layer("int8", 32, 64, gen)
    with pytest.raises(ValueError, match="StoredLinear holds .* not 'mxfp8'"):
        StoredLinear(StoredForm("mxfp8", (32, 64), tensors), torch.float32)
    with pytest.raises(CheckpointError, match="layer: int8 weight_scale has 5 values; expected 1 or 32"):
        dequantize(spec, {**tensors, "weight_scale": torch.ones(5)}, (32, 64), torch.float32, "layer")
    with pytest.raises(CheckpointError, match="layer: pre_quant_scale has 3 values for 64 inputs"):
        from h3_spark.h3_model.checkpoint.quant import check_stored
        check_stored(spec, {**tensors, "pre_quant_scale": torch.ones(3)}, (32, 64), "layer")


# ------------------------------------------------------------------------------------------ whole DiTs
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return made_files(tmp_path_factory.mktemp("stored"), TINY, FORMATS, 7)


@pytest.fixture(scope="module")
def lay():
    return layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))


def _inputs(lay, dtype):
    gen = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, lay.video_indices.numel(), TINY.video_patch_dim, generator=gen),
                audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), TINY.audio_in_channels, generator=gen),
                encoder_hidden_states=torch.randn(1, lay.num_text, TINY.text_dim, generator=gen).to(dtype),
                token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                audio_indices=lay.audio_indices, text_indices=lay.text_indices)


def _velocity(model, lay, dtype):
    ts, idx = lay.row_timesteps(0.7, 0.4, 0.999)
    with torch.no_grad():
        return model(**_inputs(lay, dtype), timestep=ts, timestep_indices=idx)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_dit_equals_dequantized_dit(files, lay, fmt, dtype):
    dense = load_dit(files[fmt], dtype=dtype)
    stored = load_dit(files[fmt], dtype=dtype, stored=True)
    kinds = {type(m).__name__ for m in stored.transformer_blocks.modules()}
    assert "StoredLinear" in kinds
    blk = stored.transformer_blocks[0]
    assert blk.ff.net[0].proj.weight.dtype == {"fp8_scaled": torch.float8_e4m3fn, "int8_convrot": torch.int8,
                                               "nvfp4": torch.uint8}[fmt]
    for a, b in zip(_velocity(dense, lay, dtype), _velocity(stored, lay, dtype)):
        assert torch.equal(a, b)
    assert sum(b.numel() * b.element_size() for b in stored.buffers()) > 0
    # Stored bytes, not dequantized ones: the blocks hold less than the dense model's.
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.transformer_blocks.parameters())
    stored_bytes = sum(t.numel() * t.element_size() for t in [*stored.transformer_blocks.parameters(),
                                                             *stored.transformer_blocks.buffers()])
    assert stored_bytes < dense_bytes


def test_stored_codes_are_views_of_the_file(files):
    model = load_dit(files["int8_convrot"], dtype=torch.bfloat16, stored=True)
    codes = model.transformer_blocks[1].attn.to_k.weight
    import mmap  # noqa: F401  (the mapping is safetensors'; /proc/self/maps shows it)

    maps = [line.split() for line in open("/proc/self/maps") if str(files["int8_convrot"]) in line]
    ranges = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
    assert any(a <= codes.data_ptr() < b for a, b in ranges), "the codes were copied out of the file's mapping"


def test_stored_dit_streams_its_stored_bytes(files, lay):
    from h3_spark.h3_model.engine.memory import plan_dit
    from h3_spark.h3_model.engine.placement import place_dit

    resident = load_dit(files["int8_convrot"], dtype=torch.bfloat16, stored=True)
    want = _velocity(resident, lay, torch.bfloat16)
    streamed = load_dit(files["int8_convrot"], dtype=torch.bfloat16, stored=True)
    plan = plan_dit(streamed, None, 64)
    plan.resident_blocks, plan.adaln_on_host = 0, True
    place_dit(streamed, plan, "cpu")
    stream = streamed.block_stream
    assert stream is not None and len(stream.units) == TINY.num_layers
    got = _velocity(streamed, lay, torch.bfloat16)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    reader = open_dit(files["int8_convrot"])
    dense = sum(2 * o.shape[0] * o.shape[1] for o in reader.plan() if o.name.startswith("transformer_blocks.0.")
                and o.name.endswith(".weight") and len(o.shape) == 2 and "adaln" not in o.name)
    assert stream.units[0].nbytes < dense


# ------------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_stored_dit_equals_dequantized_on_the_gpu(files, lay, fmt):
    """On the GPU the just-in-time dequantization gives the bits of the load-time one made on the GPU."""
    dense = load_dit(files[fmt], dtype=torch.bfloat16, device="cuda")
    stored = load_dit(files[fmt], dtype=torch.bfloat16, device="cuda", stored=True)
    inputs = {k: v.cuda() for k, v in _inputs(lay, torch.bfloat16).items()}
    ts, idx = lay.row_timesteps(0.7, 0.4, 0.999)
    with torch.no_grad():
        a = dense(**inputs, timestep=ts.cuda(), timestep_indices=idx.cuda())
        b = stored(**inputs, timestep=ts.cuda(), timestep_indices=idx.cuda())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def fp8_files(tmp_path_factory):
    """Files of a small DiT whose block linears the FP8 GEMMs take (dims divisible by 16)."""
    import dataclasses

    config = dataclasses.replace(TINY, hidden_size=64, attention_head_dim=32, ffn_dim=128)
    return made_files(tmp_path_factory.mktemp("fp8dims"), config, FORMATS, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_fp8_linears_from_stored_codes(fp8_files, fmt):
    """H3_LINEAR=fp8 on a stored model starts from the StoredLinear's own codes: an fp8_scaled file's e4m3 codes are
    kept as they are; the FP8 weight matches the one made from the same file loaded dequantized."""
    from h3_spark.h3_model.engine.kernel_plan import apply_kernels
    from h3_spark.kernels.settings import KernelSettings

    settings = KernelSettings(linear="fp8")
    dense = load_dit(fp8_files[fmt], dtype=torch.bfloat16, device="cuda")
    stored = load_dit(fp8_files[fmt], dtype=torch.bfloat16, device="cuda", stored=True)
    report = apply_kernels(stored, settings)
    apply_kernels(dense, settings)
    a = dense.transformer_blocks[1].attn.to_v
    b = stored.transformer_blocks[1].attn.to_v
    assert type(b).__name__ == "Fp8Linear"
    assert torch.equal(a.dequantized_weight(), b.dequantized_weight())
    if fmt == "fp8_scaled":
        assert any("fp8_scaled checkpoint codes" in s for s in report["linear"]["sources"])


def test_a_lora_merged_into_a_stored_dit_equals_the_dequantized_one(files, lay, tmp_path):
    """A LoRA makes the StoredLinears it touches dense (their exact dequantized weight) and merges there: the same
    velocities as the file dequantized at load with the same LoRA; the layers it does not touch stay stored."""
    from safetensors.torch import save_file

    from h3_spark.h3_model.checkpoint.lora import LoraSpec, apply_loras

    gen = torch.Generator().manual_seed(9)
    inner = TINY.num_attention_heads * TINY.attention_head_dim
    lora = tmp_path / "lora.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, TINY.hidden_size, generator=gen),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(inner, 4, generator=gen) * 0.1}, lora)
    dense = load_dit(files["int8_convrot"], dtype=torch.float32)
    stored = load_dit(files["int8_convrot"], dtype=torch.float32, stored=True)
    for model in (dense, stored):
        apply_loras(model, [LoraSpec(lora, 0.7)])
    assert type(stored.transformer_blocks[0].attn.to_q) is torch.nn.Linear
    assert isinstance(stored.transformer_blocks[0].attn.to_k, StoredLinear)
    for a, b in zip(_velocity(dense, lay, torch.float32), _velocity(stored, lay, torch.float32)):
        assert torch.equal(a, b)
