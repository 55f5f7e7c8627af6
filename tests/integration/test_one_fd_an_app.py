"""One descriptor an app in the agent (issue 42 item 5): the log pipe's read end is kept by
the log keeper and copied by its standby, not by the agent, which holds only each leader's
pidfd. Scaled down from 10,000 apps under a hard limit of 20,000: 200 apps under a hard
limit of 300, where two descriptors an app would not fit. The apps start, and what each
writes reaches its log while the agent is dead (kill -9) and after a new one adopts them."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from models.states import GenState
from models.tables import Generation
from tests.conftest import ROOT, Vigil, pid_dead, wait_for

pytestmark = pytest.mark.timeout(600)
APPS, LIMIT = 200, 300  # 2 x 200 > 300: a second fd an app would not fit
POKED = """#!/bin/sh
echo "up $$"
trap 'echo "poked $$"; kill $s' USR1
while :; do sleep 3600 & s=$!; wait $s; done
"""


def agent_under_limit(v: Vigil) -> subprocess.Popen[bytes]:
    log = open(v.state_dir / "agent.out", "ab")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--safety-interval", "1"],
                         env=v.env, stdout=log, stderr=log, cwd=ROOT,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (LIMIT, LIMIT)))
    log.close()
    v.agents.append(p)  # ended by the fixture, by pid
    return p


def leaders(v: Vigil) -> dict[str, int]:
    return dict(v.store.read(lambda s: s.execute(
        select(Generation.host, Generation.pid).where(Generation.state == GenState.current,
                                                      Generation.pid.is_not(None))).all()))


def logged(v: Vigil, host: str, line: str) -> bool:
    return any(line in p.read_text(errors="replace")
               for p in (v.state_dir / "logs" / host).glob("g*.log*"))


def poke_all(v: Vigil, pids: dict[str, int], what: str) -> None:
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    wait_for(lambda: all(logged(v, h, f"poked {pid}") for h, pid in pids.items()), 120,
             interval=0.5, what=what)


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_200_apps_under_a_limit_of_300_keep_their_logs_across_a_kill(
        vigil: Vigil, short_tmp: Path) -> None:
    build = short_tmp / "poked"
    build.write_text(POKED)
    build.chmod(0o755)
    hosts = short_tmp / "hosts.toml"
    hosts.write_text("".join(f'[hosts.w{i:03d}]\nbuild = "{build}"\nkind = "worker"\n\n'
                             for i in range(APPS)))
    vigil.run("apply", str(hosts))
    agent = agent_under_limit(vigil)
    vigil.wait_ready(agent)
    vigil.run("wake", "--all", "--wait", timeout=300)
    pids = leaders(vigil)
    assert len(pids) == APPS
    wait_for(lambda: all(logged(vigil, h, f"up {pid}") for h, pid in pids.items()), 60,
             interval=0.5, what="every app's first line in its log")
    assert "too many open files" not in vigil.agent_log().decode().lower()
    # One fd an app and what every agent has (store, sockets, helpers): not two an app.
    wait_for(lambda: fds_of(agent.pid) < APPS + 64, 30, what="the agent's copies let go")

    agent.kill()
    agent.wait(10)
    poke_all(vigil, pids, "every app's line written while no agent runs, in its log")

    before = vigil.ready_count()
    again = agent_under_limit(vigil)
    vigil.wait_ready_after(again, before, 60)
    vigil.quiesce(60)
    assert leaders(vigil) == pids  # all adopted: none restarted
    assert fds_of(again.pid) < APPS + 64
    poke_all(vigil, pids, "every app's line after the new agent adopted it, in its log")
    again.terminate()
    assert again.wait(30) == 0
    assert not any(pid_dead(p) for p in pids.values())  # the apps outlive the agent
