"""The box's fd holder: keeps every listening socket the agent opened, so it outlives the
agent (kill -9 included) and the restarted agent gets the same socket (inode) back.

The agent starts it (own session) at its first listener and talks over
`<state>/listeners.sock` (SOCK_SEQPACKET, SCM_RIGHTS):

    {"op": "put", "key": K} + [fd]      keep fd as K (replacing what K held)
    {"op": "list"}                      -> {"keys": {K: inode, ...}}
    {"op": "get", "keys": [K, ...]}     -> {"keys": [K found, ...]} + their fds, in order
    {"op": "drop", "keys": [K, ...]}    close them (the host was removed)
    {"op": "keep", "keys": [K, ...]}    close every other one (the store names no other)

It never accepts on them; it exits once it holds none and is idle IDLE seconds. One per
state dir (flock on listeners.lock); `python -m runners.keepers.fdholder STATE_DIR`. The
loop and request rules are runners/keepers/wire.py's: a `put` keeps only a listening
socket, and replaces what the key held only once the new one is taken.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from runners.base.doorbell import lock_holder
from runners.keepers.wire import MAX_FDS, BadRequest, Loop, keys_of, log_line, serve, text_of

HOLDER_SOCKET = "listeners.sock"
HOLDER_LOCK = "listeners.lock"


def holder_pid(state_dir: Path) -> int | None:
    """The pid of the running holder of this state dir, or None."""
    return lock_holder(state_dir / HOLDER_LOCK)


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def listening(fd: int) -> socket.socket:
    """`fd` as a socket, if it is a listening one; BadRequest otherwise (fd left open)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError as exc:
        raise BadRequest(f"the fd is not a socket ({exc.strerror})") from None
    try:
        accepting = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        accepting = 0
    if not accepting:
        s.close()
        raise BadRequest("the fd is not a listening socket")
    return s


class Holder:
    def __init__(self) -> None:
        self.held: dict[str, socket.socket] = {}

    def handle(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = request["op"]
        if op == "put":
            key = text_of(request, "key")
            if len(fds) != 1:
                raise BadRequest(f"put {key}: expected one fd, got {len(fds)}")
            new = listening(fds[0])  # checked before what the key held is let go
            old = self.held.pop(key, None)
            if old is not None:
                old.close()
            self.held[key] = new
            log_line("fdholder", f"put key={key} inode={_inode(new.fileno())}")
            return {"ok": True}, []
        if op == "list":
            return {"ok": True, "keys": {k: _inode(s.fileno()) for k, s in self.held.items()}}, []
        if op == "get":
            found = [k for k in keys_of(request, MAX_FDS) if k in self.held]
            return {"ok": True, "keys": found}, [self.held[k].fileno() for k in found]
        if op in ("drop", "keep"):
            named = set(keys_of(request))
            doomed = [k for k in self.held if (k in named) == (op == "drop")]
            for k in doomed:
                self.held.pop(k).close()
                log_line("fdholder", f"closed key={k}")
            return {"ok": True, "closed": doomed}, []
        raise BadRequest(f"unknown op {op!r}")


def run(state_dir: Path) -> int:
    def setup(_loop: Loop):  # type: ignore[no-untyped-def]
        holder = Holder()
        return holder.handle, lambda: bool(holder.held)

    return serve(state_dir, HOLDER_LOCK, HOLDER_SOCKET, "fdholder", setup)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
