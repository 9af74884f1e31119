"""Job records on disk: one SQLite file (the standard library's sqlite3, WAL), so a job's record outlives the process.

The service writes a job's record on every change of state (accepted, running, ended) before anyone is told of
it; the fleet's router keeps its job -> replica ledger the same way. When a process starts on a file that a dead
one left, the jobs that were queued or running are ended `failed` ("the service stopped while this job was
running"): they are not re-queued, because their inputs, their output reservation and their client's intent
may have changed meanwhile, and a half-run job's partial file was swept. Ended records stay readable; the oldest
go past `keep` records or `max_age_s` seconds.

A file one process holds is refused to a second one (an flock on `<file>.lock`): two services on one file would
fail each other's running jobs at start. Each write is committed with synchronous=FULL: it survives the process
being killed and the machine losing power.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import time
from pathlib import Path

from ..errors import InputError

try:
    import fcntl
except ImportError:  # Windows: no flock; a second service on the same file is not detected
    fcntl = None

SCHEMA_VERSION = 1
ACTIVE = ("queued", "running")
ENDED = ("done", "failed", "cancelled")
DEFAULT_KEEP = 1000
DEFAULT_MAX_AGE_S = 7 * 86400.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    finished REAL,
    owner TEXT,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished);
"""


class JobRecords:
    """The records in one file. Thread-safe (one connection behind a lock): the HTTP threads and the worker write."""

    def __init__(self, path: str | os.PathLike, *, keep: int = DEFAULT_KEEP, max_age_s: float = DEFAULT_MAX_AGE_S):
        if keep < 1:
            raise InputError(f"{path}: keep at least 1 ended job record, got {keep}")
        if not max_age_s > 0:
            raise InputError(f"{path}: the age limit of ended job records must be positive, got {max_age_s}")
        self.path = Path(path)
        self.keep, self.max_age_s = keep, max_age_s
        self._lock = threading.Lock()
        self._lock_fd = self._hold(self.path)
        try:
            self._db = self._open(self.path)
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ------------------------------------------------------------------ opening, refusing what is not ours
    @staticmethod
    def _hold(path: Path) -> int:
        if path.is_dir():
            raise InputError(f"{path}: the job record file is a folder")
        try:
            fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise InputError(f"{path}.lock: cannot open the job record file's lock ({exc.strerror})") from None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise InputError(f"{path}: another running service keeps its job records in this file; give this "
                                 f"one its own --state-dir") from None
        return fd

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        if path.exists():
            mode = path.stat().st_mode
            if not stat.S_ISREG(mode):
                raise InputError(f"{path}: the job record file is not a regular file")
            # Checked by mode, not by trying: root writes through a read-only mode, and the file would then
            # change under whoever made it read-only.
            if not mode & stat.S_IWUSR:
                raise InputError(f"{path}: the job record file is read-only (mode {stat.S_IMODE(mode):o}); the "
                                 f"service writes every job's state there")
        try:
            db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise InputError(f"{path}: cannot open the job record file ({exc})") from None
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise InputError(f"{path}: job records of a newer h3-spark (schema {version}; this one reads "
                                 f"{SCHEMA_VERSION} and older); use that version or another --state-dir")
            if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
                raise InputError(f"{path}: the job record file cannot use SQLite's write-ahead log here")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            db.close()
            what = "is not an SQLite database" if "not a database" in str(exc) else f"cannot be used ({exc})"
            raise InputError(f"{path}: the job record file {what}; move it away or use another --state-dir") \
                from None
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
                os.close(self._lock_fd)

    # ------------------------------------------------------------------ writing
    def save(self, record: dict, owner: dict | None = None) -> None:
        """Write (or replace) one job's record; `owner` is the fleet router's (replica, instance, lost)."""
        row = (record["id"], record["state"], record.get("created") or time.time(), record.get("finished"),
               None if owner is None else json.dumps(owner), json.dumps(record))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO jobs (id, state, created, finished, owner, record) "
                             "VALUES (?, ?, ?, ?, ?, ?)", row)
            if record["state"] in ENDED:
                self._expire_locked(time.time())

    def delete(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def end_unfinished(self, why: str) -> list[tuple[str, str]]:
        """End every queued or running record as failed with `why` + the state it was in; returns (id, state).
        Run once at start, before this process accepts jobs: such records were left by a process that died."""
        now, ended = time.time(), []
        with self._lock:
            rows = self._db.execute("SELECT id, state, record FROM jobs WHERE state IN (?, ?)", ACTIVE).fetchall()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for job_id, state, text in rows:
                    record = {**json.loads(text), "state": "failed", "finished": now,
                              "error": f"{why} while this job was {state}"}
                    record.pop("cancel_requested", None)
                    self._db.execute("UPDATE jobs SET state = 'failed', finished = ?, record = ? WHERE id = ?",
                                     (now, json.dumps(record), job_id))
                    ended.append((job_id, state))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._expire_locked(now)
        return ended

    def expire(self, now: float | None = None) -> None:
        with self._lock:
            self._expire_locked(time.time() if now is None else now)

    def _expire_locked(self, now: float) -> None:
        placeholders = ", ".join("?" * len(ENDED))
        self._db.execute(f"DELETE FROM jobs WHERE state IN ({placeholders}) AND finished < ?",
                         (*ENDED, now - self.max_age_s))
        self._db.execute(f"DELETE FROM jobs WHERE state IN ({placeholders}) AND id NOT IN (SELECT id FROM jobs "
                         f"WHERE state IN ({placeholders}) ORDER BY finished DESC LIMIT ?)",
                         (*ENDED, *ENDED, self.keep))

    # ------------------------------------------------------------------ reading
    def get(self, job_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def rows(self) -> list[tuple[dict, dict | None]]:
        """Every (record, owner), oldest first."""
        with self._lock:
            found = self._db.execute("SELECT record, owner FROM jobs ORDER BY created").fetchall()
        return [(json.loads(record), None if owner is None else json.loads(owner)) for record, owner in found]

    def states(self) -> list[dict]:
        """{"id", "state", "client"} of every record, oldest first."""
        with self._lock:
            found = self._db.execute("SELECT id, state, record FROM jobs ORDER BY created").fetchall()
        return [{"id": job_id, "state": state, "client": json.loads(record).get("client")}
                for job_id, state, record in found]
