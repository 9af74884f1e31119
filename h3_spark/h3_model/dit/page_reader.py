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

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ...errors import InputError

CHUNK = 8 * 2 ** 20  # one piece: enough queued reads to keep a disk busy, small enough to spread over threads
PAGE = 4096


def touch_pages(flat: torch.Tensor, start: int, end: int) -> int:
    """Bring the pages under flat[start:end] (a uint8 view of a mapping) into memory: advise the range, then read a
    byte of every page (torch releases the GIL meanwhile). Returns the bytes covered."""
    from .streaming import advise_willneed

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


class PageReader:
    """`threads` threads bringing host tensors' pages into memory, pieces served in the order they were given."""

    def __init__(self, threads: int, chunk: int = CHUNK):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"a page reader needs at least one thread, got {threads!r}")
        if chunk < PAGE or chunk % PAGE:
            raise InputError(f"a page reader's piece must be a whole number of pages ({PAGE} bytes), got {chunk}")
        self.threads, self.chunk = threads, chunk
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="h3-page-reader")
        self._lock = threading.Lock()
        self.bytes_read = 0

    def read(self, tensors) -> Reading:
        """Queue every page of the (contiguous, CPU) tensors; the pieces of one tensor go in order."""
        jobs = []
        for t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise InputError(f"a page reader reads contiguous host tensors, got one on {t.device} "
                                 f"(contiguous: {t.is_contiguous()})")
            flat = t.detach().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), self.chunk):
                jobs.append(self._pool.submit(self._read, flat, start, min(flat.numel(), start + self.chunk)))
        return Reading(jobs)

    def _read(self, flat: torch.Tensor, start: int, end: int) -> None:
        covered = touch_pages(flat, start, end)
        with self._lock:
            self.bytes_read += covered

    def close(self, wait: bool = True) -> None:
        """Stop: pieces not started are dropped; `wait`: until the running ones end (else they end on their own)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
