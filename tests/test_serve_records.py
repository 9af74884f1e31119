"""Job records on disk (serve/records.py) and the fleet router's hold on output names and its ledger file, without
models or Ray: a killed process's records, the bad state files, expiry, 100 concurrent submissions of one name."""

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

from h3_spark.errors import InputError
from h3_spark.serve.records import SCHEMA_VERSION, JobRecords

rng = random.Random()


def record(state, **extra):
    now = time.time()
    return {"id": uuid.uuid4().hex, "state": state, "created": now - rng.uniform(1, 100), "finished": None,
            "progress": {"stage": state, "step": rng.randrange(10), "total": 10}, "error": None,
            "request": {"prompt": f"a fox {rng.random()}", "output": f"{uuid.uuid4().hex[:8]}.mp4"}, **extra}


# ------------------------------------------------------------------ the file
def test_records_a_killed_process_left_end_failed_and_ended_ones_stay(tmp_path):
    path = tmp_path / "jobs.sqlite"
    done = record("done", finished=time.time(), output="x.mp4")
    queued, running = record("queued"), record("running")
    # A real kill -9 right after the writes: nothing is closed, the lock dies with the process.
    script = ("import json, os, signal, sys\n"
              "from h3_spark.serve.records import JobRecords\n"
              f"r = JobRecords({str(path)!r})\n"
              f"for rec in json.loads(sys.argv[1]): r.save(rec)\n"
              f"os.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.run([sys.executable, "-c", script, json.dumps([done, queued, running])], capture_output=True,
                           cwd=tmp_path, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    records = JobRecords(path)
    ended = dict(records.end_unfinished("the service stopped"))
    assert ended == {queued["id"]: "queued", running["id"]: "running"}
    assert records.get(done["id"]) == done
    for rec, state in ((queued, "queued"), (running, "running")):
        got = records.get(rec["id"])
        assert got["state"] == "failed" and got["error"] == f"the service stopped while this job was {state}"
        assert got["request"] == rec["request"] and got["finished"] >= got["created"]
    assert {r["id"]: r["state"] for r in records.states()} == {done["id"]: "done", queued["id"]: "failed",
                                                               running["id"]: "failed"}
    assert records.end_unfinished("again") == []
    records.close()


def test_old_records_expire_by_count_and_age(tmp_path):
    records = JobRecords(tmp_path / "j.sqlite", keep=3, max_age_s=3600)
    now = time.time()
    ended = [record(rng.choice(["done", "failed", "cancelled"]), finished=now - 60 * i) for i in range(5)]
    live = record("running")
    for rec in [live, *ended]:
        records.save(rec)
    assert {r["id"] for r in records.states()} == {live["id"], *(r["id"] for r in ended[:3])}
    records.expire(now + 3600 - 90)  # then the one finished 120 s before `now` is past the hour
    assert {r["id"] for r in records.states()} == {live["id"], ended[0]["id"], ended[1]["id"]}
    records.close()


def test_bad_state_files_are_refused_in_one_line(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    newer = tmp_path / "newer.sqlite"
    with sqlite3.connect(newer) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    frozen = tmp_path / "frozen.sqlite"
    JobRecords(frozen).close()
    frozen.chmod(0o444)
    (tmp_path / "folder.sqlite").mkdir()
    cases = [(garbage, f"{garbage}: the job record file is not an SQLite database; move it away or use another "
                       f"--state-dir"),
             (newer, f"{newer}: job records of a newer h3-spark (schema {SCHEMA_VERSION + 1}; this one reads "
                     f"{SCHEMA_VERSION} and older); use that version or another --state-dir"),
             (frozen, f"{frozen}: the job record file is read-only (mode 444); the service writes every job's "
                      f"state there"),
             (tmp_path / "folder.sqlite", f"{tmp_path / 'folder.sqlite'}: the job record file is a folder")]
    for path, message in cases:
        with pytest.raises(InputError) as err:
            JobRecords(path)
        assert str(err.value) == message
    held = JobRecords(tmp_path / "held.sqlite")
    with pytest.raises(InputError, match=r"held.sqlite: another running service keeps its job records in this "
                                         r"file; give this one its own --state-dir$"):
        JobRecords(tmp_path / "held.sqlite")
    held.close()
    JobRecords(tmp_path / "held.sqlite").close()  # free again once its holder closed it


def test_a_service_creates_its_state_dir_and_refuses_a_bad_file(tmp_path):
    from h3_spark.serve.service import STATE_FILE, Service, ServiceConfig

    lines = []
    state = tmp_path / "state" / "deeper"
    service = Service(ServiceConfig(output_dir=tmp_path, state_dir=state), lambda t: None, log=lines.append)
    assert (state / STATE_FILE).is_file()
    assert lines == [f"created the state folder {state} (--state-dir did not exist)"]
    service.records.close()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(InputError, match=f"^--state-dir {tmp_path / 'file'}: not a folder$"):
        Service(ServiceConfig(output_dir=tmp_path, state_dir=tmp_path / "file"), lambda t: None)
    (tmp_path / STATE_FILE).write_bytes(os.urandom(2048))
    with pytest.raises(InputError, match="the job record file is not an SQLite database"):
        Service(ServiceConfig(output_dir=tmp_path, state_dir=tmp_path), lambda t: None)


# ------------------------------------------------------------------ the fleet's router, with replicas faked
class FakeReplica:
    """A replica deployment's handle: `.method.remote(*args)` is awaitable, answering as replica.py does."""

    def __init__(self, name, delay=0.0):
        self.name, self.instance, self.delay = name, uuid.uuid4().hex, delay
        self.jobs: dict[str, dict] = {}

    def __getattr__(self, method):
        impl = getattr(self, f"_{method}")

        class Call:
            @staticmethod
            def remote(*args):
                async def run():
                    await asyncio.sleep(self.delay * rng.random())
                    return impl(*args)
                return run()
        return Call

    def _answer(self, status, body):
        return {"instance": self.instance, "status": status, "body": body, "headers": {}}

    def _status(self, since=None):
        return {"instance": self.instance, "state": "ready", "queue": {"queued": 0}, "now": time.time(),
                "jobs": list(self.jobs.values())}

    def _submit(self, body, client=None):
        rec = {"id": uuid.uuid4().hex, "state": "queued", "created": time.time(), "finished": None,
               "request": {"output": body["output"], "overwrite": body.get("overwrite", False)}}
        self.jobs[rec["id"]] = rec
        return self._answer(202, rec)

    def _job(self, job_id):
        rec = self.jobs.get(job_id)
        return self._answer(200, rec) if rec else self._answer(404, {"error": f"no job {job_id}"})


def router_with(replicas, state_file=None):
    from h3_spark.serve.fleet.router import Router

    settings = {"replicas": [r.name for r in replicas], "poll_seconds": 60, "call_timeout_seconds": 5,
                "lost_after_seconds": 60, "state_file": state_file}
    return Router(settings, *replicas)


def test_100_concurrent_submissions_of_one_name_place_exactly_one_job():
    pytest.importorskip("ray")
    replicas = [FakeReplica("replica-1", delay=0.01), FakeReplica("replica-2", delay=0.01)]
    router = router_with(replicas)

    async def run():
        await asyncio.gather(*(router.refresh(r.name) for r in replicas))
        bodies = [{"prompt": "p", "output": rng.choice(["race.mp4", "./race.mp4"]), "overwrite": rng.random() < 0.5}
                  for _ in range(100)]
        return await asyncio.gather(*(router.submit(b) for b in bodies))

    answers = asyncio.run(run())
    codes = [status for status, _, _ in answers]
    assert codes.count(202) == 1 and codes.count(409) == 99, codes
    placed = next(body for status, body, _ in answers if status == 202)
    for status, body, _ in answers:
        if status == 409:
            assert body["error"] in (f"output {o!r} is being placed for another request" for o in ("race.mp4",
                                                                                                   "./race.mp4")) \
                or body["error"].endswith(f"is being written by job {placed['id']}"), body
    assert sum(len(r.jobs) for r in replicas) == 1
    # Once the job has ended, the name is free again.
    owner = next(r for r in replicas if r.jobs)
    owner.jobs[placed["id"]]["state"] = "done"
    status, body, _ = asyncio.run(_refresh_then_submit(router, replicas, {"prompt": "p", "output": "race.mp4"}))
    assert status == 202, body


async def _refresh_then_submit(router, replicas, body):
    await asyncio.gather(*(router.refresh(r.name) for r in replicas))
    return await router.submit(body)


def test_a_restarted_router_finds_its_jobs_in_its_file(tmp_path):
    pytest.importorskip("ray")
    replicas = [FakeReplica("replica-1"), FakeReplica("replica-2")]
    state = tmp_path / "fleet.sqlite"
    first = router_with(replicas, state)

    async def place(router, n):
        await asyncio.gather(*(router.refresh(r.name) for r in replicas))
        return [await router.submit({"prompt": "p", "output": f"o{i}.mp4"}) for i in range(n)]

    placed = [body for _, body, _ in asyncio.run(place(first, 4))]
    first.ledger.records.close()
    # replica-2's process ends while the router is down: a new instance, with none of the old jobs.
    replicas[1].instance, replicas[1].jobs = uuid.uuid4().hex, {}
    second = router_with(replicas, state)

    async def after():
        await asyncio.gather(*(second.refresh(r.name) for r in replicas))
        return [await second.job(p["id"]) for p in placed]

    for (status, rec), sent in zip(asyncio.run(after()), placed):
        assert status == 200 and rec["replica"] == sent["replica"]
        if sent["replica"] == "replica-1":
            assert rec["state"] == "queued" and rec["request"]["output"] in {f"o{i}.mp4" for i in range(4)}
        else:
            assert rec["state"] == "failed" and rec["error"] == ("replica replica-2 was lost (its process ended "
                                                                 "while the router was down) while this job was "
                                                                 "queued")
    second.ledger.records.close()


@pytest.mark.parametrize("flags, message", [
    (["--keep-jobs", "0"], "--keep-jobs must be at least 1, got 0"),
    (["--keep-days", "0"], "--keep-days must be more than 0 (and at most 36500), got 0"),
    (["--max-headers", "2"], "--max-headers must be 8..1000, got 2"),
    (["--max-header-kb", "0"], "--max-header-kb must be 1..1024, got 0"),
    (["--keep-alive-s", "0"], "--keep-alive-s must be 1..3600, got 0"),
    (["--max-connections", "1"], "--max-connections must be 4..100000, got 1"),
    (["--body-timeout-s", "0.5"], "--body-timeout-s must be 1..3600, got 0.5"),
])
def test_bad_record_and_http_flags_are_one_line(tmp_path, capsys, flags, message):
    from h3_spark.cli import main

    assert main(["serve", "--synthetic", "tiny", "--device", "cpu", "--output-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"h3-spark serve: error: {message}\n"
