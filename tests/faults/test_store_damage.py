"""A damaged or unavailable store (issue 16 items 7, 8, 9, 11): every command says what
is wrong in one line (the cause, then the fix), and the agent stops acting on a store it
can no longer trust and says so, once, then at a slow cadence -- never a traceback.

Each damage is done for real: a second process holding SQLite's write lock, the -wal file
unlinked under a running agent, a page of the file overwritten, the file made read-only,
the schema downgraded under a running agent."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import Vigil
from tests.integration.test_cli_bad_input import refused

pytestmark = pytest.mark.timeout(180)


def one_line_ok(cp: subprocess.CompletedProcess[str]) -> None:
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Traceback" not in cp.stdout + cp.stderr


# -- item 7: a write lock held by another connection ---------------------------------------

HOLD_LOCK = """
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(300)
"""


@contextmanager
def write_lock_held(v: Vigil) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the database's write lock (an open write transaction)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(v.state_dir / "vigil.db")],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait(10)
        p.stdout.close()  # type: ignore[union-attr]


@pytest.mark.sqlite_only("SQLite's one write lock, held by another connection of the file")
def test_reads_work_and_writes_name_the_holder_while_another_connection_holds_the_write_lock(
        vigil: Vigil) -> None:
    vigil.add_host("hello")
    with write_lock_held(vigil) as holder:
        _reads_work_writes_name(vigil, holder)
    # Nothing was written; once the holder is gone the same command goes through.
    assert vigil.obligations() == []
    one_line_ok(vigil.run("wake", "hello", check=False))
    assert [o["kind"] for o in vigil.obligations()] == ["wake"]


def _reads_work_writes_name(vigil: Vigil, holder: subprocess.Popen[str]) -> None:
    # Read-only commands do not take the write lock: each answers at once.
    for args in (["status"], ["host", "list"], ["obligations"], ["events"], ["db", "current"],
                 ["schedule", "list"], ["status", "hello", "--json"], ["check"]):
        started = time.monotonic()
        cp = vigil.run(*args, check=False)
        one_line_ok(cp)
        assert time.monotonic() - started < 3, f"vigil {' '.join(args)} waited on the write lock"
    # A write retries within its budget, then names the lock's holder and the fix.
    started = time.monotonic()
    cp = vigil.run("wake", "hello", check=False)
    took = time.monotonic() - started
    line = refused(cp, "locked", f"pid {holder.pid}", f"kill {holder.pid}")
    print(line)
    assert "database server" not in line
    assert 5 < took < 60, took
