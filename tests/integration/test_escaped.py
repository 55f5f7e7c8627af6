"""Escaped descendants (issue 24 item 5) and what an app's environment carries (issue 20
items 18 and 19), through the real CLI and agent, in both containment modes.

tests/fixtures/escape.py forks a child that leaves the generation's session and cgroup and
re-execs with an empty environment: neither `cgroup.kill`, the session kill nor the marker
scan reaches it. It is recorded by the descendant walk and ended by the proof all the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, update

from models.states import GenState
from models.tables import Generation, KnownProcess
from runners.backend.cgroups import detect_cgroup_base
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

CGROUP = detect_cgroup_base("auto")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the escape fixture moves cgroups: root")


@pytest.fixture(params=["cgroup", "marker"])
def containment(request: pytest.FixtureRequest) -> str:
    if request.param == "cgroup" and CGROUP is None:
        pytest.skip("no delegated cgroup v2 with cgroup.kill on this box")
    return str(request.param)


@pytest.fixture
def ended() -> Iterator[list[int]]:
    """Pids a test started outside vigil's reach: killed by pid at the end, whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _escaped(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        env, cg = p.environ(), Path(f"/proc/{pid}/cgroup").read_text()
    except (psutil.Error, OSError):
        return False
    return env == {} and "vigil/" not in cg


def wake_escape(vigil: Vigil, tmp: Path, ended: list[int]) -> tuple[dict, int]:
    build = tmp / "esc"
    build.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FIXTURES / "escape.py"}"\n')
    build.chmod(0o755)
    pidfile = tmp / "escaped.pid"
    vigil.add_host("esc", build, "--env", f"FIXTURE_PIDFILE={pidfile}", "--drain-timeout", "1")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "esc", "--wait")
    st = vigil.status("esc")
    assert st["state"] == "awake", st
    child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10,
                         what="the escaped child's pidfile"))
    ended.append(child)
    wait_for(lambda: _escaped(child), 10, what="the child to leave its cgroup and environment")
    return st, child


def known_pids(vigil: Vigil, gen_id: int) -> set[int]:
    return set(vigil.store.read(lambda s: s.execute(select(KnownProcess.pid).where(
        KnownProcess.generation_id == gen_id)).scalars().all()))


def test_escaped_child_is_recorded_killed_and_proven_gone(vigil: Vigil, short_tmp: Path,
                                                          containment: str, ended: list[int]) -> None:
    st, child = wake_escape(vigil, short_tmp, ended)
    assert child in known_pids(vigil, st["generation"])  # the walk after health saw it
    assert child not in vigil.app_pids()  # no marker: the old scan cannot see it
    cgroup = vigil.store.read(lambda s: s.get(Generation, st["generation"]).cgroup)
    if containment == "cgroup":
        assert cgroup and child not in [int(x) for x in Path(cgroup, "cgroup.procs").read_text().split()]
    vigil.check()
    vigil.run("stop", "esc", "--wait")
    assert pid_dead(child), f"the escaped child {child} survived a stop that proved g{st['generation']} gone"
    vigil.quiesce(10)
    assert vigil.status("esc")["state"] == "asleep"
    vigil.check()


def test_check_flags_an_escaped_child_left_alive(vigil: Vigil, short_tmp: Path,
                                                 containment: str, ended: list[int]) -> None:
    st, child = wake_escape(vigil, short_tmp, ended)
    wait_for(lambda: child in known_pids(vigil, st["generation"]), 10, what="the record")
    for agent in vigil.agents:  # a proof that missed it, as before: the store says proven
        agent.kill()
        agent.wait(10)
    leader = st["pid"]
    os.kill(leader, signal.SIGKILL)
    wait_for(lambda: pid_dead(leader), 10, what="the leader to die")
    vigil.store.write(lambda s: s.execute(update(Generation).where(
        Generation.id == st["generation"]).values(state=GenState.proven)))
    cp = vigil.run("check", check=False)
    assert cp.returncode != 0
    assert "escaped_process" in cp.stdout + cp.stderr and f"pid {child}" in cp.stdout + cp.stderr, cp.stdout


def test_app_env_has_no_vigil_home_and_check_needs_none(vigil: Vigil, short_tmp: Path,
                                                        ended: list[int]) -> None:
    st, child = wake_escape(vigil, short_tmp, ended)
    env = psutil.Process(st["pid"]).environ()
    assert "VIGIL_HOME" not in env, sorted(env)
    assert env["VIGIL_GENERATION"] and env["VIGIL_SOCKET"]
    # A process of the agent's user carrying a proven generation's marker, and no
    # VIGIL_HOME: check finds it by the store's uuids.
    vigil.run("stop", "esc", "--wait")
    vigil.quiesce(10)
    uuid = vigil.store.read(lambda s: s.get(Generation, st["generation"]).uuid)
    stray = subprocess.Popen(["sleep", "120"], env={"VIGIL_GENERATION": uuid})
    ended.append(stray.pid)
    try:
        cp = vigil.run("check", check=False)
        assert cp.returncode != 0 and "stray_process" in cp.stdout + cp.stderr, cp.stdout
    finally:
        stray.kill()
        stray.wait(10)


def test_another_user_posing_as_a_generation_fails_nothing(vigil: Vigil, short_tmp: Path,
                                                           containment: str, ended: list[int]) -> None:
    st, _child = wake_escape(vigil, short_tmp, ended)
    vigil.run("stop", "esc", "--wait")
    vigil.quiesce(10)
    uuid = vigil.store.read(lambda s: s.get(Generation, st["generation"]).uuid)
    poser = subprocess.Popen(["sleep", "120"], user=65534, group=65534,
                             env={"VIGIL_GENERATION": uuid, "VIGIL_HOME": str(vigil.state_dir)})
    ended.append(poser.pid)
    try:
        wait_for(lambda: psutil.Process(poser.pid).environ().get("VIGIL_GENERATION") == uuid, 10,
                 what="the poser's exec")
        vigil.check()  # before the fix: stray_process ... proven gone
        if containment == "cgroup" and CGROUP is not None:
            assert os.stat(CGROUP).st_mode & 0o077 == 0, oct(os.stat(CGROUP).st_mode)
    finally:
        poser.kill()
        poser.wait(10)
