"""The OpenAI-style Videos API's shapes, translated to and from the service's own: a create (JSON or form fields, an
upload) becomes a `/generate` body that `validation.parse_request` checks like any other; a job's record becomes a
`video` object. No HTTP here (openai_routes.py), so the service and the fleet's router translate alike.

  create      prompt, model (h3, or h3-<mode> to fix the task), seconds, size ("WxH"), n (1), seed, user (not used),
              input_reference (an uploaded image: the first frame, fl2va; with task ref2va, or a video or a sound: a
              reference), aspect_ratio ("16:9": the canvas of that shape), fps (24 only), extra_params (an object
              of any of these, as vLLM-Omni's clients send it), and every /generate field but output/overwrite
              (task = mode, num_inference_steps = steps, num_frames = frames)
  extension   the finished video (or an uploaded one) goes on for `seconds` more: `continue` of its file
  remix       the same request again with a new prompt (same seed, canvas, length, steps, recipes)
  video       id (video_<job id>), status queued | in_progress | completed | failed, progress 0..100, created_at,
              completed_at, expires_at (when its record is dropped), model, prompt, size, seconds (str), error
              {code, message}, remixed_from_video_id; and ours: job_id, mode, seed
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import H3Error
from ..h3_model import geometry
from ..h3_model.pipeline.generation import MODES
from .validation import FIELDS, RequestError

MODEL = "h3"
PREFIX = "video_"
ID = re.compile(r"video_([0-9a-f]{32})")
STATUS = {"queued": "queued", "running": "in_progress", "done": "completed", "failed": "failed",
          "cancelled": "failed"}
LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
UPLOAD_FIELDS = ("input_reference",)
EXTENSION_UPLOAD_FIELDS = ("video",)

# The names a field of the peers' (SGLang, vLLM-Omni) arrives under, and ours.
_ALIASES = {"task": "mode", "num_inference_steps": "steps", "num_frames": "frames", "duration": "seconds"}
# /generate fields a /v1/ create passes on as they are (its output is the service's to name).
_PASSED = tuple(f for f in FIELDS if f not in ("prompt", "output", "overwrite", "seconds"))
_OURS = ("prompt", "model", "seconds", "size", "n", "user", "input_reference", "aspect_ratio", "fps", "extra_params")
CREATE_FIELDS = _OURS + _PASSED + tuple(_ALIASES)
# Form fields are text: these are read as numbers or JSON (a recipe list may also be NAME,NAME).
_INTS = ("steps", "seed", "frames", "width", "height", "n", "cache_subsample_factor", "num_inference_steps",
         "num_frames")
_NUMBERS = ("seconds", "guide_strength", "audio_guide_strength", "cache_threshold", "cache_start_percent", "cache_end_percent", "fps",
            "duration")
_JSON = ("references", "guides", "shots", "recipes", "regenerate_seconds", "extra_params", "video", "control")


@dataclass
class Submission:
    body: dict  # a /generate request
    files: dict[str, Path] = field(default_factory=dict)  # names in `body` -> files the service already holds
    labels: dict = field(default_factory=dict)  # kept in the job's record


def bad(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> RequestError:
    return RequestError(status, message, param=param, code=code)


def job_id(video_id: str) -> str:
    """The job behind a video id; 404 for anything that is not one (so a malformed id reads as unknown)."""
    match = ID.fullmatch(video_id)
    if match is None:
        raise bad(f"no video {video_id}", param="video_id", code="not_found", status=404)
    return match.group(1)


def model_names(modes: list[str]) -> list[str]:
    return [MODEL] + [f"{MODEL}-{mode}" for mode in modes]


def models_list(modes: list[str], created: float) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(created),
                                        "owned_by": "h3-spark"} for name in model_names(modes)]}


# ------------------------------------------------------------------ requests
def form_values(fields: dict[str, str]) -> dict:
    """Form fields (text) as JSON would give them; `name[key]` fields (how the openai client sends an object in a
    form) become {name: {key: value}}."""
    out: dict = {}
    for name, text in fields.items():
        if "[" in name:
            match = re.fullmatch(r"([a-z_]+)\[([a-z_]+)\]", name)
            if match is None:
                raise bad(f"form field {name!r}: send a structured field as one JSON text", param=name)
            out.setdefault(match.group(1), {})[match.group(2)] = text
            continue
        out[name] = _typed(name, text)
    return out


def _typed(name: str, text: str):
    try:
        if name in _INTS:
            return int(text)
        if name in _NUMBERS:
            return float(text)
    except ValueError:
        raise bad(f"{name} must be a {'whole ' if name in _INTS else ''}number, got {text!r:.80}", param=name) \
            from None
    if name in _JSON:
        if name == "recipes" and not text.lstrip().startswith("["):
            return [r.strip() for r in text.split(",") if r.strip()]
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise bad(f"{name} must be JSON ({exc.msg})", param=name) from None
    return text


def _number(fields: dict, name: str):
    """OpenAI sends seconds as a string ("4"); a number either way."""
    value = fields.get(name)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise bad(f"{name} must be a number of seconds, got {value!r:.80}", param=name) from None
    return value


def _merge_extra(fields: dict) -> dict:
    extra = fields.pop("extra_params", None)
    if extra is None:
        return fields
    if not isinstance(extra, dict):
        raise bad(f"extra_params must be an object, got {type(extra).__name__}", param="extra_params")
    both = sorted(set(extra) & set(fields))
    if both:
        raise bad(f"{', '.join(both)} given both in extra_params and as a field: give each once", param=both[0])
    return {**fields, **extra}


def _canonical(fields: dict, accepted: tuple[str, ...]) -> dict:
    unknown = sorted(set(fields) - set(accepted))
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(accepted)}",
                  param=unknown[0], code="unknown_parameter")
    out = {}
    for name, value in fields.items():
        ours = _ALIASES.get(name, name)
        if ours in out:
            raise bad(f"{name} and {ours} give the same thing: use one", param=name)
        out[ours] = value
    return out


def client_param(param: str | None, fields: dict) -> str | None:
    """A refused field under the name the client sent it by: `size` or `aspect_ratio` for the canvas's width and
    height, a peer's alias (num_inference_steps, task, ...) for ours; `param` itself otherwise."""
    sent = {**fields, **(fields.get("extra_params") if isinstance(fields.get("extra_params"), dict) else {})}
    if param in ("width", "height"):
        return next((name for name in ("size", "aspect_ratio") if name in sent), param)
    return next((alias for alias, ours in _ALIASES.items() if ours == param and alias in sent), param)


def mode_of_model(model: object, mode: object) -> str | None:
    """The mode a model name fixes (None: inferred from the inputs, or `task`); 400 for a name not served."""
    if model is None or model == MODEL:
        return None
    names = model_names(list(MODES))
    if not isinstance(model, str) or model not in names:
        raise bad(f"model {model!r} is not one of {', '.join(names)} (GET /v1/models lists what this service loaded)",
                  param="model", code="model_not_found")
    fixed = model[len(MODEL) + 1:]
    if mode is not None and mode != fixed:
        raise bad(f"model {model} makes {fixed}; task {mode!r} asks for another: drop one", param="task")
    return fixed


def _canvas(fields: dict) -> None:
    """size "WxH" or aspect_ratio "W:H" into width and height (checked by the validator, which names the nearest
    valid canvas)."""
    size, aspect = fields.pop("size", None), fields.pop("aspect_ratio", None)
    if size is not None and aspect is not None:
        raise bad("size and aspect_ratio both give the canvas: use one", param="aspect_ratio")
    if (size is not None or aspect is not None) and ("width" in fields or "height" in fields):
        raise bad(f"{'size' if size is not None else 'aspect_ratio'} and width/height both give the canvas: use one",
                  param="size" if size is not None else "aspect_ratio")
    if size is not None:
        match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", size) if isinstance(size, str) else None
        if match is None:
            raise bad(f"size must be WIDTHxHEIGHT (e.g. 1344x768), got {size!r:.80}", param="size")
        fields["width"], fields["height"] = int(match.group(1)), int(match.group(2))
    if aspect is not None:
        match = re.fullmatch(r"(\d{1,3}(?:\.\d+)?):(\d{1,3}(?:\.\d+)?)", aspect) if isinstance(aspect, str) else None
        if match is None:
            raise bad(f"aspect_ratio must be W:H (e.g. 16:9), got {aspect!r:.80}", param="aspect_ratio")
        try:
            height, width = geometry.resolve_canvas(float(match.group(1)), float(match.group(2)))
        except H3Error as exc:
            raise bad(str(exc), param="aspect_ratio") from None
        fields["width"], fields["height"] = width, height


def creation(fields: dict, uploads: dict, output: str) -> Submission:
    """A create's fields (JSON, or a form through `form_values`) and its uploads (uploads.Upload by field) as a
    /generate body writing `output`."""
    fields = _canonical(_merge_extra(dict(fields)), CREATE_FIELDS)
    n = fields.pop("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n != 1:
        raise bad(f"n must be 1, got {n!r:.40}: a video is one output of one job here; for more, send one request "
                  f"per seed (seed, seed + 1, ...)", param="n")
    fields.pop("user", None)  # the key names the client; OpenAI's end-user tag has nothing to do here
    fps = fields.pop("fps", geometry.FPS)
    if fps != geometry.FPS:
        raise bad(f"fps must be {geometry.FPS} (H3 makes {geometry.FPS} frames a second), got {fps!r:.40}",
                  param="fps")
    model = fields.pop("model", None)
    fixed = mode_of_model(model, fields.get("mode"))
    if fixed is not None:
        fields["mode"] = fixed
    _canvas(fields)
    if "seconds" in fields:
        fields["seconds"] = _number(fields, "seconds")
    reference = fields.pop("input_reference", None)
    submission = Submission({**fields, "output": output})
    if reference is not None:
        raise bad("input_reference must be an uploaded file (multipart/form-data); URLs and ids are not fetched "
                  "(name a file of --input-dir in first_frame or references instead)", param="input_reference")
    if "input_reference" in uploads:
        _place_reference(submission, uploads["input_reference"])
    submission.labels = {"api": "openai", "model": model or MODEL, "uploads": list(submission.files)}
    return submission


def _place_reference(submission: Submission, upload) -> None:
    """An uploaded input_reference in the request: an image is the first frame (what OpenAI's is), or with task
    ref2va a reference; a video or a sound is a reference (ref2va)."""
    body, name = submission.body, f"upload:{upload.path.name}"
    mode = body.get("mode")
    if upload.kind == "image" and mode in (None, "fl2va"):
        if body.get("first_frame") is not None:
            raise bad("input_reference and first_frame both give the first frame: use one", param="input_reference")
        body["first_frame"] = name
    elif mode in (None, "ref2va"):
        references = body.get("references") or []
        if not isinstance(references, list):
            raise bad(f"references must be a list of {{kind, path}} objects, got {type(references).__name__}",
                      param="references")
        body["references"] = [*references, {"kind": upload.kind, "path": name}]
    else:
        raise bad(f"{mode} takes no input_reference ({upload.kind}): an image is fl2va's first frame, and images, "
                  f"videos and sounds are ref2va's references", param="input_reference")
    submission.files[name] = upload.path


def extension(fields: dict, uploads: dict, source: dict | None, output: str) -> Submission:
    """An extension: the source video (a finished one, `source` its record, or an uploaded `video`) goes on for
    `seconds`, with the source's steps and seed unless given; `continue` of its file."""
    fields = _canonical(_merge_extra(dict(fields)), ("prompt", "seconds", "video", "model", "steps", "seed",
                                                     "recipes", "attention", "cache_mode", "num_inference_steps"))
    mode_of_model(fields.pop("model", None), "t2va")  # a continued film is t2va's
    fields.pop("video", None)
    if "seconds" not in fields:
        raise bad("seconds is required: the length of the new part", param="seconds")
    fields["seconds"] = _number(fields, "seconds")
    files, labels = {}, {"api": "openai", "model": MODEL}
    if "video" in uploads:
        name = f"upload:{uploads['video'].path.name}"
        files[name] = uploads["video"].path
        labels["uploads"] = [name]
    else:
        name = f"video:{source['id']}"
        files[name] = Path(source["output"])
        labels["extended_from"] = PREFIX + source["id"]
        earlier = (source.get("labels") or {}).get("body", {})
        for key in ("steps", "seed"):
            if key in earlier and key not in fields:
                fields[key] = earlier[key]
    body = {**fields, "continue": name, "output": output}
    return Submission(body, files, labels)


def extension_source(fields: dict) -> str | None:
    """The video id an extension continues (`video: {"id": ...}`), or None when the video is an upload."""
    video = fields.get("video")
    if video is None:
        return None
    if not isinstance(video, dict) or set(video) != {"id"} or not isinstance(video["id"], str):
        raise bad(f"video must be an uploaded file or {{\"id\": \"video_...\"}}, got {video!r:.80}", param="video")
    return video["id"]


def remix(source: dict, prompt: object, output: str) -> Submission:
    """The source's request again with a new prompt: its seed, canvas, length, steps and recipes."""
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt is required: the remix's new prompt", param="prompt")
    labels = source.get("labels") or {}
    earlier = labels.get("body")
    if earlier is None:
        raise bad(f"video {PREFIX}{source['id']} was not made by a create here, so there is no request to remix",
                  param="video_id")
    if labels.get("uploads") or "continue" in earlier or earlier.get("shots"):
        what = ("an upload, which is not kept" if labels.get("uploads") else "another video" if "continue" in earlier
                else "a shot list with prompts of its own")
        raise bad(f"video {PREFIX}{source['id']} was made from {what}: remix re-runs a request with a new prompt; "
                  f"create a new video instead", param="video_id")
    body = {**earlier, "prompt": prompt, "output": output}
    return Submission(body, {}, {"api": "openai", "model": labels.get("model", MODEL),
                                 "remixed_from": PREFIX + source["id"]})


def kept_body(submission: Submission) -> None:
    """Keep the request in the record's labels (what a remix re-runs), without the output it named."""
    submission.labels["body"] = {k: v for k, v in submission.body.items() if k != "output"}


# ------------------------------------------------------------------ answers
def is_video(record: dict | None) -> bool:
    return record is not None and (record.get("labels") or {}).get("api") == "openai"


def progress(record: dict) -> int:
    state = record["state"]
    if state in ("done", "failed", "cancelled"):
        return 100
    p = record.get("progress") or {}
    if state != "running" or not p.get("total"):
        return 0
    return min(99, int(100 * p["step"] / p["total"]))


def _requested_frames(request: dict) -> int:
    """The output's length before the job has made it: a film's shots after the clip it continues (the service
    read that clip's length when it accepted the job), else the one generation's frames."""
    shots = request.get("shots") or []
    if shots:
        return (request.get("continued_frames") or 0) + sum(shot["frames"] for shot in shots)
    return request.get("frames") or geometry.DEFAULT_FRAMES


def video_object(record: dict, keep_days: float) -> dict:
    labels = record.get("labels") or {}
    request = record.get("request") or {}
    info = record.get("info") or {}
    width, height = info.get("width") or request.get("width"), info.get("height") or request.get("height")
    if width is None:
        height, width = geometry.resolve_canvas()
    frames = info.get("frames") or _requested_frames(request)
    ended = record.get("finished") if record["state"] in ("done", "failed", "cancelled") else None
    out = {"id": PREFIX + record["id"], "object": "video", "model": labels.get("model", MODEL),
           "status": STATUS[record["state"]], "progress": progress(record), "created_at": int(record["created"]),
           "completed_at": None if ended is None else int(ended),
           "expires_at": None if ended is None else int(ended + keep_days * 86400),
           "prompt": request.get("prompt"), "size": f"{width}x{height}", "seconds": f"{frames / geometry.FPS:.2f}",
           "remixed_from_video_id": labels.get("remixed_from"), "error": None,
           "job_id": record["id"], "mode": request.get("mode"), "seed": request.get("seed")}
    if record.get("replica"):  # on a fleet: the replica that holds it
        out["replica"] = record["replica"]
    if labels.get("extended_from"):
        out["extended_from_video_id"] = labels["extended_from"]
    if record["state"] in ("failed", "cancelled"):
        out["error"] = {"code": "cancelled" if record["state"] == "cancelled" else "generation_failed",
                        "message": record.get("error") or record["state"]}
    return out


def list_params(query) -> tuple[str | None, int, str]:
    after = query.get("after")
    limit = query.get("limit", str(DEFAULT_LIST_LIMIT))
    order = query.get("order", "desc")
    try:
        limit = int(limit)
    except ValueError:
        raise bad(f"limit must be a whole number 1..{LIST_LIMIT}, got {limit!r:.40}", param="limit") from None
    if not 1 <= limit <= LIST_LIMIT:
        raise bad(f"limit must be 1..{LIST_LIMIT}, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise bad(f"order must be asc or desc, got {order!r:.40}", param="order")
    return after, limit, order


def page(records: list[dict], after: str | None, limit: int, order: str, keep_days: float) -> dict:
    """One page of the video objects of job `records`, by creation time (ties by id), after the video `after`."""
    ordered = [video_object(r, keep_days) for r in sorted(records, key=lambda r: (r["created"], r["id"]),
                                                          reverse=order == "desc")]
    start = 0
    if after is not None:
        ids = [v["id"] for v in ordered]
        if after not in ids:
            raise bad(f"after: no video {after} in this list", param="after", code="not_found", status=404)
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}


def deleted(video_id: str) -> dict:
    return {"id": video_id, "object": "video.deleted", "deleted": True}
