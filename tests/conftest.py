"""Shared pytest set-up: `gpu`-marked tests are skipped without CUDA; without CUDA, Triton kernels run in
Triton's CPU interpreter (TRITON_INTERPRET must be set before any kernel module is imported, hence here)."""

import os
import sys
from pathlib import Path

import pytest

# The tests run against the installed package (`pip install -e .` maps `h3_spark` to the h3_spark/ folder here).
# `python -m pytest` puts the checkout's root first on sys.path; nothing there may stand in for an installed
# module during the run, so the root leaves the path before anything is imported.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.curdir).resolve() != ROOT]

try:
    import h3_spark  # noqa: F401
except ModuleNotFoundError:
    pytest.exit("h3_spark is not installed in this Python: run the README's set-up (pip install -e \".[test]\")",
                returncode=4)

import torch  # noqa: E402

from h3_spark.h3_model.text.torchvision_compat import ensure_importable  # noqa: E402

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
