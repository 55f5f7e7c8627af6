"""NOTIFY per box (issue 28 item 1): an intent for a host rings the channels of the boxes it is
placed on, an unplaced host's (or a rollout's) the shared channel, so one intent costs a
round on the boxes that may act on it, not on every box of the fleet. The intent tables'
trigger rings (migration 0031), so the CLI, an agent and plain SQL all do. Heard here by
real LISTEN sessions of the test's own, one per channel, beside the boxes' real agents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import sql

from runners.base.wakeup import CHANNEL, box_channel
from tests.conftest import HELLO, wait_for
from tests.multibox.conftest import LEASE_TTL, Box
from tests.multibox.test_multibox import serving

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.postgresql_only("LISTEN/NOTIFY across boxes")]

# Box names with '.' and '-': not plain identifiers, so only their hashed channels are.
A, B = "rack-1.a", "rack-1.b"
SAFETY = "300"  # no backstop scan within the test: a round comes from the NOTIFY
MARK = "end-of-test-mark"


class Ear:
    """A LISTEN session of its own on one channel: what it heard, in commit order."""

    def __init__(self, url: str, channel: str) -> None:
        self.channel = channel
        conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def until_mark(self, timeout: float = 30) -> list[str]:
        """Every payload heard up to the mark (sent after the intent: PostgreSQL delivers
        in commit order, so anything the intent rang on this channel comes before it)."""
        self.conn.execute("SELECT pg_notify(%s, %s)", (self.channel, MARK))
        heard: list[str] = []
        for n in self.conn.notifies(timeout=timeout):
            if n.payload == MARK:
                return heard
            heard.append(n.payload)
        raise AssertionError(f"{self.channel}: the mark not heard within {timeout}s")

    def next(self, timeout: float) -> str | None:
        for n in self.conn.notifies(timeout=timeout, stop_after=1):
            return str(n.payload)
        return None


@pytest.fixture
def fleet(pg_url: str, short_tmp: Path) -> Iterator[dict[str, Box]]:
    boxes = {n: Box(n, short_tmp / n, pg_url) for n in (A, B, "cli")}
    try:
        yield boxes
    finally:
        for b in boxes.values():
            b.cleanup()


def ears(url: str) -> dict[str, Ear]:
    return {A: Ear(url, box_channel(A)), B: Ear(url, box_channel(B)), "shared": Ear(url, CHANNEL)}


def start(box: Box) -> None:
    p = box.start_agent(None, "--box", box.name, "--lease-ttl", str(LEASE_TTL),
                        "--safety-interval", SAFETY)
    box.wait_ready(p, timeout=60)


def test_box_channels_are_identifiers_for_any_box_name() -> None:
    names = [A, "a", "0.-_", "z" * 63]
    chans = [box_channel(n) for n in names]
    assert len(set(chans)) == len(names) and CHANNEL not in chans
    assert all(len(c.encode()) <= 63 and c.isidentifier() and c == c.lower() for c in chans)


def write_two_hosts(eng: sa.Engine) -> None:
    """By plain SQL: host `both` placed on A and B, host `loose` placed nowhere."""
    with eng.begin() as c:
        c.execute(sa.text("INSERT INTO builds (id, path, digest, source, created_at) "
                          "VALUES (1, '/x', 'ab', '/x', now())"))
        for name, box in (("both", f"{A},{B}"), ("loose", None)):
            c.execute(sa.text(
                "INSERT INTO hosts (name, kind, build_id, args, env, drain_timeout, health_timeout, "
                "desired, box, created_at) "
                "VALUES (:n, 'instance', 1, '[]', '{}', 5, 5, 'down', :b, now())"), {"n": name, "b": box})


def test_plain_sql_intents_ring_every_box_of_their_placement(pg_url: str) -> None:
    """No vigil process: rows written by hand ring as the CLI's do (the trigger's channel
    names are box_channel()'s); a rollout, tied to no box, rings the shared channel; a row
    rolled back rings nothing."""
    heard = ears(pg_url)
    eng = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    try:
        write_two_hosts(eng)
        assert all(e.until_mark() == [] for e in heard.values())  # hosts alone ring nothing
        stop = ("INSERT INTO stops (host, state, since, next_attempt_at, created_at, attempts) "
                "VALUES (:h, 'queued', now(), now(), now(), 0)")
        with eng.begin() as c:
            c.execute(sa.text(stop), {"h": "both"})
        assert heard[A].until_mark() == [""] and heard[B].until_mark() == [""]
        assert heard["shared"].until_mark() == []
        with eng.begin() as c:
            c.execute(sa.text(stop), {"h": "loose"})
        assert heard["shared"].until_mark() == [""]
        assert heard[A].until_mark() == [] and heard[B].until_mark() == []
        rollout = ("INSERT INTO rollouts (build_id, digest, mode, canary, waves, wave_count, wave, "
                   "settled, max_failures, auto_revert, after_attempt, after_stop, state, "
                   "created_at, since, next_attempt_at, attempts) VALUES (1, 'ab', 'overlap', "
                   "false, '100%', 1, 0, 0, 0, false, 0, 0, 'running', now(), now(), now(), 0)")
        with eng.connect() as c:  # rolled back: the row and its NOTIFY are gone together
            with c.begin() as tx:
                c.execute(sa.text(stop), {"h": "both"})
                c.execute(sa.text(rollout))
                tx.rollback()
        assert all(e.until_mark() == [] for e in heard.values())
        with eng.begin() as c:
            c.execute(sa.text(rollout))
        assert heard["shared"].until_mark() == [""]
        assert heard[A].until_mark() == [] and heard[B].until_mark() == []
    finally:
        eng.dispose()
        for e in heard.values():
            e.conn.close()


def test_an_intent_rings_its_boxes_only(fleet: dict[str, Box], pg_url: str) -> None:
    a, b, cli = fleet[A], fleet[B], fleet["cli"]
    a.run("host", "add", "pa", "--build", str(HELLO), "--box", A)
    a.run("host", "add", "free", "--build", str(HELLO))  # no placement: any box may take it
    (b.state_dir / "builds").symlink_to(a.state_dir / "builds")  # one staging root
    (cli.state_dir / "builds").symlink_to(a.state_dir / "builds")
    start(a)
    start(b)
    heard = ears(pg_url)
    try:
        # The CLI of a box with no agent writes the intent and rings (runners/cli/common.py).
        cli.run("wake", "pa")
        assert heard[A].next(30) is not None, "box A's channel heard nothing"
        assert heard[A].until_mark() == []  # one intent, one NOTIFY
        assert heard[B].until_mark() == [] and heard["shared"].until_mark() == []
        wait_for(lambda: serving(a, ["pa"], {A}), 60, interval=0.2, what="pa up on box A")

        # Through box B's agent (its control socket rings for it): still only A's channel.
        b.run("stop", "pa")
        assert heard[A].next(30) is not None, "box A's channel heard nothing from B's agent"
        assert heard[B].until_mark() == [] and heard["shared"].until_mark() == []

        cli.run("wake", "free")  # unplaced: the shared channel, which every agent hears
        assert heard["shared"].next(30) is not None, "the shared channel heard nothing"
        assert heard[A].until_mark() == [] and heard[B].until_mark() == []
        wait_for(lambda: serving(a, ["free"], {A, B}), 60, interval=0.2, what="free up")
        for box in (a, b):
            log = box.agent_log().decode()
            assert "LISTEN vigil failed" not in log and "hears no NOTIFY" not in log, log[-3000:]
    finally:
        for e in heard.values():
            e.conn.close()


def test_every_ring_is_also_a_row_for_agents_without_listen(pg_url: str) -> None:
    """Migration 0032: each NOTIFY the trigger sends is a `rings` row of the same channel
    (an intent for a host placed on A and B: one each; unplaced: the shared channel); a
    rolled-back intent leaves none."""
    eng = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)

    def rings() -> list[str]:
        with eng.connect() as c:
            return sorted(c.execute(sa.text("SELECT channel FROM rings")).scalars())

    try:
        write_two_hosts(eng)
        stop = ("INSERT INTO stops (host, state, since, next_attempt_at, created_at, attempts) "
                "VALUES (:h, 'queued', now(), now(), now(), 0)")
        with eng.connect() as c:
            with c.begin() as tx:
                c.execute(sa.text(stop), {"h": "both"})
                tx.rollback()
        assert rings() == []
        with eng.begin() as c:
            c.execute(sa.text(stop), {"h": "both"})
        assert rings() == sorted([box_channel(A), box_channel(B)])
        with eng.begin() as c:
            c.execute(sa.text(stop), {"h": "loose"})
        assert rings() == sorted([box_channel(A), box_channel(B), CHANNEL])
    finally:
        eng.dispose()


def test_an_agent_without_listen_hears_intents_in_its_sweep(fleet: dict[str, Box], pg_url: str) -> None:
    """`vigil agent --listen off`: no LISTEN session; an intent another box's CLI writes (no
    doorbell of this box, the safety scan 300 s away) is acted on within a few sweeps."""
    a, cli = fleet[A], fleet["cli"]
    a.run("host", "add", "pa", "--build", str(HELLO), "--box", A)
    (cli.state_dir / "builds").symlink_to(a.state_dir / "builds")
    p = a.start_agent(None, "--box", A, "--lease-ttl", str(LEASE_TTL), "--safety-interval", SAFETY,
                      "--listen", "off")
    a.wait_ready(p, timeout=60)
    eng = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            names = c.execute(sa.text("SELECT application_name FROM pg_stat_activity "
                                      "WHERE application_name LIKE 'vigil-rack-1.a-%'")).scalars().all()
        assert names and "vigil-rack-1.a-listen" not in names, names
    finally:
        eng.dispose()
    cli.run("wake", "pa")
    wait_for(lambda: serving(a, ["pa"], {A}), 30, interval=0.2, what="pa up on box A")
    cli.run("stop", "pa")
    wait_for(lambda: not serving(a, ["pa"], {A}), 30, interval=0.2, what="pa stopped on box A")


def test_rings_older_than_an_hour_are_pruned(pg_url: str) -> None:
    from models.store import Store
    from workflows.engine.history import prune_rings

    store = Store(pg_url)
    try:
        store.write(lambda s: s.execute(sa.text(
            "INSERT INTO rings (channel, at) VALUES ('vigil', timezone('utc', now()) - interval '61 minutes'),"
            " ('vigil', timezone('utc', now()) - interval '59 minutes')")))
        assert prune_rings(store) == 1
        left = store.read(lambda s: s.execute(sa.text("SELECT count(*) FROM rings")).scalar())
        assert left == 1
    finally:
        store.dispose()
