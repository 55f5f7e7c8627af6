"""The agent's side of a keeper (the fd holder, the log keeper): connect, start one when
none runs, ask with a bound, hand everything back to a new one (runners/keepers/wire.py is
the keepers' own side of the same wire)."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from runners.base.doorbell import lock_holder
from runners.keepers.spawn import BOUND, kill_and_wait, reap, spawn, start_time
from runners.keepers.wire import MAX_MESSAGE, START_BOUND, standby_of

log = logging.getLogger("vigil.keepers")


class Peer:
    """One helper as the agent sees it, and as the agent's keeper watch
    (runners/agent/helpers.py) checks and revives it. The owner (the fd holder's or the log
    keeper's client) serializes every call with `lock` and says, through `everything`,
    what a new helper must be given: (put request, [fd]) pairs, lazily (nothing: nothing
    held). `on_start`: rung when a helper is started here (the watch watches it at once)."""

    def __init__(self, state_dir: Path, *, module: str, socket_name: str, lock_name: str,
                 log_name: str, what: str,
                 everything: Callable[[], Iterable[tuple[dict[str, Any], list[int]]]],
                 on_start: Callable[[], None] = lambda: None,
                 holds: Callable[[], bool] = lambda: False,
                 on_reply: Callable[[int, dict[str, Any]], None] = lambda pid, reply: None,
                 replaceable: Callable[[int], bool] | None = None,
                 cover: Callable[[], None] = lambda: None) -> None:
        self.state_dir = state_dir.absolute()
        self.module, self.what, self.log_name = module, what, log_name
        self.path = self.state_dir / socket_name
        self.lock_path = self.state_dir / lock_name
        self.everything, self.on_start = everything, on_start
        # The log keeper's client: `holds` says the helper holds things this agent has no
        # copy of (its standby has them), `on_reply` hears each reply with the helper's pid,
        # `replaceable` whether killing a helper loses nothing (default: the agent has a
        # copy of everything it holds).
        self.holds, self.on_reply, self.cover = holds, on_reply, cover
        self.replaceable = replaceable or (lambda pid: pid in self.started or pid == self.complete)
        self.lock = threading.Lock()
        self.told: int | None = None  # the helper that has been given everything held here
        self.complete: int | None = None  # a helper whose every fd this agent has a copy of
        self.started: list[int] = []  # helpers this process started (its children)

    def running(self) -> tuple[int, float] | None:
        """(pid, start time) of the helper running now, or None."""
        pid = lock_holder(self.lock_path)
        if pid is None or pid <= 0:
            return None
        ctime = start_time(pid)
        return None if ctime is None else (pid, ctime)

    def revive(self) -> None:
        """Everything held here with a helper: one started if none runs. OSError."""
        with self.lock:
            if any(True for _ in self.everything()):
                self.ask({"op": "get", "keys": []})

    def check(self) -> None:
        """One bounded exchange with a running helper while something is held here (one
        that does not answer is killed when that loses nothing), a standby beside it so
        the next death's re-hand needs no Python start. OSError."""
        with self.lock:
            if not any(True for _ in self.everything()) and not self.holds():
                return
            if (self.ask({"op": "get", "keys": []}, start=False) is None
                    and not any(True for _ in self.everything())):
                return  # none runs, and nothing here to give one
            if any(True for _ in self.everything()) or self.holds():
                self.standby()
                self.cover()  # `cover`: the log keeper's client takes copies while no standby has them

    def _connect(self, start: bool) -> tuple[socket.socket, int] | None:
        """A connection to the helper (one started if none runs and `start`) and its pid."""
        deadline = time.monotonic() + START_BOUND
        soon = time.monotonic() + 1.0  # a standby takes over at once; none is started meanwhile
        child: int | None = None  # the helper started here
        while True:
            pid = lock_holder(self.lock_path)
            if pid is not None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.settimeout(BOUND)
                try:
                    s.connect(str(self.path))
                    return s, pid
                except OSError:
                    s.close()
            # One that holds the lock but does not answer yet is waited for (a standby that
            # takes over binds its socket a moment after it takes the lock), and a standby
            # about to take over (the one in service just died) for a second.
            waiting = lock_holder(standby_of(self.lock_path)) is not None
            if not start and pid is None and not (waiting and time.monotonic() < soon):
                return None
            if pid is None and child is not None:
                reap(self.started)
                if child not in self.started:
                    child = None  # it ended and none holds the lock: another is started
            if child is None and pid is None and not (waiting and time.monotonic() < soon):
                reap(self.started)
                child = spawn(self.module, self.state_dir, self.log_name)
                self.started.append(child)
                self.on_start()
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"the {self.what} did not answer on {self.path}")
            time.sleep(0.002)

    def standby(self) -> None:
        """A standby helper waits beside the running one (started if none waits)."""
        if lock_holder(standby_of(self.lock_path)) is None:
            reap(self.started)
            self.started.append(spawn(self.module, self.state_dir, self.log_name, standby=True))

    def _exchange(self, conn: socket.socket, request: dict[str, Any], fds: Iterable[int],
                  maxfds: int) -> tuple[bytes, list[int]]:
        socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
        data, got, _, _ = socket.recv_fds(conn, MAX_MESSAGE, max(1, maxfds))
        if not data:
            raise ConnectionResetError(f"the {self.what} closed the connection")
        return data, got

    def put_all(self, conn: socket.socket) -> None:
        for request, fds in self.everything():
            _, got = self._exchange(conn, request, fds, 0)
            for fd in got:
                os.close(fd)

    def ask(self, request: dict[str, Any], fds: Iterable[int] = (), *, start: bool = True,
            maxfds: int = 0) -> tuple[dict[str, Any], list[int]] | None:
        """One request. A helper not yet given everything held here is given it first (it
        is new: the one told died). One that does not answer within BOUND is killed when
        that loses nothing (see the module's doc) and the request goes to a new one. None:
        no helper runs and `start` is False. OSError when it cannot be done."""
        for tried in range(2):
            got_conn = self._connect(start)
            if got_conn is None:
                return None
            conn, pid = got_conn
            try:
                with conn:
                    if pid != self.told:
                        self.put_all(conn)
                        self.told = pid
                    data, got = self._exchange(conn, request, fds, maxfds)
            except TimeoutError:
                self.told = None
                self._unresponsive(pid)
                if tried:
                    raise
                continue
            except OSError:
                self.told = None
                if tried:
                    raise
                continue
            reply = self._reply(data, got)
            self.on_reply(pid, reply[0])
            return reply
        return None

    def _reply(self, data: bytes, got: list[int]) -> tuple[dict[str, Any], list[int]]:
        for fd in got:
            os.set_inheritable(fd, False)  # SCM_RIGHTS gives them without close-on-exec
        try:
            reply = json.loads(data)
        except ValueError:
            reply = {"ok": False, "error": "not JSON"}
        if not isinstance(reply, dict) or not reply.get("ok"):
            for fd in got:
                os.close(fd)
            why = reply.get("error") if isinstance(reply, dict) else reply
            raise OSError(errno.EPROTO, f"the {self.what} refused: {why}")
        return reply, got

    def _unresponsive(self, pid: int) -> None:
        """A helper that did not answer within BOUND: killed when this agent has a copy of
        all it holds; otherwise left alone, and the exchange fails."""
        ctime = start_time(pid)
        if ctime is None:
            return  # gone already
        if not self.replaceable(pid):
            raise OSError(errno.ETIMEDOUT, f"the {self.what} (pid {pid}) does not answer within "
                          f"{BOUND:g}s and holds what this agent has no copy of, so it is left "
                          f"running; `kill -CONT {pid}` if it is stopped, or kill it to lose them")
        log.warning("%s pid=%d did not answer within %gs: killed, a new one gets everything",
                    self.what, pid, BOUND)
        kill_and_wait(pid, ctime)
        reap(self.started)
