"""Bad input gets a clear error and loses nothing: each case below exits non-zero with ONE
line on stderr naming the cause and the fix, no traceback, and leaves every row (and the
database file) exactly as it was."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from models.schema import downgrade
from tests.conftest import HELLO, Vigil, on_postgresql, run_in_process
from tests.integration.unproven_double import in_process, leave_unproven_wake

# Rows a running agent writes of what it sees (the descendants its walks find), whatever a
# command does: "nothing changed" is about what the command wrote.
OBSERVED = {"known_processes"}


def dump(v: Vigil, ignore: frozenset[tuple[str, str]] = frozenset()) -> dict[str, object]:
    """Schema (tables, columns, views) and every row of every table (minus `ignore`d
    (table, column) pairs) of the box's database, on either dialect."""
    with v.store.engine.connect().execution_options(vigil_readonly=True) as conn:
        insp = sa.inspect(conn)
        out: dict[str, object] = {"views": sorted(insp.get_view_names())}
        for table in sorted(insp.get_table_names()):
            cols = [c["name"] for c in insp.get_columns(table)]
            out[f"{table} columns"] = cols
            if table in OBSERVED:
                continue
            keep = [c for c in cols if (table, c) not in ignore]
            rows = conn.execute(sa.text(f'SELECT {", ".join(keep)} FROM "{table}"'))
            out[table] = sorted((tuple(r) for r in rows), key=repr)
    return out


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
    before = dump(hello)
    refused(hello.run(*args, check=False, subprocess=True), "no host named 'nope'", "vigil host list")
    assert dump(hello) == before


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
    before = dump(hello)
    refused(hello.run("host", "add", *args, check=False, subprocess=True), *words)
    assert dump(hello) == before
    staged = [p.name for p in (hello.state_dir / "builds").iterdir()]
    assert staged == [hello.status("hello")["build_digest"]], "nothing new may be staged"


# One of each way in: a read, an intent, a definition, the agent.
COMMANDS = [("status",), ("wake", "hello"), ("host", "add", "other", "--build", str(HELLO)), ("agent",)]


@pytest.mark.backend("the schema check, per dialect")
def test_database_not_at_head(hello: Vigil) -> None:
    downgrade(hello.store.engine, "base")
    before = dump(hello)
    for args in COMMANDS:
        refused(hello.run(*args, check=False, timeout=30), "needs revision", "vigil db upgrade")
        assert dump(hello) == before, args


@pytest.mark.backend("an empty store, per dialect")
def test_state_dir_never_upgraded(short_tmp: Path) -> None:
    fresh = Vigil(short_tmp / "fresh")
    try:
        for args in COMMANDS:
            refused(fresh.run(*args, check=False, timeout=30), "no vigil state directory",
                    "vigil db upgrade")
            assert not fresh.state_dir.exists(), f"{args}: a failed command must create nothing"
        fresh.state_dir.mkdir(mode=0o700)
        missing = "empty database" if on_postgresql() else "no database"  # VIGIL_DB is empty
        for args in (("status",), ("agent",)):
            refused(fresh.run(*args, check=False, timeout=30), missing, "vigil db upgrade")
            assert list(fresh.state_dir.iterdir()) == [], f"{args}: a failed command must create nothing"
    finally:
        fresh.cleanup()


@pytest.mark.parametrize("url,words", [
    ("mysql://u@h/db", ("vigil does not run on mysql", "postgresql+psycopg://")),
    ("postgresql+psycopg2://u@h/db", ("does not run on postgresql+psycopg2", "sqlite:///")),
    ("::nonsense", ("cannot parse the database URL", "postgresql+psycopg://")),
    # Nothing listens on port 1: the driver's two-line message comes out as one line.
    ("postgresql://u:secret@127.0.0.1:1/db", ("cannot reach the PostgreSQL database", "u:***@",
                                                "Connection refused", "PostgreSQL is up")),
])
def test_database_url_refused(short_tmp: Path, url: str, words: tuple[str, ...]) -> None:
    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    env = {**os.environ, "VIGIL_HOME": str(state), "VIGIL_DB": url}
    for args in (*COMMANDS, ("db", "upgrade")):
        assert "secret" not in refused(run_in_process(list(args), env), *words), "password shown"
        assert list(state.iterdir()) == [], f"{args}: a refused command must create nothing"


@pytest.mark.sqlite_only("a corrupt SQLite file in the state dir")
def test_database_file_that_is_not_a_database(vigil: Vigil) -> None:
    garbage = b"this is not an SQLite database\n" * 200
    db_of(vigil).write_bytes(garbage)
    for extra in ("-wal", "-shm"):
        Path(f"{db_of(vigil)}{extra}").unlink(missing_ok=True)
    for args in (*COMMANDS, ("db", "upgrade")):
        refused(vigil.run(*args, check=False, timeout=30), "not a vigil database", "--state-dir")
        assert db_of(vigil).read_bytes() == garbage, args


def test_state_dir_owned_by_someone_else(hello: Vigil) -> None:
    # We run as root, who passes every permission check: this is vigil's own ownership check.
    before = dump(hello)
    mode = hello.state_dir.stat().st_mode
    os.chown(hello.state_dir, 65534, 65534)
    try:
        for args in (*COMMANDS, ("db", "upgrade")):
            refused(hello.run(*args, check=False, timeout=30), "owned by uid 65534", "--state-dir")
            assert hello.state_dir.stat().st_mode == mode, args
            assert dump(hello) == before, args
    finally:
        os.chown(hello.state_dir, os.geteuid(), os.getegid())


@pytest.mark.parametrize("wait", [False, True])
def test_wake_while_the_last_failed_wake_is_unproven(vigil: Vigil, wait: bool) -> None:
    with in_process(vigil, fails=10**6) as (ctx, proc):
        u = leave_unproven_wake(ctx, proc, vigil)
        before = dump(vigil)
        cp = vigil.run("wake", "bad", *(["--wait"] if wait else []), check=False, subprocess=True)
        refused(cp, f"generation g{u.generation_id}", "not proven gone", "vigil obligations")
        assert cp.returncode == 4
        assert dump(vigil) == before


def test_second_agent_on_the_same_state_dir(hello: Vigil) -> None:
    agent = hello.start_agent()
    hello.wait_ready(agent)
    # The running agent keeps beating its heartbeat; everything else must stay as it is.
    ignore = frozenset({("agents", "heartbeat_at")})
    before = dump(hello, ignore)
    cp = hello.run("agent", check=False, timeout=30)
    refused(cp, f"pid {agent.pid}", "already running", f"kill {agent.pid}")
    assert dump(hello, ignore) == before
    assert agent.poll() is None, "the first agent must keep running"


@pytest.mark.sqlite_only("--listen off is refused beside a SQLite store only")
def test_agent_listen_off_beside_sqlite(hello: Vigil) -> None:
    before = dump(hello)
    cp = hello.run("agent", "--listen", "off", check=False, timeout=30)
    refused(cp, "--listen off is for a PostgreSQL store", "leave it out")
    assert dump(hello) == before
