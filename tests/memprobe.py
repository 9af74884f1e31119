"""Source for subprocess probes that track the peak anonymous memory (Linux RssAnon) of a load.

`ANON_PEAK` defines `anon()` and starts a sampling thread; the probe stops it with `stop_sampling()`
and reads `peak[0]`. File pages of memory-mapped checkpoints are page cache and do not count.
"""

ANON_PEAK = r"""
import threading, time

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak, _stop = [0], threading.Event()

def _sample():
    while not _stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

def start_sampling():
    global _thread
    _thread = threading.Thread(target=_sample)
    _thread.start()

def stop_sampling():
    _stop.set()
    _thread.join()
    peak[0] = max(peak[0], anon())
"""
