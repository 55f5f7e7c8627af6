"""Engine and transactions: SQLite pragmas in one connect hook, IMMEDIATE write
transactions, transient errors retried with tenacity, and the guarded-UPDATE helper."""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, func, insert, select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential

from models import notices
from models.errors import StoreNotReady
from models.tables import Event, postgresql_options
from models.urls import listen_url_for, normalize_url

T = TypeVar("T")
Written = tuple[str, str | None, int | None, dict[str, Any]]  # an event: kind, host, generation, detail
DB_FILE = "vigil.db"
PREPARE_THRESHOLD = 5  # psycopg's own: a statement is prepared on the server at its 5th run


def utcnow() -> datetime:
    """Naive UTC: the store keeps every timestamp in UTC without a zone."""
    return datetime.now(UTC).replace(tzinfo=None)


# The server's time, in UTC without a zone (as the store keeps times): that of the
# transaction's start, so every row a transaction writes carries one time, and a lease it
# writes ends no later, and is judged expired no sooner, than by the time of its commit.
_SERVER_NOW = func.timezone("UTC", func.now())


def store_clock(s: Session) -> Any:
    """Now by the store's one clock, as a value a statement compares with and adds a
    timedelta to: on PostgreSQL the server's own time, so that leases written by one box
    and judged expired by another never depend on the two boxes' clocks agreeing; on
    SQLite (one box, one clock) the box's."""
    if s.get_bind().dialect.name == "postgresql":
        return _SERVER_NOW
    return utcnow()


def store_now(s: Session) -> datetime:
    """store_clock() as a value here: one round trip on PostgreSQL."""
    if s.get_bind().dialect.name == "postgresql":
        return s.execute(select(_SERVER_NOW)).scalar_one()  # type: ignore[no-any-return]
    return utcnow()


def is_transient(exc: BaseException) -> bool:
    """Lock contention and serialization failures: retry, never report as a failure."""
    if isinstance(exc, OperationalError):
        msg = str(exc.orig).lower()
        if "database is locked" in msg or "database is busy" in msg:
            return True
    if isinstance(exc, DBAPIError):
        code = getattr(exc.orig, "sqlstate", None)
        if code in ("40001", "40P01"):  # serialization failure, deadlock detected
            return True
    return False


FIRST_RETRY = 0.005  # seconds; the waits double from here up to 0.25 s
LOCK_WAIT = 60.0  # seconds a transaction retries lock contention (the agent's budget)
# PostgreSQL ends a transaction left idle this long (its connection closed, nothing of it
# committed), so a writer frozen mid-transaction (SIGSTOP, a paused VM) does not hold its
# row locks until it runs again: another box's takeover would wait behind them. vigil's
# transactions do no I/O between statements; below the default lease TTL (30 s), so the
# locks are gone before the leases expire. Behind a pooler, its own idle_transaction_timeout.
IDLE_IN_TRANSACTION_MS = 10_000
# The connection budget of one agent on PostgreSQL (docs/guides/several-boxes.md,
# "Connections"), each named vigil-<box>-<purpose> in pg_stat_activity:
# - store: POOL_SIZE kept open, for the threads that run on a clock while the agent is idle
#   (sweep, lease renewal, probes, the reconciler's round on a NOTIFY, the job timer, the
#   watchdogs); a connection kept is one not opened again every second. MAX_OVERFLOW more
#   while busy, opened for a burst and closed when handed back: the 8 drive threads
#   (runners/agent/daemon.py max_hosts) and the exit watcher beside the six above make 15
#   threads at once, and 1 to spare (a scheduler job or a control request); one more waits
#   for a connection (pool_timeout), as it would for a core.
#   (The old 10 + 10 kept up to 10 open for good after the first busy minute, 20 at most.)
# - jobs: one: APScheduler calls its job store under its own lock, one call at a time;
# - listen: the LISTEN connection (runners/base/wakeup.py).
POOL_SIZE, MAX_OVERFLOW = 6, 10
JOBS_POOL = 1
IDLE_CONNECTIONS = POOL_SIZE + JOBS_POOL + 1  # what an idle agent holds at most
AGENT_CONNECTIONS = POOL_SIZE + MAX_OVERFLOW + JOBS_POOL + 1  # and a busy one


def transient_retry(budget: float) -> Any:
    return retry(retry=retry_if_exception(is_transient),
                 wait=wait_exponential(multiplier=FIRST_RETRY, max=0.25),
                 stop=stop_after_delay(budget), reraise=True)


def sqlite_url(state_dir: Path) -> str:
    path = state_dir / DB_FILE
    if not path.exists():
        # Created 0600 before SQLite opens it; its -wal and -shm files copy the mode.
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    return f"sqlite:///{path}"


class Store:
    """One database: SQLite (one box) or PostgreSQL (several boxes)."""

    def __init__(self, url: str, *, synchronous: str = "FULL", busy_timeout_ms: int = 5000,
                 lock_wait: float = LOCK_WAIT, listen_url: str | None = None,
                 lock_holder: Callable[[], str | None] = lambda: None,
                 on_success: Callable[[bool], None] | None = None,
                 on_events: Callable[[list[Written]], None] | None = None) -> None:
        self.url = normalize_url(url)
        # Given: `url` is a pooler in transaction mode (PgBouncer), where each transaction may
        # run on another server session; LISTEN, which lives in a session, goes here direct,
        # and nothing is prepared or SET per session (docs/guides/several-boxes.md, "Behind PgBouncer").
        self.listen_url = listen_url_for(self.url, listen_url)
        self.pooled = self.listen_url is not None
        # Server-side prepared statements: only an agent on a direct URL (name_connections
        # sets it). A command seldom runs a statement the 5 times psycopg waits for.
        self.prepare = False
        self.lock_wait = lock_wait
        # Who holds the write lock when a transaction gave up waiting for it (given by the
        # runners, which know the box: runners/wiring.py); None: not known.
        self.lock_holder = lock_holder
        # Told of every transaction that committed (readonly or not): the agent's store
        # watch hears from it that a store in trouble works again (runners/base/storewatch.py).
        self.on_success = on_success
        # Told of the events each transaction wrote, once it committed (the agent logs the
        # failures among them).
        self.on_events = on_events
        # What each connection says it is (PostgreSQL's application_name, read by
        # pg_stat_activity): "vigil-cli" until the agent names its own (name_connections).
        self.app_name = "vigil-cli"
        self.engine: Engine = make_engine(self.url, synchronous, busy_timeout_ms,
                                          name=lambda: f"{self.app_name}-store",
                                          pooled=self.pooled, prepare=lambda: self.prepare)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite has one writer at a time. Threads of this process queue here for it, so the
        # next writer starts the moment the last one commits, instead of each polling the
        # file lock in SQLite's busy handler (sleeps growing to 100 ms; with 8 drive threads
        # the write lock sat idle most of the time). Other processes still meet busy_timeout.
        self._write_lock = threading.RLock() if self.dialect == "sqlite" else None
        self._retried = transient_retry(lock_wait)(self._run)  # wrapped once, not per call

    def hooked(self, on_success: Callable[[bool], None],
               on_events: Callable[[list[Written]], None]) -> Store:
        """This store with hooks of its own (the agent's): one engine, one pool, one write
        lock with it. Name the connections (name_connections) before: the engine reads
        this store's name."""
        twin = copy.copy(self)
        twin.on_success, twin.on_events = on_success, on_events
        twin._retried = transient_retry(self.lock_wait)(twin._run)
        return twin

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def write(self, fn: Callable[[Session], T]) -> T:
        """Run fn in one short write transaction; lock contention is retried."""
        if self._write_lock is None:
            return self._call(fn, False)
        with self._write_lock:
            return self._call(fn, False)

    def read(self, fn: Callable[[Session], T]) -> T:
        return self._call(fn, True)

    def glance(self, fn: Callable[[Session], T]) -> T:
        """A read repeated during a wait (is a stop asked?): on PostgreSQL each statement
        is its own transaction (autocommit), so a process frozen mid-read holds none open.
        PostgreSQL ends a session idle in a transaction after IDLE_IN_TRANSACTION_MS, and
        the wait's drive would go on with a dead connection (tests/multibox froze an agent
        in a readiness wait and its drive failed so). A plain read on SQLite."""
        if self.dialect != "postgresql":
            return self.read(fn)
        with self.engine.connect() as conn:
            with Session(bind=conn.execution_options(isolation_level="AUTOCOMMIT")) as s:
                return fn(s)

    def _call(self, fn: Callable[[Session], T], readonly: bool) -> T:
        # The first try runs bare: tenacity's bookkeeping cost a tenth of a short
        # transaction, and only contention needs it.
        try:
            result = self._run(fn, readonly)
        except Exception as exc:
            if not is_transient(exc):
                raise
        else:
            if self.on_success is not None:
                self.on_success(readonly)
            return result
        time.sleep(FIRST_RETRY)  # as tenacity would before its first retry
        try:
            result = self._retried(fn, readonly)
            if self.on_success is not None:
                self.on_success(readonly)
            return result
        except Exception as exc:
            if self.dialect == "sqlite" and is_transient(exc):  # waited the whole budget
                from models.trouble import Trouble, explain, one_line

                raise explain(Trouble("locked", one_line(exc.orig)), self.url,  # type: ignore[attr-defined]
                              holder=self.lock_holder(), waited=self.lock_wait) from exc
            raise

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for reads only: on SQLite its transactions begin DEFERRED, so it
        never waits for (or takes) the write lock."""
        with self.engine.connect() as conn:
            yield read_only(conn)

    def _run(self, fn: Callable[[Session], T], readonly: bool) -> T:
        with self._sessions() as session:
            if readonly:
                session.connection(execution_options={"vigil_readonly": True})
            try:
                result = fn(session)
                session.commit()
                events = session.info.pop("events", None)
                if events and self.on_events is not None:
                    self.on_events(events)
                return result
            except BaseException:
                session.rollback()
                raise

    def name_connections(self, prefix: str) -> None:
        """Name every connection from now on `<prefix>-<purpose>` (the agent: `vigil-<box>`);
        the idle ones opened under the old name are closed. The agent's own prepare their
        statements, unless the store is pooled."""
        self.app_name = prefix
        self.prepare = not self.pooled
        if self.dialect == "postgresql":
            self.engine.pool.dispose()

    def dispose(self) -> None:
        self.engine.dispose()


def read_only(conn: Connection) -> Connection:
    """Mark a connection read-only before its first statement (see _begin below)."""
    return conn.execution_options(vigil_readonly=True)


def make_engine(url: str, synchronous: str, busy_timeout_ms: int, *,
                name: Callable[[], str] = lambda: "vigil-cli", pool_size: int = POOL_SIZE,
                max_overflow: int = MAX_OVERFLOW, pooled: bool = False,
                prepare: Callable[[], bool] = lambda: False) -> Engine:
    if not url.startswith("sqlite"):
        return _pg_engine(url, synchronous, name, pool_size, max_overflow, pooled, prepare)
    engine = create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy's begin event, not the driver, decide when transactions start.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise  # a new file still in rollback mode, locked by another writer: retried
            from models.trouble import diagnose, explain

            trouble = diagnose(exc)
            if trouble is not None and trouble.kind != "damaged":  # full, read-only, I/O ...
                raise explain(trouble, url) from None
            raise _not_a_database(url, exc) from None
        except sqlite3.DatabaseError as exc:
            raise _not_a_database(url, exc) from None
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # Writers take the lock up front, so two writers never deadlock on an upgrade.
        readonly = conn.get_execution_options().get("vigil_readonly")
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return engine


def _pg_engine(url: str, synchronous: str, name: Callable[[], str], pool_size: int,
               max_overflow: int, pooled: bool, prepare: Callable[[], bool]) -> Engine:
    postgresql_options()  # the schema's PostgreSQL-only options, now that its dialect is loaded
    pg = create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)

    @event.listens_for(pg, "do_connect")
    def _named(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams["application_name"] = name()  # read per connection: it may be renamed
        # None: psycopg prepares nothing (a pooler in transaction mode would run EXECUTE elsewhere).
        cparams["prepare_threshold"] = PREPARE_THRESHOLD if prepare() else None

    if not pooled:  # a SET, not a startup option: PgBouncer refuses those, URL given or not
        @event.listens_for(pg, "connect")
        def _idle_bound(dbapi_conn: Any, _record: Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute(f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}")
            dbapi_conn.commit()

    if synchronous.upper() == "OFF":
        # As with SQLite: a crash of the database server (not of vigil) may lose the
        # last commits, never corrupt them.
        if pooled:  # a session's SET would stay on whichever server session ran it
            @event.listens_for(pg, "begin")
            def _no_wait_in_this_transaction(conn: Any) -> None:
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        else:
            @event.listens_for(pg, "connect")
            def _no_wait_for_flush(dbapi_conn: Any, _record: Any) -> None:
                with dbapi_conn.cursor() as cur:
                    cur.execute("SET synchronous_commit = off")
                dbapi_conn.commit()
    return pg


def _not_a_database(url: str, exc: Exception) -> StoreNotReady:
    return StoreNotReady(
        f"{url.removeprefix('sqlite:///')} is not a vigil database ({exc})",
        "point --state-dir or --db at a vigil database, or move the file away",
    )


def emit(session: Session, kind: str, host: str | None, generation_id: int | None = None, /,
         **detail: Any) -> None:
    """An event row, written in the transaction of the transition it reports, with a
    delivery row for each notifier its kind concerns (models/notices.py)."""
    at = utcnow()
    result: Any = session.execute(_NEW_EVENT, {"at": at, "host": host, "generation_id": generation_id,
                                          "kind": kind,
                                          "detail": json.dumps(detail, default=str,
                                                               sort_keys=True)})
    word = notices.word_of(kind, detail)
    if word is not None:
        notices.owe(session, result.inserted_primary_key[0], at, kind, host, generation_id,
                    word, detail)
    session.info.setdefault("events", []).append((kind, host, generation_id, detail))


def emit_many(session: Session, kind: str,
              events: list[tuple[str | None, int | None, dict[str, Any]]]) -> None:
    """Events of one kind, (host, generation id, detail) each, as emit writes them: those
    that notify nobody in one INSERT of many rows (recovery's 1,000 `adopted` were a
    statement each), any other through emit."""
    at, quiet = utcnow(), []
    for host, generation_id, detail in events:
        if notices.word_of(kind, detail) is not None:
            emit(session, kind, host, generation_id, **detail)
            continue
        quiet.append({"at": at, "host": host, "generation_id": generation_id, "kind": kind,
                      "detail": json.dumps(detail, default=str, sort_keys=True)})
        session.info.setdefault("events", []).append((kind, host, generation_id, detail))
    if quiet:
        session.execute(_NEW_EVENT, quiet)


# Built once: an ORM add cost a unit-of-work flush per event, several times the INSERT.
_NEW_EVENT = insert(Event.__table__)
