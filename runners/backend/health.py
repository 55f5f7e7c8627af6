"""Health check: `GET /` over the instance's unix socket until it answers below 500."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from runners.base.deadline import Deadline

POLL_INTERVAL = 0.005  # a refused connect costs microseconds; the switch waits on this
TRY_TIMEOUT = 1.0  # one slow answer must not eat the whole budget


MAX_REPLY = 1 << 20  # bytes of a reply read at most; what is beyond is not waited for


def get_status(socket_path: str, timeout: float) -> int:
    """One HTTP/1.0 `GET /`: its status code (OSError / ValueError). The whole reply is read
    before closing: closing after the status line left a BrokenPipeError traceback in the
    logs of apps on Python's http.server at every check."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(b"GET / HTTP/1.0\r\nHost: vigil\r\nConnection: close\r\n\r\n")
        buf = b""
        while len(buf) < MAX_REPLY and not _complete(buf):
            s.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    parts = buf.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError(f"bad status line {buf[:40]!r}")
    return int(parts[1])


def _complete(buf: bytes) -> bool:
    """The headers are in and so is the body their Content-Length announces (without one,
    the reply ends when the app closes: Connection: close)."""
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False


def silent(socket_path: str, timeout: float, reached: bool) -> str:
    """Why a generation never answered: an app that never served the socket vigil gave it
    is told so, and how (the commonest cause with a server nobody wrote for vigil)."""
    if reached:
        return f"health: no answer on {socket_path} within {timeout}s"
    return (f"health: nothing accepted on {socket_path} within {timeout}s: the app must serve "
            "HTTP on the unix socket named in its $VIGIL_SOCKET (--arg does not expand it: "
            "use a wrapper script that passes \"$VIGIL_SOCKET\" to the server), or listen "
            "on a port vigil holds (--listen tcp:HOST:PORT)")


class HttpHealth:
    """HealthPort: poll every ~5 ms until status < 500, a timeout, or the process exits."""

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        deadline = Deadline(timeout, TRY_TIMEOUT + POLL_INTERVAL, f"health {socket_path}")
        last: str | None = None  # most telling failure so far
        reached = False  # a connection was ever accepted: the app serves the socket
        while True:
            left = deadline.left()
            if left <= 0:
                return last or silent(socket_path, float(timeout), reached)
            try:
                code = get_status(socket_path, min(TRY_TIMEOUT, left))
                if code < 500:
                    return None
                last = f"health: status {code}"
            except (FileNotFoundError, ConnectionRefusedError):
                pass  # not listening yet: keep polling
            except (OSError, ValueError):
                reached = True  # accepted, then reset, timed out or garbage: keep polling
            if not alive():
                return "health: process exited before it answered" + (f" ({last})" if last else "")
            time.sleep(min(POLL_INTERVAL, max(0.0, deadline.left())))

    def probe(self, socket_path: str, timeout: float) -> str | None:
        try:
            code = get_status(socket_path, timeout)
        except (OSError, ValueError) as exc:
            return f"probe: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
        return None if code < 500 else f"probe: status {code}"
