"""The /generate request body: field types, ranges and limits, checked before a job is queued.

A request is JSON (an object). Media are never sent inline: references and keyframes name files inside
the service's --input-dir (relative paths), which keeps request bodies small and lets the service check
each file's size before any decoding, and the decoded size (Limits) before decoding the pixels. Unknown
fields are refused, so a misspelt option cannot be silently ignored.

Fields (defaults in brackets):
  mode               t2va | fl2va | ref2va  [ref2va with references, fl2va with keyframes, else t2va]
  prompt             string, 0..limits.max_prompt_chars characters (required; empty only for fl2va/ref2va)
  references         [{"kind": "image" | "video" | "audio", "path": "<file in --input-dir>"}]  (ref2va)
  first_frame        "<image in --input-dir>"  (fl2va)
  last_frame         "<image in --input-dir>"  (fl2va)
  output             "<name>.mp4" inside --output-dir (required; sub-folders must exist)
  overwrite          bool [false]; without it an existing output is a 409
  width, height      ints, multiples of 32, together or not at all [the 16:9 768p canvas]
  frames             int, 124..345 (5-15 s at 24 fps; snapped up to 17n+5) [124]; 1 (a still) is refused: the
                     outputs are mp4 clips
  steps              int, 2..limits.max_steps (sigma grid points: steps - 1 DiT forwards) [50]
  seed               int, 0..2^63-1 [0]
  sampler            euler | res_multistep: the step rule (pipeline/solvers.py) [euler]
  scheduler          h3 | simple | beta | normal: the sigma grid over `steps` points (pipeline/scheduler.py); beta may
                     give fewer evaluations (repeated table entries dropped: the record shows the steps it runs) [h3]
  attention          an H3_ATTENTION backend name, for this job only [the service's]
  cache_mode         off | easycache | h3_cache | first_block [off]
  cache_threshold, cache_start_percent, cache_end_percent, cache_subsample_factor  (see h3_model.step_cache)
  recipes            list of NAME or NAME:key=value,... (h3_model/engine/recipes.py), at most 4 [none]
  guides             [{"kind": "image" | "clip" | "audio", "path": "<file in --input-dir>", "frame": int}]: a still,
                     a 17k+5-frame clip or a sound pinned at a frame (negative counts from the end), at most 16,
                     any mode (a sound past the clip's end is cropped, with a note in the job's info;
                     docs/compose.md)
  guide_strength     number in (0, 1]: the level visual conditions are held at [0.999, as released]
  audio_guide_strength  number in (0, 1]: the level audio conditions are held at [1.0 (clean), as released]
  seconds            number, 0 < s <= limits.max_film_seconds: the clip's length instead of `frames` (any mode);
                     past 345 frames it is made in windows, each going on from the one before (t2va;
                     docs/compose.md)
  shots              [{"seconds": number, "prompt": string}], at most 32: a film of shots, each starting afresh
                     with its own prompt (t2va; `prompt` is still required and is what the record shows)
  continue           "<video in --input-dir>": the film goes on from this clip (with seconds or shots; the
                     output is the clip, then the new part; the canvas is the clip's)
  repaint            "<video in --input-dir>", 17k+5 frames (124..345): keep parts of it, make the rest anew
                     (t2va; the canvas and length are the clip's), with `mask` and/or `regenerate_seconds`
  mask               "<image in --input-dir>" at the clip's size: the region to make anew (non-black pixels)
  regenerate_seconds [start, end]: the span of time to make anew (picture and sound)
  decoder            vae | taeh3 [vae]: taeh3 decodes the clip (each window of a film) with the tiny temporal
                     decoder, a draft; only on a service started with --taeh3 PATH
  control            {"video": "<video in --input-dir>", "strength": 0..10 [1], "range": [start, end] [0, 1],
                     "inpaint_mask": "<image or video in --input-dir>", "inpaint_source": "<video in --input-dir>"}:
                     the H3 Fun ControlNet Union steers one generation (a video, a mask or both; the pose / depth /
                     edge video is the client's own); only on a service started with --controlnet FILE
                     (docs/controlnet.md)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import H3Error
from ..h3_model import geometry
from ..h3_model.compose.guides import GUIDE_KINDS, MAX_GUIDES, resolve_frame
from ..h3_model.dit.layout import check_references
from ..h3_model.pipeline.generation import DECODERS, MAX_STEPS, MODES
from ..h3_model.pipeline.scheduler import SCHEDULERS, JointSchedule
from ..h3_model.pipeline.solvers import SAMPLERS
from ..h3_model.pipeline.step_cache import (DEFAULT_END_PERCENT, DEFAULT_START_PERCENT, DEFAULT_SUBSAMPLE,
                                            DEFAULT_THRESHOLD)
from ..h3_model.pipeline.step_cache import MODES as CACHE_MODES
from ..h3_model.pipeline.step_cache import CacheOptions
from ..h3_model.text.prompt import check_mentions, check_prompt
from ..kernels.settings import ATTENTION_BACKENDS

REFERENCE_KINDS = ("image", "video", "audio")
FIELDS = ("mode", "prompt", "references", "first_frame", "last_frame", "output", "overwrite", "width", "height",
          "frames", "steps", "seed", "attention", "cache_mode", "cache_threshold", "cache_start_percent",
          "cache_end_percent", "cache_subsample_factor", "recipes", "guides", "guide_strength", "audio_guide_strength",
          "seconds", "shots", "continue", "repaint", "mask", "regenerate_seconds", "decoder", "sampler",
          "scheduler", "control")
CONTROL_FIELDS = ("video", "strength", "range", "inpaint_mask", "inpaint_source")
MAX_SHOTS = 32
MAX_RECIPES = 4


class RequestError(H3Error):
    """A request the service refuses; `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        # The field it is about and a machine-readable reason, for the OpenAI-style routes' error objects.
        self.param, self.code = param, code


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 * 1024
    max_prompt_chars: int = 4000
    max_steps: int = 100
    max_frames: int = 345
    max_pixels: int = geometry.CANVAS_MAX_PIXELS
    max_input_file_bytes: int = 256 * 1024 * 1024
    max_path_chars: int = 1024
    # Decoded size, which a small file can blow up: an image reference or keyframe (50 MP takes an 8K
    # photo), and one frame of a video reference (4096 x 2304 takes 4K video; only the frames the job
    # uses are decoded).
    max_image_pixels: int = 50_000_000
    max_video_frame_pixels: int = 4096 * 2304
    # The longest film a job may ask for (its windows run one after another on the service's GPU).
    max_film_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not 2 <= self.max_steps <= MAX_STEPS:
            raise H3Error(f"max steps must be 2..{MAX_STEPS}, got {self.max_steps}")
        for name in ("max_body_bytes", "max_prompt_chars", "max_frames", "max_pixels", "max_input_file_bytes",
                     "max_path_chars", "max_image_pixels", "max_video_frame_pixels"):
            if getattr(self, name) < 1:
                raise H3Error(f"{name.replace('_', ' ')} must be positive, got {getattr(self, name)}")


@dataclass
class JobRequest:
    """A validated request; paths are still the client's relative names (outputs.py confines them)."""

    mode: str
    prompt: str
    output: str
    references: list[tuple[str, str]] = field(default_factory=list)
    first_frame: str | None = None
    last_frame: str | None = None
    overwrite: bool = False
    width: int | None = None
    height: int | None = None
    frames: int = geometry.DEFAULT_FRAMES
    steps: int = 50
    seed: int = 0
    attention: str | None = None
    cache: CacheOptions = field(default_factory=CacheOptions)
    recipes: list = field(default_factory=list)  # engine.recipes.Recipe, parsed and range-checked
    guides: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, path in --input-dir, frame)
    guide_strength: float | None = None
    # A film past one generation (compose/): its shots as (frames, prompt); empty for one generation.
    shots: list[tuple[int, str]] = field(default_factory=list)
    continue_from: str | None = None  # a video in --input-dir the film goes on from
    # A repaint: the clip, the region to make anew and/or the span (start, end) in seconds.
    repaint: str | None = None
    mask: str | None = None
    regenerate_seconds: tuple[float, float] | None = None
    audio_guide_strength: float | None = None
    decoder: str = "vae"  # the video decoder (pipeline.generation.DECODERS)
    # The step rule and the sigma grid (pipeline/solvers.py, scheduler.py); None: euler on the h3 grid, or a
    # recipe's.
    sampler: str | None = None
    scheduler: str | None = None
    # The ControlNet's inputs (paths in --input-dir, strength, range), checked; None: no control.
    control: dict | None = None
    # The frames of the `continue` clip the output starts with (the service reads them from its file when it
    # accepts the job, with its canvas into width and height).
    continued_frames: int = 0

    @property
    def is_film(self) -> bool:
        return bool(self.shots)

    @property
    def evaluations(self) -> int:
        return self.steps - 1

    def public(self) -> dict:
        """What the job record shows of its request."""
        out = {k: getattr(self, k) for k in ("mode", "prompt", "output", "overwrite", "width", "height", "frames",
                                             "steps", "seed", "attention", "first_frame", "last_frame",
                                             "decoder", "sampler", "scheduler")}
        out["references"] = [{"kind": k, "path": p} for k, p in self.references]
        c = self.cache
        out["cache"] = {"mode": c.mode, "threshold": c.threshold, "start_percent": c.start_percent,
                        "end_percent": c.end_percent, "subsample_factor": c.subsample_factor}
        out["recipes"] = [r.describe() for r in self.recipes]
        out["guides"] = [{"kind": k, "path": p, "frame": f} for k, p, f in self.guides]
        out["guide_strength"], out["audio_guide_strength"] = self.guide_strength, self.audio_guide_strength
        out["shots"] = [{"frames": f, "prompt": p} for f, p in self.shots]
        out.update({"continue": self.continue_from, "continued_frames": self.continued_frames,
                    "repaint": self.repaint, "mask": self.mask,
                    "regenerate_seconds": None if self.regenerate_seconds is None else list(self.regenerate_seconds)})
        out["control"] = self.control
        return out


def _bad(message: str, param: str | None = None) -> RequestError:
    """A 400; `param` names the field it is about (OpenAI's error object carries it on the /v1/ routes)."""
    return RequestError(400, message, param=param)


def _int(body: dict, name: str, default, lo: int, hi: int):
    value = body.get(name, default)
    if value is None:
        return None
    # JSON true/false are bools, and Python's bool is an int: refuse them explicitly.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {value!r}", name)
    if not lo <= value <= hi:
        raise _bad(f"{name} must be in {lo}..{hi}, got {value}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {value!r}", name)
    try:
        return float(value)
    except OverflowError:
        raise _bad(f"{name} is out of range", name) from None


def _string(body: dict, name: str, max_chars: int, *, required: bool = False,
            allow_empty: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise _bad(f"{name} is required", name)
        return None
    if not isinstance(value, str) or not (value or allow_empty):
        raise _bad(f"{name} must be a {'' if allow_empty else 'non-empty '}string, got {value!r}", name)
    if len(value) > max_chars:
        raise _bad(f"{name} is {len(value)} characters; the limit is {max_chars}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the job record could never be sent back
        raise _bad(f"{name} is not valid Unicode (it holds a lone surrogate)", name) from None
    return value


def _choice(body: dict, name: str, choices, default):
    value = body.get(name, default)
    if value is not None and value not in choices:
        raise _bad(f"{name} must be one of {', '.join(choices)}, got {value!r}", name)
    return value


def parse_request(body: object, limits: Limits) -> JobRequest:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise _bad(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(FIELDS)}", unknown[0])

    # Empty is judged below, by the mode; _string refuses it for every other field.
    prompt = _string(body, "prompt", limits.max_prompt_chars, required=True, allow_empty=True)
    output = _string(body, "output", limits.max_path_chars, required=True)
    references = _references(body.get("references"), limits)
    first = _string(body, "first_frame", limits.max_path_chars)
    last = _string(body, "last_frame", limits.max_path_chars)
    default_mode = "ref2va" if references else "fl2va" if (first or last) else "t2va"
    mode = _choice(body, "mode", MODES, default_mode)
    if mode == "ref2va" and not references:
        raise _bad("ref2va needs at least one reference", "references")
    if mode != "ref2va" and references:
        raise _bad(f"{mode} takes no references; use ref2va", "references")
    if mode == "fl2va" and not (first or last):
        raise _bad("fl2va needs first_frame and/or last_frame", "first_frame")
    if mode != "fl2va" and (first or last):
        raise _bad(f"{mode} takes no keyframes; use fl2va", "first_frame" if first else "last_frame")
    guides = _guides(body.get("guides"), limits)
    guide_strength = _level(body, "guide_strength", "0.999")
    audio_guide_strength = _level(body, "audio_guide_strength", "1.0")
    try:
        check_prompt(mode, prompt)
        _check_mentions_at_submit(mode, prompt, references, first, last)
    except H3Error as exc:
        raise _bad(str(exc), "prompt") from None
    _no_embeddings(prompt)

    overwrite = body.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise _bad(f"overwrite must be true or false, got {overwrite!r}", "overwrite")
    width = _int(body, "width", None, geometry.CANVAS_MULTIPLE, 16384)
    height = _int(body, "height", None, geometry.CANVAS_MULTIPLE, 16384)
    if (width is None) != (height is None):
        raise _bad("width and height go together, or neither", "height" if height is None else "width")
    frames = _int(body, "frames", geometry.DEFAULT_FRAMES, 1, limits.max_frames)
    shots = _shots(body, prompt, limits)
    if shots and "frames" in body:
        raise _bad("frames and seconds / shots both give the length: use one", "frames")
    continue_from = _string(body, "continue", limits.max_path_chars)
    if continue_from is not None and not shots:
        raise _bad("continue needs the new part's length: seconds or shots", "seconds")
    if len(shots) == 1 and shots[0][0] <= limits.max_frames and "shots" not in body and continue_from is None:
        frames, shots = shots[0][0], []  # one generation (any mode): the usual snapping to 17k+5 applies
    if shots and mode != "t2va":
        raise _bad(f"a film past one generation (seconds, shots) is made of t2va windows; {mode} takes one "
                   f"generation of at most {limits.max_frames} frames", "mode")
    repaint, mask, span = _repaint(body, mode, limits)
    if repaint is not None and (shots or continue_from is not None or "frames" in body or width is not None):
        raise _bad("repaint keeps its clip's length and canvas: drop frames, width/height, seconds, shots and "
                   "continue", "repaint")
    steps = _int(body, "steps", 50, 2, limits.max_steps)
    seed = _int(body, "seed", 0, 0, 2 ** 63 - 1)
    # The field named in an OpenAI-style error (`param`): the /v1/ routes' names for the canvas and the length.
    try:
        if width is not None:
            geometry.check_canvas(width, height, max_pixels=limits.max_pixels)
    except H3Error as exc:
        raise RequestError(400, str(exc), param="size") from None
    try:
        geometry.snap_frames(frames)
    except H3Error as exc:
        raise RequestError(400, str(exc), param="seconds" if "seconds" in body else "frames") from None
    if frames == geometry.STILL_FRAMES:
        # A job's output is an mp4 streamed while it decodes, and what /v1/videos, the thumbnails and the records
        # serve: a picture has none of those, so stills are the CLI's and the nodes'.
        raise RequestError(400, "frames 1 is a still image, which the service does not make: its outputs are mp4 "
                                "clips (124..345 frames); make stills with `h3-spark generate --image` or H3 Text to "
                                "Video at length 1", param="seconds" if "seconds" in body else "frames")
    if not shots and repaint is None:  # the clip's length is the request's (a film's windows and a repaint
        _check_guide_frames(guides, geometry.snap_frames(frames))  # clip's are known once planned or read)
    attention = _choice(body, "attention", ATTENTION_BACKENDS, None)
    decoder = _choice(body, "decoder", DECODERS, "vae")

    cache_mode = _choice(body, "cache_mode", CACHE_MODES, "off")
    try:
        cache = CacheOptions(
            cache_mode,
            _number(body, "cache_threshold", DEFAULT_THRESHOLD[cache_mode]),
            _number(body, "cache_start_percent", DEFAULT_START_PERCENT),
            _number(body, "cache_end_percent", DEFAULT_END_PERCENT),
            _int(body, "cache_subsample_factor", DEFAULT_SUBSAMPLE, 1, 1 << 30))
    except RequestError:
        raise
    except H3Error as exc:
        raise _bad(str(exc), _cache_field(str(exc))) from None
    sampler = _choice(body, "sampler", SAMPLERS, None)
    scheduler = _choice(body, "scheduler", SCHEDULERS, None)
    recipes = _recipes(body, cache_mode, "steps" in body, sampler is not None, scheduler is not None, mode)
    grid = _recipe_grid(recipes)
    if grid is not None:  # the record shows the steps the job runs
        name, evaluations = grid
        steps = evaluations + 1
        if steps > limits.max_steps:
            raise _bad(f"recipe {name}: {evaluations} evaluations exceed this service's {limits.max_steps - 1}", "recipes")
    elif scheduler not in (None, "h3"):  # beta drops repeated table entries: the record shows the steps it runs
        steps = len(JointSchedule.from_scheduler(scheduler, steps)) + 1
    control = _control(body, limits)
    if control is not None and (shots or continue_from is not None):
        raise _bad("control steers one generation: drop seconds past one generation, shots and continue", "control")
    return JobRequest(mode, prompt, output, references, first, last, overwrite, width, height, frames, steps, seed,
                      attention, cache, recipes, guides, guide_strength, shots, continue_from, repaint, mask, span,
                      audio_guide_strength, decoder, sampler, scheduler, control)


def _control(body: dict, limits: Limits) -> dict | None:
    """The `control` object: its files, strength and range, checked (the files themselves at submit)."""
    from ..h3_model.controlnet.tower import check_window

    given = body.get("control")
    if given is None:
        return None
    if not isinstance(given, dict) or set(given) - set(CONTROL_FIELDS):
        raise RequestError(400, f"control must be an object with {', '.join(CONTROL_FIELDS)}, got {given!r:.100}",
                           param="control")
    out = {name: _string(given, name, limits.max_path_chars) for name in ("video", "inpaint_mask", "inpaint_source")}
    if out["video"] is None and out["inpaint_mask"] is None:
        raise _bad("control needs a video, an inpaint_mask, or both", "control")
    if out["inpaint_source"] is not None and out["inpaint_mask"] is None:
        raise _bad("control's inpaint_source goes with its inpaint_mask", "control")
    out["strength"] = _number(given, "strength", 1.0)
    window = given.get("range", [0.0, 1.0])
    if not isinstance(window, list) or len(window) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                             for v in window):
        raise _bad(f"control's range must be [start, end], fractions of the schedule, got {window!r:.100}", "control")
    out["range"] = [float(v) for v in window]
    try:
        check_window(*out["range"], out["strength"])
    except H3Error as exc:
        raise _bad(str(exc), "control") from None
    return out


def _cache_field(message: str) -> str:
    """The request field a step-cache setting's refusal is about (CacheOptions names it in words: "cache start
    percent ...")."""
    for name in ("cache_threshold", "cache_start_percent", "cache_end_percent", "cache_subsample_factor"):
        if message.startswith(name.replace("_", " ")):
            return name
    return "cache_mode"


def _level(body: dict, name: str, released: str) -> float | None:
    """A condition level (guide_strength, audio_guide_strength): a number in (0, 1], or None."""
    level = body.get(name)
    if level is not None and (isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level <= 1):
        raise _bad(f"{name} is the level conditions are held at, in (0, 1] ({released} as released), got {level!r}",
                   name)
    return level


def _no_embeddings(prompt: str) -> None:
    """`embedding:NAME` needs an embeddings folder, which the service does not take: refused now, not in the job."""
    from ..h3_model.text.embeddings import no_library_message

    refused = no_library_message(prompt)
    if refused is not None:
        raise _bad(f"{refused}; the service takes no embeddings folder", "prompt")


def _check_mentions_at_submit(mode: str, prompt: str, references: list[tuple[str, str]], first, last) -> None:
    """The prompt's `<Picture N>` / `<Video N>` / `<Audio N>` against what the request gives, before it is queued
    (a job that can only fail must not take a worker). Whether a video has a soundtrack (another `<Audio j>`) is
    known only once the file is read, so here every video may have one; the job checks the exact count."""
    if mode == "fl2va":
        check_mentions(mode, prompt, images=int(bool(first)) + int(bool(last)))
        return
    kinds = [kind for kind, _ in references]
    check_mentions(mode, prompt, images=kinds.count("image"), videos=kinds.count("video"),
                   audios=kinds.count("audio") + kinds.count("video"))


def _recipe_grid(recipes: list) -> tuple[str, int] | None:
    """(the recipe that sets the job's evaluations, how many), or None when none does."""
    from ..h3_model.engine.recipes import recipe_sampling

    run = recipe_sampling(recipes, 1)  # the count a grid replaces does not matter here
    return None if run.evaluations is None else (run.grid_from, run.evaluations)


def _recipes(body: dict, cache_mode: str, steps_given: bool, sampler_given: bool = False,
             scheduler_given: bool = False, mode: str | None = None) -> list:
    """The request's recipes, parsed; their kernels are checked by the service (it knows the device)."""
    from ..h3_model.engine.recipes import check_conflicts, check_recipe_mode, parse_recipes

    value = body.get("recipes", [])
    if not isinstance(value, list) or len(value) > MAX_RECIPES or not all(
            isinstance(v, str) and 0 < len(v) <= 200 for v in value):
        raise _bad(f"recipes must be a list of at most {MAX_RECIPES} recipe names (NAME or NAME:key=value,...), "
                   f"got {value!r}", "recipes")
    try:
        recipes = parse_recipes(value)
    except H3Error as exc:
        raise _bad(str(exc), "recipes") from None
    try:  # the kernels are checked by the service, which knows the device (device None: no kernel check)
        check_conflicts(recipes, step_cache=cache_mode != "off", explicit_steps=steps_given,
                        cache_fix="drop cache_mode", steps_fix="drop steps", explicit_sampler=sampler_given,
                        explicit_scheduler=scheduler_given, sampler_fix="drop sampler", scheduler_fix="drop scheduler")
        if mode is not None:
            check_recipe_mode(recipes, mode)
    except H3Error as exc:
        raise _bad(str(exc), "recipes") from None
    return recipes


def _repaint(body: dict, mode: str, limits: Limits) -> tuple[str | None, str | None, tuple[float, float] | None]:
    repaint = _string(body, "repaint", limits.max_path_chars)
    mask = _string(body, "mask", limits.max_path_chars)
    span = body.get("regenerate_seconds")
    if repaint is None:
        if mask is not None or span is not None:
            raise _bad("mask and regenerate_seconds go with repaint", "mask" if mask is not None else "regenerate_seconds")
        return None, None, None
    if mode != "t2va":
        raise _bad(f"{mode} takes no repaint; repainting a clip is t2va", "repaint")
    if mask is None and span is None:
        raise _bad("repaint needs what to make anew: mask, regenerate_seconds or both", "mask")
    if span is not None:
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in span)
                or not 0 <= span[0] < span[1]):
            raise _bad(f"regenerate_seconds must be [start, end] in seconds, 0 <= start < end, got {span!r:.100}",
                       "regenerate_seconds")
        span = (float(span[0]), float(span[1]))
    return repaint, mask, span


def _seconds(value: object, name: str, limits: Limits) -> int:
    """Frames for a length in seconds, within the service's longest film."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limits.max_film_seconds:
        raise _bad(f"{name} must be a number of seconds in (0, {limits.max_film_seconds:g}] (this service's longest "
                   f"film), got {value!r}", name.split("[")[0])
    return round(value * geometry.FPS)


def _shots(body: dict, prompt: str, limits: Limits) -> list[tuple[int, str]]:
    """(frames, prompt) of each shot: `shots`, or one shot of `prompt` for `seconds`; [] for neither."""
    if "seconds" in body and "shots" in body:
        raise _bad("seconds and shots both give the length: use one", "shots")
    if "seconds" in body:
        return [(_seconds(body["seconds"], "seconds", limits), prompt)]
    value = body.get("shots")
    if value is None:
        return []
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SHOTS:
        raise _bad(f"shots must be a list of 1..{MAX_SHOTS} {{seconds, prompt}} objects, got {value!r:.200}", "shots")
    shots = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"seconds", "prompt"}:
            raise _bad(f"shots[{i}] must be an object with exactly 'seconds' and 'prompt', got {item!r:.200}",
                       "shots")
        text = _string(item, "prompt", limits.max_prompt_chars, required=True)
        _no_embeddings(text)
        shots.append((_seconds(item["seconds"], f"shots[{i}].seconds", limits), text))
    total = sum(f for f, _ in shots)
    if total > round(limits.max_film_seconds * geometry.FPS):
        raise _bad(f"the shots last {total / geometry.FPS:g} s; this service's longest film is "
                   f"{limits.max_film_seconds:g} s", "shots")
    return shots


def _guides(value: object, limits: Limits) -> list[tuple[str, str, int]]:
    """The request's guides as (kind, path, frame); the files and the frames against the clip are checked later
    (the input folder by the service, the lengths when the job reads them)."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_GUIDES:
        raise _bad(f"guides must be a list of at most {MAX_GUIDES} {{kind, path, frame}} objects, got "
                   f"{type(value).__name__ if not isinstance(value, list) else f'{len(value)} of them'}", "guides")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"kind", "path", "frame"}:
            raise _bad(f"guides[{i}] must be an object with exactly 'kind', 'path' and 'frame', got {item!r}",
                       "guides")
        if item["kind"] not in GUIDE_KINDS:
            raise _bad(f"guides[{i}].kind must be one of {', '.join(GUIDE_KINDS)}, got {item['kind']!r}", "guides")
        frame = _int(item, "frame", None, -limits.max_frames, limits.max_frames - 1)
        if frame is None:
            raise _bad(f"guides[{i}].frame must be an integer", "guides")
        out.append((item["kind"], _string(item, "path", limits.max_path_chars, required=True), frame))
    return out


def _check_guide_frames(guides: list[tuple[str, str, int]], frames: int) -> None:
    """Each guide's frame against a clip of `frames` frames, known from the request; what its file holds is
    checked with the job, before its generation (pipeline/checks.py)."""
    for i, (kind, _, frame) in enumerate(guides):
        try:
            resolve_frame(frame, frames, f"guides[{i}] ({kind})")
        except H3Error as exc:
            raise _bad(str(exc), "guides") from None


def _references(value: object, limits: Limits) -> list[tuple[str, str]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"references must be a list of {{kind, path}} objects, got {type(value).__name__}", "references")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"kind", "path"}:
            raise _bad(f"references[{i}] must be an object with exactly 'kind' and 'path', got {item!r}",
                       "references")
        kind = item["kind"]
        if kind not in REFERENCE_KINDS:
            raise _bad(f"references[{i}].kind must be one of {', '.join(REFERENCE_KINDS)}, got {kind!r}",
                       "references")
        path = _string(item, "path", limits.max_path_chars, required=True)
        out.append((kind, path))

    class _Kind:
        def __init__(self, kind: str):
            self.kind = kind

    try:
        # The model's own reference limits (9 images, 3 videos, 3 audio, 12 in all; not audio alone).
        check_references([_Kind(k) for k, _ in out])
    except H3Error as exc:
        raise _bad(str(exc), "references") from None
    return out
