"""What this machine can run, and the errors that say so.

Every fast path asks here before it is chosen. A path that cannot run raises `KernelUnavailable`
naming what was asked, what is missing (package, GPU capability) and how to get it: we never fall
back silently to something slower or less exact.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch

from ..errors import H3Error

HOPPER = (9, 0)
BLACKWELL = (10, 0)


class KernelUnavailable(H3Error):
    """A requested backend or format cannot run on this machine."""


class NotInstalled(KernelUnavailable):
    """What a backend or format needs is not installed (as opposed to installed and unable to run here)."""


class SettingsError(H3Error):
    """An H3_* kernel variable holds a value we do not accept."""


def as_device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device if device is not None else "cpu")


def capability(device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device, None for anything else."""
    device = as_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def describe_device(device) -> str:
    device = as_device(device)
    cap = capability(device)
    if cap is None:
        return f"{device.type} (no CUDA GPU)" if device.type != "cuda" else "cuda requested but no CUDA GPU is visible"
    return f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"


def is_hopper(device) -> bool:
    return capability(device) == HOPPER


def is_blackwell(device) -> bool:
    cap = capability(device)
    return cap is not None and cap[0] >= 10


def require_cuda(what: str, device, minimum: tuple[int, int] | None = None,
                 exactly: tuple[int, int] | None = None, why: str = "") -> tuple[int, int]:
    """The device's capability, or KernelUnavailable saying which GPU `what` needs."""
    cap = capability(device)
    need = (f"sm_{exactly[0]}{exactly[1]}" if exactly else
            f"sm_{minimum[0]}{minimum[1]} or newer" if minimum else "a CUDA GPU")
    reason = f" ({why})" if why else ""
    if cap is None:
        raise KernelUnavailable(f"{what} needs {need}{reason}; this run is on {describe_device(device)}")
    if exactly is not None and cap != exactly:
        raise KernelUnavailable(f"{what} needs {need}{reason}; this GPU is {describe_device(device)}")
    if minimum is not None and cap < minimum:
        raise KernelUnavailable(f"{what} needs {need}{reason}; this GPU is {describe_device(device)}")
    return cap


def require_module(what: str, module: str, how: str) -> ModuleType:
    """Import `module` for `what`, or KernelUnavailable with the install hint `how`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NotInstalled(f"{what} needs the Python module `{module}`, which is not importable here "
                                f"({exc.__class__.__name__}: {exc}); {how}") from None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def require_triton(what: str, device) -> ModuleType:
    """Triton for a fused kernel: a CUDA GPU, or the CPU interpreter (TRITON_INTERPRET=1, tests only)."""
    triton = require_module(what, "triton", "install it with `pip install triton` (Linux; the `gpu` extra)")
    device = as_device(device)
    if device.type != "cuda" and not triton_interpreting():
        raise KernelUnavailable(f"{what} is a Triton GPU kernel and needs a CUDA GPU; this run is on "
                                f"{describe_device(device)} (set its switch to `off` to use the PyTorch reference)")
    return triton


def triton_ready(device) -> bool:
    """Whether Triton kernels can run on `device` (`require_triton` without the error)."""
    try:
        require_triton("probe", device)
        return True
    except KernelUnavailable:
        return False


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, set by the tests)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)
