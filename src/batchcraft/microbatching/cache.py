"""Measurement cache: one SQLite file shared by processes, recovered when corrupt.

One row per measured configuration, keyed by everything that changes the numbers: layer
geometry, pass, micro-batch size, whether the micro-batch is a step of a divided batch, dtype,
algorithm, device name, torch version and intra-op thread count. Each row keeps the spread of
its timed calls, so a time measured while the machine was busy can be recognised and measured
again (:class:`~batchcraft.microbatching.measure.Measurer`). The schema version is part of
the table name, so an old file is simply ignored by a newer batchcraft. The file runs in WAL
mode with a busy timeout, so two processes can plan at once; a file that SQLite cannot read is
moved aside (``<name>.corrupt-<time>``) and rebuilt, with a warning, never an exception.

Source: μ-cuDNN (arXiv 1804.04806) §IV keeps its benchmark results in SQLite as well.
"""

from __future__ import annotations

import os
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from batchcraft.errors import MeasurementCacheError
from batchcraft.measure.machine import cache_dir

__all__ = ["SCHEMA_VERSION", "MeasurementKey", "MeasurementRecord", "MeasurementCache", "default_cache_path"]

SCHEMA_VERSION = 2  # 2: spread column
_TABLE = f"measurements_v{SCHEMA_VERSION}"
_KEY_COLUMNS = ("device", "torch_version", "threads", "dtype", "geometry", "pass", "algorithm",
                "micro_batch", "divided")


def default_cache_path() -> Path:
    """``$BATCHCRAFT_CACHE_DIR`` or ``$XDG_CACHE_HOME/batchcraft`` or ``~/.cache/batchcraft``, + file."""
    return cache_dir() / "microbatch.sqlite"


@dataclass(frozen=True)
class MeasurementKey:
    device: str
    torch_version: str
    threads: int
    dtype: str
    geometry: str
    pass_: str
    algorithm: str
    micro_batch: int
    divided: bool

    def values(self) -> tuple:
        return (self.device, self.torch_version, int(self.threads), self.dtype, self.geometry, self.pass_,
                self.algorithm, int(self.micro_batch), int(self.divided))


@dataclass(frozen=True)
class MeasurementRecord:
    """What was measured for one key.

    Attributes:
        time_ms (float | None): wall time of one call (minimum of the timed calls); None if only memory was measured
            (the configuration did not fit the budget it was measured for).
        time_samples (int): timed calls behind ``time_ms``.
        workspace_bytes (int): measured peak extra bytes of one call, the result excluded when
            it is the layer's own output (undivided), included when it is a temporary.
        spread (float): (median - min) / min of the last round of timed calls (0 for one call).
    """

    time_ms: float | None
    time_samples: int
    workspace_bytes: int
    spread: float = 0.0


class MeasurementCache:
    """SQLite-backed store of :class:`MeasurementRecord` by :class:`MeasurementKey`.

    Args:
        path (str | Path | None): file to use; ``":memory:"`` for a private in-memory cache;
            None for :func:`default_cache_path`.
        timeout_s (float): how long to wait for another process's write lock. Default: 30.
    Raises:
        MeasurementCacheError: the directory cannot be created or the file cannot be opened
            even after moving a corrupt one aside.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, timeout_s: float = 30.0):
        self.path = default_cache_path() if path is None else (path if path == ":memory:" else Path(path))
        self.timeout_s = timeout_s
        self.recovered_from: Path | None = None
        try:
            self._conn = self._open_retrying()
        except sqlite3.DatabaseError as exc:
            if self.path == ":memory:":
                raise MeasurementCacheError(f"in-memory measurement cache failed: {exc}") from exc
            self.recovered_from = self._move_aside(exc)
            try:
                self._conn = self._open()
            except sqlite3.Error as exc2:
                raise MeasurementCacheError(
                    f"measurement cache {self.path}: cannot open even after moving the old file aside: {exc2}",
                    hint="pass cache=':memory:' or another path") from exc2

    def _open_retrying(self) -> sqlite3.Connection:
        """``_open``, retried while another process holds the file (locked is not corrupt)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.02
        while True:
            try:
                return self._open()
            except sqlite3.OperationalError as exc:
                # "database is locked": e.g. two processes switching a new file to WAL at once.
                # OperationalError subclasses DatabaseError: never treat it as corruption.
                if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                    raise MeasurementCacheError(f"measurement cache {self.path}: {exc}",
                                                hint="pass cache=':memory:' or another path") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise MeasurementCacheError(f"measurement cache: cannot create {self.path.parent}: {exc}",
                                            hint="set BATCHCRAFT_CACHE_DIR to a writable directory") from exc
        conn = sqlite3.connect(str(self.path), timeout=self.timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            # quick_check reads every page: detects a damaged file now, not in the middle of planning
            row = conn.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {row[0] if row else 'no answer'}")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {_TABLE} ("
                + ", ".join(f"{c} {'INTEGER' if c in ('threads', 'micro_batch', 'divided') else 'TEXT'} NOT NULL"
                            for c in _KEY_COLUMNS)
                + ", time_ms REAL, time_samples INTEGER NOT NULL, workspace_bytes INTEGER NOT NULL,"
                " spread REAL NOT NULL DEFAULT 0, created_at REAL NOT NULL, PRIMARY KEY (" + ", ".join(_KEY_COLUMNS) + "))")
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self, exc: Exception) -> Path:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            try:
                os.replace(src, Path(str(aside) + suffix))
            except FileNotFoundError:  # already moved by another process, or never existed
                pass
        warnings.warn(f"measurement cache {self.path} was unreadable ({exc}); moved to {aside} and rebuilt",
                      RuntimeWarning, stacklevel=3)
        return aside

    def _execute(self, sql: str, args: tuple):
        try:
            return self._conn.execute(sql, args)
        except sqlite3.OperationalError:
            raise  # locked beyond the timeout, disk full, ...: not corruption
        except sqlite3.DatabaseError as exc:
            # damaged while in use (e.g. by another program): move aside, rebuild, retry once
            if self.path == ":memory:":
                raise MeasurementCacheError(f"in-memory measurement cache failed: {exc}") from exc
            self._conn.close()
            self.recovered_from = self._move_aside(exc)
            self._conn = self._open()
            return self._conn.execute(sql, args)

    def get(self, key: MeasurementKey) -> MeasurementRecord | None:
        """The stored record for ``key``, or None."""
        where = " AND ".join(f"{c} = ?" for c in _KEY_COLUMNS)
        row = self._execute(f"SELECT time_ms, time_samples, workspace_bytes, spread FROM {_TABLE} WHERE {where}",
                            key.values()).fetchone()
        return None if row is None else MeasurementRecord(row[0], int(row[1]), int(row[2]), float(row[3]))

    def put(self, key: MeasurementKey, record: MeasurementRecord) -> None:
        """Store ``record`` under ``key`` (replacing an older one), committed at once."""
        cols = _KEY_COLUMNS + ("time_ms", "time_samples", "workspace_bytes", "spread", "created_at")
        self._execute(
            f"INSERT OR REPLACE INTO {_TABLE} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            key.values() + (record.time_ms, record.time_samples, int(record.workspace_bytes), float(record.spread),
                            time.time()))

    def __len__(self) -> int:
        return int(self._conn.execute(f"SELECT COUNT(*) FROM {_TABLE}").fetchone()[0])

    def close(self) -> None:
        self._conn.close()

    def __deepcopy__(self, memo):
        # a cache is a shared resource (an open file): copies of a planned model share it
        return self

    def __getstate__(self):
        # pickling a planned model: keep the path, reopen on load (an in-memory cache starts empty)
        return {"path": self.path, "timeout_s": self.timeout_s}

    def __setstate__(self, state):
        self.__init__(state["path"], timeout_s=state["timeout_s"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"MeasurementCache({str(self.path)!r})"
