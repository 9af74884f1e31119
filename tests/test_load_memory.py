"""Loading streams: the anonymous memory a DiT load adds stays near the model's own size, never twice it.

A mid-size synthetic checkpoint (~330 MB of bf16 weights) is written by our make-checkpoint and loaded by
load_dit in a fresh process while a thread samples RssAnon (Linux). File pages of the memory-mapped
checkpoint are page cache the kernel can drop, so only anonymous memory counts. Bound: 1.15x the loaded
model's bytes + 32 MB (one layer's dequantization buffers, allocator slack). A control run that first reads
the whole file into memory, as a non-streaming loader would, must exceed that bound, so the probe can fail.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
from h3_spark.h3_model.dit.config import TINY
from memprobe import ANON_PEAK

if not Path("/proc/self/status").is_file():
    pytest.skip("needs Linux /proc to read anonymous memory", allow_module_level=True)

MID = dataclasses.replace(TINY, num_attention_heads=8, attention_head_dim=128, hidden_size=1024, num_layers=6,
                          ffn_dim=4096, time_embed_dim=256, time_embed_hidden_dim=512, text_dim=512, freq_dim=256,
                          rope_freq_dim=16)

PROBE = ANON_PEAK + r"""
import json, sys, torch
import h3_spark.h3_model.checkpoint, h3_spark.h3_model.dit.model
from h3_spark.h3_model.checkpoint import load_dit

before = anon()
start_sampling()
if sys.argv[2] == "read-whole-file-first":
    from safetensors.torch import load_file
    whole = {k: v.clone() for k, v in load_file(sys.argv[1]).items()}
stored = sys.argv[2].startswith("stored")
model = load_dit(sys.argv[1], dtype=torch.bfloat16, stored=stored)
size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
import ctypes, gc
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: what the model holds, not the allocator
loaded = anon() - before
if sys.argv[2] in ("stream-blocks", "stored-stream-blocks"):
    # A VRAM budget's placement (CPU standing in for the GPU): one block resident, the rest packed into host
    # buffers unit by unit, each block's loaded tensors freed as soon as it is packed.
    from h3_spark.h3_model.engine.placement import Placement
    placement = Placement.of(model)
    plan = placement.weights_plan(None)
    plan.resident_blocks, plan.adaln_on_host = 1, True
    placement.apply(plan, "cpu")
    assert model.block_stream is not None and len(model.block_stream.units) == len(model.transformer_blocks) - 1
stop_sampling()
print(json.dumps({"added": peak[0] - before, "model": size, "after_load": loaded}))
"""


def _probe(path: Path, mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE, str(path), mode], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _bound(model_bytes: int) -> float:
    return 1.15 * model_bytes + 32e6


@pytest.mark.parametrize("fmt,layout", [("bf16", "comfy"), ("nvfp4", "comfy"), ("bf16", "diffusers")])
def test_load_adds_about_one_model_of_anonymous_memory(tmp_path, fmt, layout):
    out = tmp_path / ("dit" if layout == "diffusers" else "dit.safetensors")
    make_dit_checkpoint(out, MID, fmt, layout, seed=0)
    probe = _probe(out, "stream")
    assert probe["model"] > 300e6
    assert probe["added"] <= _bound(probe["model"]), probe


def test_the_probe_sees_a_non_streaming_load(tmp_path):
    out = tmp_path / "dit.safetensors"
    make_dit_checkpoint(out, MID, "bf16", "comfy", seed=0)
    probe = _probe(out, "read-whole-file-first")
    assert probe["added"] > _bound(probe["model"]), probe


@pytest.mark.parametrize("fmt", ["int8_convrot", "fp8_scaled", "nvfp4"])
def test_a_quantized_file_kept_stored_adds_almost_nothing(tmp_path, fmt):
    """Kept in its stored form, a quantized file's codes stay views of its memory map: the load adds only the
    unquantized tensors that change dtype and the small NVFP4 plain scales, far below the stored bytes; the same
    file dequantized at load adds its bf16 size (the control: the probe can tell the two apart)."""
    out = tmp_path / "dit.safetensors"
    make_dit_checkpoint(out, MID, fmt, "comfy", seed=0)
    stored = _probe(out, "stored")
    dense = _probe(out, "stream")
    assert stored["model"] < 0.7 * dense["model"]
    # Read after the freed heap is handed back (malloc_trim): 33-39 MB for these files, steady run to run (without
    # the trim the reading wandered between 46 and 106 MB, the allocator's free lists). The dense control adds
    # ~0.71 x its model (the dequantized linears; the file's bf16 tensors stay views).
    assert stored["after_load"] <= 0.25 * stored["model"] + 16e6, stored
    assert dense["after_load"] > 0.6 * dense["model"], dense


def test_streaming_stored_blocks_packs_their_stored_bytes(tmp_path):
    """Under a VRAM budget the streamed blocks of a stored int8 DiT are packed as stored (int8 codes and scales),
    so host memory holds about the stored model once, not its bf16 size."""
    out = tmp_path / "dit.safetensors"
    make_dit_checkpoint(out, MID, "int8_convrot", "comfy", seed=0)
    probe = _probe(out, "stored-stream-blocks")
    assert probe["added"] <= 1.1 * probe["model"] + 32e6, probe
    assert probe["model"] < 0.7 * _probe(out, "stream")["model"]


def test_streaming_the_blocks_of_a_loaded_dit_adds_no_second_copy(tmp_path):
    """Under a VRAM budget the streamed blocks move into host buffers; the loaded tensors each replaces are freed
    as it is packed, so the process holds the model about once (the issue's bound for a bf16 folder: 1.1x)."""
    out = tmp_path / "dit"
    make_dit_checkpoint(out, MID, "bf16", "diffusers", seed=0)
    probe = _probe(out, "stream-blocks")
    assert probe["added"] <= 1.1 * probe["model"] + 32e6, probe
