"""systemd readiness notification (sd_notify), without a new dependency.

When systemd starts the agent with `Type=notify`, it sets $NOTIFY_SOCKET to a unix datagram
socket (a path, or `@name` in the abstract namespace). The agent sends `READY=1` once its
recovery is done, `STATUS=...` lines a person sees in `systemctl status`, and `STOPPING=1`
when it shuts down. Without $NOTIFY_SOCKET every call does nothing."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("vigil.notify")


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
