"""Django's SQLite backend with one writer at a time per process, queued on a lock.

SQLite lets one connection write at a time. A second writer that finds the file locked sleeps in
SQLite's busy handler, in growing steps (1, 2, 5, 10, 15, 20, 25 ... 100 ms), and looks again: it
may sleep on long after the lock was freed, and a newcomer may take the lock first. In a burst of
requests (bench/concurrency.py at 8 and 16 streams: every admission writes its job and credit
hold) that made the last admissions wait 100-500 ms for a lock held a few milliseconds at a time.

Here a process's threads queue on a lock of their own instead, per database file: a transaction
takes it at its BEGIN and gives it back at its COMMIT, ROLLBACK or close; a write statement outside
a transaction takes it for that statement. The next writer is woken the moment it is free, in
arrival order. Other processes (Celery, beat) still meet SQLite's own busy handling, as before.
A thread that cannot take the lock within the connection's timeout goes on without it, so SQLite
decides as it did before (never worse than without this backend).

Reads take no lock (WAL: readers never wait for the writer).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from django.db.backends.sqlite3 import base

log = logging.getLogger("racon.sqlite3")

WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _reset_after_fork() -> None:
    # A forked child (Celery's pool) has only the forking thread: a lock another thread held at
    # the fork would never be given back there.
    global _locks_guard
    _locks.clear()
    _locks_guard = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def writer_lock(name: str) -> threading.Lock:
    """The process's writer lock for this database file."""
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def _is_write(sql: str) -> bool:
    return sql.lstrip()[:7].upper().startswith(WRITES)


class DatabaseWrapper(base.DatabaseWrapper):
    _writer: threading.Lock | None = None  # held by this connection (its thread) when set
    # How long a writer waits for the lock before it goes on without it; None: the connection's
    # SQLite timeout (OPTIONS "timeout", the settings' 30 s).
    writer_wait_seconds: float | None = None

    def _writer_take(self) -> None:
        lock = writer_lock(str(self.settings_dict["NAME"]))
        timeout = self.writer_wait_seconds
        if timeout is None:
            timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))
        if lock.acquire(timeout=timeout):
            self._writer = lock
        else:
            log.warning("SQLite writer lock not free after %.0fs: writing without it", timeout)

    def _writer_give(self) -> None:
        lock, self._writer = self._writer, None
        if lock is not None:
            lock.release()

    def _start_transaction_under_autocommit(self) -> None:
        if self._writer is None:
            self._writer_take()
        try:
            super()._start_transaction_under_autocommit()  # type: ignore[misc]
        except BaseException:
            self._writer_give()
            raise

    def _commit(self) -> None:
        try:
            super()._commit()  # type: ignore[misc]
        finally:
            self._writer_give()

    def _rollback(self) -> None:
        try:
            super()._rollback()  # type: ignore[misc]
        finally:
            self._writer_give()

    def _close(self) -> None:
        try:
            super()._close()  # type: ignore[misc]
        finally:
            self._writer_give()

    def create_cursor(self, name: Any = None) -> Any:
        cursor = self.connection.cursor(factory=WriterCursor)
        cursor.wrapper = self
        return cursor


class WriterCursor(base.SQLiteCursorWrapper):
    """A write statement outside a transaction holds the writer lock while it runs."""

    wrapper: DatabaseWrapper

    def _queued(self, query: str, run: Callable[[], Any]) -> Any:
        if self.wrapper._writer is not None or not _is_write(query):
            return run()
        self.wrapper._writer_take()
        try:
            return run()
        finally:
            self.wrapper._writer_give()

    def execute(self, query: str, params: Any = None) -> Any:
        return self._queued(query, lambda: super(WriterCursor, self).execute(query, params))

    def executemany(self, query: str, param_list: Any) -> Any:
        return self._queued(query, lambda: super(WriterCursor, self).executemany(query, param_list))
