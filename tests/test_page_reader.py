"""Reading a streamed text encoder's layers ahead of their copies: the in-place stream's madvise of the next unit, and
dit/page_reader.py, a reader that brings the pages under memory-mapped tensors into memory with several threads."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.errors import InputError
from h3_spark.h3_model.dit import streaming
from h3_spark.h3_model.dit.page_reader import PageReader, touch_pages
from h3_spark.h3_model.engine.flags import read_threads
from h3_spark.h3_model.engine.memory import GB, READ_AHEAD_HEADROOM, read_ahead_window


def _layers_file(path, count=5, width=48, seed=4):
    torch.manual_seed(seed)
    save_file({f"{i}.{n}": torch.randn(*shape) for i in range(count)
               for n, shape in (("weight", (width, width)), ("bias", (width,)))}, path)


def _layers(path, count=5, width=48):
    mods = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(count))
    with safe_open(str(path), framework="pt") as f:
        for i, m in enumerate(mods):
            m.weight.data, m.bias.data = f.get_tensor(f"{i}.weight"), f.get_tensor(f"{i}.bias")
    return mods


def _run(mods, x):
    for m in mods:
        x = torch.tanh(m(x))
    return x


def _resident(addr: int, nbytes: int):
    """mincore over [addr, addr + nbytes) of this process: the fraction of its pages in memory (None off Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    page = mmap.PAGESIZE
    first, last = addr // page, (addr + nbytes - 1) // page
    vec = ctypes.create_string_buffer(last - first + 1)
    if libc.mincore(first * page, (last - first + 1) * page, vec) != 0:
        return None
    return sum(b & 1 for b in vec.raw) / (last - first + 1)


def _cold_mapping(path, nbytes, seed=1):
    """A file of random bytes, written, synced and dropped from the page cache, mapped copy-on-write as safetensors
    maps a checkpoint: (mapping, uint8 tensor over it), or a skip where the pages do not drop."""
    import mmap

    rng = torch.Generator().manual_seed(seed)
    path.write_bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=rng).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    before = _resident(flat.data_ptr(), nbytes)
    if before is None or before > 0.05:
        pytest.skip("this filesystem keeps a file's pages whatever the advice (nothing to drop)")
    return mm, flat


def test_the_reader_brings_every_page_of_its_tensors_into_memory_and_copies_nothing(tmp_path):
    nbytes = 6 * 2 ** 20 + 1234  # not a whole number of pages: the last one is read too
    mm, flat = _cold_mapping(tmp_path / "big.bin", nbytes)
    part = flat[4096 * 100 + 7:]  # starts inside a page
    reader = PageReader(3, chunk=2 ** 18)
    reading = reader.read([part])
    reading.wait()
    assert reading.done() and reader.bytes_read == part.numel()
    assert _resident(part.data_ptr(), part.numel()) == 1.0
    assert _resident(flat.data_ptr(), 4096 * 99) < 0.5  # before the tensor: not read
    assert torch.equal(part[:1000], torch.frombuffer(bytearray((tmp_path / "big.bin").read_bytes()[409607:410607]),
                                                     dtype=torch.uint8))
    reader.close()
    del flat, part
    mm.close()


def test_touch_pages_covers_the_last_page_of_a_range(tmp_path):
    mm, flat = _cold_mapping(tmp_path / "edge.bin", 5 * 4096)
    # From byte 100 to 2 pages and 50 bytes on: the stride lands in pages 0 and 1; the last byte is in page 2.
    assert touch_pages(flat, 100, 2 * 4096 + 150) == 2 * 4096 + 50
    assert _resident(flat.data_ptr(), 3 * 4096) == 1.0
    assert touch_pages(flat, 10, 10) == 0
    del flat
    mm.close()


def test_a_reader_refuses_tensors_it_cannot_read():
    reader = PageReader(1)
    with pytest.raises(InputError, match=r"^a page reader reads contiguous host tensors, got one on cpu "
                                         r"\(contiguous: False\)$"):
        reader.read([torch.randn(8, 8).t()])
    reader.close()


@pytest.mark.parametrize("threads, chunk, message", [
    (0, 2 ** 20, r"^a page reader needs at least one thread, got 0$"),
    (True, 2 ** 20, r"^a page reader needs at least one thread, got True$"),
    (2, 100, r"^a page reader's piece must be a whole number of pages \(4096 bytes\), got 100$"),
    (2, 6000, r"^a page reader's piece must be a whole number of pages \(4096 bytes\), got 6000$"),
])
def test_a_reader_refuses_bad_settings(threads, chunk, message):
    with pytest.raises(InputError, match=message):
        PageReader(threads, chunk)


def test_in_place_units_are_advised_ahead_of_their_copies_without_a_reader(tmp_path, monkeypatch):
    """Streamed in place without a page reader (the default), the unit copied after the ones in the slots is advised
    to the kernel (MADV_WILLNEED, page-aligned: the real call succeeds) a block ahead of its copy, through the
    wrap-around; the forward is unchanged. Packed units are not advised."""
    path = tmp_path / "layers.safetensors"
    _layers_file(path)
    x = torch.randn(3, 48)
    want = _run(_layers(path), x)
    advised, real = [], streaming.advise_willneed
    monkeypatch.setattr(streaming, "advise_willneed", lambda ptr, n: advised.append((ptr, n, real(ptr, n))))
    mods = _layers(path)
    stream = streaming.BlockStream(mods, [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    first_ptr = {stream.units[i].sources[0].data_ptr(): i for i in range(5)}
    for _ in range(2):
        assert torch.equal(_run(mods, x), want)
    order = [first_ptr[ptr] for ptr, _, _ in advised if ptr in first_ptr]
    # Cold start: blocks 0 and 1 copied, 2 advised; leaving block k copies k + 2 and advises k + 3 (mod 5).
    assert order == [2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert all(rc in (0, None) for _, _, rc in advised) and advised
    assert {n for _, n, _ in advised} == {48 * 48 * 4, 48 * 4}

    advised.clear()
    packed = _layers(path)
    streaming.BlockStream(packed, [0, 1, 2, 3, 4], "cpu", depth=2)
    assert torch.equal(_run(packed, x), want) and advised == []


def test_the_stream_reads_its_in_place_units_ahead_in_order_and_computes_the_same(tmp_path, monkeypatch):
    """With a page reader, an in-place stream reads `depth + window` units ahead, from `prime` on and through the
    wrap-around, each unit once until it is copied, and every copy waits for its unit's reads; the forward is the
    resident one's, bit for bit. The stream's own one-unit madvise read-ahead is not used."""
    path = tmp_path / "layers.safetensors"
    _layers_file(path)
    x = torch.randn(3, 48)
    want = _run(_layers(path), x)
    mods = _layers(path)
    stream = streaming.BlockStream(mods, [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    monkeypatch.setattr(streaming, "read_ahead", lambda unit: pytest.fail("the stream's own madvise with a reader"))
    reader = PageReader(3, chunk=4096)
    assert stream.attach_reader(reader, 2) is None and stream.reader is reader and stream.window == 2
    unit_of = {id(stream.units[i]): i for i in range(5)}
    reads, waits = [], []
    real_read = reader.read

    def read(tensors):
        unit = next(u for u in stream.units.values() if u.sources is tensors)
        reads.append(unit_of[id(unit)])
        reading = real_read(tensors)
        real_wait = reading.wait
        reading.wait = lambda: (waits.append(unit_of[id(unit)]), real_wait())[1]
        return reading

    reader.read = read
    stream.prime()
    assert reads == [0, 1, 2, 3]
    for _ in range(2):
        assert torch.equal(_run(mods, x), want)
    # Leaving unit k copies k + 2 and reads through k + 1 + depth + window; unit 0 again once it left its slot.
    assert reads[:8] == [0, 1, 2, 3, 4, 0, 1, 2] and len(reads) == len(waits) + sum(
        u.reading is not None for u in stream.units.values())
    assert waits[:5] == [0, 1, 2, 3, 4]
    for unit in stream.units.values():  # the next forward's, still in flight
        if unit.reading is not None:
            unit.reading.wait()
    assert reader.bytes_read == len(reads) * (48 * 48 + 48) * 4
    stream.restore()
    assert stream.reader is None

    # A window as large as the stream reads everything at once, and nothing again until the wrap-around's copies.
    mods = _layers(path)
    stream = streaming.BlockStream(mods, [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    reader = PageReader(2, chunk=4096)
    stream.attach_reader(reader, 5)
    reads.clear()
    real_read = reader.read
    reader.read = lambda tensors: (reads.append(next(i for i, u in stream.units.items() if u.sources is tensors)),
                                   real_read(tensors))[1]
    stream.prime()
    assert reads == [0, 1, 2, 3, 4]
    assert torch.equal(_run(mods, x), want)
    assert reads == [0, 1, 2, 3, 4, 0, 1, 2]  # leaving units 2, 3 and 4: the next forward's first ones
    stream.restore()


def test_a_packed_stream_has_nothing_for_a_reader():
    packed = streaming.BlockStream(torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3)), [0, 1, 2], "cpu")
    assert packed.attach_reader(PageReader(2), 4) == "the units are packed in host memory: nothing to read"
    assert packed.reader is None


def test_the_read_ahead_window_is_what_the_host_holds_in_page_cache(tmp_path):
    path = tmp_path / "layers.safetensors"
    _layers_file(path, count=6)
    stream = streaming.BlockStream(_layers(path, count=6), list(range(6)), "cpu", depth=2, in_place=True)
    unit = stream.units[0].nbytes
    assert read_ahead_window(stream, None) == (4, "the host's available memory is unknown: 4 layers ahead")
    assert read_ahead_window(stream, 0)[0] == 1
    window, why = read_ahead_window(stream, READ_AHEAD_HEADROOM + 3 * unit + 1)
    assert window == 3 and " available on the host holds 3 of 6 layers " in why and why.endswith(
        "in page cache beside 4.00 GB")
    assert read_ahead_window(stream, 100 * GB)[0] == 6


def test_the_read_threads_variable():
    assert read_threads({}) == 0 and read_threads({"H3_READ_THREADS": " 0 "}) == 0
    assert read_threads({"H3_READ_THREADS": "16"}) == 16
    for bad in ("-1", "four", "65"):
        with pytest.raises(InputError, match=rf"^H3_READ_THREADS must be a whole number from 0 to 64 \(0: no reader "
                                             rf"threads\), got '{bad}'$"):
            read_threads({"H3_READ_THREADS": bad})


def test_a_closed_reader_cancels_what_it_had_not_started_and_refuses_more(tmp_path):
    import gc
    import threading

    mm, flat = _cold_mapping(tmp_path / "q.bin", 4 * 2 ** 20)
    reader = PageReader(1, chunk=4096)
    reading = reader.read([flat])  # 1,024 pieces on one thread
    reader.close()
    assert reading.done() and any(job.cancelled() for job in reading.jobs)
    with pytest.raises(InputError, match=r"^this page reader is closed$"):
        reader.read([flat])
    # A reader nobody closes stops its threads once it is collected.
    before = threading.active_count()
    dropped = PageReader(3)
    assert threading.active_count() == before + 3
    del dropped
    gc.collect()
    for _ in range(100):
        if threading.active_count() == before:
            break
        threading.Event().wait(0.01)
    assert threading.active_count() == before
    del flat
    mm.close()
