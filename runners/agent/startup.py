"""The agent's start and stop: the state dir's lock (one agent per state dir), its row in
the store, the doorbell the CLI rings, and the wait for SIGTERM/SIGINT."""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
from typing import IO

import psutil
from sqlalchemy import update

from models.errors import Refused
from models.store import emit, utcnow
from models.tables import Agent as AgentRow
from runners.agent.reconciler import Reconciler
from runners.agent.storelock import hold_sqlite_store
from runners.base.doorbell import DOORBELL, LOCK, take_lock
from workflows.base.context import Context


class StartStop:
    """The agent daemon's part that starts and stops it (runners/agent/daemon.py)."""

    ctx: Context
    stop: threading.Event
    _signalled: bool
    _lock_file: IO[str] | None
    _store_lock: IO[bytes] | None

    def _take_lock(self) -> None:
        path = self.ctx.state_dir / LOCK
        f = open(path, "a+")
        if not take_lock(f):
            f.seek(0)
            other = f.read().strip() or "unknown"
            f.close()
            raise Refused(f"another agent (pid {other}) is already running on {self.ctx.state_dir}",
                          f"stop it first (kill {other}) or pass another --state-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f  # held until the process ends, even by SIGKILL
        self._store_lock = hold_sqlite_store(self.ctx.store.url, self.ctx.state_dir)

    def _register(self) -> None:
        me = psutil.Process()

        def step(s):  # type: ignore[no-untyped-def]
            row = s.get(AgentRow, self.ctx.agent_id)
            values = dict(box=socket.gethostname(), pid=me.pid, create_time=me.create_time(),
                          state_dir=str(self.ctx.state_dir), started_at=utcnow(),
                          heartbeat_at=utcnow(), stopped_at=None)
            if row is None:
                s.add(AgentRow(id=self.ctx.agent_id, **values))
            else:
                s.execute(update(AgentRow).where(AgentRow.id == self.ctx.agent_id).values(**values))
            emit(s, "agent_started", None, agent=self.ctx.agent_id, pid=me.pid)

        self.ctx.store.write(step)

    def _doorbell(self, reconciler: Reconciler) -> threading.Thread:
        path = self.ctx.state_dir / DOORBELL
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    sock.recv(64)  # blocks: the agent's stop rings it once more
                except OSError:
                    return
                if not self.stop.is_set():
                    reconciler.kick()
            sock.close()

        t = threading.Thread(target=loop, name="doorbell", daemon=True)
        t.start()
        return t

    def _wait_for_stop(self) -> None:
        """Sleep until SIGTERM/SIGINT (or stop is set), without waking every 200 ms."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.set_wakeup_fd(wake_w)  # a signal makes select() return at once
        poller = select.poll()  # not select(): with 1,000 hosts the fd is above FD_SETSIZE
        poller.register(wake_r, select.POLLIN)
        try:
            while not self._signalled and not self.stop.is_set():
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

    def _on_signal(self, *_: object) -> None:
        # Only a flag: Event.set() here could deadlock on the lock a main thread interrupted
        # inside Event.wait() holds (it did, about once in 100 stops, right after `ready`).
        self._signalled = True
