"""The store out of room or out of reach (issue 16 item 15), for real: the state dir on a
small tmpfs filled to its last few KiB; PostgreSQL out of reach behind a TCP proxy of the
test's own that the test stops and starts (the shared server itself is never stopped).

Nothing is lost, the app keeps serving, commands say what is wrong in one line, and the
agent says it once (then once a minute) and once when the store is back, never with a
traceback, and keeps retrying with its ordinary backoff: the next deploy goes through."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from models.tables import Attempt
from tests.conftest import FIXTURES, HELLO, Vigil, drop_db, new_db, wait_for
from tests.faults.test_store_damage import agent_lines
from tests.integration.test_cli_bad_input import refused
from tests.integration.test_deploy_outcomes import get, variant

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.backend("the store out of reach or out of room")]


def serves(v: Vigil, host: str = "hello") -> None:
    reply = get(v.state_dir / "run" / f"{host}.sock")
    assert reply.startswith("HTTP/1.0 200"), reply


def outcomes(v: Vigil) -> list[object]:
    return v.store.read(lambda s: s.execute(select(Attempt.outcome)).scalars().all())


def no_tracebacks(v: Vigil) -> None:
    log = v.agent_log().decode()
    assert "Traceback" not in log, log[-4000:]
    assert "apscheduler" not in log, log[-4000:]


# -- a full filesystem --------------------------------------------------------------------


@pytest.fixture
def small_disk(short_tmp: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted at the state dir (unmounted at teardown, after the box's
    processes are gone: the fixture that uses it tears down first)."""
    d = short_tmp / "state"
    d.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(d)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def full_box(small_disk: Path) -> Iterator[Vigil]:
    v = Vigil(small_disk, {"VIGIL_CONTAINMENT": "auto"})
    v.run("db", "upgrade")
    try:
        yield v
    finally:
        v.cleanup()


def fill(d: Path, leave: int = 16 * 1024) -> Path:
    """Fill the filesystem of `d` to its last `leave` bytes."""
    path = d / "fill"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (1 << 20, 64 << 10, 4 << 10, 512):
            block = b"\0" * chunk
            try:
                while os.write(fd, block) == chunk:
                    pass
            except OSError:
                pass
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)
    return path


@pytest.mark.sqlite_only("the SQLite store on the full filesystem (PostgreSQL's disk is the server's)")
def test_full_disk_is_one_line_the_app_serves_and_the_next_deploy_goes_through(
        full_box: Vigil, short_tmp: Path) -> None:
    v = full_box
    v.add_host("hello")
    agent = v.start_agent()
    v.wait_ready(agent)
    v.run("wake", "hello", "--wait", "--timeout", "60")
    v.store.dispose()
    v2, v3 = variant(HELLO, short_tmp / "v2.py", "v2"), variant(HELLO, short_tmp / "v3.py", "v3")

    # A command meets the full disk: one line naming the filesystem and the fix, nothing
    # half-staged left behind, no row written.
    filler = fill(v.state_dir)
    refused(v.run("deploy", "hello", str(v2), check=False), "is full", str(v.state_dir), "df -h")
    assert not list((v.state_dir / "builds").glob("*/.*.tmp*"))
    assert outcomes(v) == []
    serves(v)

    # The agent meets it: a deploy written while there was room (the agent paused), then
    # the disk fills again before the agent runs it.
    agent.send_signal(signal.SIGSTOP)
    filler.unlink()
    v.run("deploy", "hello", str(v2))
    filler = fill(v.state_dir)
    agent.send_signal(signal.SIGCONT)
    wait_for(lambda: agent_lines(v, "store trouble kind=full"), 30, what="the agent to say it")
    time.sleep(6)  # the disk stays full: the agent keeps retrying, quietly
    said = agent_lines(v, "store trouble")
    assert len(said) == 1, said
    assert "is full" in said[0] and "df -h" in said[0] and "retries by itself" in said[0], said
    no_tracebacks(v)
    serves(v)
    assert agent.poll() is None

    # Room again: the agent says so once and finishes; the next deploy goes through.
    filler.unlink()
    wait_for(lambda: None not in outcomes(v), 60,
             what="the deploy written before the disk filled to end")
    out = v.run("deploy", "hello", str(v3), "--wait", "--timeout", "60")
    assert "done" in out.stdout, out.stdout
    serves(v)
    wait_for(lambda: agent_lines(v, "store back kind=full"), 30, what="the agent to say it is back")
    assert len(agent_lines(v, "store back")) == 1
    no_tracebacks(v)
    v.check()


def test_full_disk_while_staging_is_one_line(full_box: Vigil, short_tmp: Path) -> None:
    """Staging a build copies it into the state dir: ENOSPC there is one line too."""
    v = full_box
    v.add_host("hello")
    fill(v.state_dir, leave=0)
    before = sorted(p.name for p in (v.state_dir / "builds").iterdir())
    refused(v.run("deploy", "hello", str(variant(HELLO, short_tmp / "v2.py", "v2")),
                  check=False), "is full", "df -h")
    refused(v.run("host", "add", "other", "--build", str(variant(HELLO, short_tmp / "v4.py", "v4")),
                  check=False), "is full")
    assert sorted(p.name for p in (v.state_dir / "builds").iterdir()) == before


# -- PostgreSQL out of reach ----------------------------------------------------------------


class Proxy:
    """The test's own TCP proxy in front of the shared PostgreSQL server: stopping it is an
    outage for whoever connects through it, and no one else."""

    def __init__(self, target_host: str, target_port: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.target = (target_host, target_port)
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FIXTURES / "tcp_proxy.py"),
                                      str(self.port), self.target[0], str(self.target[1])],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # every connection through it drops at once
            self.proc.wait(10)
            self.proc.stdout.close()  # type: ignore[union-attr]
            self.proc = None


@pytest.fixture
def outage_box(short_tmp: Path) -> Iterator[tuple[Vigil, Proxy]]:
    """A box whose agent and CLI reach PostgreSQL only through a proxy of this test."""
    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    real = new_db(state)
    u = sa.make_url(real)
    proxy = Proxy(u.host or "127.0.0.1", u.port or 5432)
    proxy.start()
    v = Vigil(state, {"VIGIL_CONTAINMENT": "auto"},
              shared_db=u.set(port=proxy.port).render_as_string(hide_password=False))
    try:
        v.run("db", "upgrade")
        yield v, proxy
    finally:
        v.cleanup()
        proxy.stop()
        drop_db(real)


@pytest.mark.postgresql_only("PostgreSQL out of reach under a running agent")
def test_store_outage_is_one_warning_each_way_and_the_next_deploy_goes_through(
        outage_box: tuple[Vigil, Proxy], short_tmp: Path) -> None:
    v, proxy = outage_box
    v.add_host("hello")
    agent = v.start_agent()
    v.wait_ready(agent)
    v.run("wake", "hello", "--wait", "--timeout", "60")
    v.store.dispose()

    proxy.stop()  # the store goes away for 5 s (well inside the lease's 30 s)
    wait_for(lambda: agent_lines(v, "store trouble kind=unreachable"), 20,
             what="the agent to say the store is gone")
    refused(v.run("status", check=False), "cannot reach the PostgreSQL database",
            "PostgreSQL is up")
    serves(v)
    time.sleep(5)
    proxy.start()
    wait_for(lambda: agent_lines(v, "store back kind=unreachable"), 30,
             what="the agent to say the store is back")
    assert len(agent_lines(v, "store trouble")) == 1, agent_lines(v, "store trouble")
    assert len(agent_lines(v, "store back")) == 1, agent_lines(v, "store back")
    assert not agent_lines(v, "LISTEN"), agent_lines(v, "LISTEN")
    no_tracebacks(v)
    serves(v)
    out = v.run("deploy", "hello", str(variant(HELLO, short_tmp / "v2.py", "v2")), "--wait",
                "--timeout", "60")
    assert "done" in out.stdout, out.stdout
    serves(v)
    no_tracebacks(v)
    v.check()


@pytest.mark.sqlite_only("the SQLite store on the full filesystem (PostgreSQL's disk is the server's)")
def test_disk_full_mid_deploy_is_said_as_such_not_as_a_restart(full_box: Vigil,
                                                                short_tmp: Path) -> None:
    """The disk fills while a deploy waits for its successor's health (issue 20 item 12):
    the attempt's end says the store's disk was full, never that the agent restarted (it
    did not)."""
    v = full_box
    gate = short_tmp / "gate"
    v.add_host("hello", HELLO, "--env", f"GATE={gate}", "--env", f"THEN={HELLO}")
    agent = v.start_agent()
    v.wait_ready(agent)
    v.run("wake", "hello", "--wait", "--timeout", "60")
    gated = short_tmp / "gated.py"
    gated.write_bytes((FIXTURES.parent / "multibox" / "gated.py").read_bytes())
    gated.chmod(0o755)
    first = v.status("hello")["pid"]
    out = v.run("deploy", "hello", str(gated)).stdout
    attempt_id = int(next(w for w in out.split() if w.startswith("#"))[1:])
    wait_for(lambda: v.store.read(lambda s: s.get(Attempt, attempt_id)).successor_id is not None
             and v.store.read(lambda s: s.get(Attempt, attempt_id)).step.value == "spawned",
             30, what="the successor spawned")
    v.store.dispose()
    filler = fill(v.state_dir, leave=0)
    gate.touch()
    wait_for(lambda: agent_lines(v, "store trouble kind=full"), 30, what="the agent to say it")
    # The disk stays full until the deploy's own drive was cut short by it (not only, say,
    # the heartbeat's write): else the deploy may go through once space is back.
    wait_for(lambda: agent_lines(v, f"drive kind=attempt id={attempt_id} host=hello "
                                    "result=cut_short"), 60, what="the deploy's drive to fail")
    filler.unlink()
    wait_for(lambda: v.store.read(lambda s: s.get(Attempt, attempt_id)).outcome is not None, 60,
             what="the attempt to end")
    a = v.store.read(lambda s: s.get(Attempt, attempt_id))
    print(a.reason)
    assert "restarted" not in (a.reason or ""), a.reason
    assert "this agent's last try of it stopped there: the store failed (full: " in (a.reason or ""), a.reason
    assert agent.poll() is None
    v.quiesce(60)  # written again (cause resumed), as after a restart: it goes through
    assert v.status("hello")["state"] == "awake" and v.status("hello")["pid"] != first
    no_tracebacks(v)
    v.check()
