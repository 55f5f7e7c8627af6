"""Wake-up across boxes: a round starts as soon as any box writes an intent.

- PostgreSQL: a trigger on each intent table (migration 0031) rings the channel of each box
  its host is placed on (box_channel()), or the shared channel `vigil` for an unplaced host
  or a rollout, whoever writes (CLI, agent, plain SQL); a change tied to no intent row rings
  the shared channel (notify_boxes()). Each agent LISTENs to its box's channel and the
  shared one on a connection of its own: an intent costs a round only where it may be acted on.
- SQLite (one box): the CLI rings the doorbell socket; the agent also polls
  `PRAGMA data_version` every second (a writer that did not ring, e.g. the sqlite3 shell).
  Its own commits change it too, so a change in a second when it also wrote starts a round
  only while an obligation is open (an idle agent's heartbeat is not a round).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import func, insert, make_url, select, text

from models.errors import BrokenInvariant
from models.store import Store
from models.tables import Ring

# The store's time as the trigger writes it (migration 0032): the statement's, not the
# transaction's start, so a long transaction's ring is not already old when it commits.
_NOW_EXACT = func.timezone("utc", func.clock_timestamp())
CHANNEL = "vigil"  # shared: unplaced hosts, rollouts, config changes (and older vigils' NOTIFY)
POLL = 1.0  # the CLI rings the doorbell; this only catches writers that do not
log = logging.getLogger("vigil.wakeup")


def box_channel(box: str) -> str:
    """The channel of one box's hosts: a hash of its name, so any box name makes a plain
    lowercase identifier within PostgreSQL's 63 bytes (box names may hold '.' and '-').
    Migration 0031's trigger computes the same in SQL (a test holds them equal)."""
    return "vigil_box_" + hashlib.sha256(box.encode()).hexdigest()[:32]


def notify_boxes(store: Store) -> None:
    """A change tied to no box (a host's config, a rollout's pause): every box's agent on
    the store starts a round (PostgreSQL only; on SQLite the doorbell rings the one agent).
    An intent row needs no call: its table's trigger rings its host's boxes."""
    if store.dialect == "postgresql":
        def ring(s: Any) -> None:
            s.execute(text(f"NOTIFY {CHANNEL}"))
            s.execute(insert(Ring).values(channel=CHANNEL, at=_NOW_EXACT))  # for `--listen off`

        store.write(ring)


class Rings:
    """Intents heard without LISTEN (`vigil agent --listen off`, migration 0032): the rings
    of this box's channel and the shared one written in the last LAG seconds, read in the
    sweep's own transaction once a sweep; one not seen at the last read starts a round.
    The window, not "the rows past the last id": ids are drawn at insert and committed in
    any order, so a later id may be seen before an earlier one commits."""

    LAG = 10.0  # seconds a ring's transaction may take from its insert to its commit

    def __init__(self, box: str) -> None:
        self.channels = (CHANNEL, box_channel(box))
        self.seen: set[int] = set()

    def read(self, s: Any) -> set[int]:
        """The window's rings, read in `s` (kept by new() once its transaction committed:
        a retried transaction reads them again)."""
        return set(s.execute(select(Ring.id).where(
            Ring.channel.in_(self.channels),
            Ring.at > _NOW_EXACT - timedelta(seconds=self.LAG))).scalars())

    def new(self, ids: set[int]) -> bool:
        """True when `ids` (read()'s) hold a ring not seen at the last read (the first: any)."""
        fresh = bool(ids - self.seen)
        self.seen = ids
        return fresh


def start(store: Store, box: str, kick: Callable[[], None], stop: threading.Event,
          on_error: Callable[[BaseException], bool] = lambda exc: False,
          own: Callable[[], int] = lambda: 0) -> threading.Thread | None:
    """`box`: this agent's id (it listens on that box's channel and the shared one).
    `on_error(exc)`: True when the store itself failed and the agent has said so (the
    LISTEN loop then retries without a line of its own). `own()`: how many write transactions
    the agent has committed through `store` (its store hook counts them)."""
    if store.dialect == "postgresql":
        target: Callable[..., None] = _listen
    elif store.dialect == "sqlite" and store.engine.url.database:
        target = functools.partial(_data_version, own=own)
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


def _open_obligation(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM pending_obligations LIMIT 1").fetchone() is not None


def _data_version(store: Store, box: str, kick: Callable[[], None], stop: threading.Event,
                  on_error: Callable[[BaseException], bool], own: Callable[[], int]) -> None:
    path = store.engine.url.database
    if path is None:
        raise BrokenInvariant("path is missing")
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        last, seen = None, own()
        while not stop.wait(POLL):
            try:
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                mine, seen = own() != seen, own()  # after the read: none missed
                if last is not None and version != last and (not mine or _open_obligation(conn)):
                    kick()
            except sqlite3.Error:
                continue
            last = version
    finally:
        conn.close()
