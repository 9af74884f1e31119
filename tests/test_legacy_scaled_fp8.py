"""ComfyUI's legacy scaled-fp8 files (a `scaled_fp8` marker tensor, `.scale_weight` per fp8 layer, no
`.comfy_quant`) mean the same to every reader: the DiT reader and the text encoder's single-file reader declare
each layer by one rule (checkpoint/layer_reading.py), ComfyUI's: e4m3 per-tensor fp8, and full-precision matrix
multiplication when the marker holds two values. Both files are written by make-checkpoint's writers
(fp8_scaled) and rewritten into the legacy form."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.h3_model.checkpoint import open_dit
from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.dit.config import TINY


def _legacy(path, out, marker_key: str, marker_values: int) -> None:
    """The fp8_scaled file at `path` in the legacy form: no markers, `.scale_weight` names, and a `scaled_fp8`
    marker holding `marker_values` values."""
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    legacy = {k.replace(".weight_scale", ".scale_weight"): v for k, v in tensors.items()
              if not k.endswith(".comfy_quant")}
    assert len(legacy) < len(tensors)  # the writer declared its fp8 layers by markers, dropped here
    legacy[marker_key] = torch.zeros(marker_values, dtype=torch.float8_e4m3fn)
    save_file(legacy, out, metadata=meta)


def _facts(specs) -> set[tuple]:
    return {(s.format, s.full_precision_mm, s.source, s.label) for s in specs if s is not None}


def _dit_specs(tmp_path, marker_values: int) -> set[tuple]:
    made = tmp_path / "dit_fp8.safetensors"
    make_dit_checkpoint(made, TINY, "fp8_scaled", "comfy", seed=4)
    reader = open_dit(made)
    prefix = reader.detected.prefix
    reader.source.close()
    _legacy(made, tmp_path / "dit_legacy.safetensors", f"{prefix}scaled_fp8", marker_values)
    reader = open_dit(tmp_path / "dit_legacy.safetensors")
    try:
        return _facts(reader.quantized_layers().values())
    finally:
        reader.source.close()


def _text_encoder_specs(tmp_path, marker_values: int) -> set[tuple]:
    from h3_spark.h3_model.text.single_file import SingleFile
    from h3_spark.h3_model.text.synthetic import write_text_encoder

    made = tmp_path / "te_fp8.safetensors"
    write_text_encoder(made, "tiny", "fp8_scaled", seed=4)
    _legacy(made, tmp_path / "te_legacy.safetensors", "scaled_fp8", marker_values)
    weights = SingleFile(tmp_path / "te_legacy.safetensors", layer=1 << 30)
    try:
        return _facts(layer.spec for layer in weights.layers.values())
    finally:
        weights.source.close()


@pytest.mark.parametrize("marker_values, full_precision", [(2, True), (0, False), (1, False)])
def test_the_dit_reader_and_the_text_encoder_agree_on_a_legacy_file(tmp_path, marker_values, full_precision):
    pytest.importorskip("transformers")
    want = {("float8_e4m3fn", full_precision, "scaled_fp8", "fp8_scaled")}
    assert _dit_specs(tmp_path, marker_values) == want
    assert _text_encoder_specs(tmp_path, marker_values) == want
