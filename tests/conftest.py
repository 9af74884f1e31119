"""Shared pytest set-up: `gpu`-marked tests are skipped without CUDA; without CUDA, Triton kernels run in
Triton's CPU interpreter (TRITON_INTERPRET must be set before any kernel module is imported, hence here)."""

import os

import pytest
import torch

from h3_spark.h3_model.text.torchvision_compat import ensure_importable

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Before anything imports transformers/diffusers: a CUDA torchvision next to the CPU torch must not
# break their imports for the whole run.
ensure_importable()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """The built-in demo's tiny model folder (real names and formats, random weights), made once per run."""
    from h3_spark.h3_model.engine.demo import build_demo_models

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    return build_demo_models(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def tiny_t2va_engine():
    """A loaded T2VA engine over tiny synthetic components (fp32 on the CPU, the fused kernels' PyTorch
    references: Triton's CPU interpreter would spend seconds per pass)."""
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions
    from h3_spark.kernels.settings import KernelSettings
    from h3_spark.measure import synthetic

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    builders = synthetic.component_builders("tiny", ["t2va"], "cpu", torch.float32, torch.float32, text_layer=2)
    options = LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32, text_layer=2,
                          kernels=KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off"))
    return Engine(options=options, overrides=builders).load(["t2va"])
