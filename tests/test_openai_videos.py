"""The /v1/videos translation without HTTP: OpenAI's and the peers' fields to a /generate body the validator takes,
records to video objects and pages, and each refusal's one line."""

import re

import pytest

from h3_spark.serve import openai_videos as ov
from h3_spark.serve.validation import Limits, RequestError, parse_request

OUT = "videos/x.mp4"


def create(**fields):
    return ov.creation(fields, {}, OUT).body


def test_openai_and_peer_fields_become_a_request_the_validator_takes():
    body = create(prompt="a cat", model="h3-t2va", size="640x384", seconds="8", seed=3, user="u", n=1,
                  extra_params={"num_inference_steps": 4})
    assert body == {"prompt": "a cat", "mode": "t2va", "width": 640, "height": 384, "seconds": 8.0, "seed": 3,
                    "steps": 4, "output": OUT}
    req = parse_request(body, Limits())
    assert (req.mode, req.width, req.height, req.frames, req.steps, req.seed) == ("t2va", 640, 384, 192, 4, 3)
    tall = create(prompt="p", aspect_ratio="9:16")
    assert (tall["width"], tall["height"]) == (768, 1344)
    # A form's text, and the openai client's `name[key]` for an object.
    values = ov.form_values({"prompt": "p", "seed": "5", "seconds": "5.5", "recipes": "turbo,fasth3-8step",
                             "guides": '[{"kind": "image", "path": "a.png", "frame": 0}]', "video[id]": "video_1"})
    assert values == {"prompt": "p", "seed": 5, "seconds": 5.5, "recipes": ["turbo", "fasth3-8step"],
                      "guides": [{"kind": "image", "path": "a.png", "frame": 0}], "video": {"id": "video_1"}}


def test_a_create_passes_the_sampler_and_scheduler_on():
    body = create(prompt="a cat", sampler="res_multistep", extra_params={"scheduler": "beta"})
    assert body["sampler"] == "res_multistep" and body["scheduler"] == "beta"
    req = parse_request(body, Limits())
    assert (req.sampler, req.scheduler) == ("res_multistep", "beta")
    with pytest.raises(RequestError, match="^sampler must be one of euler, res_multistep, got 'lms'$"):
        parse_request(create(prompt="a cat", sampler="lms"), Limits())


def test_seconds_gives_one_generations_length_in_any_mode():
    req = parse_request({"prompt": "", "last_frame": "k.png", "seconds": 6, "output": "a.mp4"}, Limits())
    assert req.mode == "fl2va" and req.frames == 144 and not req.is_film


@pytest.mark.parametrize("fields, param, message", [
    ({"n": 2}, "n", "n must be 1, got 2: a video is one output of one job here"),
    ({"n": 0}, "n", "n must be 1, got 0"),
    ({"fps": 30}, "fps", "fps must be 24 (H3 makes 24 frames a second), got 30"),
    ({"model": "sora-2"}, "model", "model 'sora-2' is not one of h3, h3-t2va, h3-fl2va, h3-ref2va"),
    ({"model": "h3-t2va", "task": "ref2va"}, "task", "model h3-t2va makes t2va; task 'ref2va' asks for another"),
    ({"size": "big"}, "size", "size must be WIDTHxHEIGHT (e.g. 1344x768), got 'big'"),
    ({"size": "64x64", "width": 64}, "size", "size and width/height both give the canvas: use one"),
    ({"size": "64x64", "aspect_ratio": "1:1"}, "aspect_ratio", "size and aspect_ratio both give the canvas"),
    ({"aspect_ratio": "9:1"}, "aspect_ratio", "aspect ratio 9.0:1.0 (9) is outside 1:4 .. 4:1"),
    ({"seconds": "four"}, "seconds", "seconds must be a number of seconds, got 'four'"),
    ({"steps": 4, "num_inference_steps": 4}, "num_inference_steps", "num_inference_steps and steps give the same"),
    ({"seed": 1, "extra_params": {"seed": 2}}, "seed", "seed given both in extra_params and as a field"),
    ({"extra_params": [1]}, "extra_params", "extra_params must be an object, got list"),
    ({"output": "mine.mp4"}, "output", "unknown field(s) 'output'; accepted: prompt, model"),
    ({"input_reference": {"image_url": "http://x/a.png"}}, "input_reference",
     "input_reference must be an uploaded file (multipart/form-data); URLs and ids are not fetched"),
])
def test_bad_fields_are_one_line_with_their_param(fields, param, message):
    with pytest.raises(RequestError, match=re.escape(message)) as err:
        ov.creation({"prompt": "p", **fields}, {}, OUT)
    assert err.value.status == 400 and err.value.param == param and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, message", [
    ({"seed": "x"}, "seed must be a whole number, got 'x'"),
    ({"guides": "[oops"}, "guides must be JSON (Expecting value)"),
    ({"a[b][c]": "1"}, "form field 'a[b][c]': send a structured field as one JSON text"),
])
def test_bad_form_text(fields, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        ov.form_values(fields)


def record(job_id, created, state="done", **extra):
    return {"id": job_id, "state": state, "created": created, "started": created + 1, "finished": created + 2,
            "progress": {"stage": "sample", "step": 1, "total": 4}, "error": None, "labels": {"api": "openai",
                                                                                          "model": "h3"},
            "request": {"prompt": "p", "mode": "t2va", "seed": 1, "width": None, "height": None, "frames": 124},
            "info": {}, **extra}


def test_video_objects_and_pages():
    cancelled = ov.video_object(record("a" * 32, 100.5, "cancelled", error="deleted"), 1.0)
    assert cancelled["status"] == "failed" and cancelled["error"] == {"code": "cancelled", "message": "deleted"}
    assert cancelled["size"] == "1344x768" and cancelled["expires_at"] == 102 + 86400
    running = ov.video_object(record("b" * 32, 100.0, "running"), 1.0)
    assert (running["status"], running["progress"], running["completed_at"]) == ("in_progress", 25, None)
    records = [record(c * 32, t) for c, t in (("c", 3.2), ("a", 1.0), ("b", 3.2), ("d", 2.0))]
    asc = ov.page(records, None, 3, "asc", 1.0)
    assert [v["id"][-1] for v in asc["data"]] == ["a", "d", "b"] and asc["has_more"]
    assert (asc["first_id"], asc["last_id"]) == ("video_" + "a" * 32, "video_" + "b" * 32)
    rest = ov.page(records, asc["last_id"], 3, "asc", 1.0)
    assert [v["id"][-1] for v in rest["data"]] == ["c"] and not rest["has_more"]
    assert [v["id"][-1] for v in ov.page(records, None, 100, "desc", 1.0)["data"]] == ["c", "b", "d", "a"]
    with pytest.raises(RequestError, match="after: no video video_zz in this list") as err:
        ov.page(records, "video_zz", 3, "asc", 1.0)
    assert err.value.status == 404
    for query, message in (({"limit": "0"}, "limit must be 1..100, got 0"), ({"order": "up"}, "order must be asc"),
                           ({"limit": "x"}, "limit must be a whole number 1..100")):
        with pytest.raises(RequestError, match=re.escape(message)):
            ov.list_params(query)
    with pytest.raises(RequestError, match="no video job-1") as err:
        ov.job_id("job-1")
    assert err.value.status == 404


def test_remix_reruns_the_kept_request_and_refuses_what_it_cannot():
    made = ov.creation({"prompt": "a cat", "seed": 9, "size": "64x64"}, {}, OUT)
    ov.kept_body(made)
    source = {"id": "e" * 32, "labels": made.labels}
    again = ov.remix(source, "a dog", "videos/y.mp4")
    assert again.body == {"prompt": "a dog", "seed": 9, "width": 64, "height": 64, "output": "videos/y.mp4"}
    assert again.labels["remixed_from"] == "video_" + "e" * 32
    uploaded = {"id": "f" * 32, "labels": {**made.labels, "uploads": ["upload:x.png"]}}
    with pytest.raises(RequestError, match="was made from an upload, which is not kept"):
        ov.remix(uploaded, "a dog", OUT)
    with pytest.raises(RequestError, match="prompt is required"):
        ov.remix(source, "", OUT)


def test_a_refused_field_is_named_as_the_client_sent_it():
    assert ov.client_param("width", {"size": "10x64"}) == "size"
    assert ov.client_param("height", {"aspect_ratio": "1:9"}) == "aspect_ratio"
    assert ov.client_param("width", {"width": 10}) == "width"
    assert ov.client_param("steps", {"num_inference_steps": 1}) == "num_inference_steps"
    assert ov.client_param("steps", {"extra_params": {"num_inference_steps": 1}}) == "num_inference_steps"
    assert ov.client_param("mode", {"task": "x2va"}) == "task"
    assert ov.client_param("steps", {"steps": 1}) == "steps" and ov.client_param(None, {"size": "1x1"}) is None
    # End to end through the validator: a canvas too small for its multiple, sent as size.
    with pytest.raises(RequestError) as err:
        parse_request(create(prompt="p", size="10x64"), Limits())
    assert ov.client_param(err.value.param, {"size": "10x64"}) == "size"
