"""A WSGI app for waitress behind a listening socket vigil holds (examples/waitress/serve).

Answers every request with `waitress pid=<pid> build=<its own sha256 prefix>`."""

import hashlib
import os

with open(__file__, "rb") as _f:
    BUILD = os.environ.get("APP_BUILD") or hashlib.sha256(_f.read()).hexdigest()[:12]


def app(environ, start_response):
    body = f"waitress pid={os.getpid()} build={BUILD}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
