"""Exits as events: every current generation's leader is watched through a pidfd, and an
exit is handed to the agent the moment the kernel reports it, so the work of an idle
second does not grow with the number of hosts. The agent's periodic scan stays as the
backstop (a pid this watcher could not open, a kernel without pidfds)."""

from __future__ import annotations

import logging
import os
import resource
import select
import threading
import time
from collections.abc import Callable

from runners.agent.trust import Trouble, guarded
from runners.base.pids import CTIME_TOLERANCE, pid_status

log = logging.getLogger("vigil.watch")


def pidfds_supported() -> bool:
    """True when this kernel and Python open pidfds (Linux 5.3+, Python 3.9+)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def make_room_for(fds: int) -> None:
    """One fd per watched leader: lift the soft limit (1,024 is common) toward the hard one
    when `fds` more would not fit. Only then: apps spawned later inherit the limit."""
    if fds <= 0:  # nothing new to watch: no count of our fds (18,000 names at 9,000 hosts)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + fds + 64
    if want <= soft or soft == hard:
        return
    new = hard if hard == resource.RLIM_INFINITY else min(hard, max(want, 2 * soft))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        pass


class PipeBell:
    """A self-pipe that wakes a poll loop, rung from any thread. Once stopped it is never
    written again: a drive that ends after the stop still rings, and once the bell is
    closed its fd number may be another file's."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def ring(self) -> None:
        with self._lock:
            if self.stopped.is_set():
                return
            try:
                os.write(self.w, b"x")
            except BlockingIOError:
                pass  # already rung

    def stop(self) -> None:
        """Stopped, and rung once more: the loop ends (then close() it)."""
        with self._lock:
            self.stopped.set()
            os.write(self.w, b"x")

    def drain(self) -> None:
        try:
            while os.read(self.r, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class ExitWatcher:
    """Watches leaders by (generation id, pid, create time); calls `on_exit(ids)` from its
    own thread with the generations whose leader exited (or was already gone, or whose pid
    now names another process), and re-reads what to watch when it returns True (it
    retired some). `refresh()` asks it to re-read what to watch from
    `leaders()` (one query); it does so at most every `settle` seconds, so a burst of
    drives costs one read, and at most every `per_leader` seconds per leader watched, so
    a storm of wakes does not re-read a thousand rows four times a second."""

    def __init__(self, leaders: Callable[[], dict[int, tuple[int, float]]],
                 on_exit: Callable[[set[int]], bool | None], settle: float = 0.25,
                 per_leader: float = 0.001, settle_max: float = 2.0,
                 trouble: Trouble = lambda exc: False) -> None:
        self.leaders = leaders
        self.on_exit = on_exit
        self.trouble = trouble  # True: the store failed and the agent has said so
        self.settle = settle
        self.per_leader = per_leader
        self.settle_max = settle_max
        self._dirty = True
        self._poll = select.epoll()
        self._fd_of: dict[int, int] = {}  # generation id -> pidfd
        self._gen_of: dict[int, int] = {}  # pidfd -> generation id
        self._unwatched: set[int] = set()  # leaders it could not open a pidfd for (EMFILE, say)
        self._lock = threading.Lock()
        self._bell = PipeBell()
        self._poll.register(self._bell.r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refresh(self) -> None:
        """The set of current generations may have changed: re-read it soon."""
        self._dirty = True
        self._bell.ring()

    def watched(self) -> set[int]:
        with self._lock:
            return set(self._fd_of)

    def unwatched(self) -> set[int]:
        """The current generations it was asked to watch and could not: the backstop's."""
        with self._lock:
            return set(self._unwatched)

    def count(self) -> int:
        """How many current generations it was last given, watched or not."""
        with self._lock:
            return len(self._fd_of) + len(self._unwatched)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._bell.stop()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._bell.close()

    def _run(self) -> None:
        last_sync = 0.0
        try:
            while not self._bell.stopped.is_set():
                timeout = -1.0
                settle = min(self.settle_max, max(self.settle, self.per_leader * len(self._fd_of)))
                if self._dirty:
                    timeout = max(0.0, last_sync + settle - time.monotonic())
                exited: set[int] = set()
                for fd, _ in self._poll.poll(timeout):
                    if fd == self._bell.r:
                        self._bell.drain()
                        continue
                    gen = self._forget_fd(fd)
                    if gen is not None:
                        exited.add(gen)
                if self._bell.stopped.is_set():
                    break
                if self._dirty and time.monotonic() >= last_sync + settle:
                    self._dirty = False
                    last_sync = time.monotonic()
                    synced = False
                    with guarded(self.trouble, log, "reading the leaders to watch failed; retrying"):
                        exited |= self._sync(self.leaders())
                        synced = True
                    if not synced:  # the store is busy or down: try again shortly
                        self._dirty = True
                if exited:
                    with guarded(self.trouble, log, "handling the exit of %s failed; the scan "
                                 "retries it", sorted(exited)):
                        if self.on_exit(exited):
                            self.refresh()
        finally:
            for fd in list(self._gen_of):
                self._forget_fd(fd)
            self._poll.close()
            # The bell stays open: close() rings it after setting stop, and this loop may
            # have seen stop (woken by an exit) before that ring; close() closes it.

    def _forget_fd(self, fd: int) -> int | None:
        with self._lock:
            gen = self._gen_of.pop(fd, None)
            if gen is not None:
                self._fd_of.pop(gen, None)
        try:
            self._poll.unregister(fd)
        except (OSError, ValueError):
            pass
        os.close(fd)
        return gen

    def _sync(self, wanted: dict[int, tuple[int, float]]) -> set[int]:
        """Watch exactly `wanted` (id -> leader pid, create time): open pidfds for new
        leaders, close the ones no longer wanted. Returns the new ones already gone."""
        with self._lock:
            have = dict(self._fd_of)
            self._unwatched.clear()  # tried again below
        for gen, fd in have.items():
            if gen not in wanted:
                self._forget_fd(fd)
        make_room_for(len(wanted) - len(have))
        gone = set()
        for gen, (pid, ctime) in wanted.items():
            if gen in have:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                gone.add(gen)
                continue
            except OSError as exc:  # out of fds, say: the backstop still checks it
                log.warning("cannot watch g%d (pid %d): %s", gen, pid, exc)
                with self._lock:
                    self._unwatched.add(gen)
                continue
            # The fd names whatever holds the pid now; only the same start time is our leader.
            st = pid_status(pid)
            same = st is not None and abs(st[0] - ctime) <= CTIME_TOLERANCE
            if not same:
                os.close(fd)
                gone.add(gen)
                continue
            with self._lock:
                self._fd_of[gen] = fd
                self._gen_of[fd] = gen
            self._poll.register(fd, select.EPOLLIN)
        return gone
