"""The keepers' wire, written once: the request loop of the fd holder and the log keeper
(lock file, bind, select, recv_fds/send_fds, JSON); the agent's side of it (connect,
start one when none runs, ask with a bound, hand everything back to a new one). Messages
are one JSON object per SOCK_SEQPACKET datagram with its fds (SCM_RIGHTS); a reply is
`{"ok": true, ...}` or `{"ok": false, "error": why}`, the format older helpers speak.

Bounds (issue 20): a helper that does not answer within BOUND seconds (START_BOUND for a
new one) is treated as dead: SIGKILLed by pid and start time and replaced, but only when
the agent holds a copy of everything it holds; otherwise it is left running and the
exchange fails saying so. A helper serves only its own uid (SO_PEERCRED) and answers a bad
request with an error, nothing held touched. Both helpers take `{"op": "leave"}`
(`vigil shutdown`): exit as soon as nothing is held and no client is connected.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import selectors
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from runners.base.doorbell import take_lock

START_BOUND = 10.0  # seconds a new helper has to answer (a loaded box starts Python slowly)
SEND_BOUND = 1.0  # seconds a helper waits to send a reply before it drops that client
MAX_FDS = 200  # per message (the kernel takes at most 253: SCM_MAX_FD)
MAX_MESSAGE = 1 << 16
MAX_CLIENTS = 64  # connections a helper serves at once (the agent uses one)
IDLE = 5.0  # seconds with nothing held and no client before a helper exits
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
log = logging.getLogger("vigil.keepers")
Handler = Callable[[dict[str, Any], list[int]], tuple[dict[str, Any], list[int]]]


class BadRequest(ValueError):
    """A request a helper refuses (answered with the reason; nothing held is touched)."""


def log_line(name: str, msg: str) -> None:
    print(f"ts={time.strftime('%Y-%m-%dT%H:%M:%S')} logger=vigil.{name} {msg}",
          file=sys.stderr, flush=True)


# -- the helper's side -----------------------------------------------------------------------


def claim(lock_path: Path) -> IO[str] | None:
    """The helper's lock (one per state dir), its pid written in it; None: another runs."""
    lock = open(lock_path, "a+")
    if not take_lock(lock):
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def bind(path: Path) -> socket.socket:
    """The helper's socket, owner-only (a dead helper's file is replaced: the lock says
    none runs)."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    server.listen(16)
    return server


def parse(data: bytes) -> dict[str, Any]:
    """One request: a JSON object with a string `op`. BadRequest otherwise."""
    try:
        request = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"not JSON: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
        raise BadRequest("not a request: a JSON object with a string 'op' is expected")
    return request


def keys_of(request: dict[str, Any], limit: int | None = None) -> list[str]:
    keys = request.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BadRequest("'keys' must be a list of strings")
    return keys if limit is None else keys[:limit]


def text_of(request: dict[str, Any], field: str) -> str:
    value = request.get(field)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{field!r} must be a non-empty string")
    return value


def same_uid(conn: socket.socket) -> bool:
    _, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid == os.getuid()


class Loop:
    """A helper's select loop: its server socket, its clients, and any other fd it reads
    (the log keeper's pipes), each with its own callback."""

    def __init__(self, server: socket.socket, name: str) -> None:
        self.server, self.name = server, name
        self.sel = selectors.DefaultSelector()
        self.sel.register(server, selectors.EVENT_READ)
        self.clients: set[socket.socket] = set()
        self.quiet: set[socket.socket] = set()  # clients that never ask (a standby's mirror)
        self.serving: socket.socket | None = None  # the client whose request is handled now
        self.leaving = False  # asked to leave (shutdown): exit once idle, not IDLE seconds after

    def watch(self, fd: int, on_ready: Callable[[], None]) -> None:
        self.sel.register(fd, selectors.EVENT_READ, on_ready)

    def unwatch(self, fd: int) -> None:
        self.sel.unregister(fd)

    def run(self, handle: Handler, holding: Callable[[], bool]) -> int:
        """Serve until nothing is held, no client is connected and no request came for
        IDLE seconds (none once asked to `leave`)."""
        last = time.monotonic()
        while True:
            idle = not holding() and not self.clients - self.quiet
            wait = 0.0 if self.leaving else max(0.0, IDLE - (time.monotonic() - last))
            ready = self.sel.select(wait if idle else None)
            if not ready and not holding() and not self.clients - self.quiet:
                log_line(self.name, "nothing held, asked to leave: exiting" if self.leaving
                         else "nothing held: exiting")
                return 0
            for key, _ in ready:
                if key.data is not None:
                    key.data()
                    continue
                last = time.monotonic()
                if key.fileobj is self.server:
                    self._accept()
                else:
                    self._serve(key.fileobj, handle)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            client, _ = self.server.accept()
        except OSError:  # out of fds, say: the client retries
            return
        if len(self.clients) >= MAX_CLIENTS or not same_uid(client):
            log_line(self.name, "refused a connection (another uid, or too many clients)")
            client.close()
            return
        client.settimeout(SEND_BOUND)  # a client that never reads its replies is dropped
        self.sel.register(client, selectors.EVENT_READ)
        self.clients.add(client)

    def drop(self, conn: socket.socket) -> None:
        if conn not in self.clients:
            return  # dropped already
        self.sel.unregister(conn)
        self.clients.discard(conn)
        self.quiet.discard(conn)
        conn.close()

    def _serve(self, conn: socket.socket, handle: Handler) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            self.drop(conn)
            return
        try:
            request = parse(data)
            # `leave` (shutdown, once nothing is left to hold): exit when idle; any other
            # request (a new agent) keeps the helper as before.
            self.leaving = request.get("op") == "leave"
            self.serving = conn
            reply, out = ({"ok": True}, []) if self.leaving else handle(request, fds)
        except Exception as exc:  # one bad request never ends the helper
            reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
        finally:
            self.serving = None
            for fd in fds:  # what a request carried and the helper did not keep
                os.close(fd)
        if conn not in self.clients:
            return  # dropped while its request was handled
        try:
            socket.send_fds(conn, [json.dumps(reply).encode()], out)
        except OSError:
            self.drop(conn)


def standby_of(lock_path: Path) -> Path:
    return lock_path.with_suffix(".standby")


def serve(state_dir: Path, lock_name: str, socket_name: str, name: str,
          setup: Callable[[Loop], tuple[Handler, Callable[[], bool]]],
          follow: Callable[[IO[str]], None] | None = None) -> int:
    """A helper's whole life: its lock, its socket, its loop (`setup` makes the handler and
    says whether anything is held). With `--standby` (argv) it first waits, already
    started, for the running one's lock: the moment that one dies it takes over, so the
    agent's re-hand does not wait for a Python to start (one standby per kind). `follow`:
    how a standby waits (the log keeper's keeps copies of the running one's pipes); it
    returns once it holds the lock file it is given."""
    if "--standby" in sys.argv[2:]:
        standby = claim(standby_of(state_dir / lock_name))
        if standby is None:
            return 0  # another standby waits already
        taken = open(state_dir / lock_name, "a+")
        if follow is not None:
            follow(taken)
        else:
            fcntl.flock(taken, fcntl.LOCK_EX)  # blocks until the running helper is gone
        taken.seek(0)
        taken.truncate()
        taken.write(f"{os.getpid()}\n")
        taken.flush()
        standby.close()
        lock: IO[str] | None = taken
    else:
        lock = claim(state_dir / lock_name)
    if lock is None:
        return 0  # another helper of this kind keeps this state dir's things
    loop = Loop(bind(state_dir / socket_name), name)
    log_line(name, f"started pid={os.getpid()} state_dir={state_dir}")
    handle, holding = setup(loop)
    return loop.run(handle, holding)


# -- the agent's side ------------------------------------------------------------------------
