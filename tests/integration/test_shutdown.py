"""`vigil shutdown --wait` (issue 22): every host stopped, the agent gone, the ports vigil
held closed (a connection is refused, not left hanging), the fd holder, log keeper and
fence keeper gone: nothing of vigil left running. The next start binds the ports again."""

from __future__ import annotations

import socket

import psutil
import pytest

from tests.conftest import FIXTURES, HELLO, Vigil
from tests.listening import free_port


def _vigil_processes(vigil: Vigil) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and "runners." in cmd and (
                str(vigil.state_dir) in cmd or p.pid in {a.pid for a in vigil.agents}):
            out.append(p)
    return out


def test_shutdown_leaves_nothing_of_vigil_running(vigil: Vigil) -> None:
    port = free_port()
    vigil.add_host("web", HELLO, "--listen", f"tcp:127.0.0.1:{port}")
    vigil.add_host("api", HELLO)
    vigil.add_host("job", FIXTURES / "worker.py", "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "--all", "--wait")
    assert len(vigil.app_pids()) >= 3

    cp = vigil.run("shutdown", "--wait", timeout=120)
    agent.wait(10)
    lines = cp.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("host ")] == [
        "host api stopped (proven gone)", "host job stopped (proven gone)",
        "host web stopped (proven gone)"], cp.stdout
    assert f"agent pid {agent.pid} stopped" in lines and "closed 1 listening socket(s)" in lines
    assert lines[-1] == f"nothing of vigil runs on {vigil.state_dir}"
    assert vigil.app_pids() == [] and _vigil_processes(vigil) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert vigil.status("web")["listeners"][0]["state"] == "lost"

    before = vigil.ready_count()  # the way back: the port is bound again at the next start
    vigil.wait_ready_after(vigil.start_agent(), before)
    vigil.run("wake", "web", "--wait")
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    reopened = [e for e in vigil.json("events", "web") if e["kind"] == "listener_reopened"]
    assert len(reopened) == 1 and "closed by `vigil shutdown`" in str(reopened[0]), reopened
    vigil.check()


def test_shutdown_without_an_agent(vigil: Vigil) -> None:
    """Nothing runs: the helpers' part alone. Something holds a lease: refused, one line."""
    vigil.add_host("api", HELLO)
    cp = vigil.run("shutdown", "--wait")
    assert cp.stdout.splitlines()[-1] == f"nothing of vigil runs on {vigil.state_dir}"
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "api", "--wait")
    vigil.stop_agent(agent)
    cp = vigil.run("shutdown", check=False)
    assert cp.returncode == 4, cp.stdout + cp.stderr
    assert "no agent is running on" in cp.stderr and "(api)" in cp.stderr
    assert "start it with `vigil agent start`, then `vigil shutdown` again" in cp.stderr
