"""The agent's control socket: `<state>/control.sock`, a unix stream socket (0600, like the
database) on which the quick CLI (runners/quick/client.py) sends one JSON request a line.

Every request runs the same function the CLI runs on the store when no agent is up
(runners/quick/ops.py), so an intent is written, committed, in the same rows either way; the
reply goes out after the commit, and only then is the reconciler kicked (a drive that
reached a crash point before the reply would leave the client without its answer)."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from models.errors import BrokenInvariant, VigilError
from runners.quick import ops
from runners.quick.shapes import MAX_REQUEST, NotARequest, parse
from workflows.base.context import Context
from workflows.base.paths import CONTROL

log = logging.getLogger("vigil.control")

# Reads answered at once, per kind; the others wait their turn. The store's pool (5 + 10
# overflow on SQLite) keeps room for the drive and for intents, which never wait behind
# reads; a `--wait`'s progress polls (one row each) never wait behind listings (every host).
READ_LANES = 3
POLLS = frozenset({"progress", "last_event"})
IDLE = 120.0  # seconds a connection may wait between two requests (the CLI polls faster)
WAIT_BOUND = 1.0  # seconds a progress poll waits at most for the agent's next commit
DRAIN = 10.0  # seconds spent reading the rest of a refused oversized line before closing
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
_SOCKET_GONE = (errno.EBADF, errno.EINVAL, errno.ENOTSOCK)


def connection_cap() -> int:
    """Control connections served at once: a quarter of the open-file limit (each is one
    fd), at most 256 (each may buffer a request of up to MAX_REQUEST)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(4, min(256, soft // 4))


def refusal(why: str, fix: str | None = None) -> dict[str, Any]:
    return {"ok": False, "error": {"cause": f"not a vigil request: {why}", "fix": fix,
                                   "exit_code": 2}}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("vigil")
    except PackageNotFoundError:
        return "unknown"


class Commits:
    """A count of the agent's write commits and a wait for the next one: a `--wait`'s
    progress poll (`changed_after`: the count its last answer carried) is answered once
    the agent has committed something since, instead of the CLI reading every 50 ms while
    the app starts beside the agent on the same cores."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def committed(self, readonly: bool) -> None:
        if readonly:
            return
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_past(self, seen: int, bound: float) -> int:
        """The count once it is past `seen`, or after `bound` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self.count > seen, bound)
            return self.count


class ControlServer:
    def __init__(self, ctx: Context, db: str | None, kick: Callable[[], None],
                 live: Callable[[], dict[str, Any]], commits: Commits,
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
        self._slots = threading.BoundedSemaphore(connection_cap())
        self._reads = threading.BoundedSemaphore(READ_LANES)
        self._polls = threading.BoundedSemaphore(READ_LANES)
        self._starved_since: float | None = None  # out of fds since (monotonic), if it is
        self.commits = commits  # counted by the agent's store hook

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
        s.listen(connection_cap())
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
            # At the cap, a client waits in the listen queue until a connection ends.
            if not self._slots.acquire(timeout=0.5):
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError as exc:
                self._slots.release()
                if self._closed.is_set() or exc.errno in _SOCKET_GONE:
                    return
                self._accept_failed(exc)
                continue
            if self._starved_since is not None:
                log.info("control socket accepts again after %.1fs without fds",
                         time.monotonic() - self._starved_since)
                self._starved_since = None
            try:
                threading.Thread(target=self._serve, args=(conn,), name="control-conn",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: this client is not answered
                conn.close()
                self._slots.release()
                self._closed.wait(0.1)

    def _accept_failed(self, exc: OSError) -> None:
        """A failed accept is waited out: out of fds, connections end and free theirs; said
        once per spell, not once per attempt."""
        if exc.errno in _OUT_OF_FDS:
            if self._starved_since is None:
                self._starved_since = time.monotonic()
                soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
                log.warning("control socket: too many open files (limit %d): new connections "
                            "wait until some close; raise the agent's `ulimit -n`", soft)
        else:
            log.warning("control socket: accept failed (%s); trying again", exc)
        self._closed.wait(0.1)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rb") as reader:
                conn.settimeout(IDLE)
                while True:
                    line = reader.readline(MAX_REQUEST + 1)
                    if not line:
                        return
                    if len(line) > MAX_REQUEST and not line.endswith(b"\n"):
                        self._send(conn, refusal(f"longer than {MAX_REQUEST} bytes",
                                                 "send one JSON request a line"))
                        self._drain(conn, reader)
                        return
                    answer, intent = self.answer(line)
                    try:
                        if not self._send(conn, answer):
                            return
                    finally:
                        if intent:  # the boxes it is for: rung by the store (migration 0031)
                            self.kick()
        except OSError:  # timed out idle, reset: the client is gone
            return
        finally:
            self._slots.release()

    @staticmethod
    def _send(conn: socket.socket, answer: dict[str, Any]) -> bool:
        try:
            conn.sendall(json.dumps(answer, default=str).encode() + b"\n")
            return True
        except OSError:
            return False

    @staticmethod
    def _drain(conn: socket.socket, reader: Any) -> None:
        """Read (and drop) the rest of a refused line, so the client, still sending it,
        reads the refusal instead of a reset; bounded in time, not in bytes."""
        conn.settimeout(1.0)
        until = time.monotonic() + DRAIN
        try:
            while time.monotonic() < until:
                chunk = reader.readline(1 << 16)
                if not chunk or chunk.endswith(b"\n"):
                    return
        except OSError:
            return

    def answer(self, line: bytes) -> tuple[dict[str, Any], bool]:
        """(the reply, whether an intent was written)."""
        try:
            op, args, db = parse(line)
        except NotARequest as exc:
            return refusal(str(exc), "send what a vigil of the agent's version sends"), False
        if db != self.db or (op != "hello" and not self.may_act()):
            return {"ok": False, "other_store": True}, False
        try:
            seen = args.pop("changed_after", None) if op == "progress" else None
            count = None if seen is None else self.commits.wait_past(seen, WAIT_BOUND)
            if op == "hello":
                result = self.live()
            elif op in ops.INTENTS:
                result = ops.run(self.ctx.store, self.ctx.state_dir, op, args)
            else:
                # many reads at once would take every pooled connection
                with self._polls if op in POLLS else self._reads:
                    result = ops.run(self.ctx.store, self.ctx.state_dir, op, args)
            if op == "agent":
                result.update(self.live())
            if count is not None:  # taken before the read: a commit after it ends the next wait
                result["commits"] = count
        except VigilError as exc:
            if op in ops.INTENTS:  # the operator reads the same line
                log.info("request refused op=%s host=%s reason=%r", op, args.get("name"), exc.line())
            return {"ok": False, "error": {"cause": exc.cause, "fix": exc.fix,
                                           "exit_code": exc.exit_code}}, False
        except Exception as exc:
            from models.trouble import diagnose, explain

            trouble = diagnose(exc)
            if trouble is not None:  # the store itself (full, read-only, ...): its one line
                said = explain(trouble, self.ctx.store.url,
                               holder=self.ctx.store.lock_holder() if trouble.kind == "locked"
                               else None)
                log.warning("control request op=%s: %s", op, said.line())
                return {"ok": False, "error": {"cause": said.cause, "fix": said.fix,
                                               "exit_code": said.exit_code}}, False
            log.exception("control request op=%s failed", op)
            return {"ok": False, "error": {"cause": f"the agent failed on {op}: "
                                           f"{type(exc).__name__}: {exc}",
                                           "fix": "see the agent's log", "exit_code": 1}}, False
        return {"ok": True, "result": result}, op in ops.INTENTS
