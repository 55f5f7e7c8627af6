"""The agent's helpers (runners/keepers/) are watched like apps: kill -9 of the fd holder or
the log keeper -> a new one holds everything again (the same socket inodes, every pipe read
again); a SIGSTOPped one does not freeze what asks it; one bad datagram never crashes one or
touches what it holds; a client of another uid is refused. Real helper processes, killed
by pid; the agent's own case (a stopped host's socket across the holder's kill and then the
agent's) with a real agent."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runners.agent.exit_watch import PipeBell
from runners.agent.helpers import KeeperWatch
from runners.backend.listen import Listeners
from runners.keepers import logpipes
from runners.keepers.fdholder import HOLDER_SOCKET, holder_pid
from runners.keepers.logkeeper import KEEPER_SOCKET, keeper_pid
from runners.keepers.logpipes import LogPipes
from runners.keepers.wire import MAX_MESSAGE
from tests.conftest import HELLO, Vigil, end_holder, pid_dead, wait_for
from tests.listening import free_port, store_inode

pytestmark = pytest.mark.timeout(300)
SOCKETS = 20


@pytest.fixture
def box(short_tmp: Path) -> Iterator[tuple[Path, Listeners, LogPipes, KeeperWatch]]:
    """An agent's two clients and its helper watch, in this process; 20 held sockets and
    20 pipes."""
    state = short_tmp / "state"
    (state / "logs").mkdir(parents=True)
    bell = PipeBell()  # as the agent's wiring: a keeper started on demand is watched at once
    listeners, logs = Listeners(state, bell.ring), LogPipes(state, bell.ring)
    writes = []
    for i in range(SOCKETS):
        listeners.bind(f"k{i}", f"unix:{short_tmp}/u{i}.sock")
        listeners.hand(f"k{i}")
        (state / "logs" / f"h{i}").mkdir()  # a host's dir each: the keeper prunes by host
        writes.append(logs.open(f"g{i}", str(log_of(state, f"g{i}")), 1 << 20, 2))
    watch = KeeperWatch([listeners.peer, logs.peer], bell, tick=0.2)
    watch.start()
    try:
        yield state, listeners, logs, watch
    finally:
        watch.close()
        for sock in listeners.socks.values():
            sock.close()
        for w in writes:
            os.close(w)
        for pid in (holder_pid(state), keeper_pid(state)):
            if pid and pid > 0:
                os.kill(pid, signal.SIGCONT)
        for pid in [*listeners.peer.started, *logs.peer.started]:  # this process's children
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        end_holder(state)


def log_of(state: Path, key: str) -> Path:
    return state / "logs" / f"h{key[1:]}" / "g1.log"


def held(state: Path) -> dict[str, int] | None:
    try:
        return Listeners(state).listed()
    except OSError:
        return None


def test_a_killed_holder_and_keeper_are_restarted_with_everything(box) -> None:  # type: ignore[no-untyped-def]
    state, listeners, logs, _ = box
    want = {k: listeners.inode(k) for k in listeners.keys()}
    assert held(state) == want
    for _ in range(3):
        old = holder_pid(state)
        assert old
        os.kill(old, signal.SIGKILL)
        wait_for(lambda old=old: holder_pid(state) not in (None, old) and held(state) == want,
                 30, what="a new holder with every socket (same inodes)")
    for i in range(3):
        old = keeper_pid(state)
        assert old
        os.kill(old, signal.SIGKILL)
        wait_for(lambda old=old: keeper_pid(state) not in (None, old), 30, what="a new keeper")
        os.write(_write_end(logs, state, "g7"), f"after kill {i}\n".encode())
        wait_for(lambda i=i: f"after kill {i}\n".encode() in log_of(state, "g7").read_bytes(),
                 30, what="the line read by the new keeper")


def _write_end(logs: LogPipes, state: Path, key: str) -> int:
    """A write end of the pipe `key` (a fresh pipe whose read end the keeper gets: the
    fixture's write ends are closed at teardown, this one the kernel closes with the fd)."""
    return logs.open(f"{key}-x{time.monotonic_ns()}", str(log_of(state, key)), 1 << 20, 2)


def test_a_pipe_forgotten_while_no_keeper_runs_is_written_out_first(short_tmp: Path) -> None:
    """The generation is proven gone while its keeper is dead (before the watch started
    another): what the app wrote last is only in the pipe, whose one reader left is the
    agent's copy. forget() hands it to a new keeper before it closes that copy; it closed
    it at once, and the lines were lost."""
    state = short_tmp / "state"
    (state / "logs" / "h1").mkdir(parents=True)
    logs = LogPipes(state)  # no helper watch: nothing starts a keeper but the agent's asks
    try:
        w = logs.open("g1", str(log_of(state, "g1")), 1 << 20, 2)
        old = keeper_pid(state)
        assert old
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: keeper_pid(state) != old and pid_dead(old), 10, what="the keeper dead")
        os.write(w, b"".join(f"last line {i}\n".encode() for i in range(100)))
        os.close(w)  # the app's processes are gone: proven
        logs.forget("g1")
        assert "g1" not in logs.ends
        wait_for(lambda: b"last line 99\n" in log_of(state, "g1").read_bytes(), 30,
                 what="the last lines written by a new keeper")
        assert log_of(state, "g1").read_bytes().count(b"last line ") == 100
    finally:
        for pid in logs.peer.started:  # this process's children
            if not pid_dead(pid):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_stopped_holder_or_keeper_does_not_freeze_what_asks_it(box) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP: the agent's next exchange times out (BOUND), the helper is killed by pid and
    start time, a new one gets everything, and the request is served."""
    state, listeners, logs, _ = box
    want = {k: listeners.inode(k) for k in listeners.keys()}
    for helper_pid, ask in ((holder_pid, lambda: listeners.fds(["k3"])),
                            (keeper_pid, lambda: logs.open("late", str(state / "logs" / "late.log"),
                                                           1 << 20, 2))):
        stopped = helper_pid(state)
        assert stopped
        os.kill(stopped, signal.SIGSTOP)
        done: list[object] = []
        t = threading.Thread(target=lambda ask=ask, done=done: done.append(ask()), daemon=True)
        t.start()
        t.join(60)
        assert done, "the request hung on a stopped helper"
        wait_for(lambda stopped=stopped: pid_dead(stopped), 10, what="the stopped helper killed")
        assert helper_pid(state) not in (None, stopped)
    assert held(state) == want


def _raw(path: Path, payload: bytes, fds: list[int] = ()) -> dict:  # type: ignore[assignment]
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(path))
        socket.send_fds(s, [payload], list(fds))
        data, got, _, _ = socket.recv_fds(s, MAX_MESSAGE, 4)
    for fd in got:
        os.close(fd)
    return json.loads(data)


def test_bad_datagrams_are_refused_and_nothing_held_is_touched(box, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    state, listeners, logs, _ = box
    want = {k: listeners.inode(k) for k in listeners.keys()}
    holder, keeper = holder_pid(state), keeper_pid(state)
    plain = short_tmp / "plain"
    plain.write_text("x")
    r, w = os.pipe()
    connected = socket.socket()  # a socket, but not a listening one
    f = os.open(plain, os.O_RDONLY)
    try:
        common = [(b'"str"', []), (b"[1, 2]", []), (b'{"op": 5}', []), (b"not json", []),
                  (b"[" * 100_000, []), (b'{"op": "get", "keys": [[1]]}', []),
                  (b'{"op": "get", "keys": "k0"}', []), (b'{"op": "nope"}', [])]
        for payload, fds in [*common, (b'{"op": "put", "key": "k0"}', [f]),
                             (b'{"op": "put", "key": "k1"}', [r]),
                             (b'{"op": "put", "key": "k2"}', [connected.fileno()]),
                             (b'{"op": "put", "key": "k3"}', []),
                             (b'{"op": "drop", "keys": "k0"}', []),
                             (b'{"op": "put", "key": ["k4"]}', [f])]:
            reply = _raw(state / HOLDER_SOCKET, payload, fds)
            assert reply["ok"] is False and reply["error"], (payload[:40], reply)
        put = {"op": "put", "key": "bad", "path": str(state / "logs" / "bad.log"),
               "max_bytes": 1 << 20, "files": 2}
        for payload, fds in [*common, (json.dumps({**put, "max_bytes": 0}).encode(), [r]),
                             (json.dumps({**put, "max_bytes": "10"}).encode(), [r]),
                             (json.dumps({**put, "files": 0}).encode(), [r]),
                             (json.dumps({**put, "path": 5}).encode(), [r]),
                             (json.dumps(put).encode(), [w]),  # the write end
                             (json.dumps(put).encode(), [f]),
                             (json.dumps(put).encode(), [connected.fileno()]),
                             (json.dumps({**put, "path": "/nonexistent/dir/g.log"}).encode(), [r])]:
            reply = _raw(state / KEEPER_SOCKET, payload, fds)
            assert reply["ok"] is False and reply["error"], (payload[:40], reply)
    finally:
        for fd in (r, w, f):
            os.close(fd)
        connected.close()
    assert holder_pid(state) == holder and keeper_pid(state) == keeper
    assert held(state) == want
    cpu = _cpu(keeper)
    os.write(_write_end(logs, state, "g1"), b"still written\n")
    wait_for(lambda: b"still written\n" in log_of(state, "g1").read_bytes(), 30,
             what="the keeper still writing")
    time.sleep(0.5)  # a keeper spinning on a 0-byte file would burn this whole half second
    assert _cpu(keeper) - cpu < 0.3


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_client_of_another_uid_is_refused(box, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    """Even where the socket file lets it in (here opened up on purpose), SO_PEERCRED
    refuses a process of another uid: its connection is closed without an answer."""
    if os.getuid() != 0:
        pytest.skip("needs root to become nobody")
    state, listeners, _, _ = box
    want = {k: listeners.inode(k) for k in listeners.keys()}
    nobody = pwd.getpwnam("nobody").pw_uid
    for d in (short_tmp, state):
        os.chmod(d, 0o711)
    for name in (HOLDER_SOCKET, KEEPER_SOCKET):
        os.chmod(state / name, 0o666)
        pid = os.fork()
        if pid == 0:  # the child: nobody, then one request
            code = 3
            try:
                os.setgid(nobody)
                os.setuid(nobody)
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.settimeout(10)
                    s.connect(str(state / name))
                    try:
                        s.send(b'{"op": "keep", "keys": []}')
                        code = 0 if s.recv(MAX_MESSAGE) == b"" else 1
                    except OSError:
                        code = 0  # reset: refused
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"{name}: another uid was served"
    assert held(state) == want


def test_a_stopped_hosts_socket_survives_the_holders_kill_then_the_agents(vigil: Vigil) -> None:
    """A stopped host's socket lives only in the holder and the agent. kill -9 of the holder:
    the agent starts a new one and hands it the socket at once; kill -9 of the agent then:
    the holder has it, and the restarted agent takes it back (same inode). On the code
    before the helper watch, the holder was started again only at the next request, so
    the agent's kill lost the socket (`lost`, every wake refused)."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    inode = store_inode(vigil, "app")
    vigil.run("stop", "app", "--wait")
    vigil.quiesce(30)
    old = holder_pid(vigil.state_dir)
    assert old and list((held(vigil.state_dir) or {}).values()) == [inode]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: holder_pid(vigil.state_dir) not in (None, old)
             and list((held(vigil.state_dir) or {}).values()) == [inode], 30,
             what="a new holder with the stopped host's socket")
    vigil.stop_agent(agent, signal.SIGKILL)
    before = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), before)
    st = vigil.status("app")
    assert st["listeners"][0]["state"] == "held" and st["listeners"][0]["inode"] == inode, st
    vigil.run("wake", "app", "--wait")
    assert store_inode(vigil, "app") == inode
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 200")
    vigil.check()


def test_a_stopped_keeper_or_holder_does_not_freeze_the_agent(vigil: Vigil) -> None:
    """SIGSTOP of the log keeper, then of the fd holder: wake and deploy --wait finish, and
    SIGTERM stops the agent (issue 20 items 1 and 2)."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}")
    vigil.add_host("plain")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    stopped = []
    try:
        for helper_pid, args in ((keeper_pid, ("wake", "plain", "--wait")),
                                 (holder_pid, ("deploy", "app", str(HELLO), "--mode", "hold",
                                               "--wait"))):
            pid = helper_pid(vigil.state_dir)
            assert pid
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            vigil.run(*args, timeout=60)
            wait_for(lambda pid=pid: pid_dead(pid), 30, what="the stopped helper killed")
        last = keeper_pid(vigil.state_dir)
        assert last
        os.kill(last, signal.SIGSTOP)
        stopped.append(last)
        assert vigil.stop_agent(agent, timeout=30) == 0
    finally:
        for pid in stopped:
            if pid and not pid_dead(pid):
                os.kill(pid, signal.SIGCONT)


def _read_ends(inodes: set[str]) -> int:
    """How many read ends of these pipes this process holds (its fds' links and modes)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = next(int(x.split()[1], 8) for x in f if x.startswith("flags:"))
        except (OSError, StopIteration):
            continue
        count += link in inodes and flags & os.O_ACCMODE == os.O_RDONLY
    return count


def _mirrored(logs: LogPipes) -> bool:
    with logs.peer.lock:
        got = logs.peer.ask({"op": "get", "keys": []}, start=False)
    return got is not None and bool(got[0].get("mirrored"))


def test_the_standby_keeps_each_pipe_so_the_agent_keeps_none(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fd an app in the agent (issue 42 item 5), under a limit with no room for a copy
    and a pidfd an app: once the keeper's standby has a copy of every pipe, the agent
    closes its own; the keeper killed twice, each pipe is still read by the standby that
    took over (then by the next), no line lost; the copies the agent takes back while no
    standby has them are let go again once a new one has them."""
    monkeypatch.setattr(logpipes, "copies_fit", lambda held: False)
    state = short_tmp / "state"
    (state / "logs").mkdir(parents=True)
    bell = PipeBell()
    logs = LogPipes(state, bell.ring)
    writes = []
    for i in range(SOCKETS):
        (state / "logs" / f"h{i}").mkdir()
        writes.append(logs.open(f"g{i}", str(log_of(state, f"g{i}")), 1 << 20, 2))
    inodes = {os.readlink(f"/proc/self/fd/{w}") for w in writes}
    watch = KeeperWatch([logs.peer], bell, tick=0.2)
    watch.start()
    try:
        wait_for(lambda: not logs.ends and _read_ends(inodes) == 0, 30,
                 what="the agent's copies closed once the standby has each")
        for round_ in range(2):
            wait_for(lambda: _mirrored(logs), 30, what="a standby with a copy of every pipe")
            old = keeper_pid(state)
            assert old
            os.kill(old, signal.SIGKILL)
            wait_for(lambda old=old: keeper_pid(state) not in (None, old), 30,
                     what="the standby took over")
            for i, w in enumerate(writes):
                os.write(w, f"round {round_} pipe {i}\n".encode())
            wait_for(lambda r=round_: all(f"round {r} pipe {i}\n".encode()
                                          in log_of(state, f"g{i}").read_bytes()
                                          for i in range(SOCKETS)), 30,
                     what="every pipe's line read by the keeper that took over")
            wait_for(lambda: not logs.ends and _read_ends(inodes) == 0, 30,
                     what="the copies let go again once a new standby has each")
    finally:
        watch.close()
        for w in writes:
            os.close(w)
        for pid in logs.peer.started:  # this process's children
            if not pid_dead(pid):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        end_holder(state)


def test_the_keeper_killed_again_and_again_loses_no_pipe(short_tmp: Path) -> None:
    """Deaths in a row, each as soon as the keeper that took over has read the last line
    (its standby not yet replaced): where the fd limit has room, the agent keeps a copy of
    each pipe, so however soon the next death comes every pipe is read after it. Failed
    when the agent let its copies go whatever its limit: a death right after a take-over
    found neither a standby nor a copy (BrokenPipeError)."""
    state = short_tmp / "state"
    (state / "logs").mkdir(parents=True)
    bell = PipeBell()
    logs = LogPipes(state, bell.ring)
    writes = []
    for i in range(SOCKETS):
        (state / "logs" / f"h{i}").mkdir()
        writes.append(logs.open(f"g{i}", str(log_of(state, f"g{i}")), 1 << 20, 2))
    watch = KeeperWatch([logs.peer], bell, tick=0.2)
    watch.start()
    try:
        for round_ in range(10):
            old = keeper_pid(state)
            assert old
            os.kill(old, signal.SIGKILL)
            wait_for(lambda old=old: keeper_pid(state) not in (None, old), 30,
                     what=f"a keeper after death {round_}")
            for i, w in enumerate(writes):
                os.write(w, f"death {round_} pipe {i}\n".encode())
            wait_for(lambda r=round_: all(f"death {r} pipe {i}\n".encode()
                                          in log_of(state, f"g{i}").read_bytes()
                                          for i in range(SOCKETS)), 30,
                     what=f"every pipe read after death {round_}")
    finally:
        watch.close()
        for w in writes:
            os.close(w)
        for pid in logs.peer.started:  # this process's children
            if not pid_dead(pid):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        end_holder(state)
