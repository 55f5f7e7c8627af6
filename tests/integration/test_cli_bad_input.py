"""Bad input gets a clear error and loses nothing: each case below exits non-zero with ONE
line on stderr naming the cause and the fix, no traceback, and leaves every row (and the
database file) exactly as it was."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.schema import downgrade
from models.store import Store
from tests.conftest import HELLO, Vigil
from tests.integration.unproven_double import in_process, leave_unproven_wake


def dump(db: Path, ignore: frozenset[tuple[str, str]] = frozenset()) -> dict[str, object]:
    """Schema and every row of every table (minus `ignore`d (table, column) pairs)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        out: dict[str, object] = {"schema": sorted(conn.execute(
            "SELECT type, name, sql FROM sqlite_master").fetchall(), key=repr)}
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            cur = conn.execute(f'SELECT * FROM "{table}"')
            keep = [i for i, d in enumerate(cur.description) if (table, d[0]) not in ignore]
            out[table] = sorted((tuple(r[i] for i in keep) for r in cur), key=repr)
        return out
    finally:
        conn.close()


def refused(cp: subprocess.CompletedProcess[str], *words: str) -> str:
    """Non-zero, one line on stderr naming cause and fix, no traceback anywhere."""
    everything = cp.stdout + cp.stderr
    assert cp.returncode != 0, f"exit 0:\n{everything}"
    assert "Traceback" not in everything, everything
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, f"want one line on stderr, got {len(lines)}:\n{cp.stderr}"
    line = lines[0]
    assert line.startswith("vigil: error: ") and "; " in line, line  # cause; fix
    for w in words:
        assert w in line, f"{w!r} not in {line!r}"
    return line


@pytest.fixture
def hello(vigil: Vigil) -> Iterator[Vigil]:
    """A box with one host defined (so there are rows to lose)."""
    vigil.add_host("hello")
    yield vigil


def db_of(v: Vigil) -> Path:
    return v.state_dir / "vigil.db"


@pytest.mark.parametrize("args", [
    ("wake", "nope"), ("wake", "nope", "--wait"), ("stop", "nope"), ("status", "nope"),
    ("host", "rm", "nope"),
])
def test_unknown_host(hello: Vigil, args: tuple[str, ...]) -> None:
    before = dump(db_of(hello))
    refused(hello.run(*args, check=False, subprocess=True), "no host named 'nope'", "vigil host list")
    assert dump(db_of(hello)) == before


@pytest.mark.parametrize("case", ["bad name", "missing build", "not executable", "bad env"])
def test_host_add_bad_input(hello: Vigil, short_tmp: Path, case: str) -> None:
    plain = short_tmp / "plain.py"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    args, words = {
        "bad name": (("Bad_Name", "--build", str(HELLO)), ("invalid host name 'Bad_Name'", "lowercase")),
        "missing build": (("ok", "--build", str(short_tmp / "absent")), ("does not exist", "executable")),
        "not executable": (("ok", "--build", str(plain)), ("is not executable", f"chmod +x {plain}")),
        "bad env": (("ok", "--build", str(HELLO), "--env", "NOEQUALS"), ("is not K=V", "--env NAME=value")),
    }[case]
    before = dump(db_of(hello))
    refused(hello.run("host", "add", *args, check=False, subprocess=True), *words)
    assert dump(db_of(hello)) == before
    staged = [p.name for p in (hello.state_dir / "builds").iterdir()]
    assert staged == [hello.status("hello")["build_digest"]], "nothing new may be staged"


# One of each way in: a read, an intent, a definition, the agent.
COMMANDS = [("status",), ("wake", "hello"), ("host", "add", "other", "--build", str(HELLO)), ("agent",)]


def test_database_not_at_head(hello: Vigil) -> None:
    store = Store(f"sqlite:///{db_of(hello)}")
    downgrade(store.engine, "base")
    store.dispose()
    before = dump(db_of(hello))
    for args in COMMANDS:
        refused(hello.run(*args, check=False, subprocess=True, timeout=30), "needs revision", "vigil db upgrade")
        assert dump(db_of(hello)) == before, args


def test_state_dir_never_upgraded(short_tmp: Path) -> None:
    fresh = Vigil(short_tmp / "fresh")
    try:
        for args in COMMANDS:
            refused(fresh.run(*args, check=False, subprocess=True, timeout=30), "no vigil state directory",
                    "vigil db upgrade")
            assert not fresh.state_dir.exists(), f"{args}: a failed command must create nothing"
        fresh.state_dir.mkdir(mode=0o700)
        for args in (("status",), ("agent",)):
            refused(fresh.run(*args, check=False, subprocess=True, timeout=30), "no database", "vigil db upgrade")
            assert list(fresh.state_dir.iterdir()) == [], f"{args}: a failed command must create nothing"
    finally:
        fresh.cleanup()


def test_database_file_that_is_not_a_database(vigil: Vigil) -> None:
    garbage = b"this is not an SQLite database\n" * 200
    db_of(vigil).write_bytes(garbage)
    for extra in ("-wal", "-shm"):
        Path(f"{db_of(vigil)}{extra}").unlink(missing_ok=True)
    for args in (*COMMANDS, ("db", "upgrade")):
        refused(vigil.run(*args, check=False, subprocess=True, timeout=30), "not a vigil database", "--state-dir")
        assert db_of(vigil).read_bytes() == garbage, args


def test_state_dir_owned_by_someone_else(hello: Vigil) -> None:
    # We run as root, who passes every permission check: this is vigil's own ownership check.
    before = dump(db_of(hello))
    mode = hello.state_dir.stat().st_mode
    os.chown(hello.state_dir, 65534, 65534)
    try:
        for args in (*COMMANDS, ("db", "upgrade")):
            refused(hello.run(*args, check=False, subprocess=True, timeout=30), "owned by uid 65534", "--state-dir")
            assert hello.state_dir.stat().st_mode == mode, args
            assert dump(db_of(hello)) == before, args
    finally:
        os.chown(hello.state_dir, os.geteuid(), os.getegid())


@pytest.mark.parametrize("wait", [False, True])
def test_wake_while_the_last_failed_wake_is_unproven(vigil: Vigil, wait: bool) -> None:
    with in_process(vigil, fails=10**6) as (ctx, proc):
        u = leave_unproven_wake(ctx, proc, vigil)
        before = dump(db_of(vigil))
        cp = vigil.run("wake", "bad", *(["--wait"] if wait else []), check=False, subprocess=True)
        refused(cp, f"generation g{u.generation_id}", "not proven gone", "vigil obligations")
        assert cp.returncode == 4
        assert dump(db_of(vigil)) == before


def test_second_agent_on_the_same_state_dir(hello: Vigil) -> None:
    agent = hello.start_agent()
    hello.wait_ready(agent)
    # The running agent keeps beating its heartbeat; everything else must stay as it is.
    ignore = frozenset({("agents", "heartbeat_at")})
    before = dump(db_of(hello), ignore)
    cp = hello.run("agent", check=False, subprocess=True, timeout=30)
    refused(cp, f"pid {agent.pid}", "already running", f"kill {agent.pid}")
    assert dump(db_of(hello), ignore) == before
    assert agent.poll() is None, "the first agent must keep running"
