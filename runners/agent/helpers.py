"""The agent's keepers watched like apps: the fd holder, the log keeper and the fence keeper
(runners/keepers/) each through a pidfd, in one poll loop of their own. The moment one
exits, the agent starts a new one and hands it everything it held (every listening socket:
the agent keeps a copy of each; the log keeper's standby takes over its pipes, of which it
kept a copy, as the agent does while its fd limit has room), so no single death loses a
socket or a pipe; only a second death inside that re-hand window can (bench/keepers.py
measures it). Every TICK the running ones are checked with one bounded exchange (the fence
keeper, which has no socket, by its process state): one that does not answer is treated as
dead (runners/keepers/wire.py says how), and its exit then restarts it like any other.

A restarted agent runs `start()` before its first round: each keeper is checked, started
again if the agent holds something for it and none runs, and watched from then on."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Protocol

from runners.agent.exit_watch import PipeBell

log = logging.getLogger("vigil.keepers")

TICK = 1.0  # seconds between the bounded checks of the running keepers


class Keeper(Protocol):
    what: str

    def running(self) -> tuple[int, float] | None:
        """(pid, start time) of the keeper running now, or None."""

    def revive(self) -> None:
        """The agent holds something for it and none runs: start one, hand it everything."""

    def check(self) -> None:
        """One bounded exchange; one that does not answer is killed (its exit is an event)."""


class KeeperWatch:
    """`bell`: rung when a keeper is started on demand (a first socket, a first pipe), so
    it is watched at once; its ring is given to each keeper's client when it is built
    (Peer's and FenceGuard's on_start: runners/wiring.py, runners/agent/daemon.py)."""

    def __init__(self, keepers: list[Keeper], bell: PipeBell, tick: float = TICK) -> None:
        self.keepers = keepers
        self.tick = tick
        self._poll = select.epoll()
        self._fds: dict[int, tuple[Keeper, int]] = {}  # pidfd -> (keeper, pid)
        self._bell = bell
        self._poll.register(self._bell.r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="keeper-watch", daemon=True)
        self.restarts = 0

    def start(self) -> None:
        """Before the agent's first round: every keeper checked, restored, watched."""
        for h in self.keepers:
            self._attend(h, check=True)
        self._thread.start()

    def close(self) -> None:
        self._bell.stop()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            for fd in list(self._fds):
                os.close(fd)
            self._poll.close()
            self._bell.close()

    def _attend(self, h: Keeper, check: bool) -> None:
        """Check (bounded), restore and watch one keeper; a failure is said, not raised.
        After a death (not `check`) the new one is handed everything whoever started it
        (a standby has taken over already, most often)."""
        try:
            if check:
                h.check()
            if not check or h.running() is None:
                h.revive()
        except OSError as exc:
            log.warning("%s: %s; the next check tries again", h.what, exc)
        self._watch(h)

    def _watch(self, h: Keeper) -> None:
        now = h.running()
        watched = [fd for fd, (hh, _) in self._fds.items() if hh is h]
        if watched and now is not None and self._fds[watched[0]][1] == now[0]:
            return
        for fd in watched:
            self._forget(fd)
        if now is None:
            return
        try:
            fd = os.pidfd_open(now[0])
        except OSError:
            return  # gone already: the next tick restores it
        if h.running() != now:  # it ended between the two looks
            os.close(fd)
            return
        self._fds[fd] = (h, now[0])
        self._poll.register(fd, select.EPOLLIN)

    def _forget(self, fd: int) -> None:
        self._fds.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except OSError:
            pass
        os.close(fd)

    def _run(self) -> None:
        checked = time.monotonic()
        while not self._bell.stopped.is_set():
            events = self._poll.poll(max(0.0, checked + self.tick - time.monotonic()))
            if self._bell.stopped.is_set():
                return
            died = []
            for fd, _ in events:
                if fd == self._bell.r:
                    self._bell.drain()
                elif fd in self._fds:
                    h, pid = self._fds[fd]
                    self._forget(fd)
                    died.append(h)
                    log.warning("%s pid=%d exited: starting a new one with everything it held",
                                h.what, pid)
            for h in died:
                self.restarts += 1
                self._attend(h, check=False)
                self._attend(h, check=True)  # and a new standby beside the new one
            if time.monotonic() >= checked + self.tick:
                checked = time.monotonic()
                for h in self.keepers:
                    self._attend(h, check=True)
            else:
                for h in self.keepers:
                    if h not in died:
                        self._watch(h)  # one started on demand since
