"""`vigil ui`'s HTTP API (/api/v1/..., its OpenAPI document in runners/cli/openapi.py).

Reads follow the page's rules (open on loopback, behind --token-file elsewhere). Every POST
carries `Authorization: Bearer TOKEN`, also on loopback (a browser on the box is another
user): the token of --token-file, else the one `vigil ui` keeps in the state dir (TOKEN_FILE,
made 0600 at its first start; `vigil ui --print-token` prints it). It is compared in constant
time; no cookie is set or read, so a page elsewhere cannot borrow it (no CSRF). Checked before
anything else, so a request without it learns nothing, not even which hosts exist.

A POST calls the function the CLI's verb calls (runners/quick/ops.py; `signal` the one of
runners/cli/reloadcmds.py) and rings the agent: the intent row is written, its id answered
(202), never waited on."""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from models.errors import BadInput, NotFound, Refused, StoreNotReady, VigilError
from models.store import Store
from runners.cli.openapi import SIGNALS

TOKEN_FILE = "ui.token"  # in the state dir: the POSTs' token when no --token-file is given
PREFIX = "/api/v1"
MAX_BODY = 16384  # bytes of a POST's JSON body (a deploy's is a path)
EVENTS_LIMIT = 100  # events answered unless ?limit= says fewer or more
EVENTS_MAX = 1000
ID_MAX = 2**63 - 1  # an id above what the store's integers hold is refused, not asked of it
NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
VERBS = ("wake", "stop", "restart", "deploy", "signal")
STATUS = {200: "200 OK", 202: "202 Accepted", 400: "400 Bad Request", 401: "401 Unauthorized",
          404: "404 Not Found", 405: "405 Method Not Allowed", 409: "409 Conflict",
          413: "413 Content Too Large", 415: "415 Unsupported Media Type",
          422: "422 Unprocessable Content",
          503: "503 Service Unavailable"}


class Answer(Exception):
    """An answer other than 200: its status and the one line of {"error": ...}."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(error)
        self.code, self.error = code, error


def post_token(state_dir: Path) -> str:
    """The state dir's token for the API's POSTs, made (0600, 32 hex digits) at first use:
    written whole under another name, then linked to its own, so two servers starting at
    once read the same token and neither an empty file."""
    path = state_dir / TOKEN_FILE
    if not path.exists():
        tmp = state_dir / f".{TOKEN_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another made it first: its token is the one
        finally:
            tmp.unlink()
    token = path.read_text().strip()
    if len(token) < 16:
        raise BadInput(f"{path} holds a token of {len(token)} characters",
                       "remove it (`vigil ui` makes a new one) or write one of at least 16")
    return token


def bearer_ok(environ: dict[str, Any], token: str) -> bool:
    given = environ.get("HTTP_AUTHORIZATION", "")
    if not token or not given.startswith("Bearer "):
        return False
    return hmac.compare_digest(given.removeprefix("Bearer ").strip().encode(), token.encode())


class Api:
    """The routes under /api/v1: each returns (status code, JSON data)."""

    def __init__(self, store: Store, state_dir: Path, token: str) -> None:
        self.store, self.state_dir, self.token = store, state_dir, token

    def __call__(self, environ: dict[str, Any]) -> tuple[int, Any]:
        method = environ.get("REQUEST_METHOD", "GET")
        parts = (environ.get("PATH_INFO") or "").removeprefix(PREFIX).strip("/").split("/")
        try:
            if method == "POST":
                if not bearer_ok(environ, self.token):
                    raise Answer(401, "a valid bearer token is required (Authorization: "
                                      "Bearer TOKEN; `vigil ui --print-token` prints it)")
                return self.post(parts, environ)
            if method not in ("GET", "HEAD"):
                raise Answer(405, f"{method} is not answered here: GET reads, POST acts")
            return 200, self.get(parts, environ.get("QUERY_STRING", ""))
        except Answer as exc:
            return exc.code, {"error": exc.error}
        except VigilError as exc:
            return _code(exc), {"error": exc.line()}

    def get(self, parts: list[str], query: str) -> Any:
        from runners.quick import ops

        if parts == ["openapi.json"]:
            from runners.cli.openapi import DOCUMENT
            return DOCUMENT
        if parts == ["hosts"]:
            return {"hosts": ops.status(self.store)}
        if len(parts) == 2 and parts[0] == "hosts":
            return ops.status(self.store, _name(parts[1]))[0]
        if len(parts) == 3 and parts[0] == "hosts" and parts[2] == "runs":
            return {"runs": self.runs(_name(parts[1]), query)}
        if parts == ["obligations"]:
            return {"obligations": ops.obligations(self.store)}
        if parts == ["events"]:
            return {"events": self.events(query)}
        raise Answer(404, "no such resource: see /api/v1/openapi.json")

    def events(self, query: str) -> list[dict[str, Any]]:
        """Events with id > after, oldest first, their details cut as the page cuts them
        (no env value or credential is answered)."""
        from runners.cli.output import events_after
        from workflows.config.timeline import SHOWN

        args = parse_qs(query)
        after = _count(args, "after", 0, ID_MAX)
        limit = _count(args, "limit", EVENTS_LIMIT, EVENTS_MAX, least=1)
        rows = events_after(self.store, None, after, limit)[:limit]
        return [{**e, "detail": {k: e["detail"][k] for k in SHOWN if k in e["detail"]}}
                for e in rows]

    def runs(self, name: str, query: str) -> list[dict[str, Any]]:
        """A job's runs, newest scheduled instant first (`vigil runs NAME --json`)."""
        from workflows.lifecycle.jobs import runs_of

        limit = _count(parse_qs(query), "limit", EVENTS_LIMIT, EVENTS_MAX, least=1)
        return list(self.store.read(lambda s: runs_of(s, name, limit)))

    def post(self, parts: list[str], environ: dict[str, Any]) -> tuple[int, Any]:
        from runners.cli.common import ring_doorbell
        from runners.quick import ops

        if len(parts) != 3 or parts[0] != "hosts" or parts[2] not in VERBS:
            raise Answer(404, "no such action: POST /api/v1/hosts/NAME/"
                              "wake|stop|restart|deploy|signal")
        name, verb = _name(parts[1]), parts[2]
        body = _body(environ)
        if verb == "signal":
            return 200, self.signal(name, body)
        if verb == "deploy":
            build, mode = _build(body), _choice(body, "mode", ("overlap", "hold"))
            try:
                out = ops.deploy(self.store, self.state_dir, name, build, cwd="/", mode=mode,
                                 canary=_flag(body, "canary"))
            except BadInput as exc:  # a body well made, naming a file that is no build
                raise Answer(422, exc.line()) from None
        elif verb == "restart":
            _fields(body, ("mode",))
            out = ops.restart(self.store, name, _choice(body, "mode", ("overlap", "hold")))
        elif verb == "stop":
            _fields(body, ("force",))
            out = ops.stop(self.store, name, _flag(body, "force"))
        else:
            _fields(body, ())
            out = ops.wake(self.store, name)
        ring_doorbell(self.state_dir)  # as the CLI's own call does (runners/cli/common.py)
        return _queued(verb, out)

    def signal(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Sent at once by this process, as `vigil signal` sends it: no row to queue."""
        from runners.backend.process import ProcessBackend
        from workflows.base.paths import AGENT_ID
        from workflows.deploys.reload import check_signal, signal_host

        _fields(body, ("signal",))
        sig = body.get("signal")
        if sig not in SIGNALS:  # by its name as `kill -l` gives it; the CLI takes more
            raise Answer(400, f"signal {sig!r} is not a signal's name: give one such as "
                              'HUP, USR1 or TERM: {"signal": "HUP"}')
        known = check_signal(str(sig), "signal ")
        proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"))
        box_file = self.state_dir / AGENT_ID
        box = box_file.read_text().strip() if box_file.exists() else None
        sent = signal_host(self.store, proc, name, known, box)
        return {"kind": "signal", "signal": known, "processes": [
            {"generation": o.generation, "slot": o.slot, "pid": o.pid, "sent": o.sent}
            for o in sent]}


def _queued(verb: str, out: dict[str, Any]) -> tuple[int, Any]:
    """The row written: (202, its kind and id); nothing written (already awake, a job's
    schedule enabled, a job's next build set): 200."""
    if "attempt" in out:
        return 202, {"kind": "attempt", "id": out["attempt"], "held_down": out.get("held_down")}
    if "converge" in out:  # a job's or converging worker's build: its next runs take it
        return 200, {"kind": "converge", "id": None, "build": out["converge"]}
    row_id = out["wake"] if "wake" in out else out["id"]
    kind = "wake" if verb in ("wake", "restart") else "stop"
    said = {"state": out["state"]} if "state" in out else {}  # a job's wake: `enabled`
    return (202 if row_id is not None else 200), {"kind": kind, "id": row_id, **said}


def _code(exc: VigilError) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, BadInput):
        return 400
    if isinstance(exc, StoreNotReady):
        return 503
    return 409 if isinstance(exc, Refused) else 400


def _name(text: str) -> str:
    if NAME.fullmatch(text) is None:
        raise Answer(404, f"no host named {text!r} (a name is [a-z0-9][a-z0-9-]{{0,62}})")
    return text


def _count(args: dict[str, list[str]], key: str, default: int, most: int,
           least: int = 0) -> int:
    if key not in args:
        return default
    text = args[key][-1]
    if not text.isdigit() or int(text) < least or int(text) > most:
        raise Answer(400, f"?{key}={text[:40]!r} is not a whole number {least}..{most}")
    return int(text)


def _body(environ: dict[str, Any]) -> dict[str, Any]:
    """The POST's JSON object ({} when it has none)."""
    length = environ.get("CONTENT_LENGTH") or "0"
    size = int(length) if length.isdigit() else 0
    if size > MAX_BODY:
        raise Answer(413, f"the body is over {MAX_BODY} bytes")
    raw = environ["wsgi.input"].read(size) if size else b""
    if not raw.strip():
        return {}
    kind = environ.get("CONTENT_TYPE", "").split(";")[0].strip()
    if kind != "application/json":
        raise Answer(415, f"the body must be application/json, not {kind or 'unnamed'}")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Answer(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise Answer(400, "the body must be a JSON object")
    return body


def _fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    extra = sorted(set(body) - set(allowed))
    if extra:
        takes = ", ".join(allowed) or "no field"
        raise Answer(400, f"unknown field {extra[0]!r} in the body: this action takes {takes}")


def _build(body: dict[str, Any]) -> str:
    _fields(body, ("build", "mode", "canary"))
    build = body.get("build")
    if not isinstance(build, str) or not os.path.isabs(build):
        raise Answer(400, 'the body must give the build\'s absolute path: {"build": "/PATH"}')
    if "\x00" in build:
        raise Answer(400, "the build's path holds a NUL byte")
    return build


def _flag(body: dict[str, Any], key: str) -> bool:
    if not isinstance(body.get(key, False), bool):
        raise Answer(400, f"{key} must be true or false, not {body[key]!r}")
    return bool(body.get(key, False))


def _choice(body: dict[str, Any], key: str, choices: tuple[str, ...]) -> str:
    if key not in body:
        return choices[0]
    if body[key] not in choices:
        raise Answer(400, f"{key} must be one of {', '.join(choices)}, not {body[key]!r}")
    return str(body[key])
