"""The agent's side of the log keeper (runners/keepers/logkeeper.py): a pipe per
generation, its read end handed to the keeper, and whether this process keeps a copy of
each (its fd limit)."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runners.keepers.logkeeper import KEEPER_LOCK, KEEPER_SOCKET, SPARE_FDS
from runners.keepers.peer import Peer
from runners.keepers.wire import MAX_FDS


def room_for_copies() -> int:
    """How many more fds this process may open, with SPARE_FDS kept for everything else."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft - len(os.listdir("/proc/self/fd")) - 2 * SPARE_FDS)


def copies_fit(held: int) -> bool:
    """Whether a copy of each of `held` pipes fits this process's fd limit beside a pidfd
    for each app (and room to spare): then the agent keeps them."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft == resource.RLIM_INFINITY or 2 * held + 4 * SPARE_FDS <= soft


class LogPipes:
    """The agent's side: a pipe per generation, its read end handed to the keeper (started
    when none runs) and a copy kept here while its fd limit has room for a copy and a pidfd
    an app (copies_fit: most boxes, whose hard limit is far above), so a keeper that dies
    is started again and given every one (`peer`: runners/agent/helpers.py starts it the
    moment it exits, and a standby beside it while it holds anything). Under a tighter
    limit the copies are let go once the keeper says its standby has one of each
    (`mirrored`, in each reply: Mirror), so an app costs the agent one fd, its pidfd (10,000
    apps under 20,000); taken back while no standby has them (it took over, or died). A
    connection per exchange: nothing open between them."""

    def __init__(self, state_dir: Path, on_start: Callable[[], None] = lambda: None) -> None:
        self.state_dir = state_dir.absolute()
        self.ends: dict[str, tuple[int, dict[str, Any]]] = {}  # key -> (read end, its put)
        self.held = 1  # pipes the keeper holds, as its last reply said (unknown: asked)
        self.mirrored: int | None = None  # the keeper whose standby has a copy of each pipe
        self.lent: set[int] = set()  # keepers given pipes this agent then let go of its copy
        self.peer = Peer(self.state_dir, module="runners.keepers.logkeeper",
                         socket_name=KEEPER_SOCKET, lock_name=KEEPER_LOCK,
                         log_name="logs/logkeeper.log", what="log keeper", on_start=on_start,
                         everything=lambda: ((req, [fd]) for fd, req in self.ends.values()),
                         holds=lambda: self.held > 0, on_reply=self._heard,
                         replaceable=self._replaceable, cover=self._cover)

    def _heard(self, pid: int, reply: dict[str, Any]) -> None:
        """A keeper's reply (under peer.lock): once its standby has a copy of every pipe it
        holds (every one this agent holds too: it was given them), this agent's go."""
        self.held = int(reply.get("held") or 0)  # a keeper of before the mirror says nothing
        if not reply.get("mirrored"):
            self.mirrored = None  # of the keeper that answers now (another may have died)
            return
        self.mirrored = pid
        if self.ends and pid == self.peer.told and not copies_fit(self.held):
            self.lent.add(pid)
            for fd, _ in self.ends.values():
                os.close(fd)
            self.ends.clear()

    def _replaceable(self, pid: int) -> bool:
        """Killing this keeper (it does not answer) loses nothing: its standby has a copy
        of all it holds, or this agent has."""
        if pid == self.mirrored:
            return True
        return pid not in self.lent and (pid in self.peer.started or pid == self.peer.complete)

    def open(self, key: str, path: str, max_bytes: int, files: int) -> int:
        """The write end the app gets. The file is created 0600 (an app's output may hold
        secrets) here, so a log dir that cannot take it fails the spawn. OSError."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
        r, w = os.pipe()  # both non-inheritable: only the keeper and the app get an end
        request = {"op": "put", "key": key, "path": path, "max_bytes": max_bytes,
                   "files": files}
        try:
            with self.peer.lock:  # every exchange, and every change of `ends`
                reply = self.peer.ask(request, [r])
                if reply is not None and reply[0].get("mirrored") and not copies_fit(self.held):
                    self.lent.add(self.peer.told or 0)
                    os.close(r)  # the standby has its copy: none here
                else:
                    self.ends[key] = (r, request)
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        return w

    def forget(self, key: str) -> None:
        """The generation is proven gone: its copy of the read end is closed once a keeper
        given the pipe runs (with none, this copy is the only reader of what the app wrote
        last: a new keeper is handed every end first)."""
        with self.peer.lock:
            end = self.ends.get(key)
            if end is None:
                return
            now = self.peer.running()
            if now is None or now[0] != self.peer.told:
                try:
                    self.peer.ask({"op": "get", "keys": []})
                except OSError:
                    pass  # no keeper can be had: what is left in the pipe goes with it
            del self.ends[key]
        os.close(end[0])

    def adopt(self) -> int:
        """On agent start: copies of the read ends a running keeper writes for (none runs,
        or its standby has a copy of each: nothing to take). Returns how many."""
        with self.peer.lock:
            return self._copy_all()

    def _cover(self) -> None:
        """After each check (under peer.lock): the keeper holds pipes no standby has a copy
        of (its standby just took over, or died) and this agent has none of: copies taken
        back until a new standby has them, so a second death meanwhile loses nothing."""
        if self.mirrored is None and len(self.ends) < self.held:
            self._copy_all()

    def _copy_all(self) -> int:
        """Copies of the read ends the running keeper holds and this agent does not, as
        many as its fd limit has room for (under peer.lock). Returns how many."""
        try:
            if self._mirrored_now() and not copies_fit(self.held):
                return 0  # its standby has a copy of each, and the limit is tight: none here
            known: dict[str, dict[str, Any]] = {}
            while True:
                reply = self.peer.ask({"op": "list", "after": max(known, default="")},
                                      start=False)
                if reply is None:
                    return 0
                known.update(reply[0]["keys"])
                if not reply[0].get("more") or not reply[0]["keys"]:
                    break
            pid = self.peer.told
            keys = [k for k in known if k not in self.ends][:room_for_copies()]
            taken = 0
            for i in range(0, len(keys), MAX_FDS):
                got = self.peer.ask({"op": "get", "keys": keys[i:i + MAX_FDS]}, start=False,
                                    maxfds=MAX_FDS)
                if got is None:
                    break
                for k, fd in zip(got[0]["keys"], got[1], strict=True):
                    self.ends[k] = (fd, {"op": "put", "key": k, **known[k]})
                    taken += 1
            if all(k in self.ends for k in known) and pid == self.peer.told:
                self.peer.complete = pid  # every pipe it reads, this agent has too
                self.lent.discard(pid)
            return taken
        except (OSError, ValueError, KeyError):  # a keeper it cannot read: none taken
            return 0

    def _mirrored_now(self) -> bool:
        """Whether the running keeper's standby has a copy of each pipe it reads (asked)."""
        reply = self.peer.ask({"op": "get", "keys": []}, start=False)
        return reply is not None and bool(reply[0].get("mirrored"))
