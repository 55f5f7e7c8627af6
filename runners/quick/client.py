"""The quick CLI's side of the agent's control socket (runners/quick/control.py): one JSON
object a line each way over `<state>/control.sock`. Imports only the standard library and
models/errors.py: a command the agent answers does not pay for SQLAlchemy's import.

Request: `{"op": "wake", "args": {...}, "db": URL or null}`. Reply: `{"ok": true, "result":
...}`, `{"ok": false, "error": {"cause", "fix", "exit_code"}}` (raised as that VigilError),
or `{"ok": false, "other_store": true}`: the agent runs on another database (the client
then works on the store itself)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from models.errors import VigilError

CONTROL = "control.sock"  # workflows/base/paths.py CONTROL (kept equal by a test)
INTENTS = frozenset({"wake", "stop", "deploy", "retry", "restart"})  # requests that write a row
CONNECT_TIMEOUT = 2.0
REPLY_TIMEOUT = 120.0  # a deploy stages its build (a copy) before it answers
READ_TIMEOUT = 10.0  # a read not answered by then is read from the store itself


class OtherStore(Exception):
    """The agent on this state dir uses another database: go to the store directly."""


class Lost(Exception):
    """The connection ended, or the agent did not answer in time, after the request was
    sent: the agent may or may not have acted on it."""


def answered(err: dict[str, Any]) -> VigilError:
    """The agent's error as the command shows it: the line an operator reads (cause and
    fix), and the exit code the agent gave it."""
    out = VigilError(err.get("cause", "the agent refused the request"), err.get("fix"))
    out.exit_code = int(err.get("exit_code", 1))
    return out


class Client:
    def __init__(self, sock: socket.socket, db: str | None) -> None:
        self.sock = sock
        self.db = db
        self.reader = sock.makefile("rb")

    @classmethod
    def connect(cls, state_dir: Path, db: str | None) -> Client | None:
        """A connection to the agent's control socket, or None when no agent listens."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(CONNECT_TIMEOUT)
        try:
            s.connect(str(state_dir / CONTROL))
        except OSError:  # no socket file, nobody listening (a dead agent's file), too long
            s.close()
            return None
        return cls(s, db)

    def call(self, op: str, timeout: float = REPLY_TIMEOUT, **args: Any) -> Any:
        line = json.dumps({"op": op, "args": args, "db": self.db}).encode() + b"\n"
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(line)
            reply = self.reader.readline()
        except OSError as exc:  # reset, broken pipe, timed out
            raise Lost(str(exc) or type(exc).__name__) from None
        if not reply.endswith(b"\n"):
            raise Lost("the connection closed before the answer")
        answer = json.loads(reply)
        if answer.get("ok"):
            return answer.get("result")
        if answer.get("other_store"):
            raise OtherStore()
        raise answered(answer.get("error") or {})

    def dispose(self) -> None:
        """Close the connection (twice is fine)."""
        try:
            self.reader.close()
        finally:
            self.sock.close()
