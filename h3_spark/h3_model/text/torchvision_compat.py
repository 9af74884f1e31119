"""Let PyPI's torchvision import next to a CPU-only torch.

transformers' Qwen3-VL processors need torchvision. PyPI's Linux torchvision wheels are CUDA
builds: next to a CPU-only torch their C++ ops library does not load, and `import torchvision` then
fails registering fake kernels for two ops it never defined (`torchvision::nms` and `qnms`). That
import failure also breaks `from transformers import PreTrainedModel` for every test in the run.

`ensure_importable()` defines those two op schemas (schema only, no kernel) before torchvision is
imported, so its pure-PyTorch transforms (all the Qwen processors use) work; calling nms would
still fail loudly. It does nothing when torch has CUDA, when torchvision is absent or already
imported, or when the ops library loads. The text encoder calls it before importing torchvision
(so the CPU demo runs on a CPU-only torch); tests/conftest.py calls it before diffusers/transformers.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES = []  # keeps the schema library alive for the process


def ensure_importable() -> bool:
    """True when `import torchvision` will work (patching the CPU-torch case); False when it is absent."""
    if "torchvision" in sys.modules:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return False
    import torch

    if torch.version.cuda is not None or _ops_load(spec):
        return True
    if not _LIBRARIES:
        lib = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS.values():
            lib.define(schema)
        _LIBRARIES.append(lib)
    return True


def _ops_load(spec) -> bool:
    import torch

    folder = os.path.dirname(spec.origin)
    libs = [f for f in os.listdir(folder) if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
    if not libs:
        return False
    try:
        torch.ops.load_library(os.path.join(folder, libs[0]))
        return True
    except (OSError, RuntimeError):
        return False
