"""ComfyUI's int8_convrot video VAE (minimax_h3_video_vae_int8_convrot): written by our make-checkpoint, read by the
video VAE loader with its decoder linears kept as stored (StoredLinear) or dequantized at load.

Oracles: comfy-kitchen 0.2.40 (the library ComfyUI quantizes and dequantizes with) and a float64 reference.
- The file: every quantized layer's codes and scales are comfy-kitchen's `quantize_int8_convrot_weight` of the fp16
  file's weight of the same seed, bit for bit; its marker is ComfyUI's int8_tensorwise + convrot declaration.
- The weights: the project's one int8_convrot dequantization (kernels/formats/int8.py) undoes the rotation on the
  integer codes, exactly, and rounds once: equal (torch.equal) to the correctly rounded float64 value, in fp16 and
  fp32. comfy-kitchen's eager dequantization rounds its fp32 rotation GEMM at every step, so it is not bit-exact to
  that: in fp16 (the decode dtype) fewer than 0.5 % of the weights differ from it (0.1 % measured), each by one fp16
  ulp at most (or, near zero, by its fp32 sums' own error).
- Stored == dequantized at load: the decoded frames are equal, bit for bit (fp32 and fp16 decode).
- Against the fp16 file of the same seed (the same model before int8 rounding): max abs difference below 0.03 on
  frames in [0, 1] (measured 0.01 on this tiny model).
"""

import dataclasses
import json
import math

import pytest
import torch
from comfy_kitchen.backends.eager import quantization as ck_eager
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3_spark.errors import CheckpointError
from h3_spark.h3_model.checkpoint.quant import decode_marker, encode_marker, hadamard, quantize_fp8
from h3_spark.h3_model.vae import video_config as VC
from h3_spark.h3_model.vae.loading import (_fuse_qkv, _swap_halves, check_video_vae, load_audio_vae,
                                           load_video_vae, video_identity)
from h3_spark.h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint
from h3_spark.kernels.stored_linear import StoredLinear

SEED = 3
LINEARS = ("attn.to_qkv", "attn.to_out", "ff.w1", "ff.w2")
# Two decoder blocks so a block index the model lacks is still a decoder block's name.
CONFIG = dataclasses.replace(VC.TINY, decoder_num_layers=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vae_int8")
    return {"int8": write_vae_checkpoint(root / "int8.safetensors", CONFIG, "comfy", SEED, fmt="int8_convrot"),
            "fp16": write_vae_checkpoint(root / "fp16.safetensors", CONFIG, "comfy", SEED)}


def _layers(path):
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        return {k[: -len(".comfy_quant")]: decode_marker(f.get_tensor(k), k) for k in keys if k.endswith(".comfy_quant")}


def _latent(seed=0, frames=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, CONFIG.latent_channels, frames, 4, 4, generator=gen)


# ------------------------------------------------------------------------------------------ the file
def test_file_quantizes_exactly_the_decoder_linears_as_comfy_kitchen_does(files):
    declared = _layers(files["int8"])
    expected = {f"decoder.transformer_blocks.{i}.{name}" for i in range(CONFIG.decoder_num_layers) for name in LINEARS}
    assert set(declared) == expected
    fp16 = load_file(str(files["fp16"]))
    int8 = load_file(str(files["int8"]))
    for layer, conf in declared.items():
        k = fp16[f"{layer}.weight"].shape[1]
        group = 256 if k % 256 == 0 else 16  # the tiny widths (16, 32) take the largest power of 4 dividing them
        assert conf == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}, layer
        codes, scale = int8[f"{layer}.weight"], int8[f"{layer}.weight_scale"]
        assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (codes.shape[0], 1)
        ck_codes, ck_scale = ck_eager.quantize_int8_convrot_weight(fp16[f"{layer}.weight"].float(), group)
        assert torch.equal(codes, ck_codes) and torch.equal(scale, ck_scale), layer
        assert torch.equal(int8[f"{layer}.bias"], fp16[f"{layer}.bias"])
    # Everything else is the fp16 file's, tensor for tensor.
    rest = {k for k in fp16 if k[: k.rfind(".")] not in declared or k.endswith(".bias")}
    assert rest == {k for k in int8 if not (k[: k.rfind(".")] in declared and not k.endswith(".bias"))}
    assert all(torch.equal(int8[k], fp16[k]) for k in rest)
    assert all(int8[k].dtype in (torch.float16, torch.float32) for k in rest)


def test_check_and_identity_name_the_quantized_linears(files):
    identity = video_identity(files["int8"])
    assert identity.comfy and identity.config.decoder_num_layers == 2
    assert identity.weights == "int8_convrot decoder linears (8), the rest floats as stored"
    assert check_video_vae(files["int8"]).latent_channels == CONFIG.latent_channels
    assert video_identity(files["fp16"]).weights == "floats as stored (no quantized layer)"


# ------------------------------------------------------------------------------------------ the weights
def _comfy_weight(model, layer, heads):
    """A loaded model's weight under ComfyUI's layer name (q, k, v fused per head; ff.w1's halves swapped back)."""
    blk = model.decoder.transformer_blocks[int(layer.split(".")[2])]

    def w(module):
        return module.dequantized() if isinstance(module, StoredLinear) else module.weight.detach()

    if layer.endswith("to_qkv"):
        return _fuse_qkv(w(blk.attn.to_q), w(blk.attn.to_k), w(blk.attn.to_v), heads)
    if layer.endswith("to_out"):
        return w(blk.attn.to_out[0])
    if layer.endswith("ff.w1"):
        return _swap_halves(w(blk.ff.net[0].proj))
    return w(blk.ff.net[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_loaded_weights_against_the_float64_oracle_and_comfy_kitchen(files, dtype):
    stored = load_video_vae(files["int8"], decode_dtype=dtype)
    loaded = load_video_vae(files["int8"], decode_dtype=dtype, stored=False)
    int8 = load_file(str(files["int8"]))
    heads = CONFIG.decoder_num_attention_heads
    for layer, conf in _layers(files["int8"]).items():
        codes, scale, group = int8[f"{layer}.weight"], int8[f"{layer}.weight_scale"], conf["convrot_groupsize"]
        ours, at_load = _comfy_weight(stored, layer, heads), _comfy_weight(loaded, layer, heads)
        assert ours.dtype == at_load.dtype == dtype
        assert torch.equal(ours, at_load), layer
        n, k = codes.shape
        exact = (codes.double().reshape(n, k // group, group) @ hadamard(group).double()).reshape(n, k)
        assert torch.equal(ours, (exact * scale.double()).float().to(dtype)), layer
        params = TensorWiseINT8Layout.Params(scale=scale, orig_dtype=dtype, orig_shape=(n, k), convrot=True,
                                             convrot_groupsize=group)
        ck = QuantizedTensor(codes, "TensorWiseINT8Layout", params).dequantize()
        differ = ours != ck
        # fp32: comfy-kitchen's rounding shows in most weights, within 16 fp32 ulps of the row's largest weight;
        # fp16: its cast hides that in all but a few, each one fp16 ulp away.
        row_bound = (16 * 2.0 ** -23 * scale * 128).float().expand(n, k)
        bound = row_bound
        if dtype == torch.float16:
            assert differ.float().mean() < 5e-3, layer
            ulp = 2.0 ** (torch.floor(torch.log2(ck.float().abs().clamp_min(2.0 ** -14))) - 10)
            bound = torch.maximum(ulp * 1.001, row_bound)
        assert ((ours.float() - ck.float()).abs()[differ] <= bound[differ]).all(), layer


def test_stored_linears_hold_the_codes(files):
    vae = load_video_vae(files["int8"])
    blk = vae.decoder.transformer_blocks[1]
    linears = [blk.attn.to_q, blk.attn.to_k, blk.attn.to_v, blk.attn.to_out[0], blk.ff.net[0].proj, blk.ff.net[2]]
    assert all(isinstance(m, StoredLinear) and m.weight.dtype == torch.int8 and m.out_dtype == torch.float16
               and m.label == "int8_convrot" and m.bias.dtype == torch.float16 for m in linears)
    assert blk.ff.net[0].proj.swap_halves and not blk.ff.net[2].swap_halves
    # The rest stays as the loader keeps a float file: x_embedder, proj_out, encoder.
    assert type(vae.decoder.proj_in) is torch.nn.Linear and type(vae.decoder.proj_out) is torch.nn.Linear
    assert vae.decode_dtype == torch.float16 and vae.encoder.conv_in.weight.dtype == torch.float32
    # Switching the decode dtype switches what the codes are dequantized into, not the codes.
    vae.set_decode_dtype(torch.float32)
    assert blk.attn.to_q.out_dtype == torch.float32 and blk.attn.to_q.weight.dtype == torch.int8
    assert blk.attn.to_q.bias.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_stored_decode_equals_dequantized_at_load_bit_for_bit(files, dtype):
    z = _latent()
    stored = load_video_vae(files["int8"], decode_dtype=dtype).decode(z)
    at_load = load_video_vae(files["int8"], decode_dtype=dtype, stored=False).decode(z)
    assert stored.dtype == at_load.dtype and stored.std() > 0.05
    assert torch.equal(stored, at_load)


def test_fp8_decoder_linears_start_from_the_exact_dequantized_codes(files):
    """H3_VAE_LINEAR=fp8 on the int8_convrot file: each stored layer is dequantized exactly and then quantized to
    e4m3, so its decode equals the fp8 decode of the same file dequantized at load, bit for bit, and names where
    its weights came from."""
    from h3_spark.kernels.vae import fp8_decoder_linears

    z = _latent(2)
    stored = load_video_vae(files["int8"], decode_dtype=torch.float16)
    at_load = load_video_vae(files["int8"], decode_dtype=torch.float16, stored=False)
    layers = 6 * CONFIG.decoder_num_layers
    assert fp8_decoder_linears(stored.decoder, False, use_triton=False) == {
        "int8_convrot codes dequantized exactly, quantized per output channel": layers}
    assert fp8_decoder_linears(at_load.decoder, False, use_triton=False) == {
        "fp16 weight quantized per output channel": layers}
    got = stored.decode(z)
    assert torch.equal(got, at_load.decode(z)) and got.std() > 0.05


def test_decode_stays_close_to_the_fp16_file_of_the_same_seed(files):
    z = _latent(1)
    int8 = load_video_vae(files["int8"], decode_dtype=torch.float32).decode(z)
    fp16 = load_video_vae(files["fp16"], decode_dtype=torch.float32).decode(z)
    diff = (int8 - fp16).abs()
    assert 0 < diff.max() < 0.03 and fp16.std() > 0.05
    assert 10 * math.log10(1.0 / diff.pow(2).mean().item()) > 40  # PSNR in dB, frames in [0, 1]


# ------------------------------------------------------------------------------------------ refused inputs
def _rewrite(src, dst, edit):
    tensors = load_file(str(src))
    with safe_open(str(src), "pt") as f:
        metadata = f.metadata()
    edit(tensors)
    save_file(tensors, str(dst), metadata)
    return dst


def _copy_layer(tensors, src, dst):
    for suffix in ("weight", "weight_scale", "comfy_quant", "bias"):
        tensors[f"{dst}.{suffix}"] = tensors[f"{src}.{suffix}"].clone()


def _quantize_plain(tensors, layer):
    """A float layer of the fp16 file stored as int8 (as if its maker had quantized it too)."""
    w = tensors[f"{layer}.weight"].float()
    scale = (w.abs().amax() / 127).reshape(())
    tensors[f"{layer}.weight"] = (w / scale).round().clamp(-128, 127).to(torch.int8)
    tensors[f"{layer}.weight_scale"] = scale
    tensors[f"{layer}.comfy_quant"] = encode_marker({"format": "int8_tensorwise"})


def _marker(tensors, layer, conf):
    tensors[f"{layer}.comfy_quant"] = encode_marker(conf)


L0 = "decoder.transformer_blocks.0"
BAD = {
    "a block the model lacks": (
        lambda t: _copy_layer(t, f"{L0}.attn.to_out", "decoder.transformer_blocks.5.attn.to_out"),
        "decoder.transformer_blocks.5.attn.to_out is declared int8_convrot, but this video VAE has no such layer"),
    "a linear the block lacks": (
        lambda t: _copy_layer(t, f"{L0}.attn.to_out", f"{L0}.attn.to_gate"),
        f"{L0}.attn.to_gate is declared int8_convrot, but this video VAE has no such layer"),
    "an encoder conv": (
        lambda t: _quantize_plain(t, "encoder.conv_in"),
        "encoder.conv_in is declared int8; a video VAE keeps only its decoder blocks' linears (attn.to_qkv, "
        "attn.to_out, ff.w1, ff.w2) quantized"),
    "the x_embedder": (
        lambda t: _quantize_plain(t, "decoder.x_embedder"),
        "decoder.x_embedder is declared int8; a video VAE keeps only its decoder blocks' linears"),
    "an unknown format": (
        lambda t: _marker(t, f"{L0}.ff.w2", {"format": "int7_magic"}),
        f"{L0}.ff.w2: unknown quantization format 'int7_magic'"),
    "a format the VAE does not read": (
        lambda t: t.update({f"{L0}.ff.w2.weight": quantize_fp8(t[f"{L0}.ff.w2.weight"].float() * 0 + 0.5)[0],
                            f"{L0}.ff.w2.weight_scale": torch.tensor(0.01),
                            f"{L0}.ff.w2.comfy_quant": encode_marker({"format": "float8_e4m3fn"})}),
        f"{L0}.ff.w2 is stored as fp8_scaled; the video VAE reads its decoder linears as int8 or int8_convrot"),
    "a scale without a declaration": (
        lambda t: t.pop(f"{L0}.ff.w1.comfy_quant"),
        f"{L0}.ff.w1: has weight_scale but no quantization declaration"),
    "a scale of the wrong size": (
        lambda t: t.update({f"{L0}.attn.to_out.weight_scale": torch.ones(3, 1)}),
        f"{L0}.attn.to_out: int8 weight_scale has 3 values; expected 1 or 16"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_quantized_layers_are_refused_in_one_line_before_weights_load(files, tmp_path, monkeypatch, case):
    edit, message = BAD[case]
    path = _rewrite(files["int8"], tmp_path / "bad.safetensors", edit)
    with pytest.raises(CheckpointError) as header_only:
        check_video_vae(path)
    text = str(header_only.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text
    # load_video_vae says the same before it reads a weight (only the latent statistics are read first).
    from h3_spark.h3_model.vae import loading

    def no_weights(self, key):
        assert not key.endswith((".weight", ".bias")), f"read {key} before refusing"
        return real_get(self, key)

    real_get = loading.TensorFiles.get
    monkeypatch.setattr(loading.TensorFiles, "get", no_weights)
    with pytest.raises(CheckpointError) as loading_error:
        load_video_vae(path)
    assert str(loading_error.value) == text


def test_quantized_layers_outside_comfyuis_single_file_are_refused(tmp_path):
    folder = write_vae_checkpoint(tmp_path / "vae", "tiny", "diffusers", SEED)
    weights = folder / "diffusion_pytorch_model.safetensors"
    _rewrite(weights, weights, lambda t: _quantize_plain(t, "decoder.proj_in"))
    with pytest.raises(CheckpointError, match="quantized .comfy_quant. video VAE layers are read from ComfyUI's "
                                              "single file only"):
        check_video_vae(folder)
    audio = write_audio_vae_checkpoint(tmp_path / "audio.safetensors", "tiny", "comfy", SEED)
    _rewrite(audio, audio, lambda t: _quantize_plain(t, "pre_block.proj"))
    with pytest.raises(CheckpointError, match="a quantized .comfy_quant. audio VAE; load the fp32 file instead"):
        load_audio_vae(audio)


def test_metadata_declarations_read_as_markers(files, tmp_path):
    """ComfyUI's other declaration form: the header's _quantization_metadata instead of .comfy_quant tensors."""
    tensors = load_file(str(files["int8"]))
    with safe_open(str(files["int8"]), "pt") as f:
        metadata = dict(f.metadata())
    layers = {}
    for key in [k for k in tensors if k.endswith(".comfy_quant")]:
        layers[key[: -len(".comfy_quant")]] = decode_marker(tensors.pop(key), key)
    metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    path = tmp_path / "meta.safetensors"
    save_file(tensors, str(path), metadata)
    assert len(video_identity(path).quantized) == 4 * CONFIG.decoder_num_layers
    z = _latent(2)
    assert torch.equal(load_video_vae(path, decode_dtype=torch.float32).decode(z),
                       load_video_vae(files["int8"], decode_dtype=torch.float32).decode(z))


# ------------------------------------------------------------------------------------------ front doors
def test_make_checkpoint_writes_it_and_inspect_names_it(tmp_path, capsys):
    from h3_spark.cli import main

    out = tmp_path / "minimax_h3_video_vae_int8_convrot.safetensors"
    assert main(["make-checkpoint", "--component", "vae", "--format", "int8_convrot", "--seed", "5", str(out)]) == 0
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert made["format"] == "int8_convrot" and made["layout"] == "comfy" and made["bytes"] == out.stat().st_size
    assert set(_layers(out)) == {f"decoder.transformer_blocks.0.{n}" for n in LINEARS}
    assert main(["inspect", str(out), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "video VAE, int8_convrot decoder linears (4), the rest floats as stored" in printed
    assert "quantized layers: int8_convrot x4 (declared by comfy_quant)" in printed
    report = json.loads(next(tmp_path.glob("*.inspect.json")).read_text())
    assert report["complete"] is True and report["model"] == "video_vae"
    layer = report["layers"]["decoder.transformer_blocks.0.attn.to_qkv"]
    assert layer["format"] == "int8_convrot" and layer["convrot_groupsize"] == 16
    assert layer["stored"]["dtype"] == "I8" and layer["scales"][0]["layout"] == "per-row"
    # Its fp16 twin of the same seed: the same tensors but the quantized ones.
    twin = tmp_path / "fp16.safetensors"
    assert main(["make-checkpoint", "--component", "vae", "--seed", "5", str(twin)]) == 0
    with safe_open(str(out), "pt") as a, safe_open(str(twin), "pt") as b:
        assert torch.equal(a.get_tensor("encoder.conv_in.weight"), b.get_tensor("encoder.conv_in.weight"))


@pytest.mark.parametrize("argv,message", [
    (["--component", "audio_vae", "--format", "int8_convrot"],
     "--component audio_vae is written as published (leave --format out), not --format int8_convrot"),
    (["--component", "vae", "--format", "int8_convrot", "--layout", "diffusers"],
     "--format int8_convrot writes ComfyUI's single-file video VAE (--layout comfy), not the diffusers layout"),
    (["--component", "vae", "--format", "nvfp4"], "int8_convrot (ComfyUI's quantized video VAE), not --format nvfp4"),
])
def test_make_checkpoint_refuses_other_vae_formats(tmp_path, capsys, argv, message):
    from h3_spark.cli import main

    assert main(["make-checkpoint", *argv, str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_inspect_and_file_checks_refuse_a_bad_file_from_its_header(files, tmp_path):
    from h3_spark.h3_model.checkpoint.inspect import inspect_checkpoint, summary_lines
    from h3_spark.h3_model.engine.file_checks import check_files
    from h3_spark.h3_model.engine.loading import LoadOptions

    edit, message = BAD["an encoder conv"]
    bad = _rewrite(files["int8"], tmp_path / "bad.safetensors", edit)
    report = inspect_checkpoint(bad)
    assert report["complete"] is False and message in report["structure"]["loader_refuses"]
    assert any("INCOMPLETE: the video VAE loader refuses it" in line for line in summary_lines(report))
    with pytest.raises(CheckpointError, match="encoder.conv_in is declared int8; a video VAE keeps only"):
        check_files({"vae": bad}, LoadOptions(), None)
    assert check_files({"vae": files["int8"]}, LoadOptions(), None).video_latents == CONFIG.latent_channels
