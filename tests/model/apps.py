"""Tiny app builds for in-process tests that start many processes: the interpreter is run
directly (`#!<this python> -S`, no PATH shim, no site), so a start costs a few tens of ms.

`good` answers 200 on $VIGIL_SOCKET and exits 0 on SIGTERM; `stubborn` is `good` but
ignores SIGTERM (ended by SIGKILL after its drain); `bad_500` answers 500 forever
(fails health by its timeout); `hang` accepts connections and never answers (a health
check that hangs); `bad_exit` exits 3 at once (fails health as soon as the
check sees it gone). A `label` makes another build: same behaviour, another digest."""

from __future__ import annotations

import sys
from pathlib import Path

_SERVE = '''
import os, signal, socket
path = os.environ["VIGIL_SOCKET"]
try:
    os.unlink(path)
except FileNotFoundError:
    pass
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(64)
ino = os.stat(path).st_ino


def bye(*_):
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass
    os._exit(0)


signal.signal(signal.SIGTERM, %(on_term)s)
held = []
while True:
    c, _ = srv.accept()
    if %(hang)s:  # read the request, never answer, keep the connection open
        held.append(c)
        continue
    try:
        c.recv(4096)
        c.sendall(b"HTTP/1.0 %(status)s\\r\\nContent-Length: 3\\r\\nConnection: close\\r\\n\\r\\nok\\n")
    except OSError:
        pass
    finally:
        c.close()
'''

SOURCES = {
    "good": _SERVE % {"status": "200 OK", "hang": False, "on_term": "bye"},
    "stubborn": _SERVE % {"status": "200 OK", "hang": False, "on_term": "signal.SIG_IGN"},
    "bad_500": _SERVE % {"status": "500 Internal Server Error", "hang": False, "on_term": "bye"},
    "hang": _SERVE % {"status": "200 OK", "hang": True, "on_term": "bye"},
    "bad_exit": "import sys\nsys.exit(3)\n",
}


def write_app(directory: Path, kind: str, label: str) -> Path:
    """Write an executable build of `kind` named by `label` (the label is in its bytes)."""
    path = directory / f"{label}.py"
    path.write_text(f"#!{sys.executable} -S\n# build {label}\n{SOURCES[kind]}")
    path.chmod(0o755)
    return path
