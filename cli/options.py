"""Flags several sub-commands share, checked the same way everywhere: as the user typed them, before loading."""

from __future__ import annotations

from pathlib import Path

MODELS_HELP = ("a model folder: today's official download (FL2VA/ and/or Ref2VA/, or one of them), or the older "
               "layout (transformer/, transformer_ref/, text_encoder/, vae/, audio_vae/)")


def check_device(name: str) -> str:
    """`cpu` or `cuda[:N]` that exists here; anything else is refused naming the flag (torch would raise a
    RuntimeError deep inside the first tensor move)."""
    from ..errors import InputError

    if name == "cpu":
        return name
    index = name[len("cuda:"):] if name.startswith("cuda:") else None
    if name != "cuda" and not (index and index.isdigit()):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    import torch

    if not torch.cuda.is_available():
        raise InputError(f"--device {name} asked for, but this machine has no CUDA GPU")
    if index is not None and int(index) >= torch.cuda.device_count():
        raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return name


def file_in_the_way(folder: Path) -> Path | None:
    """The first of `folder` and its parents that exists but is not a folder (so `folder` cannot be made)."""
    return next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
