"""Which H3 VAE a file or folder holds, from its config or its safetensors header alone (no tensor is read).

ComfyUI keeps every VAE in one folder (models/vae), so a loader offering a video VAE slot and an audio VAE
slot lists the same names in both; this tells them apart so each slot can offer its own kind first and a
file picked for the wrong slot is named as what it is before anything loads.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Iterable

from ...errors import CheckpointError
from . import released
from .loading import TensorFiles, locate

VIDEO, AUDIO = "video", "audio"
# The audio VAE's attention block before its encoder (every layout keeps these names).
_AUDIO_KEYS = ("pre_block.attn.qkv.weight", "pre_block.attn.zero_k_bias")
# The video VAE's transformer decoder: in diffusers' names and ComfyUI's single file alike.
_VIDEO_PREFIX = "decoder.transformer_blocks."


def kind_of_keys(keys: Iterable[str]) -> str | None:
    keys = set(keys)
    if any(k in keys for k in _AUDIO_KEYS):
        return AUDIO
    if any(k.startswith(_VIDEO_PREFIX) for k in keys) and any(k.startswith("encoder.") for k in keys):
        return VIDEO
    return None


def vae_kind(path: str | os.PathLike) -> str | None:
    """"video", "audio", or None for anything else (another model's VAE, an unreadable file)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        return None
    return _kind(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1024)
def _kind(path: str, mtime_ns: int, size: int) -> str | None:
    # Keyed by the entry's time and size: a file replaced under the same name is read again.
    folder = Path(path)
    if folder.is_dir():
        for config in (folder / "config.json", *(folder / child / "config.json" for child in ("video_vae", "audio_vae"))):
            declared = _declared(config)
            if declared is not None:
                return declared
    for component in ("vae", "audio_vae"):
        try:
            source = locate(path, component)
            with TensorFiles(source.files) as files:
                return kind_of_keys(files.keys())
        except CheckpointError:
            continue
    return None


def _declared(config: Path) -> str | None:
    """The kind MiniMaxAI's own VAE folder declares in its config.json."""
    if not config.is_file():
        return None
    try:
        name = json.loads(config.read_text()).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return {released.VIDEO_CLASS: VIDEO, released.AUDIO_CLASS: AUDIO}.get(name)
