"""The agent's start and stop: the state dir's lock (one agent per state dir) and the SQLite
file's (one agent per store), its row in the store, the doorbell the CLI rings, and the
wait for SIGTERM/SIGINT."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psutil
from sqlalchemy import update

from models.errors import Refused
from models.store import emit, utcnow
from models.tables import Agent as AgentRow
from runners.base.doorbell import DOORBELL, LOCK, take_lock
from workflows.base.context import Context


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
    """The open database file, flocked for as long as the agent runs: the state dir's own
    lock keeps out a second agent of the same state dir; this one keeps out an agent of
    another state dir pointed at the same file, which would take hosts into its own `run/`
    (SQLite's POSIX record locks are independent of flock on Linux: the two never meet).
    None when the store is not a SQLite file (agents on one PostgreSQL store are fenced by
    leases)."""
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


def lock_state_dir(state_dir: Path, url: str) -> tuple[IO[str], IO[bytes] | None]:
    """The state dir's lock (one agent per state dir) and the SQLite file's, held until the
    process ends, even by SIGKILL."""
    path = state_dir / LOCK
    f = open(path, "a+")
    if not take_lock(f):
        f.seek(0)
        other = f.read().strip() or "unknown"
        f.close()
        raise Refused(f"another agent (pid {other}) is already running on {state_dir}",
                      f"stop it first (kill {other}) or pass another --state-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f, hold_sqlite_store(url, state_dir)


def register(ctx: Context) -> None:
    me = psutil.Process()

    def step(s):  # type: ignore[no-untyped-def]
        row = s.get(AgentRow, ctx.agent_id)
        values = dict(box=socket.gethostname(), pid=me.pid, create_time=me.create_time(),
                      state_dir=str(ctx.state_dir), started_at=utcnow(),
                      heartbeat_at=utcnow(), stopped_at=None)
        if row is None:
            s.add(AgentRow(id=ctx.agent_id, **values))
        else:
            s.execute(update(AgentRow).where(AgentRow.id == ctx.agent_id).values(**values))
        emit(s, "agent_started", None, agent=ctx.agent_id, pid=me.pid)

    ctx.store.write(step)


def doorbell(ctx: Context, stop: threading.Event, kick: Callable[[], None]) -> None:
    path = ctx.state_dir / DOORBELL
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)

    def loop() -> None:
        while not stop.is_set():
            try:
                sock.recv(64)  # blocks: the agent's stop rings it once more
            except OSError:
                return
            if not stop.is_set():
                kick()
        sock.close()

    threading.Thread(target=loop, name="doorbell", daemon=True).start()


class Signals:
    """SIGTERM/SIGINT seen. Only a flag: Event.set() in a handler could deadlock on the lock
    a main thread interrupted inside Event.wait() holds (it did, about once in 100 stops,
    right after `ready`)."""

    def __init__(self) -> None:
        self.seen = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        self.seen = True


def wait_for_stop(stop: threading.Event, signals: Signals) -> None:
    """Sleep until SIGTERM/SIGINT (or stop is set), without waking every 200 ms."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.set_wakeup_fd(wake_w)  # a signal makes select() return at once
    poller = select.poll()  # not select(): with 1,000 hosts the fd is above FD_SETSIZE
    poller.register(wake_r, select.POLLIN)
    try:
        while not signals.seen and not stop.is_set():
            poller.poll((5.0 if main else 0.2) * 1000)
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
    finally:
        if main:
            signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
