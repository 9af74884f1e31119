"""`h3-spark trace-dit` on a tiny checkpoint made here: the DiT comes from the engine's loader (resident, no
kernels), the velocities are the model's own forward, and a folder's one DiT is found without --partition."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import made_files
from h3_spark.cli import main
from h3_spark.cli.trace_dit import dit_key
from h3_spark.errors import H3Error
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.dit.trace import INPUT_KEYS
from h3_spark.h3_model.pipeline.scheduler import JointSchedule
from h3_spark.measure.contract import contract_shape, load_contract
from h3_spark.measure.runner import make_inputs

from test_bench import ROOT


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return made_files(tmp_path_factory.mktemp("trace"), TINY, ("bf16",), seed=8)["bf16"]


def _inputs(path) -> dict:
    """The tiny t2va contract's forward inputs at its middle step, stored under diffusers' names."""
    contract = load_contract(ROOT / "tests" / "data" / "tiny-t2va.json")
    schedule = JointSchedule.create(contract["steps"])
    inputs = make_inputs(contract_shape(contract, TINY), TINY, "cpu", 3, len(schedule) // 2, schedule)
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"].float()
    save_file({k: inputs[k].contiguous() for k in INPUT_KEYS}, str(path))
    return inputs


def test_trace_dit_loads_through_the_engines_loader_and_writes_the_forward(checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    from h3_spark.h3_model import checkpoint as ckpt

    inputs = _inputs(tmp_path / "in.safetensors")
    with torch.inference_mode():
        want_video, want_audio = ckpt.load_dit(checkpoint, dtype=torch.float32)(**inputs)
    real, callers = ckpt.load_dit, []

    def recording(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals["__name__"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "load_dit", recording)
    out = tmp_path / "out.safetensors"
    assert main(["trace-dit", "--checkpoint", str(checkpoint), "--inputs", str(tmp_path / "in.safetensors"),
                 "--out", str(out)]) == 0
    assert callers == ["h3_spark.h3_model.engine.loading"]
    assert json.loads(capsys.readouterr().out)["sample"] == list(want_video.shape)
    got = load_file(str(out))
    assert torch.equal(got["sample"], want_video.float()) and torch.equal(got["audio_sample"], want_audio.float())


def test_a_folders_one_dit_needs_no_partition(checkpoint, tmp_path):
    """Each key is the one whose partition the loader accepts for that path (a released mode folder's
    model_index.json names its DiT), as `load_dit` without a partition took the folder's one DiT."""
    from h3_spark.h3_model.engine.loading import LoadOptions, component_loader

    assert dit_key(checkpoint, None) == "dit" and dit_key(checkpoint, "ref2va") == "dit_ref"
    for mode, partition in (("Ref2VA", "ref2va"), ("FL2VA", "fl2va")):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": partition}}))
    for folder, key in (("root/transformer_ref", "dit_ref"), ("old/transformer", "dit"),
                        ("Ref2VA/transformer", "dit_ref"), ("FL2VA/transformer", "dit")):
        (tmp_path / folder).mkdir(parents=True)
        shutil.copy(checkpoint, tmp_path / folder / "diffusion_pytorch_model.safetensors")
        assert dit_key(tmp_path / folder, None) == key, folder
        component_loader(key, tmp_path / folder, LoadOptions(dtype=torch.float32, kernels=None))()
    assert dit_key(tmp_path / "root", None) == "dit_ref"  # its one DiT folder, transformer_ref/
    (tmp_path / "root" / "transformer").mkdir()
    shutil.copy(checkpoint, tmp_path / "root" / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(H3Error, match="holds both transformer/ and transformer_ref/; choose the partition"):
        dit_key(tmp_path / "root", None)
    assert dit_key(tmp_path / "root", "t2va") == "dit"
