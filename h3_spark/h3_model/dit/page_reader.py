"""Reading the file pages under memory-mapped host tensors with several threads, ahead of the copies that need them.

The text encoder's streamed layers are copied from the memory-mapped checkpoint (streaming.BlockStream, in place)
when the host has no room to pin them. From a cold page cache such a copy waits on its pages one readahead window
at a time, with at most the next unit advised (madvise WILLNEED). A disk that serves several requests at once
delivers more: here T threads pread(2) a unit's bytes, 8 MB a request, into scratch buffers of their own, so the
pages land in the page cache where the copy then finds them, several units ahead of it. The bytes read are not
kept: the page cache is the buffer (the kernel reclaims it first), so reading ahead costs no host memory of the
process's own. benchmarks/disk_read_cpu.py measures both ways on a machine's disk.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ...errors import CheckpointError, InputError

CHUNK = 8 * 2 ** 20  # one pread: large enough to keep a request queue full, small enough to spread over threads
MAPS = "/proc/self/maps"


@dataclass(frozen=True)
class FileSpan:
    path: str
    offset: int
    nbytes: int


def _file_mappings(maps: str = MAPS) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of every mapping of a regular file, by start address."""
    out = []
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue  # anonymous memory, the heap, the stack, [vdso]
        path = fields[5]
        if path.endswith(" (deleted)"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append((start, end, int(fields[2], 16), path))
    out.sort()
    return out


def file_spans(tensors, mappings: list | None = None, maps: str = MAPS) -> list[FileSpan]:
    """Where the tensors' bytes lie in the files they are mapped from, adjacent spans merged. A tensor that is no
    view of a file mapping (a copy in anonymous memory, say) is in memory already: nothing to read, no span.
    `mappings`: _file_mappings() read once for many calls."""
    mappings = _file_mappings(maps) if mappings is None else mappings
    starts = [m[0] for m in mappings]
    spans: list[FileSpan] = []
    for t in tensors:
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        k = bisect.bisect_right(starts, ptr) - 1
        if nbytes == 0 or k < 0 or ptr + nbytes > mappings[k][1]:
            continue
        start, _, offset, path = mappings[k]
        span = FileSpan(path, offset + ptr - start, nbytes)
        last = spans[-1] if spans else None
        if last is not None and last.path == span.path and last.offset + last.nbytes == span.offset:
            spans[-1] = FileSpan(path, last.offset, last.nbytes + nbytes)
        else:
            spans.append(span)
    return spans


class Reading:
    """The reads of one set of spans, in flight on a PageReader's threads."""

    def __init__(self, jobs: list[Future]):
        self.jobs = jobs

    def done(self) -> bool:
        return all(job.done() for job in self.jobs)

    def wait(self) -> None:
        """Until every read is done; a failed read raises here, in the thread that needs the pages."""
        for job in self.jobs:
            job.result()


class PageReader:
    """`threads` threads reading file spans into the page cache, requests served in the order they were given."""

    def __init__(self, threads: int, chunk: int = CHUNK):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"a page reader needs at least one thread, got {threads!r}")
        if chunk < 4096:
            raise InputError(f"a page reader's request must be at least one page (4096 bytes), got {chunk}")
        self.threads, self.chunk = threads, chunk
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="h3-page-reader")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self.bytes_read = 0

    def read(self, spans: list[FileSpan]) -> Reading:
        jobs = []
        for span in spans:
            end = span.offset + span.nbytes
            for offset in range(span.offset, end, self.chunk):
                jobs.append(self._pool.submit(self._read, span.path, offset, min(self.chunk, end - offset)))
        return Reading(jobs)

    def open(self, paths) -> None:
        """Open the files to be read now, so that a file this process cannot open is refused before any read is
        queued (OSError), not in the thread that waits for its pages."""
        with self._lock:
            for path in paths:
                if path not in self._fds:
                    self._fds[path] = os.open(path, os.O_RDONLY)

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _read(self, path: str, offset: int, nbytes: int) -> None:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = bytearray(self.chunk)
        view, done, fd = memoryview(scratch)[:nbytes], 0, self._fd(path)
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{path}: the file ends before byte {offset + nbytes} "
                                      f"(read ahead of a streamed layer's copy; the file changed since it was loaded)")
            done += got
        with self._lock:
            self.bytes_read += nbytes

    def close(self, wait: bool = True) -> None:
        """Stop: requests not started are dropped. `wait`: until the running ones end; else they end on their own
        and the files close after them (never under a running read)."""
        if wait:
            self._finish(cancel=True)
        else:
            threading.Thread(target=self._finish, kwargs={"cancel": True}, daemon=True,
                             name="h3-page-reader-close").start()

    def _finish(self, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
