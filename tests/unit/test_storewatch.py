"""The agent's store watch (runners/base/storewatch.py) and the store failure classifier
(models/trouble.py), on a clock of the test's own: a failure is said once, then once a
minute while it lasts, and once when it is over; a store that takes a write now and then
between failures is not over."""

from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from models.trouble import diagnose, explain
from runners.base.storewatch import HALTED, StoreWatch


def full() -> OperationalError:
    return OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def watch(tmp_path: Path) -> tuple[StoreWatch, Clock, list[str]]:
    clock = Clock()
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    log = logging.getLogger("test.storewatch")
    log.handlers = [Catch()]
    log.propagate = False
    return StoreWatch(f"sqlite:///{tmp_path}/vigil.db", tmp_path, log, clock=clock), clock, said


def test_a_failure_is_said_once_then_once_a_minute_then_back_once(watch) -> None:  # type: ignore[no-untyped-def]
    w, clock, said = watch
    for _ in range(100):  # twice a second for 50 s
        assert w.trouble(full())
        clock.t += 0.5
    assert len(said) == 1 and "store trouble kind=full" in said[0] and "is full" in said[0]
    assert w.failures == 100
    clock.t += 10.5
    w.trouble(full())  # a minute (60.5 s) after the first line: said again
    assert len(said) == 2 and "for=60s" in said[1]
    # A write that fits between failures (the -wal's free room) does not end it...
    clock.t += 1
    w.ok(readonly=False)
    w.trouble(full())
    clock.t += 1
    w.ok(readonly=False)
    assert len(said) == 2 and w.failures > 0
    # ... nor does a read; a write 5 s after the last failure does, said once.
    clock.t += 6
    w.ok(readonly=True)
    assert len(said) == 2
    w.ok(readonly=False)
    w.ok(readonly=False)
    assert len(said) == 3 and "store back kind=full" in said[2] and w.failures == 0


def test_other_errors_are_not_the_stores(watch) -> None:  # type: ignore[no-untyped-def]
    w, _clock, said = watch
    assert not w.trouble(IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE")))
    assert not w.trouble(ValueError("a bug"))
    assert said == [] and w.acting


def test_a_damaged_store_halts_and_is_said_again_once_a_minute(watch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w, clock, said = watch
    bad = OperationalError("SELECT", {}, sqlite3.DatabaseError("database disk image is malformed"))
    assert w.trouble(bad) and not w.acting
    assert "damaged" in (tmp_path / HALTED).read_text() and ".recover" in said[0]
    for _ in range(50):
        w.remind()
        assert w.trouble(ValueError("anything, once halted"))
        clock.t += 1
    assert len(said) == 1
    clock.t += 11
    w.remind()
    assert len(said) == 2 and "still does not act" in said[1]


@pytest.mark.parametrize(("exc", "kind"), [
    (full(), "full"),
    (OperationalError("x", {}, sqlite3.OperationalError("attempt to write a readonly database")),
     "readonly"),
    (OperationalError("x", {}, sqlite3.DatabaseError("file is not a database")), "damaged"),
    (OperationalError("x", {}, sqlite3.OperationalError("database is locked")), "locked"),
    (OperationalError("x", {}, sqlite3.OperationalError("disk I/O error")), "io"),
    (OSError(errno.ENOSPC, "No space left on device", "/x/builds/f"), "full"),
    (OSError(errno.EROFS, "Read-only file system", "/x/builds/f"), "readonly"),
    (OperationalError("x", {}, sqlite3.OperationalError("no such table: hosts")), None),
    (OSError(errno.ENOENT, "No such file"), None),
])
def test_diagnose(exc: BaseException, kind: str | None) -> None:
    t = diagnose(exc)
    assert (t.kind if t else None) == kind
    if t is not None:  # every kind has its own line: a cause and a fix
        line = explain(t, "sqlite:////srv/vigil/vigil.db").line()
        assert "; " in line and "\n" not in line, line
