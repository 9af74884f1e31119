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
