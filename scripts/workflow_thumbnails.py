"""The template browser's thumbnails for workflows/*.json: 256 x 256 JPEGs, the size ComfyUI's card shows.

    python scripts/workflow_thumbnails.py DEMO_MP4

The demo graph's thumbnail is a frame of what it makes: the middle frame of DEMO_MP4, the video the demo workflow
saved (tiny random models, so it is noise, and the card says so). The graphs for the released weights get a
rendered card (what goes in, what comes out): this machine cannot run them, and a frame from another model would
show what this graph does not make. Writes workflows/<name>.jpg beside each graph.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
SIZE = 256  # the template card's thumbnail box: 16rem (w-64 h-64), object-contain
BACKGROUND, PANEL, INK, MUTED, ACCENT = (22, 24, 30), (44, 48, 60), (236, 238, 242), (150, 156, 170), (255, 150, 60)
# name of the UI workflow -> (title, what goes in, what comes out)
CARDS = {
    "H3 Text to Video": ("Text to Video", ["prompt"], "video + stereo audio"),
    "H3 First-Last Frame to Video": ("First-Last Frame to Video", ["first frame", "last frame", "prompt"],
                                     "video + stereo audio"),
    "H3 Reference to Video": ("Reference to Video", ["<Picture 1> image", "<Audio 1> voice", "prompt"],
                              "video + stereo audio"),
}
DEMO = "H3 Demo, Text to Video (no download)"


def font(size: int):
    return ImageFont.load_default(size=size)  # Pillow's own scalable font: the same card on every machine


def header(draw: ImageDraw.ImageDraw, title: str) -> None:
    draw.text((14, 12), "MiniMax H3 · h3-spark", font=font(13), fill=ACCENT)
    lines = _wrap(draw, title, font(24), SIZE - 28)
    for i, line in enumerate(lines):
        draw.text((14, 32 + 28 * i), line, font=font(24), fill=INK)


def _wrap(draw, text: str, face, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if draw.textlength(candidate, font=face) <= width or not line:
            line = candidate
        else:
            lines.append(line)
            line = word
    return [*lines, line]


def card(title: str, inputs: list[str], output: str) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    header(draw, title)
    top = 104 if draw.textlength(title, font=font(24)) > SIZE - 28 else 80
    row = 24
    for i, name in enumerate(inputs):
        y = top + i * (row + 6)
        draw.rounded_rectangle((14, y, 150, y + row), radius=6, fill=PANEL)
        draw.text((22, y + 5), name, font=font(13), fill=INK)
        draw.line((150, y + row // 2, 176, y + row // 2), fill=MUTED, width=2)
    middle = top + (len(inputs) * (row + 6) - 6) // 2
    draw.line((176, top + row // 2, 176, top + (len(inputs) - 1) * (row + 6) + row // 2), fill=MUTED, width=2)
    draw.polygon([(176, middle - 7), (190, middle), (176, middle + 7)], fill=MUTED)
    film = (194, middle - 22, 242, middle + 22)
    draw.rounded_rectangle(film, radius=5, fill=ACCENT)
    draw.polygon([(211, middle - 10), (211, middle + 10), (228, middle)], fill=BACKGROUND)
    draw.text((14, SIZE - 30), output, font=font(14), fill=MUTED)
    return image


def demo_card(mp4: Path) -> Image.Image:
    """The middle frame of the demo's video, scaled to fill the card (nearest: its pixels stay pixels)."""
    import av

    with av.open(str(mp4)) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    if not frames:
        raise SystemExit(f"{mp4}: no video frames")
    frame = frames[len(frames) // 2]
    scale = SIZE / min(frame.size)
    frame = frame.resize((round(frame.width * scale), round(frame.height * scale)), Image.NEAREST)
    left, top = (frame.width - SIZE) // 2, (frame.height - SIZE) // 2
    image = frame.crop((left, top, left + SIZE, top + SIZE))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, SIZE - 64, SIZE, SIZE), fill=BACKGROUND)
    draw.text((14, SIZE - 58), "Demo: Text to Video", font=font(20), fill=INK)
    draw.text((14, SIZE - 30), "tiny random models: this noise", font=font(13), fill=MUTED)
    return image


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("demo_mp4", type=Path, help="the mp4 the demo workflow saved (ComfyUI's output/h3-spark/)")
    args = p.parse_args(argv)
    if not args.demo_mp4.is_file():
        print(f"error: {args.demo_mp4}: no such file", file=sys.stderr)
        return 2
    images = {name: card(*spec) for name, spec in CARDS.items()}
    images[DEMO] = demo_card(args.demo_mp4)
    for name, image in images.items():
        path = ROOT / "workflows" / f"{name}.jpg"
        image.save(path, quality=92)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
