"""The agent's control socket: `<state>/control.sock`, a unix stream socket (0600, like the
database) on which the quick CLI (runners/quick/client.py) sends one JSON request a line.

Every request runs the same function the CLI runs on the store when no agent is up
(runners/quick/ops.py), so an intent is written, committed, in the same rows either way; the
reply goes out after the commit, and only then is the reconciler kicked (a drive that
reached a crash point before the reply would leave the client without its answer)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from models.errors import BrokenInvariant, VigilError
from runners.quick import ops
from workflows.base.context import Context
from workflows.base.paths import CONTROL

log = logging.getLogger("vigil.control")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("vigil")
    except PackageNotFoundError:
        return "unknown"


class ControlServer:
    def __init__(self, ctx: Context, db: str | None, kick: Callable[[], None],
                 live: Callable[[], dict[str, Any]],
                 may_act: Callable[[], bool] = lambda: True) -> None:
        self.ctx = ctx
        # A halted agent (its store files replaced, the schema changed) answers nothing: its
        # connections may write where no other reader looks; the CLI goes to the store.
        self.may_act = may_act
        self.db = db  # the --db the agent was given (None: the state dir's SQLite file)
        self.kick = kick
        self.live = live  # what the agent says of itself (pid, version, last round, ...)
        self.path = ctx.state_dir / CONTROL
        self.sock: socket.socket | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        try:
            self.path.unlink()  # a dead agent's: this one holds the lock
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # 0600 from its first moment: with a socket group the state dir is 0710, and a
        # socket made under the umask could be opened before a chmod (a narrower umask for
        # an instant only narrows what other threads create meanwhile).
        old = os.umask(0o177)
        try:
            s.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        s.listen(64)
        self.sock = s
        threading.Thread(target=self._accept, name="control", daemon=True).start()

    def close(self) -> None:
        """No new connection; requests already read are answered by their threads."""
        self._closed.set()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _accept(self) -> None:
        if self.sock is None:
            raise BrokenInvariant("the control socket accepts only once it is bound")
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="control-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            for line in reader:
                answer, intent = self.answer(line)
                try:
                    conn.sendall(json.dumps(answer, default=str).encode() + b"\n")
                except OSError:
                    return
                finally:
                    if intent:
                        ops.notify_boxes(self.ctx.store)
                        self.kick()

    def answer(self, line: bytes) -> tuple[dict[str, Any], bool]:
        """(the reply, whether an intent was written)."""
        try:
            req = json.loads(line)
            op, args = req["op"], req.get("args") or {}
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "error": {"cause": "not a vigil request", "fix": None,
                                           "exit_code": 2}}, False
        if req.get("db") != self.db or (op != "hello" and not self.may_act()):
            return {"ok": False, "other_store": True}, False
        try:
            result = self.live() if op == "hello" else ops.run(
                self.ctx.store, self.ctx.state_dir, op, args)
            if op == "agent":
                result.update(self.live())
        except VigilError as exc:
            if op in ops.INTENTS:  # the operator reads the same line
                log.info("request refused op=%s host=%s reason=%r", op, args.get("name"), exc.line())
            return {"ok": False, "error": {"cause": exc.cause, "fix": exc.fix,
                                           "exit_code": exc.exit_code}}, False
        except Exception as exc:
            from models.trouble import diagnose, explain

            trouble = diagnose(exc)
            if trouble is not None:  # the store itself (full, read-only, ...): its one line
                line = explain(trouble, self.ctx.store.url,
                               holder=self.ctx.store.lock_holder() if trouble.kind == "locked"
                               else None)
                log.warning("control request op=%s: %s", op, line.line())
                return {"ok": False, "error": {"cause": line.cause, "fix": line.fix,
                                               "exit_code": line.exit_code}}, False
            log.exception("control request op=%s failed", op)
            return {"ok": False, "error": {"cause": f"the agent failed on {op}: "
                                           f"{type(exc).__name__}: {exc}",
                                           "fix": "see the agent's log", "exit_code": 1}}, False
        return {"ok": True, "result": result}, op in ops.INTENTS
