"""Every refusal a request's inputs allow, made before any weight is read.

`check_request` is the one pass the front doors make once a request is parsed and its files are read: the CLI
before it loads the engine, the service before a job's generation (a film's before its first window), the
ComfyUI nodes through the same guide checks before they encode. It needs no model: the canvas and the length
are the request's (or the ones the pipeline will take), so every guide's frame, kind, clip length, aspect and
sound, each film window's guides and a history are judged on what the flags say. The pipeline makes the same
checks again when it prepares the request (compose/guides.py holds them once), so a caller that skips this pass
gets the same messages, only later.
"""

from __future__ import annotations

from ...errors import InputError
from .. import geometry
from ..compose.guides import check_guides, prepare_history
from ..media.refs import check_image


def request_canvas(req) -> tuple[int, int, int]:
    """(width, height, frames) a request is generated at: its own canvas, else FL2VA's first given keyframe's
    aspect, else 16:9; its frames snapped to 17k+5."""
    frames = geometry.snap_frames(req.frames)
    width, height = req.width, req.height
    if width is None:
        keyframe = req.first_frame if req.first_frame is not None else req.last_frame
        if req.mode == "fl2va" and keyframe is not None:
            image = check_image(keyframe, "the first keyframe" if req.first_frame is not None else "the last keyframe")
            height, width = geometry.resolve_canvas(image.shape[1], image.shape[0])
        else:
            height, width = geometry.resolve_canvas(16, 9)
    return width, height, frames


def check_request(req, film=None) -> list[str]:
    """Refuse now (one line, `InputError`) what the request's generation would refuse after loading: the
    request's own checks, its guides against its canvas and length (or, for a `film` (compose/film.Film), each
    window's guides against that window), a history against the canvas. Returns the notes of what is taken with
    a change (a sound guide cropped to what remains of the clip)."""
    req.validate()
    width, height, frames = request_canvas(req)
    if film is None:
        notes = check_guides(req.guides, frames=frames, width=width, height=height)
    else:
        notes = []
        for index in sorted(film.guides):
            window = film.plan.windows[index]
            try:
                notes += [f"window {index + 1}: {note}" for note in
                          check_guides(film.guides[index], frames=window.frames, width=width, height=height)]
            except InputError as exc:
                raise InputError(f"window {index + 1} (film frames {window.start}..{window.start + window.frames}): "
                                 f"{exc}") from None
    if req.history is not None:
        prepare_history(req.history, width=width, height=height)
    return notes
