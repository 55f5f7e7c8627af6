"""Shared by the listener tests: a real gunicorn on a TCP port vigil holds, a closed-loop
client on it, and the socket's inode as the store, the fd holder and the app each see it."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from models.tables import Listener
from runners.backend.listen import Listeners
from runners.keepers.fdholder import holder_pid
from tests.conftest import HELLO, ROOT, Vigil, pid_dead, wait_for

GUNICORN_DIR = ROOT / "examples" / "gunicorn"
GUNICORN = Path(sys.executable).parent / "gunicorn"  # installed by the test extra
MAX_REQUESTS = 200_000
MAX_SECONDS = 400.0  # the client stops by itself, whatever the test does
REQUEST_TIMEOUT = 30.0  # a request queued through a hold deploy on a loaded box is late, not lost


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_builds(tmp: Path) -> list[Path]:
    """Two builds of examples/gunicorn/serve (different bytes, so different digests)."""
    out = []
    for label in ("a", "b"):
        p = tmp / f"serve-{label}"
        p.write_bytes((GUNICORN_DIR / "serve").read_bytes() + f"# build {label}\n".encode())
        p.chmod(0o755)
        out.append(p)
    return out


def add_gunicorn(v: Vigil, name: str, build: Path, port: int, *extra: str) -> str:
    address = f"tcp:127.0.0.1:{port}"
    v.run("host", "add", name, "--build", str(build), "--cwd", str(GUNICORN_DIR),
          "--listen", f"http={address}", "--env", f"GUNICORN={GUNICORN}",
          "--drain-timeout", "15", "--health-timeout", "60", *extra)
    return address


@dataclass
class Client:
    """Closed loop: one GET at a time, each on a new TCP connection; bounded in count and
    time. A failure is a refused or reset connection, a timeout, or an answer not 200."""

    port: int
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def one(self) -> str | None:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=REQUEST_TIMEOUT) as s:
                s.sendall(b"GET / HTTP/1.0\r\nHost: t\r\n\r\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        if not data.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
            return f"answer {data[:60]!r}"
        for part in data.split():
            if part.startswith(b"pid="):
                self.pids.add(int(part[4:]))
        return None

    def _run(self) -> None:
        started = time.monotonic()
        n = 0
        while not self.stop.is_set() and n < MAX_REQUESTS and time.monotonic() - started < MAX_SECONDS:
            n += 1
            err = self.one()
            if err is None:
                self.ok += 1
            else:
                self.failures.append(err)
            time.sleep(0.005)  # load, not a CPU hog on a 2-core box

    def __enter__(self) -> Client:
        self.thread.start()
        wait_for(lambda: self.ok > 0 or self.failures, 60, what="the client's first answer")
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(REQUEST_TIMEOUT + 10)
        assert not self.thread.is_alive(), "the client did not stop"


def store_inode(v: Vigil, host: str) -> int | None:
    return v.store.read(lambda s: s.execute(select(Listener.inode).where(
        Listener.host == host)).scalar())


def holder_inodes(v: Vigil) -> dict[str, int]:
    with Listeners(v.state_dir) as holder:
        return holder.listed() or {}


def app_has(pid: int, inode: int) -> bool:
    """The process has the very socket open (its fds name socket:[inode])."""
    want = f"socket:[{inode}]"
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == want for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def serving_inode(v: Vigil, host: str) -> int:
    """The inode of the host's listener, checked the same in the store, the fd holder and
    the current generation's leader; returns it."""
    inode = store_inode(v, host)
    assert inode, f"{host}: no inode recorded"
    assert inode in holder_inodes(v).values(), (inode, holder_inodes(v))
    pid = v.status(host)["pid"]
    assert pid and app_has(pid, inode), f"{host}: leader {pid} does not have socket:[{inode}]"
    return inode


def awake(v: Vigil, host: str, timeout: float = 90) -> dict:
    try:
        return wait_for(lambda: (st := v.status(host))["state"] == "awake" and st, timeout,
                        interval=0.1, what=f"{host} awake")
    except AssertionError as exc:  # why not: its row, its obligations and the agents' log
        raise AssertionError(f"{exc}; status {v.status(host)}; open {v.obligations()}; "
                             f"agent log:\n{v.agent_log().decode(errors='replace')[-6000:]}") from None


def stopped_with_a_lost_socket(v: Vigil, address: str) -> int:
    """Add `app` on `address`, wake it, stop it, then kill -9 its agent and its fd holder
    (by pid, one after the other) and start a new agent: nothing has the socket any more.
    Returns the lost socket's inode."""
    v.run("host", "add", "app", "--build", str(HELLO), "--listen", address)
    agent = v.start_agent()
    v.wait_ready(agent)
    v.run("wake", "app", "--wait")
    inode = store_inode(v, "app")
    v.run("stop", "app", "--wait")
    v.quiesce()
    holder = holder_pid(v.state_dir)
    assert holder and inode
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)
    os.kill(holder, signal.SIGKILL)
    wait_for(lambda: pid_dead(holder), 10, what="the holder gone")
    before = v.ready_count()
    v.wait_ready_after(v.start_agent(), before)
    assert v.status("app")["listeners"][0]["state"] == "lost"
    return inode


def reopened_events(v: Vigil) -> list[dict]:
    return [e for e in v.json("events", "app") if e["kind"] == "listener_reopened"]
