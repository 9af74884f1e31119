"""The pictures a finished video is downloaded as besides its mp4: a thumbnail (its first frame, WebP, as OpenAI
serves it) and a spritesheet (frames spread evenly over the clip in one grid, JPEG). Both are read from the mp4 with
PyAV and made when asked for; nothing is stored."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from ..h3_model.media import files as media

SPRITES = 16  # frames in a spritesheet, at most
SPRITE_COLUMNS = 4
# Each frame scaled to this width, a smaller clip's frames up too: the grid's geometry is fixed (column i starts
# at i * 256 px) whatever the clip, so a player can cut tiles without reading the clip's size first.
SPRITE_WIDTH = 256


def _frames(path: Path, count: int) -> list[np.ndarray]:
    """`count` RGB frames spread evenly over the video (fewer when it has fewer), holding only those in memory."""
    av = media._av()
    with media.ffmpeg_log(None):
        with av.open(str(path)) as container:
            total = container.streams.video[0].frames if container.streams.video else 0
        if total <= 0 and count > 1:  # a container that does not say: count them
            with av.open(str(path)) as container:
                total = sum(1 for _ in container.decode(video=0))
        wanted = set(np.linspace(0, max(total - 1, 0), num=max(1, min(count, total))).round().astype(int).tolist())
        picked = []
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    picked.append(frame.to_ndarray(format="rgb24"))
                    if len(picked) == len(wanted):
                        break
    if not picked:
        raise ValueError(f"{path.name} holds no video frame")
    return picked


def thumbnail(path: Path) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(_frames(path, 1)[0]).save(out, format="WEBP", quality=90)
    return out.getvalue()


def spritesheet(path: Path) -> bytes:
    from PIL import Image

    frames = _frames(path, SPRITES)
    height, width = frames[0].shape[:2]
    tile_w = SPRITE_WIDTH
    tile_h = max(1, round(height * tile_w / width))
    columns = min(SPRITE_COLUMNS, len(frames))
    rows = math.ceil(len(frames) / columns)
    sheet = Image.new("RGB", (columns * tile_w, rows * tile_h))
    for i, frame in enumerate(frames):
        tile = Image.fromarray(frame).resize((tile_w, tile_h), Image.BILINEAR)
        sheet.paste(tile, ((i % columns) * tile_w, (i // columns) * tile_h))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=85)
    return out.getvalue()


VARIANTS = {"thumbnail": (thumbnail, "image/webp"), "spritesheet": (spritesheet, "image/jpeg")}
