"""The box's log keeper: one small process of vigil's own that writes every generation's
output to `<state>/logs/<host>/g<N>.log`, capped and rotated (at most FILES files of at most
MAX_BYTES each: g<N>.log, g<N>.log.1, ...; the oldest is dropped), so a chatty app cannot
fill the disk. Older generations' files beyond the newest KEEP of a host are deleted when a
new one starts.

Each app writes its stdout and stderr into a pipe; the agent hands the pipe's read end to
the keeper over `<state>/logs.sock` (SOCK_SEQPACKET, SCM_RIGHTS) and keeps a copy of it.
The keeper runs in its own session, outside every generation's containment: it outlives
the agent (apps keep running when the agent stops or dies, and so does their output). A
restarted agent takes copies of the read ends back from the keeper; a keeper that died
under a running agent is started again and given every read end the agent holds, so an
app's pipe never loses its reader while either of the two runs (an app whose pipe is full
meanwhile waits in its write). Only the death of both at once leaves an app's pipe with no
reader (its next write fails with EPIPE).

One process for the box, whatever the number of hosts: a python process per generation
cost 3.8 MB and 12 ms of CPU at every spawn. It sleeps in select() and never blocks an app
on disk trouble: a write that fails (disk full) drops that output.

Messages are one JSON object, with the fds it carries in the same datagram:

    {"op": "put", "key": UUID, "path": P, "max_bytes": N, "files": K} + [fd]
    {"op": "list", "after": K}         -> {"keys": {UUID: {"path": P, ...}, ...}, "more": B}
    {"op": "get", "keys": [UUID, ...]} -> {"keys": [found, ...]} + copies of their fds

It exits once it writes for no pipe and nobody has talked to it for IDLE seconds. One per
state dir (flock on logs.lock). Run as `python -m runners.keepers.logkeeper STATE_DIR`; the standard
library only, like the rest of what it imports.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import cast

from runners.base.doorbell import lock_holder

KEEPER_SOCKET = "logs.sock"
KEEPER_LOCK = "logs.lock"
KEEP = 5  # generations' files kept per host
CHUNK = 1 << 16
MAX_FDS = 200  # per message (the kernel takes at most 253: SCM_MAX_FD)
MAX_MESSAGE = 1 << 16
LIST_PAGE = 100  # keys per list reply (a path of up to ~400 bytes each fits a datagram)
IDLE = 5.0
START_BOUND = 10.0  # seconds for a new keeper to answer
ROOT = str(Path(__file__).resolve().parent.parent)
_FILE = re.compile(r"g(\d+)\.log(?:\.\d+)?")


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


class Rotating:
    """One generation's file, rotated at `max_bytes` (cut at a line end when one fits)."""

    def __init__(self, path: str, max_bytes: int, files: int) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, max(1, files)
        self.fd = -1
        self.size = 0
        self._open()

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)

    def _rotate(self) -> None:
        os.close(self.fd)
        if self.files == 1:
            os.unlink(self.path)
        else:
            for i in range(self.files - 1, 0, -1):  # .1 -> .2, ..., base -> .1
                src = self.path if i == 1 else f"{self.path}.{i - 1}"
                try:
                    os.replace(src, f"{self.path}.{i}")
                except FileNotFoundError:
                    pass
        self._open()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            room = self.max_bytes - self.size
            if room <= 0:
                try:
                    self._rotate()
                except OSError:  # the dir is gone or full: this output is lost
                    return
                continue
            part = view[:room]
            if len(view) > room:  # cut at the last whole line that fits, if any
                nl = bytes(part).rfind(b"\n")
                if nl >= 0:
                    part = part[:nl + 1]
                elif self.size > 0:
                    self.size = self.max_bytes  # start the line in a fresh file
                    continue
            try:
                n = os.write(self.fd, part)
            except OSError:  # disk full, I/O error: this output is lost, the app goes on
                n = len(part)
            self.size += n
            view = view[n:]


def _log(msg: str) -> None:
    print(f"ts={time.strftime('%Y-%m-%dT%H:%M:%S')} logger=vigil.logkeeper {msg}",
          file=sys.stderr, flush=True)


class Keeper:
    def __init__(self, sel: selectors.BaseSelector) -> None:
        self.sel = sel
        self.pipes: dict[str, tuple[int, Rotating]] = {}  # key -> (read end, its file)

    def handle(self, request: dict, fds: list[int]) -> tuple[dict, list[int]]:
        op = request.get("op")
        if op == "put":
            key = str(request["key"])
            if len(fds) != 1:
                raise ValueError(f"put {key}: expected one fd, got {len(fds)}")
            if key in self.pipes:  # the same pipe again (a restarted agent's copy)
                return {"ok": True}, []
            path = str(request["path"])
            out = Rotating(path, int(request["max_bytes"]), int(request["files"]))
            fd = fds.pop()
            os.set_blocking(fd, False)
            self.pipes[key] = (fd, out)
            self.sel.register(fd, selectors.EVENT_READ, key)
            prune(os.path.dirname(path))
            return {"ok": True}, []
        if op == "list":  # a page of LIST_PAGE: a datagram holds 64 KiB
            after = str(request.get("after", ""))  # a cursor: pipes may end between pages
            keys = sorted(k for k in self.pipes if k > after)
            page = keys[:LIST_PAGE]
            return {"ok": True, "more": len(keys) > LIST_PAGE,
                    "keys": {k: {"path": self.pipes[k][1].path,
                                 "max_bytes": self.pipes[k][1].max_bytes,
                                 "files": self.pipes[k][1].files} for k in page}}, []
        if op == "get":
            found = [k for k in request.get("keys", [])[:MAX_FDS] if k in self.pipes]
            return {"ok": True, "keys": found}, [self.pipes[k][0] for k in found]
        raise ValueError(f"unknown op {op!r}")

    def drain(self, key: str) -> None:
        """Read what the pipe has (one chunk: every pipe gets its turn); at EOF, every
        writer of it has closed it: the generation's output is complete."""
        fd, out = self.pipes[key]
        try:
            data = os.read(fd, CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            out.write(data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        out.close()
        del self.pipes[key]


def run(state_dir: Path) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # ends when idle, not with a session's signals
    lock = open(state_dir / KEEPER_LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another keeper writes this box's logs
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    path = state_dir / KEEPER_SOCKET
    try:
        path.unlink()  # a dead keeper's (the lock says none runs)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(16)
    _log(f"started pid={os.getpid()} state_dir={state_dir}")
    sel = selectors.DefaultSelector()
    keeper = Keeper(sel)
    sel.register(server, selectors.EVENT_READ)
    clients: set[socket.socket] = set()
    last = time.monotonic()
    while True:
        idle = not keeper.pipes and not clients
        ready = sel.select(max(0.0, IDLE - (time.monotonic() - last)) if idle else None)
        if not ready and not keeper.pipes and not clients:
            _log("no pipe to write for: exiting")
            return 0
        for key, _ in ready:
            if isinstance(key.data, str):
                keeper.drain(key.data)
                continue
            last = time.monotonic()
            conn = key.fileobj
            if conn is server:
                client, _ = server.accept()
                sel.register(client, selectors.EVENT_READ)
                clients.add(client)
                continue
            conn = cast(socket.socket, conn)  # every other registered object is one
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                sel.unregister(conn)
                clients.discard(conn)
                conn.close()
                continue
            try:
                reply, out = keeper.handle(json.loads(data), fds)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                reply, out = {"ok": False, "error": str(exc)}, []
            finally:
                for fd in fds:  # what a request carried and the keeper did not keep
                    os.close(fd)
            try:
                socket.send_fds(conn, [json.dumps(reply).encode()], out)
            except OSError:
                sel.unregister(conn)
                clients.discard(conn)
                conn.close()


class LogPipes:
    """The agent's side: a pipe per generation, its read end handed to the keeper (started
    when none runs) and a copy kept here until the generation is proven gone. A connection
    per request (a spawn's cost is a connect), so nothing is left open between them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir.absolute()
        self.ends: dict[str, tuple[int, dict]] = {}  # key -> (read end, its put request)
        self._told: int | None = None  # the keeper that has every end held here
        self._started: list[int] = []  # keepers this process started, reaped as they end
        self._lock = threading.Lock()

    def open(self, key: str, path: str, max_bytes: int, files: int) -> int:
        """The write end the app gets. The file is created 0600 (an app's output may hold
        secrets) here, so a log dir that cannot take it fails the spawn. OSError."""
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
        r, w = os.pipe()  # both non-inheritable: only the keeper and the app get an end
        request = {"op": "put", "key": key, "path": path, "max_bytes": max_bytes,
                   "files": files}
        try:
            with self._lock:
                self._ask(request, [r])
                self.ends[key] = (r, request)
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        return w

    def forget(self, key: str) -> None:
        """The generation is proven gone: its copy of the read end is closed."""
        with self._lock:
            end = self.ends.pop(key, None)
        if end is not None:
            os.close(end[0])

    def adopt(self) -> int:
        """On agent start: copies of the read ends a running keeper writes for (none runs:
        nothing to take). Returns how many."""
        with self._lock:
            try:
                known: dict[str, dict] = {}
                while True:
                    reply = self._ask({"op": "list", "after": max(known, default="")},
                                      start=False)
                    if reply is None:
                        return 0
                    known.update(reply[0]["keys"])
                    if not reply[0].get("more") or not reply[0]["keys"]:
                        break
                keys = [k for k in known if k not in self.ends]
                taken = 0
                for i in range(0, len(keys), MAX_FDS):
                    got = self._ask({"op": "get", "keys": keys[i:i + MAX_FDS]}, start=False,
                                    maxfds=MAX_FDS)
                    if got is None:
                        break
                    for k, fd in zip(got[0]["keys"], got[1], strict=True):
                        self.ends[k] = (fd, {"op": "put", "key": k, **known[k]})
                        taken += 1
                return taken
            except (OSError, ValueError, KeyError):  # a keeper it cannot read: none taken
                return 0

    def ensure(self) -> None:
        """A keeper that died under this agent is started again with every read end."""
        with self._lock:
            self._reap()
            if self.ends and keeper_pid(self.state_dir) != self._told:
                self._ask({"op": "list"})

    # -- the connection ---------------------------------------------------------------------
    def _reap(self) -> None:
        for pid in list(self._started):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._started.remove(pid)

    def _start(self) -> None:
        self._reap()
        env = {k: v for k, v in os.environ.items() if k != "VIGIL_CRASH_AT"}
        env["VIGIL_LOG_KEEPER"] = str(self.state_dir)
        env["PYTHONPATH"] = ROOT  # posix_spawn keeps this process's cwd: -m finds it here
        logs = self.state_dir / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        out = os.open(logs / "logkeeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:  # posix_spawn: no Popen handle to outlive (the keeper outlives this process)
            self._started.append(os.posix_spawn(
                sys.executable, [sys.executable, "-S", "-m", "runners.keepers.logkeeper",
                                 str(self.state_dir)], env,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, out, 2)],
                setsid=True))
        finally:
            os.close(out)

    def _connect(self, start: bool) -> tuple[socket.socket, int] | None:
        """A connection to the keeper (started if none runs and `start`) and its pid."""
        path = str(self.state_dir / KEEPER_SOCKET)
        deadline = time.monotonic() + START_BOUND
        started = False
        while True:
            pid = keeper_pid(self.state_dir)
            if pid is not None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    s.connect(path)
                    return s, pid
                except OSError:
                    s.close()
            if not start:
                return None
            if not started and pid is None:
                self._start()
                started = True
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"the log keeper did not answer on {path}")
            time.sleep(0.005)

    def _ask(self, request: dict, fds: list[int] = (), *, start: bool = True,  # type: ignore[assignment]
             maxfds: int = 0) -> tuple[dict, list[int]] | None:
        """One request (the caller holds the lock). A keeper this process has not told
        every read end it holds is told them first (it is new: the one told died)."""
        for tried in range(2):
            got_conn = self._connect(start)
            if got_conn is None:
                return None
            conn, pid = got_conn
            try:
                with conn:
                    if pid != self._told:
                        self._put_all(conn)
                        self._told = pid
                    socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
                    data, got, _, _ = socket.recv_fds(conn, MAX_MESSAGE, max(1, maxfds))
                if not data:
                    raise ConnectionResetError("the log keeper closed the connection")
            except OSError:
                self._told = None
                if tried:
                    raise
                continue
            for fd in got:
                os.set_inheritable(fd, False)  # SCM_RIGHTS gives them without close-on-exec
            reply = json.loads(data)
            if not reply.get("ok"):
                for fd in got:
                    os.close(fd)
                raise OSError(errno.EPROTO, f"the log keeper refused: {reply.get('error')}")
            return reply, got
        return None

    def _put_all(self, conn: socket.socket) -> None:
        for fd, request in self.ends.values():
            socket.send_fds(conn, [json.dumps(request).encode()], [fd])
            socket.recv_fds(conn, MAX_MESSAGE, 1)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
