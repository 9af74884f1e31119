"""benchmarks/disk_read_cpu.py on a small file: every column reads the file's bytes (checked per unit against the
file), the pages are dropped before each read, and bad columns are refused by name."""

from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_benchmark

bench = load_benchmark("disk_read_cpu")


def test_every_column_reads_the_whole_file_cold(tmp_path):
    out = tmp_path / "disk.json"
    assert bench.main(["--gb", "0.006", "--unit-mb", "1.5", "--repeats", "2", "--dir", str(tmp_path),
                       "--columns", "sequential,willneed-2,pread-3,stream-0,stream-2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["file_bytes"] == 6_000_000 and result["unit_bytes"] == int(1.5 * 2 ** 20) and result["units"] == 4
    assert list(result["results"]) == ["sequential", "willneed-2", "pread-3", "stream-0", "stream-2"]
    assert result["results"]["sequential"]["vs_first"] == 1.0
    for row in result["results"].values():
        assert len(row["seconds"]) == 2 and row["gb_per_s"] > 0
        assert all(f is None or 0 <= f <= 1 for f in row["resident_after_drop"])
    fractions = [f for row in result["results"].values() for f in row["resident_after_drop"]]
    assert result["cold_reads"] == (None if None in fractions else all(f < 0.05 for f in fractions))
    assert not (tmp_path / "h3-disk-read.bin").exists()  # removed unless --keep


def test_the_drop_empties_the_page_cache_of_the_file(tmp_path):
    path = tmp_path / "f.bin"
    bench.write_file(path, 3 * 2 ** 20, seed=3)
    path.read_bytes()  # every page in the cache now
    if bench.resident_fraction(path) is None:
        pytest.skip("mincore is Linux's")
    assert bench.resident_fraction(path) > 0.9
    after = bench.drop_pages(path)
    if after > 0.9:
        pytest.skip(f"{tmp_path} keeps a file's pages whatever the advice (tmpfs): nothing to drop")
    assert after < 0.05


def test_the_units_cover_the_file_once():
    units = bench.units_of(10_000_001, 3_000_000)
    assert units[0] == (0, 3_000_000) and units[-1] == (9_000_000, 1_000_001)
    assert sum(n for _, n in units) == 10_000_001


def test_a_column_that_reads_other_bytes_fails_the_run(tmp_path, monkeypatch):
    real = bench.read_threads
    monkeypatch.setattr(bench, "read_threads", lambda *a: real(*a)[:-1] + ["0" * 32])
    with pytest.raises(SystemExit, match=r"^pread-2 read other bytes than the file holds$"):
        bench.main(["--gb", "0.003", "--unit-mb", "1", "--repeats", "1", "--dir", str(tmp_path),
                    "--columns", "sequential,pread-2", "--out", str(tmp_path / "d.json")])


@pytest.mark.parametrize("columns, message", [
    ("sequential,readahead-2", "--columns: 'readahead-2' is not sequential, willneed-D, pread-T or stream-T (D, T >= 1; stream-0: no page reader)"),
    ("pread-0", "--columns: 'pread-0' is not sequential, willneed-D, pread-T or stream-T (D, T >= 1; stream-0: no page reader)"),
    ("stream-x", "--columns: 'stream-x' is not sequential, willneed-D, pread-T or stream-T (D, T >= 1; stream-0: no "
                 "page reader)"),
    ("willneed", "--columns: 'willneed' is not sequential, willneed-D, pread-T or stream-T (D, T >= 1; stream-0: no page reader)"),
    (" , ", "--columns: none given"),
])
def test_bad_columns_are_refused_by_name(columns, message):
    with pytest.raises(SystemExit, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(";", ";") + "$"):
        bench.parse_columns(columns)


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"^--gb and --unit-mb must be positive, --repeats at least 1$"):
        bench.main(["--gb", "0", "--out", str(tmp_path / "d.json")])
