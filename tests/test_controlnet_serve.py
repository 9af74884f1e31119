"""The service's `control` field: a job steered by the ControlNet (a service started with --controlnet), and the
requests it refuses in one line (tiny synthetic models, CPU)."""

import pytest
import torch

from h3_spark.h3_model.checkpoint.controlnet import random_getter, synthetic_config, write_controlnet
from test_serve import model_dir, request, resident, serve, wait_job  # noqa: F401


@pytest.fixture
def with_controlnet(resident, tmp_path):  # noqa: F811
    config = synthetic_config(resident.components.dit.config, union2=False, comfy=False)
    path = tmp_path / "cn.safetensors"
    write_controlnet(path, config, random_getter(config, 3), "released")
    resident.load_controlnet(path)
    yield path
    resident.load_controlnet(None)


def _inputs(tmp_path):
    from h3_spark.h3_model.media import files as media

    inputs = tmp_path / "in"
    inputs.mkdir()
    gen = torch.Generator().manual_seed(0)
    media.write_mp4(inputs / "pose.mp4", torch.randint(0, 256, (30, 48, 80, 3), dtype=torch.uint8, generator=gen), None)
    from PIL import Image

    mask = torch.zeros(64, 64, 3, dtype=torch.uint8)
    mask[:, 32:] = 255
    Image.fromarray(mask.numpy()).save(inputs / "mask.png")
    return inputs


@pytest.mark.slow
def test_a_job_with_control_runs_the_tower(serve, with_controlnet, tmp_path):  # noqa: F811
    client = serve(input_dir=_inputs(tmp_path))
    r = client.post("/generate", json=request("ctl.mp4", steps=3, control={
        "video": "pose.mp4", "strength": 0.7, "range": [0, 0.9], "inpaint_mask": "mask.png"}))
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=300)
    assert job["state"] == "done", job["error"]
    assert job["info"]["control"]["evaluations"] == 2 and job["info"]["control"]["inpaint"] is True
    assert job["request"]["control"]["video"] == "pose.mp4"


@pytest.mark.parametrize("control,fragment", [
    ({"strength": 1}, "control needs a video, an inpaint_mask, or both"),
    ({"video": "pose.mp4", "strength": 11}, "control strength must be in [0, 10]"),
    ({"video": "pose.mp4", "range": [0.5]}, "control's range must be [start, end]"),
    ({"video": "pose.mp4", "weight": 1}, "control must be an object with video, strength, range"),
    ({"video": "pose.mp4", "inpaint_source": "pose.mp4"}, "control's inpaint_source goes with its inpaint_mask"),
    ({"video": "missing.mp4"}, "'missing.mp4': no such file in the input folder"),
])
def test_bad_control_fields_are_refused(serve, with_controlnet, tmp_path, control, fragment):  # noqa: F811
    client = serve(input_dir=_inputs(tmp_path))
    r = client.post("/generate", json=request("x.mp4", control=control))
    assert r.status_code == 400 and fragment in r.text, r.text


def test_control_needs_a_service_with_a_controlnet(serve, tmp_path):  # noqa: F811
    client = serve(input_dir=_inputs(tmp_path))
    r = client.post("/generate", json=request("x.mp4", control={"video": "pose.mp4"}))
    assert r.status_code == 400 and "started without --controlnet FILE" in r.text, r.text


def test_v1_videos_pass_control_on_as_json_or_form_text():
    from h3_spark.serve import openai_videos as ov
    from h3_spark.serve.validation import Limits, parse_request

    control = {"video": "pose.mp4", "strength": 0.5, "range": [0, 0.5]}
    body = ov.creation({"prompt": "a dancer", "model": "h3-t2va", "control": control}, {}, "v/x.mp4").body
    assert body["control"] == control
    assert parse_request(body, Limits()).control == {"video": "pose.mp4", "inpaint_mask": None,
                                                     "inpaint_source": None, "strength": 0.5, "range": [0.0, 0.5]}
    assert ov.form_values({"control": '{"video": "pose.mp4"}'}) == {"control": {"video": "pose.mp4"}}
