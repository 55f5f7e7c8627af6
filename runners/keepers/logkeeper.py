"""The box's log keeper: one process of vigil's own that writes every generation's output
to `<state>/logs/<host>/g<N>.log`, capped and rotated (FILES files of MAX_BYTES; the times
beside it: runners/keepers/logfile.py); a host's files beyond its newest KEEP generations
are deleted when a new one starts.

The agent hands each app's pipe read end to the keeper over `<state>/logs.sock`
(SOCK_SEQPACKET, SCM_RIGHTS). The keeper runs in its own session and outlives the agent;
its standby (Mirror) holds a copy of every read end, sent before the agent hears `ok`, and
takes over the moment the keeper dies, so a pipe has a reader while either runs. The agent
keeps a copy too while its fd limit has room (LogPipes), and none under a tight one once
the standby has each (one fd an app in the agent: 10,000 apps under a limit of 20,000);
while no standby has them it keeps copies, and a keeper that died is then restarted with
every read end.

One process for the box (a python process per generation cost 3.8 MB and 12 ms of CPU a
spawn). It holds one fd per app and the files of the OPEN_FILES pipes that wrote last (a
quiet pipe's files are reopened at its next output: 10,000 apps each holding two files
hit EMFILE at 6,650). It sleeps in epoll; a write that fails (disk full) drops that output.

    {"op": "put", "key": UUID, "path": P, "max_bytes": N, "files": K} + [fd]
    {"op": "list", "after": K}         -> {"keys": {UUID: {"path": P, ...}, ...}, "more": B}
    {"op": "get", "keys": [UUID, ...]} -> {"keys": [found, ...]} + copies of their fds
    {"op": "mirror"} (a standby) -> {"op": "put", "pipes": [{key, path, ...}]} + fds, each
        pipe now and each new one, {"op": "drop", "key": K} when one is written out
    every reply also says {"held": N, "mirrored": B} (B: the standby has a copy of each)

It exits once it writes for no pipe and nobody has talked to it for IDLE seconds. One per
state dir (flock on logs.lock); `python -m runners.keepers.logkeeper STATE_DIR`, standard
library only. The loop and the rules every request meets (own uid only; a `put` takes only
a pipe's read end and a file of at least MIN_BYTES) are runners/keepers/wire.py's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import resource
import signal
import socket
import stat
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from runners.base.doorbell import lock_holder, take_lock
from runners.keepers.logfile import Rotating
from runners.keepers.spawn import BOUND
from runners.keepers.wire import (
    MAX_FDS,
    MAX_MESSAGE,
    BadRequest,
    Loop,
    keys_of,
    log_line,
    serve,
    text_of,
)

KEEPER_SOCKET = "logs.sock"
KEEPER_LOCK = "logs.lock"
KEEP = 5  # generations' files kept per host
LIST_PAGE = 100  # keys per list reply (a path of up to ~400 bytes each fits a datagram)
OPEN_FILES = 128  # generations' files open at once (2 fds each): a quiet pipe's are parked
SPARE_FDS = 32  # its socket, clients, selector, lock: never taken by files (a put's fd must fit)
MIN_BYTES = 4096  # the smallest file a put may ask for (`--log-max-bytes` starts at 4K)
PUSH_PAGE = LIST_PAGE  # pipes a datagram to the standby (each with its path, as in a list)
_FILE = re.compile(r"g(\d+)\.(?:log|times)(?:\.\d+)?")  # outputs and their times


def keeper_pid(state_dir: Path) -> int | None:
    """The pid of the running keeper of this state dir, or None."""
    return lock_holder(state_dir / KEEPER_LOCK)


def prune(directory: str, keep: int = KEEP) -> None:
    """Delete the files of all but the newest `keep` generations in a host's log dir."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    gens = sorted({int(m[1]) for n in names if (m := _FILE.fullmatch(n))}, reverse=True)
    old = set(gens[keep:])
    for n in names:
        m = _FILE.fullmatch(n)
        if m and int(m[1]) in old:
            try:
                os.unlink(os.path.join(directory, n))
            except OSError:
                pass


class Keeper:
    def __init__(self, loop: Loop) -> None:
        self.loop, self.sel = loop, loop.sel
        self.pipes: dict[str, tuple[int, Rotating]] = {}  # key -> (read end, its file)
        self.open: OrderedDict[str, None] = OrderedDict()  # keys whose files are open, oldest first
        self.mirror: socket.socket | None = None  # the standby's connection: copies of every pipe

    def handle(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        reply, out = self._handle(request, fds)
        # Every reply says what is held and whether the standby has a copy of all of it:
        # then the agent may let its own copies go (LogPipes).
        return {**reply, "held": len(self.pipes), "mirrored": self.mirrored()}, out

    def _handle(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = request["op"]
        if op == "put":
            return self._put(request, fds)
        if op == "mirror":  # a standby: every pipe now, each new one as it is put
            self._lose_mirror()
            self.mirror = self.loop.serving
            if self.mirror is not None:
                self.loop.quiet.add(self.mirror)  # it never asks: not a reason to stay
                self._push(sorted(self.pipes))
            return {"ok": True}, []
        if op == "list":  # a page of LIST_PAGE: a datagram holds 64 KiB
            after = request.get("after", "")  # a cursor: pipes may end between pages
            if not isinstance(after, str):
                raise BadRequest("'after' must be a string")
            keys = sorted(k for k in self.pipes if k > after)
            page = keys[:LIST_PAGE]
            return {"ok": True, "more": len(keys) > LIST_PAGE,
                    "keys": {k: {"path": self.pipes[k][1].path,
                                 "max_bytes": self.pipes[k][1].max_bytes,
                                 "files": self.pipes[k][1].files} for k in page}}, []
        if op == "get":
            found = [k for k in keys_of(request, MAX_FDS) if k in self.pipes]
            return {"ok": True, "keys": found}, [self.pipes[k][0] for k in found]
        raise BadRequest(f"unknown op {op!r}")

    def _put(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """Keep a pipe's read end and write what it carries; everything is checked before
        anything is taken (a bad put leaves every pipe as it was)."""
        key = text_of(request, "key")
        if len(fds) != 1:
            raise BadRequest(f"put {key}: expected one fd, got {len(fds)}")
        if key in self.pipes:  # the same pipe again (a restarted agent's copy)
            return {"ok": True}, []
        path = text_of(request, "path")
        max_bytes, files = request.get("max_bytes"), request.get("files")
        if type(max_bytes) is not int or max_bytes < MIN_BYTES:
            raise BadRequest(f"put {key}: max_bytes must be an integer of at least {MIN_BYTES}")
        if type(files) is not int or files < 1:
            raise BadRequest(f"put {key}: files must be an integer of at least 1")
        st = os.fstat(fds[0])
        if not stat.S_ISFIFO(st.st_mode) or fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE:
            raise BadRequest(f"put {key}: the fd is not the read end of a pipe")
        self._room(self._most_open() - 1)
        try:
            out = Rotating(path, max_bytes, files)  # OSError: refused, nothing taken
        except OSError as e:  # a limit lower than a pipe an app and OPEN_FILES: park more
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not self.open:
                raise
            self._room(len(self.open) // 2)
            out = Rotating(path, max_bytes, files)
        fd = fds.pop()
        os.set_blocking(fd, False)
        self.pipes[key] = (fd, out)
        self.open[key] = None
        self.loop.watch(fd, lambda: self.drain(key))
        prune(os.path.dirname(path))
        self._push([key])  # in the standby's queue before the agent hears ok
        return {"ok": True}, []

    def take(self, copies: dict[str, tuple[int, dict[str, Any]]]) -> None:
        """A standby that took over: the pipes it kept copies of, read from now on."""
        for key, (fd, request) in copies.items():
            fds = [fd]
            try:
                self._put(request, fds)
            except (BadRequest, OSError) as exc:
                log_line("logkeeper", f"could not take {key} over: {exc}")
            for left in fds:
                os.close(left)
        copies.clear()

    def mirrored(self) -> bool:
        return self.mirror is not None and self.mirror in self.loop.clients

    def _push(self, keys: list[str]) -> None:
        """Copies of these pipes to the standby, a page a datagram (SCM_RIGHTS): once sent
        they are in its queue, held by the kernel even if this keeper dies next."""
        for i in range(0, len(keys) if self.mirrored() else 0, PUSH_PAGE):
            page = keys[i:i + PUSH_PAGE]
            pipes = [{"key": k, "path": self.pipes[k][1].path,
                      "max_bytes": self.pipes[k][1].max_bytes, "files": self.pipes[k][1].files}
                     for k in page]
            self._send({"op": "put", "pipes": pipes}, [self.pipes[k][0] for k in page])

    def _send(self, message: dict[str, Any], fds: list[int]) -> None:
        if self.mirror is None:  # no standby attached: nobody to send to (never asserted: -O)
            return
        try:
            socket.send_fds(self.mirror, [json.dumps(message).encode()], fds)
        except OSError:  # it died, or does not read (SEND_BOUND): no standby until another
            self._lose_mirror()

    def _lose_mirror(self) -> None:
        if self.mirror is not None:
            self.loop.drop(self.mirror)
            self.mirror = None

    def drain(self, key: str) -> None:
        """Read what the pipe has (one chunk: every pipe gets its turn); at EOF, every
        writer of it has closed it: the generation's output is complete."""
        fd, out = self.pipes[key]
        if key in self.open:
            self.open.move_to_end(key)
        else:
            self._room(self._most_open() - 1)
            self.open[key] = None
        try:
            if out.take(fd):  # pipe to file in the kernel: nothing held here (logfile.py)
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # its file could not be opened again
                del self.open[key]
                if self.open:  # the pipe stays readable: the next turn retries
                    self._room(len(self.open) // 2)
                else:  # nothing to close: this chunk is dropped, the app never blocks
                    out.discard(fd)
                return
        self.sel.unregister(fd)
        os.close(fd)
        out.close()
        del self.pipes[key]
        self.open.pop(key, None)
        if self.mirrored():  # every writer closed and all is written: the standby's copy goes
            self._send({"op": "drop", "key": key}, [])

    def _most_open(self) -> int:
        """Files open at once: OPEN_FILES, fewer where the fd limit would not hold them
        beside a read end for each pipe (a fd that arrives past the limit is dropped by the
        kernel: the put fails)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return OPEN_FILES
        return max(1, min(OPEN_FILES, (soft - len(self.pipes) - SPARE_FDS) // 2))

    def _room(self, most: int) -> None:
        """Park the files of the pipes that wrote least recently, down to `most` open."""
        while len(self.open) > most:
            oldest, _ = self.open.popitem(last=False)
            self.pipes[oldest][1].park()


class Mirror:
    """The standby's side: a copy of every pipe the running keeper reads, so its death
    loses none and the agent need keep no copy of its own (one fd an app in the agent: its
    pidfd). Attached to the keeper (op `mirror`), it is sent every pipe, then each new one
    and each one finished (`drop`); when the connection ends and the keeper's lock is free,
    the keeper is gone and this standby takes its lock and every copy over (Keeper.take)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / KEEPER_SOCKET
        self.copies: dict[str, tuple[int, dict[str, Any]]] = {}  # key -> (read end, its put)

    def follow(self, lock: IO[str]) -> None:
        """Until the keeper's lock is this process's: copies of what the keeper holds."""
        while True:
            conn = self._attach()
            if conn is not None:
                with conn:
                    self._receive(conn)
            # The keeper's lock is let go as it exits, a moment after its sockets close.
            if self._take(lock, BOUND if conn is not None else 0.0):
                return
            # A keeper runs: the one followed (it dropped this standby), or another that
            # took the lock first (started by the agent meanwhile): each copy is put to it
            # (a pipe it has already is kept as it is) and let go, then it is followed
            # afresh; a copy no keeper took stays here.
            self._hand_over()
            time.sleep(0.05)

    def _hand_over(self) -> None:
        for key, (fd, request) in list(self.copies.items()):
            conn = self._connect()
            if conn is None:
                return  # none answers: the copies are let go only once a keeper has them
            with conn:
                try:
                    socket.send_fds(conn, [json.dumps(request).encode()], [fd])
                    conn.recv(MAX_MESSAGE)
                except OSError:
                    return
            self._close(key)

    def _connect(self) -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(str(self.path))
        except OSError:
            conn.close()
            return None
        return conn

    def _attach(self) -> socket.socket | None:
        conn = self._connect()
        if conn is None:
            return None
        try:
            conn.send(json.dumps({"op": "mirror"}).encode())
        except OSError:
            conn.close()
            return None
        return conn

    def _receive(self, conn: socket.socket) -> None:
        """Every copy sent until the keeper closes the connection (its death)."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
            except OSError:
                return
            if not data:
                return
            try:
                self._keep(json.loads(data), fds)
            except (ValueError, KeyError, TypeError) as exc:
                log_line("logkeeper", f"standby: a message it cannot read: {exc}")
                for fd in fds:
                    os.close(fd)

    def _keep(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "put":
            if len(message["pipes"]) != len(fds):
                raise ValueError(f"{len(message['pipes'])} pipes named, {len(fds)} fds")
            for pipe, fd in zip(message["pipes"], fds, strict=True):
                self._close(pipe["key"])
                self.copies[pipe["key"]] = (fd, {"op": "put", **pipe})
        elif op == "drop":
            self._close(message["key"])
        else:  # the reply to `mirror`
            for fd in fds:
                os.close(fd)

    def _take(self, lock: IO[str], bound: float) -> bool:
        deadline = time.monotonic() + bound
        while not take_lock(lock):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _close(self, key: str) -> None:
        old = self.copies.pop(key, None)
        if old is not None:
            os.close(old[0])


def run(state_dir: Path) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ends when idle, not with a session's signals
    mirror = Mirror(state_dir)

    def setup(loop: Loop):  # type: ignore[no-untyped-def]
        keeper = Keeper(loop)
        keeper.take(mirror.copies)  # a standby taking over: every pipe it kept a copy of
        return keeper.handle, lambda: bool(keeper.pipes)

    return serve(state_dir, KEEPER_LOCK, KEEPER_SOCKET, "logkeeper", setup, follow=mirror.follow)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
