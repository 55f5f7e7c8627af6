"""An ASGI app for hypercorn behind a listening socket vigil holds (examples/hypercorn/serve).

Answers every request with `hypercorn pid=<pid> build=<its own sha256 prefix>`."""

import hashlib
import os

with open(__file__, "rb") as _f:
    BUILD = os.environ.get("APP_BUILD") or hashlib.sha256(_f.read()).hexdigest()[:12]


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = f"{SERVER} pid={os.getpid()} build={BUILD}\n".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


SERVER = os.environ.get("APP_SERVER", "hypercorn")
