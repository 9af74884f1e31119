"""/v1/videos driven by the official openai client against a live `h3-spark serve --synthetic tiny --device cpu`
(a subprocess on a free port, one for the module, with a keys file), and by plain HTTP multipart as vLLM-Omni's
clients and LiteLLM's vLLM video provider send it. Each job is the tiny models' 64x64, 124 frames, 2 steps."""

import io
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from ports import free_port

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("python_multipart")
av = pytest.importorskip("av")
from PIL import Image  # noqa: E402

# The client marks the Videos API deprecated (OpenAI's own service ends it); ours stays.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ALICE, BOB, ROOT = "alice-token-0123456789", "bob-token-0123456789ab", "root-token-0123456789ab"
SMALL = {"size": "64x64", "seconds": "5.17", "extra_body": {"steps": 2, "seed": 11}}  # 124 frames
MAX_INPUT_MB = 1
ENV = {"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    (root / "out").mkdir()
    keys = root / "keys"
    keys.write_text(f"alice {ALICE}\nbob {BOB}\nroot {ROOT} admin\n")
    os.chmod(keys, 0o600)
    port = free_port()
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "h3_spark.cli", "serve", "--synthetic", "tiny", "--synthetic-modes",
                             "t2va,ref2va", "--device", "cpu", "--output-dir", str(root / "out"), "--port", str(port),
                             "--keys-file", str(keys), "--max-input-mb", str(MAX_INPUT_MB), "--queue-size", "8",
                             "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                            cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (root / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/ready", headers={"Authorization": f"Bearer {ROOT}"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield {"base": base, "root": root}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def client(server, key=ALICE):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=key, max_retries=0, timeout=60)


def frames_of(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def png_bytes(seed=0, size=(64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def wait(c, video_id, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        video = c.videos.retrieve(video_id)
        if video.status in ("completed", "failed") or time.monotonic() > deadline:
            return video
        time.sleep(0.05)


def uploads_left(server) -> list[str]:
    folder = server["root"] / "out" / ".h3-spark-uploads"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ------------------------------------------------------------------ the openai client
def test_create_poll_and_download_every_variant(server):
    c = client(server)
    video = c.videos.create_and_poll(prompt="a cat plays the piano", poll_interval_ms=50, **SMALL)
    assert video.status == "completed" and video.progress == 100 and video.error is None, video
    assert video.object == "video" and video.model == "h3" and video.size == "64x64" and video.seconds == "5.17"
    assert video.id.startswith("video_") and video.completed_at >= video.created_at and video.seed == 11
    assert video.expires_at == video.completed_at + 7 * 86400

    mp4 = c.videos.download_content(video.id).read()
    assert mp4 == c.videos.download_content(video.id, variant="video").read()
    frames = frames_of(mp4)
    assert len(frames) == 124 and frames[0].shape == (64, 64, 3)

    # The thumbnail is the first frame (lossy WebP: within 12 levels on average); the spritesheet a 4x4 grid of
    # 16 frames spread over the clip, the first tile the first frame (JPEG: within 16).
    thumb = c.videos.download_content(video.id, variant="thumbnail")
    assert thumb.response.headers["content-type"] == "image/webp"
    picture = np.asarray(Image.open(io.BytesIO(thumb.read())).convert("RGB"), dtype=np.int16)
    assert picture.shape == (64, 64, 3) and np.abs(picture - frames[0]).mean() < 12
    sheet = c.videos.download_content(video.id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    # Each tile 256 px wide whatever the clip (a 64x64 clip's frames scaled up): the first tile is the first frame
    # scaled to 256 px, the last the last.
    grid = np.asarray(Image.open(io.BytesIO(sheet.read())).convert("RGB"), dtype=np.int16)
    assert grid.shape == (1024, 1024, 3)

    def tile(i):
        row, col = divmod(i, 4)
        return grid[row * 256:(row + 1) * 256, col * 256:(col + 1) * 256]

    def scaled(frame):
        return np.asarray(Image.fromarray(frame).resize((256, 256), Image.BILINEAR), dtype=np.int16)

    assert np.abs(tile(0) - scaled(frames[0])).mean() < 16 and np.abs(tile(15) - scaled(frames[-1])).mean() < 16
    assert np.abs(tile(0) - scaled(frames[-1])).mean() > np.abs(tile(0) - scaled(frames[0])).mean()

    with pytest.raises(openai.BadRequestError) as err:
        c.videos.download_content(video.id, variant="poster")
    assert err.value.body == {"message": "variant must be video, thumbnail, spritesheet or 0, got 'poster'",
                              "type": "invalid_request_error", "param": "variant", "code": "invalid_variant"}
    with pytest.raises(openai.BadRequestError, match="has one output, variant 0"):
        c.videos.download_content(video.id, variant="1")

    # The remix: the same request (seed, canvas, length, steps) with a new prompt.
    remixed = wait(c, c.videos.remix(video.id, prompt="a dog plays the drums").id)
    assert remixed.status == "completed" and remixed.remixed_from_video_id == video.id, remixed
    assert (remixed.seed, remixed.size, remixed.seconds, remixed.prompt) == (11, "64x64", "5.17",
                                                                             "a dog plays the drums")

    # The extension: the video goes on for 5.17 s more; its first frames are the source's, as written. (This
    # client refuses `video={"id": ...}` itself, before sending: it takes only files there; the id goes as the
    # form field video[id] it would have sent.)
    extended = c.videos.extend(prompt="the cat bows", seconds="5.17", video=openai.omit,
                               extra_body={"video": {"id": video.id}})
    assert extended.extended_from_video_id == video.id
    # Its canvas and stitched length from the moment it is accepted, not the default canvas and the new part's.
    assert (extended.size, extended.seconds) == ("64x64", "10.33"), extended
    extended = wait(c, extended.id, 120)
    assert extended.status == "completed", extended.error
    longer = frames_of(c.videos.download_content(extended.id).read())
    assert len(longer) == 248 and extended.seconds == "10.33"
    # They were decoded and encoded again: the oracle is the source's frames through our own encoder once more
    # (followed by the new part, as in one stream), to within 2 levels a pixel on average.
    from h3_spark.h3_model.media.files import Mp4Stream

    again = Mp4Stream(server["root"] / "oracle.mp4", audio=False)
    again.add(np.stack(frames + longer[124:]))
    oracle = frames_of(again.finish().read_bytes())
    kept = np.mean([np.abs(a.astype(np.int16) - b).mean() for a, b in zip(longer[:124], oracle[:124])])
    assert kept < 2, kept


def test_every_extension_form_answers_the_continued_canvas_and_the_stitched_length(server):
    """A 128x64 video extended by id (JSON), by id (form field video[id]) and as an uploaded mp4: each create
    answer, each retrieve and the list say 128x64 and the stitched total (124 + 124 frames: 10.33 s), and the
    finished extension holds that many frames."""
    c = client(server)
    source = c.videos.create_and_poll(prompt="a wide one", poll_interval_ms=50,
                                      **{**SMALL, "size": "128x64"})
    assert source.status == "completed" and source.size == "128x64", source.error
    mp4 = c.videos.download_content(source.id).read()
    answers = [post(server, "/v1/videos/extensions",
                    json={"video": {"id": source.id}, "prompt": "on", "seconds": "5.17", "steps": 2}),
               post(server, "/v1/videos/extensions",
                    files={"video[id]": (None, source.id), "prompt": (None, "on"), "seconds": (None, "5.17"),
                           "steps": (None, "2")}),
               post(server, "/v1/videos/extensions", files={"video": ("clip.mp4", mp4, "video/mp4")},
                    data={"prompt": "on", "seconds": "5.17", "steps": "2"})]
    ids = []
    for r in answers:
        assert r.status_code == 200, r.text
        video = r.json()
        assert (video["size"], video["seconds"]) == ("128x64", "10.33"), video
        assert (c.videos.retrieve(video["id"]).size, c.videos.retrieve(video["id"]).seconds) == ("128x64", "10.33")
        ids.append(video["id"])
    listed = {v.id: (v.size, v.seconds) for v in c.videos.list(limit=100).data}
    assert all(listed[i] == ("128x64", "10.33") for i in ids)
    done = wait(c, ids[2], 180)
    assert done.status == "completed" and (done.size, done.seconds) == ("128x64", "10.33"), done.error
    frames = frames_of(c.videos.download_content(done.id).read())
    assert len(frames) == 248 and frames[0].shape == (64, 128, 3)
    for video_id in ids[:2]:
        c.videos.delete(video_id)
    # The service's own log line names the canvas (it read NonexNone for a film).
    log = (server["root"] / "serve.log").read_text()
    assert f"[perf] job {done.job_id} mode=t2va 128x64x248 " in log


def test_list_pages_and_delete(server):
    c = client(server, BOB)
    made = [c.videos.create(prompt=f"a page {i}", **SMALL) for i in range(3)]
    ids = [v.id for v in made]
    first = c.videos.list(limit=2, order="asc")
    assert [v.id for v in first.data] == ids[:2] and first.has_more and first.last_id == ids[1]
    second = c.videos.list(limit=2, order="asc", after=first.last_id)
    assert [v.id for v in second.data] == ids[2:] and not second.has_more
    assert [v.id for v in c.videos.list(order="desc").data] == ids[::-1]
    assert [v.id for v in c.videos.list(limit=1).iter_pages().__next__().data] == ids[-1:]
    for video_id in ids:  # queued or running: cancelled and forgotten
        gone = c.videos.delete(video_id)
        assert (gone.id, gone.deleted, gone.object) == (video_id, True, "video.deleted")
        with pytest.raises(openai.NotFoundError):
            c.videos.retrieve(video_id)
    assert c.videos.list().data == []
    with pytest.raises(openai.NotFoundError, match="after: no video video_0"):
        c.videos.list(after="video_" + "0" * 32)


def test_errors_are_the_clients_own_exceptions(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as err:
        c.videos.retrieve("video_" + "0" * 32)
    assert err.value.body["code"] == "not_found" and err.value.status_code == 404
    cases = [({"size": "1280x720"}, "size", "got 1280x720 (nearest valid: 1280x704)"),
             ({"seconds": "4"}, "seconds", "nearest valid: 124 frames, 5.17 s"),
             ({"seconds": "0"}, "seconds", "seconds must be a number of seconds in (0, 60]"),
             ({"seconds": "100"}, "seconds", "seconds must be a number of seconds in (0, 60]"),
             ({"extra_body": {"steps": 1}}, "steps", "steps must be in 2..100, got 1"),
             ({"extra_body": {"cache_mode": "easycache", "cache_threshold": -1}}, "cache_threshold",
              "cache threshold must be a finite number >= 0"),
             ({"extra_body": {"guide_strength": 2}}, "guide_strength", "guide_strength is the level conditions"),
             ({"extra_body": {"first_frame": "nope.png"}}, "first_frame",
              "first_frame name input files, but this service was started without --input-dir"),
             ({"extra_body": {"recipes": "no-such-recipe"}}, "recipes", "no-such-recipe"),
             ({"model": "sora-2"}, "model", "model 'sora-2' is not one of h3, h3-t2va, h3-fl2va, h3-ref2va"),
             ({"extra_body": {"n": 2}}, "n", "n must be 1, got 2"),
             ({"extra_body": {"guidance_scale": 5}}, "guidance_scale", "unknown field(s) 'guidance_scale'")]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.videos.create(prompt="x", **{**SMALL, **fields})
        assert message in err.value.body["message"] and err.value.body["type"] == "invalid_request_error", fields
        if param is not None:
            assert err.value.body["param"] == param
    with pytest.raises(openai.AuthenticationError) as err:
        client(server, "not-a-key-in-the-file-0123").videos.list()
    assert err.value.body == {"message": "unauthorized", "type": "authentication_error", "param": None,
                              "code": "invalid_api_key"}
    with pytest.raises(openai.BadRequestError, match="video is required: {\"id\": \"video_...\"} of a finished"):
        c.videos.extend(prompt="x", seconds="5", video=openai.omit)
    with pytest.raises(openai.NotFoundError, match="no video video_3"):
        c.videos.extend(prompt="x", seconds="5", video=openai.omit, extra_body={"video": {"id": "video_3"}})
    # The service's own routes keep their shape.
    r = httpx.get(f"{server['base']}/jobs/nope", headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 404 and r.json() == {"error": "no job nope"}


def test_keys_see_only_their_own_videos_and_an_admin_all(server):
    alice, bob, root = client(server), client(server, BOB), client(server, ROOT)
    mine = alice.videos.create(prompt="alice's own", **SMALL)
    for call in (lambda: bob.videos.retrieve(mine.id), lambda: bob.videos.delete(mine.id),
                 lambda: bob.videos.download_content(mine.id), lambda: bob.videos.remix(mine.id, prompt="x")):
        with pytest.raises(openai.NotFoundError, match=f"no video {mine.id}"):
            call()
    assert mine.id not in [v.id for v in bob.videos.list(limit=100).data]
    assert mine.id in [v.id for v in root.videos.list(limit=100).data]
    assert root.videos.retrieve(mine.id).prompt == "alice's own"
    assert root.videos.delete(mine.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.videos.retrieve(mine.id)


# ------------------------------------------------------------------ plain HTTP multipart (vLLM-Omni, LiteLLM)
def post(server, path, key=ALICE, headers=None, **kwargs):
    return httpx.post(f"{server['base']}{path}", headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      timeout=120, **kwargs)


def test_multipart_with_an_uploaded_first_frame_as_vllm_omni_and_litellm_send_it(server):
    frame = png_bytes(3)
    # LiteLLM's hosted_vllm provider: the fields as form text, extra_params serialized as JSON.
    r = post(server, "/v1/videos", files={"input_reference": ("frame.png", frame, "image/png")},
             data={"prompt": "the picture comes alive", "model": "h3", "size": "64x64", "seconds": "5.17",
                   "extra_params": json.dumps({"num_inference_steps": 2, "seed": 5})})
    assert r.status_code == 200, r.text
    video = r.json()
    # Answered as queued, or already in progress when the idle worker took it before the answer was written.
    assert video["status"] in ("queued", "in_progress") and video["mode"] == "fl2va" and video["seed"] == 5
    done = wait(client(server), video["id"])
    assert done.status == "completed", done.error
    assert uploads_left(server) == []  # read by the job, then removed

    # vLLM-Omni's /sync: a form (multipart, as curl -F sends it) without a file, the mp4 back in the answer.
    fields = {"prompt": "a quick one", "size": "64x64", "seconds": "5.17", "num_inference_steps": "2", "task": "t2va"}
    r = post(server, "/v1/videos/sync", files={name: (None, value) for name, value in fields.items()})
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert len(frames_of(r.content)) == 124 and r.headers["x-video-id"].startswith("video_")
    assert float(r.headers["x-inference-time-s"]) > 0


@pytest.mark.parametrize("upload, status, message", [
    (("frame.png", png_bytes(1), "video/mp4"), 400, "input_reference is declared video/mp4 but holds a png image"),
    (("noise.png", bytes(range(256)) * 64, "image/png"), 400, "input_reference is not an image, a video or a sound"),
    (("notes.txt", b"hello\n" * 100, "text/plain"), 400, "input_reference is not an image, a video or a sound"),
    (("big.png", png_bytes(2, (640, 640)), "image/png"), 413,
     f"input_reference is larger than the {MAX_INPUT_MB << 20} byte limit for an upload (--max-input-mb)"),
])
def test_bad_uploads_are_refused_in_one_line_and_nothing_is_kept(server, upload, status, message):
    r = post(server, "/v1/videos", files={"input_reference": upload}, data={"prompt": "x", "size": "64x64"})
    assert r.status_code == status and r.json()["error"]["message"].startswith(message), r.text
    assert r.json()["error"]["param"] == "input_reference" and "\n" not in r.json()["error"]["message"]
    assert uploads_left(server) == []


def test_form_refusals(server):
    r = post(server, "/v1/videos", files={"prompt": ("p.txt", b"x", "text/plain")}, data={"size": "64x64"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt takes no file; files go in input_reference"
    r = post(server, "/v1/videos", content=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "takes application/json or multipart/form-data" in r.json()["error"]["message"]
    r = post(server, "/v1/videos", data={"prompt": "x"}, files={"input_reference": ("f.png", png_bytes(), "image/png")},
             headers={"Origin": "https://example.com"})
    assert r.status_code == 403 and "refuses multipart bodies from web pages" in r.json()["error"]["message"]
