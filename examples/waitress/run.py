"""waitress on the listening socket vigil holds, and on the generation's own unix socket:

    vigil host add web --build examples/waitress/serve --cwd examples/waitress \\
        --listen http=tcp:127.0.0.1:8080 --ready http

waitress does not read LISTEN_FDS: `serve(sockets=...)` takes the socket vigil holds (fd
3, the first --listen). It sends no READY=1, so readiness is `--ready http`: GET / on
$VIGIL_SOCKET, served by a second `serve` in a thread (one server may not mix TCP and unix
sockets). waitress has no graceful stop:
SIGTERM ends the process at once, so a connection it had accepted and not yet answered is
reset or closed unanswered (at most one per connection in flight at that instant; what is
still queued on the shared socket waits for the next generation). A client that retries an
idempotent request on a reset or an empty answer never sees it.
Run with the Python that has waitress (PYTHON, default python3 on PATH)."""

import os
import socket
import sys
import threading

import waitress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from app import app  # noqa: E402

shared = socket.socket(fileno=3)  # LISTEN_FDS: the first --listen, family and all
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind(os.environ["VIGIL_SOCKET"])
own.listen(128)
threading.Thread(target=waitress.serve, args=(app,), kwargs={"sockets": [own], "threads": 1},
                 daemon=True).start()
waitress.serve(app, sockets=[shared], threads=4)
