"""llama.cpp's vision file (mmproj) beside a GGUF text encoder: written by make-checkpoint --mmproj (the gguf
package's GGUFWriter), read into Qwen3-VL's vision tower.

Oracles: the gguf package's own tensor-name map (`get_tensor_name_map(MODEL_ARCH.MMPROJ)`) for the block names,
and the ComfyUI bf16 single file of the same seed loaded through the dense path. Claims:
- the mmproj declares clip / qwen3vl_merger, Qwen3-VL's sizes, and the block tensors under gguf's names;
- a BF16 text GGUF + BF16 mmproj encodes an FL2VA presentation (keyframe through the tower) exactly as the dense
  file (torch.equal); an F16 mmproj within 2e-3 of it (bf16 weights through F16: subnormals round; the hidden
  states are O(1)); the tower found beside the text file is named in `vision_note`;
- `h3-spark generate` FL2VA with the GGUF text encoder and the mmproj beside it writes the clip and says which
  vision file it took; the same files without the mmproj refuse the keyframe;
- discovery beside the text GGUF passes over other models' mmproj files (a shared folder);
- bad inputs, one line each: an mmproj for another model (projection width; projector type), a file that is not
  an mmproj, two mmproj files of this model beside the text GGUF, --text-encoder-vision with a file that holds its
  own tower.
"""

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from h3_spark.cli import main  # noqa: E402
from h3_spark.errors import CheckpointError, InputError  # noqa: E402
from gguf_files import rewrite_gguf  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3_spark.h3_model.text import synthetic as S
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    root = tmp_path_factory.mktemp("mmproj")
    out = {}
    for t in ("BF16", "F16"):
        (root / t).mkdir()
        assert main(["make-checkpoint", "--component", "text_encoder", "--format", f"gguf:{t}", "--mmproj", "--seed",
                     "2", str(root / t / "te.gguf")]) == 0
        out[t] = root / t / "te.gguf"
    made = S.write_text_encoder(root / "dense" / "te.safetensors", "tiny", "bf16", seed=2,
                                tokenizer_dir=root / "dense" / "tok")
    out["dense"], out["tokenizer"], out["layers"] = made.path, made.tokenizer_dir, made.layers
    return out


def _te(path, files, **kw):
    from h3_spark.h3_model.text.encoder import TextEncoder

    return TextEncoder.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=files["tokenizer"],
                                       layer=files["layers"], **kw)


def _fl2va(te):
    gen = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, 256, (64, 128, 3), generator=gen, dtype=torch.uint8) for _ in range(2)]
    return te.encode(te.prompts.fl2va("a paper boat <d>drifts</d>", frames)).embeds


def test_the_mmproj_is_llama_cpps_qwen3vl_vision_file(files):
    from h3_spark.h3_model.text.stand_in import TINY_VISION

    reader = gguf.GGUFReader(files["F16"].with_name("mmproj-te.gguf"))
    field = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert field["general.architecture"] == "clip" and field["clip.projector_type"] == "qwen3vl_merger"
    assert field["clip.vision.projection_dim"] == 32 and field["clip.vision.block_count"] == TINY_VISION["depth"]
    assert field["clip.vision.is_deepstack_layers"] == [True, True, False]  # TINY_VISION taps blocks 0 and 1
    names = {t.name: t for t in reader.tensors}
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, TINY_VISION["depth"])
    for hf in ("visual.blocks.2.attn.qkv", "visual.blocks.0.mlp.linear_fc1", "visual.blocks.1.mlp.linear_fc2",
               "visual.pos_embed"):
        assert f"{table.get_name(hf)}.weight" in names, hf
    for extra in ("v.patch_embd.weight.1", "mm.0.weight", "mm.2.bias", "v.post_ln.weight", "v.deepstack.1.fc2.weight"):
        assert extra in names, extra
    assert names["v.blk.0.attn_qkv.weight"].tensor_type.name == "F16"
    assert names["v.blk.0.ln1.weight"].tensor_type.name == "F32"


def test_the_tower_from_the_mmproj_encodes_as_the_dense_file(files):
    want = _fl2va(_te(files["dense"], files))
    exact = _te(files["BF16"], files)
    assert exact.vision_note == "text encoder vision tower from mmproj-te.gguf, found beside te.gguf"
    assert torch.equal(_fl2va(exact), want)
    close = _fl2va(_te(files["F16"], files))
    assert want.abs().max() > 0.5 and torch.allclose(close, want, rtol=0, atol=2e-3), (close - want).abs().max()


def test_generate_fl2va_with_a_gguf_text_encoder_and_its_mmproj(files, demo_models, tmp_path, capsys, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    pytest.importorskip("av")
    first = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 128, 3), dtype=np.uint8)).save(first)
    argv = ["generate", "--dit", str(demo_models / "transformer"), "--vae", str(demo_models / "vae"),
            "--audio-vae", str(demo_models / "audio_vae"), "--text-encoder", str(files["BF16"]),
            "--tokenizer", str(files["tokenizer"]), "--text-encoder-layer", str(files["layers"]),
            "--prompt", "a boat", "--first-frame", str(first), "--width", "128", "--height", "64", "--steps", "2",
            "--out", str(tmp_path / "fl2va.mp4")]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == "fl2va" and summary["frames"] == 124
    assert summary["load_notes"] == ["text encoder vision tower from mmproj-te.gguf, found beside te.gguf"]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(files["BF16"], bare / "te.gguf")
    argv[argv.index(str(files["BF16"]))] = str(bare / "te.gguf")
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert f"error: the text encoder {bare / 'te.gguf'} has no vision tower (a GGUF without its mmproj): " in err


def _copy(src, dst, *, fields=None):
    """src (an mmproj) again, its tensors as stored, with key/values replaced by `fields`."""
    return rewrite_gguf(src, dst, "clip", copy_fields=True, fields=fields)


def _one_line(exc_info, text):
    got = str(exc_info.value)
    assert got == text and "\n" not in got, got


def test_an_mmproj_for_another_model_is_refused(files, tmp_path):
    mmproj = files["F16"].with_name("mmproj-te.gguf")
    wide = _copy(mmproj, tmp_path / "mmproj-wide.gguf", fields={"clip.vision.projection_dim": 5120})
    with pytest.raises(CheckpointError) as err:
        _te(files["F16"], files, vision=wide)
    _one_line(err, f"{wide}: an mmproj for another model: its projection width (clip.vision.projection_dim) is "
                   "5120, this text encoder's hidden size is 32")
    other = _copy(mmproj, tmp_path / "mmproj-qwen2.gguf", fields={"clip.projector_type": "qwen2vl_merger"})
    with pytest.raises(CheckpointError) as err:
        _te(files["F16"], files, vision=other)
    _one_line(err, f"{other}: an mmproj for another model: clip.projector_type is 'qwen2vl_merger', Qwen3-VL's is "
                   "'qwen3vl_merger'")


def test_a_file_that_is_not_an_mmproj_is_refused(files):
    with pytest.raises(CheckpointError) as err:
        _te(files["F16"], files, vision=files["BF16"])
    _one_line(err, f"{files['BF16']}: general.architecture is 'qwen3vl', a text encoder GGUF, not a llama.cpp vision "
                   "file (an mmproj declares 'clip')")


def test_two_mmproj_files_beside_the_text_gguf_are_refused(files, tmp_path):
    for name in ("te.gguf", "mmproj-te.gguf"):
        shutil.copy(files["F16"].with_name(name), tmp_path / name)
    shutil.copy(files["BF16"].with_name("mmproj-te.gguf"), tmp_path / "mmproj-BF16.gguf")
    with pytest.raises(InputError) as err:
        _te(tmp_path / "te.gguf", files)
    _one_line(err, f"{tmp_path}: 2 mmproj files for this text encoder beside te.gguf (mmproj-BF16.gguf, "
                   "mmproj-te.gguf); name the one to use with --text-encoder-vision")
    # Naming one settles it.
    assert _te(tmp_path / "te.gguf", files, vision=tmp_path / "mmproj-te.gguf").vision_tower


def test_other_models_vision_files_beside_are_passed_over(files, tmp_path):
    """A shared folder (ComfyUI's text_encoders) holds other models' mmproj files: discovery takes only this model's."""
    shutil.copy(files["F16"], tmp_path / "te.gguf")
    _copy(files["F16"].with_name("mmproj-te.gguf"), tmp_path / "mmproj-big-model.gguf",
          fields={"clip.vision.projection_dim": 5120})
    assert not _te(tmp_path / "te.gguf", files).vision_tower
    shutil.copy(files["F16"].with_name("mmproj-te.gguf"), tmp_path / "mmproj-te.gguf")
    te = _te(tmp_path / "te.gguf", files)
    assert te.vision_tower and te.vision_note == "text encoder vision tower from mmproj-te.gguf, found beside te.gguf"


def test_a_vision_file_for_a_text_encoder_that_holds_its_tower_is_refused(files):
    vision = files["F16"].with_name("mmproj-te.gguf")
    with pytest.raises(InputError) as err:
        _te(files["dense"], files, vision=vision)
    _one_line(err, f"--text-encoder-vision {vision}: the text encoder {files['dense']} holds its own vision tower "
                   "(only a llama.cpp text GGUF keeps it in a separate mmproj file)")
