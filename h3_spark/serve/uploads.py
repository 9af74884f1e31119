"""Files clients upload (the `/v1/videos` routes' `input_reference`, an extension's `video`): read from a
multipart/form-data body as it streams, each checked against its size limit while it arrives, written straight under
the state folder with a name made here (never the client's), and kept only if it decodes as an image, a video or a
sound the engine reads. What the client declared (the part's Content-Type) must agree with what the bytes are.

  form        `read_form`: text fields in memory (each at most `max_field_bytes`, at most `max_fields`), file parts
              only in the fields that take one, each at most `max_file_bytes` (413 the moment it passes), the whole
              body within `timeout_s` (408)
  files       `UploadFolder`: `<state folder>/.h3-spark-uploads/<uuid><suffix>`; the suffix comes from the
              container PyAV finds, the kind from its streams; the file is then read by the engine's own reader
              (media/files.py) with the service's pixel limits, so an upload that is accepted is one a job can read
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request

from ..errors import H3Error
from ..h3_model import geometry
from ..h3_model.media import files as media
from .http_limits import ClientGone, body_chunks
from .validation import Limits, RequestError

UPLOADS = ".h3-spark-uploads"  # hidden: no client can name it as an output or an input
# The containers the engine's readers take (media/files.py's suffixes), by PyAV's format name.
_IMAGE_FORMATS = {"png_pipe": ".png", "jpeg_pipe": ".jpg", "webp_pipe": ".webp"}
_VIDEO_FORMATS = {"mov,mp4,m4a,3gp,3g2,mj2": ".mp4", "matroska,webm": ".webm"}
_AUDIO_FORMATS = {"wav": ".wav", "flac": ".flac", "mp3": ".mp3", "mov,mp4,m4a,3gp,3g2,mj2": ".m4a"}
# A declared Content-Type that says nothing about the bytes; any other must name the kind they are.
_GENERIC_TYPES = ("", "application/octet-stream")


@dataclass(frozen=True)
class Upload:
    field: str
    path: Path
    kind: str  # image | video | audio
    size: int


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, Upload] = field(default_factory=dict)

    def discard(self) -> None:
        for upload in self.files.values():
            upload.path.unlink(missing_ok=True)


class UploadFolder:
    def __init__(self, state_dir: str | os.PathLike, limits: Limits):
        self.root = Path(state_dir) / UPLOADS
        self.limits = limits

    def partial(self) -> Path:
        self.root.mkdir(mode=0o700, exist_ok=True)
        return self.root / f".{uuid.uuid4().hex}.part"

    def accept(self, field_name: str, partial: Path, declared: str) -> Upload:
        """Name the received bytes by what they decode to and check that the engine reads them; removed and
        refused (400) otherwise."""
        try:
            kind, suffix, what = _probe(partial, field_name)
            if declared not in _GENERIC_TYPES and declared.split("/")[0] != kind:
                raise _refuse(field_name, f"is declared {declared} but holds {what}")
            final = partial.with_name(f"{uuid.uuid4().hex}{suffix}")
            partial.rename(final)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        try:
            self._decode(final, kind)
        except H3Error as exc:
            final.unlink(missing_ok=True)
            # The engine's reader names our file; the client knows its field.
            reason = str(exc).replace(f"{final}: ", "")
            raise _refuse(field_name, f"({what}) cannot be read: {reason}") from None
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        return Upload(field_name, final, kind, final.stat().st_size)

    def _decode(self, path: Path, kind: str) -> None:
        limits = self.limits
        if kind == "image":
            media.read_image(path, max_pixels=limits.max_image_pixels)
        elif kind == "video":
            media.read_video(path, fps=geometry.FPS, max_frames=1, with_audio=False,
                             max_pixels=limits.max_video_frame_pixels)
        else:
            media.read_audio_clip(path, max_seconds=1.0)


def _refuse(field_name: str, problem: str) -> RequestError:
    return RequestError(400, f"{field_name} {problem}; upload a png, jpeg or webp image, an mp4 or webm video, or a "
                             f"wav, flac, mp3 or m4a sound", param=field_name, code="invalid_file")


def _probe(path: Path, field_name: str) -> tuple[str, str, str]:
    """(kind, suffix, a description) of a file by its content: PyAV's container and its streams."""
    av = media._av()
    with media.ffmpeg_log(None):
        try:
            container = av.open(str(path))
        except (av.error.FFmpegError, OSError, UnicodeDecodeError):
            raise _refuse(field_name, "is not an image, a video or a sound") from None
        with container:
            name = container.format.name
            video, audio = bool(container.streams.video), bool(container.streams.audio)
    if name in _IMAGE_FORMATS and video:
        return "image", _IMAGE_FORMATS[name], f"a {_IMAGE_FORMATS[name][1:]} image"
    if name in _VIDEO_FORMATS and video:
        return "video", _VIDEO_FORMATS[name], f"a {_VIDEO_FORMATS[name][1:]} video"
    if name in _AUDIO_FORMATS and audio and not video:
        return "audio", _AUDIO_FORMATS[name], f"a {_AUDIO_FORMATS[name][1:]} sound"
    raise _refuse(field_name, f"is a {name} file")


class _FormParser:
    """python-multipart's callbacks: each part's headers, then its bytes to memory (a field) or to a file."""

    def __init__(self, folder: UploadFolder, file_fields: tuple[str, ...], max_field_bytes: int, max_fields: int,
                 max_file_bytes: int):
        self.folder, self.file_fields = folder, file_fields
        self.max_field_bytes, self.max_fields, self.max_file_bytes = max_field_bytes, max_fields, max_file_bytes
        self.form = Form()
        self.received: list[tuple[str, Path, str]] = []  # (field, partial file, declared type)
        self._headers: dict[bytes, bytes] = {}
        self._name = self._value = b""
        self._part: dict | None = None

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._headers, self._part = {}, None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._name.strip().lower()] = self._value.strip()
        self._name = self._value = b""

    def _headers_done(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise RequestError(400, "a multipart part has no field name (Content-Disposition: form-data; name=...)")
        if b"filename" in options:
            if name not in self.file_fields:
                raise RequestError(400, f"{name} takes no file; files go in {', '.join(self.file_fields)}",
                                   param=name)
            if any(f == name for f, _, _ in self.received):
                raise RequestError(400, f"{name} is given twice", param=name)
            declared = self._headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            path = self.folder.partial()
            self._part = {"name": name, "file": open(path, "xb"), "size": 0}
            self.received.append((name, path, declared))
        else:
            if len(self.form.fields) >= self.max_fields:
                raise RequestError(400, f"the form has more than {self.max_fields} fields")
            if name in self.form.fields:
                raise RequestError(400, f"{name} is given twice", param=name)
            self._part = {"name": name, "data": bytearray()}

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if "file" in part:
            part["size"] += end - start
            if part["size"] > self.max_file_bytes:
                raise RequestError(413, f"{part['name']} is larger than the {self.max_file_bytes} byte limit for an "
                                        f"upload (--max-input-mb)", param=part["name"], code="file_too_large")
            part["file"].write(data[start:end])
        else:
            part["data"] += data[start:end]
            if len(part["data"]) > self.max_field_bytes:
                raise RequestError(413, f"the form field {part['name']} is larger than {self.max_field_bytes} bytes",
                                   param=part["name"])

    def _end(self) -> None:
        part = self._part
        if "file" in part:
            part["file"].close()
        else:
            try:
                self.form.fields[part["name"]] = bytes(part["data"]).decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(400, f"the form field {part['name']} is not UTF-8", param=part["name"]) from None
        self._part = None

    def close(self) -> None:
        if self._part is not None and "file" in self._part:
            self._part["file"].close()


async def read_form(request: Request, folder: UploadFolder, *, file_fields: tuple[str, ...], max_field_bytes: int,
                    max_fields: int, max_file_bytes: int, timeout_s: float) -> Form:
    """A multipart/form-data body: its fields, and its files checked and stored (`UploadFolder.accept`). Nothing
    stays on disk when it is refused."""
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if not boundary:
        raise RequestError(400, "a multipart/form-data body needs its boundary in the Content-Type header")
    parser = _FormParser(folder, file_fields, max_field_bytes, max_fields, max_file_bytes)
    body = MultipartParser(boundary, parser.callbacks())
    try:
        try:
            async for chunk in body_chunks(request, timeout_s):
                body.write(chunk)
            body.finalize()
        except (RequestError, ClientGone):
            raise
        except Exception as exc:  # noqa: BLE001 - python-multipart's parse errors: a malformed body
            raise RequestError(400, f"the multipart body is malformed ({exc})") from None
        finally:
            parser.close()
        for name, path, declared in parser.received:
            # Moved into the form as each is accepted, so a later refusal removes the earlier ones too.
            parser.form.files[name] = await asyncio.to_thread(folder.accept, name, path, declared)
    except BaseException:
        parser.form.discard()
        for _, path, _ in parser.received:
            path.unlink(missing_ok=True)
        raise
    return parser.form
