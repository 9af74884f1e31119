"""This process's host memory: its resident set now and at its peak, and its cgroup's limit and count.

Under a VRAM budget the weights that do not fit the card wait in host memory (page-locked buffers among them),
so what a run held on the host matters as much as what it held on the GPU. The process's peak resident set
(VmHWM) is what it touched itself; a container is judged by its cgroup's count instead, which also holds the
page cache of the files read (checkpoint shards) and memory pinned for copies, so the cgroup v2 limit and peak
go beside it. Every reader answers None where the system does not say (not Linux, cgroup v1, a malformed file):
a report must never fail a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

GB = 10 ** 9
# Module-level so that tests can point them at a fake tree.
PROC_STATUS = Path("/proc/self/status")
PROC_MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _gb(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / GB, 3)


def _kb_field(path: Path, field: str) -> int | None:
    """A `VmRSS:   1234 kB` line of a /proc file (status, meminfo) in bytes; None without the file or the line,
    or when the line is not a count of kB."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            parts = value.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB":
                return int(parts[0]) * 1024
            return None
    return None


def _status_bytes(field: str) -> int | None:
    return _kb_field(PROC_STATUS, field)


def rss_bytes() -> int | None:
    """Resident bytes now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int | None:
    """Peak resident bytes (VmHWM); else getrusage's ru_maxrss (kB on Linux, bytes on macOS); None on Windows."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def cgroup_path() -> str | None:
    """This process's cgroup v2 path (the `0::/...` line of /proc/self/cgroup); None without one."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = line[3:].strip()
            return path if path.startswith("/") else None
    return None


def _cgroup_bytes(folder: Path, name: str) -> int | None:
    """A memory.* file's count in bytes; None for "max" (no limit), a missing file (memory.peak came with Linux
    5.19) or content that is not a count."""
    try:
        text = (folder / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _tightest_limit(folder: Path) -> int | None:
    """The smallest memory.max from the process's cgroup up to the root: a parent's limit binds its children too
    (systemd and container runtimes often set it one level up)."""
    limits = []
    root = CGROUP_ROOT.resolve()
    folder = folder.resolve()
    while True:
        limit = _cgroup_bytes(folder, "memory.max")
        if limit is not None:
            limits.append(limit)
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    return min(limits, default=None)


def cgroup_memory() -> dict | None:
    """{path, limit_gb, peak_gb, current_gb} of this process's cgroup v2; None without one, or when its memory
    controller cannot be read (no memory.current: cgroup v1 or a hybrid set-up, the host's root cgroup).
    limit_gb None: no limit; peak_gb None: a kernel before 5.19."""
    path = cgroup_path()
    if path is None:
        return None
    folder = CGROUP_ROOT / path.lstrip("/")
    current = _cgroup_bytes(folder, "memory.current")
    if current is None:
        return None
    return {"path": path, "limit_gb": _gb(_tightest_limit(folder)),
            "peak_gb": _gb(_cgroup_bytes(folder, "memory.peak")), "current_gb": _gb(current)}


def _reclaimable_file_bytes(folder: Path) -> int:
    """The clean page cache a cgroup's count holds (memory.stat: the file LRU lists less what is dirty or under
    writeback): the kernel drops it before refusing memory, as MemAvailable counts it on the machine. Shared memory
    sits on the anonymous lists and is not in it. 0 when memory.stat is missing or says none of it."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    stat = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stat[parts[0]] = int(parts[1])
    cached = stat.get("active_file", 0) + stat.get("inactive_file", 0)
    return max(0, cached - stat.get("file_dirty", 0) - stat.get("file_writeback", 0))


def available_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable, or less where a cgroup v2 limit up the chain leaves
    less (its limit less its count, the count's clean page cache given back: a cgroup that has read a checkpoint
    sits at its limit with the file's pages, which the kernel reclaims first). None when the system does not say."""
    candidates = [_kb_field(PROC_MEMINFO, "MemAvailable")]  # free memory plus the page cache it can drop
    path = cgroup_path()
    if path is not None:
        folder = (CGROUP_ROOT / path.lstrip("/")).resolve()
        root = CGROUP_ROOT.resolve()
        while True:
            limit, current = _cgroup_bytes(folder, "memory.max"), _cgroup_bytes(folder, "memory.current")
            if limit is not None and current is not None:
                candidates.append(max(0, limit - max(0, current - _reclaimable_file_bytes(folder))))
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def host_memory() -> dict:
    """{rss_gb, peak_rss_gb, cgroup}: now, at the peak, and the cgroup's facts (None outside a cgroup v2)."""
    return {"rss_gb": _gb(rss_bytes()), "peak_rss_gb": _gb(peak_rss_bytes()), "cgroup": cgroup_memory()}


def host_memory_report() -> dict:
    """What summaries, /ready and receipts carry next to their GPU memory: `peak_host_memory_gb` (the process's
    peak resident set) and `host_memory` (host_memory())."""
    memory = host_memory()
    return {"peak_host_memory_gb": memory["peak_rss_gb"], "host_memory": memory}
