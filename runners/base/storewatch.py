"""The store as the box sees it: who holds SQLite's write lock (for the line a command
prints when it gave up waiting), and the agent's watch over its store -- the file it opened
is still the file at its path, the schema is still the one it knows -- with what it says
when the store fails: once, then at a slow cadence, and once when it is back."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from models.errors import StoreTrouble
from models.store import Store
from models.trouble import Trouble, diagnose, explain, refine
from runners.base.doorbell import halted_line
from workflows.base.paths import HALTED

# SQLite's locks (os_unix.c): in WAL mode the writer holds byte 120 of the -shm file
# (WAL_WRITE_LOCK); in rollback mode RESERVED is byte 0x40000001 of the database file.
_WAL_WRITE_BYTE = 120
_RESERVED_BYTE = 0x40000001


def _lock_pids(path: Path, byte: int) -> list[int]:
    """Pids holding a POSIX write lock over `byte` of `path` (from /proc/locks)."""
    try:
        st = path.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        f = line.split()
        # "1: POSIX  ADVISORY  WRITE 10108 fe:00:2147683 120 120"
        if len(f) >= 8 and f[1] == "POSIX" and f[3] == "WRITE" and f[5] == dev:
            end = f[7]
            if int(f[6]) <= byte and (end == "EOF" or byte <= int(end)) and f[4].isdigit():
                pids.append(int(f[4]))
    return pids


def write_lock_holder(db: Path, agent_pid: int | None = None) -> str | None:
    """Who holds the write lock of the SQLite file `db`, as words for a line ("pid 42
    (sqlite3 vigil.db)", "the agent (pid 7)"); None when no one can be named."""
    pids = _lock_pids(Path(f"{db}-shm"), _WAL_WRITE_BYTE) or _lock_pids(db, _RESERVED_BYTE)
    pids = [p for p in pids if p != os.getpid()]
    if not pids:
        return None
    pid = pids[0]
    if pid == agent_pid:
        return f"the agent (pid {pid}; `kill {pid}` ends it, its apps keep running)"
    try:
        cmd = " ".join(" ".join(psutil.Process(pid).cmdline()).split())[:60]
    except psutil.Error:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd}; `kill {pid}` ends it)" if cmd else f" (`kill {pid}` ends it)")


# -- the agent's watch ------------------------------------------------------------------------

REPEAT = 60.0  # seconds between reminders while the store stays in trouble
# A store in trouble is back once a transaction commits this long after its last failure:
# a full disk still takes the small writes that fit the -wal's space, so single commits
# between failures do not count.
BACK_AFTER = 5.0


@dataclass
class _Spell:
    kind: str
    line: str
    since: float
    said_at: float
    failed_at: float


class StoreWatch:
    """What the agent says about its store, and whether it may act. `trouble(exc)`: a
    whole-store failure (full, unreachable, read-only, locked past the wait, damaged) is one
    line, then one every REPEAT seconds, never a traceback (False: another error, the caller
    logs it); a damaged store halts. `ok()`: back, once. `halt(kind, cause, fix)`: the store
    cannot be trusted (its file replaced, its schema changed): the agent stops acting, says so
    in its log and in <state>/agent.halted (`vigil status`, `vigil check`)."""

    def __init__(self, url: str, state_dir: Path, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic, repeat: float = REPEAT,
                 on_halt: Callable[[], None] = lambda: None, back_after: float = BACK_AFTER) -> None:
        self.back_after = back_after
        self.url = url
        self.on_halt = on_halt
        self.state_dir = state_dir
        self.log = log
        self.clock = clock
        self.repeat = repeat
        self.halted: str | None = None
        self._halted_said = 0.0
        self._spell: _Spell | None = None
        self._lock = threading.Lock()
        self._failures = 0  # consecutive whole-store failures: the agent's backoff
        try:
            (state_dir / HALTED).unlink()  # a new agent starts afresh
        except FileNotFoundError:
            pass

    @property
    def acting(self) -> bool:
        return self.halted is None

    @property
    def failures(self) -> int:
        return self._failures

    def trouble(self, exc: BaseException) -> bool:
        if self.halted is not None:
            return True  # said already (and again every REPEAT seconds)
        t = diagnose(exc)
        if t is not None:
            t = refine(t, self.url)
        if t is None or not t.whole_store:
            return False
        line = exc.line() if isinstance(exc, StoreTrouble) else explain(t, self.url, agent=True).line()
        if t.halts:
            cause, _, fix = line.partition("; ")
            self.halt(t.kind, cause, fix)
            return True
        now = self.clock()
        with self._lock:
            self._failures += 1
            spell = self._spell
            if spell is None or spell.kind != t.kind:
                self._spell = _Spell(t.kind, line, now, now, now)
                self.log.warning("store trouble kind=%s: %s", t.kind, line)
                return True
            spell.failed_at = now
            if now - spell.said_at >= self.repeat:
                spell.said_at = now
                self.log.warning("store trouble kind=%s for=%.0fs: %s", t.kind, now - spell.since,
                                 line)
        return True

    def ok(self, readonly: bool) -> None:
        """A transaction committed (Store.on_success). A store that refused writes (full,
        read-only, locked) is back once a write commits; an unreachable one at any."""
        if self._spell is None and not self._failures:
            return  # the usual case: one attribute read
        with self._lock:
            spell = self._spell
            if spell is not None:
                if readonly and spell.kind != "unreachable":
                    return
                if self.clock() - spell.failed_at < self.back_after:
                    return
            self._failures = 0
            self._spell = None
        if spell is not None:
            self.log.warning("store back kind=%s after=%.1fs", spell.kind, self.clock() - spell.since)

    def halt(self, kind: str, cause: str, fix: str) -> None:
        line = f"{cause}; {fix}"
        with self._lock:
            first = self.halted is None
            if first:
                self.halted = line
        if first:
            self.log.error("halted kind=%s: the agent no longer acts on this store: %s", kind, line)
            self._halted_said = self.clock()
            try:
                path = self.state_dir / HALTED
                tmp = path.with_suffix(".tmp")
                tmp.write_text(line + "\n")
                os.replace(tmp, path)
            except OSError as exc:
                self.log.error("cannot write %s: %s", self.state_dir / HALTED, exc)
            self.on_halt()

    def remind(self) -> None:
        """While halted: say so again, every REPEAT seconds."""
        if self.halted is not None and self.clock() - self._halted_said >= self.repeat:
            self._halted_said = self.clock()
            self.log.error("halted: the agent still does not act on this store: %s", self.halted)


@dataclass
class FileGuard:
    """The SQLite files the agent opened (the database and its -wal) are still the ones at
    their paths: a -wal deleted under a running agent leaves it writing to a file no one
    else sees (and every other connection gets `disk I/O error`)."""

    db: Path
    ids: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, store: Store) -> FileGuard | None:
        if store.dialect != "sqlite" or not store.engine.url.database:
            return None
        db = Path(store.engine.url.database).absolute()
        ids = {}
        for which, path in (("db", db), ("wal", Path(f"{db}-wal"))):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # no -wal (not in WAL mode): nothing to watch there
            ids[which] = (st.st_dev, st.st_ino)
        return cls(db, ids)

    def changed(self) -> str | None:
        """"db" or "wal" when that file is gone from its path or another file is there."""
        for which, was in self.ids.items():
            path = self.db if which == "db" else Path(f"{self.db}-wal")
            try:
                st = path.stat()
            except FileNotFoundError:
                return which
            if (st.st_dev, st.st_ino) != was:
                return which
        return None


def write_back(store: Store) -> bool:
    """After the -wal was deleted under this process: checkpoint its commits from the file
    it still holds open into the database file, and start the log afresh (TRUNCATE), so
    other connections see them and can open the database again. True if it did."""
    # Busy while another thread of this agent (a drive, the exit watcher, a probe) is in
    # a read: tried again for a while, as those reads are short.
    for _ in range(WRITE_BACK_TRIES):
        try:
            # On the driver's connection: a checkpoint cannot run inside the transaction
            # that SQLAlchemy's connections begin first.
            conn = store.engine.raw_connection()
            try:
                cur = conn.cursor()
                busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                cur.close()
            finally:
                conn.close()
        except Exception:
            return False
        if busy == 0:
            return True
        time.sleep(0.05)
    return False


WRITE_BACK_TRIES = 40  # x 50 ms


__all__ = ["HALTED", "FileGuard", "StoreWatch", "Trouble", "halted_line", "write_back",
           "write_lock_holder"]
