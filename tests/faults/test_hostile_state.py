"""Corrupt and hostile state (issue 4 item 6).

(a) A database with a row in an impossible state -- two current generations for one host,
    made possible by dropping the partial unique index that forbids it: `vigil check` names
    it, the agent refuses to act on that host (no drive, no liveness retire, no adoption;
    the reason is on the host's obligations and in a `refused` event), the other hosts keep
    working, and once the rows are repaired the host's pending work goes through.
(b) Pid reuse: a current generation row whose pid now belongs to an unrelated live process
    (same pid, another start time): the agent never signals it, and treats the generation
    as gone (retired, proven) -- by the liveness sweep, by a stop, and by recovery.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, text, update

from models.states import GenState, HostKind, StopState
from models.tables import Event, Generation, Lease, Stop
from runners.backend.files import stage_build
from runners.base.pids import CTIME_TOLERANCE
from runners.cli.check import run_checks
from tests.conftest import Vigil, pid_dead, wait_for
from tests.model.apps import write_app
from tests.model.box import Box
from workflows.config import hosts
from workflows.generations.ending import ref_of
from workflows.lifecycle.stop import drive_stop, request_stop
from workflows.lifecycle.wake import request_wake

pytestmark = pytest.mark.timeout(120)


def add_host(v: Vigil, name: str, build: Path) -> None:
    """`vigil host add`, in-process (setup, not under test)."""
    path, digest = stage_build(str(build), v.state_dir)
    v.store.write(lambda s: hosts.add_host(
        s, name, kind=HostKind.instance, build_path=path, digest=digest, source=str(build),
        args=[], env={}, cwd=None, drain_timeout=0.5, health_timeout=5.0))


def same_process(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) <= CTIME_TOLERANCE and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def events(v: Vigil, kind: str, host: str) -> list[dict]:  # type: ignore[type-arg]
    rows = v.store.read(lambda s: s.execute(select(Event).where(
        Event.kind == kind, Event.host == host).order_by(Event.id)).scalars().all())
    return [json.loads(e.detail) for e in rows]


def sql(v: Vigil, stmt: str, **params: object) -> list[tuple]:
    """One statement in its own transaction, behind vigil's back (plain SQL, either dialect)."""
    with v.store.engine.begin() as conn:
        result = conn.execute(text(stmt), params)
        return [tuple(r) for r in result] if result.returns_rows else []


# -- (a) two current generations ----------------------------------------------------------


def test_host_with_two_current_generations_is_refused_others_keep_working(
        vigil: Vigil, short_tmp: Path) -> None:
    app = write_app(short_tmp, "good", "app")
    add_host(vigil, "bad", app)
    add_host(vigil, "fine", app)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "bad", "--wait", "--timeout", "30")
    (g1,) = [g for g in vigil.store.read(lambda s: s.execute(select(Generation)).scalars().all())]
    assert g1.state is GenState.current and g1.pid

    # The corruption: the index that makes it impossible is dropped, a second current
    # generation is written for the same host (no pid: nothing of it ever ran).
    sql(vigil, "DROP INDEX ux_generations_one_current")
    sql(vigil, """INSERT INTO generations (uuid, host, build_id, state, fence, agent_id,
                                           created_at, current_at)
                  SELECT 'bogus-0000-0000-0000-000000000000', host, build_id, 'current', fence,
                         agent_id, created_at, current_at FROM generations WHERE id = :id""",
        id=g1.id)
    ((g2,),) = sql(vigil, "SELECT max(id) FROM generations")

    # `vigil check` names it.
    cp = vigil.run("check", "--json", check=False)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    named = [v for v in json.loads(cp.stdout) if v["name"] == "one_current"]
    assert len(named) == 1 and "host bad" in named[0]["message"] and \
        f"g{g1.id}" in named[0]["message"] and f"g{g2}" in named[0]["message"], cp.stdout

    # The agent refuses to act on `bad`: its stop stays open with the reason, retried.
    vigil.run("stop", "bad")
    stop_row = wait_for(lambda: vigil.store.read(lambda s: s.execute(select(Stop).where(
        Stop.host == "bad", Stop.attempts >= 2)).scalar_one_or_none()), 20,
        what="the stop of bad to be refused twice")
    assert stop_row.state is StopState.queued
    assert "impossible state" in stop_row.last_error and f"g{g2}" in stop_row.last_error
    (view,) = [o for o in vigil.obligations() if o["host"] == "bad"]
    assert view["kind"] == "stop" and "impossible state" in view["last_error"]
    refused = events(vigil, "refused", "bad")
    assert len(refused) == 1 and "impossible state" in refused[0]["reason"], refused
    assert b"impossible state" in vigil.agent_log()

    # Meanwhile the other host is served as usual.
    vigil.run("wake", "fine", "--wait", "--timeout", "30")
    assert vigil.status("fine")["state"] == "awake"
    vigil.run("stop", "fine", "--wait", "--timeout", "30")
    assert vigil.status("fine")["state"] == "asleep"

    # The liveness sweep (every second) does not retire the pid-less bogus row either, and
    # nothing of `bad` was signalled.
    time.sleep(1.5)
    states = dict(sql(vigil, "SELECT id, state FROM generations WHERE host = 'bad'"))
    assert states == {g1.id: "current", g2: "current"}, states
    assert same_process(g1.pid, g1.create_time)

    # A restarted agent does not adopt or retire anything of it either.
    vigil.stop_agent(agent, signal.SIGKILL)
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    assert events(vigil, "recovered", None)[-1]["refused"] == 1  # type: ignore[arg-type]
    assert len(events(vigil, "refused", "bad")) == 2
    assert not events(vigil, "adopted", "bad")
    states = dict(sql(vigil, "SELECT id, state FROM generations WHERE host = 'bad'"))
    assert states == {g1.id: "current", g2: "current"}, states
    assert same_process(g1.pid, g1.create_time)

    # Repaired by hand: the pending stop goes through on its next retry.
    sql(vigil, "UPDATE generations SET state = 'proven' WHERE id = :id", id=g2)
    sql(vigil, "CREATE UNIQUE INDEX ux_generations_one_current ON generations (host) "
               "WHERE state = 'current'")
    wait_for(lambda: vigil.status("bad")["state"] == "asleep" and not vigil.obligations(), 20,
             what="the stop of bad to finish after the repair")
    assert pid_dead(g1.pid)
    assert vigil.store.read(lambda s: s.get(Lease, "bad")) is None
    vigil.check()


# -- (b) pid reuse --------------------------------------------------------------------------


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated live process (no vigil marker) whose pid the test plants in a row."""
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("by", ["sweep", "stop", "recovery"])
def test_generation_whose_pid_was_reused_is_never_signalled(
        short_tmp: Path, stranger: subprocess.Popen[bytes], by: str) -> None:
    box = Box(short_tmp, agent_id="hostile-agent", proof_wait=0.2)
    # Identity allows start times up to CTIME_TOLERANCE apart (the boot second can flip):
    # the stranger must have started well before the app it stands in for.
    born = psutil.Process(stranger.pid).create_time()
    wait_for(lambda: time.time() - born > CTIME_TOLERANCE + 2.5, 8, what="the stranger to age")
    try:
        box.add_host("app", write_app(short_tmp, "good", "app"), drain_timeout=0.3)
        box.store.write(lambda s: request_wake(s, "app"))
        box.quiesce()
        gen = box.currents()["app"]
        # The app dies; its pid is "reused" by the stranger (same pid, another start time).
        os.kill(gen.pid, signal.SIGKILL)
        wait_for(lambda: pid_dead(gen.pid), 5, what="the app to die")
        box.ctx.proc.reap()  # type: ignore[attr-defined]
        ctime = psutil.Process(stranger.pid).create_time()
        assert abs(ctime - gen.create_time) > CTIME_TOLERANCE
        box.store.write(lambda s: s.execute(update(Generation).where(Generation.id == gen.id)
                                            .values(pid=stranger.pid)))
        gen = box.store.read(lambda s: s.get(Generation, gen.id))
        # `vigil check` does not take the stranger for the leader.
        assert [v.name for v in run_checks(box.store, box.state_dir)] == ["current_alive"]
        # Nor does the process port: neither a TERM nor a KILL reaches it.
        ref = ref_of(gen)
        assert not box.ctx.proc.leader_alive(ref) and box.ctx.proc.proven(ref)
        box.ctx.proc.terminate(ref)
        box.ctx.proc.kill_all(ref)

        if by == "sweep":
            box.quiesce()  # the liveness sweep retires it and restarts the host
        elif by == "stop":
            sid = box.store.write(lambda s: request_stop(s, "app")).id
            drive_stop(box.ctx, sid)  # the stop itself, before any sweep
            assert box.store.read(lambda s: s.get(Stop, sid)).state is StopState.done
            box.quiesce()
        else:
            box.crash()  # a restarted agent's recovery does not adopt it
            box.quiesce()

        g = box.store.read(lambda s: s.get(Generation, gen.id))
        assert g.state is GenState.proven, g.state
        assert same_process(stranger.pid, ctime), "the stranger was signalled"
        assert stranger.poll() is None
        now = box.currents()
        if by == "stop":
            assert now == {}
        else:
            assert now["app"].id != gen.id and now["app"].pid != stranger.pid
        assert box.open_rows() == []
        assert run_checks(box.store, box.state_dir) == []
    finally:
        box.close()
    assert stranger.poll() is None
