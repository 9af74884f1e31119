"""/v1/videos through the fleet's router: two real replicas (`Replica`, each a `--synthetic tiny` service in this
process) behind Ray's handle interface (`method.remote(*args)`, awaitable), the router's own app under uvicorn, and
the official openai client. Creates are spread over the replicas; every later call about a video reaches the one
that holds it; uploads go through the router's state folder. Ray's own routing and process isolation are
tests/test_fleet.py's."""

import asyncio
import io
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ports import free_port

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
pytest.importorskip("ray")
from PIL import Image  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SMALL = {"size": "64x64", "seconds": "5.17", "extra_body": {"steps": 2}}


class Handle:
    """What the router calls: Ray's deployment handle, `handle.method.remote(*args)` awaited, here a thread."""

    def __init__(self, replica):
        self.replica = replica

    def __getattr__(self, name):
        method = getattr(self.replica, name)
        return SimpleNamespace(remote=lambda *args: asyncio.to_thread(method, *args))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from h3_spark.serve.fleet.replica import Replica
    from h3_spark.serve.fleet.router import Router

    for name, value in {"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off"}.items():
        os.environ.setdefault(name, value)
    out = tmp_path_factory.mktemp("fleet-videos")
    argv = ["--synthetic", "tiny", "--synthetic-modes", "t2va", "--device", "cpu", "--output-dir", str(out)]
    from h3_spark.serve.fleet import replica as replica_module

    # Outside a Ray worker there is no actor name to report (Ray would warn at every poll).
    actor_name, replica_module._actor_name = replica_module._actor_name, lambda: None
    replicas = []
    for name in ("replica-1", "replica-2"):  # one after the other: transformers' lazy imports are not thread-safe
        replicas.append(Replica(name, argv, threads=1))
        assert replicas[-1].service.wait_loaded(90), replicas[-1].status()
    settings = {"replicas": ["replica-1", "replica-2"], "poll_seconds": 0.1, "call_timeout_seconds": 60,
                "lost_after_seconds": 600, "state_file": str(out / ".h3-spark-fleet.sqlite"), "keep_days": 2.0}
    router = Router(settings, *(Handle(r) for r in replicas))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(router.__serve_build_asgi_app__(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, [r.status() for r in replicas]
        try:
            if httpx.get(f"{base}/ready").json().get("ready_replicas") == 2:
                break
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.1)
    yield SimpleNamespace(base=base, out=out, router=router)
    server.should_exit = True
    thread.join(30)
    for replica in replicas:
        replica.service.stop()
    replica_module._actor_name = actor_name


def test_videos_spread_over_replicas_and_each_call_reaches_its_owner(fleet):
    c = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == ["h3", "h3-t2va", "h3-fl2va"]
    made = [c.videos.create(prompt=f"a fox {i}", **SMALL) for i in range(2)]
    assert {v.replica for v in made} == {"replica-1", "replica-2"}  # the second went to the idle one
    done = [c.videos.poll(v.id, poll_interval_ms=50) for v in made]
    assert [v.status for v in done] == ["completed", "completed"], [v.error for v in done]
    assert done[0].expires_at == done[0].completed_at + 2 * 86400
    for video in done:
        mp4 = c.videos.download_content(video.id).read()
        with __import__("av").open(io.BytesIO(mp4)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 124
        thumb = Image.open(io.BytesIO(c.videos.download_content(video.id, variant="thumbnail").read()))
        assert thumb.size == (64, 64)
    listed = c.videos.list(order="asc")
    assert [v.id for v in listed.data] == [v.id for v in made] and not listed.has_more

    # An upload through the router: written under its state folder, read by whichever replica takes the job.
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    fields = {"prompt": "it moves", "size": "64x64", "seconds": "5.17", "num_inference_steps": "2"}
    r = httpx.post(f"{fleet.base}/v1/videos", files={"input_reference": ("f.png", png.getvalue(), "image/png"),
                                                     **{k: (None, v) for k, v in fields.items()}})
    assert r.status_code == 200, r.text
    uploaded = c.videos.poll(r.json()["id"], poll_interval_ms=50)
    assert uploaded.status == "completed" and uploaded.mode == "fl2va", uploaded.error
    assert list((fleet.out / ".h3-spark-uploads").iterdir()) == []

    # An extension through the router: the continued canvas and the stitched length from the create answer on.
    extended = c.videos.extend(prompt="on", seconds="5.17", video=openai.omit,
                               extra_body={"video": {"id": made[1].id}, "steps": 2})
    assert (extended.size, extended.seconds) == ("64x64", "10.33"), extended
    assert c.videos.poll(extended.id, poll_interval_ms=50).seconds == "10.33"

    gone = c.videos.delete(made[0].id)
    assert gone.deleted and made[0].id not in [v.id for v in c.videos.list().data]
    for call in (lambda: c.videos.retrieve(made[0].id), lambda: c.videos.download_content(made[0].id)):
        with pytest.raises(openai.NotFoundError, match=f"no video {made[0].id}"):
            call()
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.videos.create(prompt="x", **{**SMALL, "extra_body": {"n": 3}})


def test_each_key_sees_only_its_own_jobs_and_videos_through_the_router(fleet):
    """A router with named keys (a keys file's): each key's jobs and videos are its own (404 for another's, as if
    they did not exist), an admin key sees all; the replicas' records carry the key's name."""
    from starlette.testclient import TestClient

    from h3_spark.serve.auth import Client
    from h3_spark.serve.fleet.config import Secret
    from h3_spark.serve.fleet.router import Router

    alice, bob, root = "alice-token-0123456789", "bob-token-0123456789ab", "root-token-0123456789ab"
    keys = {alice: Client("alice"), bob: Client("bob"), root: Client("root", admin=True)}
    settings = {"replicas": list(fleet.router.names), "poll_seconds": 0.1, "call_timeout_seconds": 60,
                "lost_after_seconds": 600, "api_key": Secret(keys)}
    router = Router(settings, *fleet.router.handles.values())

    def as_(token):
        return {"Authorization": f"Bearer {token}"}

    with TestClient(router.__serve_build_asgi_app__()) as client:
        assert client.get("/jobs").status_code == 401
        job = client.post("/generate", json={"prompt": "a heron", "output": "keys-a.mp4", "width": 64, "height": 64,
                                             "frames": 124, "steps": 2}, headers=as_(alice))
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]
        video = client.post("/v1/videos", json={"prompt": "a crane", "size": "64x64", "seconds": "5.17",
                                                "steps": 2}, headers=as_(alice)).json()
        for method, path in (("GET", f"/jobs/{job_id}"), ("DELETE", f"/jobs/{job_id}"),
                             ("GET", f"/jobs/{job_id}/preview")):
            got = client.request(method, path, headers=as_(bob))
            assert got.status_code == 404 and got.json() == {"error": f"no job {job_id}"}
        got = client.get(f"/v1/videos/{video['id']}", headers=as_(bob))
        assert got.status_code == 404 and got.json()["error"]["message"] == f"no video {video['id']}"
        assert client.get("/jobs", headers=as_(bob)).json()["jobs"] == []
        assert client.get("/v1/videos", headers=as_(bob)).json()["data"] == []
        everyone = {j["id"] for j in client.get("/jobs", headers=as_(root)).json()["jobs"]}
        assert {job_id, video["job_id"]} <= everyone
        assert [v["id"] for v in client.get("/v1/videos", headers=as_(alice)).json()["data"]] == [video["id"]]
        deadline = time.monotonic() + 90
        while True:
            records = [client.get(f"/jobs/{i}", headers=as_(alice)).json() for i in (job_id, video["job_id"])]
            if all(r["state"] in ("done", "failed", "cancelled") for r in records) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [r["state"] for r in records] == ["done", "done"], records
        assert [r["client"] for r in records] == ["alice", "alice"]
        assert client.get(f"/jobs/{job_id}", headers=as_(root)).json()["client"] == "alice"
