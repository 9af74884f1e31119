"""Files the service reads and writes, confined to its --input-dir and --output-dir.

A client names files by relative path. A name is refused (400) when it is absolute, has a '..' or empty
component, a backslash or NUL, or resolves (following symlinks, of the folders and of the file itself)
outside the folder. Outputs are .mp4 files whose folder already exists; they are written under a
hidden temporary name in the same folder and moved into place with os.replace, so a reader never
sees half a file, and an existing file is replaced only when the request said overwrite (else 409).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..h3_model import media
from ..h3_model.errors import InputError
from .validation import RequestError

TEMP_PREFIX = "."  # temporary outputs are hidden files; clients may not name hidden files
NAME_MAX = 255  # bytes in one path component on common file systems
SUFFIXES = {"image": media.IMAGE_SUFFIXES, "video": media.VIDEO_SUFFIXES, "audio": media.AUDIO_SUFFIXES}


class OutputExists(RequestError):
    def __init__(self, message: str):
        super().__init__(409, message)


class Folder:
    def __init__(self, root: str | os.PathLike, what: str):
        path = Path(root)
        if not path.is_dir():
            raise InputError(f"{path}: the {what} folder does not exist")
        self.root = path.resolve()
        self.what = what

    def confine(self, name: str) -> Path:
        """The absolute path for a client's relative name, or RequestError(400)."""
        if not isinstance(name, str) or not name:
            raise RequestError(400, f"a path in the {self.what} folder must be a non-empty string")
        if "\x00" in name or "\\" in name:
            raise RequestError(400, f"{name!r}: NUL and backslash are not allowed in paths")
        pure = PurePosixPath(name)
        if pure.is_absolute() or name.startswith("~"):
            raise RequestError(400, f"{name!r}: give a path relative to the {self.what} folder, not an absolute one")
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise RequestError(400, f"{name!r}: empty, '.' and '..' path components are not allowed")
        try:
            too_long = any(len(p.encode("utf-8")) > NAME_MAX for p in parts)
        except UnicodeEncodeError:
            raise RequestError(400, f"{name!r} is not valid Unicode") from None
        if too_long:
            raise RequestError(400, f"{name!r}: a path component is longer than {NAME_MAX} bytes")
        candidate = self.root.joinpath(*parts)
        # resolve() follows every symlink on the way, the final component included when it exists.
        try:
            resolved = candidate.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop, a path the system refuses
            raise RequestError(400, f"{name!r} cannot be resolved in the {self.what} folder ({exc})") from None
        if not resolved.is_relative_to(self.root):
            raise RequestError(400, f"{name!r} leads outside the {self.what} folder")
        return candidate


class InputFolder(Folder):
    def __init__(self, root: str | os.PathLike, max_file_bytes: int):
        super().__init__(root, "input")
        self.max_file_bytes = max_file_bytes

    def media(self, name: str, kind: str) -> Path:
        path = self.confine(name)
        if path.suffix.lower() not in SUFFIXES[kind]:
            raise RequestError(400, f"{name!r}: a {kind} must be one of {', '.join(SUFFIXES[kind])}")
        if not path.is_file():
            raise RequestError(400, f"{name!r}: no such file in the input folder")
        size = path.stat().st_size
        if size > self.max_file_bytes:
            raise RequestError(413, f"{name!r} is {size} bytes; the limit for an input file is "
                                    f"{self.max_file_bytes}")
        return path


class OutputFolder(Folder):
    def __init__(self, root: str | os.PathLike):
        super().__init__(root, "output")
        self._lock = threading.Lock()
        self._reserved: dict[Path, str] = {}

    def check(self, name: str, overwrite: bool) -> Path:
        path = self.confine(name)
        if path.name.startswith(TEMP_PREFIX):
            raise RequestError(400, f"{name!r}: hidden names (starting with '.') are reserved for temporary files")
        if path.suffix.lower() != ".mp4":
            raise RequestError(400, f"{name!r}: the output must be an .mp4 file")
        if not path.parent.is_dir():
            raise RequestError(400, f"{name!r}: its folder does not exist in the output folder")
        if path.is_symlink():
            raise RequestError(400, f"{name!r} is a symlink; name a plain file")
        if path.is_dir():
            raise OutputExists(f"{name!r} is a folder in the output folder")
        if path.exists() and not overwrite:
            raise OutputExists(f"{name!r} already exists in the output folder; send \"overwrite\": true to replace it")
        return path

    def reserve(self, name: str, overwrite: bool, job_id: str) -> Path:
        """Check a name and hold it for one job, so two queued jobs cannot write the same file."""
        with self._lock:
            path = self.check(name, overwrite)
            holder = self._reserved.get(path)
            if holder is not None:
                raise OutputExists(f"{name!r} is the output of job {holder}, which has not finished")
            self._reserved[path] = job_id
            return path

    def release(self, path: Path | None) -> None:
        with self._lock:
            self._reserved.pop(path, None)

    @contextlib.contextmanager
    def mp4_stream(self, path: Path, job_id: str, *, overwrite: bool) -> Iterator[media.Mp4Stream]:
        """A `media.Mp4Stream` on a hidden temporary file next to `path` (frames can be added while the job
        still decodes), moved into place when the block ends after `finish`; removed otherwise."""
        rel = path.relative_to(self.root).as_posix()
        # Checked again: a symlink or a file may have appeared since the request was accepted.
        path = self.check(rel, overwrite)
        # Named by the job alone, so any accepted output name leaves room for it.
        tmp = path.with_name(f"{TEMP_PREFIX}{job_id}.partial.mp4")
        stream = media.Mp4Stream(tmp)
        try:
            yield stream
            if not stream.finished:
                raise InputError(f"{rel!r}: the mp4 was not finished")
            # Once more before the move: the file or a symlink may have appeared while the job ran.
            os.replace(tmp, self.check(rel, overwrite))
        finally:
            stream.abort()
            if tmp.exists():
                tmp.unlink()
