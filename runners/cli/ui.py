"""`vigil ui`: a status page served from the store by a process of its own: every host and
generation (`vigil top`'s cells), every open obligation with its age and what it waits for,
the last hour's deploys, rollouts and restarts. The page (ui.html, ui.js, ui.css beside
this file, nothing fetched from elsewhere) asks /api/state every 2 s; its restart, stop and
wake buttons POST to the API below with the token the person gives it.

Served by waitress (a pure-Python WSGI server with a thread pool): only the routes are here.
Loopback or a unix socket (0600) by default; any other address requires --token-file, whose
token each data request carries (`Authorization: Bearer`, compared in constant time; the page
takes it from `?token=` and drops it from the address bar). No env value or credential is
shown: events' details are cut to ids, builds, modes, waves and reasons.

The HTTP API under /api/v1 (runners/cli/api.py) answers beside it; its POSTs need a bearer
token always (--token-file's, else the state dir's, printed by --print-token).

Hostile requests: without a token only the Host names of its listen address (and
--allow-host) are answered (421 otherwise: no DNS rebinding). Only the API takes a POST; a
body over MAX_BODY is refused (413) unread; headers must come whole within HEADER_TIME and HEADER_BYTES; idle connections
close after IDLE_TIME; at most CONNECTIONS at once."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import threading
import time
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
HEADER_TIME = 10.0  # seconds a request's headers may take to come whole (waitress has no bound)
HEADER_BYTES = 8192  # a request's line and headers (the page's own are well under 1 KiB)
IDLE_TIME = 10  # seconds an idle connection is kept (the page asks every 2 s)
CONNECTIONS = 32  # open at once (a browser opens about 6)
API_PREFIX = "/api/v1"  # runners/cli/api.py: the HTTP API, beside the page's own /api/state
MAX_BODY = 16384  # bytes of a request's body (an API POST's JSON; waitress refuses more: 413)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
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

    def __init__(self, env: Env, token: str | None, post_token: str) -> None:
        from runners.cli.api import Api
        from runners.cli.topview import Sampler

        self.env, self.token = env, token
        self.hosts: set[str] | None = None  # the Host values answered (None: any, a token checks)
        self.store = env.store()
        self.sampler = Sampler()
        self.lock = threading.Lock()  # one sampler: a CPU % is over the time between reads
        self.api = Api(self.store, env.state_dir, post_token)
        self.files = {route: ((HERE / name).read_bytes(), kind)
                      for route, (name, kind) in FILES.items()}

    def __call__(self, environ: dict[str, Any], start: Start) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        api = path.startswith(API_PREFIX + "/")
        if not api and environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _reply(start, "405 Method Not Allowed", b"read-only\n", "text/plain")
        if self.hosts is not None and environ.get("HTTP_HOST", "").lower() not in self.hosts:
            return _reply(start, "421 Misdirected Request", b"this page answers to its own "
                          b"address only (vigil ui --allow-host NAME adds a name)\n", "text/plain")
        if api:  # reads with the page's rules; a POST the API checks against its own token
            if (self.token is not None and environ.get("REQUEST_METHOD") != "POST"
                    and path != API_PREFIX + "/openapi.json" and not self.allowed(environ)):
                body = b'{"error": "a valid token is required"}'
                return _reply(start, "401 Unauthorized", body, "application/json")
            return self.answer_api(environ, start)
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

    def answer_api(self, environ: dict[str, Any], start: Start) -> list[bytes]:
        from runners.cli.api import STATUS

        code, data = self.api(environ)
        body = json.dumps(data, default=str).encode()
        return _reply(start, STATUS[code], body, "application/json")

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


def host_names(host: str, port: int, allow: tuple[str, ...]) -> set[str]:
    """The Host header values a page listening on host:port answers to: its loopback names
    with the port (alone on port 80), the listen address itself and each --allow-host NAME
    (with the port, unless it gives one)."""
    names = {*LOOPBACK_NAMES, _host(host), *allow}
    out = set()
    for name in names:
        name = name.lower()
        if name.startswith("[") and name.endswith("]") or ":" not in name:
            out.add(f"{name}:{port}")
            if port == 80:
                out.add(name)
        elif name.count(":") > 1 and not name.startswith("["):  # a bare IPv6 address
            out.add(f"[{name}]:{port}")
        else:
            out.add(name)
    return out


def read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text().strip()
        mode = os.stat(token_file).st_mode
    except OSError as exc:
        raise BadInput(f"--token-file {token_file}: {exc.strerror}",
                       "give a readable file holding the token") from None
    if len(token) < 16:
        raise BadInput(f"--token-file {token_file} holds a token of {len(token)} characters",
                       "use at least 16 (e.g. `openssl rand -hex 16 > FILE`)")
    if mode & 0o044:  # served all the same: the operator may mean it, but should know
        click.echo(f"vigil ui: warning: --token-file {token_file} is readable by others (mode "
                   f"{mode & 0o777:o}): chmod 600 {token_file}", err=True)
    return token


@click.command()
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
              help="HOST:PORT (port 0: any free one) or unix:PATH to serve the page on.")
@click.option("--token-file", default=None,
              help="A file holding the token every request must carry (required off loopback).")
@click.option("--allow-host", "allow", multiple=True, metavar="NAME[:PORT]",
              help="Without a token: a Host name the page also answers to (repeatable); "
                   "by default only localhost, 127.0.0.1 and [::1] with its port.")
@click.option("--print-token", is_flag=True,
              help="Print the token the HTTP API's POSTs carry (made at first use) and exit.")
@click.pass_obj
def ui(env: Env, listen: str, token_file: str | None, allow: tuple[str, ...],
       print_token: bool) -> None:
    """A status page of hosts, open obligations, deploys and rollouts and restarts, live
    in a browser, and the HTTP API under /api/v1 (served from the store; the agent need
    not run). The API: docs/reference/http-api.md."""
    from runners.cli.api import post_token

    where = parse_listen(listen, token_file)
    token = read_token(token_file)
    env.store()  # the state dir and its store exist before a token is kept there
    posts = token if token is not None else post_token(env.state_dir)
    if print_token:
        click.echo(posts)
        return
    page = Page(env, token, posts)
    server = _server(page, listen, where)
    url = (f"unix:{where['unix_socket']}" if "unix_socket" in where else
           f"http://{_host(where['host'])}:{server.effective_port}/")
    if token is None and "host" in where:  # a unix socket is 0600: no browser reaches it
        page.hosts = host_names(where["host"], server.effective_port, allow)
    click.echo(f"vigil ui: serving {env.state_dir} on {url} (Ctrl-C to end)")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _server(page: Page, listen: str, where: dict[str, Any]) -> Any:
    """Waitress held to what the page needs (see the module's docstring); one line when
    it cannot listen."""
    from waitress import create_server

    unix = "unix_socket" in where
    try:
        server: Any = create_server(
            page, threads=4, ident="vigil", max_request_body_size=MAX_BODY,  # more: 413, unread
            max_request_header_size=HEADER_BYTES, channel_timeout=IDLE_TIME,
            cleanup_interval=1, connection_limit=CONNECTIONS, **where)
    except OSError as exc:
        raise BadInput(f"--listen {listen}: cannot listen: {exc.strerror or exc}",
                       "give a unix:PATH in a directory that exists" if unix else
                       "stop what listens there or pick another port (port 0: any free "
                       "one)") from None
    # One server, or (a name of several addresses) a MultiSocketServer holding one each.
    many = [server] if hasattr(server, "channel_class") else list(server.map.values())
    for one in many:
        if hasattr(one, "channel_class"):
            _bound_headers(one)
    return server


def _bound_headers(server: Any) -> None:
    """A request whose headers have not come whole HEADER_TIME after its first byte is
    cut: waitress's channel_timeout only closes a connection idle that long, so one
    trickling a byte at a time would hold it (and a connection slot) for good."""
    from waitress.channel import HTTPChannel

    class Channel(HTTPChannel):  # type: ignore[misc]
        began = 0.0  # when the request being read began

        def received(self, data: bytes) -> bool:
            if self.request is None and data:
                self.began = time.time()
            return bool(super().received(data))

    plain = server.maintenance

    def maintenance(now: float) -> None:
        plain(now)
        for channel in list(server.active_channels.values()):
            if (channel.request is not None and not channel.requests
                    and now - getattr(channel, "began", now) > HEADER_TIME):
                channel.will_close = True

    server.channel_class = Channel
    server.maintenance = maintenance
