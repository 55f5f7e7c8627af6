"""Health check: `GET /` over the instance's unix socket until it answers below 500;
`GET PATH` until 2xx/3xx (http:PATH); a connect accepted (tcp)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from runners.base.deadline import Deadline

POLL_INTERVAL = 0.005  # a refused connect costs microseconds; the switch waits on this
TRY_TIMEOUT = 1.0  # one slow answer must not eat the whole budget


MAX_REPLY = 1 << 20  # bytes of a reply read at most; what is beyond is not waited for


def get_status(socket_path: str, timeout: float, path: str = "/") -> int:
    """One HTTP/1.0 `GET path`: its status code (OSError / ValueError). The whole reply is read
    before closing: closing after the status line left a BrokenPipeError traceback in the
    logs of apps on Python's http.server at every check."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(b"GET " + path.encode("ascii") + b" HTTP/1.0\r\nHost: vigil\r\n"
                  b"Connection: close\r\n\r\n")
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

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool],
              path: str | None = None) -> str | None:
        deadline = Deadline(timeout, TRY_TIMEOUT + POLL_INTERVAL, f"health {socket_path}")
        last: str | None = None  # most telling failure so far
        reached = False  # a connection was ever accepted: the app serves the socket
        while True:
            left = deadline.left()
            if left <= 0:
                return last or silent(socket_path, float(timeout), reached)
            try:
                code = get_status(socket_path, min(TRY_TIMEOUT, left), path or "/")
                if passes(code, path):
                    return None
                last = f"health: {said(code, path)}"
            except (FileNotFoundError, ConnectionRefusedError):
                pass  # not listening yet: keep polling
            except (OSError, ValueError):
                reached = True  # accepted, then reset, timed out or garbage: keep polling
            if not alive():
                return "health: process exited before it answered" + (f" ({last})" if last else "")
            time.sleep(min(POLL_INTERVAL, max(0.0, deadline.left())))

    def probe(self, socket_path: str, timeout: float, path: str | None = None) -> str | None:
        try:
            code = get_status(socket_path, timeout, path or "/")
        except (OSError, ValueError) as exc:
            return f"probe: {_why(exc)}"
        return None if passes(code, path) else f"probe: {said(code, path)}"

    def reach(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        deadline = Deadline(timeout, TRY_TIMEOUT + POLL_INTERVAL, f"connect {socket_path}")
        last = ""
        while True:
            left = deadline.left()
            if left <= 0:
                return f"ready: no connect accepted on {socket_path} within {float(timeout)}s{last}"
            try:
                connect(socket_path, min(TRY_TIMEOUT, left))
                return None
            except OSError as exc:
                last = f" (last: {_why(exc)})"
            if not alive():
                return "ready: process exited before it accepted a connect" + last
            time.sleep(min(POLL_INTERVAL, max(0.0, deadline.left())))

    def knock(self, socket_path: str, timeout: float) -> str | None:
        try:
            connect(socket_path, timeout)
        except OSError as exc:
            return f"probe: connect: {_why(exc)}"
        return None


def connect(socket_path: str, timeout: float) -> None:
    """One connect to the unix socket, closed at once (OSError when refused or too slow)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)


def passes(code: int, path: str | None) -> bool:
    """Plain http (no path) asks below 500, as ever; a path of the app's own asks 2xx/3xx."""
    return code < 500 if path is None else 200 <= code < 400


def said(code: int, path: str | None) -> str:
    return f"status {code}" if path is None else f"GET {path} answered {code}"


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
