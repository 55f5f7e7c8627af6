"""Where the CLI meets a running agent: the lock that says one runs, the doorbell that
tells it a new intent was written, and the agent id that stays with the box."""

from __future__ import annotations

import fcntl
import os
import socket
import time
import uuid
from pathlib import Path
from typing import IO, Any

from models.errors import BadInput
from workflows.base.paths import AGENT_ID, DOORBELL, HALTED, LOCK


def agent_id(state_dir: Path, wanted: str | None = None) -> str:
    """Stable per box: written once in the state directory (as `wanted`, the operator's
    `--box NAME`, when given on the first start; a different name later is refused)."""
    path = state_dir / AGENT_ID
    try:
        have = path.read_text().strip()
    except FileNotFoundError:
        have = None
    if have is not None:
        if wanted is not None and wanted != have:
            raise BadInput(f"--box {wanted}: the state directory {state_dir} is box {have}",
                           f"pass --box {have} (or none), or use another --state-dir")
        return have
    else:
        new = wanted or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(new + "\n")
        os.replace(tmp, path)
        return new


def box_of(state_dir: Path) -> str | None:
    """This state dir's box (its agent id) if an agent ever started here: read, never made."""
    try:
        return (state_dir / AGENT_ID).read_text().strip() or None
    except OSError:
        return None


def ring(state_dir: Path) -> None:
    """Tell a running agent that a new intent was written. Best effort: the agent's safety
    scan finds the row anyway."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(b"!", str(state_dir / DOORBELL))
    except OSError:
        pass
    finally:
        s.close()


PROBE_GRACE = 1.0  # seconds a taker retries a lock a probe may hold (a loaded box preempts it)


def take_lock(f: IO[Any]) -> bool:
    """Take the flock of the open file `f` for as long as it stays open: False when another
    process holds it. A probe (lock_holder) holds a free lock for a moment, so a refusal is
    retried for PROBE_GRACE before it counts: a helper or an agent that starts while the
    agent or the CLI probes would otherwise think one of its kind runs, and exit."""
    deadline = time.monotonic() + PROBE_GRACE
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)


def lock_holder(path: Path) -> int | None:
    """The pid written in a held flock file (-1 when unreadable), or None when nobody holds
    it (tried by taking it shared for a moment: probes do not see each other as holders)."""
    try:
        f = open(path, "r+")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


def running_agent_pid(state_dir: Path) -> int | None:
    """The pid holding the agent lock, or None when no agent runs on this state dir."""
    return lock_holder(state_dir / LOCK)


def halted_line(state_dir: Path) -> str | None:
    """The running agent's halt line, if it stopped acting (<state>/agent.halted; a file
    left by an agent that is gone does not count)."""
    try:
        line = (state_dir / HALTED).read_text().strip()
    except OSError:
        return None
    return line if line and running_agent_pid(state_dir) is not None else None
