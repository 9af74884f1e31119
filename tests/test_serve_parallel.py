"""`h3-spark serve --gpus 2` on the CPU (torchrun, gloo): one job over two ranks, a collective cancel, shutdown.

The service runs as a real subprocess (it relaunches itself under torchrun) on the tiny demo models. Its
output is compared with a one-process `h3-spark generate` of the same request; then a long job is
cancelled mid-sampling and a further job (with a per-job attention backend) must still run, which it only
does when both ranks stopped at the same block; then SIGTERM must end the service and both ranks.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from ports import free_port  # noqa: E402

PROMPT = "A cat plays the piano."
JOB = {"prompt": PROMPT, "width": 64, "height": 64, "frames": 124, "steps": 3, "seed": 1}
ENV = {"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off", "OMP_NUM_THREADS": "1"}


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's ranks run in sessions of their own, out of the test's reach)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_ready(client, proc, log_path, timeout=180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            r = client.get("/ready")
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout} s:\n{log_path.read_text()[-4000:]}")


def _wait_job(client, job_id, check, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/jobs/{job_id}").json()
        if check(body):
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job_id}: {body}")


def _submit(client, **fields) -> str:
    r = client.post("/generate", json={**JOB, **fields})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _ended(body) -> bool:
    return body["state"] in ("done", "failed", "cancelled")


def _lockstep_worker(rank, port, queue):
    import threading

    import torch.distributed as dist

    from h3_spark.errors import H3Error
    from h3_spark.serve.lockstep import Lockstep, LockstepCancel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seen = {}
    try:
        lockstep = Lockstep.join(rank, 2, "cpu")
        try:  # rank 1 alone fails to prepare: both ranks drop the job
            lockstep.agree(OSError("disk gone") if rank else None, "same", "prepare job j")
        except Exception as exc:  # noqa: BLE001
            seen["one_failed"] = f"{type(exc).__name__}: {exc}"
        try:  # both prepared, but read different bytes
            lockstep.agree(None, f"bytes of rank {rank}", "prepare job k")
        except H3Error as exc:
            seen["different"] = str(exc)
        seen["agreed"] = lockstep.agree(None, "same")
        flag = threading.Event()
        seen["cancel_unset"] = LockstepCancel(flag if rank == 0 else None).is_set()
        flag.set()
        seen["cancel_set"] = LockstepCancel(flag if rank == 0 else None).is_set()
        if rank == 0:
            lockstep.send({"id": "j"})
            lockstep.send(None)
        else:
            seen["messages"] = [lockstep.receive(), lockstep.receive()]
        queue.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_lockstep_agreement_and_collective_cancel():
    """A failure on one rank fails the job on every rank; rank 0's cancel flag reaches every rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_lockstep_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        seen = dict(queue.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert seen[0]["one_failed"] == "H3Error: rank 1 could not prepare job j: OSError: disk gone"
    assert seen[1]["one_failed"] == "OSError: disk gone"  # a rank re-raises its own error
    for rank in (0, 1):
        assert "read different inputs" in seen[rank]["different"]
        assert seen[rank]["agreed"] == ["same", "same"]
        assert seen[rank]["cancel_unset"] is False and seen[rank]["cancel_set"] is True
    assert seen[1]["messages"] == [{"id": "j"}, None]


def test_serve_gpus_2_runs_cancels_and_shuts_down(tmp_path):
    from h3_spark.h3_model.media import files as media
    from h3_spark.h3_model.engine.demo import build_demo_models
    from h3_spark.h3_model.text.torchvision_compat import ensure_importable

    if not ensure_importable():
        pytest.skip("the Qwen3-VL processors need torchvision")
    if not os.path.isdir("/proc/self"):
        pytest.skip("the orphan check reads /proc")
    models = build_demo_models(tmp_path / "demo")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, **ENV}
    port = free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "h3_spark.cli", "serve", "--gpus", "2", "--device", "cpu", "--models", str(models),
           "--text-encoder-layer", "2", "--output-dir", str(out), "--port", str(port), "--log-level", "warning"]
    ranks: list[int] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            ready = _wait_ready(client, proc, log_path)
            ranks = _descendants(proc.pid)
            assert ready["world_size"] == 2 and ready["devices"] == ["cpu", "cpu"], ready
            dit = ready["models"]["dit"]
            assert dit["class"] == "H3DiT" and dit["sequence_parallel"] == 2 and dit["parameter_bytes"] > 0

            # One job over both ranks, against one process running the same request.
            done = _wait_job(client, _submit(client, output="two.mp4"), _ended)
            assert done["state"] == "done", done
            single = tmp_path / "one.mp4"
            run = subprocess.run([sys.executable, "-m", "h3_spark.cli", "generate", "--demo", "--demo-dir", str(models),
                                  "--quiet", "--device", "cpu", "--prompt", PROMPT, "--steps", "3", "--seed", "1",
                                  "--width", "64", "--height", "64", "--frames", "124", "--out", str(single)],
                                 capture_output=True, text=True, env=env, timeout=300)
            assert run.returncode == 0, run.stderr[-2000:]
            two = out / "two.mp4"
            assert done["output"] == str(two)
            info, expected = media.probe(two), media.probe(single)
            for key in ("width", "height", "frames", "fps", "channels", "sample_rate"):
                assert info[key] == expected[key], key
            assert (info["width"], info["height"], info["frames"]) == (64, 64, 124)
            assert abs(info["duration"] - expected["duration"]) < 0.05
            a, b = media.read_video(two), media.read_video(single)
            assert (a.frames.float() - b.frames.float()).abs().mean().item() <= 1.0
            assert (a.audio - b.audio).abs().mean().item() <= 0.01

            # Cancel mid-sampling: both ranks must stop at the same block ...
            long = _submit(client, output="long.mp4", steps=100)
            _wait_job(client, long, lambda b: b["progress"]["stage"] == "sampling" and b["progress"]["step"] >= 1)
            assert client.delete(f"/jobs/{long}").status_code == 202
            cancelled = _wait_job(client, long, _ended)
            assert cancelled["state"] == "cancelled", cancelled
            assert not (out / "long.mp4").exists()
            # ... or the next job's collectives would not line up.
            after = _wait_job(client, _submit(client, output="after.mp4", seed=2, attention="sdpa"), _ended)
            assert after["state"] == "done", after
            assert after["backends"]["attention"]["requested"] == "sdpa"
            assert media.probe(out / "after.mp4")["frames"] == 124

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        text = log_path.read_text()
        assert "rank 0 shut the service down" in text, text[-4000:]
        # The follower's own record of the cancel (inside a step, or between two when it lands there).
        assert re.search(r"cancelled (during|before) step", text), text[-4000:]
        assert len(ranks) >= 2, ranks
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ranks if _alive(pid)], "a rank outlived the service"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in ranks + _descendants(proc.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
