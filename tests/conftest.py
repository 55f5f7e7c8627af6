"""Shared harness: a private state dir per test, the real CLI and the real agent as
subprocesses, bounded polling, and a teardown that ends every process the test started,
by pid (the agent, then every process carrying this state dir's marker)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import subprocess as _subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from models.store import Store, sqlite_url
from workflows.config.hostrows import status

ROOT = Path(__file__).resolve().parent.parent
# The apps' `#!/usr/bin/env python3` finds this run's interpreter first, not a pyenv shim
# (these boxes put /root/.pyenv/shims first): the shim is a bash script whose forks carry
# the app's environment and command line for a moment, so a scan at that moment counts
# them as the app's processes (test_group_wake's "4 live processes for 3 spawns"), and it
# costs ~150 ms of CPU at every app start (33 ms without it).
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
FIXTURES = ROOT / "tests" / "fixtures"
HELLO = ROOT / "examples" / "hello" / "hello.py"


# -- the database under test -------------------------------------------------------------
# `pytest --db postgresql` or VIGIL_TEST_DB=postgresql runs the suite on PostgreSQL: every
# box gets a throwaway database (VIGIL_TEST_PG names the admin URL). Default: SQLite files.
TEST_DB_ENV = "VIGIL_TEST_DB"
DIALECTS = ("sqlite", "postgresql")
PG_ADMIN = os.environ.get("VIGIL_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
PG_PREFIX = f"vigil_t{os.getpid():x}_"  # this pytest run's databases


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--db", choices=DIALECTS, default=None,
                     help=f"database the suite runs on (default ${TEST_DB_ENV} or sqlite)")


def pytest_configure(config: pytest.Config) -> None:
    db = config.getoption("--db") or os.environ.get(TEST_DB_ENV) or "sqlite"
    if db not in DIALECTS:
        raise pytest.UsageError(f"{TEST_DB_ENV}={db!r}: use one of {', '.join(DIALECTS)}")
    os.environ[TEST_DB_ENV] = db  # read lazily below (tests also import this module)


def pytest_report_header(config: pytest.Config) -> str:
    return f"vigil database: {selected_db()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test runs on SQLite. On PostgreSQL run only the tests whose outcome can differ
    there: `@pytest.mark.backend("why")` (the store, its migrations, claims, locks, LISTEN,
    leases, the crash matrix's store steps) and `postgresql_only("why")`; the others are
    deselected (docs/internals/testing.md says how a new test is classified), as are the
    `sqlite_only("why")` tests of a `backend` module."""
    if not on_postgresql():
        for item in items:
            mark = item.get_closest_marker("postgresql_only")
            if mark is not None:
                why = mark.args[0] if mark.args else "one-dialect test"
                item.add_marker(pytest.mark.skip(reason=f"postgresql only: {why}"))
        return
    kept, dropped = [], []
    for item in items:
        on_both = item.get_closest_marker("backend") is not None
        if item.get_closest_marker("postgresql_only") is not None or (
                on_both and item.get_closest_marker("sqlite_only") is None):
            kept.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_sessionstart() -> None:
    """Drop what an earlier run, killed before its teardown, left on a local server."""
    if not on_postgresql():
        return
    try:
        left = _pg_databases("vigil_t")
    except sa.exc.OperationalError as exc:
        pytest.exit(f"--db postgresql: cannot connect to {sa.make_url(PG_ADMIN)} "
                    f"({' '.join(str(exc.orig).split())}); start PostgreSQL (see .ci/run) or "
                    "set VIGIL_TEST_PG to an admin URL", returncode=4)
    if sa.make_url(PG_ADMIN).host in ("127.0.0.1", "localhost", None):
        for name in left:
            pid = re.fullmatch(r"vigil_t([0-9a-f]+)_[0-9a-f]{12}", name)
            if pid and not psutil.pid_exists(int(pid[1], 16)):
                drop_db(_pg_url(name))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for starter, _ in _STARTER:
        starter.kill()
        starter.wait(10)
    left = leftovers(_RUN_DIRS)  # whatever a per-test check could not see (module fixtures)
    if left:
        print(f"\nprocesses of this run's state dirs left at its end (killed now): {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if on_postgresql():  # a database whose test died before its teardown, and the template
        for name in _pg_databases(PG_PREFIX):
            drop_db(_pg_url(name))
    for d in _TEMPLATE_DIRS:
        shutil.rmtree(d, ignore_errors=True)


_TEMPLATES: dict[str, str] = {}  # database kind -> this run's upgraded, empty store
_TEMPLATE_DIRS: list[Path] = []


def schema_template() -> str:
    """The URL of an upgraded, empty store made once per run: each box's store starts as a
    copy of it (SQLite: its file; PostgreSQL: CREATE DATABASE ... TEMPLATE), as an Alembic
    upgrade per test cost 0.4-1.3 s on SQLite and 1.3-3.6 s on PostgreSQL on a busy box."""
    kind = selected_db()
    if kind not in _TEMPLATES:
        from models import schema
        from models.statedir import prepare_state_dir

        d = Path(tempfile.mkdtemp(prefix="vgtpl", dir="/tmp"))
        _TEMPLATE_DIRS.append(d)
        state = prepare_state_dir(d / "state")
        url = new_db(state)
        store = Store(url)
        try:
            schema.upgrade(store.engine)
        finally:
            store.dispose()
        if not on_postgresql():  # everything in the file itself, nothing left in a -wal
            import sqlite3

            con = sqlite3.connect(state / "vigil.db")
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            con.close()
        _TEMPLATES[kind] = url
    return _TEMPLATES[kind]


def selected_db() -> str:
    return os.environ.get(TEST_DB_ENV, "sqlite")


def on_postgresql() -> bool:
    return selected_db() == "postgresql"


def _pg_url(name: str) -> str:
    return sa.make_url(PG_ADMIN).set(database=name).render_as_string(hide_password=False)


def _pg_admin_sql(sql: str, **params: Any) -> list[Any]:
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            result = conn.execute(sa.text(sql), params)
            return list(result.scalars()) if result.returns_rows else []
    finally:
        admin.dispose()


def _pg_databases(prefix: str) -> list[str]:
    return _pg_admin_sql("SELECT datname FROM pg_database WHERE starts_with(datname, :p)",
                         p=prefix)


def new_db(state_dir: Path, template: str | None = None) -> str:
    """A fresh database for one box: on SQLite its state dir's file (a copy of `template`'s
    file if given), on PostgreSQL a new database (created from `template` if given)."""
    if not on_postgresql():
        if template is not None:
            db = state_dir / "vigil.db"
            shutil.copyfile(sa.make_url(template).database or "", db)
            os.chmod(db, 0o600)
        return sqlite_url(state_dir)
    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{sa.make_url(template).database}"' if template else ""
    _pg_admin_sql(f'CREATE DATABASE "{name}"{copy}')
    return _pg_url(name)


def drop_db(url: str) -> None:
    """Drop a PostgreSQL database from new_db (its leftover sessions ended first); a SQLite
    file goes with its directory."""
    if url.startswith("postgresql"):
        _pg_admin_sql(f'DROP DATABASE IF EXISTS "{sa.make_url(url).database}" WITH (FORCE)')


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll until cond() is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pid_dead(pid: int) -> bool:
    """Exited or a zombie (PID 1 here does not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ignores_sigterm(pid: int) -> bool:
    """The process has set SIGTERM to SIG_IGN (a fixture that has finished starting up)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def store_cgroups(state_dir: Path, db_url: str | None = None) -> list[str]:
    """The cgroup dir of every generation the box's store knows (empty when it cannot be
    read)."""
    if db_url is None and not (state_dir / "vigil.db").exists():
        return []
    engine = sa.create_engine(db_url or sqlite_url(state_dir), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(
                "SELECT cgroup FROM generations WHERE cgroup IS NOT NULL")).scalars())
    except sa.exc.SQLAlchemyError:
        return []
    finally:
        engine.dispose()


def drop_cgroups(dirs: list[str]) -> None:
    """The dirs of generations a test ended behind vigil's back (SIGKILL by pid), which no
    agent is left to release: removed, so a suite run leaves none in the shared
    /sys/fs/cgroup tree (a busy or missing one is left alone)."""
    for d in dirs:
        if os.path.basename(d.rstrip("/")) and os.path.isdir(d):
            try:
                os.rmdir(d)
            except OSError:
                pass


def store_uuids(state_dir: Path, db_url: str | None = None) -> set[str]:
    """Every generation uuid the box's store knows (empty when it cannot be read: a test
    may have damaged it)."""
    if db_url is None and not (state_dir / "vigil.db").exists():
        return set()
    engine = sa.create_engine(db_url or sqlite_url(state_dir), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text("SELECT uuid FROM generations")).scalars())
    except sa.exc.SQLAlchemyError:
        return set()
    finally:
        engine.dispose()


def marked_pids(state_dir: Path, db_url: str | None = None) -> list[int]:
    """Live processes spawned for this state dir: they carry the marker of a generation of
    its store (apps get no VIGIL_HOME), or, where the store cannot be read, a socket under
    the state dir."""
    uuids = store_uuids(state_dir, db_url)
    home = str(state_dir) + os.sep
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if of_box(env, uuids, home):
            out.append(p.pid)
    return out


def of_box(env: dict[str, str], uuids: set[str], home: str) -> bool:
    """A process spawned for a box: it carries the marker of a generation of the box's store
    (`uuids`), or a socket under its state dir (`home`, ending in a separator)."""
    if "VIGIL_GENERATION" not in env:
        return False
    return env["VIGIL_GENERATION"] in uuids or any(
        env.get(k, "").startswith(home) for k in ("VIGIL_SOCKET", "NOTIFY_SOCKET"))


def end_holder(state_dir: Path) -> None:
    """The helpers of this state dir that outlive every agent (runners/keepers: the fd
    holder, the log keeper, their standbys, the fence keeper), until none is left: a standby
    may take over, or a helper start another standby, between a scan and its kill."""
    kill_until_none(lambda: helper_pids(state_dir), "helpers still started at teardown")


def kill_until_none(scan: Callable[[], list[int]], left: str) -> None:
    """SIGKILL by pid what `scan` finds, wait for each to die, and scan again, until a scan
    finds none (5 rounds at most, then fail saying `left`)."""
    for _ in range(5):
        pids = scan()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            wait_for(lambda pid=pid: pid_dead(pid), 5, what=f"pid {pid} to die")
    assert not scan(), left


def helper_pids(state_dir: Path) -> list[int]:
    """Live helpers of this state dir: `python -m runners.keepers.<name> STATE_DIR ...`."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            cmd = p.cmdline()
            if (len(cmd) > 3 and str(state_dir) in cmd and any(a.startswith("runners.keepers.")
                                                              for a in cmd)
                    and p.status() != psutil.STATUS_ZOMBIE):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


class Forked:
    """An agent forked by the run's starter (tests/zygote.py), seen as Popen sees a child:
    pid, poll, wait, send_signal, kill, terminate, returncode (-N when killed by signal N).
    The starter is its parent: the exit status comes over this connection."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn, self._buf = conn, b""
        self.pid = int(self._line(None) or 0)
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> str | None:
        while b"\n" not in self._buf:
            if not select.select([self._conn], [], [], timeout)[0]:
                return None
            got = self._conn.recv(64)
            if not got:
                raise AssertionError(f"the agent starter ended before agent {getattr(self, 'pid', '?')}")
            self._buf += got
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(["vigil", "agent"], timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(int(line))
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_STARTER: list[Any] = []  # (Popen of tests/zygote.py, its socket path), made once a run


def forked_agent(argv: list[str], env: dict[str, str], log: Path) -> Forked:
    """A new agent forked by the run's starter, started on the first call."""
    if not _STARTER or _STARTER[0][0].poll() is not None:
        d = Path(tempfile.mkdtemp(prefix="vgz", dir="/tmp"))
        _TEMPLATE_DIRS.append(d)
        path = str(d / "starter.sock")
        with open(d / "starter.err", "ab") as err:
            starter = subprocess.Popen([sys.executable, "-m", "tests.zygote", path, selected_db()],
                                       cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
        assert starter.stdout is not None
        with starter.stdout:
            assert starter.stdout.readline() == b"ready\n", (d / "starter.err").read_text()
        _STARTER[:] = [(starter, path)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_STARTER[0][1])
    conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT), "log": str(log)}).encode() + b"\n")
    return Forked(conn)


def run_in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `vigil ARGS` through runners.cli.main in this process, with `env` as os.environ."""
    from runners import cli

    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if k != "VIGIL_CRASH_AT"})
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(args)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["vigil", *args], code, out.getvalue(), err.getvalue())


class Vigil:
    """One box: a state dir, the CLI and the agent."""

    def __init__(self, state_dir: Path, extra_env: dict[str, str] | None = None,
                 shared_db: str | None = None, template: str | None = None) -> None:
        self.state_dir = state_dir
        self.env = {**os.environ, "VIGIL_HOME": str(state_dir), **(extra_env or {})}
        self.env.pop("VIGIL_CRASH_AT", None)
        # On PostgreSQL the CLI (in-process or not), the agent and `store` all use one
        # throwaway database; on SQLite, <state>/vigil.db. A `shared_db` (several boxes on
        # one store, tests/multibox) belongs to whoever made it: used, never dropped here.
        self.owns_db = shared_db is None and on_postgresql()
        if template is not None:  # the state dir and the store, as `db upgrade` makes them
            from models.statedir import prepare_state_dir

            prepare_state_dir(state_dir)
            if shared_db is None and not on_postgresql():
                new_db(state_dir, template)
        self.db_url = shared_db or (new_db(state_dir, template) if self.owns_db else None)
        if self.db_url:
            self.env["VIGIL_DB"] = self.db_url
        else:
            self.env.pop("VIGIL_DB", None)
        self.agents: list[subprocess.Popen[bytes]] = []
        self._store: Store | None = None

    # -- CLI ---------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 120, subprocess: bool = False) -> subprocess.CompletedProcess[str]:
        """The CLI. In-process by default (the same `main` the console script runs, minus
        ~0.6 s of interpreter start-up per call); `subprocess=True` for a real process."""
        if subprocess or (args and args[0] == "agent"):  # never run an agent inside pytest
            cp = _subprocess.run([sys.executable, "-m", "runners.cli", *args], capture_output=True,
                                 text=True, env={**self.env, **(env or {})}, timeout=timeout, cwd=ROOT)
        else:
            cp = run_in_process(list(args), {**self.env, **(env or {})})
        if check and cp.returncode != 0:
            raise AssertionError(f"vigil {' '.join(args)} exited {cp.returncode}:\n{cp.stdout}{cp.stderr}")
        return cp

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    # -- direct reads (fast: no subprocess) ------------------------------------------------
    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.db_url or f"sqlite:///{self.state_dir / 'vigil.db'}")
        return self._store

    def status(self, host: str) -> dict[str, Any]:
        return self.store.read(lambda s: status(s, host))[0]

    def obligations(self) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.exec_driver_sql("SELECT * FROM pending_obligations")]

    def add_host(self, name: str, build: Path = HELLO, *extra: str) -> None:
        self.run("host", "add", name, "--build", str(build), *extra)

    def app_pids(self) -> list[int]:
        """Live marked processes that are not one of this box's agents: what the apps left."""
        agents = {p.pid for p in self.agents}
        return [pid for pid in marked_pids(self.state_dir, self.db_url) if pid not in agents]

    # -- agent -------------------------------------------------------------------------
    def start_agent(self, crash_at: str | None = None, *extra: str,
                    real: bool = False) -> subprocess.Popen[bytes]:
        """`vigil agent`, its output appended to <state>/agent.out: forked by the run's
        agent starter (tests/zygote.py), or with `real` (or VIGIL_TEST_FORK=0) started as
        `python -m runners.cli agent` would be, for a test that reads its command line or
        /proc environment."""
        env = dict(self.env)
        if crash_at:
            env["VIGIL_CRASH_AT"] = crash_at
        argv = ["agent", "--safety-interval", "1", *extra]
        if real or os.environ.get("VIGIL_TEST_FORK", "1") == "0":
            log = open(self.state_dir / "agent.out", "ab")
            p = subprocess.Popen([sys.executable, "-m", "runners.cli", *argv], env=env,
                                 stdout=log, stderr=log, cwd=ROOT)
            log.close()
        else:
            p = forked_agent(argv, env, self.state_dir / "agent.out")  # type: ignore[assignment]
        self.agents.append(p)
        return p

    def wait_ready(self, p: subprocess.Popen[bytes], timeout: float = 20) -> None:
        try:
            wait_for(lambda: p.poll() is not None
                     or b"level=INFO logger=vigil.agent ready" in self.agent_log(),
                     timeout, what="agent ready")
        except AssertionError as exc:  # where its start stalled: its log, with times
            raise AssertionError(f"{exc}; its log:\n{self.agent_log().decode()[-4000:]}") from None
        assert p.poll() is None, f"agent exited {p.returncode}:\n{self.agent_log().decode()[-3000:]}"

    def ready_count(self) -> int:
        """How many agents have logged `ready` in this box's (appended) agent log."""
        return self.agent_log().count(b"level=INFO logger=vigil.agent ready")

    def wait_ready_after(self, p: subprocess.Popen[bytes], before: int, timeout: float = 20) -> None:
        """Like wait_ready for a restarted agent: the log is appended, so an earlier agent's
        `ready` line is already there; wait for one more than `before` (ready_count())."""
        try:
            wait_for(lambda: p.poll() is not None or self.ready_count() > before, timeout,
                     what="restarted agent ready")
        except AssertionError as exc:  # where its start stalled: its log, with times
            raise AssertionError(f"{exc}; its log:\n{self.agent_log().decode()[-4000:]}") from None
        assert p.poll() is None, f"agent exited {p.returncode}:\n{self.agent_log().decode()[-3000:]}"

    def agent_log(self) -> bytes:
        try:
            return (self.state_dir / "agent.out").read_bytes()
        except FileNotFoundError:
            return b""

    def stop_agent(self, p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if p.poll() is None:
            p.send_signal(sig)
        return p.wait(timeout)

    def quiesce(self, timeout: float = 30) -> None:
        """No open obligation left (the agent has finished everything in flight)."""
        wait_for(lambda: not self.obligations(), timeout, interval=0.1,
                 what=f"quiescence (open: {self.obligations()})")

    def check(self) -> None:
        cp = self.run("check", check=False)
        assert cp.returncode == 0, f"vigil check failed:\n{cp.stdout}{cp.stderr}"

    # -- teardown ----------------------------------------------------------------------
    def _drop_memory_parents(self) -> None:
        """The v1 memory parents of this box's tiered hosts (runners/backend/cglimits.py),
        left behind when a test killed the apps itself: removed, deepest first."""
        from runners.backend.cglimits import PARENTS, v1_mounts

        mount, idfile = v1_mounts().get("memory"), self.state_dir / "agent-id"
        if mount is None or not idfile.exists():
            return
        root = Path(mount) / "vigil" / PARENTS / idfile.read_text().strip()
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            d.rmdir()
        if root.is_dir():
            root.rmdir()

    def _end_marked(self) -> None:
        """Every process of this box's generations, SIGKILLed by pid until a scan finds none:
        a pre-fork server's master (gunicorn's) may fork a worker between a scan and its
        kill, and that worker then outlives it."""
        kill_until_none(lambda: marked_pids(self.state_dir, self.db_url),
                        "processes still forked at teardown")

    def cleanup(self) -> None:
        if self._store is not None:
            self._store.dispose()
        for p in self.agents:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self._end_marked()
        self._drop_memory_parents()
        drop_cgroups(store_cgroups(self.state_dir, self.db_url))
        end_holder(self.state_dir)
        if self.owns_db and self.db_url:  # after every process that used it is gone
            drop_db(self.db_url)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory: unix socket paths must stay under 108 bytes. Every box of a test
    lives in one, so a process still naming it once the test's teardown is over was left
    behind: it is killed by pid and the test fails, naming it."""
    d = Path(tempfile.mkdtemp(prefix="vg", dir="/tmp"))
    _RUN_DIRS.append(str(d))
    since = time.time()
    yield d
    try:
        left = leftovers([str(d)], since)
        assert not left, f"processes left behind by this test (killed now): {left}"
    finally:
        shutil.rmtree(d, ignore_errors=True)


_RUN_DIRS: list[str] = []  # every short_tmp of this run, for the session's last check


def naming(p: psutil.Process, dirs: list[str]) -> bool:
    """The process names one of `dirs` in its command line, its environment or its cwd."""
    seps = tuple(d.rstrip(os.sep) for d in dirs)
    try:
        text = [*p.cmdline(), *p.environ().values(), p.cwd()]
    except (psutil.Error, OSError):
        return False
    return any(v == d or v.startswith(d + os.sep) or (d + os.sep) in v
               for v in text for d in seps)


def leftovers(dirs: list[str], since: float = 0.0) -> list[str]:
    """Live (not zombie) processes started after `since` that name one of `dirs`, and
    their descendants (an nginx master names its prefix, its workers name nothing; killing
    the master alone left the workers running): each SIGKILLed by pid, and described (pid,
    parent, start time, command line)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.create_time() < since - 1 or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if not naming(p, dirs):
                continue
            tree = [p, *p.children(recursive=True)]
        except (psutil.Error, OSError):
            continue
        for q in tree:
            try:
                found.append(f"pid {q.pid} (parent {q.ppid()}, started "
                             f"{time.strftime('%H:%M:%S', time.localtime(q.create_time()))}): "
                             f"{' '.join(q.cmdline())[:300]}")
                q.kill()
            except (psutil.Error, OSError):
                continue
    return found


@pytest.fixture(params=["auto"])
def containment(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def vigil(short_tmp: Path, containment: str) -> Iterator[Vigil]:
    v = Vigil(short_tmp / "state", {"VIGIL_CONTAINMENT": containment},
              template=schema_template())  # what `vigil db upgrade` makes, copied
    try:
        yield v
    finally:
        v.cleanup()


@pytest.fixture
def ctx(vigil: Vigil) -> Iterator[Any]:
    """A Context of the box's store, as the agent makes it (for driving workflows in the
    test's own process)."""
    from runners.wiring import make_context, open_store

    store: Store = open_store(vigil.state_dir, vigil.db_url)
    try:
        yield make_context(vigil.state_dir, store, "test-agent")
    finally:
        store.dispose()
