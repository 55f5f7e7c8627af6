"""`vigil ui`: a read-only status page served from the store by a process of its own, never
the agent's: every host and its generation (what `vigil top` shows), every open obligation
with its age and what it waits for, the last hour's deploys and rollouts (waves, halts,
reverts) and each host's restarts over that hour. The page (ui.html, ui.js, ui.css beside
this file, nothing fetched from elsewhere) asks /api/state every 2 s and redraws in place.

Served by waitress: a small, well-kept, pure-Python WSGI server with a thread pool (a slow
browser holds no other), so no HTTP is written here, only the routes. Loopback (or a
unix socket, 0600) by default; any other address requires --token-file, whose token each
data request carries (`Authorization: Bearer TOKEN`; the page sends what its URL's `?token=`
gave it, then drops it from the address bar), compared in constant time; the page, its
script and its style hold no data and need none. Nothing on the page is an env value or a
credential: the rows are `vigil top`'s cells, the events' details are cut to ids, builds,
modes, waves and reasons."""

from __future__ import annotations

import hmac
import ipaddress
import json
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import click

from models.errors import BadInput
from runners.cli.common import Env

DEFAULT_LISTEN = "127.0.0.1:8377"
WINDOW = timedelta(hours=1)  # the timeline's and the restart chart's span
BUCKETS = 30  # bars of the restart chart: two minutes each
EVENTS = 20
HERE = Path(__file__).parent
FILES = {"/": ("ui.html", "text/html; charset=utf-8"),
         "/ui.js": ("ui.js", "text/javascript; charset=utf-8"),
         "/ui.css": ("ui.css", "text/css; charset=utf-8")}
HEADERS = [("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
           ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
           ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'")]
Start = Callable[[str, list[tuple[str, str]]], Any]


class Page:
    """The WSGI app: the page, its script and /api/state, behind the token if one is set."""

    def __init__(self, env: Env, token: str | None) -> None:
        from runners.cli.topview import Sampler

        self.env, self.token = env, token
        self.store = env.store()
        self.sampler = Sampler()
        self.lock = threading.Lock()  # one sampler: a CPU % is over the time between reads
        self.files = {route: ((HERE / name).read_bytes(), kind)
                      for route, (name, kind) in FILES.items()}

    def __call__(self, environ: dict[str, Any], start: Start) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _reply(start, "405 Method Not Allowed", b"read-only\n", "text/plain")
        path = environ.get("PATH_INFO") or "/"
        if path in self.files:  # the page and its script hold no data: no token needed
            body, kind = self.files[path]
            return _reply(start, "200 OK", body, kind)
        if self.token is not None and not self.allowed(environ):
            return _reply(start, "401 Unauthorized", b"a valid token is required\n",
                          "text/plain")
        if path == "/api/state":
            body = json.dumps(self.state(), default=str).encode()
            return _reply(start, "200 OK", body, "application/json")
        return _reply(start, "404 Not Found", b"not found\n", "text/plain")

    def allowed(self, environ: dict[str, Any]) -> bool:
        given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").strip()
        if not given:
            given = parse_qs(environ.get("QUERY_STRING", "")).get("token", [""])[0]
        return hmac.compare_digest(given.encode(), (self.token or "").encode())

    def state(self) -> dict[str, Any]:
        from models.store import utcnow
        from runners.cli.topview import COLUMNS, cells, read
        from workflows.config.timeline import (
            SHOWN,
            open_obligations,
            restarts_over_time,
            timeline,
        )

        with self.lock:
            frame = read(self.store, self.env.state_dir, self.env.db, 0, None, EVENTS,
                         self.sampler)
        now = utcnow()
        since = now - WINDOW
        events, restarts, owed = self.store.read(lambda s: (
            timeline(s, since), restarts_over_time(s, since, now, BUCKETS), open_obligations(s)))
        return {"now": now.isoformat() + "Z", "agent": frame.agent, "halted": frame.halted,
                "columns": COLUMNS, "hosts": [cells(r, False) for r in frame.rows],
                "total": frame.total, "obligations": owed, "timeline": events,
                "restarts": {"since": since.isoformat() + "Z", "buckets": BUCKETS,
                             "hosts": restarts},
                "events": [{**e, "detail": {k: e["detail"][k] for k in SHOWN
                                            if k in e["detail"]}} for e in frame.events]}


def _reply(start: Start, status: str, body: bytes, kind: str) -> list[bytes]:
    start(status, [("Content-Type", kind), ("Content-Length", str(len(body))), *HEADERS])
    return [body]


def parse_listen(listen: str, token_file: str | None) -> dict[str, Any]:
    """--listen as waitress's arguments; a non-loopback address without a token refused."""
    if listen.startswith("unix:"):
        return {"unix_socket": listen.removeprefix("unix:"), "unix_socket_perms": "600"}
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
        if not 0 <= number <= 65535:
            raise ValueError
    except ValueError:
        raise BadInput(f"--listen {listen!r} is not HOST:PORT or unix:PATH",
                       f"give e.g. --listen {DEFAULT_LISTEN}") from None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise BadInput(f"--listen {listen!r}: {host!r} is not an IP address",
                       f"give e.g. --listen {DEFAULT_LISTEN}") from None
    if not loopback and token_file is None:
        raise BadInput(f"--listen {listen} is not a loopback address: the page would be "
                       "open to anyone who reaches it", "pass --token-file FILE (a secret "
                       "of at least 16 characters), or listen on 127.0.0.1")
    return {"host": host, "port": number}


def read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise BadInput(f"--token-file {token_file}: {exc.strerror}",
                       "give a readable file holding the token") from None
    if len(token) < 16:
        raise BadInput(f"--token-file {token_file} holds a token of {len(token)} characters",
                       "use at least 16 (e.g. `openssl rand -hex 16 > FILE`)")
    return token


@click.command()
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
              help="HOST:PORT (port 0: any free one) or unix:PATH to serve the page on.")
@click.option("--token-file", default=None,
              help="A file holding the token every request must carry (required off loopback).")
@click.pass_obj
def ui(env: Env, listen: str, token_file: str | None) -> None:
    """A read-only status page of hosts, open obligations, deploys and rollouts and
    restarts, live in a browser (served from the store; the agent need not run)."""
    where = parse_listen(listen, token_file)
    token = read_token(token_file)
    from waitress import create_server

    server: Any = create_server(Page(env, token), threads=4, ident="vigil", **where)
    url = (f"unix:{where['unix_socket']}" if "unix_socket" in where else
           f"http://{_host(where['host'])}:{server.effective_port}/")
    click.echo(f"vigil ui: serving {env.state_dir} on {url} (Ctrl-C to end)")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
