"""Media I/O: real small files written with PyAV into tmp_path, read back, resampled, muxed, probed."""

from __future__ import annotations

import os
import re

import av
import numpy as np
import pytest
import torch

from h3_spark.h3_model.media import files as media
from h3_spark.errors import InputError
from h3_spark.h3_model.media.resample import resample


def write_image(path, array: np.ndarray, codec: str) -> None:
    with av.open(str(path), "w", format="image2") as out:
        stream = out.add_stream(codec)
        stream.width, stream.height = array.shape[1], array.shape[0]
        stream.pix_fmt = {"png": "rgb24", "mjpeg": "yuvj444p", "libwebp": "yuv420p"}[codec]
        if codec == "libwebp":
            stream.options = {"lossless": "1"}
        out.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        out.mux(stream.encode())


def write_audio(path, samples: np.ndarray, rate: int, codec: str, container: str | None = None) -> None:
    """samples: float32 (channels, n) in [-1, 1]."""
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        fmt = stream.codec_context.format.name
        data = samples if fmt.endswith("p") else samples.T.reshape(1, -1)
        if fmt.startswith("s16"):
            data = (data * 32767).astype(np.int16)
        elif fmt.startswith("s32"):
            data = (data * 2147483647).astype(np.int32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=fmt, layout=layout)
        frame.sample_rate, frame.pts = rate, 0
        out.mux(stream.encode(frame))
        out.mux(stream.encode())


def write_video(path, frames: np.ndarray, fps: int, audio: np.ndarray | None = None, rate: int = 48000) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "0"}
        sound = out.add_stream("aac", rate=rate, layout="stereo") if audio is not None else None
        for array in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        out.mux(stream.encode())
        if sound is not None:
            frame = av.AudioFrame.from_ndarray(audio, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = rate, 0
            out.mux(sound.encode(frame))
            out.mux(sound.encode())


def numbered_frames(count: int, height: int = 24, width: int = 32) -> np.ndarray:
    """Flat frames whose grey level encodes their index (4 levels apart, robust to H.264)."""
    return np.stack([np.full((height, width, 3), 4 * i, dtype=np.uint8) for i in range(count)])


def frame_ids(frames: torch.Tensor) -> list[int]:
    return [round(v / 4) for v in frames[:, :, :, 0].float().mean(dim=(1, 2)).tolist()]


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * (440 + 110 * c) * t) for c in range(channels)]).astype(np.float32)


# ---- images ----------------------------------------------------------------------------------


def test_png_reads_back_exactly(tmp_path):
    array = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    write_image(tmp_path / "a.png", array, "png")
    image = media.read_image(tmp_path / "a.png")
    assert image.dtype == torch.uint8 and image.shape == (20, 30, 3)
    assert torch.equal(image, torch.from_numpy(array))


@pytest.mark.parametrize("suffix, codec, tolerance", [(".jpg", "mjpeg", 12), (".webp", "libwebp", 0)])
def test_jpg_and_webp_read_as_rgb(tmp_path, suffix, codec, tolerance):
    array = np.zeros((16, 24, 3), dtype=np.uint8)
    array[:, :12] = (200, 40, 90)
    array[:, 12:] = (10, 180, 250)
    write_image(tmp_path / f"a{suffix}", array, codec)
    image = media.read_image(tmp_path / f"a{suffix}")
    assert image.shape == (16, 24, 3)
    assert (image[:, 2:10].int() - torch.tensor([200, 40, 90])).abs().max() <= max(tolerance, 3)


# ---- video -----------------------------------------------------------------------------------


def test_resample_frame_indices_drop_and_hold():
    # Slots round(i * 0.8) are 0, 1, 2, 2, 3: frame 2 loses its slot to frame 3 (the oracle's rule).
    assert media.resample_frame_indices(5, 30.0).tolist() == [0, 1, 3, 4]
    assert media.resample_frame_indices(4, 12.0).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert media.resample_frame_indices(6, 24.0).tolist() == list(range(6))


def test_30fps_video_is_resampled_to_24fps_with_its_soundtrack(tmp_path):
    audio = np.random.default_rng(1).uniform(-0.3, 0.3, (2, 96000)).astype(np.float32)
    write_video(tmp_path / "a.mp4", numbered_frames(60), 30, audio, 48000)
    clip = media.read_video(tmp_path / "a.mp4")
    assert clip.source_fps == 30.0 and clip.fps == 24.0
    assert clip.frames.shape == (48, 24, 32, 3)
    assert frame_ids(clip.frames) == media.resample_frame_indices(60, 30.0).tolist()
    assert clip.audio.shape == (2, 64000) and clip.sample_rate == 32000  # 2 s at 32 kHz


def test_12fps_webm_duplicates_frames_and_max_frames_truncates(tmp_path):
    with av.open(str(tmp_path / "a.webm"), "w") as out:
        stream = out.add_stream("libvpx-vp9", rate=12)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        stream.options = {"lossless": "1"}
        for array in numbered_frames(10):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        out.mux(stream.encode())
    clip = media.read_video(tmp_path / "a.webm", max_frames=7)
    assert clip.audio is None
    assert frame_ids(clip.frames) == [0, 0, 1, 1, 2, 2, 3]


def test_max_frames_decodes_only_the_frames_shown(tmp_path, monkeypatch):
    audio = np.random.default_rng(2).uniform(-0.3, 0.3, (2, 96000)).astype(np.float32)
    write_video(tmp_path / "a.mp4", numbered_frames(60), 30, audio, 48000)
    full = media.read_video(tmp_path / "a.mp4")
    converted = []
    upright = media._upright
    monkeypatch.setattr(media, "_upright", lambda frame: converted.append(1) or upright(frame))
    part = media.read_video(tmp_path / "a.mp4", max_frames=20)
    # 30 -> 24 fps drops every fifth source frame: 20 output frames show 20 of the first 25 source frames,
    # and only those are kept (a whole read would convert all 60).
    assert len(converted) == 20
    assert torch.equal(part.frames, full.frames[:20])
    # The soundtrack is cut at the frames' duration at its own rate, then resampled (the reference's order).
    native = media.read_video(tmp_path / "a.mp4", sample_rate=None)
    assert native.sample_rate == 48000 and full.sample_rate == 32000
    cut = native.audio[:, : 20 * 48000 // 24]
    assert torch.equal(part.audio, resample(cut, 48000, 32000))
    assert part.audio.shape == (2, round(20 / 24 * 32000))


def test_pixel_limits_refuse_before_decoding(tmp_path):
    write_image(tmp_path / "a.png", np.zeros((24, 32, 3), np.uint8) + 7, "png")
    assert media.read_image(tmp_path / "a.png", max_pixels=24 * 32).shape == (24, 32, 3)
    with pytest.raises(InputError, match=r"the image is 32x24, over the limit of 767 pixels"):
        media.read_image(tmp_path / "a.png", max_pixels=24 * 32 - 1)
    write_video(tmp_path / "a.mp4", numbered_frames(6), 24)
    with pytest.raises(InputError, match=r"the video frame is 32x24, over the limit of 100 pixels"):
        media.read_video(tmp_path / "a.mp4", max_pixels=100)


# ---- audio -----------------------------------------------------------------------------------


def test_44k1_mono_wav_becomes_32k_stereo(tmp_path):
    write_audio(tmp_path / "a.wav", tone(1.0, 44100), 44100, "pcm_s16le")
    audio = media.read_audio(tmp_path / "a.wav")
    assert audio.dtype == torch.float32 and audio.shape == (2, 32000)
    assert torch.equal(audio[0], audio[1])
    assert 0.45 < audio.abs().max() < 0.55  # the duplicated channel keeps full level


def test_flac_stereo_keeps_its_channels(tmp_path):
    write_audio(tmp_path / "a.flac", tone(0.5, 32000, channels=2), 32000, "flac")
    audio = media.read_audio(tmp_path / "a.flac", max_seconds=0.25)
    assert audio.shape == (2, 8000)
    reference = torch.from_numpy(tone(0.25, 32000, channels=2))
    assert (audio - reference).abs().max() < 1e-3


def test_max_seconds_stops_decoding_with_the_same_samples(tmp_path):
    write_audio(tmp_path / "a.wav", tone(3.0, 44100), 44100, "pcm_s16le")
    full = media.read_audio_clip(tmp_path / "a.wav")
    part = media.read_audio_clip(tmp_path / "a.wav", max_seconds=0.5)
    assert full.sample_rate == part.sample_rate == 44100
    assert part.audio.shape == (2, 22050) and torch.equal(part.audio, full.audio[:, :22050])
    # Cut at the file's rate, then resampled: what read_audio returns.
    cut = media.read_audio(tmp_path / "a.wav", max_seconds=0.5)
    assert cut.shape == (2, 16000) and torch.equal(cut, resample(part.audio, 44100, 32000))


@pytest.mark.parametrize("suffix, codec, container", [(".mp3", "libmp3lame", "mp3"), (".m4a", "aac", "ipod")])
def test_lossy_audio_decodes_to_32k(tmp_path, suffix, codec, container):
    write_audio(tmp_path / f"a{suffix}", tone(1.0, 48000, channels=2), 48000, codec, container)
    audio = media.read_audio(tmp_path / f"a{suffix}")
    assert audio.shape[0] == 2
    assert abs(audio.shape[1] - 32000) <= 2048  # codec priming/padding frames
    assert audio.abs().max() > 0.3


# ---- writing ---------------------------------------------------------------------------------


def test_write_mp4_is_h264_aac_stereo_faststart_and_trimmed(tmp_path):
    frames = torch.from_numpy(numbered_frames(29, 48, 64))
    audio = torch.rand(2, 50000, generator=torch.Generator().manual_seed(0)) - 0.5
    path = media.write_mp4(tmp_path / "o.mp4", frames, audio)
    info = media.probe(path)
    assert (info["video_codec"], info["audio_codec"]) == ("h264", "aac")
    assert (info["width"], info["height"], info["frames"], info["fps"]) == (64, 48, 29, 24.0)
    assert (info["channels"], info["sample_rate"]) == (2, 32000)
    assert info["audio_duration"] == pytest.approx(29 / 24, abs=1e-3)  # 1.56 s of audio cut to 1.21 s
    data = path.read_bytes()
    assert data.index(b"moov") < data.index(b"mdat")
    assert frame_ids(media.read_video(path).frames) == list(range(29))
    assert not list(tmp_path.glob(".*partial"))


def test_streamed_chunks_make_the_same_file_as_one_write(tmp_path):
    frames = numbered_frames(29, 48, 64)
    audio = torch.rand(2, 50000, generator=torch.Generator().manual_seed(1)) - 0.5
    with media.mp4_writer(tmp_path / "s.mp4") as stream:
        for part in np.split(frames, [10, 20]):
            stream.add(torch.from_numpy(part))
        assert not (tmp_path / "s.mp4").exists()  # only the hidden partial file until the block ends
        stream.finish(audio)
    whole = media.write_mp4(tmp_path / "w.mp4", frames, audio)
    streamed, written = media.read_video(tmp_path / "s.mp4"), media.read_video(whole)
    assert frame_ids(streamed.frames) == list(range(29))
    assert torch.equal(streamed.frames, written.frames)
    assert media.probe(tmp_path / "s.mp4")["audio_duration"] == pytest.approx(29 / 24, abs=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.mp4", "w.mp4"]


def _x264_options(path) -> str:
    """The settings x264 writes into its first packet (an SEI: "x264 - core ... options: cabac=1 ref=3 ...")."""
    with av.open(str(path)) as container:
        first = bytes(next(p for p in container.demux(video=0) if p.size))
    return first[first.index(b"options: "):].split(b"\x00")[0].decode("ascii", "replace")


def test_the_x264_preset_comes_from_the_argument_or_its_variable(tmp_path, monkeypatch):
    frames = np.random.default_rng(5).integers(0, 256, (6, 32, 48, 3), dtype=np.uint8)
    monkeypatch.delenv("H3_X264_PRESET", raising=False)
    assert media.x264_preset() == "veryfast" and media.x264_preset("fast") == "fast"
    media.write_mp4(tmp_path / "v.mp4", frames)
    assert " subme=2 " in _x264_options(tmp_path / "v.mp4") and " ref=1 " in _x264_options(tmp_path / "v.mp4")
    monkeypatch.setenv("H3_X264_PRESET", "medium")
    media.write_mp4(tmp_path / "m.mp4", frames)
    assert " subme=7 " in _x264_options(tmp_path / "m.mp4") and " ref=3 " in _x264_options(tmp_path / "m.mp4")
    media.write_mp4(tmp_path / "a.mp4", frames, preset="veryfast")  # the argument wins over the variable
    assert " subme=2 " in _x264_options(tmp_path / "a.mp4")
    monkeypatch.setenv("H3_X264_PRESET", "quick")
    with pytest.raises(InputError, match=r"^H3_X264_PRESET must be one of x264's presets \(ultrafast, superfast, "
                                         r"veryfast, faster, fast, medium, slow, slower, veryslow\), got 'quick'$"):
        media.Mp4Stream(tmp_path / "b.mp4")
    with pytest.raises(InputError, match=r"^preset must be one of x264's presets .*got 'placebo'$"):
        media.write_mp4(tmp_path / "b.mp4", frames, preset="placebo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4", "m.mp4", "v.mp4"]


def test_stream_errors_name_the_problem_and_leave_no_file(tmp_path):
    frames = torch.from_numpy(numbered_frames(4, 16, 16))
    with pytest.raises(InputError, match="video chunks must keep one size: 16x16 first, then 32x16"):
        with media.mp4_writer(tmp_path / "a.mp4") as stream:
            stream.add(frames)
            stream.add(torch.from_numpy(numbered_frames(2, 16, 32)))
    with pytest.raises(InputError, match="the stream has an audio track; finish needs the audio"):
        with media.mp4_writer(tmp_path / "a.mp4") as stream:
            stream.add(frames)
            stream.finish()
    with pytest.raises(InputError, match="opened without an audio track"):
        with media.mp4_writer(tmp_path / "a.mp4", audio=False) as stream:
            stream.add(frames)
            stream.finish(torch.zeros(2, 100))
    with pytest.raises(InputError, match="no video frames to write"):
        with media.mp4_writer(tmp_path / "a.mp4") as stream:
            stream.finish(torch.zeros(2, 100))
    with pytest.raises(InputError, match="the mp4 was not finished"):
        with media.mp4_writer(tmp_path / "a.mp4") as stream:
            stream.add(frames)
    with pytest.raises(RuntimeError, match="the decode failed"):
        with media.mp4_writer(tmp_path / "a.mp4") as stream:
            stream.add(frames)
            raise RuntimeError("the decode failed")
    assert not any(tmp_path.iterdir())
    done = media.Mp4Stream(tmp_path / "b.mp4", audio=False)
    done.add(frames)
    done.finish()
    with pytest.raises(InputError, match="frames added after finish"):
        done.add(frames)


def test_an_encoder_failure_reaches_the_producer(tmp_path):
    # The container is opened on the encoding thread; its failure comes back at the producer's next call.
    stream = media.Mp4Stream(tmp_path / "missing" / "a.mp4", audio=False)
    stream.add(torch.from_numpy(numbered_frames(3, 16, 16)))
    with pytest.raises(InputError, match="a.mp4: cannot write mp4"):
        stream.finish()
    stream.abort()


def _descriptors_on(target: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if link.startswith(target):
            found.append(f"{fd} -> {link}")
    return found


@pytest.mark.skipif(not (os.path.exists("/dev/full") and os.path.isdir("/proc/self/fd")),
                    reason="needs Linux's /dev/full (every write: ENOSPC) and /proc/self/fd")
@pytest.mark.parametrize("chunks", [1, 6])
def test_a_full_disk_fails_the_stream_and_frees_its_descriptor(tmp_path, chunks):
    # The kernel's own ENOSPC: the stream's file is /dev/full. PyAV kept its descriptor open when muxing or closing
    # failed, so a failed job's deleted file held its disk space until the process ended.
    (tmp_path / "o.mp4").symlink_to("/dev/full")
    stream = media.Mp4Stream(tmp_path / "o.mp4", audio=False)
    rng = np.random.default_rng()
    with pytest.raises(InputError) as err:
        for _ in range(chunks):
            stream.add(rng.integers(0, 256, (8, 64, 64, 3), dtype=np.uint8))
        stream.finish()
    stream.abort()
    assert str(err.value) == f"{tmp_path / 'o.mp4'}: cannot write mp4 ([Errno 28] No space left on device)"
    assert _descriptors_on("/dev/full") == []


_ON_A_FULL_TMPFS = """
import json, os, sys
import numpy as np
from h3_spark.errors import InputError
from h3_spark.h3_model.media.files import Mp4Stream

folder = sys.argv[1]
def free():
    s = os.statvfs(folder)
    return s.f_bavail * s.f_frsize
def held():
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += [os.readlink(f"/proc/self/fd/{fd}")] if folder in os.readlink(f"/proc/self/fd/{fd}") else []
        except OSError:
            pass
    return found
rng = np.random.default_rng()
for room in map(int, sys.argv[2:]):
    filler = os.path.join(folder, "filler")
    with open(filler, "wb") as f:
        f.write(bytes(free() - room))
    before, path = free(), os.path.join(folder, ".job.partial.mp4")
    stream, error = Mp4Stream(path, audio=False), None
    try:
        for _ in range(6):
            stream.add(rng.integers(0, 256, (8, 128, 128, 3), dtype=np.uint8))
        stream.finish()
    except InputError as exc:
        error = str(exc)
    stream.abort()
    os.unlink(path)
    print(json.dumps({"room": room, "error": error, "before": before, "after": free(), "held": held()}))
    os.unlink(filler)
"""


def test_a_full_tmpfs_gives_its_space_back_after_a_failed_stream(tmp_path):
    # A real file system that fills up: a 512 KiB tmpfs, mounted in a user namespace of its own (no root needed).
    # No room at all (the header's first write fails) and 48 KiB (a few frames are written first).
    import json
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("this machine lets no unprivileged user namespace mount a tmpfs (unshare -rm failed); the "
                    "injected ENOSPC tests cover the same path")
    folder = tmp_path / "small"
    folder.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(_ON_A_FULL_TMPFS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rooms = [0, 48 * 1024]
    run = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=512k tmpfs "{folder}" && exec '
                          f'"{sys.executable}" "{script}" "{folder}" ' + " ".join(map(str, rooms))],
                         capture_output=True, text=True, env=env, timeout=120)
    if run.returncode and "mount" in run.stderr and not run.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    got = [json.loads(line) for line in run.stdout.strip().splitlines()]
    assert [g["room"] for g in got] == rooms
    for g in got:
        assert g["error"] == f"{folder}/.job.partial.mp4: cannot write mp4 ([Errno 28] No space left on device)"
        assert g["held"] == [] and g["after"] == g["before"] == g["room"]


def test_write_mp4_without_audio(tmp_path):
    info = media.probe(media.write_mp4(tmp_path / "o.mp4", numbered_frames(5, 16, 16)))
    assert info["video_codec"] == "h264" and "audio_codec" not in info


def test_ffmpeg_log_is_silent_unless_asked(tmp_path, capfd):
    media.write_mp4(tmp_path / "a.mp4", numbered_frames(3, 16, 16))
    assert capfd.readouterr().err == ""
    media.write_mp4(tmp_path / "b.mp4", numbered_frames(3, 16, 16), loglevel="info")
    assert "libx264" in capfd.readouterr().err
    media.write_mp4(tmp_path / "c.mp4", numbered_frames(3, 16, 16))
    assert capfd.readouterr().err == ""


# ---- bad inputs ------------------------------------------------------------------------------


def test_missing_unsupported_and_corrupt_inputs(tmp_path):
    with pytest.raises(InputError, match="nope.png: no such image file"):
        media.read_image(tmp_path / "nope.png")
    (tmp_path / "a.gif").write_bytes(b"GIF89a")
    with pytest.raises(InputError, match=re.escape("unsupported image type .gif; use .png, .jpg, .jpeg, .webp")):
        media.read_image(tmp_path / "a.gif")
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    with pytest.raises(InputError, match="bad.png: cannot (read as|decode) image"):
        media.read_image(tmp_path / "bad.png")
    (tmp_path / "bad.mp4").write_bytes(b"\0" * 64)
    with pytest.raises(InputError, match="bad.mp4: cannot (read as|decode) video"):
        media.read_video(tmp_path / "bad.mp4")
    with pytest.raises(InputError, match="not a file"):
        media.read_audio(tmp_path.parent / tmp_path.name / ".." / tmp_path.name)
    write_video(tmp_path / "silent.mp4", numbered_frames(3), 24)
    (tmp_path / "silent.m4a").write_bytes((tmp_path / "silent.mp4").read_bytes())
    with pytest.raises(InputError, match="silent.m4a: no audio stream"):
        media.read_audio(tmp_path / "silent.m4a")


def test_bad_write_arguments(tmp_path):
    frames = numbered_frames(3, 16, 16)
    with pytest.raises(InputError, match=re.escape("video frames must be uint8 (F, H, W, 3)")):
        media.write_mp4(tmp_path / "a.mp4", frames.astype(np.float32))
    with pytest.raises(InputError, match="even width and height, got 15x16"):
        media.write_mp4(tmp_path / "a.mp4", frames[:, :, :15])
    with pytest.raises(InputError, match=re.escape("audio must be float (2, samples), got (1, 100)")):
        media.write_mp4(tmp_path / "a.mp4", frames, torch.zeros(1, 100))
    with pytest.raises(InputError, match="no such folder for the output"):
        media.write_mp4(tmp_path / "missing" / "a.mp4", frames)
    with pytest.raises(InputError, match="unknown ffmpeg loglevel 'loud'"):
        media.write_mp4(tmp_path / "a.mp4", frames, loglevel="loud")
    assert not (tmp_path / "a.mp4").exists()
