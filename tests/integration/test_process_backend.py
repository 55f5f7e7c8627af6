"""ProcessBackend and HttpHealth against real processes, in both containment modes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket as so
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from runners.backend.cgroups import detect_cgroup_base
from runners.backend.health import HttpHealth, get_status
from runners.backend.process import ProcessBackend, SpawnError
from workflows.base.ports import ProcRef, SpawnSpec

# The process backend alone: no database, so nothing to repeat on PostgreSQL.
pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
HELLO = ROOT / "examples" / "hello" / "hello.py"
CGROUP = detect_cgroup_base()


def wait_for(cond: Callable[[], object], bound: float = 10.0, step: float = 0.02) -> bool:
    """Poll cond until truthy or bound seconds pass; returns whether it held."""
    deadline = time.monotonic() + bound
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def handles(pid: int, sig: int, field: str) -> bool:
    """Whether /proc/<pid>/status shows sig in SigIgn/SigCgt (the fixture is ready)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


class Harness:
    def __init__(self, backend: ProcessBackend, tmp: str) -> None:
        self.b = backend
        self.tmp = tmp
        self.refs: list[ProcRef] = []
        self.pids: list[tuple[int, float]] = []  # extra processes: (pid, create_time)

    def spawn(
        self, script: Path | str, *, socket: bool = True, env: dict[str, str] | None = None
    ) -> ProcRef:
        gen = str(uuid.uuid4())
        cg = self.b.containment_for(gen)
        sock = os.path.join(self.tmp, gen[:8] + ".sock") if socket else None
        spec = SpawnSpec(
            generation_uuid=gen,
            host="t",
            argv=[str(script)],
            env=env or {},
            socket_path=sock,
            log_path=os.path.join(self.tmp, gen[:8] + ".log"),
            cgroup=cg,
        )
        ref = ProcRef(gen, None, None, cg)
        self.refs.append(ref)  # before spawn: teardown sweeps the marker/cgroup even on error
        s = self.b.spawn(spec)
        ref = ProcRef(gen, s.pid, s.create_time, cg)
        self.refs.append(ref)
        return ref

    def track(self, pid: int) -> None:
        try:
            self.pids.append((pid, psutil.Process(pid).create_time()))
        except psutil.NoSuchProcess:
            pass

    def close(self) -> None:
        for ref in self.refs:
            self.b.kill_all(ref)
        for pid, ctime in self.pids:  # only if it is still the process we recorded
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ctime) < 0.05:
                    p.kill()
            except psutil.Error:
                pass
        for ref in self.refs:
            wait_for(lambda r=ref: self.b.proven(r), bound=5)
            self.b.release(ref)


@pytest.fixture(params=["cgroup", "marker"])
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "cgroup" and CGROUP is None:
        pytest.skip("no usable cgroup v2 (cgroup.kill/cgroup.events) on this box")
    tmp = tempfile.mkdtemp(prefix="vpb-", dir="/tmp")  # short: unix socket paths max ~107 bytes
    harness = Harness(ProcessBackend(request.param), tmp)
    assert harness.b.mode == request.param
    try:
        yield harness
    finally:
        harness.close()
        shutil.rmtree(tmp, ignore_errors=True)


def sock_of(h: Harness, ref: ProcRef) -> str:
    return os.path.join(h.tmp, ref.generation_uuid[:8] + ".sock")


def test_hello_serves_then_terminates_cleanly(h: Harness) -> None:
    ref = h.spawn(HELLO, env={"HELLO_BUILD": "b1"})
    assert h.b.leader_alive(ref)
    assert HttpHealth().check(sock_of(h, ref), 10.0, lambda: h.b.leader_alive(ref)) is None
    assert ref.pid in h.b.live_members(ref)
    if ref.cgroup:
        assert str(ref.pid) in Path(ref.cgroup, "cgroup.procs").read_text().split()
    h.b.terminate(ref)
    assert wait_for(lambda: h.b.proven(ref))
    assert h.b.exit_status(ref.pid) == 0
    assert not h.b.leader_alive(ref) and h.b.live_members(ref) == []
    h.b.release(ref)
    assert ref.cgroup is None or not os.path.exists(ref.cgroup)


def test_hello_body_and_env(h: Harness) -> None:
    ref = h.spawn(HELLO, env={"HELLO_BUILD": "b7"})
    sock = sock_of(h, ref)
    assert HttpHealth().check(sock, 10.0, lambda: h.b.leader_alive(ref)) is None
    with so.socket(so.AF_UNIX, so.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.0 200")
    assert data.endswith(f"hello pid={ref.pid} build=b7\n".encode())
    env = psutil.Process(ref.pid).environ()
    assert env["VIGIL_GENERATION"] == ref.generation_uuid and env["VIGIL_HOST"] == "t"
    assert env["VIGIL_SOCKET"] == sock and "PYTEST_CURRENT_TEST" not in env


def test_double_fork_grandchild_is_contained(h: Harness) -> None:
    pidfile = os.path.join(h.tmp, "gc.pid")
    ref = h.spawn(FIX / "double_fork.py", env={"FIXTURE_PIDFILE": pidfile})
    assert wait_for(lambda: os.path.exists(pidfile))
    gc = int(Path(pidfile).read_text())
    h.track(gc)
    assert HttpHealth().check(sock_of(h, ref), 10.0, lambda: h.b.leader_alive(ref)) is None
    assert gc in h.b.live_members(ref)
    h.b.terminate(ref)
    assert wait_for(lambda: not h.b.leader_alive(ref))
    assert not h.b.proven(ref)  # the grandchild outlived the leader's graceful exit
    h.b.kill_all(ref)
    assert wait_for(lambda: h.b.proven(ref))
    # Reparented to a PID 1 that never reaps: gone or zombie. SIGKILL was sent; on a loaded
    # box the grandchild may still be on its way out when the marker scan no longer sees it.
    assert wait_for(lambda: dead(gc))


def test_ignore_term_needs_kill_all(h: Harness) -> None:
    ref = h.spawn(FIX / "ignore_term.py", socket=False)
    assert wait_for(lambda: handles(ref.pid, signal.SIGTERM, "SigIgn"))
    h.b.terminate(ref)
    assert not wait_for(lambda: not h.b.leader_alive(ref), bound=0.5)
    assert not h.b.proven(ref)
    h.b.kill_all(ref)
    assert wait_for(lambda: h.b.proven(ref))
    assert h.b.exit_status(ref.pid) == -signal.SIGKILL


def test_worker_exits_zero_on_term(h: Harness) -> None:
    ref = h.spawn(FIX / "worker.py", socket=False)
    assert wait_for(lambda: handles(ref.pid, signal.SIGTERM, "SigCgt"))
    h.b.terminate(ref)
    assert wait_for(lambda: h.b.proven(ref))
    assert h.b.exit_status(ref.pid) == 0


def test_pid_reuse_is_never_signalled(h: Harness) -> None:
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        h.track(p.pid)
        ctime = psutil.Process(p.pid).create_time()
        gen = str(uuid.uuid4())
        ref = ProcRef(gen, p.pid, ctime + 10.0, h.b.containment_for(gen))
        assert not h.b.leader_alive(ref)
        h.b.terminate(ref)
        h.b.kill_all(ref)
        assert h.b.proven(ref)  # a stranger on the pid is not our leader
        assert not wait_for(lambda: p.poll() is not None, bound=0.3)
        assert psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE
        assert h.b.leader_alive(ProcRef(gen, p.pid, ctime, None))  # the true identity matches
    finally:
        p.kill()
        p.wait()


def test_spawn_errors(h: Harness) -> None:
    with pytest.raises(SpawnError, match="ENOENT"):
        h.spawn(Path(h.tmp) / "missing")
    plain = Path(h.tmp) / "plain.py"
    plain.write_text("print(1)\n")
    plain.chmod(0o644)
    with pytest.raises(SpawnError, match="EACCES"):
        h.spawn(plain)
    plain.chmod(0o755)
    with pytest.raises(SpawnError, match="ENOEXEC"):
        h.spawn(plain)
    with pytest.raises(SpawnError, match="ENOENT"):
        h.spawn("vigil-no-such-command-xyz")
    for ref in h.refs:  # nothing was left behind
        assert ref.cgroup is None or not os.path.exists(ref.cgroup)
        assert h.b.live_members(ref) == []


def test_health_bad_status(h: Harness) -> None:
    ref = h.spawn(FIX / "bad_health.py")
    reason = HttpHealth().check(sock_of(h, ref), 1.0, lambda: h.b.leader_alive(ref))
    assert reason == "health: status 500"


def test_health_no_socket_times_out(h: Harness) -> None:
    ref = h.spawn(FIX / "no_socket.py")
    t0 = time.monotonic()
    reason = HttpHealth().check(sock_of(h, ref), 0.5, lambda: h.b.leader_alive(ref))
    # The app never served $VIGIL_SOCKET: the reason says so, and how (issue 22).
    assert reason is not None and reason.startswith(
        f"health: nothing accepted on {sock_of(h, ref)} within 0.5s: the app must serve HTTP "
        "on the unix socket named in its $VIGIL_SOCKET"), reason
    assert time.monotonic() - t0 < 10.0  # bounded, with room for a loaded CI box


def test_health_process_exits(h: Harness) -> None:
    ref = h.spawn(FIX / "exit_fast.py")
    reason = HttpHealth().check(sock_of(h, ref), 10.0, lambda: h.b.leader_alive(ref))
    assert reason is not None and "exited" in reason


def test_unreaped_zombie_leader_counts_as_exited(h: Harness) -> None:
    ref = h.spawn(FIX / "exit_fast.py", socket=False)
    assert wait_for(lambda: psutil.Process(ref.pid).status() == psutil.STATUS_ZOMBIE)
    fresh = ProcessBackend(h.b.mode)  # no Popen handle: cannot reap, like a restarted agent
    assert not fresh.leader_alive(ref)
    assert fresh.live_members(ref) == []
    assert fresh.proven(ref)
    assert psutil.Process(ref.pid).status() == psutil.STATUS_ZOMBIE  # proof did not need a reap
    assert h.b.exit_status(ref.pid) == 3


_ORPHANER = """
import json, sys
from runners.backend.process import ProcessBackend
from workflows.base.ports import SpawnSpec
b = ProcessBackend(sys.argv[1])
cg = b.containment_for(sys.argv[2])
s = b.spawn(SpawnSpec(generation_uuid=sys.argv[2], host="t", argv=[sys.argv[3]], cgroup=cg))
print(json.dumps([s.pid, s.create_time, cg]))
"""


def test_orphan_after_agent_exit_is_adopted_and_proven(h: Harness) -> None:
    """The spawning 'agent' exits; its worker is reparented to a PID 1 that never reaps."""
    gen = str(uuid.uuid4())
    h.refs.append(ProcRef(gen, None, None, h.b.containment_for(gen)))  # teardown sweep
    out = subprocess.run(
        [sys.executable, "-c", _ORPHANER, h.b.mode, gen, str(FIX / "worker.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid, ctime, cg = json.loads(out.stdout)
    ref = ProcRef(gen, pid, ctime, cg)
    h.refs.append(ref)
    assert h.b.leader_alive(ref) and pid in h.b.live_members(ref)
    assert wait_for(lambda: handles(pid, signal.SIGTERM, "SigCgt"))
    h.b.terminate(ref)
    assert wait_for(lambda: h.b.proven(ref))  # the leftover zombie does not block the proof
    h.b.release(ref)
    assert cg is None or not os.path.exists(cg)


def test_contain_modes_and_detection() -> None:
    assert detect_cgroup_base("marker") is None
    assert ProcessBackend("marker").containment_for("x") is None
    with pytest.raises(ValueError):
        detect_cgroup_base("bogus")
    with pytest.raises(RuntimeError, match="containment=cgroup unavailable"):
        ProcessBackend("cgroup", cgroup_root="/nonexistent-vigil-root")
    if CGROUP is not None:
        assert ProcessBackend("auto").containment_for("u") == os.path.join(CGROUP, "u")
        assert os.path.isdir(CGROUP)


def test_get_status_helper_rejects_garbage(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        get_status(str(tmp_path / "nope.sock"), 0.2)


def test_health_check_reads_the_whole_reply_before_it_closes(tmp_path: Path) -> None:
    """An app that writes its headers, then its body a moment later (as Python's
    http.server may): the check waits for the body its Content-Length announces. Before
    the fix it closed after the status line, and the app's body write failed (EPIPE: a
    BrokenPipeError traceback in the logs of apps on http.server)."""
    import threading

    path = str(tmp_path / "app.sock")
    server = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    errors: list[str] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            body = b"hello\n"
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            time.sleep(0.2)
            try:
                conn.sendall(body)
            except OSError as exc:
                errors.append(repr(exc))

    t = threading.Thread(target=serve)
    t.start()
    try:
        assert get_status(path, 5.0) == 200
    finally:
        t.join(10)
        server.close()
    assert errors == []


def test_hello_finishes_in_flight_requests_on_term(h: Harness) -> None:
    ref = h.spawn(HELLO, env={"HELLO_DELAY": "0.4", "HELLO_BUILD": "slow"})
    sock = sock_of(h, ref)
    assert HttpHealth().check(sock, 10.0, lambda: h.b.leader_alive(ref)) is None
    conns = []
    for _ in range(3):  # in flight or still queued in the backlog: all must be answered
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.settimeout(5)
        s.connect(sock)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        conns.append(s)
    h.b.terminate(ref)
    for s in conns:
        with s:
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200") and b"build=slow" in data
    assert wait_for(lambda: h.b.proven(ref))
    assert h.b.exit_status(ref.pid) == 0
    assert not os.path.exists(sock)  # hello removed its own socket


def test_the_join_is_heard_from_the_shim_not_polled(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim closes its stdin (a pipe from the backend) once it is in its cgroup: the
    spawn waits on that, then reads /proc/<pid>/cgroup once and finds it joined; the shim's
    status is never polled. The build's stdin is /dev/null, as it always was."""
    if h.b.mode != "cgroup":
        pytest.skip("the join is a cgroup matter")
    import runners.backend.process as process

    polled: list[int] = []
    real = process.pid_status

    def counted(pid: int) -> tuple[float, str] | None:
        polled.append(pid)
        return real(pid)

    monkeypatch.setattr(process, "pid_status", counted)
    build = Path(h.tmp) / "stdin.sh"
    build.write_text("#!/bin/sh\nreadlink /proc/$$/fd/0\nexec sleep 30\n")
    build.chmod(0o755)
    refs = [h.spawn(build, socket=False) for _ in range(5)]
    assert polled == []
    for ref in refs:
        log = Path(h.tmp) / f"{ref.generation_uuid[:8]}.log"
        assert wait_for(lambda p=log: p.exists() and p.read_text() == "/dev/null\n"), log.read_text()
        assert str(ref.pid) in Path(ref.cgroup or "", "cgroup.procs").read_text().split()


def test_a_join_bell_refused_is_a_failed_spawn_with_nothing_left(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim's pipe refused (EMFILE: the agent's open-file limit) fails the spawn in one
    line: nothing started, its cgroup dropped, no descriptor of this process left open."""
    if h.b.mode != "cgroup":
        pytest.skip("the join's pipe is a cgroup matter")
    import runners.backend.process as process

    real, calls = os.pipe, []

    def second_refused() -> tuple[int, int]:  # the log pipe first, then the shim's
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real()

    build = Path(h.tmp) / "never.sh"
    build.write_text("#!/bin/sh\nexec sleep 30\n")
    build.chmod(0o755)
    h.spawn(build, socket=False)  # the log keeper is up: its own pipes are not counted below
    def open_fds() -> set[str]:  # (not the listing's own, closed by the time it is read)
        return {fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}

    before = open_fds()
    monkeypatch.setattr(process.os, "pipe", second_refused)
    with pytest.raises(SpawnError, match="EMFILE"):
        h.spawn(build, socket=False)
    monkeypatch.setattr(process.os, "pipe", real)
    assert len(calls) == 2
    kept = {str(fd) for fd, _ in h.b.logs.ends.values()} if h.b.logs else set()
    extra = open_fds() - before - kept  # the log pipe's copy is kept, as ever
    assert not extra, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in extra}
    cg = h.refs[-1].cgroup
    assert cg is not None and not os.path.exists(cg)


def test_build_that_joins_its_cgroup_and_exits_at_once_counts_as_run(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The join is polled by reading /proc/<pid>/cgroup, then the shim's status. An agent
    whose other threads hold the GIL can be paused between the two reads, long enough for
    the shim to join, exec the build and the build to exit: a zombie that had joined is a
    build that ran, never "could not join". The pause is widened here to make it certain."""
    if h.b.mode != "cgroup":
        pytest.skip("the join is a cgroup matter")
    import runners.backend.process as process

    real = process.pid_status

    def paused(pid: int) -> tuple[float, str] | None:
        time.sleep(0.1)  # the agent descheduled between the two reads
        return real(pid)

    monkeypatch.setattr(process, "pid_status", paused)
    build = Path(h.tmp) / "exit1.sh"
    build.write_text("#!/bin/sh\necho ran\nexit 1\n")
    build.chmod(0o755)
    for _ in range(3):
        ref = h.spawn(build, socket=False)  # raised "could not join cgroup (shim exit 1)"
        assert ref.pid is not None
        assert wait_for(lambda r=ref: h.b.exit_status(r.pid) is not None)
        assert h.b.exit_status(ref.pid) == 1
    assert (Path(h.tmp) / f"{ref.generation_uuid[:8]}.log").read_text() == "ran\n"
