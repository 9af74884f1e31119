"""A continued clip is read by its tail: `read_video_tail` gives read_video's last frames and the same sound while
holding only a few frames, `head()` gives the frames before them again, and `generate --continue` on a long clip
keeps its memory near a short clip's (the clip streams through into the output)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.compose.film import ContinuedClip
from h3_spark.h3_model.media import files as media

av = pytest.importorskip("av")


def _clip(path, frames, *, size=(48, 80), fps=24, audio=True, seed=0):
    """A clip whose frames differ from each other (a moving random texture) with a sine under it."""
    h, w = size
    texture = torch.randint(0, 256, (h, w * 2, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    pixels = torch.stack([texture[:, (3 * i) % w:(3 * i) % w + w] for i in range(frames)])
    sound = None
    if audio:
        t = torch.arange(round(frames / fps * 32000)) / 32000
        sound = torch.stack([torch.sin(2 * math.pi * 330 * t), torch.cos(2 * math.pi * 220 * t)]) * 0.5
    media.write_mp4(path, pixels, sound, fps=fps)
    return path


@pytest.mark.parametrize("fps, max_frames", [(24, None), (30, None), (24, 50), (18, 40)])
def test_the_tail_and_head_are_read_videos_frames(tmp_path, fps, max_frames):
    path = _clip(tmp_path / "clip.mp4", 75, fps=fps)
    whole = media.read_video(path, max_frames=max_frames)
    tail = media.read_video_tail(path, 23, max_frames=max_frames)
    assert tail.total_frames == whole.frames.shape[0]
    assert torch.equal(tail.frames, whole.frames[-23:])
    assert torch.equal(tail.audio, whole.audio)
    head = list(tail.head())
    assert all(1 <= c.shape[0] <= tail.chunk_frames for c in head)
    assert torch.equal(torch.cat(head), whole.frames[:-23])
    assert media.video_geometry(path, max_frames=max_frames) == (whole.frames.shape[0], 80, 48)


def test_a_clip_shorter_than_the_tail_is_all_tail(tmp_path):
    path = _clip(tmp_path / "short.mp4", 10, audio=False)
    tail = media.read_video_tail(path, 23)
    assert tail.total_frames == 10 and tail.frames.shape[0] == 10 and tail.audio is None
    assert list(tail.head()) == []
    continued = ContinuedClip.from_tail(tail)
    assert continued.head is None and continued.total_frames == 10


def test_a_continued_clip_that_lies_about_its_head_is_refused():
    frames = torch.zeros(4, 8, 8, 3, dtype=torch.uint8)
    with pytest.raises(InputError, match="a continued clip of 10 frames holds its last 4: the frames before them "
                                         "come from head"):
        ContinuedClip(frames, None, length=10)
    with pytest.raises(InputError, match="a continued clip of 3 frames holds its last 4"):
        ContinuedClip(frames, None, length=3)


def test_a_tail_of_no_frames_is_refused(tmp_path):
    path = _clip(tmp_path / "clip.mp4", 10, audio=False)
    with pytest.raises(InputError, match="a video's tail is at least one frame, got 0"):
        media.read_video_tail(path, 0)


def test_a_continued_clip_streams_through_into_the_film(tmp_path):
    """render_film writes the head, then the tail, then the windows: the output starts with the whole clip."""
    from h3_spark.h3_model.compose.film import Shot, plan_request, render_film
    from h3_spark.h3_model.pipeline.generation import GenerationRequest

    path = _clip(tmp_path / "clip.mp4", 60)
    whole = media.read_video(path)
    continued = ContinuedClip.from_tail(media.read_video_tail(path, 23))
    film = plan_request([Shot("go on", 24)], [], width=None, height=None, continued=continued)
    assert (film.width, film.height) == (80, 48) and film.plan.first_frame == 60

    class _Result:
        def __init__(self, request):
            n = request.frames
            self.video = torch.full((n, 48, 80, 3), 7, dtype=torch.uint8)
            self.audio = torch.zeros(2, round(n / 24 * 32000) + 4000)
            self.timings, self.info = {}, {}

    written = []
    base = GenerationRequest(mode="t2va", prompt="go on", width=80, height=48, frames=24, steps=2)
    result = render_film(_Result, base, film, on_frames=written.append)
    out = torch.cat(written)
    assert result.frames == out.shape[0] == 84 and result.info["width"] == 80 and result.info["height"] == 48
    assert torch.equal(out[:60], whole.frames)
    assert torch.equal(result.audio[:, :whole.audio.shape[1]], whole.audio[:, :result.audio.shape[1]])


_PEAK = r"""
import json, resource, sys
from h3_spark.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _continue_peak(demo_models, clip, out):
    argv = ["generate", "--demo", "--demo-dir", str(demo_models), "--width", "256", "--height", "256",
            "--steps", "2", "--continue", str(clip), "--seconds", "1", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, timeout=600,
                          env={"H3_MODULATION_FUSION": "off", "H3_Q_RMS_ROPE_INT8_FUSION": "off",
                               "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    summary, peak = json.loads(lines[-2]), json.loads(lines[-1])
    assert peak["code"] == 0
    return summary, peak["peak_rss_kb"] * 1024


@pytest.mark.slow
def test_continuing_a_long_clip_holds_about_what_a_short_one_does(demo_models, tmp_path):
    """40 s of 256x256 is 189 MB of frames; read whole (as before) the peak grew by more than that. Now the long
    clip's peak stays within 40 MB of a 2 s clip's (measured: see the report in docs/compose.md)."""
    short, long_ = _clip(tmp_path / "short.mp4", 48, size=(256, 256)), _clip(tmp_path / "long.mp4", 960,
                                                                               size=(256, 256), seed=1)
    frame_bytes = 960 * 256 * 256 * 3
    s_summary, s_peak = _continue_peak(demo_models, short, tmp_path / "a.mp4")
    l_summary, l_peak = _continue_peak(demo_models, long_, tmp_path / "b.mp4")
    assert (s_summary["continued_frames"], l_summary["continued_frames"]) == (48, 960)
    info = media.probe(tmp_path / "b.mp4")
    assert info["frames"] == 984 and info["audio_duration"] == pytest.approx(41.0, abs=1e-3)
    # The copied-through head is the clip's own frames (x264 round trip: compare to the clip as decoded).
    # A random texture loses about 7 levels in a second x264 pass; a frame off by one differs by about 80.
    first = media.read_video(tmp_path / "b.mp4", max_frames=25, with_audio=False).frames.float()
    clip = media.read_video(long_, max_frames=25, with_audio=False).frames.float()
    assert (first[:24] - clip[:24]).abs().mean() < 12.0 < 40.0 < (first[:24] - clip[1:]).abs().mean()
    print(f"peak RSS: 2 s clip {s_peak / 2**20:.1f} MiB, 40 s clip {l_peak / 2**20:.1f} MiB; "
          f"frames {frame_bytes / 2**20:.1f} MiB")
    assert l_peak - s_peak < 40 * 2**20, (s_peak, l_peak)
    assert np.isfinite(l_peak)
