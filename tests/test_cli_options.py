"""The flags several sub-commands share (h3_model/engine/flags.py), checked as the user typed them."""

import pytest
import torch

from h3_spark.h3_model.engine.flags import check_device, file_in_the_way
from h3_spark.kernels.settings import kernel_settings
from h3_spark.errors import InputError


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:1"])
def test_devices_that_exist_pass(two_gpus, name):
    assert check_device(name) == name


@pytest.mark.parametrize("name,message", [
    ("tpu", "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    ("cuda:", "--device must be cpu, cuda or cuda:N, got 'cuda:'"),
    ("cuda:x", "--device must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ("cuda:2", "--device cuda:2: this machine has 2 CUDA GPU(s)"),
])
def test_other_devices_are_refused_by_name(two_gpus, name, message):
    with pytest.raises(InputError) as err:
        check_device(name)
    assert message in str(err.value)


def test_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="--device cuda asked for, but this machine has no CUDA GPU"):
        check_device("cuda")


def test_flags_override_the_environment_and_are_named_when_wrong(monkeypatch):
    monkeypatch.setenv("H3_ATTENTION", "fa3")
    assert kernel_settings(None, None).attention == "fa3"
    assert kernel_settings("sdpa", "bf16").attention == "sdpa"
    with pytest.raises(InputError) as err:
        kernel_settings("bogus", None)
    assert "--attention 'bogus' is not accepted" in str(err.value) and "H3_ATTENTION" not in str(err.value)


def test_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("")
    assert file_in_the_way(tmp_path / "f" / "sub") == tmp_path / "f"
    assert file_in_the_way(tmp_path / "new" / "sub") is None
