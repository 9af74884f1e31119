"""The flags several sub-commands share: declared once (h3_model/engine/options.py), turned into LoadOptions there,
and their values checked as the user typed them (h3_model/engine/flags.py)."""

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


def _parse(*argv):
    from h3_spark.cli import build_parser

    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("budget", ["24", "22.5GiB"])
def test_a_vram_budget_does_not_combine_with_gpus(monkeypatch, budget):
    from h3_spark.h3_model.engine.options import placement_budget

    monkeypatch.delenv("H3_VRAM_BUDGET", raising=False)
    args = _parse("generate", "--vram-budget", budget, "--gpus", "2")
    with pytest.raises(InputError) as err:
        placement_budget(args, 2)
    assert str(err.value) == "--vram-budget streams blocks on one GPU; it does not combine with --gpus yet"
    # One GPU keeps the budget it was given; auto (the flag's or the variable's) under --gpus means resident.
    assert placement_budget(args, 1) == {"24": 24 * 10 ** 9, "22.5GiB": int(22.5 * 2 ** 30)}[budget]
    assert placement_budget(_parse("serve", "--output-dir", "o", "--vram-budget", "auto"), 4) is None
    monkeypatch.setenv("H3_VRAM_BUDGET", "16")
    with pytest.raises(InputError, match="does not combine with --gpus"):
        placement_budget(_parse("serve", "--output-dir", "o", "--gpus", "2"), 2)


@pytest.mark.parametrize("argv,message", [
    (("--gpus", "0"), "--gpus must be at least 1, got 0"),
    (("--nnodes", "2"), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (("--prefetch-depth", "0"), "--prefetch-depth must be at least 1, got 0"),
    (("--device", "tpu"), "--device must be cpu, cuda or cuda:N, got 'tpu'"),
])
@pytest.mark.parametrize("door", [("generate",), ("serve", "--output-dir", "o")])
def test_placement_flags_are_checked_alike_by_every_door(door, argv, message):
    from h3_spark.h3_model.engine.options import check_placement

    with pytest.raises(InputError) as err:
        check_placement(_parse(*door, *argv))
    assert message in str(err.value)


def test_generate_and_serve_load_the_same_options_from_the_same_flags(monkeypatch, tmp_path):
    from h3_spark.h3_model.engine.options import load_options
    from h3_spark.serve.command import service_settings

    for name in ("H3_VRAM_BUDGET", "H3_HOST_BUDGET", "H3_VAE_DTYPE", "H3_VAE_TILE_SIZE", "H3_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    flags = ("--device", "cpu", "--dtype", "bfloat16", "--vae-dtype", "float16", "--vae-tile-size", "0",
             "--mlp-chunks", "3", "--attention", "sdpa", "--linear", "bf16", "--vram-budget", "7GB",
             "--prefetch-depth", "3", "--host-budget", "9GiB", "--qkv-layout", "stacked", "--text-encoder-layer", "7",
             "--dit", str(tmp_path / "dit.safetensors"))
    generate = _parse("generate", *flags)
    options, request = load_options(generate, "cpu")
    paths, served, config = service_settings(_parse("serve", "--output-dir", str(tmp_path), *flags))
    assert served == options
    assert (config.vae_tile_size, config.mlp_chunks) == (request.vae_tile_size, request.mlp_chunks) == (None, 3)
    assert paths.dit == tmp_path / "dit.safetensors"
    assert (options.dtype, options.vae_dtype, options.text_layer, options.qkv_layout) == (
        torch.bfloat16, torch.float16, 7, "stacked")
    assert (options.kernels.attention, options.kernels.linear) == ("sdpa", "bf16")
    assert (options.vram_budget, options.prefetch_depth, options.host_budget) == (7 * 10 ** 9, 3, 9 * 2 ** 30)
    # Left out: the device's dtypes, the released model's text layer, the default tile.
    options, request = load_options(_parse("serve", "--output-dir", "o"), "cpu")
    assert (options.dtype, options.vae_dtype, options.text_layer, request.vae_tile_size) == (
        torch.float32, torch.float32, 50, 256)
