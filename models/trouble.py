"""When the store itself fails, not a step: what kind of failure it is, and the one line an
operator needs (the cause, then the fix), for the CLI and for the agent's log.

`diagnose` reads an exception (SQLAlchemy's wrapper or the driver's own error, or an OSError
from the filesystem holding the store) and names its kind; `explain` turns that into a
StoreTrouble for a store at a given place."""

from __future__ import annotations

import errno
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from models.errors import StoreTrouble

# kind -> the agent's reaction: a whole-store failure pauses every drive (the agent backs
# off as a whole: no row's pacing can be written); a damaged store stops the agent acting.
WHOLE_STORE = {"locked", "full", "readonly", "cantopen", "unreachable", "damaged"}
HALTS = {"damaged"}

_SQLITE_CODES = {sqlite3.SQLITE_FULL: "full", sqlite3.SQLITE_CORRUPT: "damaged",
                 sqlite3.SQLITE_NOTADB: "damaged", sqlite3.SQLITE_READONLY: "readonly",
                 sqlite3.SQLITE_CANTOPEN: "cantopen", sqlite3.SQLITE_IOERR: "io",
                 sqlite3.SQLITE_BUSY: "locked"}
_SQLITE_WORDS = (("database or disk is full", "full"), ("malformed", "damaged"),
                 ("file is not a database", "damaged"), ("readonly database", "readonly"),
                 ("unable to open database file", "cantopen"), ("disk i/o error", "io"),
                 ("database is locked", "locked"), ("database is busy", "locked"))
_OS_ERRNOS = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "readonly"}


@dataclass(frozen=True)
class Trouble:
    kind: str  # locked, full, readonly, cantopen, io, damaged, unreachable
    detail: str  # the driver's or the kernel's own words, on one line
    path: str | None = None  # the file a filesystem error (OSError) was about, if not the store

    @property
    def whole_store(self) -> bool:
        return self.kind in WHOLE_STORE

    @property
    def halts(self) -> bool:
        return self.kind in HALTS


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def diagnose(exc: BaseException) -> Trouble | None:
    """The kind of store failure `exc` is, or None when it is not one (a step's own error:
    a lost race, an integrity error, a bug)."""
    if isinstance(exc, StoreTrouble):
        return Trouble(exc.kind, exc.detail)
    orig = getattr(exc, "orig", None) or exc  # SQLAlchemy's DBAPIError wraps the driver's
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE_CODES:
            return Trouble(_SQLITE_CODES[code & 0xFF], one_line(orig))
        text = str(orig).lower()
        for words, kind in _SQLITE_WORDS:
            if words in text:
                return Trouble(kind, one_line(orig))
        return None
    if isinstance(orig, OSError):
        os_kind = _OS_ERRNOS.get(orig.errno or 0)
        path = orig.filename2 or orig.filename
        return Trouble(os_kind, one_line(orig), str(path) if path else None) if os_kind else None
    return _postgresql(orig)


def _postgresql(orig: BaseException) -> Trouble | None:
    try:
        import psycopg
    except ImportError:  # pragma: no cover (a dependency of vigil)
        return None
    if not isinstance(orig, psycopg.Error):
        return None
    state = getattr(orig, "sqlstate", None) or ""
    detail = one_line(orig).split(" (Background on this error", 1)[0]
    if state == "53100":  # disk_full
        return Trouble("full", detail)
    if state.startswith("XX0"):  # data_corrupted, index_corrupted
        return Trouble("damaged", detail)
    # Connection exceptions (class 08), the server shutting down or starting (57P01-03),
    # or a connection that failed before any SQLSTATE (refused, reset, closed).
    if state.startswith("08") or state in ("57P01", "57P02", "57P03") or (
            not state and isinstance(orig, psycopg.OperationalError)):
        return Trouble("unreachable", detail)
    return None


NEARLY_FULL = 1 << 20  # bytes: below this, a disk I/O error on SQLite is taken for a full disk


def refine(t: Trouble, url: str) -> Trouble:
    """SQLite reports some writes on a full filesystem as `disk I/O error` (opening the
    -wal, say): where the filesystem of the store is (nearly) full, that is what it is."""
    if t.kind != "io" or not url.startswith("sqlite"):
        return t
    try:
        fs = os.statvfs(Path(url.split("///", 1)[-1]).parent)
    except OSError:
        return t
    return Trouble("full", t.detail) if fs.f_bavail * fs.f_frsize < NEARLY_FULL else t


def explain(t: Trouble, url: str, *, agent: bool = False, holder: str | None = None,
            waited: float | None = None) -> StoreTrouble:
    """The line for a store at `url`: the cause, then the fix. `agent`: said by the agent,
    which retries by itself (a command says to run it again)."""
    t = refine(t, url)
    again = "the agent retries by itself" if agent else "then run the command again"
    if t.path is not None:  # a file of the state dir (a build being staged), not the store
        mount = Path(t.path).parent
        while not mount.exists() or not os.path.ismount(mount):
            mount = mount.parent
        if t.kind == "full":
            return StoreTrouble(t.kind, t.detail, f"the filesystem holding {mount} is full "
                                f"({t.detail})", f"free space on it (see `df -h {mount}`); "
                                f"nothing was lost, {again}")
        return StoreTrouble(t.kind, t.detail, f"{mount} is mounted read-only ({t.detail})",
                            f"remount it read-write or choose another --state-dir; {again}")
    if url.startswith("sqlite"):
        path = Path(url.split("///", 1)[-1])
        where, d = str(path), str(path.parent)
        uid = os.geteuid()
        fixes = {
            "locked": (f"the database {where} is locked: {holder or 'another connection'} has "
                       "held its write lock " + (f"for over {waited:g}s" if waited else
                                                 "past this command's wait"),
                       "end that transaction (or that process), " + again),
            "full": (f"the filesystem holding {d} is full ({t.detail})",
                     f"free space on it (see `df -h {d}`); nothing was lost, {again}"),
            "readonly": (f"the database {where} cannot be written ({t.detail})",
                         f"make {where}, its -wal and -shm files and {d} writable by uid {uid} "
                         f"(or run vigil as their owner), {again}"),
            "cantopen": (f"cannot open the database {where} ({t.detail})",
                         f"make sure {d} exists and uid {uid} may write in it (SQLite creates "
                         f"{path.name}-wal and {path.name}-shm there), {again}"),
            "io": (f"disk I/O error on the database {where}",
                   f"if {path.name}-wal or {path.name}-shm was deleted or the file replaced "
                   "while the agent ran, stop the agent with SIGTERM (never kill -9: it writes "
                   "back what only it still holds) and start it again; else check the disk "
                   "(`dmesg`)"),
            "damaged": (f"the database {where} is damaged ({t.detail})",
                        "stop the agent; restore it from your last backup, or salvage what is "
                        f"readable: `sqlite3 {where} .recover | sqlite3 {where}.recovered`, move "
                        f"{path.name} and its -wal and -shm files aside, move "
                        f"{path.name}.recovered to {path.name}, then run `vigil check`"),
        }
    else:
        from sqlalchemy import make_url

        where = f"the PostgreSQL database {make_url(url).render_as_string()}"  # password masked
        fixes = {
            "unreachable": (f"cannot reach {where}: {t.detail}",
                            f"make sure PostgreSQL is up and reachable from this box; {again}"),
            "full": (f"{where} is out of disk space ({t.detail})",
                     f"free space on the server's data directory; {again}"),
            "damaged": (f"{where} reports damaged data ({t.detail})",
                        "stop the agents; restore the database from your last backup, then "
                        "run `vigil check`"),
            "locked": (f"{where} kept this command waiting on a lock", again),
        }
    cause, fix = fixes.get(t.kind, (f"the store at {url} failed: {t.detail}", again))
    return StoreTrouble(t.kind, t.detail, cause, fix)
