"""Tiny checkpoints written by our make-checkpoint, one file per format, for the loader tests."""

from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint


def made_files(root, config, formats, seed: int, **options) -> dict:
    """format -> path of a comfy-layout file of `config` with random weights from `seed`."""
    out = {}
    for fmt in formats:
        out[fmt] = root / f"{fmt}.safetensors"
        make_dit_checkpoint(out[fmt], config, fmt, "comfy", seed=seed, **options)
    return out
