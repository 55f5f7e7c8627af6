"""The raw baselines of bench/obligations.py: the stdlib sqlite3 driver alone, one INSERT a
commit (the fsync limit of this disk), and the agent's own give_back statements on a copy of
its seeded store, 256 rows a commit (the like-for-like limit of the agent's drain)."""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from common import sqlite_modes

from models.states import LIVE_GEN, OPEN_STOP, OPEN_WAKE


def raw_rate(where: Path, n: int) -> tuple[float, str, str]:
    """Single-row INSERT commits/s, and the (journal, synchronous) they ran at."""
    path = where / "raw.db"
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    t0 = time.perf_counter()
    for i in range(n):
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO t (v) VALUES (?)", (f"row {i}",))
        con.execute("COMMIT")
    dt = time.perf_counter() - t0
    modes = sqlite_modes(con)
    con.close()
    return n / dt, *modes


def _states(values: tuple[Any, ...]) -> str:
    return ", ".join(f"'{v.value}'" for v in values)


# The statements workflows/leases/lease.py give_back runs, written out for the stdlib driver:
# the due rows, the lease delete guarded per row (holder, fence, nothing retains the host),
# the release delete of rows whose lease is gone, one event per lease given back.
_DUE = ("SELECT id, host, attempts FROM releases WHERE holder = ? AND next_attempt_at <= ?"
        " ORDER BY next_attempt_at, id LIMIT ?")
_NEEDED = (f"EXISTS (SELECT 1 FROM generations g WHERE g.host = leases.host AND g.state IN ({_states(LIVE_GEN)}))"
           f" OR EXISTS (SELECT 1 FROM wakes w WHERE w.host = leases.host AND w.state IN ({_states(OPEN_WAKE)}))"
           f" OR EXISTS (SELECT 1 FROM stops s WHERE s.host = leases.host AND s.state IN ({_states(OPEN_STOP)}))"
           " OR EXISTS (SELECT 1 FROM members m WHERE m.host = leases.host)"
           " OR EXISTS (SELECT 1 FROM restores r WHERE r.host = leases.host)"
           " OR EXISTS (SELECT 1 FROM attempts a WHERE a.host = leases.host AND a.outcome IS NULL)"
           " OR EXISTS (SELECT 1 FROM hosts h WHERE h.name = leases.host AND h.raised = 1)")
_LEASE_DELETE = ("DELETE FROM leases WHERE host IN ({hosts}) AND EXISTS (SELECT 1 FROM releases r"
                 " WHERE r.id IN ({ids}) AND r.host = leases.host AND r.holder = leases.holder"
                 f" AND r.fence = leases.fence) AND NOT ({_NEEDED}) RETURNING host, fence")
_RELEASE_DELETE = ("DELETE FROM releases WHERE id IN ({ids}) AND NOT EXISTS (SELECT 1 FROM leases l"
                   " WHERE l.host = releases.host AND l.holder = releases.holder"
                   " AND l.fence = releases.fence) RETURNING id")
_EVENT = "INSERT INTO events (at, host, generation_id, kind, detail) VALUES (?, ?, NULL, 'released', ?)"


def raw_batched_rate(db: Path, holder: str, n: int, batch: int = 256) -> tuple[float, str, str]:
    """The like-for-like baseline of the agent's drain: the stdlib driver on a copy of the
    same seeded store (same schema, rows and pragmas as vigil's connections), the same
    set-based statements, `batch` rows a commit. Resolutions/s around every commit, and the
    (journal, synchronous) they ran at."""
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("PRAGMA foreign_keys=ON")
    resolved = 0
    t0 = time.perf_counter()
    while True:
        now = datetime.utcnow().isoformat(" ")
        con.execute("BEGIN IMMEDIATE")
        rows = con.execute(_DUE, (holder, now, batch)).fetchall()
        if not rows:
            con.execute("COMMIT")
            break
        ids = [r[0] for r in rows]
        hosts = sorted({r[1] for r in rows})
        marks = {"ids": ", ".join("?" * len(ids)), "hosts": ", ".join("?" * len(hosts))}
        released = con.execute(_LEASE_DELETE.format(**marks), [*hosts, *ids]).fetchall()
        resolved += len(con.execute(_RELEASE_DELETE.format(**marks), ids).fetchall())
        con.executemany(_EVENT, [(now, h, json.dumps({"fence": f})) for h, f in released])
        con.execute("COMMIT")
    dt = time.perf_counter() - t0
    modes = sqlite_modes(con)
    con.close()
    if resolved != n:
        raise RuntimeError(f"raw batched: {resolved} of {n} owed releases resolved")
    return n / dt, *modes
