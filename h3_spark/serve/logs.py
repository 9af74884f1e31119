"""The service's own log lines on stderr: plain text, or one JSON object per line (`--log-format json`) with
the time, the level, the message and, when the line is about a job, its id (for log pipelines to group by)."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Callable

FORMATS = ("text", "json")
_JOB = re.compile(r"\bjob ([0-9a-f]{32})\b")


def make_log(fmt: str = "text", stream=None) -> Callable[[str], None]:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")

    def text(message: str) -> None:
        print(f"h3-spark serve: {message}", file=stream or sys.stderr, flush=True)

    def structured(message: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        record = {"time": stamp, "service": "h3-spark", "level": "error" if _is_error(message) else "info",
                  "msg": message}
        found = _JOB.search(message)
        if found:
            record["job"] = found.group(1)
        print(json.dumps(record), file=stream or sys.stderr, flush=True)

    return text if fmt == "text" else structured


def _is_error(message: str) -> bool:
    return any(word in message for word in ("failed", "Traceback", "out of memory"))
