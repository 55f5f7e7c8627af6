"""The listening socket survives the agent: kill -9 at every crash point of the hand-over
(the first open: intent, bind, hand-over to the fd holder, written held; and the next
agent's recovery that finds it with the holder), restart, then deploy under load: no
request fails, and the socket's inode is the one it had before, in the store, the fd
holder and the app. Then kill -9 the agent and its holder together: the socket is copied
back out of the running generation (pidfd_getfd), same inode, and deploys go on. A real
gunicorn on a TCP port; both containments."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from runners.keepers.fdholder import holder_pid
from tests.conftest import Vigil, pid_dead, wait_for
from tests.listening import (
    Client,
    add_gunicorn,
    awake,
    free_port,
    reopened_events,
    serve_builds,
    serving_inode,
    stopped_with_a_lost_socket,
)

pytestmark = pytest.mark.timeout(600)

CHAINS = {
    "listen.opening": ("listen.opening",),
    "listen.bound": ("listen.bound",),
    "listen.handed": ("listen.handed",),
    "listen.held": ("listen.held",),
    "listen.recovered": ("listen.handed", "listen.recovered"),
}


def crash(v: Vigil, point: str, drive: bool, host: str = "web") -> None:
    before = v.ready_count()
    agent = v.start_agent(point)
    if drive:
        wait_for(lambda: agent.poll() is not None or v.ready_count() > before, 60,
                 what="crash agent ready")
        if agent.poll() is None:
            v.run("wake", host)
    try:
        rc = agent.wait(90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"agent did not die at {point}:\n"
                             f"{v.agent_log().decode()[-3000:]}") from None
    assert rc == -signal.SIGKILL, v.agent_log().decode()[-3000:]
    assert f"crash point={point}".encode() in v.agent_log()


def restart(v: Vigil) -> subprocess.Popen[bytes]:
    before = v.ready_count()
    agent = v.start_agent()
    v.wait_ready_after(agent, before, timeout=60)
    return agent


@pytest.mark.parametrize("containment", ["auto", "marker"])
@pytest.mark.parametrize("point", sorted(CHAINS))
def test_socket_survives_the_agent(vigil: Vigil, short_tmp: Path, point: str) -> None:
    builds = serve_builds(short_tmp)
    port = free_port()
    add_gunicorn(vigil, "web", builds[0], port)
    for i, at in enumerate(CHAINS[point]):
        crash(vigil, at, drive=i == 0)
    agent = restart(vigil)
    awake(vigil, "web", 120)
    inode = serving_inode(vigil, "web")
    with Client(port) as client:
        for i, mode in enumerate(("hold", "overlap")):
            vigil.run("deploy", "web", str(builds[(i + 1) % 2]), "--mode", mode, "--wait",
                      timeout=180)
            assert serving_inode(vigil, "web") == inode
        # kill -9 of the agent alone: the holder keeps the socket
        vigil.stop_agent(agent, signal.SIGKILL)
        agent = restart(vigil)
        vigil.run("deploy", "web", str(builds[0]), "--mode", "hold", "--wait", timeout=180)
        assert serving_inode(vigil, "web") == inode
        # kill -9 of the agent and its fd holder: copied back from the running generation
        holder = holder_pid(vigil.state_dir)
        assert holder
        vigil.stop_agent(agent, signal.SIGKILL)
        os.kill(holder, signal.SIGKILL)
        wait_for(lambda: pid_dead(holder), 10, what="the holder gone")
        agent = restart(vigil)
        assert holder_pid(vigil.state_dir) not in (None, holder)
        vigil.run("deploy", "web", str(builds[1]), "--mode", "hold", "--wait", timeout=180)
        assert serving_inode(vigil, "web") == inode
    print(f"\n{point}: {client.ok} answered, {len(client.failures)} failed")
    assert not client.failures, f"{len(client.failures)} failed: {client.failures[:5]}"
    vigil.quiesce(30)
    vigil.check()


@pytest.mark.parametrize("point", ["listen.opening", "listen.bound", "listen.handed",
                                   "listen.held"])
def test_a_reopen_cut_short_is_finished_once(vigil: Vigil, short_tmp: Path, point: str) -> None:
    """A lost socket's rebind, the agent killed at each step of it: the restarted agent
    finishes it, the host wakes, and `listener_reopened` is written exactly once."""
    port = free_port()
    first = stopped_with_a_lost_socket(vigil, f"tcp:127.0.0.1:{port}")
    for p in list(vigil.agents):
        vigil.stop_agent(p)
    crash(vigil, point, drive=True, host="app")
    restart(vigil)
    vigil.run("wake", "app")
    awake(vigil, "app", 120)
    assert serving_inode(vigil, "app") != first
    events = reopened_events(vigil)
    assert len(events) == 1 and "both died" in str(events[0]), events
    vigil.quiesce(30)
    vigil.check()
