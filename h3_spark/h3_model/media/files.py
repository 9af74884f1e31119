"""Media I/O on PyAV: images, videos and audio in; H.264 + AAC mp4 out.

Everything comes out on H3's clocks: video at 24 fps (frames dropped or held, never blended),
audio at 32 kHz stereo float32 (mono is duplicated onto both channels, more than two channels are
downmixed by libswresample). Frames are uint8 (F, H, W, 3) RGB tensors.

FFmpeg's log is silenced unless a loglevel (ffmpeg's names: quiet ... trace) is given, in which
case FFmpeg prints to stderr at that level for the duration of the call.

Audio is decoded at the file's own rate (PyAV converts the sample format only) and put on 32 kHz by
`resample.resample`, the reference pipeline's windowed-sinc filter; `read_audio_clip` and
`read_video(sample_rate=None)` hand the soundtrack over at its own rate, so that a reference can be
truncated before it is resampled, as the reference pipeline does.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ...errors import InputError
from .resample import resample

FPS = 24
SAMPLE_RATE = 32000
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".webm")
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".m4a")
MAX_QUEUED_CHUNKS = 4  # chunks an Mp4Stream holds for its encoder
DEFAULT_CRF = 18  # x264's constant rate factor: visually lossless for most content
LOGLEVELS = ("quiet", "panic", "fatal", "error", "warning", "info", "verbose", "debug", "trace")


def _av():
    try:
        import av
    except ImportError:
        raise InputError("media I/O needs PyAV: pip install av") from None
    return av


@contextmanager
def ffmpeg_log(loglevel: str | None) -> Iterator[None]:
    """Silence FFmpeg, or let it print to stderr at `loglevel`, for the duration of a call."""
    av = _av()
    if loglevel is None:
        av.logging.set_level(None)
        yield
        return
    if loglevel not in LOGLEVELS:
        raise InputError(f"unknown ffmpeg loglevel {loglevel!r}; choose one of {', '.join(LOGLEVELS)}")
    level = -8 if loglevel == "quiet" else getattr(av.logging, loglevel.upper())
    av.logging.restore_default_callback()
    av.logging.set_libav_level(level)
    try:
        yield
    finally:
        av.logging.set_level(None)


def _check_input(path: str | os.PathLike, suffixes: tuple[str, ...], kind: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such {kind} file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    if path.suffix.lower() not in suffixes:
        raise InputError(f"{path}: unsupported {kind} type {path.suffix or '(none)'}; use {', '.join(suffixes)}")
    return path


@contextmanager
def _open(path: Path, kind: str, loglevel: str | None) -> Iterator[Any]:
    av = _av()
    with ffmpeg_log(loglevel):
        try:
            container = av.open(str(path))
        except (av.error.FFmpegError, OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: cannot read as {kind} ({exc})") from None
        with container:
            try:
                yield container
            except av.error.FFmpegError as exc:
                raise InputError(f"{path}: cannot decode {kind} ({exc})") from None


def _upright(frame: Any) -> np.ndarray:
    """RGB array of a frame, turned the way players display it (the stream's display matrix
    rotation, counterclockwise, snapped to quarter turns)."""
    array = frame.to_ndarray(format="rgb24")
    turns = round(getattr(frame, "rotation", 0) / 90.0) % 4
    return np.ascontiguousarray(np.rot90(array, k=-turns)) if turns else array


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _check_pixels(path: Path, width: int, height: int, max_pixels: int | None, what: str) -> None:
    # Decoded size, not file size, is what costs memory: a few KB of well-compressed pixels can be gigabytes.
    if max_pixels is not None and width * height > max_pixels:
        raise InputError(f"{path}: the {what} is {width}x{height}, over the limit of {max_pixels} pixels")


def read_image(path: str | os.PathLike, *, max_pixels: int | None = None,
               loglevel: str | None = None) -> torch.Tensor:
    """png / jpg / webp -> uint8 (H, W, 3) RGB (alpha dropped); refused past `max_pixels` before decoding."""
    path = _check_input(path, IMAGE_SUFFIXES, "image")
    with _open(path, "image", loglevel) as container:
        if not container.streams.video:
            raise InputError(f"{path}: no image in the file")
        ctx = container.streams.video[0].codec_context
        _check_pixels(path, ctx.width, ctx.height, max_pixels, "image")
        for frame in container.decode(video=0):
            _check_pixels(path, frame.width, frame.height, max_pixels, "image")
            return torch.from_numpy(_upright(frame).copy())
    raise InputError(f"{path}: no image in the file")


def resample_frame_indices(num_frames: int, source_fps: float, target_fps: float = FPS) -> torch.Tensor:
    """Source frame shown at each target frame: every frame holds from its own slot,
    round(i * target / source), to the next frame's, the last one to the slot the stream's end
    rounds to (what ffmpeg's fps filter does)."""
    if source_fps <= 0:
        raise InputError(f"a video needs a positive frame rate, got {source_fps}")
    scale = target_fps / source_fps
    slots = torch.floor(torch.arange(num_frames + 1, dtype=torch.float64) * scale + 0.5).long()
    return torch.repeat_interleave(torch.arange(num_frames), slots.diff())


@dataclass
class VideoClip:
    frames: torch.Tensor          # uint8 (F, H, W, 3) at `fps`
    fps: float
    source_fps: float
    audio: torch.Tensor | None    # float32 (2, N) at `sample_rate`, or None without a soundtrack
    sample_rate: int | None


def _video_stream(path: Path, container, max_pixels: int | None):
    """(the first video stream, its frame rate) of an open container, refused in one line when it has none, no
    rate, or frames over `max_pixels`."""
    if not container.streams.video:
        raise InputError(f"{path}: no video stream")
    stream = container.streams.video[0]
    source_fps = float(stream.average_rate or stream.guessed_rate or 0)
    if source_fps <= 0:
        raise InputError(f"{path}: the video stream has no frame rate")
    _check_pixels(path, stream.codec_context.width, stream.codec_context.height, max_pixels, "video frame")
    return stream, source_fps


def read_video(path: str | os.PathLike, *, fps: float = FPS, max_frames: int | None = None,
               max_pixels: int | None = None, sample_rate: int | None = SAMPLE_RATE, with_audio: bool = True,
               loglevel: str | None = None) -> VideoClip:
    """mp4 / mov / webm -> frames at `fps` (dropped or held) and, if present, the soundtrack stereo, cut at the
    returned frames' duration at its own rate, then resampled to `sample_rate` (None: left at its own rate).

    With `max_frames`, only the source frames those output frames show are kept and the soundtrack is
    decoded no further than their duration, so memory follows the request, not the file; frames over
    `max_pixels` are refused before decoding."""
    path = _check_input(path, VIDEO_SUFFIXES, "video")
    with _open(path, "video", loglevel) as container:
        stream, source_fps = _video_stream(path, container, max_pixels)
        needed = keep = None
        if max_frames is not None:
            needed = math.ceil((max_frames + 1) * source_fps / fps) + 1
            # A source frame's slot does not depend on the stream's length: these are the frames shown.
            keep = set(resample_frame_indices(needed, source_fps, fps)[:max_frames].tolist())
        kept: dict[int, np.ndarray] = {}
        decoded = 0
        for frame in container.decode(stream):
            if keep is None or decoded in keep:
                _check_pixels(path, frame.width, frame.height, max_pixels, "video frame")
                kept[decoded] = _upright(frame)
            decoded += 1
            if needed is not None and decoded >= needed:
                break
        if not decoded:
            raise InputError(f"{path}: the video stream has no frames")
        index = resample_frame_indices(decoded, source_fps, fps)
        if max_frames is not None:
            index = index[:max_frames]
        audio, rate = None, sample_rate
        if with_audio and container.streams.audio:
            container.seek(0)
            audio, rate = _decode_audio(container, container.streams.audio[0], index.numel() / fps)
    order = sorted(kept)
    position = {src: i for i, src in enumerate(order)}
    video = torch.from_numpy(np.stack([kept[i] for i in order]))[torch.tensor([position[i] for i in index.tolist()],
                                                                             dtype=torch.long)]
    if audio is not None and sample_rate is not None:
        audio, rate = resample(audio, rate, sample_rate), sample_rate
    return VideoClip(video, float(fps), source_fps, audio, rate)


@dataclass
class VideoTail:
    """The end of a video: its last frames (uint8 (T, H, W, 3) at `fps`), how many frames the whole video has at
    that rate, and the soundtrack under all of them (as `read_video` gives it). `head()` decodes the frames
    before the tail again, a few at a time, for a writer that copies the video through."""

    frames: torch.Tensor
    total_frames: int
    fps: float
    audio: torch.Tensor | None
    sample_rate: int | None
    path: Path
    max_pixels: int | None = None
    chunk_frames: int = 12

    def head(self) -> Iterator[torch.Tensor]:
        """The frames before the tail, in order, in chunks of at most `chunk_frames` (uint8 (n, H, W, 3))."""
        count = self.total_frames - int(self.frames.shape[0])
        if count <= 0:
            return
        with _open(self.path, "video", None) as container:
            stream = container.streams.video[0]
            source_fps = float(stream.average_rate or stream.guessed_rate or 0)
            index = resample_frame_indices(math.ceil((count + 1) * source_fps / self.fps) + 1, source_fps,
                                           self.fps)[:count].tolist()
            chunk, j = [], 0
            for decoded, frame in enumerate(container.decode(stream)):
                if j >= count:
                    break
                if index[j] != decoded:
                    continue  # a source frame no output frame shows (dropped by the rate change)
                _check_pixels(self.path, frame.width, frame.height, self.max_pixels, "video frame")
                array = _upright(frame)
                while j < count and index[j] == decoded:  # held over several output frames when slower
                    chunk.append(array)
                    j += 1
                if len(chunk) >= self.chunk_frames:
                    yield torch.from_numpy(np.stack(chunk))
                    chunk = []
            if chunk:
                yield torch.from_numpy(np.stack(chunk))
        if j != count:
            raise InputError(f"{self.path}: the video changed while it was read ({j} of {count} frames before its "
                             f"tail)")


def read_video_tail(path: str | os.PathLike, tail_frames: int, *, fps: float = FPS, max_frames: int | None = None,
                    max_pixels: int | None = None, sample_rate: int | None = SAMPLE_RATE,
                    loglevel: str | None = None) -> VideoTail:
    """The last `tail_frames` frames of a video at `fps` (of its first `max_frames`, when given) and its whole
    soundtrack, holding no more than those frames in memory: every frame is decoded once and only the newest few
    are kept. `read_video` gives the same frames (the tail of its own) and the same sound."""
    if tail_frames < 1:
        raise InputError(f"a video's tail is at least one frame, got {tail_frames}")
    path = _check_input(path, VIDEO_SUFFIXES, "video")
    with _open(path, "video", loglevel) as container:
        stream, source_fps = _video_stream(path, container, max_pixels)
        needed = None if max_frames is None else math.ceil((max_frames + 1) * source_fps / fps) + 1
        # The source frames the last `tail_frames` output frames can show, with a frame to spare either side.
        recent: deque = deque(maxlen=math.ceil((tail_frames + 1) * source_fps / fps) + 3)
        decoded = 0
        for frame in container.decode(stream):
            _check_pixels(path, frame.width, frame.height, max_pixels, "video frame")
            recent.append((decoded, _upright(frame)))
            decoded += 1
            if needed is not None and decoded >= needed:
                break
        if not decoded:
            raise InputError(f"{path}: the video stream has no frames")
        index = resample_frame_indices(decoded, source_fps, fps)
        if max_frames is not None:
            index = index[:max_frames]
        total = index.numel()
        audio, rate = None, sample_rate
        if container.streams.audio:
            container.seek(0)
            audio, rate = _decode_audio(container, container.streams.audio[0], total / fps)
    kept = dict(recent)
    shown = index[max(total - tail_frames, 0):].tolist()
    if any(i not in kept for i in shown):  # cannot happen with the spare frames above; say so if it does
        raise InputError(f"{path}: the tail's source frames were not kept (frame rate {source_fps:g})")
    video = torch.from_numpy(np.stack([kept[i] for i in shown]))
    if audio is not None and sample_rate is not None:
        audio, rate = resample(audio, rate, sample_rate), sample_rate
    return VideoTail(video, total, float(fps), audio, rate, path, max_pixels)


def video_geometry(path: str | os.PathLike, *, fps: float = FPS, max_frames: int | None = None) -> tuple[int, int, int]:
    """(frames at `fps`, width, height) of a video from its container's index and its first frame: what `read_video`
    would give, for an answer that must come before the job reads it. A container that does not count its frames
    is counted by its packets."""
    path = _check_input(path, VIDEO_SUFFIXES, "video")
    with _open(path, "video", None) as container:
        if not container.streams.video:
            raise InputError(f"{path}: no video stream")
        stream = container.streams.video[0]
        source_fps = float(stream.average_rate or stream.guessed_rate or 0)
        if source_fps <= 0:
            raise InputError(f"{path}: the video stream has no frame rate")
        count = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        container.seek(0)
        # One frame decoded: the size players show (a rotated phone video's width and height swap).
        first = next(iter(container.decode(stream)), None)
        if first is None:
            raise InputError(f"{path}: the video stream has no frames")
        height, width = _upright(first).shape[:2]
    frames = resample_frame_indices(count, source_fps, fps).numel() if count else 0
    return (frames if max_frames is None else min(frames, max_frames)), width, height


@dataclass
class AudioClip:
    audio: torch.Tensor           # float32 (2, N); mono duplicated onto both channels
    sample_rate: int


def read_audio_clip(path: str | os.PathLike, *, max_seconds: float | None = None,
                    loglevel: str | None = None) -> AudioClip:
    """wav / flac / mp3 / m4a -> float32 stereo (2, N) at the file's own sample rate, at most `max_seconds`."""
    path = _check_input(path, AUDIO_SUFFIXES, "audio")
    with _open(path, "audio", loglevel) as container:
        if not container.streams.audio:
            raise InputError(f"{path}: no audio stream")
        audio, rate = _decode_audio(container, container.streams.audio[0], max_seconds)
    if audio.shape[1] == 0:
        raise InputError(f"{path}: the audio stream has no samples")
    return AudioClip(audio, rate)


def read_audio(path: str | os.PathLike, *, sample_rate: int = SAMPLE_RATE, max_seconds: float | None = None,
               loglevel: str | None = None) -> torch.Tensor:
    """wav / flac / mp3 / m4a -> float32 stereo (2, N) at `sample_rate` (cut at `max_seconds` at the file's rate,
    then resampled)."""
    clip = read_audio_clip(path, max_seconds=max_seconds, loglevel=loglevel)
    return resample(clip.audio, clip.sample_rate, sample_rate)


def _decode_audio(container: Any, stream: Any, max_seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """The stream at its own rate, stereo (mono duplicated), and that rate; with `max_seconds`, decoding stops
    once that much is in and the rest is cut off."""
    av = _av()
    rate = int(stream.codec_context.sample_rate or stream.rate or 0)
    if rate <= 0:
        raise InputError("the audio stream has no sample rate")
    limit = None if max_seconds is None else int(max_seconds * rate)
    channels = stream.codec_context.channels or stream.layout.nb_channels
    # Planar float at the stream's own rate: no resampling here. Mono stays mono (libswresample's
    # mono->stereo upmix would attenuate by 3 dB; we duplicate it afterwards); more channels are downmixed.
    layout = "mono" if channels == 1 else "stereo"
    converter = av.AudioResampler(format="fltp", layout=layout, rate=rate)
    chunks, total = [], 0
    for frame in container.decode(stream):
        for out in converter.resample(frame):
            chunks.append(out.to_ndarray())
            total += chunks[-1].shape[1]
        if limit is not None and total >= limit:
            break
    else:
        chunks += [out.to_ndarray() for out in converter.resample(None)]
    audio = torch.from_numpy(np.concatenate(chunks, axis=1)) if chunks else torch.zeros(1 if channels == 1 else 2, 0)
    audio = audio.to(torch.float32)[:, :limit]
    return (audio.expand(2, -1).contiguous() if audio.shape[0] == 1 else audio), rate


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _as_frames(frames: torch.Tensor | np.ndarray) -> np.ndarray:
    array = frames.numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] < 1:
        raise InputError(f"video frames must be uint8 (F, H, W, 3) with F >= 1, got {tuple(array.shape)} {array.dtype}")
    if array.shape[1] % 2 or array.shape[2] % 2:
        raise InputError(f"H.264 (yuv420p) needs an even width and height, got {array.shape[2]}x{array.shape[1]}")
    return array


def _as_audio(audio: torch.Tensor | np.ndarray) -> np.ndarray:
    array = audio.float().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] != 2 or array.shape[1] < 1:
        raise InputError(f"audio must be float (2, samples), got {tuple(array.shape)}")
    return np.ascontiguousarray(np.clip(array, -1.0, 1.0), dtype=np.float32)


def write_mp4(path: str | os.PathLike, frames: torch.Tensor | np.ndarray,
              audio: torch.Tensor | np.ndarray | None = None, *, fps: int = FPS, sample_rate: int = SAMPLE_RATE,
              crf: int = DEFAULT_CRF, preset: str | None = None, loglevel: str | None = None) -> Path:
    """Write H.264 (yuv420p, `crf`, x264 `preset`: `x264_preset`) at `fps` plus stereo AAC, moov atom first
    (faststart).

    The audio is trimmed to the video's duration, round(F / fps * sample_rate) samples. The file
    appears only when complete.
    """
    if audio is not None:
        _as_audio(audio)  # fail before encoding anything
    with mp4_writer(path, audio=audio is not None, fps=fps, sample_rate=sample_rate, crf=crf, preset=preset,
                    loglevel=loglevel) as stream:
        stream.add(frames)
        stream.finish(audio)
    return Path(path)


def write_png(path: str | os.PathLike, frame: torch.Tensor | np.ndarray) -> Path:
    """One uint8 (H, W, 3) picture -> a PNG at `path`, which appears only when complete."""
    from PIL import Image

    array = frame.numpy() if isinstance(frame, torch.Tensor) else np.asarray(frame)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise InputError(f"a picture must be uint8 (H, W, 3), got {tuple(array.shape)} {array.dtype}")
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such folder for the output")
    tmp = path.with_name(f".{path.name}.partial")
    try:
        Image.fromarray(np.ascontiguousarray(array)).save(tmp, format="PNG")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# x264's presets, fastest first. At crf 18 on 1344x768x124 (benchmarks/mux_cpu.py, the H100 machine's 16 cores,
# receipts/h100/mux-1344x768x124-presets-66ad520.json and -segments-66ad520.json): medium ends 0.57 s after the last
# decoded frame on camera-like frames and 1.56 s on the noise a random-weight DiT decodes to; veryfast 0.19 and
# 0.32 s, for a file 6.3 % larger and 0.17 dB lower in PSNR on the camera-like frames. veryfast is the default: the
# mux is the render's tail, and a fewer-core machine's x264 falls further behind the decode at medium.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow")
PRESET_ENV = "H3_X264_PRESET"
DEFAULT_PRESET = "veryfast"
VIDEO_CODEC = "libx264"


def x264_preset(preset: str | None = None) -> str:
    """`preset`, else $H3_X264_PRESET, else veryfast; checked against x264's presets."""
    source = "preset"
    if preset is None:
        preset, source = os.environ.get(PRESET_ENV, "").strip() or DEFAULT_PRESET, PRESET_ENV
    if preset not in X264_PRESETS:
        raise InputError(f"{source} must be one of x264's presets ({', '.join(X264_PRESETS)}), got {preset!r}")
    return preset


@contextmanager
def mp4_writer(path: str | os.PathLike, **options: Any) -> Iterator["Mp4Stream"]:
    """An `Mp4Stream` on a hidden partial file next to `path`, moved into place when the block ends after
    `finish`; on an exception, or without `finish`, the partial file is removed and `path` left alone."""
    path = Path(path)
    if path.parent and not path.parent.is_dir():
        raise InputError(f"{path.parent}: no such folder for the output")
    tmp = path.with_name(f".{path.name}.partial")
    stream = Mp4Stream(tmp, **options)
    try:
        yield stream
        if not stream.finished:
            raise InputError(f"{path}: the mp4 was not finished")
        os.replace(tmp, path)
    finally:
        stream.abort()
        if tmp.exists():
            tmp.unlink()


def open_output(path: Path):
    """The file an `Mp4Stream` writes through (read and write: faststart reads it back)."""
    return open(path, "w+b")


class Mp4Stream:
    """An mp4 encoded while its frames are still being made.

    `add` hands (F, H, W, 3) uint8 chunks to a background thread that encodes them (x264 works while the
    GPU decodes the next window); `finish(audio)` waits for the video, adds the AAC track and closes the
    file at `path` (no temporary name: `mp4_writer` gives one). The chunks are not copied: do not change
    them after `add`. Errors of the encoder surface in the next `add` or in `finish`.
    """

    def __init__(self, path: str | os.PathLike, *, audio: bool = True, fps: int = FPS,
                 sample_rate: int = SAMPLE_RATE, crf: int = DEFAULT_CRF, preset: str | None = None,
                 loglevel: str | None = None):
        _av()
        if loglevel is not None and loglevel not in LOGLEVELS:
            raise InputError(f"unknown ffmpeg loglevel {loglevel!r}; choose one of {', '.join(LOGLEVELS)}")
        self.path = Path(path)
        self.fps, self.sample_rate, self.crf, self.loglevel = fps, sample_rate, crf, loglevel
        self.preset = x264_preset(preset)
        self.audio = audio
        self.frames = 0
        self.finished = False
        self._shape: tuple[int, int] | None = None
        # Bounded: a producer faster than x264 (a clip copied through, frames decoded from a file) waits here
        # instead of piling decoded frames up in memory.
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED_CHUNKS)
        self._error: BaseException | None = None
        self._out = self._vstream = self._astream = None
        # Our own descriptor on the file: PyAV leaves its own open when muxing or closing fails (ENOSPC, EIO),
        # which kept a failed job's deleted file, and the disk space, held until the process ended.
        self._file = None
        self._thread: threading.Thread | None = None

    def add(self, frames: torch.Tensor | np.ndarray) -> None:
        self._raise()
        if self.finished:
            raise InputError(f"{self.path}: frames added after finish")
        array = _as_frames(frames)
        if self._shape is None:
            self._shape = array.shape[1:3]
        elif array.shape[1:3] != self._shape:
            raise InputError(f"video chunks must keep one size: {self._shape[1]}x{self._shape[0]} first, then "
                             f"{array.shape[2]}x{array.shape[1]}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._encode, name="h3-mp4-encode", daemon=True)
            self._thread.start()
        self.frames += array.shape[0]
        self._queue.put(array)

    def finish(self, audio: torch.Tensor | np.ndarray | None = None) -> Path:
        """Encode what is left, add `audio` (float (2, samples), trimmed to the video's duration), close."""
        if self.frames == 0:
            raise InputError(f"{self.path}: no video frames to write")
        if audio is None and self.audio:
            raise InputError(f"{self.path}: the stream has an audio track; finish needs the audio")
        if audio is not None and not self.audio:
            raise InputError(f"{self.path}: the stream was opened without an audio track")
        sound = None if audio is None else _as_audio(audio)[:, : round(self.frames / self.fps * self.sample_rate)]
        self._queue.put(None)
        self._thread.join()
        self._raise()
        av = _av()
        try:
            with ffmpeg_log(self.loglevel):
                if sound is not None:
                    frame = av.AudioFrame.from_ndarray(sound, format="fltp", layout="stereo")
                    frame.sample_rate = self.sample_rate
                    frame.pts = 0
                    self._out.mux(self._astream.encode(frame))
                    self._out.mux(self._astream.encode())
                self._out.close()
        except (av.error.FFmpegError, OSError) as exc:
            raise InputError(f"{self.path}: cannot write mp4 ({exc})") from None
        finally:
            self._out = None
            self._close_file()
        self.finished = True
        return self.path

    def abort(self) -> None:
        """Stop encoding and close the file, finished or not (the caller removes it)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        # The file first: PyAV then skips the trailer (nothing more is written to a file being dropped).
        self._close_file()
        if self._out is not None:
            try:
                self._out.close()
            except Exception:  # noqa: BLE001 - a half-written file is removed by the caller anyway
                pass
            self._out = None

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # its last buffered bytes could not be written (ENOSPC): the file is dropped anyway
                pass
            self._file = None

    def _raise(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, InputError):
                raise err
            raise InputError(f"{self.path}: cannot write mp4 ({err})") from err

    def _open(self, height: int, width: int) -> None:
        av = _av()
        # w+b: faststart reads the file back to move the index to the front.
        self._file = open_output(self.path)
        self._out = av.open(self._file, "w", format="mp4", options={"movflags": "+faststart"})
        v = self._out.add_stream(VIDEO_CODEC, rate=Fraction(self.fps).limit_denominator())
        v.width, v.height, v.pix_fmt = width, height, "yuv420p"
        v.options = {"crf": str(self.crf), "preset": self.preset}
        # Frame threads on every core: PyAV's default (slice threads) left x264 at ~24 fps on one core.
        v.codec_context.thread_type = "AUTO"
        v.codec_context.thread_count = 0
        self._vstream = v
        if self.audio:
            self._astream = self._out.add_stream("aac", rate=self.sample_rate, layout="stereo")

    def _encode(self) -> None:
        av = _av()
        done = False
        try:
            with ffmpeg_log(self.loglevel):
                while (array := self._queue.get()) is not None:
                    if self._out is None:
                        self._open(array.shape[1], array.shape[2])
                    for rgb in array:
                        self._out.mux(self._vstream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
                done = True
                if self._out is not None:
                    self._out.mux(self._vstream.encode())
        except BaseException as exc:  # noqa: BLE001 - handed to the producer's thread
            self._error = exc
            while not done:  # the producer learns of it at its next call; take its chunks until it stops
                done = self._queue.get() is None


def probe(path: str | os.PathLike) -> dict[str, Any]:
    """Codecs, geometry and durations of a media file (for summaries and tests)."""
    path = _check_input(path, VIDEO_SUFFIXES + AUDIO_SUFFIXES + IMAGE_SUFFIXES, "media")
    info: dict[str, Any] = {}
    with _open(path, "media", None) as container:
        info["format"] = container.format.name
        info["duration"] = container.duration / 1_000_000 if container.duration else None
        if container.streams.video:
            v = container.streams.video[0]
            info.update(video_codec=v.codec_context.name, width=v.codec_context.width, height=v.codec_context.height,
                        fps=float(v.average_rate) if v.average_rate else None, frames=v.frames)
        if container.streams.audio:
            a = container.streams.audio[0]
            duration = float(a.duration * a.time_base) if a.duration is not None else None
            info.update(audio_codec=a.codec_context.name, channels=a.codec_context.channels,
                        sample_rate=a.codec_context.sample_rate, audio_duration=duration)
    return info
