"""The fleet on Ray Serve (serve/fleet/), on the CPU: a local Ray head with 2 CPUs, tiny synthetic models.

One fleet for the module: replica-1 and replica-2 (`--synthetic tiny --device cpu`, half a CPU and one torch
thread each) and `broken`, whose models folder does not exist. Routing, job state across clients, the broken
replica and finally a replica killed mid-job are checked through the fleet's HTTP front, with loops that stop
at a deadline. The config's one-line errors, the ledger's bookkeeping, the token and a missing Ray need no Ray
cluster and run first.
"""

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from h3_spark.errors import H3Error, InputError
from h3_spark.serve.fleet.config import config_from_mapping, load_config
from h3_spark.serve.fleet.ledger import Ledger
from h3_spark.serve.http_limits import HttpLimits
from ports import free_port

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

# Ray Serve's own pydantic models warn on import; nothing of ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")
ROOT = Path(__file__).resolve().parents[1]
TERMINAL = ("done", "failed", "cancelled")
KERNEL_ENV = {"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}
rng = random.Random()


def tiny_serve(out) -> dict:
    return {"synthetic": "tiny", "synthetic_modes": "t2va", "device": "cpu", "output_dir": str(out)}


def body(steps=3, **extra) -> dict:
    words = ["cat", "piano", "river", "lantern", "fox", "violin", "storm", "garden"]
    prompt = "a " + " ".join(rng.sample(words, 3))
    return {"prompt": prompt, "output": f"fleet-{uuid.uuid4().hex[:12]}.mp4", "steps": steps, "width": 64,
            "height": 64, "frames": 124, "seed": rng.randrange(1 << 30), **extra}


# ------------------------------------------------------------------ config (no Ray)
@pytest.mark.parametrize("mapping, message", [
    ({"replicas": 0}, "fleet config t: replicas must be 1..256, got 0"),
    ({"replicas": "two"}, "fleet config t: replicas must be a count or a non-empty list of replicas, got 'two'"),
    ({"replica": 2}, "fleet config t: unknown setting 'replica' (known: replicas, serve,"),
    ({"serve": {"host": "0.0.0.0"}}, "fleet config t: replica replica-1: serve option 'host' is not per replica: "
                                     "the fleet's front listens"),
    ({"serve": {"gpus": 2}}, "fleet config t: replica replica-1: serve option 'gpus': a replica is one process on "
                             "one device; the fleet does not run sequence-parallel replicas"),
    ({"serve": {"bogus_flag": 1}}, "fleet config t: replica replica-1: unrecognized arguments: --bogus-flag 1"),
    ({"serve": {"device": "cpu"}}, "fleet config t: replica replica-1: the following arguments are required: "
                                   "--output-dir"),
    ({"serve": {"queue_size": "many"}}, "fleet config t: replica replica-1: argument --queue-size: invalid int "
                                        "value: 'many'"),
    ({"gpus_per_replica": 2}, "fleet config t: gpus_per_replica 2: a replica holds its models on one GPU"),
    ({"cpus_per_replica": -1}, "fleet config t: cpus_per_replica must be at least 0, got -1"),
    ({"port": 70000}, "fleet config t: port must be 1..65535, got 70000"),
    ({"poll_seconds": float("nan")}, "fleet config t: poll_seconds must be a number, got nan"),
    ({"replicas": [{"name": "a"}, {"name": "a"}]}, "fleet config t: two replicas are named 'a'"),
    ({"replicas": [{"name": "Bad_Name"}]}, "fleet config t: replica name 'Bad_Name' must be 1-40 of a-z"),
    ({"env": {"H3_ATTENTION": ["sdpa"]}}, "fleet config t: env H3_ATTENTION must be a string or a number"),
    ({"api_key_file": "a", "keys_file": "b"}, "fleet config t: api_key_file (one token) and keys_file (named keys) "
                                              "both give the front's keys: use one"),
    ({"keys_file": 3}, "fleet config t: keys_file must be a file path, got 3"),
    ({"serve": {"keys_file": "k"}}, "fleet config t: replica replica-1: serve option 'keys_file' is not per replica: "
                                    "the fleet's front checks the keys"),
    ({"http": {"head_timeout": 3}}, "fleet config t: unknown http setting 'head_timeout' (known: max_header_bytes, "),
    ({"http": {"body_timeout_s": 0}}, "fleet config t: http: --body-timeout-s must be 1..3600, got 0"),
    ({"http": {"sync_timeout_s": "long"}}, "fleet config t: http sync_timeout_s must be a number, got 'long'"),
    ({"http": [1]}, "fleet config t: http must be a mapping, got list"),
])
def test_bad_config_values_are_one_line_errors(tmp_path, mapping, message):
    if "--output-dir" not in message:
        mapping = {**mapping, "serve": {"output_dir": str(tmp_path), **mapping.get("serve", {})}}
    with pytest.raises(InputError) as err:
        config_from_mapping(mapping, "t")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_config_file_gives_each_replica_its_serve_flags(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(f"replicas:\n  - name: gpu-a\n  - name: gpu-b\n    serve: {{queue_size: 9}}\n"
                    f"serve:\n  output_dir: {tmp_path}\n  device: cpu\nport: 8123\nenv: {{H3_ATTENTION: sdpa}}\n")
    config = load_config(path, {"serve": {"max_steps": 7}, "host": "127.0.0.2"})
    assert [r.name for r in config.replicas] == ["gpu-a", "gpu-b"]
    assert config.replicas[1].serve_argv == ("--output-dir", str(tmp_path), "--device", "cpu", "--max-steps", "7",
                                             "--queue-size", "9")
    assert config.gpus_per_replica == 0 and config.port == 8123 and config.host == "127.0.0.2"
    assert config.env == {"H3_ATTENTION": "sdpa"}
    assert config.http == HttpLimits()  # the front's HTTP limits: serve's, unless the config's `http` says
    assert load_config(path, {"http": {"head_timeout_s": 2.5, "sync_timeout_s": 60}}).http == HttpLimits(
        head_timeout_s=2.5, sync_timeout_s=60)
    # The front checks uploads and steps against the strictest replica's limits (any may take the job).
    strict = config_from_mapping({"replicas": [{"name": "a", "serve": {"max_input_mb": 8, "keep_days": 3}},
                                               {"name": "b", "serve": {"max_steps": 12}}],
                                  "serve": {"output_dir": str(tmp_path)}}, "t")
    limits, keep_days = strict.front_limits()
    assert (limits.max_input_file_bytes, limits.max_steps, keep_days) == (8 << 20, 12, 3.0)
    (tmp_path / "bad.yaml").write_text("replicas: [1\n")
    with pytest.raises(InputError, match=r"bad.yaml: not valid YAML at line 2$"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(InputError, match=r"fleet config .*fleet.toml: name a .yaml, .yml or .json file"):
        (tmp_path / "fleet.toml").write_text("")
        load_config(tmp_path / "fleet.toml")


# ------------------------------------------------------------------ the ledger (no Ray)
def status(instance, state="ready", jobs=(), now=1.0):
    return {"instance": instance, "state": state, "queue": {"queued": 0}, "now": now, "jobs": list(jobs)}


def test_the_ledger_places_on_the_least_loaded_and_fails_a_lost_instances_jobs():
    ledger = Ledger(["r1", "r2", "r3"])
    ledger.observe("r1", status("a"))
    ledger.observe("r2", status("b"))
    ledger.observe("r3", status("c", state="failed"))
    assert ledger.candidates() == ["r1", "r2"]  # never the failed one
    ledger.placed("j1", "r1", "a", {"id": "j1", "state": "queued", "request": {"output": "x/o.mp4"}})
    assert ledger.candidates() == ["r2", "r1"]
    assert ledger.output_taken("x/./o.mp4") == "j1" and ledger.output_taken("o.mp4") is None
    ledger.placed("j2", "r1", "a", {"id": "j2", "state": "running"})
    ledger.placed("j3", "r1", "a", {"id": "j3", "state": "done"})
    # Ray restarted r1: a new instance answers; what ran on the old one is gone.
    ledger.observe("r1", status("a2"))
    j1, j2, j3 = (ledger.answer(j) for j in ("j1", "j2", "j3"))
    assert j1["state"] == "failed" and j1["replica"] == "r1"
    assert j1["error"] == "replica r1 was lost (its process ended and Ray started a new one) while this job was queued"
    assert j2["error"].endswith("while this job was running")
    assert j3["state"] == "done" and j3.get("error") is None
    assert ledger.output_taken("x/o.mp4") is None
    # A late record of a lost job from anywhere does not bring it back.
    ledger.record("j2", "r1", "a", {"id": "j2", "state": "done"})
    assert ledger.answer("j2")["state"] == "failed"


def test_a_silent_replica_loses_its_jobs_only_after_the_grace_period():
    ledger = Ledger(["r1"])
    ledger.observe("r1", status("a"))
    ledger.placed("j1", "r1", "a", {"id": "j1", "state": "running"})
    ledger.unanswered("r1", "no answer within 10 s", lost_after=30, now=100.0)
    assert ledger.candidates() == [] and ledger.answer("j1")["state"] == "running"
    ledger.unanswered("r1", "no answer within 10 s", lost_after=30, now=131.0)
    assert ledger.answer("j1")["error"] == ("replica r1 was lost (it did not answer for 30 s: no answer within "
                                            "10 s) while this job was running")
    # It comes back (same process) still running j1: the router is told to cancel it.
    assert ledger.observe("r1", status("a", jobs=[{"id": "j1", "state": "running"}])) == ["j1"]
    assert ledger.answer("j1")["state"] == "failed" and ledger.candidates() == ["r1"]


def test_the_fronts_metrics_count_replica_states_jobs_and_losses():
    """The router's /metrics from its ledger: states, queues, jobs by replica, and a restart's losses."""
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from h3_spark.serve.fleet.metrics import FleetMetrics

    ledger = Ledger(["r1", "r2"])
    ledger.observe("r1", {**status("a"), "queue": {"queued": 2}})
    ledger.observe("r2", status("b", state="failed"))
    placed = rng.randint(2, 5)
    for i in range(placed):
        ledger.placed(f"j{i}", "r1", "a", {"id": f"j{i}", "state": "running" if i == 0 else "queued"})
    ledger.placed("done1", "r1", "a", {"id": "done1", "state": "done"})
    ledger.observe("r1", status("a2"))  # restarted: the placed jobs are lost, the done one stays done
    text, media_type = FleetMetrics(ledger).render()
    assert media_type.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text.decode()) for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("h3_spark_fleet_replica_state", replica="r1", state="ready") == 1
    assert value("h3_spark_fleet_replica_state", replica="r2", state="failed") == 1
    assert value("h3_spark_fleet_replica_state", replica="r2", state="ready") == 0
    assert value("h3_spark_fleet_replica_queue_depth", replica="r1") == 0  # the new process's queue
    assert value("h3_spark_fleet_jobs", replica="r1", state="failed") == placed
    assert value("h3_spark_fleet_jobs", replica="r1", state="done") == 1
    assert value("h3_spark_fleet_jobs", replica="r1", state="running") == 0
    assert value("h3_spark_fleet_jobs_lost_total", replica="r1") == placed
    assert value("h3_spark_fleet_replica_processes_lost_total", replica="r1") == 1
    assert value("h3_spark_fleet_replica_processes_lost_total", replica="r2") == 0


# ------------------------------------------------------------------ Ray absent, the token (no Ray cluster)
def test_without_ray_the_fleet_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from h3_spark.cli import main
    from h3_spark.serve.fleet import require_ray
    from h3_spark.serve.fleet.app import build_fleet

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(H3Error, match=r"^the fleet needs Ray Serve: pip install 'h3-spark\[fleet\]'"):
        require_ray()
    config = config_from_mapping({"serve": {"output_dir": str(tmp_path)}})
    with pytest.raises(H3Error, match=r"^the fleet needs Ray Serve"):
        build_fleet(config)
    assert main(["fleet", "--replicas", "2", "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("h3-spark fleet: error: the fleet needs Ray Serve: pip install 'h3-spark[fleet]'")
    assert err.count("\n") == 1


def test_the_front_asks_for_the_token_and_refuses_beyond_loopback_without_one(tmp_path, capsys):
    from starlette.testclient import TestClient

    from h3_spark.cli import main
    from h3_spark.serve.fleet.config import Secret
    from h3_spark.serve.fleet.router import Router, create_router_app

    pytest.importorskip("ray")
    token = "fleet-token-0123456789abcdef"
    router = Router({"replicas": [], "poll_seconds": 60, "call_timeout_seconds": 1, "lost_after_seconds": 1,
                     "api_key": Secret(token)})
    assert token not in repr(router.api_key)
    with TestClient(create_router_app(router)) as client:
        assert client.get("/fleet").status_code == 401
        assert client.get("/ready", headers={"Authorization": f"Bearer {token}x"}).status_code == 401
        got = client.get("/ready", headers={"Authorization": f"Bearer {token}"})
        assert got.status_code == 503 and got.json() == {"ready": False, "ready_replicas": 0, "replicas": {}}
        assert client.get("/metrics").status_code == 401
        got = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert got.status_code == 200 and "h3_spark_fleet_jobs" in got.text
    assert main(["fleet", "--host", "0.0.0.0", "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert "--host 0.0.0.0 listens beyond this machine and the API has no token" in capsys.readouterr().err
    keys = tmp_path / "keys"
    keys.write_text("alice alice-token-0123456789\n")
    keys.chmod(0o644)
    assert main(["fleet", "--keys-file", str(keys), "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert f"--keys-file {keys} is open to other users (mode 644): chmod 600 it" in capsys.readouterr().err


# ------------------------------------------------------------------ `h3-spark fleet` listens on loopback only
def listening_beyond_loopback(root_pid: int) -> list[str]:
    """Listening TCP sockets of the process and its descendants that are not on a loopback address."""
    import ipaddress

    psutil = pytest.importorskip("psutil")
    root = psutil.Process(root_pid)
    pids = {root.pid} | {p.pid for p in root.children(recursive=True)}
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        address = ipaddress.ip_address(conn.laddr.ip)
        mapped = getattr(address, "ipv4_mapped", None)
        if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
            with contextlib.suppress(psutil.Error):
                found.append(f"{psutil.Process(conn.pid).name()} on {conn.laddr.ip}:{conn.laddr.port}")
    return sorted(found)


def test_a_local_fleet_listens_on_loopback_only(tmp_path):
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("ray")
    port = free_port()
    env = {**os.environ, **KERNEL_ENV, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    command = [sys.executable, "-m", "h3_spark.cli", "fleet", "--replicas", "1", "--synthetic", "tiny",
               "--synthetic-modes", "t2va", "--device", "cpu", "--output-dir", str(tmp_path), "--port", str(port),
               "--num-cpus", "1", "--cpus-per-replica", "0.5"]
    # Started from the checkout, as a user would: Ray's workers run in the driver's folder, so a root module that
    # shadowed an installed one (the old root-as-package layout's kernels/) failed every replica.
    fleet = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    family = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            def replica_up():
                # Its Serve gRPC server is up once it answers the router (loading or ready): no need to wait for
                # the models.
                assert fleet.poll() is None, fleet.stderr.read().decode()[-2000:]
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):  # Ray answers text until the app is up
                    return client.get("/ready").json()["replicas"]["replica-1"]["state"] in ("loading", "ready")
                return False

            until(replica_up, 120, "the fleet's replica up")
            listening = listening_beyond_loopback(fleet.pid)
            assert client.get("/live", headers={"Host": "attacker.example"}).status_code == 400
    finally:
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(fleet.pid).children(recursive=True)
        os.killpg(fleet.pid, signal.SIGKILL)  # the fleet, its Ray head and workers: nothing of it is kept
        fleet.wait(30)
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.kill()
    assert listening == []


# ------------------------------------------------------------------ the fleet on a local Ray head
@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray import serve

    from h3_spark.serve.fleet.app import APP_NAME, build_fleet

    out = tmp_path_factory.mktemp("fleet-out")
    config = config_from_mapping({
        "replicas": [{"name": "replica-1"}, {"name": "replica-2"},
                     {"name": "broken", "serve": {"synthetic": None, "models": str(out / "no-such-models")}}],
        "serve": tiny_serve(out), "cpus_per_replica": 0.5, "env": KERNEL_ENV, "poll_seconds": 0.25,
        "call_timeout_seconds": 5, "lost_after_seconds": 60}, "tests")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_fleet(config), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as client:
            until(lambda: client.get("/ready").json()["ready_replicas"] == 2, 90, "two replicas ready")
        yield {"url": url, "out": out, "ray": ray}
    finally:
        serve.shutdown()
        ray.shutdown()


def until(check, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s")


def wait_job(client, job_id, timeout=60):
    record = {}

    def ended():
        nonlocal record
        record = client.get(f"/jobs/{job_id}").json()
        return record if record["state"] in TERMINAL else None

    try:
        return until(ended, timeout, f"job {job_id} ended")
    except AssertionError:
        raise AssertionError(f"job {job_id} did not end: {record}") from None


def test_ready_reports_each_replica_and_the_broken_ones_error(fleet):
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        ready = client.get("/ready")
        view = client.get("/fleet").json()
        live = client.get("/live")
    assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["ready_replicas"] == 2
    replicas = ready.json()["replicas"]
    assert replicas["replica-1"]["state"] == "ready" and replicas["replica-2"]["state"] == "ready"
    assert replicas["broken"]["state"] == "failed"
    assert replicas["broken"]["error"] == f"loading failed: {fleet['out'] / 'no-such-models'}: no such model folder " \
                                          f"(--models)"
    assert view["replicas"]["broken"]["error"] == replicas["broken"]["error"]
    assert replicas["replica-1"]["instance"] != replicas["replica-2"]["instance"]
    assert replicas["replica-1"]["pid"] != replicas["replica-2"]["pid"]
    assert live.json() == {"alive": True}


def test_jobs_spread_over_the_replicas_and_each_call_reaches_the_owner(fleet):
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        sent = [body() for _ in range(5)]
        placed = [client.post("/generate", json=b) for b in sent]
        assert [p.status_code for p in placed] == [202] * 5, [p.json() for p in placed]
        owners = [p.json()["replica"] for p in placed]
        assert sorted(owners) == ["replica-1", "replica-1", "replica-1", "replica-2", "replica-2"] or \
            sorted(owners) == ["replica-1", "replica-1", "replica-2", "replica-2", "replica-2"], owners
        # The last one waits behind its replica's first: cancelled on its owner.
        last = placed[-1].json()["id"]
        cancel = client.delete(f"/jobs/{last}")
        assert cancel.status_code in (200, 202) and cancel.json()["replica"] == owners[-1]
        records = [wait_job(client, p.json()["id"]) for p in placed]
        for record, sent_body, owner in zip(records[:4], sent, owners):
            assert record["state"] == "done", record
            assert record["replica"] == owner and record["request"]["prompt"] == sent_body["prompt"]
            assert record["request"]["seed"] == sent_body["seed"]
            assert (fleet["out"] / sent_body["output"]).stat().st_size > 0
        assert records[4]["state"] == "cancelled"
        png = client.get(f"/jobs/{records[0]['id']}/preview")
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        from PIL import Image

        assert Image.open(io.BytesIO(png.content)).size[0] > 0
        again = client.delete(f"/jobs/{records[0]['id']}")
        assert again.status_code == 409 and "already ended (done)" in again.json()["error"]
        listed = {j["id"]: j for j in client.get("/jobs").json()["jobs"]}
        assert all(listed[p.json()["id"]]["replica"] == o for p, o in zip(placed, owners))
        stranger = uuid.uuid4().hex
        for method, path in (("GET", f"/jobs/{stranger}"), ("DELETE", f"/jobs/{stranger}"),
                             ("GET", f"/jobs/{stranger}/preview")):
            got = client.request(method, path)
            assert got.status_code == 404 and got.json() == {"error": f"no job {stranger}"}
        # Two live jobs may not write one output, whichever replicas they land on.
        same = body(steps=6)
        first = client.post("/generate", json=same)
        clash = client.post("/generate", json={**same, "seed": 1})
        assert clash.status_code == 409 and clash.json()["error"] == \
            f"output {same['output']!r} is being written by job {first.json()['id']}"
        assert wait_job(client, first.json()["id"])["state"] == "done"
        view = client.get("/fleet").json()
    assert view["replicas"]["broken"]["assigned"] == 0


def test_job_state_survives_the_client(fleet):
    sent = body()
    with httpx.Client(base_url=fleet["url"], timeout=30) as first:
        job_id = first.post("/generate", json=sent).json()["id"]
    time.sleep(0.5)
    with httpx.Client(base_url=fleet["url"], timeout=30) as later:
        record = wait_job(later, job_id)
    assert record["state"] == "done" and record["output"] and record["request"]["prompt"] == sent["prompt"]


@contextlib.contextmanager
def front(fleet, http, **kwargs):
    """The fleet's own front (serve/fleet/front.py, as `h3-spark fleet` runs it) before the module's fleet."""
    import threading

    import uvicorn

    from h3_spark.serve.auth import LOOPBACK_HOSTS
    from h3_spark.serve.fleet.front import front_app
    from h3_spark.serve.http_limits import uvicorn_settings
    from h3_spark.serve.validation import Limits

    port = free_port()
    app = front_app(fleet["url"], http, Limits(), kwargs.get("allowed_hosts", LOOPBACK_HOSTS), kwargs.get("key"),
                    lambda line: None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on",
                                           **uvicorn_settings(http)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started, 10, "the front started")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_front_holds_serves_deadlines_against_stalled_sockets(fleet):
    """serve's slow-client test against the 2-replica fleet through its front: 120 stalled sockets (half a partial
    head, half 6 of 100 body bytes of POST /generate) while four clients loop POST /generate and GET /live: every
    request answered (none lost), /live 200 throughout, the heads closed silently at 2 s and the bodies answered 408
    at 3 s. Ray's own proxy keeps a stalled head open past that deadline (why the front is ours)."""
    import statistics
    import threading

    from slow_clients import LIVE, closed_within, raw_request, stalled
    from h3_spark.serve.http_limits import HttpLimits

    direct = stalled(int(fleet["url"].rsplit(":", 1)[1]), "head")
    http = HttpLimits(max_connections=8, head_timeout_s=2.0, body_timeout_s=3.0)
    with front(fleet, http) as port:
        heads = [stalled(port, "head") for _ in range(60)]
        bodies = [stalled(port, "body", "/generate") for _ in range(60)]
        results, stop = [], time.monotonic() + 2.0

        def client(k):
            n = 0
            while time.monotonic() < stop:
                job = json.dumps(body(steps=2, output=f"front-{k}-{n}-{uuid.uuid4().hex[:6]}.mp4")).encode()
                results.append(("generate", *raw_request(port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                               b"Content-Type: application/json\r\nContent-Length: "
                                                               + str(len(job)).encode() + b"\r\nConnection: close"
                                                               b"\r\n\r\n" + job)))
                results.append(("live", *raw_request(port, LIVE)))
                n += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = {kind: sorted({code for k, code, _, _ in results if k == kind}) for kind in ("generate", "live")}
        assert len(results) > 20 and set(codes["generate"]) <= {202, 429, 503}, codes
        assert codes["generate"][0] == 202 and codes["live"] == [200], codes
        assert all(h.get("retry-after") for k, code, h, _ in results if code in (429, 503))
        live = sorted(seconds for kind, _, _, seconds in results if kind == "live")
        assert statistics.median(live) < 0.5, live
        assert all(closed_within(s, 3.0) == (True, b"") for s in heads)
        for s in bodies:
            closed, got = closed_within(s, 3.0)
            assert closed and got.startswith(b"HTTP/1.1 408"), got[:40]
    assert closed_within(direct, 1.0)[0] is False  # 3 s and more after it opened, Ray's proxy still holds it
    direct.close()
    with httpx.Client(base_url=fleet["url"], timeout=30) as plain:
        placed = sum(1 for k, code, _, _ in results if k == "generate" and code == 202)
        jobs = plain.get("/jobs").json()["jobs"]
        assert placed and len(jobs) >= placed  # the jobs the front let through are the router's
        for job in jobs:  # the later tests start from idle replicas
            if job["state"] not in TERMINAL:
                plain.delete(f"/jobs/{job['id']}")
        until(lambda: all(j["state"] in TERMINAL for j in plain.get("/jobs").json()["jobs"]), 60, "the jobs ended")


def test_the_front_refuses_a_stranger_host_in_each_routes_shape_and_forwards_answers_whole(fleet):
    from slow_clients import raw_request
    from h3_spark.serve.http_limits import HttpLimits

    with front(fleet, HttpLimits()) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        got = c.get("/v1/models", headers={"host": "attacker.example"})
        assert got.status_code == 400 and got.json() == {"error": {
            "message": "Host 'attacker.example' is not a name this server answers to (--allowed-host)",
            "type": "invalid_request_error", "param": None, "code": "invalid_host"}}
        got = c.get("/jobs", headers={"host": "attacker.example:8000"})
        assert got.status_code == 400 and got.json() == {
            "error": "Host 'attacker.example:8000' is not a name this server answers to (--allowed-host)"}
        ready = c.get("/ready")
        assert ready.status_code == 200 and ready.json()["ready_replicas"] == 2
        assert c.get("/v1/models").json()["data"][0]["id"] == "h3"
        code, _, _ = raw_request(port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                       b"application/json\r\nContent-Length: 1099511627776\r\nConnection: close"
                                       b"\r\n\r\n{}")
        assert code == 413  # on the declared length, before any of it is read


def test_a_killed_replicas_jobs_fail_with_the_reason_and_the_fleet_keeps_serving(fleet):
    ray = fleet["ray"]
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        placed = [client.post("/generate", json=body(steps=8)).json() for _ in range(4)]
        victims = [p["id"] for p in placed if p["replica"] == "replica-1"]
        survivors = [p["id"] for p in placed if p["replica"] == "replica-2"]
        assert len(victims) == 2 and len(survivors) == 2, placed
        until(lambda: client.get(f"/jobs/{victims[0]}").json()["state"] == "running", 30, "replica-1's job running")
        before = client.get("/fleet").json()["replicas"]["replica-1"]
        ray.kill(ray.get_actor(before["actor"], namespace="serve"), no_restart=True)

        ended = {p["id"]: wait_job(client, p["id"], timeout=60) for p in placed}
        for job_id in victims:
            assert ended[job_id]["state"] == "failed", ended[job_id]
            assert ended[job_id]["error"].startswith("replica replica-1 was lost (")
            assert ended[job_id]["error"].endswith(("while this job was running", "while this job was queued"))
        assert ended[victims[0]]["error"].endswith("while this job was running")
        assert [ended[j]["state"] for j in survivors] == ["done", "done"]

        # New work goes to whoever is ready: replica-2 now, the restarted replica-1 once it has loaded.
        fresh = client.post("/generate", json=body())
        assert fresh.status_code == 202 and fresh.json()["replica"] == "replica-2"
        assert wait_job(client, fresh.json()["id"])["state"] == "done"

        def restarted():
            view = client.get("/fleet").json()["replicas"]["replica-1"]
            return view if view["state"] == "ready" and view["instance"] != before["instance"] else None

        after = until(restarted, 60, "replica-1 restarted by Ray and ready")
        assert after["pid"] != before["pid"]
        pair = [client.post("/generate", json=body()).json() for _ in range(2)]
        assert sorted(p["replica"] for p in pair) == ["replica-1", "replica-2"]
        assert [wait_job(client, p["id"])["state"] for p in pair] == ["done", "done"]
        counts = client.get("/fleet").json()["jobs"]
        metrics = client.get("/metrics").text
    assert "queued" not in counts and "running" not in counts
    # The front's metrics saw the loss: one process of replica-1, its two jobs.
    assert 'h3_spark_fleet_replica_processes_lost_total{replica="replica-1"} 1.0' in metrics
    assert 'h3_spark_fleet_jobs_lost_total{replica="replica-1"} 2.0' in metrics
    assert 'h3_spark_fleet_jobs_lost_total{replica="replica-2"} 0.0' in metrics
