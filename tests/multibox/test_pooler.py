"""Two boxes on one PostgreSQL through PgBouncer in transaction mode (issue 28 item 3): every
connection of the agents and the CLI goes through the pooler, where each transaction may
run on another server session, except each agent's LISTEN session, which goes to the server
direct (VIGIL_LISTEN_DB). The boxes wake hosts on the CLI's NOTIFY, deploy, and an agent
killed -9 recovers; `vigil check` is clean; nothing failed on a prepared statement."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy import select

from models.states import GenState
from models.store import Store
from models.tables import Build, Generation
from runners.base.doorbell import running_agent_pid
from tests.conftest import pid_dead, wait_for
from tests.integration.test_rollouts import build_variant
from tests.multibox.conftest import LEASE_TTL, Box, Pooler
from tests.multibox.test_multibox import add_hosts, leases, serving

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.postgresql_only("PgBouncer in front of PostgreSQL")]

NAMES = [f"p{i}" for i in range(6)]
# Longer than the test waits for a wake: a round must come from the CLI's NOTIFY, heard
# on the LISTEN session, not from the backstop scan.
SAFETY = "300"


@pytest.fixture
def pooled(short_tmp: Path, pgbouncer: Pooler) -> Iterator[Callable[[str], Box]]:
    made: list[Box] = []

    def make(name: str) -> Box:
        b = Box(name, short_tmp / name, pgbouncer.url)
        b.env["VIGIL_LISTEN_DB"] = pgbouncer.direct
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.cleanup()


def start(box: Box) -> psutil.Process:
    p = box.start_agent(None, "--box", box.name, "--lease-ttl", str(LEASE_TTL),
                        "--safety-interval", SAFETY)
    box.wait_ready(p, timeout=60)
    return psutil.Process(p.pid)


def direct_sessions(agent: psutil.Process, server_port: int, direct: str) -> list[str]:
    """The queries of the server sessions the agent reaches without the pooler."""
    ports = [c.laddr.port for c in agent.net_connections("tcp")
             if c.raddr and c.raddr.port == server_port and c.status == psutil.CONN_ESTABLISHED]
    eng = sa.create_engine(direct, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            return [c.execute(sa.text("SELECT query FROM pg_stat_activity WHERE client_port = :p"),
                              {"p": port}).scalar() for port in ports]
    finally:
        eng.dispose()


def current_pids(box: Box) -> dict[str, int]:
    return dict(box.store.read(lambda s: s.execute(select(Generation.host, Generation.pid).where(
        Generation.state == GenState.current)).all()))


def current_digest(box: Box, host: str) -> str:
    return box.store.read(lambda s: s.execute(select(Build.digest).join(
        Generation, Generation.build_id == Build.id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar_one())


def test_two_boxes_through_pgbouncer_wake_deploy_and_recover(pooled, pgbouncer) -> None:  # type: ignore[no-untyped-def]
    a, b = pooled("a"), pooled("b")
    add_hosts(a, NAMES, "a,b")
    (b.state_dir / "builds").symlink_to(a.state_dir / "builds")  # one staging root (as a fleet)
    agents = {"a": start(a), "b": start(b)}
    server_port = sa.make_url(pgbouncer.direct).port or 5432
    for name, agent in agents.items():  # the only session that skips the pooler: LISTEN
        wait_for(lambda agent=agent: [q.split("_")[0] for q in direct_sessions(
            agent, server_port, pgbouncer.direct)] == ["LISTEN vigil"], 20, interval=0.2,
            what=f"{name}: one direct session, its LISTEN (then its probe's)")

    a.run("wake", *NAMES)  # through the pooler: the intents, then NOTIFY vigil
    wait_for(lambda: serving(a, NAMES, {"a", "b"}), 120, interval=0.25, what="6 hosts awake")

    new = build_variant(a.state_dir.parent / "hello-next.py")
    owner = leases(a)
    target = NAMES[0]
    a.run("deploy", target, str(new), "--wait", "--timeout", "120")
    assert current_digest(a, target) == hashlib.sha256(new.read_bytes()).hexdigest()
    wait_for(lambda: serving(a, NAMES, {"a", "b"}), 60, interval=0.25, what="deployed host serving")

    victim = owner[NAMES[1]]
    box = a if victim == "a" else b
    before = current_pids(a)
    agents[victim].send_signal(signal.SIGKILL)
    box.agent().wait(10)
    ready = box.ready_count()
    restarted = box.start_agent(None, "--box", box.name, "--lease-ttl", str(LEASE_TTL),
                                "--safety-interval", SAFETY)
    box.wait_ready_after(restarted, ready, timeout=60)
    wait_for(lambda: serving(a, NAMES, {"a", "b"}), 120, interval=0.25, what="served after the kill")
    kept = {h: p for h, p in current_pids(a).items() if before.get(h) == p}
    print(f"after kill -9 of {victim}'s agent: {len(kept)} of {len(NAMES)} hosts kept their pid")
    for x in (a, b):
        x.check()
        log = x.agent_log().decode()
        assert "prepared statement" not in log, log[-3000:]
        assert "LISTEN vigil failed" not in log and "hears no NOTIFY" not in log, log[-3000:]
    assert "prepared statement" not in pgbouncer.log.read_text()


def test_an_agent_through_pgbouncer_without_listen_db_says_so(pgbouncer: Pooler,
                                                              short_tmp: Path) -> None:
    """Its LISTEN made through the pooler hears nothing: the agent says so once, with the fix."""
    box = Box("a", short_tmp / "a", pgbouncer.url)
    try:
        box.start_agent(None, "--box", "a", "--lease-ttl", str(LEASE_TTL))
        wait_for(lambda: b"hears no NOTIFY" in box.agent_log(), 60, interval=0.25,
                 what="the agent saying its LISTEN hears nothing")
        line = next(ln for ln in box.agent_log().decode().splitlines() if "hears no NOTIFY" in ln)
        assert "give --listen-db (VIGIL_LISTEN_DB) a direct URL" in line, line
    finally:
        box.cleanup()


def test_agent_start_hands_listen_db_to_the_agent(pgbouncer: Pooler, short_tmp: Path) -> None:
    """`vigil --listen-db URL agent start`: the detached agent gets it (in its environment,
    as VIGIL_DB: a password stays out of `ps`) and listens direct."""
    box = Box("a", short_tmp / "a", pgbouncer.url)
    pid = None
    try:
        box.run("--listen-db", pgbouncer.direct, "agent", "start", "--box", "a", "--lease-ttl",
                str(LEASE_TTL), subprocess=True)
        pid = running_agent_pid(box.state_dir)
        assert pid is not None
        agent = psutil.Process(pid)
        assert pgbouncer.direct not in " ".join(agent.cmdline())
        server_port = sa.make_url(pgbouncer.direct).port or 5432
        wait_for(lambda: [q.split("_")[0] for q in direct_sessions(agent, server_port, pgbouncer.direct)]
                 == ["LISTEN vigil"], 20, interval=0.2, what="the detached agent's LISTEN, direct")
        box.run("agent", "stop", "--wait")
    finally:
        if pid is not None and not pid_dead(pid):
            os.kill(pid, signal.SIGKILL)
        box.cleanup()


def churn(stores: list[Store], rounds: int = 12) -> None:
    """The same statements, many times, from each store in turn (each its own client)."""
    for i in range(rounds):
        for st in stores:
            st.write(lambda s, i=i: s.execute(sa.text("SELECT count(*) FROM hosts WHERE name = :n"),
                                              {"n": f"h{i}"}).scalar())


def test_an_agents_store_through_pgbouncer_prepares_nothing(pgbouncer: Pooler) -> None:
    """Behind the pooler (a listen URL given) the agent's store prepares no statement; the
    same churn with psycopg's prepared statements on fails (what the setting is for)."""
    pooled = [Store(pgbouncer.url, listen_url=pgbouncer.direct) for _ in range(2)]
    naive = [Store(pgbouncer.url) for _ in range(2)]
    try:
        for st in pooled + naive:
            st.name_connections("vigil-t")  # as the agent does
        assert [st.prepare for st in pooled + naive] == [False, False, True, True]
        churn(pooled)
        with pytest.raises(sa.exc.DBAPIError, match="prepared statement"):
            churn(naive)
    finally:
        for st in pooled + naive:
            st.dispose()


def test_synchronous_off_through_pgbouncer_stays_in_its_transactions(pgbouncer: Pooler) -> None:
    """VIGIL_SYNCHRONOUS=OFF behind the pooler is SET LOCAL per transaction: it holds in
    each of vigil's transactions and never stays on a server session another client gets."""
    off = Store(pgbouncer.url, synchronous="OFF", listen_url=pgbouncer.direct)
    other = Store(pgbouncer.url, listen_url=pgbouncer.direct)

    def show(s):  # type: ignore[no-untyped-def]
        return s.execute(sa.text("SHOW synchronous_commit")).scalar()

    try:
        default = other.write(show)
        if default == "off":
            pytest.skip("the server's own synchronous_commit is off: nothing to tell apart")
        for _ in range(6):  # round robin: every server session of the pool in turn
            assert off.write(show) == "off"
            assert other.write(show) == default
    finally:
        off.dispose()
        other.dispose()
