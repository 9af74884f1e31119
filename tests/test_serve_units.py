"""The service's parts without HTTP or models: request parsing, folders and atomic outputs, the job queue."""

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import re

import pytest

from h3_spark.errors import H3Error, InputError
from h3_spark.h3_model.pipeline.step_cache import CacheOptions
from h3_spark.serve import outputs as outputs_module
from h3_spark.serve.jobs import Job, JobQueue, QueueFull
from h3_spark.serve.outputs import InputFolder, OutputExists, OutputFolder
from h3_spark.serve.validation import Limits, RequestError, parse_request

LIMITS = Limits()


# ------------------------------------------------------------------ request parsing
def test_defaults_and_mode_inference():
    req = parse_request({"prompt": "a cat", "output": "a.mp4"}, LIMITS)
    assert (req.mode, req.frames, req.steps, req.seed, req.width, req.height) == ("t2va", 124, 50, 0, None, None)
    assert req.cache == CacheOptions() and req.attention is None and req.overwrite is False
    assert req.evaluations == 49
    assert parse_request({"prompt": "p", "output": "a.mp4", "last_frame": "k.png"}, LIMITS).mode == "fl2va"
    ref = parse_request({"prompt": "p", "output": "a.mp4", "references": [{"kind": "video", "path": "v.mp4"},
                                                                         {"kind": "audio", "path": "s.wav"}]}, LIMITS)
    assert ref.mode == "ref2va" and ref.references == [("video", "v.mp4"), ("audio", "s.wav")]
    public = ref.public()
    assert public["references"][0] == {"kind": "video", "path": "v.mp4"} and public["cache"]["mode"] == "off"


def test_guides_are_parsed_and_shown():
    req = parse_request({"prompt": "p", "output": "a.mp4", "guides": [
        {"kind": "image", "path": "still.png", "frame": 48}, {"kind": "audio", "path": "s.wav", "frame": -96}],
        "guide_strength": 0.9, "audio_guide_strength": 0.8}, LIMITS)
    assert req.mode == "t2va" and req.guides == [("image", "still.png", 48), ("audio", "s.wav", -96)]
    public = req.public()
    assert public["guides"][1] == {"kind": "audio", "path": "s.wav", "frame": -96} and public["guide_strength"] == 0.9
    assert req.audio_guide_strength == 0.8 and public["audio_guide_strength"] == 0.8


def test_guides_go_with_references_too():
    req = parse_request({"prompt": "<Picture 1> walks", "output": "a.mp4", "references": [
        {"kind": "image", "path": "ref.png"}], "guides": [{"kind": "image", "path": f"g{i}.png", "frame": f}
                                                           for i, f in enumerate((36, 72, 120))]}, LIMITS)
    assert req.mode == "ref2va" and [g[2] for g in req.guides] == [36, 72, 120]


@pytest.mark.parametrize("extra, fragment", [
    ({"guides": [{"kind": "photo", "path": "a.png", "frame": 0}]}, "guides[0].kind must be one of image, clip, audio"),
    ({"guides": [{"kind": "image", "path": "a.png"}]}, "guides[0] must be an object with exactly 'kind', 'path' and 'frame'"),
    ({"guides": [{"kind": "image", "path": "a.png", "frame": 400}]}, "frame must be in -345..344, got 400"),
    ({"guides": [{"kind": "image", "path": "a.png", "frame": 1.5}]}, "frame must be an integer, got 1.5"),
    ({"guides": [{"kind": "image", "path": "a.png", "frame": 0}] * 17}, "guides must be a list of at most 16"),
    # The clip's length is known from the request: a frame past it is refused at once, not when the job runs.
    ({"guides": [{"kind": "image", "path": "a.png", "frame": 124}]},
     "guides[0] (image): frame 124 is outside the 124-frame clip (use 0..123, or -1..-124 from the end)"),
    ({"guides": [{"kind": "audio", "path": "a.wav", "frame": -142}], "frames": 141},
     "guides[0] (audio): frame -142 is outside the 141-frame clip"),
    ({"guide_strength": 0}, "guide_strength is the level conditions are held at, in (0, 1]"),
    ({"guide_strength": True}, "guide_strength is the level conditions are held at, in (0, 1]"),
    ({"audio_guide_strength": 1.5}, "audio_guide_strength is the level conditions are held at, in (0, 1] (1.0 as "
                                    "released), got 1.5"),
])
def test_bad_guides(extra, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)) as err:
        parse_request({"prompt": "p", "output": "a.mp4", **extra}, LIMITS)
    assert err.value.status == 400


def test_films_are_parsed_into_shots():
    req = parse_request({"prompt": "p", "output": "a.mp4", "seconds": 20}, LIMITS)
    assert req.shots == [(480, "p")] and req.is_film
    req = parse_request({"prompt": "p", "output": "a.mp4", "shots": [{"seconds": 2, "prompt": "a"},
                                                                     {"seconds": 3, "prompt": "b"}]}, LIMITS)
    assert req.shots == [(48, "a"), (72, "b")] and req.public()["shots"][1] == {"frames": 72, "prompt": "b"}
    one = parse_request({"prompt": "p", "output": "a.mp4", "seconds": 10}, LIMITS)
    assert not one.is_film and one.frames == 240


@pytest.mark.parametrize("extra, fragment", [
    ({"seconds": 61}, "seconds must be a number of seconds in (0, 60] (this service's longest film), got 61"),
    ({"seconds": "20"}, "seconds must be a number of seconds"),
    ({"seconds": 20, "shots": []}, "seconds and shots both give the length: use one"),
    ({"seconds": 20, "frames": 124}, "frames and seconds / shots both give the length: use one"),
    ({"shots": "a"}, "shots must be a list of 1..32 {seconds, prompt} objects"),
    ({"shots": [{"seconds": 1}]}, "shots[0] must be an object with exactly 'seconds' and 'prompt'"),
    ({"shots": [{"seconds": 40, "prompt": "a"}, {"seconds": 30, "prompt": "b"}]},
     "the shots last 70 s; this service's longest film is 60 s"),
    ({"seconds": 20, "last_frame": "k.png"},
     "a film past one generation (seconds, shots) is made of t2va windows; fl2va takes one generation"),
])
def test_bad_films(extra, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)) as err:
        parse_request({"prompt": "p", "output": "a.mp4", **extra}, LIMITS)
    assert err.value.status == 400


def test_continue_and_repaint_are_parsed():
    req = parse_request({"prompt": "p", "output": "a.mp4", "seconds": 3, "continue": "clip.mp4"}, LIMITS)
    assert req.is_film and req.continue_from == "clip.mp4" and req.public()["continue"] == "clip.mp4"
    req = parse_request({"prompt": "p", "output": "a.mp4", "repaint": "c.mp4", "mask": "m.png",
                         "regenerate_seconds": [1, 2.5]}, LIMITS)
    assert (req.repaint, req.mask, req.regenerate_seconds) == ("c.mp4", "m.png", (1.0, 2.5))
    assert req.public()["regenerate_seconds"] == [1.0, 2.5]


@pytest.mark.parametrize("extra, fragment", [
    ({"continue": "c.mp4"}, "continue needs the new part's length: seconds or shots"),
    ({"mask": "m.png"}, "mask and regenerate_seconds go with repaint"),
    ({"repaint": "c.mp4"}, "repaint needs what to make anew: mask, regenerate_seconds or both"),
    ({"repaint": "c.mp4", "regenerate_seconds": [2, 1]}, "regenerate_seconds must be [start, end] in seconds"),
    ({"repaint": "c.mp4", "mask": "m.png", "frames": 124},
     "repaint keeps its clip's length and canvas: drop frames, width/height, seconds, shots and continue"),
    ({"repaint": "c.mp4", "mask": "m.png", "last_frame": "k.png"}, "fl2va takes no repaint; repainting a clip is t2va"),
])
def test_bad_continues_and_repaints(extra, fragment):
    with pytest.raises(RequestError, match=re.escape(fragment)) as err:
        parse_request({"prompt": "p", "output": "a.mp4", **extra}, LIMITS)
    assert err.value.status == 400


def test_cache_fields_take_the_mode_defaults():
    req = parse_request({"prompt": "p", "output": "a.mp4", "cache_mode": "easycache", "cache_subsample_factor": 4},
                        LIMITS)
    assert req.cache == CacheOptions("easycache", 0.1, 0.2, 0.9, 4)


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "p", "output": "a.mp4", "references": [{"kind": "audio", "path": "s.wav"}]}, "audio-only"),
    ({"prompt": "p", "output": "a.mp4", "references": [{"kind": "image", "path": f"{i}.png"} for i in range(10)]},
     "at most 9 image"),
    ({"prompt": "p", "output": "a.mp4", "references": [{"kind": "image"}]}, "exactly 'kind' and 'path'"),
    ({"prompt": "p", "output": "a.mp4", "references": "a.png"}, "must be a list"),
    ({"prompt": "p", "output": "a.mp4", "mode": "t2va", "first_frame": "k.png"}, "takes no keyframes"),
    ({"prompt": "p", "output": "a.mp4", "mode": "fl2va"}, "first_frame and/or last_frame"),
    ({"prompt": "p", "output": "a.mp4", "mode": "t2va", "references": [{"kind": "image", "path": "a.png"}]},
     "takes no references"),
    ({"prompt": 5, "output": "a.mp4"}, "prompt must be a string, got 5"),
    ({"prompt": "p", "output": ""}, "output must be a non-empty string, got ''"),
    ({"prompt": "", "output": "a.mp4"}, r"t2va needs a prompt: it is all the text encoder reads"),
    ({"prompt": "p"}, "output is required"),
])
def test_refusals(body, fragment):
    with pytest.raises(RequestError, match=fragment) as err:
        parse_request(body, LIMITS)
    assert err.value.status == 400


def test_an_empty_prompt_is_taken_with_keyframes_or_references():
    assert parse_request({"prompt": "", "output": "a.mp4", "last_frame": "k.png"}, LIMITS).prompt == ""
    ref = parse_request({"prompt": "", "output": "a.mp4", "references": [{"kind": "image", "path": "a.png"}]}, LIMITS)
    assert (ref.mode, ref.prompt) == ("ref2va", "")
    # Whitespace is a prompt: it reaches the text encoder as its own tokens, as in the reference pipeline.
    assert parse_request({"prompt": "  ", "output": "a.mp4"}, LIMITS).prompt == "  "


def test_limits_are_checked():
    with pytest.raises(H3Error, match="max steps"):
        Limits(max_steps=1)
    with pytest.raises(H3Error, match="positive"):
        Limits(max_body_bytes=0)
    with pytest.raises(RequestError, match="2..8"):
        parse_request({"prompt": "p", "output": "a.mp4", "steps": 9}, Limits(max_steps=8))


# ------------------------------------------------------------------ folders
def test_a_missing_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        OutputFolder(tmp_path / "nope")


def test_input_files_are_checked_for_type_existence_and_size(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.wav").write_bytes(b"x" * 100)
    folder = InputFolder(tmp_path, max_file_bytes=50)
    assert folder.media("a.png", "image") == tmp_path / "a.png"
    with pytest.raises(RequestError, match="must be one of"):
        folder.media("a.png", "audio")
    with pytest.raises(RequestError, match="no such file") as err:
        folder.media("c.png", "image")
    assert err.value.status == 400
    with pytest.raises(RequestError, match="limit") as err:
        folder.media("sub/b.wav", "audio")
    assert err.value.status == 413


def test_outputs_are_reserved_per_job_until_released(tmp_path):
    folder = OutputFolder(tmp_path)
    path = folder.reserve("a.mp4", False, "job1")
    with pytest.raises(OutputExists, match="job1"):
        folder.reserve("a.mp4", True, "job2")
    folder.release(path)
    assert folder.reserve("a.mp4", False, "job2") == path


def _fake_stream(calls, fail: bool = False):
    class Stream:  # stands in for media.Mp4Stream: writes its bytes at finish
        def __init__(self, path):
            self.path, self.finished = path, False
            calls.append(path)

        def add(self, video):
            pass

        def finish(self, audio):
            self.path.write_bytes(b"half" if fail else b"mp4 bytes")
            if fail:
                raise InputError("encoder died")
            self.finished = True

        def abort(self):
            pass

    return Stream


def _write_mp4(folder, path, job_id, *, overwrite):
    with folder.mp4_stream(path, job_id, overwrite=overwrite) as stream:
        stream.add(None)
        stream.finish(None)
    return path


def test_outputs_are_written_under_a_temporary_name_then_moved(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream(calls))
    folder = OutputFolder(tmp_path)
    final = _write_mp4(folder, tmp_path / "clip.mp4", "j1", overwrite=False)
    assert final.read_bytes() == b"mp4 bytes"
    assert calls[0].parent == tmp_path and calls[0].name == ".j1.partial.mp4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]

    # A file that appeared while the job ran is not replaced without overwrite; nothing is left over.
    with pytest.raises(OutputExists, match="already exists"):
        _write_mp4(folder, tmp_path / "clip.mp4", "j2", overwrite=False)
    (tmp_path / "clip.mp4").write_bytes(b"old")
    assert _write_mp4(folder, tmp_path / "clip.mp4", "j3", overwrite=True).read_bytes() == b"mp4 bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


def test_a_symlink_planted_after_acceptance_is_refused_at_write_time(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream([]))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sub").mkdir()
    folder = OutputFolder(out)
    path = folder.reserve("sub/clip.mp4", False, "j1")
    (out / "sub").rmdir()
    (out / "sub").symlink_to(elsewhere)
    with pytest.raises(RequestError, match="leads outside"):
        _write_mp4(folder, path, "j1", overwrite=False)
    assert not any(elsewhere.iterdir())


def test_a_symlink_planted_while_the_job_writes_is_refused_before_the_move(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream([]))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    folder = OutputFolder(out)
    path = folder.reserve("clip.mp4", False, "j1")
    with pytest.raises(RequestError, match="leads outside"):
        with folder.mp4_stream(path, "j1", overwrite=True) as stream:
            stream.add(None)
            (out / "clip.mp4").symlink_to(elsewhere / "target.mp4")
            stream.finish(None)
    assert not any(elsewhere.iterdir())
    assert sorted(p.name for p in out.iterdir()) == ["clip.mp4"]  # the planted link only, no partial file


def test_output_names_the_file_system_would_refuse_are_400(tmp_path):
    folder = OutputFolder(tmp_path)
    with pytest.raises(RequestError, match="longer than 255 bytes") as err:
        folder.check("a" * 252 + ".mp4", False)
    assert err.value.status == 400
    folder.check("a" * 251 + ".mp4", False)  # 255 bytes: fine, and the temporary name is short
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(RequestError, match="cannot be resolved|leads outside") as err:
        folder.check("loop/clip.mp4", False)
    assert err.value.status == 400
    with pytest.raises(RequestError, match="not valid Unicode"):
        folder.check("\ud800.mp4", False)  # a lone surrogate, as JSON can carry


def test_the_temporary_file_is_removed_when_muxing_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream([], fail=True))
    with pytest.raises(InputError, match="encoder died"):
        _write_mp4(OutputFolder(tmp_path), tmp_path / "clip.mp4", "j1", overwrite=False)
    assert not any(tmp_path.iterdir())


def test_a_file_that_appears_while_the_job_streams_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream([]))
    folder = OutputFolder(tmp_path)
    with pytest.raises(OutputExists, match="already exists"):
        with folder.mp4_stream(tmp_path / "clip.mp4", "j1", overwrite=False) as stream:
            (tmp_path / "clip.mp4").write_bytes(b"someone else's")
            stream.finish(None)
    assert (tmp_path / "clip.mp4").read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
    with pytest.raises(InputError, match="the mp4 was not finished"):
        with folder.mp4_stream(tmp_path / "new.mp4", "j2", overwrite=False):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


# What a writer in another process does: hold the flock until told to stop (stdin closed).
_LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_the_sweep_removes_only_partials_that_no_live_process_writes(tmp_path):
    pytest.importorskip("fcntl")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    dead = out / "sub" / f".{uuid.uuid4().hex}.partial.mp4"  # its writer died: nothing holds the lock
    live = out / f".{uuid.uuid4().hex}.partial.mp4"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    hex_id = uuid.uuid4().hex
    # Names a user or another program may have made; only `.<job id>.partial.mp4` is the service's.
    lookalikes = ["clip.partial.mp4", f"{hex_id}.partial.mp4", ".clip.partial.mp4", f".{hex_id}.partial.mp4.bak",
                  f".{hex_id.upper()}.partial.mp4", f".{hex_id}.partial.mov"]
    for name in lookalikes:
        (out / name).write_bytes(b"the user's")
    elsewhere = tmp_path / "elsewhere.mp4"
    elsewhere.write_bytes(b"not in the folder")
    link = out / f".{uuid.uuid4().hex}.partial.mp4"
    link.symlink_to(elsewhere)
    folder_named_so = out / f".{uuid.uuid4().hex}.partial.mp4"
    folder_named_so.mkdir()

    folder = OutputFolder(out)
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(live)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        removed = folder.sweep_partials()
        assert [p.relative_to(folder.root).as_posix() for p in removed] == [f"sub/{dead.name}"]
        assert not dead.exists() and live.read_bytes() == b"half"
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert all((out / name).read_bytes() == b"the user's" for name in lookalikes)
    assert link.is_symlink() and elsewhere.read_bytes() == b"not in the folder" and folder_named_so.is_dir()

    # Its writer gone, the same file is a leftover like any other.
    assert [p.name for p in folder.sweep_partials()] == [live.name]
    assert not live.exists()


def test_a_job_holds_its_partial_against_a_sweep_and_leaves_none(tmp_path, monkeypatch):
    pytest.importorskip("fcntl")
    calls = []
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream(calls))
    job = Job("request")  # a real job id: the sweep knows a partial by the shape of its name
    folder = OutputFolder(tmp_path)
    with folder.mp4_stream(tmp_path / "clip.mp4", job.id, overwrite=False) as stream:
        stream.add(None)
        partial = calls[0]
        assert partial.name == outputs_module.partial_name(job.id) and outputs_module.PARTIAL.fullmatch(partial.name)
        # A service starting beside this one (its own open of the file, as another process would have).
        assert OutputFolder(tmp_path).sweep_partials() == [] and partial.is_file()
        stream.finish(None)
        assert OutputFolder(tmp_path).sweep_partials() == [] and partial.is_file()
    assert (tmp_path / "clip.mp4").read_bytes() == b"mp4 bytes"
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4"]


def test_without_fcntl_nothing_is_swept_and_outputs_are_still_written(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs_module, "fcntl", None)
    monkeypatch.setattr(outputs_module.media, "Mp4Stream", _fake_stream([]))
    stale = tmp_path / f".{uuid.uuid4().hex}.partial.mp4"
    stale.write_bytes(b"half")
    folder = OutputFolder(tmp_path)
    assert folder.sweep_partials() is None and stale.read_bytes() == b"half"
    _write_mp4(folder, tmp_path / "clip.mp4", Job("request").id, overwrite=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["clip.mp4", stale.name])


# ------------------------------------------------------------------ the queue
class Gate:
    """A runner whose jobs wait for the test to let them finish."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, job):
        self.started.set()
        assert self.release.wait(30)
        if job.request == "boom":
            raise RuntimeError("boom")
        return ("bogus", None) if job.request == "bogus" else ("done", None)


def _wait(queue, job, states=("done", "failed", "cancelled")):
    deadline = time.monotonic() + 30
    while queue.snapshot(job.id)["state"] not in states:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return queue.snapshot(job.id)


def test_queue_bounds_cancels_and_survives_a_bad_runner():
    gate = Gate()
    finished = []
    queue = JobQueue(2, gate, on_finish=finished.append)
    queue.start()
    try:
        first = queue.submit(Job("boom"))
        assert gate.started.wait(30)
        second, third = queue.submit(Job("bogus")), queue.submit(Job("ok"))
        with pytest.raises(QueueFull) as err:
            queue.submit(Job("too many"))
        assert err.value.status == 429 and err.value.headers == {"Retry-After": "10"}
        assert queue.stats() == {"capacity": 2, "queued": 2, "running": first.id}

        assert queue.cancel(third.id)["state"] == "cancelled"
        assert finished == [third]
        gate.release.set()
        assert _wait(queue, first)["error"] == "internal error: RuntimeError: boom"
        assert "runner ended the job in state 'bogus'" in _wait(queue, second)["error"]
        with pytest.raises(RequestError, match="already ended") as err:
            queue.cancel(first.id)
        assert err.value.status == 409
        with pytest.raises(KeyError):
            queue.cancel("nope")
        after = queue.submit(Job("ok"))
        assert _wait(queue, after)["state"] == "done"
        assert queue.retry_after() == 1  # the jobs so far took well under a second
        queue._durations.clear()
        queue._durations.extend([2.5, 7.1])
        assert queue.retry_after() == 5  # their mean, rounded up
    finally:
        queue.stop()


def test_finished_records_are_bounded():
    queue = JobQueue(8, lambda job: ("done", None), keep_finished=2)
    queue.start()
    try:
        jobs = [queue.submit(Job(str(i))) for i in range(4)]
        _wait(queue, jobs[-1])
        assert [j["id"] for j in queue.list()] == [j.id for j in jobs[2:]]
    finally:
        queue.stop()


def test_stop_cancels_what_waits_and_asks_the_running_job_to_stop():
    seen = threading.Event()

    def runner(job):
        seen.set()
        assert job.cancel.wait(30)
        return "cancelled", "stopped"

    queue = JobQueue(4, runner)
    queue.start()
    running = queue.submit(Job("a"))
    assert seen.wait(30)
    waiting = queue.submit(Job("b"))
    queue.stop()
    assert queue.snapshot(running.id)["state"] == "cancelled"
    assert queue.snapshot(waiting.id)["error"] == "the service is shutting down"
    with pytest.raises(RequestError, match="shutting down"):
        queue.submit(Job("c"))


def test_component_loader_names_the_components():
    from h3_spark.h3_model.engine.loading import LoadOptions, component_loader

    with pytest.raises(InputError, match="unknown component 'unet'; components are dit, dit_ref, text_encoder"):
        component_loader("unet", Path("."), LoadOptions())
    assert callable(component_loader("vae", Path("nowhere"), LoadOptions()))  # nothing is read until called


def test_jobs_decode_inputs_within_the_pixel_limits(tmp_path):
    """A job's images are refused past Limits.max_image_pixels, its videos past max_video_frame_pixels."""
    import numpy as np
    from PIL import Image

    from h3_spark.serve.execute import _read_inputs

    Image.fromarray(np.full((40, 60, 3), 9, np.uint8)).save(tmp_path / "key.png")
    req = parse_request({"prompt": "a cat", "output": "o.mp4", "first_frame": "key.png"}, Limits())

    def message(**limits):
        return {"request": req, "references": [], "first_frame": str(tmp_path / "key.png"), "last_frame": None,
                "max_image_pixels": limits.get("image", 2400), "max_video_frame_pixels": 1}

    _, first, last = _read_inputs(message())
    assert first.shape == (40, 60, 3) and last is None
    with pytest.raises(InputError, match="the image is 60x40, over the limit of 2399 pixels"):
        _read_inputs(message(image=2399))
    req.references = [("image", str(tmp_path / "key.png"))]
    with pytest.raises(InputError, match="over the limit of 2399 pixels"):
        _read_inputs({**message(image=2399), "first_frame": None, "references": req.references})


def test_recipes_are_parsed_and_shown_in_the_record():
    req = parse_request({"prompt": "p", "output": "a.mp4", "recipes": ["turbo:evaluations=4", "first-block-cache"]},
                        LIMITS)
    assert [r.name for r in req.recipes] == ["turbo", "first-block-cache"] and req.steps == 5
    # A FastH3 grid sets the evaluations too: the record shows the ones the job runs.
    assert parse_request({"prompt": "p", "output": "a.mp4", "recipes": ["fasth3-8step"]}, LIMITS).steps == 9
    assert parse_request({"prompt": "p", "output": "a.mp4", "recipes": ["fasth3"]}, LIMITS).steps == 5
    assert req.public()["recipes"][0] == {"name": "turbo", "evaluations": 4, "video_shift": 6.0, "audio_shift": 3.0}


@pytest.mark.parametrize("body, fragment", [
    ({"recipes": "turbo"}, "recipes must be a list of at most 4 recipe names"),
    ({"recipes": ["turbo"] * 5}, "recipes must be a list of at most 4"),
    ({"recipes": ["zoom"]}, "unknown recipe 'zoom'"),
    ({"recipes": ["turbo"], "steps": 20}, "recipe turbo sets the steps and the video shift: drop steps"),
    ({"recipes": ["first-block-cache"], "cache_mode": "easycache"}, "drop cache_mode"),
    ({"recipes": ["turbo:evaluations=60"]}, "recipe turbo: 60 evaluations exceed this service's"),
])
def test_recipe_refusals(body, fragment):
    with pytest.raises(RequestError, match=fragment) as err:
        parse_request({"prompt": "p", "output": "a.mp4", **body}, Limits(max_steps=50))
    assert err.value.status == 400


# ------------------------------------------------------------------ readiness
def test_ready_reports_host_memory_while_loading_and_once_ready(tmp_path, monkeypatch):
    """/ready's body carries the host memory beside the GPU's `memory`, also while loading (when it peaks): the
    process's peak resident set and, in a cgroup v2 (a fake tree here), the cgroup's limit, peak and count."""
    from h3_spark.h3_model.engine import host_memory
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.serve.service import Service, ServiceConfig

    (tmp_path / "cgroup" / "h3").mkdir(parents=True)
    for name, count in (("max", 64 * 10 ** 9), ("peak", 3_210_000_000), ("current", 1_230_000_000)):
        (tmp_path / "cgroup" / "h3" / f"memory.{name}").write_text(f"{count}\n")
    (tmp_path / "proc_cgroup").write_text("0::/h3\n")
    monkeypatch.setattr(host_memory, "PROC_CGROUP", tmp_path / "proc_cgroup")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", tmp_path / "cgroup")
    cgroup = {"path": "/h3", "limit_gb": 64.0, "peak_gb": 3.21, "current_gb": 1.23}

    (tmp_path / "out").mkdir()
    # An engine holding nothing: /ready's own fields are what is tested, not the models.
    service = Service(ServiceConfig(output_dir=tmp_path / "out"), lambda tracker: Engine(), log=lambda m: None)
    ok, body = service.ready()  # not started: still loading
    assert not ok and body["host_memory"]["cgroup"] == cgroup
    assert body["peak_host_memory_gb"] == body["host_memory"]["peak_rss_gb"] > 0
    service.start()
    try:
        assert service.wait_loaded(30)
        ok, body = service.ready()
    finally:
        service.stop()
    assert ok and body["memory"]["device"] == "cpu" and body["host_memory"]["cgroup"] == cgroup
    assert body["host_memory"]["rss_gb"] > 0 and body["peak_host_memory_gb"] >= body["host_memory"]["rss_gb"]


@pytest.mark.parametrize("body,message", [
    ({"prompt": "<Picture 3> dances", "references": [{"kind": "image", "path": "a.png"}]},
     "the prompt names <Picture 3>, but this request gives 1 image reference (<Picture 1>)"),
    ({"prompt": "<Picture 1> waves"}, "the prompt names <Picture 1>, but this request gives no image reference "
                                      "(t2va takes none)"),
    ({"prompt": "<Video 2> plays", "references": [{"kind": "video", "path": "v.mp4"}]},
     "the prompt names <Video 2>, but this request gives 1 video reference (<Video 1>)"),
    ({"prompt": "<Picture 2> ends it", "first_frame": "a.png"},
     "the prompt names <Picture 2>, but this request gives 1 keyframe (<Picture 1>)"),
    ({"prompt": "<Audio 3> hums", "references": [{"kind": "image", "path": "a.png"}, {"kind": "audio", "path": "a.wav"},
                                                 {"kind": "video", "path": "v.mp4"}]},
     "the prompt names <Audio 3>, but this request gives 2 audio references (<Audio 1>..<Audio 2>)"),
])
def test_reference_mentions_are_checked_at_submit(body, message):
    """A prompt naming a reference the request does not give is refused before it is queued (400), not by the
    worker after it took the job."""
    import re

    with pytest.raises(RequestError, match="^" + re.escape(message) + "$") as caught:
        parse_request({"output": "a.mp4", **body}, LIMITS)
    assert caught.value.status == 400


def test_a_soundtrack_mention_the_submit_cannot_see_yet_is_taken():
    """<Audio 2> with one audio reference and one video: the video may bring a soundtrack, so the submit takes it
    (the job checks the exact count once it has read the video)."""
    refs = [{"kind": "audio", "path": "a.wav"}, {"kind": "video", "path": "v.mp4"}]
    assert parse_request({"prompt": "<Audio 2> and <Video 1>", "output": "a.mp4", "references": refs},
                         LIMITS).mode == "ref2va"
