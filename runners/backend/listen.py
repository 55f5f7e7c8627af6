"""Listening sockets on the box: binding them, checking an address is free, and keeping them
with the fd holder (runners/keepers/fdholder.py) across agent restarts.

Where a socket lives: the agent's own copy (it dup2s it into every generation it spawns),
the holder's copy (which outlives the agent), and each generation's inherited copies. A
restarted agent gets it back from the holder; if the holder died too, from a live process
that still has it open (pidfd_getfd, Linux 5.6+, found by the inode the store recorded),
and hands it to a new holder. Only when none of them has it is the socket lost.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import cast

from runners.backend.addresses import split, unix_in_use, why_unbindable
from runners.keepers.fdholder import HOLDER_LOCK, HOLDER_SOCKET
from runners.keepers.peer import Peer
from runners.keepers.wire import MAX_FDS

BACKLOG = socket.SOMAXCONN  # the kernel caps it at net.core.somaxconn
_PIDFD_GETFD = 438  # the syscall's number (the same on every architecture)


def boot_id() -> str:
    """This boot of the box: a socket opened in another boot cannot be held by anything."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _family(host: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def open_socket(address: str) -> socket.socket:
    """Bind and listen. Raises OSError (errno as the kernel said, strerror the one line of
    why_unbindable) or ValueError (a file that is not a socket sits on the unix path)."""
    try:
        return _bind(address)
    except OSError as exc:
        raise OSError(exc.errno, why_unbindable(address, exc)) from exc


def _bind(address: str) -> socket.socket:
    kind, where = split(address)
    if kind == "unix":
        path = str(where)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise ValueError(f"{path} exists and is not a socket")
            if unix_in_use(path):
                raise OSError(errno.EADDRINUSE, "something already listens there")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale socket file: nothing listens on it
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        host, port = cast(tuple[str, int], where)
        s = socket.socket(_family(host), socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no user
        if _family(host) == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        s.bind(where)  # type: ignore[arg-type]
        s.listen(BACKLOG)
    except BaseException:
        s.close()
        raise
    return s


def probe_address(address: str) -> str | None:
    """Whether vigil could open `address` now: None, or why not (one line with the fix).
    Binds and closes at once (a unix path is only checked, never created)."""
    kind, where = split(address)
    if kind == "unix":
        path = str(where)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            return f"{address}: directory {parent} does not exist; create it or pick another path"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{address}: directory {parent} is not writable by vigil; pick a writable directory"
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                return f"{address}: {path} exists and is not a socket; remove it or pick another path"
            if unix_in_use(path):
                return why_unbindable(address, OSError(errno.EADDRINUSE, "in use"))
        return None
    try:
        open_socket(address).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _pidfd_getfd(pid: int, target: int) -> int:
    import ctypes  # only a rescue needs it

    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        fd = libc.syscall(_PIDFD_GETFD, pidfd, target, 0)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return fd  # close-on-exec already (the kernel sets it)
    finally:
        os.close(pidfd)


def copy_from(pid: int, inode: int) -> socket.socket | None:
    """A copy of the socket `inode` from a live process that has it open, or None."""
    want = f"socket:[{inode}]"
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") != want:
                continue
            return socket.socket(fileno=_pidfd_getfd(pid, int(name)))
        except OSError:
            continue
    return None


class Listeners:
    """The agent's listening sockets (the ListenerPort): its own copies by key, and the
    holder that keeps them across restarts (`peer`: runners/agent/helpers.py starts a new
    one the moment it exits and hands it every socket, so each lives in two processes at
    least)."""

    def __init__(self, state_dir: Path, on_start: Callable[[], None] = lambda: None) -> None:
        self.state_dir = state_dir.absolute()
        self.socks: dict[str, socket.socket] = {}
        self.peer = Peer(self.state_dir, module="runners.keepers.fdholder",
                         socket_name=HOLDER_SOCKET, lock_name=HOLDER_LOCK,
                         log_name="logs/fdholder.log", what="fd holder", on_start=on_start,
                         everything=lambda: (({"op": "put", "key": k}, [s.fileno()])
                                             for k, s in self.socks.items()))

    # -- the ListenerPort --------------------------------------------------------------------
    def boot(self) -> str:
        return boot_id()

    def keys(self) -> list[str]:
        return list(self.socks)

    def inode(self, key: str) -> int | None:
        s = self.socks.get(key)
        return None if s is None else os.fstat(s.fileno()).st_ino

    def bind(self, key: str, address: str) -> int:
        """Open the socket as `key` (this agent's copy); returns its inode. OSError/ValueError."""
        with self.peer.lock:  # every exchange, and every change of `socks`
            old = self.socks.pop(key, None)
            if old is not None:
                old.close()
            self.socks[key] = open_socket(address)
            return os.fstat(self.socks[key].fileno()).st_ino

    def hand(self, key: str) -> None:
        """Give the holder its copy (starting the holder if none runs). Raises OSError."""
        with self.peer.lock:
            self.peer.ask({"op": "put", "key": key}, [self.socks[key].fileno()])

    def fds(self, keys: list[str]) -> list[int]:
        """This agent's fds of `keys`, in order; KeyError for one it does not have. A
        holder that died is started again and given them all first."""
        with self.peer.lock:
            out = [self.socks[k].fileno() for k in keys]
            if keys:
                self.peer.ask({"op": "get", "keys": []})  # cheap; restores a holder that died
            return out

    def fetch(self, keep: set[str]) -> dict[str, int]:
        """On agent start: every socket the holder keeps that the store still names (the
        rest it closes); returns key -> inode of each one this agent now has."""
        with self.peer.lock:
            listed = self.peer.ask({"op": "list"}, start=False)
            if listed is None:
                return {}
            pid = self.peer.told
            self.peer.ask({"op": "keep", "keys": sorted(keep)})
            wanted = [k for k in listed[0]["keys"] if k in keep and k not in self.socks]
            for i in range(0, len(wanted), MAX_FDS):
                reply = self.peer.ask({"op": "get", "keys": wanted[i:i + MAX_FDS]}, maxfds=MAX_FDS)
                if reply is None:
                    break
                for key, fd in zip(reply[0]["keys"], reply[1], strict=True):
                    self.socks[key] = socket.socket(fileno=fd)
            if pid == self.peer.told and all(k in self.socks for k in wanted):
                self.peer.complete = pid  # every socket it holds, this agent has too
            return {k: os.fstat(s.fileno()).st_ino for k, s in self.socks.items()}

    def listed(self) -> dict[str, int] | None:
        """What the holder keeps (key -> inode), or None when no holder runs."""
        with self.peer.lock:
            reply = self.peer.ask({"op": "list"}, start=False)
            return None if reply is None else {k: int(v) for k, v in reply[0]["keys"].items()}

    def rescue(self, key: str, inode: int, pids: list[int]) -> bool:
        """Take socket `inode` from one of `pids` (a live process that inherited it) and
        give it to the holder. False when none of them has it."""
        for pid in pids:
            s = copy_from(pid, inode)
            if s is None:
                continue
            with self.peer.lock:
                old = self.socks.pop(key, None)
                if old is not None:
                    old.close()
                self.socks[key] = s
                self.peer.ask({"op": "put", "key": key}, [s.fileno()])
            return True
        return False

    def drop(self, keys: list[str]) -> None:
        """Close these (the host is gone): here and in the holder, if one runs."""
        with self.peer.lock:
            for k in keys:
                s = self.socks.pop(k, None)
                if s is not None:
                    s.close()
            if keys:
                self.peer.ask({"op": "drop", "keys": keys}, start=False)

    def close(self) -> None:
        """Nothing to close: a connection lasts one exchange (the sockets are the agent's own,
        and die with it)."""

    def __enter__(self) -> Listeners:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
