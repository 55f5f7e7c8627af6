"""A damaged or unavailable store (issue 16 items 7, 8, 9, 11): every command says what
is wrong in one line (the cause, then the fix), and the agent stops acting on a store it
can no longer trust and says so, once, then at a slow cadence -- never a traceback.

Each damage is done for real: a second process holding SQLite's write lock, the -wal file
unlinked under a running agent, a page of the file overwritten, the file made read-only,
the schema downgraded under a running agent."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from models.schema import downgrade
from models.schema import upgrade as schema_upgrade
from tests.conftest import HELLO, ROOT, Vigil, wait_for
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


# -- item 9: damage and an environment vigil cannot use -------------------------------------

NO_DAC = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
          "--bounding-set=-dac_override,-dac_read_search"]


def as_plain_user(v: Vigil, *args: str, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess[str]:
    """`vigil ARGS` as a real process whose file access is checked as for any user: root
    without CAP_DAC_OVERRIDE (these boxes run the tests as root, which reads and writes
    everything otherwise)."""
    return subprocess.run([*NO_DAC, sys.executable, "-m", "runners.cli", *args],
                          capture_output=True, text=True, env={**v.env, **(env or {})},
                          timeout=120, cwd=ROOT)


def checkpoint(v: Vigil) -> None:
    """Everything in the -wal written into vigil.db, nothing left open."""
    v.store.dispose()
    with sqlite3.connect(v.state_dir / "vigil.db") as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def damage_table(v: Vigil, table: str) -> None:
    """Overwrite the root page of `table` in the file with garbage (as a bad disk would)."""
    checkpoint(v)
    db = v.state_dir / "vigil.db"
    conn = sqlite3.connect(db)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    conn.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\x55" * page_size)


@pytest.mark.sqlite_only("a page of the SQLite file overwritten")
def test_damaged_database_is_one_line_naming_the_recovery(vigil: Vigil) -> None:
    vigil.add_host("hello")
    damage_table(vigil, "hosts")
    for args in (["status"], ["host", "list"], ["wake", "hello"], ["check"]):
        refused(vigil.run(*args, check=False), "damaged", "malformed", "backup", ".recover")
    # The agent too: one line on its log, a non-zero exit, no traceback.
    agent = vigil.start_agent()
    assert agent.wait(60) != 0
    log = vigil.agent_log().decode()
    assert "Traceback" not in log, log
    (line,) = [ln for ln in log.splitlines() if "damaged" in ln]
    assert ".recover" in line and "backup" in line, line
    # The salvage the line gives works where the sqlite3 shell has `.recover` (it needs the
    # sqlite_dbpage table, which e.g. Debian's 3.40 shell is built without).
    probe = subprocess.run(["sqlite3", ":memory:", "SELECT count(*) FROM sqlite_dbpage"],
                           capture_output=True) if shutil.which("sqlite3") else None
    if probe is not None and probe.returncode == 0:
        db = vigil.state_dir / "vigil.db"
        subprocess.run(f"sqlite3 {db} .recover | sqlite3 {db}.recovered", shell=True,
                       check=True, capture_output=True)
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{db}{suffix}").exists():
                os.replace(f"{db}{suffix}", f"{db}{suffix}.damaged")
        os.replace(f"{db}.recovered", db)
        assert vigil.run("db", "current").stdout.startswith("0006")
        one_line_ok(vigil.run("status", check=False))


@pytest.mark.sqlite_only("file modes of the SQLite file")
def test_read_only_database_reads_work_writes_are_one_line(vigil: Vigil) -> None:
    vigil.add_host("hello")
    checkpoint(vigil)
    os.chmod(vigil.state_dir / "vigil.db", 0o400)
    one_line_ok(as_plain_user(vigil, "status"))
    refused(as_plain_user(vigil, "wake", "hello"), "cannot be written", "writable")
    cp = as_plain_user(vigil, "agent", "--safety-interval", "1")
    refused(cp, "cannot be written", "writable")
    os.chmod(vigil.state_dir / "vigil.db", 0o600)
    assert vigil.obligations() == []


@pytest.fixture
def elsewhere(short_tmp: Path) -> Iterator[Path]:
    """Directories of another user (uid 1234): one open (0755), one private (0700), and a
    regular file."""
    base = short_tmp / "other"
    base.mkdir()
    (base / "open").mkdir(mode=0o755)
    (base / "private").mkdir(mode=0o700)
    (base / "file").write_text("not a directory\n")
    for p in (base / "open", base / "private", base / "file"):
        os.chown(p, 1234, 1234)
    yield base


@pytest.mark.parametrize(("where", "words", "status_words"), [
    ("open/state", ["owned by uid 1234", "may not write"], ["no vigil state directory"]),
    ("private/state", ["owned by uid 1234", "may not enter"], None),
    ("private/deep/state", ["owned by uid 1234", "may not enter"], None),
    ("file/state", ["is a file, not a directory"], None),
    ("file", ["not a directory"], None),
])
@pytest.mark.parametrize("command", ["db upgrade", "status"])
def test_state_dir_out_of_reach_is_one_line(vigil: Vigil, elsewhere: Path, where: str,
                                            words: list[str], status_words: list[str] | None,
                                            command: str) -> None:
    home = elsewhere / where
    cp = as_plain_user(vigil, *command.split(), env={"VIGIL_HOME": str(home), "VIGIL_DB": ""})
    refused(cp, str(home), *(status_words if command == "status" and status_words else words))
    assert not (elsewhere / "open" / "state").exists()


def test_hosts_file_that_is_not_utf8_is_one_line(vigil: Vigil, short_tmp: Path) -> None:
    f = short_tmp / "hosts.toml"
    f.write_bytes(b'[hosts.web]\nbuild = "' + str(HELLO).encode() + b'"\ncwd = "caf\xe9"\n')
    before = vigil.obligations()
    refused(vigil.run("apply", str(f), check=False), "hosts.toml:3", "not UTF-8", "UTF-8")
    refused(vigil.run("apply", "--dry-run", str(f), check=False), "not UTF-8")
    assert vigil.json("host", "list") == [] and vigil.obligations() == before


NAN_ENTRIES = [
    (["host", "add", "x", "--build", str(HELLO), "--drain-timeout", "nan"], {}),
    (["host", "add", "x", "--build", str(HELLO), "--health-timeout", "NaN"], {}),
    (["host", "add", "x", "--build", str(HELLO), "--kind", "worker", "--max-run", "-nan"], {}),
    (["host", "add", "x", "--build", str(HELLO), "--kind", "worker", "--restart-cap", "nan"], {}),
    (["wake", "x", "--wait", "--timeout", "nan"], {}),
    (["agent", "--safety-interval", "nan"], {}),
    (["agent", "--sweep-interval", "nan"], {}),
    (["agent"], {"VIGIL_LEASE_TTL": "nan"}),
    (["agent"], {"VIGIL_SETTLE_SECONDS": "nan"}),
]


@pytest.mark.parametrize(("args", "env"), NAN_ENTRIES, ids=[" ".join(a[-2:]) + "".join(e)
                                                             for a, e in NAN_ENTRIES])
def test_nan_duration_is_refused_at_every_entry(vigil: Vigil, args: list[str],
                                                env: dict[str, str]) -> None:
    refused(vigil.run(*args, check=False, env=env), "nan")
    assert vigil.json("host", "list") == [] and vigil.obligations() == []


@pytest.mark.parametrize("key", ["drain_timeout = nan", "health_timeout = -nan",
                                 "restart_floor = nan"])
def test_nan_duration_in_a_hosts_file_is_refused(vigil: Vigil, short_tmp: Path, key: str) -> None:
    f = short_tmp / "hosts.toml"
    kind = 'kind = "worker"\n' if "restart" in key else ""
    f.write_text(f'[hosts.web]\nbuild = "{HELLO}"\n{kind}{key}\n')
    refused(vigil.run("apply", str(f), check=False), "nan")
    assert vigil.json("host", "list") == []


# -- item 8: the -wal deleted under a running agent -------------------------------------------


def agent_lines(v: Vigil, word: str) -> list[str]:
    return [ln for ln in v.agent_log().decode().splitlines() if word in ln]


@pytest.mark.sqlite_only("SQLite's -wal file, unlinked under the agent")
def test_wal_deleted_under_the_agent_halts_it_and_loses_nothing(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait", "--timeout", "60")
    pid = vigil.status("hello")["pid"]
    vigil.store.dispose()  # the test's own connections closed: only the agent has it open
    os.unlink(vigil.state_dir / "vigil.db-wal")

    # The agent notices at its next round or sweep (a second at most), stops acting, and
    # says so in one line: what happened and what to do.
    wait_for(lambda: agent_lines(vigil, "halted kind=replaced"), 20, what="the agent to halt")
    (line,) = agent_lines(vigil, "halted kind=replaced")
    assert "vigil.db-wal was deleted" in line and "restart the agent" in line, line
    assert (vigil.state_dir / "agent.halted").exists()
    # Commands work again (its commits were written back), and say it has stopped acting.
    cp = vigil.run("status", check=False)
    one_line_ok(cp)
    assert "the agent has stopped acting" in cp.stderr and "vigil.db-wal" in cp.stderr
    cp = vigil.run("check", "--json", check=False)
    assert cp.returncode == 1 and "agent_halted" in cp.stdout, cp.stdout + cp.stderr
    events = [e["kind"] for e in vigil.json("events", "hello")]
    assert "woke" in events, events  # written before the -wal went: not lost
    # It acts on nothing: a stop stays queued, the app keeps running.
    vigil.run("stop", "hello")
    time.sleep(3)
    assert psutil.pid_exists(pid) and vigil.status("hello")["state"] == "stopping"
    assert [o["kind"] for o in vigil.obligations()] == ["stop"]
    log = vigil.agent_log().decode()
    assert "Traceback" not in log, log
    assert len(agent_lines(vigil, "halted")) == 1  # said once (again only every minute)

    # A restarted agent finishes the work, and nothing is left over.
    assert vigil.stop_agent(agent) == 1
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    vigil.quiesce()
    assert vigil.status("hello")["state"] == "asleep"
    assert not (vigil.state_dir / "agent.halted").exists()
    vigil.check()


# -- item 11: the schema downgraded under a running agent -------------------------------------


@pytest.mark.backend("the schema check, per dialect")
def test_schema_downgraded_under_the_agent_halts_it_with_one_line(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait", "--timeout", "60")
    pid = vigil.status("hello")["pid"]
    downgrade(vigil.store.engine, "0003")  # what a `vigil db` of an older vigil would do
    wait_for(lambda: agent_lines(vigil, "halted kind=schema"), 20, what="the agent to halt")
    (line,) = agent_lines(vigil, "halted kind=schema")
    assert "revision 0003" in line and "vigil db upgrade" in line, line
    # Slow cadence: nothing more for a while (a reminder a minute), no traceback, and the
    # app it runs is left alone.
    time.sleep(4)
    log = vigil.agent_log().decode()
    assert "Traceback" not in log and "apscheduler" not in log, log
    assert len(agent_lines(vigil, "halted")) == 1, agent_lines(vigil, "halted")
    assert psutil.pid_exists(pid)
    # Once upgraded and restarted, the agent goes on as before (the app adopted).
    schema_upgrade(vigil.store.engine)
    assert vigil.stop_agent(agent) == 1
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    assert vigil.status("hello")["pid"] == pid
    vigil.run("stop", "hello", "--wait", "--timeout", "60")
    vigil.check()
