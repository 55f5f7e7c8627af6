"""Wake-up across boxes: a round starts as soon as any box writes an intent.

- PostgreSQL: the CLI notifies right after its intent commits (notify_boxes()): the channel
  of each box the host is placed on (box_channel()), or the shared channel `vigil` for an
  unplaced host, a rollout, or anything tied to no box. Every agent LISTENs on a dedicated
  connection to its own box's channel and the shared one, and kicks a round per
  notification: an intent costs a round on the boxes that may act on it, not on the fleet.
- SQLite (one box): the CLI rings the doorbell socket; the agent also polls
  `PRAGMA data_version` on a connection of its own every second, which changes whenever
  another connection committed (a writer that did not ring, e.g. the sqlite3 shell).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import make_url, select, text

from models.errors import BrokenInvariant
from models.store import Store
from models.tables import Host
from workflows.leases.placement import boxes as placed_on

CHANNEL = "vigil"  # shared: unplaced hosts, rollouts, config changes (and older vigils' NOTIFY)
POLL = 1.0  # the CLI rings the doorbell; this only catches writers that do not
log = logging.getLogger("vigil.wakeup")


def box_channel(box: str) -> str:
    """The channel of one box's hosts: a hash of its name, so any box name makes a plain
    lowercase identifier within PostgreSQL's 63 bytes (box names may hold '.' and '-')."""
    return "vigil_box_" + hashlib.sha256(box.encode()).hexdigest()[:32]


def channels_for(placements: Iterable[str | None]) -> set[str]:
    """The channels to ring for hosts stored with these placements (hosts.box)."""
    out: set[str] = set()
    for stored in placements:
        out |= {box_channel(b) for b in placed_on(stored)} or {CHANNEL}
    return out


def notify_boxes(store: Store, hosts: Iterable[str] | None = None) -> None:
    """A new intent: the boxes that may act on it start a round (PostgreSQL only; on
    SQLite the doorbell rings the one agent). `hosts`: the hosts the intent is for (their
    placements are read in the same transaction); None: not tied to a box (the shared
    channel). A host not found (removed meanwhile) rings the shared channel."""
    if store.dialect != "postgresql":
        return
    names = sorted(set(hosts)) if hosts is not None else None

    def ring(s: Any) -> None:
        if names is None:
            wanted = {CHANNEL}
        else:
            found = dict(s.execute(select(Host.name, Host.box).where(Host.name.in_(names))).all())
            wanted = channels_for(found.values()) | ({CHANNEL} if len(found) < len(names) else set())
        for ch in sorted(wanted):  # one transaction: delivered together at its commit
            s.execute(text("SELECT pg_notify(:ch, '')"), {"ch": ch})

    store.write(ring)


def start(store: Store, box: str, kick: Callable[[], None], stop: threading.Event,
          on_error: Callable[[BaseException], bool] = lambda exc: False) -> threading.Thread | None:
    """`box`: this agent's id (it listens on that box's channel and the shared one).
    `on_error(exc)`: True when the store itself failed and the agent has said so (the
    LISTEN loop then retries without a line of its own)."""
    if store.dialect == "postgresql":
        target = _listen
    elif store.dialect == "sqlite" and store.engine.url.database:
        target = _data_version
    else:
        return None
    t = threading.Thread(target=target, args=(store, box, kick, stop, on_error), name="wakeup",
                         daemon=True)
    t.start()
    return t


def _listen(store: Store, box: str, kick: Callable[[], None], stop: threading.Event,
            on_error: Callable[[BaseException], bool]) -> None:
    import psycopg
    from psycopg import sql

    # Direct to the server when the store is a pooler in transaction mode: a LISTEN made
    # through it would stay on a server session that goes back to the pool.
    url = make_url(store.listen_url) if store.listen_url else store.engine.url
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    while not stop.is_set():
        try:
            with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None,
                                 application_name=f"{store.app_name}-listen") as conn:
                for ch in (CHANNEL, box_channel(box)):  # the probe's comes last
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ch)))
                kick()  # anything written while we were not listening
                probe = Probe(store, conn)
                while not stop.is_set():
                    for n in conn.notifies(timeout=0.5, stop_after=1):
                        if not probe.heard(n.channel):
                            kick()
                    probe.check()
        except Exception as exc:  # the safety scan still runs; listen again shortly
            if not on_error(exc):
                log.warning("LISTEN %s failed, retrying: %s", CHANNEL, exc)
            stop.wait(1.0)


class Probe:
    """A NOTIFY on a channel of this session's own, sent through the store: a LISTEN that
    does not hear it (its session is not the one the store's NOTIFY reaches, as through a
    pooler in transaction mode without --listen-db) is said once, with the fix."""

    WAIT = 10.0  # seconds; a NOTIFY takes milliseconds, even on a loaded box
    warned = False  # once per agent, not per reconnection

    def __init__(self, store: Store, conn: Any) -> None:
        self.channel = f"vigil_probe_{os.getpid()}"
        self.url = store.engine.url.render_as_string(hide_password=True)
        conn.execute(f"LISTEN {self.channel}")
        store.write(lambda s: s.execute(text(f"NOTIFY {self.channel}")))
        self.deadline: float | None = time.monotonic() + self.WAIT

    def heard(self, channel: str) -> bool:
        if channel != self.channel:
            return False
        self.deadline = None
        return True

    def check(self) -> None:
        if self.deadline is None or time.monotonic() < self.deadline or Probe.warned:
            return
        Probe.warned, self.deadline = True, None
        log.warning("LISTEN %s hears no NOTIFY sent through the store %s within %.0fs: new "
                    "intents wait for the safety scan; through a pooler in transaction mode "
                    "(PgBouncer) give --listen-db (VIGIL_LISTEN_DB) a direct URL of the server",
                    CHANNEL, self.url, self.WAIT)


def _data_version(store: Store, box: str, kick: Callable[[], None], stop: threading.Event,
                  on_error: Callable[[BaseException], bool]) -> None:
    path = store.engine.url.database
    if path is None:
        raise BrokenInvariant("path is missing")
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        last = None
        while not stop.wait(POLL):
            try:
                version = conn.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error:
                continue
            if last is not None and version != last:
                kick()
            last = version
    finally:
        conn.close()
