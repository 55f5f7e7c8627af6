"""Several boxes, one store: a throwaway PostgreSQL database per test and several `Box`es
sharing it, each a state dir of its own (standing for one machine) with its own agent.

The agents run with a short lease TTL (LEASE_TTL) so takeovers happen within a test.
Teardown ends, by pid, every agent, app and fence keeper a test started.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from models import schema
from models.store import Store
from runners.keepers.fencekeeper import keeper_pid
from tests.conftest import Vigil, wait_for

PG_ADMIN = os.environ.get("VIGIL_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
LEASE_TTL = 6.0  # renewal every 1 s, self-fence 4 s after the last renewal (runners/agent/fencing.py)


@pytest.fixture
def pg_url() -> Iterator[str]:
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect():
            pass
    except OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN}: {exc.orig}")
    name = f"vigil_mb_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    store = Store(url)
    try:
        schema.upgrade(store.engine)
    finally:
        store.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer",) if os.access(p, os.X_OK)), None)


@dataclass
class Pooler:
    url: str  # the test's database through PgBouncer, transaction mode
    direct: str  # the same database on the server: the LISTEN session's (VIGIL_LISTEN_DB)
    pid: int
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pgbouncer(pg_url: str) -> Iterator[Pooler]:
    """A PgBouncer of this test's own (its ini and port in a tmp dir, pool_mode transaction,
    trust auth) in front of the test's database; started and ended by its pid."""
    if PGBOUNCER is None:
        pytest.skip("pgbouncer is not installed: apt-get install pgbouncer (.ci/run installs it)")
    server = sa.make_url(pg_url)
    home = Path(tempfile.mkdtemp(prefix="vgpgb", dir="/tmp"))
    home.chmod(0o755)  # readable by the user it runs as (PgBouncer refuses to run as root)
    port = _free_port()
    user = server.username or getpass.getuser()
    (home / "users.txt").write_text(f'"{user}" ""\n')
    # A small server pool shared by every client, handed out round robin: each transaction
    # runs on another server session, so session state or a prepared statement kept by
    # vigil breaks at once.
    (home / "pgbouncer.ini").write_text(
        f"[databases]\n{server.database} = host={server.host or '127.0.0.1'} "
        f"port={server.port or 5432} dbname={server.database}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home / 'users.txt'}\npool_mode = transaction\n"
        "default_pool_size = 6\nmin_pool_size = 3\nserver_round_robin = 1\n"
        "max_client_conn = 400\nserver_reset_query =\n"
        "ignore_startup_parameters = extra_float_digits\n"
        + ("user = postgres\n" if os.geteuid() == 0 else ""))
    log = home / "pgbouncer.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([PGBOUNCER, str(home / "pgbouncer.ini")], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    pooled = server.set(port=port, host="127.0.0.1").render_as_string(hide_password=False)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pgbouncer exited {proc.returncode}: {log.read_text()[-2000:]}")
        eng = sa.create_engine(pooled, poolclass=sa.pool.NullPool)
        try:
            with eng.connect() as c:
                return c.execute(sa.text("SELECT 1")).scalar() == 1
        except OperationalError:
            return False
        finally:
            eng.dispose()

    try:
        wait_for(answers, 20, interval=0.1, what="pgbouncer answering")
        yield Pooler(pooled, pg_url, proc.pid, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)


class Box(Vigil):
    """One box: its own state dir and agent, the shared PostgreSQL store."""

    def __init__(self, name: str, state_dir: Path, url: str) -> None:
        super().__init__(state_dir, {"VIGIL_SETTLE_SECONDS": "0.5"}, shared_db=url)
        self.name = name
        self.url = url
        state_dir.mkdir(parents=True, mode=0o700)

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.url)
        return self._store

    def start(self) -> subprocess.Popen[bytes]:
        p = self.start_agent(None, "--box", self.name, "--lease-ttl", str(LEASE_TTL))
        self.wait_ready(p, timeout=60)
        return p

    def agent(self) -> subprocess.Popen[bytes]:
        return self.agents[-1]

    def app_procs(self) -> dict[str, dict[int, str]]:
        """host -> {pid: generation marker} of this box's live app processes."""
        return app_procs([self]).get(self.name, {})

    def cleanup(self) -> None:
        for p in self.agents:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped agent cannot die of SIGKILL later
        super().cleanup()
        pid = keeper_pid(self.state_dir)
        if pid and pid > 0:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def app_procs(boxes: list[Box]) -> dict[str, dict[str, dict[int, str]]]:
    """box -> host -> {pid: generation marker} of its live processes (not zombies): one scan."""
    # Apps carry no VIGIL_HOME: a box's apps are those whose own socket lies in its state dir.
    homes = {str(b.state_dir) + os.sep: b.name for b in boxes}
    out: dict[str, dict[str, dict[int, str]]] = {}
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            box = next((name for home, name in homes.items() if any(
                env.get(k, "").startswith(home) for k in ("VIGIL_SOCKET", "NOTIFY_SOCKET"))), None)
            if box is None or "VIGIL_GENERATION" not in env or p.status() == psutil.STATUS_ZOMBIE:
                continue
            out.setdefault(box, {}).setdefault(env["VIGIL_HOST"], {})[p.pid] = env["VIGIL_GENERATION"]
        except (psutil.Error, OSError):
            continue
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def boxes(request: pytest.FixtureRequest, short_tmp: Path,
          pg_url: str) -> Iterator[Callable[[str], Box]]:
    made: list[Box] = []

    def make(name: str) -> Box:
        b = Box(name, short_tmp / name, pg_url)
        made.append(b)
        return b

    try:
        yield make
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for b in made:  # shown with the captured output of the failing test
                print(f"--- box {b.name} agent log (tail) ---\n{b.agent_log().decode()[-6000:]}")
                keeper = b.state_dir / "fencekeeper.log"
                if keeper.exists():
                    print(f"--- box {b.name} fence keeper ---\n{keeper.read_text()[-1500:]}")
            if made:
                print(store_dump(made[0].store))
    finally:
        for b in made:
            b.cleanup()


def store_dump(store: Store) -> str:
    """What the shared store holds when a test failed: open obligations, leases, live
    generations, the last events (a stall shows here, not in the agents' logs)."""
    queries = {
        "pending_obligations": "SELECT * FROM pending_obligations ORDER BY host",
        "leases": "SELECT host, holder, fence, expires_at FROM leases ORDER BY host",
        "live generations": "SELECT id, host, state, agent_id, pid FROM generations "
                            "WHERE state <> 'proven' ORDER BY host",
        "events of hosts with no current generation":
            "SELECT at, kind, host, detail FROM events WHERE host IN (SELECT name FROM hosts "
            "WHERE name NOT IN (SELECT host FROM generations WHERE state = 'current')) "
            "ORDER BY host, id LIMIT 200",
        "last events": "SELECT at, kind, host, detail FROM events ORDER BY id DESC LIMIT 40",
    }
    out = []
    for title, sql in queries.items():
        try:
            rows = store.read(lambda s, sql=sql: s.execute(sa.text(sql)).all())
        except Exception as exc:  # a dump must never hide the test's own failure
            rows = [f"({type(exc).__name__}: {exc})"]
        out.append(f"--- {title} ---\n" + "\n".join(str(tuple(r)) if not isinstance(r, str)
                                                     else r for r in rows))
    return "\n".join(out)


class Sampler:
    """Samples, every `interval`, the live processes of every box (psutil, grouped by their
    generation marker) and the store's live generations, per host; records each instant
    two generations of one host live."""

    def __init__(self, boxes: list[Box], interval: float = 0.05) -> None:
        self.boxes = boxes
        self.interval = interval
        self.samples = 0
        self.double: list[str] = []
        self.last_alive: dict[str, float] = {}  # box name -> last instant one of its apps lived
        self._stop = False
        import threading

        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop = True
        self._thread.join(30)

    def _run(self) -> None:
        from sqlalchemy import func, select

        from models.states import LIVE_GEN
        from models.tables import Generation

        store = self.boxes[0].store
        while not self._stop:
            now = time.time()
            per_host: dict[str, set[str]] = {}  # host -> live generations (by marker)
            for box, procs in app_procs(self.boxes).items():
                self.last_alive[box] = now
                for host, marks in procs.items():
                    per_host.setdefault(host, set()).update(f"{box}:{m[:8]}" for m in marks.values())
            self.double += [f"{now:.2f} psutil: {h} has live generations {sorted(gs)}"
                            for h, gs in per_host.items() if len(gs) > 1]
            rows = store.read(lambda s: s.execute(
                select(Generation.host, func.count()).where(Generation.state.in_(LIVE_GEN))
                .group_by(Generation.host)).all())
            self.double += [f"{now:.2f} store: {h} has {n} live generations"
                            for h, n in rows if n > 1]
            self.samples += 1
            time.sleep(self.interval)
