"""Files the service reads and writes, confined to its --input-dir and --output-dir.

A client names files by relative path. A name is refused (400) when it is absolute, has a '..' or empty
component, a backslash or NUL, or resolves (following symlinks, of the folders and of the file itself)
outside the folder. Outputs are .mp4 files whose folder already exists; they are written under a
hidden temporary name in the same folder and moved into place with os.replace, so a reader never
sees half a file, and an existing file is replaced only when the request said overwrite (else 409).

A temporary file outlives its job when the process dies or stops while the job decodes (the decode
cannot be interrupted). Its writer holds an exclusive flock on it for as long as the name exists, so
`OutputFolder.sweep_partials` (run when a service starts) can remove exactly the ones no live process,
this one or another service sharing the folder, is writing. Two limits: a service of an older h3-spark
(before the lock) writes the same names unlocked, so do not start a new service on a folder an old one is
still writing to; and on NFS, where flock is emulated with POSIX locks that close with any descriptor of the
file, the encoder closing its own descriptor at `finish` can drop the lock for the moment before the move.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Iterator

from ..errors import InputError
from ..h3_model.media import files as media
from .validation import RequestError

try:
    import fcntl
except ImportError:  # Windows: no flock, so a stale partial cannot be told from a live one
    fcntl = None

TEMP_PREFIX = "."  # temporary outputs are hidden files; clients may not name hidden files
# What partial_name gives for a job id (jobs.Job: uuid4 hex); the sweep removes nothing else.
PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial\.mp4")
NAME_MAX = 255  # bytes in one path component on common file systems
SUFFIXES = {"image": media.IMAGE_SUFFIXES, "video": media.VIDEO_SUFFIXES, "audio": media.AUDIO_SUFFIXES}


def partial_name(job_id: str) -> str:
    # Named by the job alone, so any accepted output name leaves room for it.
    return f"{TEMP_PREFIX}{job_id}.partial.mp4"


def _create_locked(path: Path) -> int:
    """Create `path` and return an fd that holds an exclusive flock on it (none without fcntl). The caller
    keeps the fd open until the name is gone (moved into place or unlinked)."""
    for _ in range(3):
        # O_EXCL: never write through a symlink or into a file someone else made under this name.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (ENOLCK): a sweep cannot lock the file either, so keeps it
            return fd
        # A sweep may have locked and removed the file between the create and the flock (a lock on a file
        # that has no name any more protects nothing): then make it again.
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise InputError(f"{path}: the temporary output was removed as it was created, three times; another "
                     f"process keeps deleting files in the output folder")


def _remove_if_unlocked(path: Path) -> bool:
    """Unlink `path` when no process holds a flock on it (its writer is gone); False when it is kept."""
    try:
        # O_RDWR: NFS emulates flock with POSIX locks, and an exclusive one needs a writable fd.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # gone meanwhile, a symlink, or not ours to open
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            return False
        # Between the open and the flock its writer may have moved it into place (and a new file could,
        # in principle, have taken the name): unlink only the file that was found unlocked.
        try:
            if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                return False
            os.unlink(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


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

    def sweep_partials(self) -> list[Path] | None:
        """Remove the temporary outputs (`.<job id>.partial.mp4`, in any folder under the root) that no
        process is writing, and return them; None where there is no fcntl (nothing is removed then).
        Run it before this service starts jobs: NFS's emulated flock does not keep a process from
        taking its own lock again, so a sweep must not run beside this process's own writers."""
        if fcntl is None:
            return None
        removed = []
        for folder, _, files in os.walk(self.root):
            for name in sorted(files):
                path = Path(folder, name)
                if PARTIAL.fullmatch(name) and _remove_if_unlocked(path):
                    removed.append(path)
        return removed

    @contextlib.contextmanager
    def mp4_stream(self, path: Path, job_id: str, *, overwrite: bool) -> Iterator[media.Mp4Stream]:
        """A `media.Mp4Stream` on a hidden temporary file next to `path` (frames can be added while the job
        still decodes), moved into place when the block ends after `finish`; removed otherwise."""
        rel = path.relative_to(self.root).as_posix()
        # Checked again: a symlink or a file may have appeared since the request was accepted.
        path = self.check(rel, overwrite)
        tmp = path.with_name(partial_name(job_id))
        # The encoder opens the file again by name (same inode): the lock on this fd covers what it writes.
        fd = _create_locked(tmp)
        stream = None
        try:
            stream = media.Mp4Stream(tmp)
            yield stream
            if not stream.finished:
                raise InputError(f"{rel!r}: the mp4 was not finished")
            # Once more before the move: the file or a symlink may have appeared while the job ran.
            os.replace(tmp, self.check(rel, overwrite))
        finally:
            if stream is not None:
                stream.abort()
            tmp.unlink(missing_ok=True)
            os.close(fd)  # only now: a sweep must not find the name unlocked while this job still owns it
