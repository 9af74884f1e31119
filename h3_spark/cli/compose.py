"""`h3-spark generate`'s composition flags: guides at any frame, films past 15 s, shots, continuing a clip."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

GUIDE_FORMAT = "KIND:PATH@FRAME"
MAX_SHOTS = 32
MAX_SHOT_FILE_BYTES = 1 << 20


def add_compose_flags(parser) -> None:
    from ..h3_model.compose.windows import DEFAULT_HISTORY_FRAMES, MAX_FILM_SECONDS, MAX_WINDOW_FRAMES

    group = parser.add_argument_group("composition (guides at any frame; films past one generation)")
    group.add_argument("--guide", action="append", default=[], metavar=GUIDE_FORMAT,
                       help="pin a still (image:a.png@48), a clip of 17k+5 frames (clip:b.mp4@0) or a sound "
                            "(audio:c.wav@-96) at a frame of the clip; a negative frame counts from the end (-1 is "
                            "the last); a sound past the clip's end is cropped (noted); repeatable, any mode "
                            "(with --ref too)")
    group.add_argument("--guide-strength", type=float, default=None, metavar="LEVEL",
                       help="the level the visual conditions (keyframes, guides, references) are held at, in (0, 1]: "
                            "0.999 as released; lower holds them more loosely")
    group.add_argument("--audio-guide-strength", type=float, default=None, metavar="LEVEL",
                       help="the level the audio conditions (sound guides, references, a history's sound) are held "
                            "at, in (0, 1]: 1.0 (clean) as released; lower holds them more loosely")
    group.add_argument("--seconds", type=float, default=None,
                       help=f"the clip's length in seconds instead of --frames; past {MAX_WINDOW_FRAMES} frames "
                            f"(14.4 s) it is made in windows, each going on from the one before (at most "
                            f"{MAX_FILM_SECONDS:g} s)")
    group.add_argument("--shot", action="append", default=[], metavar="SECONDS:PROMPT",
                       help="a shot of the film with its own prompt, in order; each starts afresh (nothing carried "
                            "over); repeatable. --prompt is then unused")
    group.add_argument("--shots", type=Path, default=None, metavar="FILE.json",
                       help='the shots as a JSON list: [{"seconds": 8, "prompt": "..."}, ...]')
    group.add_argument("--continue", dest="continue_from", type=Path, default=None, metavar="CLIP.mp4",
                       help="go on from a clip: its tail conditions the first window, and the output is the clip "
                            "followed by the continuation (--seconds, or the shots, give the new part's length)")
    group.add_argument("--history-frames", type=int, default=DEFAULT_HISTORY_FRAMES,
                       help=f"frames of the film a window goes on from, 17k+5 (default {DEFAULT_HISTORY_FRAMES})")
    group.add_argument("--repaint", type=Path, default=None, metavar="CLIP.mp4",
                       help="keep parts of a clip (17k+5 frames, 124..345) and make the rest anew: with --mask, a "
                            "region of the picture (the sound is kept); with --regenerate-seconds, a span of time "
                            "(picture and sound); with both, the region within the span")
    group.add_argument("--mask", type=Path, default=None, metavar="IMAGE.png",
                       help="with --repaint: where to make the picture anew (non-black pixels), at the clip's size")
    group.add_argument("--regenerate-seconds", default=None, metavar="START-END",
                       help="with --repaint: the span of time to make anew, e.g. 2-3.5")


def parse_guides(items: list[str]) -> list:
    """--guide KIND:PATH@FRAME items, read from their files."""
    from ..h3_model import geometry
    from ..h3_model.compose.guides import GUIDE_KINDS, Guide
    from ..h3_model.media import files as media

    guides = []
    for item in items:
        kind, sep, rest = item.partition(":")
        path, at, frame = rest.rpartition("@")
        if not sep or kind not in GUIDE_KINDS or not at or not path:
            raise InputError(f"--guide must be {GUIDE_FORMAT} with KIND in {', '.join(GUIDE_KINDS)}, got {item!r}")
        try:
            index = int(frame)
        except ValueError:
            raise InputError(f"--guide {item!r}: the frame after @ must be an integer, got {frame!r}") from None
        if kind == "image":
            guides.append(Guide("image", index, image=media.read_image(path)))
        elif kind == "clip":
            clip = media.read_video(path, fps=geometry.FPS, with_audio=False)
            guides.append(Guide("clip", index, clip=clip.frames))
        else:
            clip = media.read_audio_clip(path)
            guides.append(Guide("audio", index, audio=clip.audio, sample_rate=clip.sample_rate))
    return guides


def parse_shots(args) -> list:
    """The film's shots: --shot items, or the --shots file, or one shot of --prompt for --seconds."""
    from ..h3_model.compose.film import Shot
    from ..h3_model.compose.windows import MAX_FILM_SECONDS, frames_for_seconds

    if args.shot and args.shots:
        raise InputError("--shot and --shots both give the shots: use one")
    if args.shots is not None:
        items = _shot_file(args.shots)
    elif args.shot:
        items = []
        for text in args.shot:
            seconds, sep, prompt = text.partition(":")
            try:
                items.append({"seconds": float(seconds), "prompt": prompt})
            except ValueError:
                raise InputError(f"--shot must be SECONDS:PROMPT, got {text!r}") from None
            if not sep:
                raise InputError(f"--shot must be SECONDS:PROMPT, got {text!r}")
    else:
        return [Shot(args.prompt, frames_for_seconds(args.seconds))]
    if not 1 <= len(items) <= MAX_SHOTS:
        raise InputError(f"a film has 1..{MAX_SHOTS} shots, got {len(items)}")
    shots = [Shot(item["prompt"], frames_for_seconds(item["seconds"])) for item in items]
    total = sum(s.frames for s in shots)
    if total > frames_for_seconds(MAX_FILM_SECONDS):
        raise InputError(f"the shots last {total / 24:g} s; a film lasts at most {MAX_FILM_SECONDS:g} s")
    return shots


def _shot_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise InputError(f"--shots {path}: no such file")
    if path.stat().st_size > MAX_SHOT_FILE_BYTES:
        raise InputError(f"--shots {path}: larger than {MAX_SHOT_FILE_BYTES} bytes")
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"--shots {path} is not valid JSON ({exc})") from None
    if not isinstance(items, list):
        raise InputError(f"--shots {path} must hold a JSON list of shots, got {type(items).__name__}")
    for i, item in enumerate(items):
        if (not isinstance(item, dict) or set(item) != {"seconds", "prompt"} or not isinstance(item["prompt"], str)
                or isinstance(item["seconds"], bool) or not isinstance(item["seconds"], (int, float))):
            raise InputError(f"--shots {path}: shot {i + 1} must be {{\"seconds\": number, \"prompt\": string}}, "
                             f"got {json.dumps(item)[:200]}")
    return items


def is_film(args) -> bool:
    """Whether the flags ask for windows: past one generation's length, shots, or a continued clip."""
    from ..h3_model.compose.windows import MAX_WINDOW_FRAMES

    if args.prompt is None and (args.shot or args.shots):
        args.prompt = parse_shots(args)[0].prompt  # the shots carry the prompts; the request takes the first
    if args.seconds is not None:
        from ..h3_model.compose.windows import frames_for_seconds

        frames = frames_for_seconds(args.seconds)
        if frames <= MAX_WINDOW_FRAMES and not (args.shot or args.shots or args.continue_from):
            args.frames = frames  # one generation: the usual snapping to 17k+5 applies
            return False
        return True
    return bool(args.shot or args.shots or args.continue_from)


def read_continued(path: Path, history_frames: int):
    """The clip --continue goes on from: the frames the film is conditioned on (its last frame and the history
    before it) at 24 fps and its sound at 32 kHz; the frames before them are read again as the output is
    written, so a long clip is never held whole."""
    from ..h3_model import geometry
    from ..h3_model.compose.film import ContinuedClip
    from ..h3_model.media import files as media

    tail = media.read_video_tail(path, history_frames + 1, fps=geometry.FPS, sample_rate=geometry.AUDIO_SAMPLE_RATE)
    return ContinuedClip.from_tail(tail)


def plan_film_flags(args, req):
    """The film the flags ask for (compose/film.py's Film), planned before any weight loads; `req` takes the
    continued clip's canvas and hands its guides to the windows."""
    from ..h3_model.compose.film import plan_request

    if req.mode != "t2va":
        raise InputError(f"a film past one generation is made of t2va windows; {req.mode} takes one "
                         "generation of at most 345 frames")
    if args.continue_from is not None and args.seconds is None and not (args.shot or args.shots):
        raise InputError("--continue needs the new part's length: --seconds, --shot or --shots")
    continued = None if args.continue_from is None else read_continued(args.continue_from, args.history_frames)
    film = plan_request(parse_shots(args), req.guides, width=req.width, height=req.height, continued=continued,
                        history_frames=args.history_frames, what=f"--continue {args.continue_from}")
    req.width, req.height, req.guides = film.width, film.height, []
    # Later windows hold condition rows at levels the first may not have (a history's sound at t = 1): the
    # AdaLN weights must outlive the first window's tables.
    args.keep_adaln = True
    return film


def check_flags(args, req, film=None, rank: int = 0) -> list[str]:
    """Every refusal the flags allow, made before any weight is read (pipeline/checks.check_request: the guides
    against the clip or each window, the request's own checks); what is taken with a change is printed (rank 0)
    as a note and kept for the summary."""
    import sys

    from ..h3_model.pipeline.checks import check_request

    args.compose_notes = check_request(req, film)
    if not args.quiet and not rank:
        for note in args.compose_notes:
            print(f"h3-spark: note: {note}", file=sys.stderr, flush=True)
    return args.compose_notes


def render_film_out(args, engine, req, film, progress, rank: int, fresh_step_cache=None):
    """The film into --out (rank 0), its windows run in lockstep on every rank under --gpus."""
    import time

    from ..h3_model.compose.film import render_film
    from ..h3_model.media import files as media

    def generate(request):
        return engine.generate(request, on_progress=progress)

    def render(on_frames, on_window=None):
        return render_film(generate, req, film, on_frames=on_frames, fresh_step_cache=fresh_step_cache,
                           on_window=on_window)

    if rank:
        render(lambda frames: None)
        return None
    started = time.perf_counter()
    with media.mp4_writer(args.out, loglevel=args.ffmpeg_loglevel) as stream:
        result = render(stream.add, lambda window, entry: progress_window(args, window, entry))
        mux = time.perf_counter()
        stream.finish(result.audio)
        result.info["mux_s"] = round(time.perf_counter() - mux, 3)
    result.info["total_s"] = round(time.perf_counter() - started, 3)
    return result


def progress_window(args, window, entry) -> None:
    import sys

    if args.progress and not args.quiet:
        print(f"h3-spark: window {window.index + 1} (shot {window.shot + 1}) kept film frames "
              f"{entry['film_frames'][0]}..{entry['film_frames'][1]} in {entry['seconds']:.2f} s",
              file=sys.stderr, flush=True)


def film_summary(args, engine, result, kernels: dict, exactness: dict, options) -> dict:
    """The JSON summary of a film: its windows (frames kept, overlaps and tails trimmed, seconds), lengths."""
    from ..h3_model.compose.windows import frame_sample

    return {"out": str(args.out), "mode": "t2va", "device": options.device,
            "dtype": str(options.dtype).removeprefix("torch."), "frames": result.frames,
            "seconds": round(result.frames / 24, 4), "audio_samples": int(result.audio.shape[1]),
            "audio_samples_expected": frame_sample(result.frames),
            "continued_frames": result.info["plan"]["first_frame"] if "first_frame" in result.info["plan"] else 0,
            "windows": result.info["windows"], "total_s": result.info["total_s"], "mux_s": result.info["mux_s"],
            "load_s": {k: round(v, 3) for k, v in engine.load_seconds.items()},
            "attention": kernels.get("attention", {}).get("chosen"),
            "linear": kernels.get("linear", {}).get("format"), "decoder": args.decoder, **exactness,
            **({"notes": args.compose_notes} if getattr(args, "compose_notes", None) else {})}


def parse_repaint(args):
    """(Source, NoiseMask) of --repaint, --mask and --regenerate-seconds, or (None, None)."""
    from ..h3_model import geometry
    from ..h3_model.compose.masks import Source, repaint_mask
    from ..h3_model.media import files as media

    if args.repaint is None:
        if args.mask is not None or args.regenerate_seconds is not None:
            raise InputError("--mask and --regenerate-seconds go with --repaint CLIP.mp4")
        return None, None
    if args.mask is None and args.regenerate_seconds is None:
        raise InputError("--repaint needs what to make anew: --mask, --regenerate-seconds or both")
    span = None
    if args.regenerate_seconds is not None:
        start, sep, end = args.regenerate_seconds.partition("-")
        try:
            span = (float(start), float(end))
        except ValueError:
            raise InputError(f"--regenerate-seconds must be START-END in seconds, got {args.regenerate_seconds!r}") from None
        if not sep:
            raise InputError(f"--regenerate-seconds must be START-END in seconds, got {args.regenerate_seconds!r}")
    clip = media.read_video(args.repaint, fps=geometry.FPS, sample_rate=geometry.AUDIO_SAMPLE_RATE)
    frames, height, width = (int(n) for n in clip.frames.shape[:3])
    region = None if args.mask is None else media.read_image(args.mask)
    return Source(clip.frames, clip.audio), repaint_mask(frames, height, width, region, span, f"--mask {args.mask}")
