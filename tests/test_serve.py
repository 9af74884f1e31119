"""The HTTP service end to end on a tiny synthetic model set (CPU, seconds).

Models: the TINY DiT (text_dim widened to the tiny Qwen3-VL's 32) written as a diffusers folder, the
tiny video and audio VAEs written by vae_loading, all loaded from disk by serve.models.load_models.
The text encoder is the tiny random Qwen3-VL of tests/fixtures/qwen_tiny.py: loaded from a saved
folder when torchvision is importable (transformers' Qwen3-VL processor needs it); otherwise the same
tiny model and tokenizer are built in memory, wrapped in the real TextEncoder, and handed to
load_models as a component override, with a processor stand-in that only marks token types (the
requests here are text-only t2va, whose token types are all text).
"""

import contextlib
import dataclasses
import errno
import io
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from fixtures import qwen_tiny as Q
from ports import free_port
from h3_spark.h3_model.engine.engine import LoadEvent
from h3_spark.h3_model.engine.loading import LoadOptions
from h3_spark.h3_model.engine.paths import ComponentPaths
from h3_spark.h3_model.dit.config import TINY
from h3_spark.h3_model.text.encoder import TextEncoder
from h3_spark.kernels.settings import KernelSettings

starlette = pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from h3_spark.serve import execute  # noqa: E402
from h3_spark.serve.app import create_app  # noqa: E402
from h3_spark.serve.models import LoadTracker, load_models  # noqa: E402
from h3_spark.serve.service import Service, ServiceConfig  # noqa: E402
from h3_spark.serve.validation import Limits  # noqa: E402

TEXT_LAYER = 2
CANVAS = {"width": 64, "height": 64, "frames": 124}


class _TokenTypes:
    """create_mm_token_type_ids of Qwen3VLProcessor: 1 on image pads, 2 on video pads, 0 elsewhere."""

    def __init__(self, tokenizer):
        self.image, self.video = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])

    def create_mm_token_type_ids(self, batch):
        return [[1 if t == self.image else 2 if t == self.video else 0 for t in row] for row in batch]


def tiny_text_encoder():
    from transformers import Qwen3VLModel

    tok = Q.make_tokenizer()
    torch.manual_seed(0)
    model = Qwen3VLModel(Q.tiny_config(tok, layers=TEXT_LAYER)).eval()
    Q.randomize(model, 0)
    return TextEncoder(model, tok, _TokenTypes(tok), layer=TEXT_LAYER, dtype=torch.float32, device=torch.device("cpu"),
                       source="tests: tiny Qwen3-VL in memory")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    root = tmp_path_factory.mktemp("models")
    make_dit_checkpoint(root / "transformer", dataclasses.replace(TINY, text_dim=32), "bf16", "diffusers", seed=1)
    write_vae_checkpoint(root / "vae")
    write_audio_vae_checkpoint(root / "audio_vae")
    if Q.HAS_TORCHVISION:
        tok = Q.make_tokenizer()
        Q.save_hf_folder(root / "text_encoder", Q.make_reference_model(tok), Q.make_processor(tok))
    return root


def model_spec(model_dir) -> tuple[ComponentPaths, LoadOptions]:
    # The PyTorch references for the fused ops: conftest turns on Triton's CPU interpreter, where `auto`
    # would pick the Triton kernels and spend seconds per step interpreting them.
    kernels = KernelSettings(modulation_fusion="off", q_rms_rope_int8_fusion="off")
    return ComponentPaths(models=model_dir), LoadOptions(device="cpu", dtype=torch.float32, vae_dtype=torch.float32,
                                                         text_layer=TEXT_LAYER, kernels=kernels)


def text_override(model_dir, gate: threading.Event | None = None):
    """None (read the saved folder) when possible, else the in-memory encoder; `gate` holds it back."""
    if Q.HAS_TORCHVISION and gate is None:
        return {}

    def build():
        if gate is not None:
            assert gate.wait(60)
        if Q.HAS_TORCHVISION:
            return TextEncoder.from_pretrained(model_dir / "text_encoder", dtype=torch.float32, device="cpu",
                                               layer=TEXT_LAYER)
        return tiny_text_encoder()

    return {"text_encoder": build}


@pytest.fixture(scope="module")
def resident(model_dir):
    return load_models(*model_spec(model_dir), LoadTracker(), text_override(model_dir))


@pytest.fixture
def serve(resident, tmp_path):
    """serve(**config) -> a started TestClient over a Service that shares the resident models."""
    clients = []

    def start(**config):
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        config.setdefault("output_dir", out)
        service = Service(ServiceConfig(**config), lambda tracker: resident, log=lambda m: None)
        client = TestClient(create_app(service))
        client.__enter__()
        clients.append(client)
        key = config.get("api_key")
        if isinstance(key, dict):  # named keys (a keys file): an admin one asks for readiness
            key = next(token for token, who in key.items() if who.admin)
        wait_ready(client, headers={"Authorization": f"Bearer {key}"} if key else None)
        client.service = service
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def wait_ready(client, timeout=60, headers=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get("/ready", headers=headers)
        if r.status_code == 200:
            return r.json()
        time.sleep(0.05)
    raise AssertionError(f"not ready: {r.json()}")


def wait_job(client, job_id, states=("done", "failed", "cancelled"), timeout=60, check=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/jobs/{job_id}").json()
        if body["state"] in states and (check is None or check(body)):
            return body
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} did not reach {states}: {body}")


def request(output, **extra):
    return {"prompt": "the cat", "output": output, "steps": 3, **CANVAS, **extra}


# ------------------------------------------------------------------ readiness
def test_ready_is_503_while_loading_then_lists_the_models(model_dir, tmp_path):
    gate = threading.Event()
    spec = model_spec(model_dir)
    service = Service(ServiceConfig(output_dir=tmp_path),
                      lambda tracker: load_models(*spec, tracker, text_override(model_dir, gate)), log=lambda m: None)
    with TestClient(create_app(service)) as client:
        deadline = time.monotonic() + 60
        while True:
            r = client.get("/ready")
            body = r.json()
            if body["loading"]["components"].get("text_encoder", {}).get("state") == "loading":
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.02)
        assert r.status_code == 503 and body["ready"] is False
        comps = body["loading"]["components"]
        assert comps["dit"]["state"] == "resident" and comps["vae"]["state"] == "pending"
        assert body["loading"]["still_loading"] == ["text_encoder", "vae", "audio_vae"]
        refused = client.post("/generate", json=request("early.mp4"))
        assert refused.status_code == 503 and "still loading" in refused.json()["error"]
        assert refused.headers["Retry-After"]

        gate.set()
        ready = wait_ready(client)
    assert ready["ready"] is True and ready["device"] == "cpu" and ready["modes"] == ["t2va", "fl2va"]
    assert set(ready["models"]) == {"dit", "text_encoder", "vae", "audio_vae"}
    assert ready["models"]["dit"]["dtypes"] == ["float32"] and ready["models"]["dit"]["parameter_bytes"] > 0
    assert ready["models"]["dit"]["attention"]["backend"] == "sdpa"
    assert ready["models"]["dit"]["linear"]["format"] == "bf16"
    assert ready["models"]["vae"]["kernels"]["attention"]["chosen"] == "sdpa"
    assert ready["models"]["vae"]["kernels"]["exact"] is True
    assert ready["loading"]["state"] == "ready" and ready["loading"]["still_loading"] == []
    assert "process_rss_bytes" in ready["memory"]
    attention, linear = ready["supported"]["attention"], ready["supported"]["linear"]
    assert attention["sdpa"]["supported"] and attention["auto"]["runs"] == "sdpa"
    assert not attention["fa3"]["supported"] and "fa3" in attention["fa3"]["why"]
    assert linear["bf16"]["supported"] and not linear["fp8"]["supported"]


def test_a_failed_load_is_reported_and_nothing_is_accepted(tmp_path):
    def broken(tracker):
        tracker.plan(["dit"])
        tracker.record(LoadEvent("dit", "loading"))
        raise OSError("disk gone")

    failures = []
    service = Service(ServiceConfig(output_dir=tmp_path), broken, log=lambda m: None)
    service.on_load_failed = failures.append
    with TestClient(create_app(service)) as client:
        service.wait_loaded(30)
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["loading"]["state"] == "failed"
        assert "disk gone" in r.json()["loading"]["error"]
        assert client.post("/generate", json=request("x.mp4")).status_code == 503
    assert failures == ["OSError: disk gone"]


def test_start_removes_partial_outputs_a_stopped_service_left(resident, tmp_path, monkeypatch):
    import uuid

    from h3_spark.serve import outputs

    (tmp_path / "sub").mkdir()
    stale = tmp_path / "sub" / f".{uuid.uuid4().hex}.partial.mp4"  # its job's process was killed mid-decode
    stale.write_bytes(b"half an mp4")
    (tmp_path / "mine.partial.mp4").write_bytes(b"a user's file")

    def started(logs):
        service = Service(ServiceConfig(output_dir=tmp_path), lambda tracker: resident, log=logs.append)
        service.start()
        assert service.wait_loaded(60)
        service.stop()

    if outputs.fcntl is not None:
        logs = []
        started(logs)
        assert not stale.exists()
        assert f"removed sub/{stale.name}: the partial output of a job whose service stopped before it finished" in logs
        assert (tmp_path / "mine.partial.mp4").read_bytes() == b"a user's file"
        stale.write_bytes(b"half an mp4")

    monkeypatch.setattr(outputs, "fcntl", None)
    logs = []
    started(logs)
    assert stale.read_bytes() == b"half an mp4"
    assert any("are not removed: this platform has no fcntl" in line for line in logs), logs


# ------------------------------------------------------------------ a generation
def test_generate_poll_done_with_a_per_request_attention_switch(serve, resident, monkeypatch):
    from h3_spark.h3_model.media import files as media
    from h3_spark.kernels import attention as attention_module

    client = serve()
    dit = resident.components.dit
    default_attention, weights = dit.attention, {n: (p, p.data_ptr()) for n, p in dit.named_parameters()}
    calls = []
    original = attention_module.HeadSlicedBackend.__call__
    monkeypatch.setattr(attention_module.HeadSlicedBackend, "__call__",
                        lambda self, q, k, v: calls.append(1) or original(self, q, k, v))

    r = client.post("/generate", json=request("clip.mp4", steps=5, seed=3, attention="kj_head_sliced",
                                              cache_mode="h3_cache", cache_threshold=1e9))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.headers["Location"] == f"/jobs/{job_id}"
    job = wait_job(client, job_id)
    assert job["state"] == "done", job["error"]

    out = client.service.outputs.root / "clip.mp4"
    assert job["output"] == str(out) and out.is_file()
    assert sorted(os.listdir(out.parent)) == ["clip.mp4"]  # no temporary file left behind
    info = media.probe(out)
    assert info["video_codec"] == "h264" and info["audio_codec"] == "aac"
    assert (info["width"], info["height"]) == (CANVAS["width"], CANVAS["height"])  # the canvas asked for
    assert job["progress"]["stage"] == "done"
    assert {"text_encode", "sampling", "video_decode", "audio_decode", "mux"} <= set(job["timings"])
    assert job["info"]["frames"] == 124 and job["request"]["seed"] == 3

    # The switched backend ran, the job says so, and the load-time one is back on the same weights.
    assert calls and job["backends"]["attention"]["requested"] == "kj_head_sliced"
    assert job["backends"]["attention"]["backend"] == "kj_head_sliced"
    assert dit.attention is default_attention and resident.components.dit is dit
    assert all(p is weights[n][0] and p.data_ptr() == weights[n][1] for n, p in dit.named_parameters())

    cache = job["step_cache"]
    assert cache["mode"] == "h3_cache" and cache["evaluations"] == 4
    assert cache["computed"] == [0] and cache["reused"] == [1, 2, 3]  # window 0.2..0.9 of 4 evaluations
    assert job["backends"]["exact"] is False and "step_cache" in job["backends"]["approximate_paths"]

    again = client.post("/generate", json=request("clip.mp4"))
    assert again.status_code == 409 and "overwrite" in again.json()["error"]


def test_a_jobs_attention_is_resolved_once_when_it_is_accepted(serve, resident, monkeypatch):
    from h3_spark.h3_model.engine import engine as engine_module

    chosen = []
    original = engine_module.choose_attention
    monkeypatch.setattr(engine_module, "choose_attention",
                        lambda dit, name, settings, device: chosen.append(name) or original(dit, name, settings, device))
    client = serve()
    r = client.post("/generate", json=request("once.mp4", attention="kj_head_sliced"))
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "done", job["error"]
    assert chosen == ["kj_head_sliced"] and job["backends"]["attention"]["chosen"] == "kj_head_sliced(sdpa)"
    refused = client.post("/generate", json=request("fp8.mp4", attention="fa3"))
    assert refused.status_code == 400 and "attention 'fa3' cannot run here: fa3 needs sm_90" in refused.json()["error"]


def test_a_job_with_recipes_runs_them_and_says_so(serve):
    client = serve()
    body = {k: v for k, v in request("turbo.mp4").items() if k != "steps"}  # turbo sets them
    r = client.post("/generate", json={**body, "recipes": ["turbo:evaluations=3", "first-block-cache"]})
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "done", job["error"]
    assert job["request"]["steps"] == 4 and job["info"]["evaluations"] == 3
    assert [x["name"] for x in job["info"]["recipes"]] == ["turbo", "first-block-cache"]
    assert job["step_cache"]["mode"] == "first_block"
    assert job["backends"]["exact"] is False
    assert {"recipe turbo", "recipe first-block-cache"} <= set(job["backends"]["approximate_paths"])


def test_a_job_reports_its_own_fallback_calls(serve, resident, monkeypatch):
    """Backends count calls they ran on another kernel; each job reports its share, not the running total."""
    dit = resident.components.dit
    inner = dit.attention

    class Counting:  # stands in for e.g. sol_attn sending short sequences to its fallback
        calls = 0

        def __call__(self, q, k, v):
            Counting.calls += 1
            return inner(q, k, v)

        def describe(self):
            return {"backend": "counting", "exact": True, "short_calls_on_fallback": Counting.calls}

    monkeypatch.setattr(dit, "attention", Counting())
    client = serve()
    shares = []
    for name in ("a.mp4", "b.mp4"):
        before = Counting.calls
        job = wait_job(client, client.post("/generate", json=request(name, steps=3)).json()["id"])
        assert job["state"] == "done", job["error"]
        shares.append(job["backends"]["attention"]["short_calls_on_fallback"])
        assert shares[-1] == Counting.calls - before > 0
    assert shares[0] == shares[1]


# ------------------------------------------------------------------ queue and cancellation
def test_queue_full_then_cancel_queued_and_running(serve, resident, monkeypatch):
    # Each DiT step takes at least 50 ms here, so the 99-step job is surely still running when cancelled.
    dit = resident.components.dit
    forward = dit.forward
    monkeypatch.setattr(dit, "forward", lambda *a, **k: time.sleep(0.05) or forward(*a, **k))
    client = serve(queue_size=1)
    running = client.post("/generate", json=request("long.mp4", steps=100)).json()["id"]
    wait_job(client, running, ("running",), check=lambda b: b["progress"]["stage"] == "sampling"
             and b["progress"]["step"] >= 1)
    queued = client.post("/generate", json=request("next.mp4"))
    assert queued.status_code == 202
    queued = queued.json()["id"]
    assert client.get(f"/jobs/{queued}").json()["state"] == "queued"

    full = client.post("/generate", json=request("third.mp4"))
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert "queue is full" in full.json()["error"]

    cancelled = client.delete(f"/jobs/{queued}")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert client.delete(f"/jobs/{queued}").status_code == 200  # idempotent

    start = time.monotonic()
    stopping = client.delete(f"/jobs/{running}")
    assert stopping.status_code == 202 and stopping.json()["cancel_requested"] is True
    ended = wait_job(client, running, timeout=30)
    assert ended["state"] == "cancelled" and "cancelled" in ended["error"]
    assert time.monotonic() - start < 10
    assert ended["progress"]["step"] < 99
    assert not any(client.service.outputs.root.iterdir())
    assert client.delete("/jobs/nope").status_code == 404
    assert client.get("/jobs/nope").status_code == 404
    listed = client.get("/jobs").json()
    assert {j["id"]: j["state"] for j in listed["jobs"]} == {running: "cancelled", queued: "cancelled"}


def test_a_cancel_during_the_decode_publishes_no_file(serve, monkeypatch):
    client = serve()
    decoding, release = threading.Event(), threading.Event()
    generate = client.service.models.generate

    def slow_decode(*args, **kwargs):
        out = generate(*args, **kwargs)  # the frames are in the hidden partial file by now
        decoding.set()
        assert release.wait(30)
        return out

    monkeypatch.setattr(client.service.models, "generate", slow_decode)
    job = client.post("/generate", json=request("late.mp4")).json()["id"]
    assert decoding.wait(60)
    stopping = client.delete(f"/jobs/{job}")
    assert stopping.status_code == 202 and stopping.json()["cancel_requested"] is True
    release.set()
    ended = wait_job(client, job)
    assert ended["state"] == "cancelled" and "no output was written" in ended["error"]
    assert not any(client.service.outputs.root.iterdir())  # neither the mp4 nor its partial file


# ------------------------------------------------------------------ out of memory
class _Exploding:
    def __init__(self, inner, exc):
        self.inner, self.exc = inner, exc

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, presentation):
        raise self.exc


def test_out_of_memory_fails_the_job_frees_memory_and_the_service_goes_on(serve, resident, monkeypatch):
    client = serve()
    freed = []
    monkeypatch.setattr(execute, "free_memory", lambda: freed.append(1))
    comps = resident.components
    real = comps.text_encoder
    for i, exc in enumerate([torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB"),
                             MemoryError("host allocation failed")]):
        comps.text_encoder = _Exploding(real, exc)
        try:
            job = wait_job(client, client.post("/generate", json=request(f"oom{i}.mp4")).json()["id"])
        finally:
            comps.text_encoder = real
        assert job["state"] == "failed" and "out of memory during text_encode" in job["error"]
        assert type(exc).__name__ in job["error"]
        assert len(freed) == i + 1
    assert client.get("/ready").status_code == 200
    (client.service.outputs.root / "after.mp4").write_bytes(b"old")
    job = wait_job(client, client.post("/generate", json=request("after.mp4", overwrite=True)).json()["id"])
    assert job["state"] == "done", job["error"]
    assert (client.service.outputs.root / "after.mp4").read_bytes()[4:8] == b"ftyp"


# ------------------------------------------------------------------ paths
def test_paths_are_confined_to_their_folders(serve, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "big.png").write_bytes(b"\x89PNG" + b"0" * 4096)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    client = serve(input_dir=inputs, limits=Limits(max_input_file_bytes=1024))
    out = client.service.outputs.root
    (out / "escape").symlink_to(outside)
    (out / "link.mp4").symlink_to(outside / "x.mp4")
    (out / "taken.mp4").write_bytes(b"x")
    (out / "inner.mp4").symlink_to(out / "taken.mp4")

    def status(**body):
        r = client.post("/generate", json=request(**body))
        return r.status_code, r.json().get("error", "")

    for name in ("../x.mp4", "/tmp/x.mp4", "a/../../x.mp4", "escape/x.mp4", "./x.mp4", "a\\b.mp4", "~/x.mp4"):
        code, error = status(output=name)
        assert code == 400, (name, error)
    assert status(output="link.mp4") == (400, "'link.mp4' leads outside the output folder")
    assert status(output="inner.mp4") == (400, "'inner.mp4' is a symlink; name a plain file")
    assert status(output=".hidden.mp4")[0] == 400
    assert status(output="clip.mov")[0] == 400
    assert status(output="nofolder/clip.mp4")[0] == 400
    code, error = status(output="taken.mp4")
    assert code == 409 and "overwrite" in error
    frames = dict(mode="fl2va", output="k.mp4")
    assert status(first_frame="../secret.png", **frames)[0] == 400
    assert status(first_frame="missing.png", **frames)[0] == 400
    code, error = status(first_frame="big.png", **frames)
    assert code == 413 and "limit" in error
    assert not any(outside.iterdir())


def test_a_job_with_guides_reads_them_from_the_input_folder(serve, tmp_path):
    from PIL import Image

    inputs = tmp_path / "in"
    inputs.mkdir()
    Image.fromarray(torch.randint(0, 256, (40, 72, 3), dtype=torch.uint8).numpy()).save(inputs / "still.png")
    client = serve(input_dir=inputs)
    r = client.post("/generate", json=request("guided.mp4", guides=[{"kind": "image", "path": "still.png",
                                                                      "frame": 60}], guide_strength=0.9))
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "done", job["error"]
    assert job["request"]["guides"] == [{"kind": "image", "path": "still.png", "frame": 60}]
    r = client.post("/generate", json=request("x.mp4", guides=[{"kind": "clip", "path": "none.mp4", "frame": 0}]))
    assert r.status_code == 400 and "'none.mp4': no such file in the input folder" in r.json()["error"]
    r = client.post("/generate", json=request("y.mp4", guides=[{"kind": "image", "path": "still.png", "frame": 200}]))
    assert r.status_code == 400 and "guides[0] (image): frame 200 is outside the 124-frame clip" in r.json()["error"]
    # What only the file tells (a still 4x off the canvas) fails the job before its generation starts.
    Image.fromarray(torch.randint(0, 256, (10, 72, 3), dtype=torch.uint8).numpy()).save(inputs / "strip.png")
    r = client.post("/generate", json=request("z.mp4", guides=[{"kind": "image", "path": "strip.png", "frame": 0}]))
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "failed" and "guide 1 (image) is 72x10: cover-cropped to the" in job["error"]
    assert job["progress"]["stage"] == "read_inputs"  # refused before the text encoder ran


def test_a_film_job_runs_its_windows_and_a_shot_list(serve):
    client = serve()

    def film(output, **extra):  # the length in seconds or shots, not frames
        return {k: v for k, v in request(output, steps=2, **extra).items() if k != "frames"}

    r = client.post("/generate", json=film("film.mp4", seconds=16))
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done", job["error"]
    assert job["info"]["frames"] == 384 and job["info"]["audio_samples"] == 512000
    assert [w["film_frames"] for w in job["info"]["windows"]] == [[0, 192], [192, 384]]
    assert job["request"]["shots"] == [{"frames": 384, "prompt": job["request"]["prompt"]}]
    r = client.post("/generate", json=film("shots.mp4", shots=[{"seconds": 1, "prompt": "a fox"},
                                                               {"seconds": 1.5, "prompt": "a crow"}]))
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done", job["error"]
    assert job["info"]["frames"] == 60 and [w["shot"] for w in job["info"]["windows"]] == [0, 1]
    r = client.post("/generate", json=film("one.mp4", seconds=5))  # within one generation: snapped to 124
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done" and job["request"]["frames"] == 120 and job["request"]["shots"] == []


def test_continue_and_repaint_jobs_read_their_clips_from_the_input_folder(serve, tmp_path):
    from h3_spark.h3_model.media import files as media

    inputs = tmp_path / "in"
    inputs.mkdir()
    gen = torch.Generator().manual_seed(0)
    for name, count in (("short.mp4", 48), ("full.mp4", 124)):
        sound = torch.rand(2, round(count / 24 * 32000), generator=gen) - 0.5
        media.write_mp4(inputs / name, torch.randint(0, 256, (count, 64, 64, 3), dtype=torch.uint8, generator=gen),
                        sound)
    client = serve(input_dir=inputs)
    body = {k: v for k, v in request("more.mp4", steps=2).items() if k not in ("frames", "width", "height")}
    r = client.post("/generate", json={**body, "seconds": 1, "continue": "short.mp4"})
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done", job["error"]
    assert job["info"]["frames"] == 72 and job["info"]["windows"][0]["history_frames"] == 22
    r = client.post("/generate", json={**body, "output": "fixed.mp4", "repaint": "full.mp4",
                                       "regenerate_seconds": [1, 2]})
    job = wait_job(client, r.json()["id"], timeout=120)
    assert job["state"] == "done", job["error"]
    # Frames 24..47 touch latent frames 7..14; the test VAE is 4x spatial: 64x64 is 8x8 patches a latent frame.
    assert job["info"]["kept_rows"]["video"] == 29 * 64


def test_each_key_sees_only_its_own_jobs_and_an_admin_all(serve):
    from h3_spark.serve.auth import Client

    alice, bob, root = "alice-token-0123456789", "bob-token-0123456789ab", "root-token-0123456789ab"
    client = serve(api_key={alice: Client("alice"), bob: Client("bob"), root: Client("root", admin=True)},
                   state_dir=None)

    def as_(token):
        return {"Authorization": f"Bearer {token}"}

    a = client.post("/generate", json=request("a.mp4"), headers=as_(alice)).json()["id"]
    b = client.post("/generate", json=request("b.mp4"), headers=as_(bob)).json()["id"]
    assert client.get(f"/jobs/{a}", headers=as_(alice)).json()["client"] == "alice"
    for path in (f"/jobs/{a}", f"/jobs/{a}/preview"):
        r = client.get(path, headers=as_(bob))
        assert r.status_code == 404 and r.json() == {"error": f"no job {a}"}
    assert client.delete(f"/jobs/{a}", headers=as_(bob)).status_code == 404
    assert [j["id"] for j in client.get("/jobs", headers=as_(bob)).json()["jobs"]] == [b]
    assert {j["id"] for j in client.get("/jobs", headers=as_(root)).json()["jobs"]} >= {a, b}
    assert client.get(f"/jobs/{b}", headers=as_(root)).json()["client"] == "bob"
    assert client.get("/jobs", headers=as_("not-a-key-of-anyone-0000")).status_code == 401
    for job_id, token in ((a, alice), (b, bob)):
        assert wait_job_auth(client, job_id, as_(token))["state"] == "done"
    # The metrics count each key's jobs under its name; no token appears in them.
    body = client.get("/metrics", headers=as_(root)).text
    assert 'h3_spark_jobs_finished_total{client="alice",state="done"} 1.0' in body
    assert 'h3_spark_jobs_finished_total{client="bob",state="done"} 1.0' in body
    assert not any(token in body for token in (alice, bob, root))


def test_inputs_need_an_input_folder(serve):
    client = serve()
    r = client.post("/generate", json=request("k.mp4", first_frame="a.png"))
    assert r.status_code == 400 and "--input-dir" in r.json()["error"]


# ------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("body, code, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"prompt": NaN}', 400, "NaN"),
    (b"[1, 2]", 400, "JSON object"),
    (b"\xff\xfe", 400, "UTF-8"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400, "not acceptable JSON"),
    (b"[" * 5000, 400, "nests too deeply"),
    (b'{"prompt": "a cat \\ud800", "output": "x.mp4"}', 400, "lone surrogate"),
])
def test_malformed_bodies(serve, body, code, fragment):
    client = serve()
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == code and fragment in r.json()["error"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_does_not_say_json_is_refused(serve, content_type):
    """What a cross-origin page can send without a preflight (text/plain, a form, multipart) is 415, not queued."""
    client = serve()
    headers = {} if content_type is None else {"content-type": content_type}
    r = client.post("/generate", content=json.dumps(request("x.mp4")).encode(), headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"] == ("POST /generate takes Content-Type: application/json, got "
                                 f"{content_type or 'none'!r}")
    assert client.get("/jobs").json()["jobs"] == []
    r = client.post("/generate", content=json.dumps(request("x.mp4")).encode(),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 202, r.text


def test_the_sync_wait_is_a_setting_and_its_end_is_a_504_naming_the_video(serve):
    """--sync-timeout-s (HttpLimits.sync_timeout_s): past it /v1/videos/sync answers 504 in OpenAI's shape, naming
    the video to poll; the job goes on and ends as any other."""
    from h3_spark.errors import InputError
    from h3_spark.serve.http_limits import HttpLimits

    client = serve(http=HttpLimits(sync_timeout_s=1))
    release = threading.Event()
    runner = client.service._runner
    client.service._runner = lambda job: (release.wait(30), runner(job))[1]  # held until the answer is in
    started = time.monotonic()
    r = client.post("/v1/videos/sync", json={"prompt": "a held job", "size": "64x64", "seconds": "5.17",
                                             "steps": 2})
    waited = time.monotonic() - started
    release.set()
    video_id = r.headers.get("x-video-id", "")
    assert r.status_code == 504 and 1.0 <= waited < 5.0, (r.text, waited)
    assert r.json()["error"] == {
        "message": f"video {video_id} did not finish within 1 s (the sync wait, --sync-timeout-s); it goes on: "
                   f"GET /v1/videos/{video_id}", "type": "server_error", "param": None, "code": "sync_timeout"}
    assert video_id.startswith("video_") and r.headers["location"] == f"/v1/videos/{video_id}"
    deadline = time.monotonic() + 60
    while client.get(f"/v1/videos/{video_id}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(InputError, match="^--sync-timeout-s must be 1..86400, got 0$"):
        HttpLimits(sync_timeout_s=0)


def test_a_loopback_service_answers_loopback_host_names_only(serve):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends Host: its own name, which a loopback service
    refuses (400); its own names pass. The CLI's default allow-list is the loopback names on loopback, any Host
    beyond it (the token guards it there), and what --allowed-host says."""
    from h3_spark.serve.command import allowed_hosts
    from h3_spark.serve.auth import LOOPBACK_HOSTS

    client = serve(allowed_hosts=(*LOOPBACK_HOSTS, "testserver"))  # the test client's own name, for its set-up
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert client.get("/live", headers={"host": host}).status_code == 200, host
    for host in ("attacker.example:8000", "127.0.0.1.attacker.example"):
        r = client.post("/generate", json=request("x.mp4"), headers={"host": host})
        assert r.status_code == 400 and r.json() == {
            "error": f"Host {host!r} is not a name this server answers to (--allowed-host)"}, host
        assert client.get("/jobs", headers={"host": host}).status_code == 400
        # On /v1/, OpenAI's error object (its clients read nothing else).
        r = client.get("/v1/models", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": f"Host {host!r} is not a name this server answers to (--allowed-host)",
            "type": "invalid_request_error", "param": None, "code": "invalid_host"}
    assert allowed_hosts("127.0.0.1", None) == LOOPBACK_HOSTS and allowed_hosts("0.0.0.0", None) is None
    assert allowed_hosts("127.0.0.1", ["H3.Example", "localhost"]) == ("h3.example", "localhost")
    assert allowed_hosts("127.0.0.1", ["*"]) is None


def test_unknown_routes_and_methods_answer_json(serve):
    client = serve()
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"] == "GET /nope: Not Found"
    r = client.put("/jobs/x")
    assert r.status_code == 405 and r.json()["error"] == "PUT /jobs/x: Method Not Allowed"
    assert "GET" in r.headers["allow"]


@pytest.mark.parametrize("change, code, fragment", [
    ({"stepz": 4}, 400, "unknown field"),
    ({"prompt": None}, 400, "prompt is required"),
    ({"prompt": ""}, 400, "t2va needs a prompt"),
    ({"prompt": "x" * 5000}, 400, "limit is 4000"),
    ({"steps": True}, 400, "integer"),
    ({"steps": 101}, 400, "2..100"),
    ({"frames": 2000}, 400, "frames"),
    ({"frames": 60}, 400, "5-15 s"),
    ({"width": None, "height": 64}, 400, "together"),
    ({"width": 70, "height": 64}, 400, "multiples of 32"),
    ({"width": 4096, "height": 4096}, 400, "pixel limit"),
    ({"seed": -1}, 400, "seed"),
    ({"mode": "ref2va", "references": [{"kind": "image", "path": "a.png"}]}, 400, "did not load"),
    ({"mode": "x2va"}, 400, "mode must be one of"),
    ({"references": [{"kind": "smell", "path": "a"}]}, 400, "kind"),
    ({"attention": "warp"}, 400, "attention must be one of"),
    ({"attention": "fa3"}, 400, "cannot run here"),
    ({"cache_mode": "teacache"}, 400, "cache_mode"),
    ({"cache_mode": "easycache", "cache_start_percent": 0.9, "cache_end_percent": 0.1}, 400, "after end"),
    ({"cache_mode": "easycache", "cache_threshold": "big"}, 400, "number"),
    ({"overwrite": "yes"}, 400, "true or false"),
    ({"cache_mode": "easycache", "cache_threshold": 10 ** 400}, 400, "out of range"),
    ({"output": "a" * 300 + ".mp4"}, 400, "longer than 255 bytes"),
    ({"recipes": ["sparse"]}, 400, "recipe sparse needs Sol-Attn: sol_attn"),
    ({"recipes": ["hyperdrive"]}, 400, "unknown recipe 'hyperdrive'"),
])
def test_bad_fields_are_refused_with_a_clear_message(serve, change, code, fragment):
    client = serve()
    r = client.post("/generate", json={**request("x.mp4"), **change})
    assert r.status_code == code, r.text
    assert fragment in r.json()["error"]


def test_too_large_bodies_are_refused_before_reading(serve):
    client = serve(limits=Limits(max_body_bytes=2048))
    r = client.post("/generate", content=b'{"prompt": "' + b"x" * 4096 + b'"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and "2048" in r.json()["error"]


# ------------------------------------------------------------------ the command and a real server
@contextlib.contextmanager
def _running(config):
    """A uvicorn server in a thread until its /ready answers 200; stopped and joined on the way out."""
    import httpx
    import uvicorn

    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://{config.host}:{config.port}", timeout=10) as http:
            deadline = time.monotonic() + 30
            while http.get("/ready").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield server, thread
    finally:
        server.should_exit = True
        thread.join(30)


def test_serve_command_binds_loopback_by_default(model_dir, resident, tmp_path):
    import httpx

    from h3_spark.cli import build_parser
    from h3_spark.cli import serve as serve_cli
    from h3_spark.serve.command import server_config

    args = build_parser().parse_args(["serve", "--models", str(model_dir), "--output-dir", str(tmp_path)])
    assert args.host == "127.0.0.1" and args._run is serve_cli.run
    service = Service(ServiceConfig(output_dir=tmp_path), lambda tracker: resident, log=lambda m: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    config = server_config(args, create_app(service), service.config.http)
    config.log_level = "warning"
    assert config.host == "127.0.0.1"
    with _running(config) as (server, thread):
        bound = [sock.getsockname() for srv in server.servers for sock in srv.sockets]
        assert bound and all(addr[0] == "127.0.0.1" for addr in bound)
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=10) as http:
            assert http.get("/ready").json()["modes"] == ["t2va", "fl2va"]
    assert not thread.is_alive()


def test_serve_command_refuses_a_missing_output_folder(model_dir, tmp_path):
    from h3_spark.cli import main

    code = main(["serve", "--models", str(model_dir), "--output-dir", str(tmp_path / "nope"), "--device", "cpu"])
    assert code == 2


def test_eight_concurrent_clients_over_http_nothing_lost(resident, tmp_path):
    """8 clients against a queue of 4 over real HTTP on loopback: every request is answered (done or 429)."""
    import importlib.util

    import uvicorn
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("load_test", Path(__file__).resolve().parents[1] / "scripts" /
                                                  "load_test.py")
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    service = Service(ServiceConfig(output_dir=tmp_path, queue_size=4), lambda tracker: resident, log=lambda m: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _running(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")):
        report = load_test.run_load(f"http://127.0.0.1:{port}", {"prompt": "the cat", "steps": 2, **CANVAS},
                                    clients=8, requests=8, timeout=120)
    assert report["submitted"] == 8 and report["errors"] == 0 and report["lost"] == 0
    assert report["accepted"] + report["rejected"] == 8
    assert report["done"] == report["accepted"] >= 5  # one running + four queued at least
    assert report["requests_per_s"] > 0 and report["latency_s"]["p50"] is not None


def test_serve_synthetic_refuses_model_paths(tmp_path, capsys):
    from h3_spark.cli import main

    code = main(["serve", "--synthetic", "tiny", "--vae", str(tmp_path), "--output-dir", str(tmp_path),
                 "--device", "cpu"])
    assert code == 2
    assert "--synthetic builds every model: drop --vae" in capsys.readouterr().err


def test_serve_names_a_bad_flag_as_the_flag(tmp_path, capsys):
    from h3_spark.cli import main

    assert main(["serve", "--synthetic", "tiny", "--output-dir", str(tmp_path), "--device", "cpu",
                 "--attention", "warp"]) == 2
    assert "--attention 'warp' is not accepted; use one of: auto, sdpa" in capsys.readouterr().err


def test_serve_synthetic_full_needs_a_gpu_unless_asked(tmp_path, capsys, monkeypatch):
    from h3_spark.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--synthetic", "full", "--output-dir", str(tmp_path)]) == 2
    assert "--synthetic full builds the full-size models for a CUDA GPU and this machine has none" in \
        capsys.readouterr().err


def test_serve_synthetic_end_to_end_with_the_service_benchmark(tmp_path, monkeypatch):
    """benchmarks/serve_gpu.py on the CPU: `serve --synthetic tiny` starts, /ready says the weights are
    random, the contract's ref2va request completes warm and with both step caches."""
    import importlib.util

    monkeypatch.setenv("H3_MODULATION_FUSION", "off")
    monkeypatch.setenv("H3_Q_RMS_ROPE_INT8_FUSION", "off")
    root = Path(__file__).resolve().parents[1]
    contract = json.loads((root / "tests" / "data" / "tiny-ref2va.json").read_text())
    contract.update(name="tiny-ref2va-124f", frames=124, steps=6, width=64, height=64)
    (tmp_path / "c.json").write_text(json.dumps(contract))
    spec = importlib.util.spec_from_file_location("serve_gpu", root / "benchmarks" / "serve_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "serve.json"
    assert bench.main(["--contract", str(tmp_path / "c.json"), "--out", str(out), "--synthetic", "tiny",
                       "--device", "cpu", "--warm", "1", "--timeout", "120"]) == 0
    r = json.loads(out.read_text())
    assert r["cold_start_to_ready_s"] > 0 and "synthetic random weights" in r["ready"]["weights"]
    assert set(r["ready"]["models"]) == {"dit_ref", "text_encoder", "vae", "audio_vae"}
    assert r["first_request"]["state"] == "done" and [w["state"] for w in r["warm_requests"]] == ["done"]
    assert r["warm_requests"][0]["info"]["reference_cache_hits"] == 2
    for mode in ("easycache", "h3_cache"):
        c = r["step_caches"][mode]
        assert c["state"] == "done" and c["computed_steps"] + c["reused_steps"] == 5


def test_a_running_job_serves_its_newest_preview(serve):
    client = serve()
    assert client.get("/jobs/nope/preview").status_code == 404
    r = client.post("/generate", json=request("preview.mp4", steps=3))
    job_id = r.json()["id"]
    job = wait_job(client, job_id)
    assert job["state"] == "done", job["error"]
    png = client.get(f"/jobs/{job_id}/preview")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ authentication
TOKEN = "s3cret-token-for-the-tests-0123456789"


def test_every_route_needs_the_bearer_token(serve, tmp_path):
    logs = []
    client = serve(api_key=TOKEN)
    client.service.log = logs.append
    routes = [("GET", "/ready"), ("POST", "/generate"), ("GET", "/jobs"), ("GET", "/jobs/abc"),
              ("DELETE", "/jobs/abc"), ("GET", "/jobs/abc/preview"), ("GET", "/nowhere")]
    wrong = {"Authorization": "Bearer " + "x" * len(TOKEN)}
    for method, path in routes:
        for headers in ({}, wrong, {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": TOKEN},
                        {"Authorization": f"bearer {TOKEN}"}):
            r = client.request(method, path, headers=headers, json={} if method == "POST" else None)
            assert r.status_code == 401 and r.json() == {"error": "unauthorized"}, (method, path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
        r = client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"},
                           json={} if method == "POST" else None)
        assert r.status_code != 401, (method, path)
    right = {"Authorization": f"Bearer {TOKEN}"}
    ready = client.get("/ready", headers=right)
    assert ready.status_code == 200 and TOKEN not in ready.text
    job = client.post("/generate", headers=right, json=request("auth.mp4", steps=2))
    assert job.status_code == 202
    done = wait_job_auth(client, job.json()["id"], right)
    assert done["state"] == "done" and TOKEN not in json.dumps(done)
    assert not any(TOKEN in line for line in logs)


def wait_job_auth(client, job_id, headers, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/jobs/{job_id}", headers=headers).json()
        if body["state"] in ("done", "failed", "cancelled"):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end")


def test_api_key_sources_and_their_errors(tmp_path):
    from h3_spark.errors import InputError
    from h3_spark.serve.auth import check_binding, read_api_key

    key = tmp_path / "key"
    key.write_text(TOKEN + "\nsecond line ignored\n")
    assert read_api_key(key, {}) == TOKEN
    assert read_api_key(None, {"H3_API_KEY": f"  {TOKEN}  "}) == TOKEN
    assert read_api_key(None, {}) is None
    with pytest.raises(InputError, match=r"--api-key-file .*nope: no such file"):
        read_api_key(tmp_path / "nope", {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InputError, match=r"--api-key-file .*empty is empty: put the token on its first line"):
        read_api_key(tmp_path / "empty", {})
    with pytest.raises(InputError, match="H3_API_KEY: the token is 5 characters; use at least 16"):
        read_api_key(None, {"H3_API_KEY": "short"})
    with pytest.raises(InputError, match=r"--host 0.0.0.0 listens beyond this machine and the API has no token: "
                                         r"give one with --api-key-file FILE \(or H3_API_KEY\), or bind 127.0.0.1"):
        check_binding("0.0.0.0", None)
    with pytest.raises(InputError, match="--host gpu-box.example listens beyond"):
        check_binding("gpu-box.example", None)
    assert check_binding("127.0.0.1", None) is None and check_binding("::1", None) is None
    assert check_binding("localhost", TOKEN) == "every request needs its bearer token (on loopback too)"
    assert check_binding("0.0.0.0", TOKEN) == "every request needs its bearer token (on 0.0.0.0)"


def test_serve_refuses_an_open_service_beyond_loopback(tmp_path, capsys, monkeypatch):
    from h3_spark.cli import main

    monkeypatch.delenv("H3_API_KEY", raising=False)
    assert main(["serve", "--synthetic", "tiny", "--output-dir", str(tmp_path), "--device", "cpu",
                 "--host", "0.0.0.0"]) == 2
    assert "listens beyond this machine and the API has no token" in capsys.readouterr().err


def test_live_and_metrics(serve):
    client = serve()
    assert client.get("/live").json() == {"alive": True}
    r = client.post("/generate", json=request("metrics.mp4", steps=2))
    assert wait_job(client, r.json()["id"])["state"] == "done"
    assert client.post("/generate", json={**request("bad.mp4"), "mode": "x2va"}).status_code == 400
    text = client.get("/metrics")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    body = text.text
    assert 'h3_spark_jobs{state="done"} 1.0' in body and 'h3_spark_jobs{state="queued"} 0.0' in body
    assert 'h3_spark_jobs_finished_total{client="",state="done"} 1.0' in body
    assert 'h3_spark_stage_seconds_count{stage="sampling"} 1.0' in body
    assert "h3_spark_queue_depth 0.0" in body and "h3_spark_queue_capacity 4.0" in body
    assert 'h3_spark_models_state{state="ready"} 1.0' in body
    assert 'h3_spark_kernels_info{attention="' in body and 'dit="dit"' in body


def test_json_logs_carry_the_job_id():
    import io

    from h3_spark.serve.logs import make_log

    out = io.StringIO()
    log = make_log("json", out)
    job = "0123456789abcdef0123456789abcdef"
    log(f"[perf] job {job} mode=t2va sampling=1.00s")
    log(f"job {job} failed:\nTraceback (most recent call last): ...")
    log("ready: t2va on cpu")
    first, second, third = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["job"] == job and first["level"] == "info" and first["msg"].startswith("[perf]")
    assert second["job"] == job and second["level"] == "error" and "Traceback" in second["msg"]
    assert "job" not in third and third["service"] == "h3-spark" and third["time"].endswith("Z")
    with pytest.raises(ValueError, match="log format must be one of text, json"):
        make_log("xml")


def test_metrics_without_prometheus_client_say_how_to_get_it(serve):
    client = serve()
    client.service.metrics = None
    r = client.get("/metrics")
    assert r.status_code == 501 and "pip install 'h3-spark[serve]'" in r.json()["error"]


# ------------------------------------------------------------------ faults (#31): records, a full disk, HTTP limits
def test_records_outlive_the_service(serve, tmp_path):
    state = tmp_path / "state"
    client = serve(state_dir=state)
    done = client.post("/generate", json=request("kept.mp4", seed=random_seed())).json()["id"]
    assert wait_job(client, done)["state"] == "done"
    cancelled = client.post("/generate", json=request("never.mp4", steps=50)).json()["id"]
    queued = client.post("/generate", json=request("never2.mp4")).json()["id"]
    assert client.delete(f"/jobs/{queued}").status_code == 200
    client.delete(f"/jobs/{cancelled}")
    assert wait_job(client, cancelled)["state"] == "cancelled"
    before = {j: client.get(f"/jobs/{j}").json() for j in (done, cancelled, queued)}
    client.__exit__(None, None, None)
    again = serve(state_dir=state)
    for job_id, record in before.items():
        got = again.get(f"/jobs/{job_id}")
        assert got.status_code == 200 and got.json() == record
    assert {j["id"] for j in again.get("/jobs").json()["jobs"]} >= set(before)
    refused = again.delete(f"/jobs/{done}")
    assert refused.status_code == 409 and refused.json()["error"] == f"job {done} already ended (done); nothing to cancel"


def random_seed():
    import random

    return random.randrange(1 << 30)


class _FailingDisk(io.FileIO):
    """A real file whose writes fail with `code` once `room` bytes are written, as a full or failing disk does."""

    room, code = 0, errno.ENOSPC

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(self.code, os.strerror(self.code))
        return super().write(data)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd")
@pytest.mark.parametrize("room, code", [(0, errno.ENOSPC), (3000, errno.ENOSPC), (3000, errno.EIO)])
def test_a_full_disk_fails_the_job_and_leaves_nothing_open(serve, monkeypatch, room, code):
    from h3_spark.h3_model.media import files as media

    # Through the whole service, the file system's answer is injected at the one place the mp4 is written, on a
    # real file in the output folder (test_media.py fills a real tmpfs where one can be mounted).
    failing = type("Failing", (_FailingDisk,), {"room": room, "code": code})
    monkeypatch.setattr(media, "open_output", lambda path: failing(path, "w+"))
    client = serve()
    job = client.post("/generate", json=request("full.mp4", seed=random_seed())).json()["id"]
    ended = wait_job(client, job)
    assert ended["state"] == "failed"
    assert ended["error"].endswith(f"/.{job}.partial.mp4: cannot write mp4 ([Errno {code}] {os.strerror(code)})")
    assert not any(client.service.outputs.root.iterdir())

    def held():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if ".partial.mp4" in os.readlink(f"/proc/self/fd/{fd}"):
                    found.append(fd)
        return found

    assert held() == []
    monkeypatch.undo()  # space again: the next job is written
    job = client.post("/generate", json=request("full.mp4", seed=random_seed())).json()["id"]
    assert wait_job(client, job)["state"] == "done"
    assert (client.service.outputs.root / "full.mp4").stat().st_size > 0


def test_too_many_headers_are_refused(serve):
    client = serve()
    crowd = {f"x-extra-{i}": str(i) for i in range(70)}
    got = client.get("/live", headers=crowd)
    assert got.status_code == 431 and got.json() == {"error": f"the request has {70 + len(client.headers) + 1} "
                                                              f"headers; the limit is 64"}
    assert client.get("/live", headers=dict(list(crowd.items())[:20])).status_code == 200


def test_slow_bodies_time_out_and_a_client_gone_is_one_line(model_dir, resident, tmp_path):
    import httpx

    from h3_spark.serve.command import server_config
    from h3_spark.serve.http_limits import HttpLimits

    lines = []
    config = ServiceConfig(output_dir=tmp_path, http=HttpLimits(body_timeout_s=1, max_header_bytes=4096))
    service = Service(config, lambda tracker: resident, log=lines.append)
    args = type("Args", (), {"host": "127.0.0.1", "port": free_port(), "log_level": "warning"})()
    with _running(server_config(args, create_app(service), config.http)):
        lines.clear()  # the start-up line

        def half(body_sent: bytes, declared: int) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", args.port), timeout=10)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % declared + body_sent)
            return sock

        slow = half(b'{"prompt": ', 200)
        t0 = time.monotonic()
        answer = slow.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and time.monotonic() - t0 < 5
        assert '{"error":"the request body did not arrive within 1 s"}' in answer
        slow.close()
        gone = half(b'{"prompt": "a', 300)
        time.sleep(0.2)
        gone.close()
        deadline = time.monotonic() + 5
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) == 1 and lines[0].endswith("disconnected before sending its body of POST /generate; "
                                                     "nothing done"), lines
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=10) as http:
            big = http.get("/live", headers={"x-big": "a" * 8192})
            assert big.status_code == 431 and big.json()["error"].endswith("bytes; the limit is 4096")
            assert http.get("/live").status_code == 200
        # 1 MiB of head: h11 stops reading it at the limit; uvicorn answers 400 and closes.
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=10)
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nx-big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        answer = sock.recv(4096).decode()
        sock.close()
        assert answer.startswith("HTTP/1.1 400") and answer.endswith("Invalid HTTP request received."), answer[:80]


def test_the_service_logs_what_auto_chose_and_why_it_refused_the_faster_backends(resident, tmp_path):
    logs = []
    service = Service(ServiceConfig(output_dir=tmp_path), lambda tracker: resident, log=logs.append)
    service.start()
    assert service.wait_loaded(60)
    service.stop()
    assert resident.kernel_reports["dit"]["attention"]["requested"] == "auto"
    line = next(m for m in logs if m.startswith("dit: attention auto chose "))
    assert line == ("dit: attention auto chose sdpa (cpu (no CUDA GPU): PyTorch SDPA); fa3: fa3 needs sm_90 "
                    "(FlashAttention-3 kernels are built for Hopper only); this run is on cpu (no CUDA GPU); "
                    "cudnn_sdpa: cudnn_sdpa needs sm_80 or newer (cuDNN fused attention); this run is on cpu "
                    "(no CUDA GPU)")
