#!/usr/bin/env python3
"""hello: a tiny HTTP app on the unix socket named by $VIGIL_SOCKET.

Env: HELLO_BUILD (build label), HELLO_FAIL_HEALTH=1 (answer 500), HELLO_DELAY=<sec> (per request).
`hello.py --fd N` serves an inherited listening unix socket instead (a supervisor such as
circus owns it and passes it to every process; bench/downtime.py uses that).
Socket activation (vigil `--listen`, systemd): with LISTEN_FDS and LISTEN_PID = its pid it
also serves the inherited fds 3, 4, ... (TCP or unix), and says READY=1 on $NOTIFY_SOCKET
once it serves (HELLO_NEVER_READY=1: never, for tests).
SIGTERM: close the listener, finish in-flight requests, exit 0.
"""

import hashlib
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

STOP = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: STOP.set())  # first, so an early TERM still drains

with open(__file__, "rb") as _f:
    BUILD = os.environ.get("HELLO_BUILD") or hashlib.sha256(_f.read()).hexdigest()[:12]
FAIL = os.environ.get("HELLO_FAIL_HEALTH") == "1"
DELAY = float(os.environ.get("HELLO_DELAY") or 0)

_inflight = 0
_idle = threading.Condition()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        if DELAY:
            time.sleep(DELAY)
        code = 500 if FAIL else 200
        body = f"hello pid={os.getpid()} build={BUILD}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:  # unix peers have no (host, port)
        return "unix"

    def log_message(self, fmt: str, *args: object) -> None:
        pass  # quiet: the agent captures stderr and benchmarks send many requests


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 1024  # listen backlog: absorbs bursts during a swap

    def process_request_thread(self, request, client_address):  # type: ignore[no-untyped-def]
        global _inflight
        try:
            super().process_request_thread(request, client_address)
        finally:
            with _idle:
                _inflight -= 1
                _idle.notify_all()

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        global _inflight
        with _idle:
            _inflight += 1
        super().process_request(request, client_address)


def serve_inherited(fd: int) -> int:
    """Serve a listener someone else owns: on SIGTERM stop accepting and finish in-flight
    requests; the listener (and whatever is queued on it) stays with its owner."""
    srv = Server(None, Handler, bind_and_activate=False)  # type: ignore[arg-type]
    srv.socket.close()
    srv.socket = socket.socket(fileno=fd)
    loop = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    loop.start()
    while not STOP.wait(0.5):
        pass
    srv.shutdown()
    with _idle:
        _idle.wait_for(lambda: _inflight == 0)
    return 0


def inherited() -> list[int]:
    """The sd_listen_fds protocol: fds 3.. when LISTEN_PID names this very process."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    return list(range(3, 3 + int(os.environ.get("LISTEN_FDS") or 0)))


def notify(state: str) -> None:
    """sd_notify: one datagram to $NOTIFY_SOCKET (nothing when it is not set)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or os.environ.get("HELLO_NEVER_READY") == "1":
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect("\0" + path[1:] if path.startswith("@") else path)
            s.sendall(state.encode())
        except OSError:
            pass


def serve_shared(fds: list[int]) -> list[Server]:
    """Serve listeners this process shares with the next generation: on SIGTERM it stops
    accepting and what is queued stays on the listener, for the next one."""
    servers = []
    for fd in fds:
        srv = Server(None, Handler, bind_and_activate=False)  # type: ignore[arg-type]
        srv.socket.close()
        srv.socket = socket.socket(fileno=fd)
        srv.socket.setblocking(False)  # another process may take the connection first
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        servers.append(srv)
    return servers


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--fd":
        return serve_inherited(int(sys.argv[2]))
    shared = serve_shared(inherited())
    path = os.environ.get("VIGIL_SOCKET")
    if not path and shared:
        notify("READY=1\nSTATUS=serving")
        while not STOP.wait(0.5):
            pass
        notify("STOPPING=1")
        for srv in shared:
            srv.shutdown()
        with _idle:
            _idle.wait_for(lambda: _inflight == 0)
        return 0
    if not path:
        print("hello: VIGIL_SOCKET is not set", file=sys.stderr)
        return 2
    try:
        os.unlink(path)  # stale socket from an earlier run
    except FileNotFoundError:
        pass
    srv = Server(path, Handler)
    ino = os.stat(path).st_ino
    loop = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    loop.start()
    notify("READY=1\nSTATUS=serving")
    while not STOP.wait(0.5):
        pass
    notify("STOPPING=1")
    for shared_srv in shared:
        shared_srv.shutdown()
    srv.shutdown()  # stop the accept loop
    # Connections the kernel already queued were sent to us: serve them rather than reset them.
    srv.socket.setblocking(False)
    while True:
        try:
            req, addr = srv.socket.accept()
        except (BlockingIOError, OSError):
            break
        req.setblocking(True)
        srv.process_request(req, addr)
    srv.server_close()  # listener closed: no new connections
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass
    with _idle:
        _idle.wait_for(lambda: _inflight == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
