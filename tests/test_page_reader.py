"""dit/page_reader.py: where memory-mapped tensors lie in their file, a reader that puts those pages in the page cache
with several threads, and the text encoder's in-place stream reading its layers ahead with it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3_spark.errors import CheckpointError, InputError
from h3_spark.h3_model.dit import streaming
from h3_spark.h3_model.dit.page_reader import FileSpan, PageReader, file_spans
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


def _resident(path, span):
    """mincore over one span of the file: the fraction of its pages in the page cache (None off Linux)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    page = mmap.PAGESIZE
    first, last = span.offset // page, (span.offset + span.nbytes - 1) // page
    vec = ctypes.create_string_buffer(last - first + 1)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        arr = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(arr.ctypes.data + first * page, (last - first + 1) * page, vec)
        del arr
    return None if rc != 0 else sum(b & 1 for b in vec.raw) / (last - first + 1)


def test_file_spans_are_where_the_mapped_tensors_lie_in_the_file(tmp_path):
    path = tmp_path / "layers.safetensors"
    _layers_file(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = [f.get_tensor("3.weight"), f.get_tensor("3.bias")]
    spans = file_spans(tensors)
    assert spans is not None and len(spans) in (1, 2) and all(s.path == str(path) for s in spans)
    assert sum(s.nbytes for s in spans) == 48 * 48 * 4 + 48 * 4
    data = path.read_bytes()
    if len(spans) == 2:  # each tensor's own bytes, at its own place in the file
        for span, t in zip(spans, tensors):
            assert data[span.offset:span.offset + span.nbytes] == t.numpy().tobytes()
    else:
        assert data[spans[0].offset:spans[0].offset + spans[0].nbytes] == b"".join(t.numpy().tobytes() for t in tensors)
    assert file_spans([torch.randn(8)]) == []  # anonymous memory: in memory already, nothing to read
    assert file_spans([tensors[0]], maps=str(tmp_path / "no-maps")) == []
    assert file_spans([torch.randn(8), tensors[1]]) == file_spans([tensors[1]])


def test_adjacent_tensors_merge_into_one_span(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"a": torch.randn(1000), "b": torch.randn(1000)}, path)
    with safe_open(str(path), framework="pt") as f:
        a, b = f.get_tensor("a"), f.get_tensor("b")
    first, second = sorted([a, b], key=lambda t: t.data_ptr())
    assert first.data_ptr() + 4000 == second.data_ptr()
    [span] = file_spans([first, second])
    assert span.nbytes == 8000 and path.read_bytes()[span.offset:span.offset + 8000] == (
        first.numpy().tobytes() + second.numpy().tobytes())


def test_the_reader_puts_the_spans_pages_in_the_page_cache(tmp_path):
    path = tmp_path / "big.bin"
    rng = torch.Generator().manual_seed(1)
    path.write_bytes(torch.randint(0, 256, (6 * 2 ** 20,), dtype=torch.uint8, generator=rng).numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    span = FileSpan(str(path), 4096 * 100, 3 * 2 ** 20)
    before = _resident(path, span)
    if before is None or before > 0.05:
        pytest.skip("this filesystem keeps a file's pages whatever the advice (nothing to drop)")
    reader = PageReader(3, chunk=2 ** 18)
    reading = reader.read([span])
    reading.wait()
    assert reading.done() and reader.bytes_read == span.nbytes and _resident(path, span) == 1.0
    reader.close()


def test_a_file_shorter_than_its_spans_fails_where_the_pages_are_needed(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(10_000))
    reader = PageReader(2, chunk=4096)
    reading = reader.read([FileSpan(str(path), 8192, 4096)])
    with pytest.raises(CheckpointError, match=r"short\.bin: the file ends before byte 12288 \(read ahead of a "
                                              r"streamed layer's copy; the file changed since it was loaded\)$"):
        reading.wait()
    reader.close()


@pytest.mark.parametrize("threads, chunk, message", [
    (0, 2 ** 20, r"^a page reader needs at least one thread, got 0$"),
    (True, 2 ** 20, r"^a page reader needs at least one thread, got True$"),
    (2, 100, r"^a page reader's request must be at least one page \(4096 bytes\), got 100$"),
])
def test_a_reader_refuses_bad_settings(threads, chunk, message):
    with pytest.raises(InputError, match=message):
        PageReader(threads, chunk)


def test_the_stream_reads_its_in_place_units_ahead_in_order_and_computes_the_same(tmp_path, monkeypatch):
    """With a page reader, an in-place stream reads `depth + window` units ahead, from `prime` on and through the
    wrap-around, each unit once until it is copied, and every copy waits for its unit's reads; the forward is the
    resident one's, bit for bit. The kernel's madvise read-ahead is not used."""
    path = tmp_path / "layers.safetensors"
    _layers_file(path)
    x = torch.randn(3, 48)
    want = _run(_layers(path), x)
    mods = _layers(path)
    stream = streaming.BlockStream(mods, [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    monkeypatch.setattr(streaming, "advise_willneed", lambda ptr, n: pytest.fail("madvise with a page reader"))
    reader = PageReader(3, chunk=4096)
    assert stream.attach_reader(reader, 2) is None and stream.reader is reader and stream.window == 2
    assert stream.file_bytes == 5 * (48 * 48 + 48) * 4
    unit_of = {id(stream.units[i]): i for i in range(5)}
    reads, waits = [], []
    real_read = reader.read

    def read(spans):
        unit = next(u for u in stream.units.values() if u.spans is spans)
        reads.append(unit_of[id(unit)])
        reading = real_read(spans)
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
    assert reader.bytes_read > 0
    stream.restore()
    assert stream.reader is None

    # A window as large as the stream reads everything at once, and nothing again until the wrap-around's copies.
    mods = _layers(path)
    stream = streaming.BlockStream(mods, [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    reader = PageReader(2, chunk=4096)
    stream.attach_reader(reader, 5)
    reads.clear()
    real_read = reader.read
    reader.read = lambda spans: (reads.append(next(i for i, u in stream.units.items() if u.spans is spans)),
                                 real_read(spans))[1]
    stream.prime()
    assert reads == [0, 1, 2, 3, 4]
    assert torch.equal(_run(mods, x), want)
    assert reads == [0, 1, 2, 3, 4, 0, 1, 2]  # leaving units 2, 3 and 4: the next forward's first ones
    stream.restore()


def test_a_stream_of_anonymous_memory_keeps_the_madvise_read_ahead():
    mods = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    stream = streaming.BlockStream(mods, [0, 1, 2], "cpu", depth=2, in_place=True)
    why = stream.attach_reader(PageReader(2), 4)
    assert why == ("no layer is a view of its file's mapping: each copy reads its own pages (madvise read-ahead)")
    assert stream.reader is None
    packed = streaming.BlockStream(torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3)), [0, 1, 2], "cpu")
    assert packed.attach_reader(PageReader(2), 4) == "the units are packed in host memory: nothing to read"


def test_a_mapped_file_this_process_cannot_open_keeps_the_madvise_read_ahead(tmp_path, monkeypatch):
    path = tmp_path / "layers.safetensors"
    _layers_file(path)
    stream = streaming.BlockStream(_layers(path), [0, 1, 2, 3, 4], "cpu", depth=2, in_place=True)
    real_open = os.open

    def refuse(name, *args, **kwargs):
        if str(name) == str(path):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    assert stream.attach_reader(PageReader(2), 4) == (f"{path} cannot be opened to read ahead (Permission denied): "
                                                      "madvise read-ahead")
    assert stream.reader is None


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
    assert read_threads({}) == 8 and read_threads({"H3_READ_THREADS": " 0 "}) == 0
    assert read_threads({"H3_READ_THREADS": "16"}) == 16
    for bad in ("-1", "four", "65"):
        with pytest.raises(InputError, match=rf"^H3_READ_THREADS must be a whole number from 0 to 64 \(0: no reader "
                                             rf"threads\), got '{bad}'$"):
            read_threads({"H3_READ_THREADS": bad})
