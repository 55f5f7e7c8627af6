"""uvicorn on the listening socket vigil holds, and on the generation's own unix socket:

    vigil host add web --build examples/uvicorn/serve --cwd examples/uvicorn \\
        --listen http=tcp:127.0.0.1:8080 --ready http

Not `uvicorn --fd 3`: that treats the inherited socket as a unix one whatever it is, so
a TCP socket never gets TCP_NODELAY and keep-alive answers wait on Nagle's algorithm.
Handing uvicorn the socket object itself (`Server.run(sockets=...)`) keeps its family.
uvicorn sends no READY=1: readiness is `--ready http`, GET / on $VIGIL_SOCKET, bound here
beside it. SIGTERM is uvicorn's graceful stop: it answers what it accepted, then exits.
Run with the Python that has uvicorn (PYTHON, default python3 on PATH)."""

import os
import socket
import sys

import uvicorn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
shared = socket.socket(fileno=3)  # LISTEN_FDS: the first --listen, family and all
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind(os.environ["VIGIL_SOCKET"])
own.listen(128)
os.environ.setdefault("APP_SERVER", "uvicorn")
config = uvicorn.Config("app:app", log_level="warning", timeout_graceful_shutdown=10)
uvicorn.Server(config).run(sockets=[shared, own])
