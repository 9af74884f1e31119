"""A GGUF DiT that declares another architecture (the community `MiniMax-H3-FL2VA-Q3_K_M.gguf` says `wan`).

Files are written by the gguf package's own GGUFWriter from a make-checkpoint GGUF's stored tensors (their bytes
unchanged), under another `general.architecture`. Claims:
- H3's tensor names and shapes under `wan` (Q3_K, the repack's type, and Q8_0) load; the velocities equal the
  same file labelled minimax_h3 bit for bit (torch.equal), and the model's origin, the engine's report and the
  generate summary carry the one-line note naming the declared architecture;
- a real `wan` file (Wan's tensor names), and `wan` over H3's names with one shape wrong, are refused in one line
  naming the file, the declared architecture and what does not fit.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from h3_spark.errors import CheckpointError  # noqa: E402
from h3_spark.h3_model.checkpoint import load_dit  # noqa: E402
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint  # noqa: E402
from h3_spark.h3_model.dit import layout  # noqa: E402
from h3_spark.h3_model.dit.config import TINY  # noqa: E402
from gguf_files import rewrite_gguf  # noqa: E402
from oracle import text_tags  # noqa: E402

# Rows of 256 values: every block linear takes Q3_K (the published repack's type) without an F16 fallback.
K_ALIGNED = dataclasses.replace(TINY, hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_dim=256,
                                text_dim=32, time_embed_dim=32)


def _relabel(src, dst, arch, *, replace=None):
    """src's tensors (stored bytes as they are) under `arch`; `replace` swaps a tensor for another array."""
    return rewrite_gguf(src, dst, arch, replace=replace)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mislabelled")
    out = {}
    for t in ("Q3_K", "Q8_0"):
        good = make_dit_checkpoint(root / f"h3_{t}.gguf", K_ALIGNED, f"gguf:{t}", "comfy", seed=5).path
        out[t] = good, _relabel(good, root / f"MiniMax-H3-FL2VA-{t}.gguf", "wan")
    return out


def _velocity(model):
    c = model.config
    lay = layout.build_t2va(text_tags(6, vision=(2, 4)), 2, 4, 4, 3, keyframes=("first",))
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, lay.video_indices.numel(), c.video_patch_dim, generator=gen),
                  audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), c.audio_in_channels, generator=gen),
                  encoder_hidden_states=torch.randn(1, lay.num_text, c.text_dim, generator=gen),
                  token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
                  audio_indices=lay.audio_indices, text_indices=lay.text_indices)
    ts, idx = lay.row_timesteps(0.7, 0.4, 0.999)
    with torch.no_grad():
        return model(**inputs, timestep=ts, timestep_indices=idx)


@pytest.mark.parametrize("gguf_type", ["Q3_K", "Q8_0"])
def test_h3_tensors_under_wan_load_with_a_note(files, gguf_type):
    good, wan = files[gguf_type]
    assert gguf.GGUFReader(wan).fields["general.architecture"].contents() == "wan"
    model = load_dit(wan, stored=True)
    note = model.checkpoint_origin.note
    assert note == (f"{wan.name} declares general.architecture 'wan' but holds the H3 DiT's tensors (every name and "
                    "shape checked): loaded as the H3 DiT"), note
    assert load_dit(good, stored=True).checkpoint_origin.note is None
    want = _velocity(load_dit(good, stored=True))
    assert all(torch.equal(a, b) for a, b in zip(_velocity(model), want))


def test_the_note_reaches_the_report(files):
    from h3_spark.h3_model.engine.report import describe_models

    class Models:
        components = type("C", (), {"dit": load_dit(files["Q8_0"][1]), "dit_ref": None, "text_encoder": None,
                                    "vae": None, "audio_vae": None})()
        kernel_reports: dict = {}
        world_size = 1

        def memory_report(self, name):
            return None

    report = describe_models(Models())
    assert "declares general.architecture 'wan'" in report["dit"]["note"]
    json.dumps(report)


def _wan_file(path):
    """A (tiny) Wan 2.x DiT's names and layout: what a true `wan` GGUF holds."""
    writer = gguf.GGUFWriter(path, "wan")
    gen = np.random.default_rng(0)
    for name, shape in {"patch_embedding.weight": (64, 16, 1, 2, 2), "text_embedding.0.weight": (64, 32),
                        "blocks.0.self_attn.q.weight": (64, 64), "blocks.0.ffn.0.weight": (128, 64),
                        "head.head.weight": (64, 64)}.items():
        writer.add_tensor(name, gen.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_is_not_h3_is_refused(tmp_path):
    path = _wan_file(tmp_path / "wan2.1_t2v_1.3B-Q8_0.gguf")
    with pytest.raises(CheckpointError) as err:
        load_dit(path)
    text = str(err.value)
    assert text.startswith(f"{path}: general.architecture is 'wan', and its tensors are not an H3 DiT's (not an H3 "
                           "checkpoint (no DiT, video VAE, audio VAE or Qwen3-VL text encoder tensor names; found e.g. "
                           "blocks.0.ffn.0.weight,"), text
    assert text.endswith("): not an H3 DiT GGUF") and "\n" not in text


def test_h3_names_with_a_wrong_shape_under_wan_are_refused(files, tmp_path):
    good, _ = files["Q8_0"]
    bad = _relabel(good, tmp_path / "wrong.gguf", "wan",
                   replace={"blocks.1.attn.k_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointError) as err:
        load_dit(bad)
    text = str(err.value)
    assert text == (f"{bad}: general.architecture is 'wan', and its tensors are not an H3 DiT's (1 tensors have the "
                    "wrong shape: transformer_blocks.1.attn.norm_k.weight is [64], expected [128] (file name: "
                    "blocks.1.attn.k_norm.weight)): not an H3 DiT GGUF"), text


def test_a_text_encoder_label_over_a_non_dit_is_refused_naming_it(tmp_path):
    path = _wan_file(tmp_path / "x.gguf")
    relabelled = _relabel(path, tmp_path / "qwen.gguf", "qwen3vl")
    with pytest.raises(CheckpointError, match=r"general.architecture is 'qwen3vl', a text encoder GGUF, and its "
                                              r"tensors are not an H3 DiT's \(not an H3 checkpoint"):
        load_dit(relabelled)
