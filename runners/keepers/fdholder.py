"""The box's fd holder: a small process of vigil's own that keeps every listening socket
the agent opened, so the socket outlives the agent (kill -9 included) and the restarted
agent gets the very same socket back (same inode), never a second one on the same address.

The agent starts it (own session, like the fence keeper) the first time it opens a
listener, hands it each socket over `<state>/listeners.sock` (SOCK_SEQPACKET, SCM_RIGHTS),
and on start asks it for them again. Every message is one JSON object, with the fds it
carries in the same datagram:

    {"op": "put", "key": K} + [fd]      keep fd as K (replacing what K held)
    {"op": "list"}                      -> {"keys": {K: inode, ...}}
    {"op": "get", "keys": [K, ...]}     -> {"keys": [K found, ...]} + their fds, in order
    {"op": "drop", "keys": [K, ...]}    close them (the host was removed)
    {"op": "keep", "keys": [K, ...]}    close every other one (the store names no other)

It holds the sockets and nothing else: it never accepts on them. It exits once it holds
none and nobody has talked to it for IDLE seconds; while it holds one it sleeps in
select() without a timeout. One per state dir (flock on listeners.lock).

Run as `python -m runners.keepers.fdholder STATE_DIR`.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import cast

from runners.base.doorbell import lock_holder

HOLDER_SOCKET = "listeners.sock"
HOLDER_LOCK = "listeners.lock"
MAX_FDS = 200  # per message (the kernel takes at most 253: SCM_MAX_FD)
MAX_MESSAGE = 1 << 16
IDLE = 5.0  # seconds with nothing held and no request before it exits


def holder_pid(state_dir: Path) -> int | None:
    """The pid of the running holder of this state dir, or None."""
    return lock_holder(state_dir / HOLDER_LOCK)


def _log(msg: str) -> None:
    print(f"ts={time.strftime('%Y-%m-%dT%H:%M:%S')} logger=vigil.fdholder {msg}",
          file=sys.stderr, flush=True)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


class Holder:
    def __init__(self) -> None:
        self.held: dict[str, socket.socket] = {}

    def handle(self, request: dict, fds: list[int]) -> tuple[dict, list[int]]:
        op = request.get("op")
        if op == "put":
            key = str(request["key"])
            if len(fds) != 1:
                raise ValueError(f"put {key}: expected one fd, got {len(fds)}")
            old = self.held.pop(key, None)
            if old is not None:
                old.close()
            self.held[key] = socket.socket(fileno=fds.pop())
            _log(f"put key={key} inode={_inode(self.held[key].fileno())}")
            return {"ok": True}, []
        if op == "list":
            return {"ok": True, "keys": {k: _inode(s.fileno()) for k, s in self.held.items()}}, []
        if op == "get":
            found = [k for k in request.get("keys", [])[:MAX_FDS] if k in self.held]
            return {"ok": True, "keys": found}, [self.held[k].fileno() for k in found]
        if op in ("drop", "keep"):
            named = set(request.get("keys", []))
            doomed = [k for k in self.held if (k in named) == (op == "drop")]
            for k in doomed:
                self.held.pop(k).close()
                _log(f"closed key={k}")
            return {"ok": True, "closed": doomed}, []
        raise ValueError(f"unknown op {op!r}")


def run(state_dir: Path) -> int:
    lock = open(state_dir / HOLDER_LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another holder keeps this box's sockets
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    path = state_dir / HOLDER_SOCKET
    try:
        path.unlink()  # a dead holder's (the lock says none runs)
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
    holder = Holder()
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    last = time.monotonic()
    while True:
        timeout = None if holder.held else max(0.0, IDLE - (time.monotonic() - last))
        ready = sel.select(timeout)
        if not ready and not holder.held and len(sel.get_map()) == 1:
            _log("nothing held: exiting")
            return 0
        for key, _ in ready:
            last = time.monotonic()
            conn = key.fileobj
            if conn is server:
                client, _ = server.accept()
                sel.register(client, selectors.EVENT_READ)
                continue
            conn = cast(socket.socket, conn)  # every other registered object is one
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                sel.unregister(conn)
                conn.close()
                continue
            try:
                reply, out = holder.handle(json.loads(data), fds)
            except (ValueError, KeyError, TypeError) as exc:
                reply, out = {"ok": False, "error": str(exc)}, []
            finally:
                for fd in fds:  # what a request carried and the holder did not keep
                    os.close(fd)
            try:
                socket.send_fds(conn, [json.dumps(reply).encode()], out)
            except OSError:
                sel.unregister(conn)
                conn.close()


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
