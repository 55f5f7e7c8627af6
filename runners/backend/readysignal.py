"""A generation's own readiness signal (the ReadinessPort), for hosts on a shared listener.

- notify: each generation gets its own `$NOTIFY_SOCKET` (`<state>/run/<host>/n<n>.sock`,
  a unix datagram socket bound before its spawn). `READY=1` from one of its processes
  (the sender's pid, from SCM_CREDENTIALS, carries the generation's VIGIL_GENERATION
  marker) means ready; `STOPPING=1` and `STATUS=...` become events (`app_stopping`,
  `app_status`, a changed status at most once a second). One thread reads every such
  socket (select), so an idle generation costs nothing. The socket is closed when the
  generation is proven gone, and bound again when a restarted agent adopts it.
- watchdog: a host with `--watchdog` gets such a socket whatever its readiness; the time of
  each `WATCHDOG=1` is kept here, in memory (the agent's watchdog loop reads it:
  workflows/lifecycle/watchdog.py), and `WATCHDOG=trigger` rings `watchdog_bell`.
- exec:CMD: `/bin/sh -c CMD` in the host's working dir with the generation's environment,
  inside its containment (its cgroup and marker, as the stop command: an agent killed while
  a probe runs leaves nothing the stop's proof would not end), as the app's user
  (`host add --user/--group`, setpriv after the join), tried again every POLL seconds until it exits 0,
  each try bounded by what is left of the health timeout (then its process group is
  killed). The ongoing health probe's exec:CMD is one such try (`run_once`).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from models.store import Store, emit
from runners.backend.stopcmd import contained
from runners.base import sd_notify
from runners.base.deadline import Deadline
from workflows.base.ports import SpawnError, SpawnSpec

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("vigil.readiness")

POLL = 0.1  # seconds between two runs of a probe command
PROBE_STEP = 0.5  # a running probe is waited for in steps this long
STATUS_EVERY = 1.0  # at most one app_status event per generation per second
MARKER = "VIGIL_GENERATION"


def sender_is(generation_uuid: str, pid: int) -> bool | None:
    """Whether `pid` carries the generation's marker; None when it cannot be read (the
    sender has exited: a helper such as systemd-notify may, right after it sent)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    if not env:
        return None  # a zombie's environment reads empty
    return f"{MARKER}={generation_uuid}".encode() in env.split(b"\0")


def silent_notify(host: str, timeout: float) -> str:
    """A generation that runs and never says READY=1: most servers do not (gunicorn does),
    so the reason names the readiness that works for them."""
    return (f"ready: no READY=1 on $NOTIFY_SOCKET within {timeout}s (the app runs; most "
            "servers never send it): give the host a readiness it has, `vigil host set "
            f"{host} --ready http` if it also serves $VIGIL_SOCKET, or --ready "
            "'exec:curl -fs http://127.0.0.1:PORT/'")


@dataclass
class _Watched:
    sock: socket.socket
    path: str
    host: str
    generation_id: int
    ready: threading.Event = field(default_factory=threading.Event)
    status: str | None = None
    status_at: float = 0.0
    # For a reload (Type=notify-reload): lines counted as they come, and the count at the
    # last RELOADING=1 and at the last READY=1.
    said: int = 0
    reloading_at: int = 0
    ready_at: int = 0


class Readiness:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread: threading.Thread | None = None
        self._pings: dict[str, float] = {}  # generation uuid -> its last WATCHDOG=1 (epoch)
        self._triggered: set[str] = set()  # generations that sent WATCHDOG=trigger
        self.watchdog_bell = threading.Event()  # rung by WATCHDOG=trigger

    # -- notify ------------------------------------------------------------------------------
    def open_notify(self, generation_uuid: str, path: str, host: str, generation_id: int) -> None:
        self.forget(generation_uuid)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        s = sd_notify.bind(path, blocking=False)
        with self._lock:
            self._watched[generation_uuid] = _Watched(s, path, host, generation_id)
            self._sel.register(s, selectors.EVENT_READ, generation_uuid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="notify", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def wait_notify(self, generation_uuid: str, timeout: float,
                    alive: Callable[[], bool]) -> str | None:
        w = self._watched.get(generation_uuid)
        if w is None:
            return "ready: the generation has no NOTIFY_SOCKET"
        deadline = Deadline(timeout, 0.02, f"notify g{w.generation_id}")
        while True:
            if w.ready.wait(min(0.02, max(0.0, deadline.left()))):
                return None
            if not alive():
                return "ready: process exited before it sent READY=1"
            if deadline.left() <= 0:
                return silent_notify(w.host, float(timeout))

    def reload_mark(self, generation_uuid: str) -> int | None:
        w = self._watched.get(generation_uuid)
        return None if w is None else w.said

    def wait_reload(self, generation_uuid: str, mark: int, timeout: float,
                    alive: Callable[[], bool]) -> str | None:
        w = self._watched.get(generation_uuid)
        if w is None:
            return "reload: the generation has no NOTIFY_SOCKET"
        deadline = Deadline(timeout, 0.02, f"reload g{w.generation_id}")
        while True:
            if w.reloading_at > mark and w.ready_at > w.reloading_at:
                return None
            if not alive():
                return "reload: process exited before it sent READY=1"
            if deadline.left() <= 0:
                said = "RELOADING=1 but no READY=1" if w.reloading_at > mark else "no RELOADING=1"
                return (f"reload: {said} on $NOTIFY_SOCKET within {float(timeout)}s of the "
                        "signal (systemd's notify-reload protocol)")
            time.sleep(min(0.02, max(0.0, deadline.left())))

    def forget(self, generation_uuid: str) -> None:
        with self._lock:
            w = self._watched.pop(generation_uuid, None)
            self._pings.pop(generation_uuid, None)
            self._triggered.discard(generation_uuid)
            if w is None:
                return
            try:
                self._sel.unregister(w.sock)
            except (KeyError, ValueError):
                pass
        self._read(generation_uuid, w)  # what it said last (STOPPING=1) is still queued
        w.sock.close()
        try:
            os.unlink(w.path)
        except OSError:
            pass

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select():
                if key.fileobj == self._wake_r:
                    try:
                        os.read(self._wake_r, 512)
                    except BlockingIOError:
                        pass
                    continue
                with self._lock:
                    w = self._watched.get(key.data)
                if w is not None:
                    self._read(key.data, w)

    def watchdog_seen(self, generation_uuid: str) -> tuple[float | None, bool]:
        with self._lock:
            w = self._watched.get(generation_uuid)
        if w is not None:  # what is queued counts: the reader may be behind (a stalled agent)
            self._read(generation_uuid, w)
        return self._pings.get(generation_uuid), generation_uuid in self._triggered

    def _watchdog(self, generation_uuid: str, lines: list[str]) -> None:
        if "WATCHDOG=1" in lines:
            self._pings[generation_uuid] = time.time()
        if "WATCHDOG=trigger" in lines:
            self._triggered.add(generation_uuid)
            self.watchdog_bell.set()

    def _read(self, generation_uuid: str, w: _Watched) -> None:
        while True:
            try:
                data, pid = sd_notify.receive(w.sock)
            except (BlockingIOError, OSError):
                return
            lines = data.decode(errors="replace").splitlines()
            if pid is not None and sender_is(generation_uuid, pid) is False:
                log.warning("notify ignored host=%s generation=%d pid=%d (not a process of it)",
                            w.host, w.generation_id, pid)
                continue
            self._watchdog(generation_uuid, lines)
            try:
                self._record(w, lines, pid)
            except Exception:  # an event row is advisory; readiness must not wait on it
                log.exception("notify event not written host=%s", w.host)

    def _record(self, w: _Watched, lines: list[str], pid: int | None) -> None:
        events: list[tuple[str, dict[str, object]]] = []
        for line in lines:  # in the order said: RELOADING=1 before READY=1 in one message too
            w.said += 1
            if line == "RELOADING=1":
                w.reloading_at = w.said
                events.append(("app_reloading", {"pid": pid}))
            elif line == "READY=1":
                w.ready_at = w.said
        if "READY=1" in lines and not w.ready.is_set():
            w.ready.set()
            events.append(("app_ready", {"pid": pid}))
        if "STOPPING=1" in lines:
            events.append(("app_stopping", {"pid": pid}))
        for line in lines:
            if line.startswith("STATUS="):
                text = line[len("STATUS="):]
                now = time.monotonic()
                if text != w.status and now - w.status_at >= STATUS_EVERY:
                    w.status, w.status_at = text, now
                    events.append(("app_status", {"pid": pid, "status": text[:500]}))
        if events:
            def record(s: Session) -> None:
                for kind, detail in events:
                    emit(s, kind, w.host, w.generation_id, **detail)
            self.store.write(record)

    # -- exec --------------------------------------------------------------------------------
    def run_probe(self, spec: SpawnSpec, timeout: float, alive: Callable[[], bool]) -> str | None:
        command = spec.argv[-1]
        deadline = Deadline(timeout, PROBE_STEP, f"probe {command!r}")
        last = ""
        while True:
            if deadline.left() <= 0:
                return f"ready: `{command}` did not exit 0 within {float(timeout)}s{last}"
            try:
                p = _start(spec)
            except (OSError, ValueError, SpawnError) as exc:
                return f"ready: `{command}` could not start: {exc}"
            out = _finish(p, deadline)
            if p.returncode == 0:
                return None
            if p.returncode == -signal.SIGKILL and deadline.left() <= 0:
                # Ours, at the deadline: the try before says more about why it never passed.
                last = last or " (last: still running at the deadline, killed)"
                continue
            last = f" (last: {_ended(p.returncode, out)})"
            if not alive():
                return f"ready: process exited before `{command}` passed{last}"
            time.sleep(min(POLL, max(0.0, deadline.left())))

    def run_once(self, spec: SpawnSpec, timeout: float) -> str | None:
        command = spec.argv[-1]
        deadline = Deadline(timeout, PROBE_STEP, f"probe {command!r}")
        try:
            p = _start(spec)
        except (OSError, ValueError, SpawnError) as exc:
            return f"probe: `{command}` could not start: {exc}"
        out = _finish(p, deadline)
        if p.returncode == 0:
            return None
        if p.returncode == -signal.SIGKILL and deadline.left() <= 0:
            return f"probe: `{command}` still ran after {float(timeout)}s (killed)"
        return f"probe: `{command}` {_ended(p.returncode, out)}"


def _start(spec: SpawnSpec) -> subprocess.Popen[bytes]:
    """`spec.argv` (`/bin/sh -c CMD`) in the generation's containment, as the stop command
    is (runners/backend/stopcmd.py): its cgroup, its marker, its user, so the drain's SIGKILL
    and the proof reach a probe that outlived the agent that started it. In a session of
    its own: its group is what a deadline kills (the join shim execs, keeping the pid).
    Raises OSError, or SpawnError for a user the box lacks or a bad env file."""
    argv, env = contained(spec)
    cwd = spec.cwd or ("/" if spec.user or spec.group else None)  # the agent's may be shut
    return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)


def _ended(returncode: int, out: bytes) -> str:
    """`exit N: last line of its output` (or `killed by SIGNAME`)."""
    tail = out.decode(errors="replace").strip().splitlines()[-1:] if out else []
    how = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0
           else f"exit {returncode}")
    return how + (f": {tail[0][:200]}" if tail else "")


def _finish(p: subprocess.Popen[bytes], deadline: Deadline) -> bytes:
    """The probe's output once it exits, or its process group killed at the deadline. Waited
    for in steps, so a stall of the agent is seen as one (the deadline re-arms)."""
    while True:
        left = deadline.left()
        try:
            out, _ = p.communicate(timeout=max(0.0, min(PROBE_STEP, left)))
            return out
        except subprocess.TimeoutExpired:
            if deadline.left() > 0:
                continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return p.communicate()[0]
