"""A lost listening socket is bound again at its host's next start (issue 24 item 3); only an
address something else holds refuses, naming it. And two defects of issue 20: unix aliases
(item 14) and a foreign unix socket whose backlog is full taken over as stale (item 15).
Real agents, real sockets, real foreign processes (each ended by pid)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import update

from models.tables import Listener
from runners.keepers.fdholder import holder_pid
from tests.conftest import HELLO, Vigil, pid_dead, wait_for
from tests.listening import free_port, reopened_events, serving_inode, stopped_with_a_lost_socket

pytestmark = pytest.mark.timeout(300)

# A foreign program: listens on argv[1] (tcp:PORT or unix:PATH, backlog argv[2]), never
# accepts, says "ready" once it listens, and waits to be killed.
FOREIGN = """
import socket, sys, time
kind, _, where = sys.argv[1].partition(":")
if kind == "unix":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(where)
else:
    s = socket.socket()
    s.bind(("127.0.0.1", int(where)))
s.listen(int(sys.argv[2]))
print("ready", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def foreign() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()


def listen_foreign(started: list[subprocess.Popen[str]], address: str,
                   backlog: int = 16) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", FOREIGN, address, str(backlog)],
                         stdout=subprocess.PIPE, text=True)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_reboot_reopens_the_socket_and_says_so(vigil: Vigil, short_tmp: Path) -> None:
    """A reboot, simulated: every process of vigil gone and the box's boot id changed (in the
    store). The next wake binds the unix path again and the event says the box rebooted.
    Before the fix: bound again silently (no listener_reopened, status said nothing)."""
    path = short_tmp / "app.sock"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"unix:{path}")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    inode = serving_inode(vigil, "app")
    vigil.run("stop", "app", "--wait")
    vigil.quiesce()
    holder = holder_pid(vigil.state_dir)
    assert holder
    vigil.stop_agent(agent)
    os.kill(holder, signal.SIGKILL)
    wait_for(lambda: pid_dead(holder), 10, what="the holder gone")
    vigil.store.write(lambda s: s.execute(update(Listener).where(Listener.host == "app")
                                          .values(boot_id="0" * 36)))
    before = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), before)
    st = vigil.status("app")["listeners"][0]
    assert st["state"] == "lost" and "the box rebooted" in st["note"], st
    vigil.run("wake", "app", "--wait")
    assert serving_inode(vigil, "app") != inode
    events = reopened_events(vigil)
    assert len(events) == 1 and "the box rebooted" in str(events[0]), events
    cp = vigil.run("check", check=False)
    assert cp.returncode == 0 and "was reopened" in cp.stdout, cp.stdout
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(10)
        c.connect(str(path))


def test_a_lost_address_held_by_another_program_refuses_naming_it(
        vigil: Vigil, short_tmp: Path, foreign: list[subprocess.Popen[str]]) -> None:
    """The socket lost, and meanwhile another program listens on the port: wake and deploy
    refuse in one line naming that program's pid and name, and change nothing; once it is
    gone, the wake binds the port. Before the fix the refusal said `vigil host reopen`
    (which then failed at the spawn with a bare Errno 98)."""
    port = free_port()
    stopped_with_a_lost_socket(vigil, f"tcp:127.0.0.1:{port}")
    other = listen_foreign(foreign, f"tcp:{port}")
    for args in (("wake", "app"), ("deploy", "app", str(HELLO))):
        cp = vigil.run(*args, check=False)
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 4 and len(lines) == 1, (args, cp.stdout, cp.stderr)
        assert f"in use by pid {other.pid} (python" in lines[0], lines
        assert "stop it or pick another port" in lines[0], lines
    assert vigil.status("app")["listeners"][0]["state"] == "lost"
    assert not reopened_events(vigil)
    other.kill()
    other.wait(10)
    vigil.run("wake", "app", "--wait")
    assert len(reopened_events(vigil)) == 1
    vigil.check()


def test_a_spawn_on_a_taken_address_names_what_holds_it(
        vigil: Vigil, short_tmp: Path, foreign: list[subprocess.Popen[str]]) -> None:
    """The port was free at `host add` and is taken before the first wake: the wake fails
    (never the build's fault) with the holder's pid and name. Before: a bare Errno 98."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}")
    other = listen_foreign(foreign, f"tcp:{port}")
    vigil.wait_ready(vigil.start_agent())
    cp = vigil.run("wake", "app", "--wait", check=False)
    assert cp.returncode != 0, cp.stdout
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by pid {other.pid} (python" in lines[0], lines


def test_unix_aliases_are_the_same_address(vigil: Vigil, short_tmp: Path) -> None:
    """Issue 20 item 14: `unix://dir/x.sock` and a path through a symlinked directory name
    the file of `unix:/dir/x.sock`: refused at `host add` and in a hosts file. Before the
    fix both were accepted (and the second wake failed with Errno 98)."""
    real = short_tmp / "real"
    real.mkdir()
    link = short_tmp / "link"
    link.symlink_to(real)
    vigil.run("host", "add", "first", "--build", str(HELLO), "--listen", f"unix:{real}/x.sock")
    for alias in (f"unix:/{real}/x.sock", f"unix:{link}/x.sock", f"unix:{real}/../real/x.sock"):
        cp = vigil.run("host", "add", "second", "--build", str(HELLO), "--listen", alias,
                       check=False)
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 2 and len(lines) == 1, (alias, cp.stderr)
        assert "is already host first's listener" in lines[0], (alias, lines)
    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.first]\nbuild = "{HELLO}"\nlisten = ["unix:{real}/x.sock"]\n'
                 f'[hosts.third]\nbuild = "{HELLO}"\nlisten = ["unix:{link}/x.sock"]\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 2 and "is also host first's listener" in cp.stderr, cp.stderr
    assert [h["host"] for h in vigil.json("host", "list")] == ["first"]


def full_backlog(path: Path) -> list[socket.socket]:
    """Connect to the unix listener at `path` until its backlog is full (EAGAIN)."""
    held: list[socket.socket] = []
    for _ in range(64):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(str(path))
        except BlockingIOError:
            c.close()
            return held
        held.append(c)
    raise AssertionError("the backlog never filled")


def test_a_live_unix_socket_with_a_full_backlog_is_not_taken_over(
        vigil: Vigil, short_tmp: Path, foreign: list[subprocess.Popen[str]]) -> None:
    """Issue 20 item 15: another program listens on the path and its backlog is full, so a
    connect answers EAGAIN. `host add` refuses (naming it), and a wake of a host added on
    the path before refuses too: the file is neither deleted nor rebound. Before the fix
    EAGAIN was read as a stale file: unlinked and bound by vigil."""
    path = short_tmp / "theirs.sock"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"unix:{path}")
    other = listen_foreign(foreign, f"unix:{path}", backlog=0)
    ino = os.stat(path).st_ino
    held = full_backlog(path)
    try:
        cp = vigil.run("host", "add", "second", "--build", str(HELLO), "--listen",
                       f"unix:{short_tmp}/./theirs.sock", check=False)
        assert cp.returncode == 2 and "is already host app's listener" in cp.stderr, cp.stderr
        vigil.run("host", "rm", "app")
        cp = vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"unix:{path}",
                       check=False)
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode == 2 and len(lines) == 1, cp.stderr
        assert f"something already listens on {path}: pid {other.pid} (python" in lines[0], lines
        assert os.stat(path).st_ino == ino
    finally:
        for c in held:
            c.close()


def test_a_wake_does_not_take_over_a_full_unix_socket(
        vigil: Vigil, short_tmp: Path, foreign: list[subprocess.Popen[str]]) -> None:
    """The same at the bind: the path was free at `host add`, then another program listens
    there with a full backlog; the wake fails naming it and the file is the other's still."""
    path = short_tmp / "theirs.sock"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"unix:{path}")
    other = listen_foreign(foreign, f"unix:{path}", backlog=0)
    ino = os.stat(path).st_ino
    held = full_backlog(path)
    try:
        vigil.wait_ready(vigil.start_agent())
        cp = vigil.run("wake", "app", "--wait", check=False)
        lines = cp.stderr.strip().splitlines()
        assert cp.returncode != 0 and len(lines) == 1, (cp.stdout, cp.stderr)
        assert f"pid {other.pid} (python" in lines[0], lines
        assert os.stat(path).st_ino == ino and other.poll() is None
    finally:
        for c in held:
            c.close()
