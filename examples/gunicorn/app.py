"""A WSGI app for gunicorn behind a listening socket vigil holds (examples/gunicorn/serve).

Answers `GET /` with `gunicorn pid=<worker pid> build=<APP_BUILD or its own sha256
prefix>`; APP_DELAY=<sec> delays every answer (to see requests queue during a deploy)."""

import hashlib
import os
import time

with open(__file__, "rb") as _f:
    BUILD = os.environ.get("APP_BUILD") or hashlib.sha256(_f.read()).hexdigest()[:12]
DELAY = float(os.environ.get("APP_DELAY") or 0)


def app(environ, start_response):
    if DELAY:
        time.sleep(DELAY)
    body = f"gunicorn pid={os.getpid()} build={BUILD}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
