"""The control socket under attack (issue 20, items 5-8): a malformed or oversized request
is answered with one line, `not a vigil request: <why>`; running out of file descriptors is
waited out, not the end of accepting; 200 statuses at once are all answered, a deploy beside
them goes through."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from runners.base.doorbell import running_agent_pid
from runners.quick.client import CONTROL, Client
from tests.conftest import HELLO, ROOT, Vigil, wait_for


def raw(vigil: Vigil, line: bytes, timeout: float = 20) -> dict[str, Any]:
    """Send `line` as it is on a fresh connection; the one reply line, parsed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(vigil.state_dir / CONTROL))
        sender = threading.Thread(target=lambda: _send_quietly(s, line), daemon=True)
        sender.start()
        reply = s.makefile("rb").readline()
        sender.join(timeout)
    assert reply.endswith(b"\n"), f"no reply to {line[:60]!r}"
    return dict(json.loads(reply))


def _send_quietly(s: socket.socket, line: bytes) -> None:
    try:
        s.sendall(line)
    except OSError:  # the agent closed after answering a line it refused
        pass


def hello(vigil: Vigil) -> dict[str, Any]:
    c = Client.connect(vigil.state_dir, vigil.db_url)
    assert c is not None, "the control socket takes no connection"
    try:
        return dict(c.call("hello", 20))
    finally:
        c.dispose()


@pytest.fixture
def agent(vigil: Vigil) -> subprocess.Popen[bytes]:
    vigil.add_host("hello")
    p = vigil.start_agent()
    vigil.wait_ready(p)
    return p


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(("line", "why"), [
    (b"{\"op\": [1]}\n", "no op"),  # unhashable op
    (b"{\"op\": {\"a\": 1}, \"args\": {}}\n", "no op"),
    (DEEP + b"\n", "nested too deeply"),
    (b"\xff\xfe\n", "not UTF-8"),
    (b"[1, 2]\n", "not an object"),
    (b"{\"op\": \"wake\"}\n", "wake needs args.name"),
    (b"{\"op\": \"wake\", \"args\": {\"name\": 7}}\n", "args.name of wake must be str"),
    (b"{\"op\": \"deploy\", \"args\": {\"name\": \"hello\"}}\n", "deploy needs args.build"),
    (b"{\"op\": \"progress\", \"args\": {\"kind\": \"attempt\"}}\n", "progress needs args.id"),
    (b"{\"op\": \"progress\", \"args\": {\"kind\": \"attempt\", \"id\": null}}\n", "args.id"),
    (b"{\"op\": \"progress\", \"args\": {\"kind\": \"attempt\", \"id\": 1, "
     b"\"changed_after\": \"x\"}}\n", "args.changed_after of progress must be int"),
    (b"{\"op\": \"status\", \"args\": [1]}\n", "args of status is not an object"),
    (b"{\"op\": \"nope\"}\n", "unknown op 'nope'"),
    (b"{\"op\": \"status\", \"db\": 5}\n", "db is neither"),
])
def test_malformed_request_is_one_line(vigil: Vigil, agent: subprocess.Popen[bytes],
                                       line: bytes, why: str) -> None:
    """Failed before its fix: an unhashable op or a deep nesting closed the connection with
    no reply (and a traceback in the log); missing fields answered AttributeError/KeyError."""
    reply = raw(vigil, line)
    cause = reply["error"]["cause"]
    assert cause.startswith("not a vigil request: ") and why in cause, cause
    assert "\n" not in cause and reply["error"]["exit_code"] == 2
    assert hello(vigil)["pid"] == agent.pid
    assert b"Traceback" not in vigil.agent_log()


def test_oversized_request_is_refused_without_being_held(vigil: Vigil,
                                                         agent: subprocess.Popen[bytes]) -> None:
    """Failed before its fix: a line had no bound (the agent read all of it, 64 MiB, into
    memory, and answered only `not a vigil request`)."""
    before = psutil.Process(agent.pid).memory_info().rss
    line = b'{"op": "status", "args": {"name": "' + b"a" * (64 << 20) + b'"}}\n'
    reply = raw(vigil, line, timeout=60)
    assert reply["error"]["cause"] == "not a vigil request: longer than 1048576 bytes"
    grown = psutil.Process(agent.pid).memory_info().rss - before
    assert grown < 32 << 20, f"the agent grew by {grown >> 20} MiB"
    # A request just under the bound is still a request.
    ok = raw(vigil, b'{"op": "status", "args": {"name": "hello"}, "pad": "'
             + b" " * ((1 << 20) - 1000) + b'", "db": ' + json.dumps(vigil.db_url).encode()
             + b"}\n")
    assert ok["ok"] is True, ok
    assert hello(vigil)["pid"] == agent.pid


def _hold_connections(path: Path, count: int) -> list[socket.socket]:
    """Up to `count` connections to the control socket, as many as the listen queue takes."""
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:  # the listen queue is full
            s.close()
            continue
        held.append(s)
    return held


def test_control_socket_accepts_again_after_running_out_of_fds(
        vigil: Vigil, agent: subprocess.Popen[bytes]) -> None:
    """Failed before its fix: one EMFILE ended the accepting thread, for good."""
    me = psutil.Process(agent.pid)
    # The agent's limit lowered under it to a few fds more than it has open now.
    limit = me.num_fds() + 8
    me.rlimit(psutil.RLIMIT_NOFILE, (limit, limit))
    held = _hold_connections(vigil.state_dir / CONTROL, 150)
    try:
        wait_for(lambda: b"too many open files" in vigil.agent_log(), 20,
                 what="the agent to say it ran out of fds")
    finally:
        for s in held:
            s.close()
    assert hello(vigil)["pid"] == agent.pid
    log = vigil.agent_log()
    assert log.count(b"too many open files") == 1 and b"Traceback" not in log, log[-3000:]


def test_agent_raises_its_soft_open_file_limit(vigil: Vigil) -> None:
    """Failed before its fix: the agent kept the soft limit it was started with."""
    vigil.add_host("hello")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(hard, 4096)

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    log = open(vigil.state_dir / "agent.out", "ab")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--safety-interval",
                          "1"], env=vigil.env, stdout=log, stderr=log, cwd=ROOT,
                         preexec_fn=low)
    log.close()
    vigil.agents.append(p)
    vigil.wait_ready(p)
    assert psutil.Process(p.pid).rlimit(psutil.RLIMIT_NOFILE) == (hard, hard)


def test_200_concurrent_statuses_all_answered_beside_a_deploy(
        vigil: Vigil, agent: subprocess.Popen[bytes]) -> None:
    """Failed before its fix: the statuses took every pooled connection; some answered
    `QueuePool limit ... timed out` (the deploy beside them is timed in bench/control.py)."""
    vigil.run("wake", "hello", "--wait")
    errors: list[str] = []
    answered: list[int] = []
    go = threading.Barrier(201)

    def status() -> None:
        go.wait(60)
        c = Client.connect(vigil.state_dir, vigil.db_url)
        if c is None:
            errors.append("no connection")
            return
        try:
            rows = c.call("status", 120)
            answered.append(len(rows))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            c.dispose()

    threads = [threading.Thread(target=status) for _ in range(200)]
    for t in threads:
        t.start()
    go.wait(60)
    deploy = vigil.run("deploy", "hello", str(HELLO), "--wait", check=False, subprocess=True)
    for t in threads:
        t.join(150)
    assert errors == [], errors[:5]
    assert answered == [1] * 200
    assert deploy.returncode == 0 and "switched" in deploy.stdout, deploy.stdout + deploy.stderr


def _bell_names(pid: int) -> list[str]:
    """The abstract unix socket names process `pid` has bound (from /proc/net/unix, which
    every local user may read, matched to its fds)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    names = []
    for row in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = row.split()
        if len(cols) >= 8 and cols[6] in inodes and cols[7].startswith("@"):
            names.append(cols[7][1:])
    return names


def test_agent_start_takes_ready_only_from_its_agent(vigil: Vigil) -> None:
    """Failed before its fix: any local user's READY=1 on the start's abstract socket made
    `vigil agent start` say "agent started" for an agent that was not ready."""
    vigil.add_host("hello")
    start = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "start",
                              "--safety-interval", "1"], env=vigil.env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    spoofed = 0
    try:
        names = wait_for(lambda: start.poll() is None and _bell_names(start.pid), 20,
                         interval=0.005, what="the start's notify socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for name in names:
                s.sendto(b"READY=1", "\0" + name)
                spoofed += 1
        out, err = start.communicate(timeout=90)
    finally:
        if start.poll() is None:
            start.kill()
            start.wait(10)
        pid = running_agent_pid(vigil.state_dir)
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: running_agent_pid(vigil.state_dir) is None, 20, what="agent gone")
    assert spoofed >= 1
    assert start.returncode == 0 and b"agent started" in out, out + err
    # It answered only once the agent itself was ready.
    assert b"logger=vigil.agent ready" in (vigil.state_dir / "agent.log").read_bytes()


def test_second_agent_on_the_same_sqlite_file_is_refused(vigil: Vigil, short_tmp: Path) -> None:
    """Failed before its fix: an agent of another state dir pointed at the same SQLite file
    ran, and took the hosts into its own run/."""
    if vigil.db_url:
        pytest.skip("several agents on one PostgreSQL store are fenced by leases")
    vigil.add_host("hello")
    first = vigil.start_agent()
    vigil.wait_ready(first)
    other = short_tmp / "other"
    env = {**vigil.env, "VIGIL_HOME": str(other),
           "VIGIL_DB": f"sqlite:///{vigil.state_dir / 'vigil.db'}"}
    vigil.run("db", "upgrade", env=env)  # the other state dir, on the same (head) store
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "agent", "--safety-interval", "1"],
                        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cp.returncode != 0, cp.stdout + cp.stderr
    (line,) = cp.stderr.strip().splitlines()
    assert f"another agent (pid {first.pid}) already runs on the database" in line, line
    assert not (other / "run").exists() or not any((other / "run").iterdir())
    assert hello(vigil)["pid"] == first.pid
