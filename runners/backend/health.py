"""Health check: `GET /` over the instance's unix socket until it answers below 500."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from runners.base.deadline import Deadline

POLL_INTERVAL = 0.005  # a refused connect costs microseconds; the switch waits on this
TRY_TIMEOUT = 1.0  # one slow answer must not eat the whole budget


def get_status(socket_path: str, timeout: float) -> int:
    """One HTTP/1.0 `GET /`; returns the status code. Raises OSError / ValueError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(b"GET / HTTP/1.0\r\nHost: vigil\r\nConnection: close\r\n\r\n")
        buf = b""
        while b"\r\n" not in buf and len(buf) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    parts = buf.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError(f"bad status line {buf[:40]!r}")
    return int(parts[1])


class HttpHealth:
    """HealthPort: poll every ~5 ms until status < 500, a timeout, or the process exits."""

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        deadline = Deadline(timeout, TRY_TIMEOUT + POLL_INTERVAL, f"health {socket_path}")
        last: str | None = None  # most telling failure so far
        while True:
            left = deadline.left()
            if left <= 0:
                return last or f"health: no answer on {socket_path} within {float(timeout)}s"
            try:
                code = get_status(socket_path, min(TRY_TIMEOUT, left))
                if code < 500:
                    return None
                last = f"health: status {code}"
            except (OSError, ValueError):
                pass  # not listening yet, reset, or garbage: keep polling
            if not alive():
                return "health: process exited before it answered" + (f" ({last})" if last else "")
            time.sleep(min(POLL_INTERVAL, max(0.0, deadline.left())))

    def probe(self, socket_path: str, timeout: float) -> str | None:
        try:
            code = get_status(socket_path, timeout)
        except (OSError, ValueError) as exc:
            return f"probe: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
        return None if code < 500 else f"probe: status {code}"
