"""racon.sqlite3: a process's SQLite writers queue on a lock, not in SQLite's busy handler.

Each test opens its own SQLite file through Django's connection handling with the racon.sqlite3
engine (whatever database the suite itself runs on), with a SQLite busy timeout far shorter than
the time a writer holds the file: a second writer that met the lock in SQLite would fail with
"database is locked"; queued on the process's lock it waits, and writes once the first is done.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

from racon.sqlite3 import base

HOLD_SECONDS = 0.5  # ten times SQLite's busy timeout below
BUSY_TIMEOUT = 0.05


def _handler(path: Path, engine: str) -> ConnectionHandler:
    return ConnectionHandler(
        {
            "default": {  # this handler's own, not the suite's
                "ENGINE": engine,
                "NAME": str(path),
                "OPTIONS": {
                    "timeout": BUSY_TIMEOUT,
                    "transaction_mode": "IMMEDIATE",
                    "init_command": "PRAGMA journal_mode=WAL;",
                },
            }
        }
    )


@pytest.fixture
def db_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, django_db_blocker: Any
) -> Iterator[Path]:
    monkeypatch.setattr(base.DatabaseWrapper, "writer_wait_seconds", 30.0)
    path = tmp_path / "writers.sqlite3"
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE t (who TEXT, n INTEGER)")
    with django_db_blocker.unblock():  # this file only: the suite's database is not touched
        yield path


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def _hold(handler: ConnectionHandler, began: threading.Event, *, fail: bool = False) -> None:
    """A transaction (as transaction.atomic begins and ends one) that writes, then holds the file
    for HOLD_SECONDS; with ``fail`` it ends in a rollback instead of a commit."""
    conn = None
    try:
        conn = handler["default"]
        conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
        with conn.cursor() as c:
            c.execute("INSERT INTO t VALUES ('holder', 1)")
        began.set()
        threading.Event().wait(HOLD_SECONDS)
        if fail:
            conn.rollback()
        else:
            conn.commit()
        conn.set_autocommit(True)
    finally:
        began.set()
        if conn is not None:
            conn.close()


def _write(handler: ConnectionHandler, sql: str, *, transaction: bool) -> None:
    conn = handler["default"]
    try:
        if transaction:
            conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
        with conn.cursor() as c:
            c.execute(sql)
        if transaction:
            conn.commit()
            conn.set_autocommit(True)
    finally:
        conn.close()


def _rows(path: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(path) as c:
        return list(c.execute("SELECT who, n FROM t ORDER BY rowid"))


def _race(
    handler: ConnectionHandler, *, fail: bool = False, transaction: bool = True
) -> list[BaseException]:
    """A holder's transaction (see _hold) and, once it holds the file, a second writer; the
    errors of both."""
    began = threading.Event()
    holder, holder_errors = _in_thread(lambda: _hold(handler, began, fail=fail))
    assert began.wait(30)
    writer, writer_errors = _in_thread(
        lambda: _write(handler, "INSERT INTO t VALUES ('second', 2)", transaction=transaction)
    )
    holder.join(60)
    writer.join(60)
    assert holder_errors == []
    return writer_errors


@pytest.mark.parametrize("transaction", [True, False], ids=["transaction", "autocommit"])
def test_a_second_writer_waits_for_the_first_and_writes_after_it(
    db_file: Path, transaction: bool
) -> None:
    assert _race(_handler(db_file, "racon.sqlite3"), transaction=transaction) == []
    assert _rows(db_file) == [("holder", 1), ("second", 2)]


def test_a_rolled_back_transaction_frees_the_lock(db_file: Path) -> None:
    handler = _handler(db_file, "racon.sqlite3")
    assert _race(handler, fail=True) == []
    assert _rows(db_file) == [("second", 2)]
    # And the lock is free again: a third writer in this thread goes at once.
    _write(handler, "UPDATE t SET n = 3", transaction=False)
    assert _rows(db_file) == [("second", 3)]


def test_without_the_queue_the_second_writer_meets_the_busy_file(db_file: Path) -> None:
    """The same two writers on Django's own SQLite backend: the second fails with "database is
    locked" after SQLite's busy timeout, which is what the queue above spares it."""
    errors = _race(_handler(db_file, "django.db.backends.sqlite3"))
    assert len(errors) == 1 and isinstance(errors[0], OperationalError)
    assert "locked" in str(errors[0])
    assert _rows(db_file) == [("holder", 1)]
