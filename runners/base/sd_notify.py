"""systemd's readiness notification (sd_notify), both ends, without a new dependency.

notify(): under `Type=notify` systemd sets $NOTIFY_SOCKET (a path, or `@name`: abstract);
the agent sends `READY=1` once recovered, `STATUS=...` lines and `STOPPING=1`; without it
every call does nothing. bind()/receive(): `vigil agent start` waits for its agent's
READY=1, and each generation on a shared listener has a socket of its own
(runners/backend/readysignal.py); anyone may send to such a name, so each datagram comes
with its sender's pid (SCM_CREDENTIALS)."""

from __future__ import annotations

import logging
import os
import socket
import struct

log = logging.getLogger("vigil.notify")
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def notify(*lines: str) -> bool:
    """Send `lines` as one datagram to $NOTIFY_SOCKET. True when sent; never raises."""
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    if target.startswith("@"):
        address = "\0" + target[1:]  # abstract namespace
    elif target.startswith("/"):
        address = target
    else:
        log.warning("notify unsupported NOTIFY_SOCKET=%r (only unix paths and @abstract)", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall("\n".join(lines).encode())
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        # Nobody listens any more: e.g. the `vigil agent start` that waited for READY=1
        # has returned. Not the agent's concern.
        log.debug("notify unheard socket=%s error=%r", target, exc)
        return False
    except OSError as exc:
        log.warning("notify failed socket=%s error=%r", target, exc)
        return False
    return True


def bind(address: str, *, blocking: bool = True) -> socket.socket:
    """A datagram socket bound at `address` (a path, or "\\0name" in the abstract
    namespace) that learns each sender's pid."""
    flags = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | (0 if blocking else socket.SOCK_NONBLOCK)
    s = socket.socket(socket.AF_UNIX, flags)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        s.bind(address)
    except BaseException:
        s.close()
        raise
    return s


def receive(sock: socket.socket) -> tuple[bytes, int | None]:
    """One datagram off a socket from bind(): its bytes and its sender's pid (None when the
    kernel gave none)."""
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
    pid = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = _UCRED.unpack(payload[:_UCRED.size])[0]
    return data, pid
