"""H.264 in parallel segments: an mp4's frames encoded by several x264 encoders at once, muxed in order.

One x264 encoder keeps only part of a many-core host busy at 1344x768 (its frame threads wait on each other and
on one lookahead), so the encode of a clip ran seconds past the VAE decode that feeds it. Here every run of
`segment_frames` frames gets an encoder of its own, on a thread of its own, started as soon as its first frame
arrives; its packets are muxed after the previous segment's. Each segment is a closed group of pictures that
starts with an IDR frame, as a stream cut every `segment_frames` frames (`keyint`) would be: the cost is one
keyframe a segment, in size at the same quality (`crf`), stated by `benchmarks/mux_cpu.py`.

The encoders are configured alike, so their parameter sets (SPS/PPS: the mp4's `avcC`) are identical; each
segment's is checked against the stream's before its packets are written, and a difference fails the file
rather than writing one that decodes wrongly. Frames carry their index in the clip as the timestamp, so the
segments' decoding timestamps follow each other without gaps.
"""

from __future__ import annotations

import os
import queue
import threading
from fractions import Fraction

import numpy as np

from ...errors import InputError

SEGMENT_ENV = "H3_MUX_SEGMENT_FRAMES"
# Segments encoded at once; more only adds threads once the cores are busy.
MAX_LIVE_SEGMENTS = 4


def segment_frames(value: int | str | None = None) -> int:
    """Frames a segment (0: one encoder for the whole clip): `value`, else $H3_MUX_SEGMENT_FRAMES, else 0."""
    source = "segment_frames"
    if value is None:
        value, source = os.environ.get(SEGMENT_ENV, "0").strip() or "0", SEGMENT_ENV
    try:
        frames = int(value)
    except (TypeError, ValueError):
        raise InputError(f"{source} must be a whole number of frames (0: one encoder), got {value!r}") from None
    if frames < 0 or 0 < frames < 8:
        raise InputError(f"{source} must be 0 (one encoder) or at least 8 frames, got {frames}")
    return frames


def encoder(av, width: int, height: int, rate: Fraction, options: dict, threads: int):
    """A standalone x264 encoder configured as the mp4 stream's own (global headers: the parameter sets go to
    the container, not before each keyframe)."""
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    ctx.time_base, ctx.framerate = 1 / rate, rate
    ctx.options = dict(options)
    ctx.thread_type, ctx.thread_count = "AUTO", threads
    ctx.flags |= av.codec.context.Flags.global_header
    return ctx


class Segment:
    """Frames `first`, `first + 1`, ... through encoder `codec` on a thread of its own; `close()` after its last
    frame, then `packets()` waits for them. The frames are not copied: do not change them after `put`."""

    def __init__(self, av, codec, first: int):
        self.av, self.codec, self.first = av, codec, first
        self.count = 0
        self._frames: queue.Queue = queue.Queue()
        self._packets: list = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"h3-mp4-segment-{first}", daemon=True)
        self._thread.start()

    def put(self, rgb: np.ndarray) -> None:
        self._frames.put(rgb)
        self.count += 1

    def close(self) -> None:
        self._frames.put(None)

    def packets(self) -> list:
        """The segment's packets in decoding order, once its encoder has flushed; its error, if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._packets

    def stop(self) -> None:
        """Give up: the thread ends after the frames already queued (used when the file is being dropped)."""
        self.close()
        self._thread.join()

    def _run(self) -> None:
        done = False
        try:
            index = self.first
            while (rgb := self._frames.get()) is not None:
                frame = self.av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = index
                index += 1
                self._packets.extend(self.codec.encode(frame))
            done = True
            self._packets.extend(self.codec.encode())
        except BaseException as exc:  # noqa: BLE001 - handed to the muxing thread by packets()
            self._error = exc
            while not done:
                done = self._frames.get() is None


def check_parameter_sets(stream_ctx, segment: Segment) -> None:
    """A segment's own encoder must have written the stream's parameter sets, or its frames would decode wrongly."""
    if segment.codec is not stream_ctx and segment.codec.extradata != stream_ctx.extradata:
        raise InputError(f"the x264 encoder of the segment at frame {segment.first} made other parameter sets than "
                         f"the stream's; set {SEGMENT_ENV}=0 to encode with one encoder")
