"""Host memory readings (h3_model/engine/host_memory.py) on fake /proc and cgroup v2 trees: each value, and each
way the system can fail to say (no file, no line, a malformed count), which must give None, never an error."""

import random
import resource

import pytest

from h3_spark.h3_model.engine import host_memory

GB = 10 ** 9


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Point the module at empty fake files: /proc/self/status, /proc/self/cgroup and the cgroup root."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(host_memory, "PROC_STATUS", tmp_path / "status")
    monkeypatch.setattr(host_memory, "PROC_MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(host_memory, "PROC_CGROUP", tmp_path / "proc_cgroup")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", root)
    return tmp_path


def _cgroup(fake, path: str, **files) -> None:
    """/proc/self/cgroup naming `path` and its folder's memory.* files (name with _ for .)."""
    (fake / "proc_cgroup").write_text(f"4:memory:/v1/ignored\n0::{path}\n")
    folder = fake / "cgroup" / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".")).write_text(text)


def _ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_status_gives_rss_and_its_peak(fake):
    rng = random.Random(7)
    rss_kb, hwm_kb = rng.randrange(10 ** 5, 10 ** 7), rng.randrange(10 ** 7, 10 ** 8)
    (fake / "status").write_text(f"Name:\tpython\nVmPeak:\t  99 kB\nVmHWM:\t{hwm_kb:>9} kB\nVmRSS:\t{rss_kb:>9} kB\n")
    assert host_memory.rss_bytes() == rss_kb * 1024
    assert host_memory.peak_rss_bytes() == hwm_kb * 1024


@pytest.mark.parametrize("status", [None, "Name:\tpython\n", "VmHWM:\t12 MB\nVmRSS:\tlots kB\n", "VmHWM:\n"])
def test_without_a_readable_status_the_peak_comes_from_getrusage(fake, status):
    if status is not None:
        (fake / "status").write_text(status)
    assert host_memory.rss_bytes() is None
    before = _ru_maxrss_bytes()
    assert before <= host_memory.peak_rss_bytes() <= _ru_maxrss_bytes()


def test_the_cgroup_limit_peak_and_count(fake):
    rng = random.Random(11)
    limit, peak, current = (rng.randrange(GB, 100 * GB) for _ in range(3))
    _cgroup(fake, "/system.slice/h3.service", memory_max=f"{limit}\n", memory_peak=f"{peak}\n",
            memory_current=f"{current}\n")
    assert host_memory.cgroup_memory() == {"path": "/system.slice/h3.service", "limit_gb": round(limit / GB, 3),
                                           "peak_gb": round(peak / GB, 3), "current_gb": round(current / GB, 3)}


def test_a_parents_tighter_limit_binds(fake):
    _cgroup(fake, "/outer", memory_max=f"{3 * GB}\n")
    _cgroup(fake, "/outer/inner", memory_max="max\n", memory_current=f"{GB}\n")
    assert host_memory.cgroup_memory()["limit_gb"] == 3.0
    (fake / "cgroup" / "outer" / "memory.max").write_text("max\n")
    assert host_memory.cgroup_memory()["limit_gb"] is None  # no limit anywhere up the tree


def test_missing_and_malformed_cgroup_files_read_as_unknown(fake):
    _cgroup(fake, "/job", memory_current=f"{GB}\n", memory_max="lots\n")  # no memory.peak before Linux 5.19
    assert host_memory.cgroup_memory() == {"path": "/job", "limit_gb": None, "peak_gb": None, "current_gb": 1.0}
    (fake / "cgroup" / "job" / "memory.peak").write_text("-5\n")
    assert host_memory.cgroup_memory()["peak_gb"] is None


@pytest.mark.parametrize("proc_cgroup, current", [
    (None, "1000"),  # not Linux
    ("4:memory:/v1/only\n", "1000"),  # cgroup v1: no 0:: line
    ("0::relative/path\n", "1000"),  # not a path in the hierarchy
    ("0::/job\n", None),  # no memory controller here (hybrid set-up, the host's root cgroup)
    ("0::/job\n", "a lot"),  # a count that is not one
])
def test_no_cgroup_v2_memory_reads_as_none(fake, proc_cgroup, current):
    if proc_cgroup is not None:
        (fake / "proc_cgroup").write_text(proc_cgroup)
    (fake / "cgroup" / "job").mkdir()
    if current is not None:
        (fake / "cgroup" / "job" / "memory.current").write_text(current)
    assert host_memory.cgroup_memory() is None


def test_the_report_keys(fake):
    (fake / "status").write_text("VmHWM:\t2000000 kB\nVmRSS:\t1000000 kB\n")
    _cgroup(fake, "/", memory_max=f"{8 * GB}\n", memory_current=f"{2 * GB}\n", memory_peak=f"{5 * GB}\n")
    assert host_memory.host_memory_report() == {
        "peak_host_memory_gb": 2.048,
        "host_memory": {"rss_gb": 1.024, "peak_rss_gb": 2.048,
                        "cgroup": {"path": "/", "limit_gb": 8.0, "peak_gb": 5.0, "current_gb": 2.0}}}


def test_available_memory_is_the_tightest_of_meminfo_and_each_cgroup_level(fake):
    rng = random.Random(13)
    available_kb = rng.randrange(10 ** 7, 10 ** 8)
    (fake / "meminfo").write_text(f"MemTotal:  {2 * available_kb} kB\nMemFree:  5 kB\nMemAvailable: {available_kb} kB\n")
    assert host_memory.available_bytes() == available_kb * 1024  # no cgroup: the machine's
    # A parent's limit less its count is tighter than the child's, which has none.
    _cgroup(fake, "/outer", memory_max=f"{9 * GB}\n", memory_current=f"{6 * GB}\n")
    _cgroup(fake, "/outer/inner", memory_max="max\n", memory_current=f"{GB}\n")
    assert host_memory.available_bytes() == 3 * GB
    _cgroup(fake, "/outer/inner", memory_max=f"{3 * GB}\n", memory_current=f"{2 * GB}\n")
    assert host_memory.available_bytes() == GB
    # Over its limit (reclaim pending): nothing, never a negative count.
    _cgroup(fake, "/outer/inner", memory_max=f"{GB}\n", memory_current=f"{2 * GB}\n")
    assert host_memory.available_bytes() == 0


def test_a_cgroup_full_of_clean_page_cache_still_has_that_much_available(fake):
    # After reading a checkpoint a 32 GB box sits at its limit: most of its count is the files' pages, which the
    # kernel drops before refusing memory; what is dirty or under writeback must be written first and is not counted.
    rng = random.Random(17)
    limit = 32 * GB
    anon, active, inactive, dirty, writeback = (rng.randrange(GB // 10, 8 * GB) for _ in range(5))
    dirty, writeback = dirty // 8, writeback // 8
    current = min(limit, anon + active + inactive)
    stat = (f"anon {anon}\nfile {active + inactive}\nshmem 4096\nactive_file {active}\ninactive_file {inactive}\n"
            f"file_dirty {dirty}\nfile_writeback {writeback}\nunevictable 0\n")
    _cgroup(fake, "/box", memory_max=f"{limit}\n", memory_current=f"{current}\n", memory_stat=stat)
    clean = active + inactive - dirty - writeback
    assert clean > 0  # the draw has clean cache to give back, so the count alone would be wrong
    assert host_memory.available_bytes() == limit - (current - clean)
    # A memory.stat that says nothing usable gives nothing back: the count alone, as without the file.
    (fake / "cgroup" / "box" / "memory.stat").write_text("active_file lots\ninactive_file\n")
    assert host_memory.available_bytes() == limit - current
    (fake / "cgroup" / "box" / "memory.stat").unlink()
    assert host_memory.available_bytes() == limit - current
    # More dirty than cached (the counters are read at different instants): never more than the count.
    (fake / "cgroup" / "box" / "memory.stat").write_text(f"active_file 10\ninactive_file 10\nfile_dirty {GB}\n")
    assert host_memory.available_bytes() == limit - current


@pytest.mark.parametrize("meminfo", [None, "MemTotal: 5 kB\n", "MemAvailable: lots kB\n", "MemAvailable: 5 MB\n"])
def test_unknown_available_memory_reads_as_none(fake, meminfo):
    if meminfo is not None:
        (fake / "meminfo").write_text(meminfo)
    assert host_memory.available_bytes() is None
    _cgroup(fake, "/job", memory_max=f"{4 * GB}\n", memory_current=f"{GB}\n")
    assert host_memory.available_bytes() == 3 * GB  # the cgroup still says


def test_this_process_reads_without_error():
    report = host_memory.host_memory_report()
    assert set(report["host_memory"]) == {"rss_gb", "peak_rss_gb", "cgroup"}
    assert report["peak_host_memory_gb"] is None or report["peak_host_memory_gb"] > 0
    available = host_memory.available_bytes()
    assert available is None or available >= 0
