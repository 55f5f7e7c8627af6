"""The box's log keeper: one process of vigil's own that writes every generation's output
to `<state>/logs/<host>/g<N>.log`, capped and rotated (FILES files of MAX_BYTES; the times
beside it: runners/keepers/logfile.py); a host's files beyond its newest KEEP generations
are deleted when a new one starts.

The agent hands each app's pipe read end to the keeper over `<state>/logs.sock`
(SOCK_SEQPACKET, SCM_RIGHTS) and keeps a copy. The keeper runs in its own session and
outlives the agent; a restarted agent takes copies back, and a keeper that died under a
running agent is restarted with every read end, so a pipe has a reader while either runs.

One process for the box (a python process per generation cost 3.8 MB and 12 ms of CPU a
spawn). It holds one fd per app and the files of the OPEN_FILES pipes that wrote last (a
quiet pipe's files are reopened at its next output: 10,000 apps each holding two files
hit EMFILE at 6,650). It sleeps in epoll; a write that fails (disk full) drops that output.

    {"op": "put", "key": UUID, "path": P, "max_bytes": N, "files": K} + [fd]
    {"op": "list", "after": K}         -> {"keys": {UUID: {"path": P, ...}, ...}, "more": B}
    {"op": "get", "keys": [UUID, ...]} -> {"keys": [found, ...]} + copies of their fds

It exits once it writes for no pipe and nobody has talked to it for IDLE seconds. One per
state dir (flock on logs.lock); `python -m runners.keepers.logkeeper STATE_DIR`, standard
library only. The loop and the rules every request meets (own uid only; a `put` takes only
a pipe's read end and a file of at least MIN_BYTES) are runners/keepers/wire.py's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import selectors
import signal
import stat
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runners.base.doorbell import lock_holder
from runners.keepers.logfile import Rotating
from runners.keepers.wire import MAX_FDS, BadRequest, Loop, Peer, keys_of, serve, text_of

KEEPER_SOCKET = "logs.sock"
KEEPER_LOCK = "logs.lock"
KEEP = 5  # generations' files kept per host
LIST_PAGE = 100  # keys per list reply (a path of up to ~400 bytes each fits a datagram)
OPEN_FILES = 128  # generations' files open at once (2 fds each): a quiet pipe's are parked
MIN_BYTES = 4096  # the smallest file a put may ask for (`--log-max-bytes` starts at 4K)
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
    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.pipes: dict[str, tuple[int, Rotating]] = {}  # key -> (read end, its file)
        self.open: OrderedDict[str, None] = OrderedDict()  # keys whose files are open, oldest first

    def handle(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = request["op"]
        if op == "put":
            return self._put(request, fds)
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
        self._room(OPEN_FILES - 1)
        out = Rotating(path, max_bytes, files)  # OSError: refused, nothing taken
        fd = fds.pop()
        os.set_blocking(fd, False)
        self.pipes[key] = (fd, out)
        self.open[key] = None
        self.sel.register(fd, selectors.EVENT_READ, lambda: self.drain(key))
        prune(os.path.dirname(path))
        return {"ok": True}, []

    def drain(self, key: str) -> None:
        """Read what the pipe has (one chunk: every pipe gets its turn); at EOF, every
        writer of it has closed it: the generation's output is complete."""
        fd, out = self.pipes[key]
        if key in self.open:
            self.open.move_to_end(key)
        else:
            self._room(OPEN_FILES - 1)
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

    def _room(self, most: int) -> None:
        """Park the files of the pipes that wrote least recently, down to `most` open."""
        while len(self.open) > most:
            oldest, _ = self.open.popitem(last=False)
            self.pipes[oldest][1].park()


def run(state_dir: Path) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ends when idle, not with a session's signals

    def setup(loop: Loop):  # type: ignore[no-untyped-def]
        keeper = Keeper(loop.sel)
        return keeper.handle, lambda: bool(keeper.pipes)

    return serve(state_dir, KEEPER_LOCK, KEEPER_SOCKET, "logkeeper", setup)


class LogPipes:
    """The agent's side: a pipe per generation, its read end handed to the keeper (started
    when none runs) and a copy kept here until the generation is proven gone, so a keeper
    that dies is started again and given every read end (`peer`: runners/agent/helpers.py
    starts it the moment it exits). A connection per exchange: nothing open between them."""

    def __init__(self, state_dir: Path, on_start: Callable[[], None] = lambda: None) -> None:
        self.state_dir = state_dir.absolute()
        self.ends: dict[str, tuple[int, dict[str, Any]]] = {}  # key -> (read end, its put)
        self.peer = Peer(self.state_dir, module="runners.keepers.logkeeper",
                         socket_name=KEEPER_SOCKET, lock_name=KEEPER_LOCK,
                         log_name="logs/logkeeper.log", what="log keeper", on_start=on_start,
                         everything=lambda: ((req, [fd]) for fd, req in self.ends.values()))

    def open(self, key: str, path: str, max_bytes: int, files: int) -> int:
        """The write end the app gets. The file is created 0600 (an app's output may hold
        secrets) here, so a log dir that cannot take it fails the spawn. OSError."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
        r, w = os.pipe()  # both non-inheritable: only the keeper and the app get an end
        request = {"op": "put", "key": key, "path": path, "max_bytes": max_bytes,
                   "files": files}
        try:
            with self.peer.lock:  # every exchange, and every change of `ends`
                self.peer.ask(request, [r])
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
        """On agent start: copies of the read ends a running keeper writes for (none runs:
        nothing to take). Returns how many."""
        with self.peer.lock:
            try:
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
                keys = [k for k in known if k not in self.ends]
                taken = 0
                for i in range(0, len(keys), MAX_FDS):
                    got = self.peer.ask({"op": "get", "keys": keys[i:i + MAX_FDS]}, start=False,
                                        maxfds=MAX_FDS)
                    if got is None:
                        break
                    for k, fd in zip(got[0]["keys"], got[1], strict=True):
                        self.ends[k] = (fd, {"op": "put", "key": k, **known[k]})
                        taken += 1
                if taken == len(keys) and pid == self.peer.told:
                    self.peer.complete = pid  # every pipe it reads, this agent has too
                return taken
            except (OSError, ValueError, KeyError):  # a keeper it cannot read: none taken
                return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
