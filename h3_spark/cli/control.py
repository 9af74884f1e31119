"""`generate`'s ControlNet flags: the H3 Fun ControlNet Union file, the control video, strength and window, and an
optional inpaint mask with its source video. The pose / depth / edge pictures are the user's own (their
preprocessor's output, as a video file): nothing here detects anything."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError


def add_control_flags(parser) -> None:
    group = parser.add_argument_group("control (the H3 Fun ControlNet Union: pose, depth, edges, inpainting)")
    group.add_argument("--controlnet", type=Path, default=None, metavar="FILE",
                       help="an H3 Fun ControlNet Union file: ComfyUI's converted one (pruned AdaLN + int8_convrot, "
                            "for the pruned DiT) or Alibaba PAI's v1 / Union 2.0 (bf16, for the released DiT)")
    group.add_argument("--control", type=Path, default=None, metavar="VIDEO",
                       help="the control video, made by your own preprocessor (pose, depth, Canny/HED/MLSD edges, "
                            "scribble, layout, gray): cut or held on its last frame to the clip's length, "
                            "cover-cropped to the canvas")
    group.add_argument("--control-strength", type=float, default=1.0, metavar="S",
                       help="how strongly the control steers, 0..10 (0: no control at all)")
    group.add_argument("--control-range", default="0-1", metavar="A-B",
                       help="the part of the schedule the control acts in, as fractions (0-1: all of it; 0-0.5: the "
                            "first half of the noise levels, with the video shift as ComfyUI counts them)")
    group.add_argument("--inpaint-mask", type=Path, default=None, metavar="M",
                       help="an image or video the size of --inpaint-source: white (above half) where to make anew")
    group.add_argument("--inpaint-source", type=Path, default=None, metavar="V",
                       help="the video behind --inpaint-mask (without it the masked hint shows black)")


def parse_range(text: str) -> tuple[float, float]:
    start, sep, end = str(text).partition("-")
    try:
        window = (float(start), float(end))
    except ValueError:
        window = None
    if not sep or window is None:
        raise InputError(f"--control-range must be A-B, fractions of the schedule in [0, 1], got {text!r}")
    return window


def check_control_flags(args) -> None:
    """The flags go together, and the ControlNet file is one (its header only), before anything loads."""
    wants = args.control is not None or args.inpaint_mask is not None
    if args.controlnet is None:
        if wants or args.inpaint_source is not None:
            raise InputError("--control and --inpaint-mask need --controlnet FILE")
        return
    if not wants:
        raise InputError("--controlnet needs --control VIDEO, --inpaint-mask M, or both")
    if args.inpaint_source is not None and args.inpaint_mask is None:
        raise InputError("--inpaint-source goes with --inpaint-mask")
    parse_range(args.control_range)
    from ..h3_model.checkpoint.controlnet import ControlNetFile

    with ControlNetFile(args.controlnet) as f:
        f.check()


def _mask(path: Path):
    from ..h3_model import geometry
    from ..h3_model.media import files as media

    from ..h3_model.compose.windows import MAX_WINDOW_FRAMES

    if path.suffix.lower() in media.VIDEO_SUFFIXES:
        pixels = media.read_video(path, fps=geometry.FPS, max_frames=MAX_WINDOW_FRAMES, with_audio=False).frames
    else:
        pixels = media.read_image(path)
    return pixels.float().mean(-1) / 255.0


def parse_control(args):
    """The request's ControlRequest (files read), or None without --controlnet."""
    if args.controlnet is None:
        return None
    from ..h3_model import geometry
    from ..h3_model.controlnet.hint import ControlRequest
    from ..h3_model.media import files as media

    from ..h3_model.compose.windows import MAX_WINDOW_FRAMES

    def video(path: Path | None):  # no further than one generation's longest clip: the rest is never used
        if path is None:
            return None
        return media.read_video(path, fps=geometry.FPS, max_frames=MAX_WINDOW_FRAMES, with_audio=False).frames

    start, end = parse_range(args.control_range)
    mask = None if args.inpaint_mask is None else _mask(args.inpaint_mask)
    control = ControlRequest(video=video(args.control), mask=mask, source=video(args.inpaint_source),
                             strength=args.control_strength, start=start, end=end)
    control.validate()
    return control
