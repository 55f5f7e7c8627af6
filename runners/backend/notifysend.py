"""Sending a notification: a shell command given the event on its stdin, killed (its whole
session, by pid) past its timeout; or a POST of the event to a webhook with the standard
library's urllib, bounded by the same timeout for the whole try (not per socket read), its
redirects never followed (a 3xx is a failed try). urllib and http.client are imported at
the first POST: an agent with no webhook never loads them."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import tempfile
import threading
from typing import TYPE_CHECKING, Any

from models.states import TryOutcome
from workflows.base.ports import Sent

if TYPE_CHECKING:
    import http.client
    import urllib.error

TAIL = 300  # bytes of a failed command's stderr, or of a refusing webhook's answer, kept


def _tail(data: bytes) -> str:
    text = data[-TAIL:].decode("utf-8", "replace").strip()
    return " ".join(text.split())  # one line in the log


class Notices:
    def run(self, command: str, body: bytes, env: dict[str, str], timeout: float) -> Sent:
        with tempfile.TemporaryFile() as err:
            try:
                # Its own session: a timeout kills the command and everything it started.
                proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=err,
                                        env={**os.environ, **env}, start_new_session=True)
            except OSError as exc:
                return Sent(TryOutcome.failed, None, f"cannot run /bin/sh: {exc.strerror}")
            try:
                proc.communicate(body, timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # ended meanwhile
                proc.wait()
                return Sent(TryOutcome.timeout, None,
                            f"still running after {timeout:g}s: killed (pid {proc.pid})")
            code = proc.returncode
            if code == 0:
                return Sent(TryOutcome.delivered, 0)
            err.seek(0)
            said = _tail(err.read())
            how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
            return Sent(TryOutcome.failed, code, how + (f": {said}" if said else ""))

    def post(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> Sent:
        import http.client
        import urllib.error
        import urllib.request

        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        deadline = _Deadline(timeout)
        # Its own opener: redirects not followed, each socket cut at the try's deadline.
        no_redirect, plain, tls = _handlers()
        opener = urllib.request.build_opener(no_redirect(), plain(deadline), tls(deadline))
        try:
            with opener.open(request, timeout=timeout) as answer:
                status = int(answer.status)
        except urllib.error.HTTPError as exc:
            if deadline.passed:  # a status whose headers were cut short: no answer either
                return Sent(TryOutcome.timeout, None, f"no answer within {timeout:g}s")
            return _refused(exc)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or deadline.passed:
                return Sent(TryOutcome.timeout, None, f"no answer within {timeout:g}s")
            return Sent(TryOutcome.failed, None, f"cannot POST to {url!r}: {reason}")
        finally:
            deadline.cancel()
        if deadline.passed:  # its headers cut short read as ended: what came is not an answer
            return Sent(TryOutcome.timeout, None, f"no answer within {timeout:g}s")
        if 200 <= status < 300:
            return Sent(TryOutcome.delivered, status)
        return Sent(TryOutcome.failed, status, f"HTTP {status}: not a 2xx answer")


def _refused(exc: urllib.error.HTTPError) -> Sent:
    """A non-2xx answer (a 3xx among them: never followed) as a failed try."""
    import http.client

    try:
        said = _tail(exc.read() or b"")
    except (http.client.HTTPException, OSError):
        said = ""  # its body did not come whole before the deadline: the status says enough
    if 300 <= exc.code < 400:
        where = exc.headers.get("Location", "")
        return Sent(TryOutcome.failed, exc.code, f"HTTP {exc.code}: a redirect"
                    + (f" to {_tail(where.encode())}" if where else "") + ", not followed")
    return Sent(TryOutcome.failed, exc.code,
                f"HTTP {exc.code} {exc.reason}" + (f": {said}" if said else ""))


class _Deadline:
    """The whole try's bound: urllib's timeout is per socket operation, so a receiver that
    trickles a byte at a time would hold a try forever; at the deadline every socket of the
    try is shut down (by its descriptor: the blocked read returns at once)."""

    def __init__(self, timeout: float) -> None:
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.passed = False
        self.timer = threading.Timer(timeout, self._cut)
        self.timer.daemon = True
        self.timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if not self.passed:
                return
        _shut(sock)  # connected after the deadline: cut at once

    def _cut(self) -> None:
        with self.lock:
            self.passed = True
            socks = list(self.socks)
        for sock in socks:
            _shut(sock)

    def cancel(self) -> None:
        self.timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        # The plain socket's shutdown, also under TLS: the SSL object is left to its reader.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


def _watched(cls: type[http.client.HTTPConnection], deadline: _Deadline) -> Any:
    def connection(host: str, **kw: Any) -> http.client.HTTPConnection:
        conn = cls(host, **kw)
        plain_connect = conn.connect

        def connect() -> None:
            plain_connect()
            deadline.watch(conn.sock)

        conn.connect = connect  # type: ignore[method-assign]
        return conn

    return connection


@functools.cache
def _handlers() -> tuple[Any, Any, Any]:
    """urllib's handlers of a try (no redirect; HTTP and HTTPS, their sockets cut at the
    deadline), made once at the first POST."""
    import http.client
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *_: Any, **__: Any) -> None:
            return None  # the 3xx is raised as an HTTPError: a failed try

    class Http(urllib.request.HTTPHandler):
        def __init__(self, deadline: _Deadline) -> None:
            super().__init__()
            self.deadline = deadline

        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(_watched(http.client.HTTPConnection, self.deadline), req)

    class Https(urllib.request.HTTPSHandler):
        def __init__(self, deadline: _Deadline) -> None:
            super().__init__()
            self.deadline = deadline

        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(_watched(http.client.HTTPSConnection, self.deadline), req,
                                context=self._context)  # type: ignore[attr-defined]

    return NoRedirect, Http, Https
