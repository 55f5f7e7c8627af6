"""One agent per SQLite store: the agent holds an exclusive flock on the database file
itself for as long as it runs. The state dir's own lock (runners/base/doorbell.py LOCK)
keeps out a second agent of the same state dir; this one keeps out an agent of another state
dir pointed at the same file, which would take hosts into its own `run/`. SQLite locks with
POSIX record locks, which are independent of flock on Linux, so the two never meet."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

from models.errors import Refused
from runners.base.doorbell import take_lock


def _holder(path: Path) -> str | None:
    """The pid holding a flock on `path`, from /proc/locks (which names it)."""
    try:
        st = os.stat(path)
        rows = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for row in rows:
        cols = row.split()
        if len(cols) >= 6 and cols[1] == "FLOCK" and cols[3] == "WRITE":
            if int(cols[5].rsplit(":", 1)[-1]) == st.st_ino:
                return cols[4]
    return None


def hold_sqlite_store(url: str, state_dir: Path) -> IO[bytes] | None:
    """The open database file, locked, to keep open until the agent ends; None when the
    store is not a SQLite file (several agents on one PostgreSQL store are fenced by leases)."""
    if not url.startswith("sqlite:///"):
        return None
    path = Path(url.removeprefix("sqlite:///").split("?", 1)[0])
    try:
        f = open(path, "rb")  # noqa: SIM115 (held for the agent's life)
    except OSError:
        return None  # no file yet: the store's own open says why
    if not take_lock(f):
        f.close()
        other = _holder(path)
        who = f"pid {other}" if other else "another process"
        raise Refused(f"another agent ({who}) already runs on the database {path}, from another "
                      f"state dir than {state_dir}",
                      "one agent per SQLite store: stop it, or run this one with its state dir "
                      "(VIGIL_HOME)") from None
    return f
