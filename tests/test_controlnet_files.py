"""H3 Fun ControlNet files: written by our make-checkpoint in ComfyUI's and Alibaba PAI's layouts, detected by their
keys, named by inspect, read back through the real reader into the tower.

Tolerances: a bf16 file holds each fp32 weight rounded to bf16 (relative error <= 2^-8 per element, the hint
projection fp32 exactly); an int8_convrot layer read as its codes (StoredLinear) gives the same output as the same
layer dequantized at load, bit for bit.
"""

import json
import struct

import pytest
import torch

from h3_spark.cli import main
from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.checkpoint import open_dit
from h3_spark.h3_model.checkpoint.controlnet import (ControlNetFile, load_tower, random_getter, synthetic_config,
                                                     write_controlnet)
from h3_spark.h3_model.checkpoint.make import CURVE_DEFAULTS
from h3_spark.h3_model.dit.config import FULL, TINY
from h3_spark.kernels.stored_linear import StoredLinear

import dataclasses

CURVE_TINY = dataclasses.replace(TINY, adaln_curve_grid=CURVE_DEFAULTS["tiny"][0],
                                 time_embed_dim=CURVE_DEFAULTS["tiny"][1])


def _make(tmp_path, capsys, name, *argv):
    out = tmp_path / name
    assert main(["make-checkpoint", str(out), "--component", "controlnet", *argv]) == 0
    return out, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("layout,union2", [("comfy", False), ("comfy", True), ("released", False),
                                           ("released", True)])
def test_written_files_read_back_and_inspect_names_them(tmp_path, capsys, layout, union2):
    out, made = _make(tmp_path, capsys, "cn.safetensors", "--layout", layout, *(["--union2"] if union2 else []))
    version = "union2" if union2 else "v1"
    assert made["version"] == version and made["blocks"] == 2 and made["places"] == [0, 1]
    assert main(["inspect", str(out), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"Fun ControlNet Union {version}: 2 blocks after DiT layers 0, 1" in printed and "complete" in printed
    report = json.loads((tmp_path / "cn.inspect.json").read_text())
    assert report["model"] == "controlnet" and report["layout"] == layout
    assert report["controlnet"]["inpaint_fill"] == ("mid-gray (post_norm)" if union2 else "black")
    dit = CURVE_TINY if layout == "comfy" else TINY
    config = synthetic_config(TINY, union2=union2, comfy=layout == "comfy")
    get = random_getter(config, 0)
    tower = load_tower(out, dit, dtype=torch.float32, stored=False)
    for name, param in tower.named_parameters():
        want = get(name)
        err = (param.float() - want).abs().max() / want.abs().max()
        if layout == "released" or "norm" in name or name.endswith("bias") or "adaln" in name:
            assert err <= 2 ** -8, name
        else:  # int8 rows after the ConvRot rotation: a fraction of a percent of the row's largest value
            assert err <= 0.02, name
    assert tower.config.curve_form == (layout == "comfy")


def test_stored_codes_run_as_the_dequantized_layers(tmp_path, capsys):
    out, _ = _make(tmp_path, capsys, "cn.safetensors", "--layout", "comfy")
    kept = load_tower(out, CURVE_TINY, dtype=torch.float32, stored=True)
    loaded = load_tower(out, CURVE_TINY, dtype=torch.float32, stored=False)
    gen = torch.Generator().manual_seed(1)
    for k in range(2):
        a, b = kept.control_blocks[k], loaded.control_blocks[k]
        assert isinstance(a.attn.to_q, StoredLinear) and isinstance(a.after_proj, StoredLinear)
        for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "after_proj"):
            x = torch.randn(1, 7, a.get_submodule(name).in_features, generator=gen)
            assert torch.equal(a.get_submodule(name)(x), b.get_submodule(name)(x)), name


def test_full_size_plans_are_the_published_shapes():
    v1 = synthetic_config(FULL, union2=False, comfy=True)
    assert v1.places == (0, 10, 20, 30, 40) and v1.time_embed_dim == 8 and v1.curve_form
    u2 = synthetic_config(FULL, union2=True, comfy=False)
    assert u2.places == tuple(range(0, 50, 5)) and u2.time_embed_dim == 2688 and u2.version == "union2"
    from h3_spark.h3_model.checkpoint.controlnet import controlnet_groups

    groups = controlnet_groups(v1, random_getter(v1, 0), "comfy")
    entries = {name: (dt, shape) for g in groups for name, dt, shape in g.entries}
    assert entries["control_proj_in.weight"] == ("F32", (5376, 196))
    assert entries["control_blocks.0.attn.qkv_proj.weight"] == ("I8", (3 * 7168, 5376))
    assert entries["control_blocks.0.adaln_proj.linear.weight"] == ("F32", (6 * 3 * 5376, 8))
    assert entries["control_blocks.4.after_proj.weight"] == ("I8", (5376, 5376))
    assert "control_blocks.1.before_proj.weight" not in entries
    weights = sum(1 for n, (dt, _) in entries.items() if n.endswith(".weight") and dt == "I8")
    assert weights == 5 * 5 + 1  # qkv, out, fc1, fc2, after_proj per block; before_proj once


def _rewrite_metadata(path, **meta):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {**header.get("__metadata__", {}), **meta}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def test_bad_files_are_refused_in_one_line_before_weights(tmp_path, capsys):
    out, _ = _make(tmp_path, capsys, "cn.safetensors", "--layout", "released")
    with pytest.raises(CheckpointError, match="holds the H3 Fun ControlNet .*--controlnet.*, not the DiT"):
        open_dit(out)
    dit_file = tmp_path / "dit.safetensors"
    assert main(["make-checkpoint", str(dit_file)]) == 0
    with pytest.raises(CheckpointError, match="holds the DiT \\(give it with --dit\\), not an H3 Fun ControlNet"):
        ControlNetFile(dit_file)
    wide = dataclasses.replace(TINY, hidden_size=32)
    with pytest.raises(CheckpointError, match="is for a DiT 24 wide .* this DiT is 32 wide"):
        load_tower(out, wide)
    with pytest.raises(CheckpointError, match="full AdaLN reading 16 values, the DiT pruned"):
        load_tower(out, CURVE_TINY)
    deep = tmp_path / "deep.safetensors"
    config = synthetic_config(dataclasses.replace(TINY, num_layers=4), union2=False, comfy=False)
    write_controlnet(deep, config, random_getter(config, 0), "released")
    with pytest.raises(CheckpointError, match="injects after DiT layer 3 but the DiT has 2 layers"):
        load_tower(deep, TINY)
    _rewrite_metadata(out, control_blocks_places="[0, 1, 2]")
    with pytest.raises(CheckpointError, match="control_blocks_places .* is not a list of 2 DiT layers"):
        ControlNetFile(out)


def test_a_missing_tensor_is_named(tmp_path):
    config = synthetic_config(TINY, union2=False, comfy=False)
    get = random_getter(config, 0)
    path = tmp_path / "cn.safetensors"
    write_controlnet(path, config, get, "released")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    del tensors["control_blocks.1.attn.norm_k.weight"]
    save_file(tensors, path, metadata={"control_blocks_places": "[0, 1]"})
    with pytest.raises(CheckpointError, match="1 tensors of the control tower missing, e.g. "
                                              "control_blocks.1.attn.norm_k.weight"):
        ControlNetFile(path).check()


@pytest.mark.parametrize("layout", ["comfy", "released"])
def test_device_bytes_from_the_header_are_what_the_loaded_tower_holds(tmp_path, capsys, layout):
    from h3_spark.kernels.stored_linear import scratch_bytes

    out, _ = _make(tmp_path, capsys, "cn.safetensors", "--layout", layout)
    tower = load_tower(out, CURVE_TINY if layout == "comfy" else TINY, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in [*tower.parameters(), *tower.buffers()])
    with ControlNetFile(out) as f:
        assert f.device_bytes(torch.bfloat16) >= held
        assert f.device_bytes(torch.bfloat16) <= held + max(scratch_bytes(tower), 2 * 128 * 24 * 2)


@pytest.mark.parametrize("layout", ["comfy", "released"])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_streamed_minimum_from_the_header_is_the_loaded_towers(tmp_path, capsys, layout, depth):
    """What the DiT's plan sets aside before the tower loads equals what the loaded tower's own plan needs with
    every block streamed (stored int8_convrot layers as their codes, plus the dequantization scratch)."""
    from h3_spark.h3_model.engine.memory import measure_tower, streamed_minimum

    out, _ = _make(tmp_path, capsys, "cn.safetensors", "--layout", layout)
    tower = load_tower(out, CURVE_TINY if layout == "comfy" else TINY, dtype=torch.bfloat16)
    with ControlNetFile(out) as f:
        assert f.streamed_bytes(torch.bfloat16, depth) == streamed_minimum(measure_tower(tower, depth))


def test_a_budget_leaves_the_tower_its_streamed_minimum_and_streams_the_rest(tmp_path):
    """Under a VRAM budget (emulated on the CPU) the DiT's plan takes the ControlNet's streamed minimum (read from
    the header) out of its share, and the loaded tower keeps resident what the DiT's plan leaves: beside the 8-block
    DiT a 4-block tower streams its other blocks through the DiT's machinery."""
    from h3_spark.h3_model.engine import memory
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import synthetic

    deep = dataclasses.replace(TINY, num_layers=8)  # enough blocks that streaming some of them saves memory
    dit = {"dit": lambda: synthetic.synthetic_dit(deep, torch.float32, "cpu")}

    def engine(budget):
        options = LoadOptions(device="cpu", dtype=torch.float32, kernels=KernelSettings(
            modulation_fusion="off", q_rms_rope_int8_fusion="off"), vram_budget=budget, plan_rows=64)
        return Engine(options=options, overrides=dit)

    probe = engine(100 * memory.GB).load(["t2va"], dit_only=True).memory_plans["dit"]
    config = dataclasses.replace(synthetic_config(deep, union2=False, comfy=False), places=(0, 2, 4, 6))
    path = tmp_path / "cn.safetensors"
    write_controlnet(path, config, random_getter(config, 0), "released")
    budget = memory.budget_for(probe.device_bytes)
    plain = engine(budget).load(["t2va"], dit_only=True).memory_plans["dit"]
    controlled = engine(budget)
    controlled.check_controlnet(path, ["t2va"])
    with ControlNetFile(path) as f:
        # The DiT's plan leaves the tower the least it runs in: its blocks streamed, as the loaded tower measures.
        assert controlled.controlnet_reserve == f.streamed_bytes(torch.float32, 2) > 0
    controlled.load(["t2va"], dit_only=True)
    plan = controlled.memory_plans["dit"]
    assert plain.budget - plan.budget == controlled.controlnet_reserve
    assert plan.device_bytes < plain.device_bytes  # the DiT keeps less on the device (here: its AdaLN on the host)
    controlled.load_controlnet(path)
    tower_plan = controlled.controlnet_plan
    assert memory.streamed_minimum(tower_plan) == controlled.controlnet_reserve
    # The tower keeps resident what the DiT's plan left beside that minimum; here not all: its other blocks stream.
    report = controlled.memory_report("controlnet")
    assert report["resident_blocks"] + report["streamed_blocks"] == 4 and report["streamed_blocks"] >= 1
    assert report["room_bytes"] == memory.tower_room(budget, [plan], 0) and "slack_bytes" not in report
    room = memory.tower_room(budget, [plan], 0)
    assert tower_plan.device_bytes <= room < tower_plan.device_bytes + tower_plan.blocks[report["resident_blocks"]]
    stream = controlled.components.controlnet.block_stream
    assert sorted(stream.units) == tower_plan.streamed
    assert controlled.host_plan["controlnet_streamed_bytes"] == stream.host_bytes > 0  # checked by --host-budget
    # A budget that holds the streamed DiT but not the tower's minimum beside it: refused at load, naming both.
    tight = memory.budget_for(memory.streamed_minimum(probe))
    engine(tight).load(["t2va"], dit_only=True)  # the DiT alone fits
    refused = engine(tight)
    refused.check_controlnet(path, ["t2va"])
    with pytest.raises(InputError, match=rf"VRAM budget of .* less the {memory.gb(refused.controlnet_reserve)} the "
                                         r"ControlNet's tower needs with its blocks streamed is below what a streamed "
                                         r"DiT forward needs"):
        refused.load(["t2va"], dit_only=True)
    # Without the check before the load, the tower's own plan refuses it, naming its minimum.
    unchecked = engine(tight).load(["t2va"], dit_only=True)
    with pytest.raises(InputError, match=rf"leaves the ControlNet .* below the {memory.gb(refused.controlnet_reserve)} "
                                         r"its tower needs with every block streamed"):
        unchecked.load_controlnet(path)
    assert unchecked.components.controlnet is None
