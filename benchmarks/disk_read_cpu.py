"""How fast a cold checkpoint reaches host memory on this machine's disk, read the ways our loaders can read it;
JSON to --out.

Usage (repository root, on the machine whose disk is in question; no root needed):
    python3 benchmarks/disk_read_cpu.py --out $OUT/disk.json [--dir /tmp] [--gb 8] [--repeats 3]
CPU smoke:
    python3 benchmarks/disk_read_cpu.py --gb 0.05 --unit-mb 4 --repeats 1 --out /tmp/disk.json

Why: from cold, the consumer box's text encode is its text layers' read (13.7 GB at ~1.05 GB/s on one H100 machine,
~1.4 GB/s on another: receipts/h100/README.md). `willneed-1` emulates the stream's read-ahead without a page
reader, `stream-T` is the stream itself with a page reader of T threads (dit/page_reader.py; H3_READ_THREADS, off
by default since this benchmark found the H100 machine's disk capped at ~1.1 GB/s whatever reads it).

A file of --gb random bytes is written once into --dir (fsynced) and read as units of --unit-mb (a text layer is
274 MB). Before every read the file's pages are dropped with posix_fadvise(DONTNEED) while nothing maps it, so each
read starts cold; the resident fraction after the drop is recorded (mincore) to show it did. Columns, interleaved
over --repeats, each a median GB/s:
- `sequential`: one pread of 8 MB after another, as a plain loader reads;
- `willneed-D`: the text encoder's in-place stream (dit/streaming.py): the file mapped, the unit D ahead advised
  with `advise_willneed` (madvise WILLNEED) while the current unit is copied out of the mapping; D = 1 is what the
  stream does today;
- `pread-T`: T threads, each reading its share of a unit with pread, unit after unit: what several reads in flight
  give, whoever issues them;
- `stream-T`: the product's own path: the file mapped copy-on-write as safetensors maps a checkpoint, each unit a
  module whose buffer is a view of the mapping, streamed in place by `BlockStream` on the CPU (a copy is a memcpy
  into a slot) with a page reader of T threads (`dit/page_reader.py`, every unit in its window and primed first,
  as in the 24 GB / 32 GB box), or T = 0: the madvise read-ahead (H3_READ_THREADS=0). The stream's wrap-around
  copies the first two units again at the end (from the page cache), as it does between prompts.
Every column checks what it read against the file, unit by unit (64 sampled pages, the last one included), so a
faster column cannot be a shorter read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = 8 * 2 ** 20
DEFAULT_COLUMNS = "sequential,willneed-1,willneed-4,pread-4,pread-8,pread-16,stream-0,stream-8"


def write_file(path: Path, nbytes: int, seed: int = 0) -> None:
    """Random bytes (incompressible, so no storage layer reads them faster than they are), fsynced."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(64 * 2 ** 20, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def units_of(nbytes: int, unit: int) -> list[tuple[int, int]]:
    return [(off, min(unit, nbytes - off)) for off in range(0, nbytes, unit)]


SAMPLES, SAMPLE = 64, 4096  # what each unit's fingerprint reads: 64 windows of a page, first and last included


def digest(view) -> str:
    """A unit's fingerprint from SAMPLES evenly spaced pages of it (its last page too, so a short read shows):
    cheap enough to sit inside the timed read, where hashing every byte would cost as much as reading it."""
    n = len(view)
    starts = sorted({min(n - 1, i * max(0, n - SAMPLE) // (SAMPLES - 1)) for i in range(SAMPLES)})
    h = hashlib.blake2b(n.to_bytes(8, "little"), digest_size=16)
    for s in starts:
        h.update(view[s:s + SAMPLE])
    return h.hexdigest()


def drop_pages(path: Path) -> float | None:
    """Drop the file's clean pages from the page cache; the fraction still resident after (None off Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def resident_fraction(path: Path) -> float | None:
    """mincore over the whole file: the fraction of its pages in the page cache."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    page = mmap.PAGESIZE
    pages = -(-size // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def read_sequential(path: Path, units, buf: np.ndarray) -> list[str]:
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in units:
            view = memoryview(buf)[:n]
            done = 0
            while done < n:
                done += os.preadv(fd, [view[done:min(n, done + CHUNK)]], off + done)
            out.append(digest(view))
    finally:
        os.close(fd)
    return out


def read_willneed(path: Path, units, buf: np.ndarray, depth: int) -> list[str]:
    """The stream's in-place path: map the file, advise the unit `depth` ahead, copy the current one out."""
    from h3_spark.h3_model.dit.streaming import advise_willneed

    out = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        whole = np.frombuffer(mm, dtype=np.uint8)
        base = whole.ctypes.data
        for off, n in units[:depth]:
            advise_willneed(base + off, n)
        for k, (off, n) in enumerate(units):
            if k + depth < len(units):
                ahead_off, ahead_n = units[k + depth]
                advise_willneed(base + ahead_off, ahead_n)
            np.copyto(buf[:n], whole[off:off + n])
            out.append(digest(memoryview(buf)[:n]))
        del whole
    return out


def read_threads(path: Path, units, buf: np.ndarray, threads: int, pool: ThreadPoolExecutor) -> list[str]:
    out = []
    fd = os.open(path, os.O_RDONLY)

    def share(off: int, start: int, end: int) -> None:
        view = memoryview(buf)
        while start < end:
            start += os.preadv(fd, [view[start:min(end, start + CHUNK)]], off + start)

    try:
        for off, n in units:
            step = -(-n // threads)
            jobs = [pool.submit(share, off, s, min(n, s + step)) for s in range(0, n, step)]
            for job in jobs:
                job.result()
            out.append(digest(memoryview(buf)[:n]))
    finally:
        os.close(fd)
    return out


def read_stream(path: Path, units, threads: int) -> list[str]:
    """`stream-T`: BlockStream in place over the mapped file, each unit's forward fingerprinting its slot's bytes."""
    import gc

    import torch

    from h3_spark.h3_model.dit.page_reader import PageReader
    from h3_spark.h3_model.dit.streaming import BlockStream

    class Unit(torch.nn.Module):
        def forward(self, out: list) -> None:
            out.append(digest(memoryview(self.data.numpy())))

    out: list[str] = []
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        mods = torch.nn.ModuleList()
        for off, n in units:
            mods.append(Unit())
            mods[-1].register_buffer("data", whole[off:off + n])
        stream = BlockStream(mods, list(range(len(mods))), "cpu", depth=2, in_place=True)
        if threads:
            why = stream.attach_reader(PageReader(threads), len(mods))
            if why is not None:
                raise SystemExit(f"stream-{threads}: no page reader ({why})")
            stream.prime()
        for m in mods:
            m(out)
        stream.restore()
        del stream, mods, whole, m
    finally:
        gc.collect()
        mm.close()
    return out


def parse_columns(text: str) -> list[tuple[str, int]]:
    columns = []
    for name in (c.strip() for c in text.split(",") if c.strip()):
        kind, _, n = name.partition("-")
        if name == "sequential":
            columns.append((name, 0))
        elif kind in ("willneed", "pread") and n.isdigit() and int(n) >= 1:
            columns.append((name, int(n)))
        elif kind == "stream" and n.isdigit():
            columns.append((name, int(n)))
        else:
            raise SystemExit(f"--columns: {name!r} is not sequential, willneed-D, pread-T or stream-T (D, T >= 1; "
                             "stream-0: no page reader)")
    if not columns:
        raise SystemExit("--columns: none given")
    return columns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--dir", default="/tmp", help="where the file is written (the disk measured)")
    p.add_argument("--gb", type=float, default=8.0, help="file size in GB (more than the disk's own cache)")
    p.add_argument("--unit-mb", type=float, default=274.0, help="one read unit (a text layer: 274 MB)")
    p.add_argument("--columns", default=DEFAULT_COLUMNS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the file for the next run")
    args = p.parse_args(argv)
    if args.gb <= 0 or args.unit_mb <= 0 or args.repeats < 1:
        raise SystemExit("--gb and --unit-mb must be positive, --repeats at least 1")
    columns = parse_columns(args.columns)
    from h3_spark.measure import stamp

    record = stamp.stamp_before()
    path = Path(args.dir) / "h3-disk-read.bin"
    nbytes = int(args.gb * 1e9)
    if not path.exists() or path.stat().st_size != nbytes:
        t0 = time.perf_counter()
        write_file(path, nbytes)
        print(f"wrote {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    units = units_of(nbytes, int(args.unit_mb * 2 ** 20))
    buf = np.empty(max(n for _, n in units), dtype=np.uint8)
    truth = read_sequential(path, units, buf)  # what every column must read
    seconds = {name: [] for name, _ in columns}
    resident = {name: [] for name, _ in columns}
    pool = ThreadPoolExecutor(max((n for name, n in columns if name.startswith("pread")), default=1))
    try:
        for _ in range(args.repeats):
            for name, n in columns:
                resident[name].append(drop_pages(path))
                t0 = time.perf_counter()
                if name == "sequential":
                    got = read_sequential(path, units, buf)
                elif name.startswith("willneed"):
                    got = read_willneed(path, units, buf, n)
                elif name.startswith("stream"):
                    got = read_stream(path, units, n)
                else:
                    got = read_threads(path, units, buf, n, pool)
                seconds[name].append(time.perf_counter() - t0)
                if got != truth:
                    raise SystemExit(f"{name} read other bytes than the file holds")
                print(f"{name}: {nbytes / seconds[name][-1] / 1e9:.2f} GB/s", file=sys.stderr)
    finally:
        pool.shutdown()
        if not args.keep:
            path.unlink(missing_ok=True)
    first = columns[0][0]
    rates = {name: nbytes / statistics.median(s) / 1e9 for name, s in seconds.items()}
    results = {name: {"gb_per_s": round(rates[name], 3), "vs_first": round(rates[name] / rates[first], 3),
                      "seconds": [round(s, 3) for s in seconds[name]],
                      "resident_after_drop": resident[name]} for name, _ in columns}
    fractions = [f for row in resident.values() for f in row]
    # tmpfs and some network filesystems keep a file's pages whatever the advice: then no read here was cold.
    cold = None if None in fractions else all(f < 0.05 for f in fractions)
    out = {"benchmark": "disk_read_cpu", "file_bytes": nbytes, "unit_bytes": units[0][1], "units": len(units),
           "dir": str(Path(args.dir).resolve()), "cold_reads": cold, "results": results,
           "stamp": stamp.stamp_after(record)}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"cold_reads": cold, **{k: v["gb_per_s"] for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
