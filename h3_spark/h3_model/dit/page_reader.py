"""Bringing the file pages under memory-mapped host tensors into memory with several threads, ahead of the copies
that need them.

The text encoder's streamed layers are copied from the memory-mapped checkpoint (streaming.BlockStream, in place)
when the host has no room to pin them. From a cold page cache such a copy waits on its pages one readahead window
at a time, with at most the next unit advised (madvise WILLNEED). Here T threads take a unit 8 MB at a time: each
advises its piece (the kernel queues the whole piece's reads at once) and then reads one byte of every page of it
through the mapping, which returns once the pages are in memory and mapped. Nothing is copied: the page cache is
the buffer (the kernel reclaims it first), so reading ahead costs no host memory of the process's own and no
memory bandwidth, and the copy that follows finds its pages mapped. A job keeps its tensor alive, so the mapping
cannot go away under a running read. benchmarks/disk_read_cpu.py measures the ways on a machine's disk.
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future

import torch

from ...errors import InputError
from .streaming import advise_willneed

CHUNK = 8 * 2 ** 20  # one piece: enough queued reads to keep a disk busy, small enough to spread over threads
PAGE = 4096


def touch_pages(flat: torch.Tensor, start: int, end: int) -> int:
    """Bring the pages under flat[start:end] (a uint8 view of a mapping) into memory: advise the range, then read a
    byte of every page (torch releases the GIL meanwhile). Returns the bytes covered."""
    if end <= start:
        return 0
    advise_willneed(flat.data_ptr() + start, end - start)
    flat[start:end:PAGE].max()
    flat[end - 1].item()  # the last page, which the stride can step over
    return end - start


class Reading:
    """The reads of one set of tensors, in flight on a PageReader's threads."""

    def __init__(self, jobs: list[Future]):
        self.jobs = jobs

    def done(self) -> bool:
        return all(job.done() for job in self.jobs)

    def wait(self) -> None:
        """Until every read is done; a failed read raises here, in the thread that needs the pages."""
        for job in self.jobs:
            job.result()


class _Queue:
    """What a reader's threads share: the pieces to read, the count read, whether the reader is closed. The threads
    hold this, not the reader, so a reader nobody closes is still collected, and its finalizer stops them."""

    def __init__(self, threads: int):
        self.pieces: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False
        self.bytes_read = 0
        self.threads = threads

    def work(self) -> None:
        while True:
            item = self.pieces.get()
            if item is None:
                return
            job, flat, start, end = item
            if self.closed:
                job.cancel()
                continue
            if not job.set_running_or_notify_cancel():
                continue
            try:
                covered = touch_pages(flat, start, end)
            except BaseException as exc:  # handed to the thread that waits for these pages
                job.set_exception(exc)
                continue
            with self.lock:
                self.bytes_read += covered
            job.set_result(covered)

    def stop(self) -> None:
        """Pieces not started are cancelled; each thread ends after the piece it is reading."""
        self.closed = True
        while True:
            try:
                item = self.pieces.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self.threads):
            self.pieces.put(None)


class PageReader:
    """`threads` threads bringing host tensors' pages into memory, pieces served in the order they were given.

    The threads are daemons of our own rather than a ThreadPoolExecutor's: at interpreter exit an executor's
    workers finish every queued piece first, and a reader primed with a whole text encoder would hold a process
    that is done (a server stopped right after its load) for the seconds the disk needs."""

    def __init__(self, threads: int, chunk: int = CHUNK):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"a page reader needs at least one thread, got {threads!r}")
        if chunk < PAGE or chunk % PAGE:
            raise InputError(f"a page reader's piece must be a whole number of pages ({PAGE} bytes), got {chunk}")
        self.threads, self.chunk = threads, chunk
        self._shared = _Queue(threads)
        self._workers = [threading.Thread(target=self._shared.work, name=f"h3-page-reader-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()
        self._finalizer = weakref.finalize(self, self._shared.stop)

    @property
    def bytes_read(self) -> int:
        return self._shared.bytes_read

    def read(self, tensors) -> Reading:
        """Queue every page of the (contiguous, CPU) tensors; the pieces of one tensor go in order."""
        if self._shared.closed:
            raise InputError("this page reader is closed")
        jobs = []
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise InputError(f"a page reader reads contiguous host tensors, got one on {t.device} "
                                 f"(contiguous: {t.is_contiguous()})")
            flat = t.detach().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), self.chunk):
                job = Future()
                jobs.append(job)
                self._shared.pieces.put((job, flat, start, min(flat.numel(), start + self.chunk)))
        return Reading(jobs)

    def close(self, wait: bool = True) -> None:
        """Stop: pieces not started are dropped (their jobs cancelled); `wait`: until the running ones end (else
        they end on their own)."""
        self._finalizer()
        if wait:
            for worker in self._workers:
                worker.join()
