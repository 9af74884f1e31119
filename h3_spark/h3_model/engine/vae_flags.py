"""The video VAE decode settings every front door takes: flag, else H3_VAE_DTYPE / H3_VAE_TILE_SIZE, else
default. (H3_VAE_TILE_BATCH has no flag: `kernels.settings.vae_tile_batch`, which the
ComfyUI nodes use too.)"""

from __future__ import annotations

import os
from typing import Mapping

DTYPES = ("float16", "float32")
DEFAULT_TILE_SIZE = 256


def vae_options(dtype: str | None, tile: int | None, default_dtype: str,
                environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(decode dtype name, tile size in pixels; 0 = untiled). Flags win over the environment."""
    from ...errors import InputError

    environ = os.environ if environ is None else environ
    dtype = dtype or environ.get("H3_VAE_DTYPE") or default_dtype
    if dtype not in DTYPES:
        raise InputError(f"H3_VAE_DTYPE={dtype!r}: choose one of {', '.join(DTYPES)}")
    if tile is None:
        raw = environ.get("H3_VAE_TILE_SIZE")
        try:
            tile = int(raw) if raw not in (None, "") else DEFAULT_TILE_SIZE
        except ValueError:
            raise InputError(f"H3_VAE_TILE_SIZE={raw!r}: expected a whole number of pixels (0 = untiled)") from None
    if tile < 0:
        raise InputError(f"tile size must be >= 0 (0 = untiled), got {tile}")
    return dtype, tile
