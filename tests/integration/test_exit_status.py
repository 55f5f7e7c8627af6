"""How an app's leader ended, through the CLI (issue 22 item 5): its `exited` event, the
restart it queued, `vigil status` (table and JSON) and the metrics say `exited 3`,
`exited 137 (SIGKILL)` (a shell that lost its child to SIGKILL), `killed by SIGKILL`, or
`exited (status unknown)` for a leader this agent did not spawn (adopted: only a parent
learns a status)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for
from tests.integration.test_operator import scrape, value
from tests.listening import free_port

JOB = FIXTURES / "job.py"  # runs argv[1] seconds, exits argv[2]


def exited(v: Vigil, host: str, n: int = 1) -> list[dict]:
    """The host's first `n` `exited` events that carry a status, waited for."""
    def got() -> list[dict]:
        es = [e for e in v.json("events", host) if e["kind"] == "exited" and "status" in e["detail"]]
        return es if len(es) >= n else []
    return wait_for(got, 30, what=f"{n} exited event(s) of {host}")


def restart_reasons(v: Vigil, host: str) -> list[str]:
    return [e["detail"]["reason"] for e in v.json("events", host) if e["kind"] == "restart_scheduled"]


def test_a_workers_exit_code_and_a_shells_lost_child(vigil: Vigil, short_tmp: Path) -> None:
    shell = short_tmp / "lost-child"
    shell.write_text("#!/bin/sh\nsleep 0.5\nsh -c 'kill -9 $$'\n")  # the shell exits 137
    shell.chmod(0o755)
    vigil.add_host("three", JOB, "--kind", "worker", "--arg", "0.5", "--arg", "3",
                   "--restart-floor", "30")
    vigil.add_host("lost", shell, "--kind", "worker", "--restart-floor", "30")
    port = free_port()
    vigil.wait_ready(vigil.start_agent(None, "--metrics-listen", f"127.0.0.1:{port}"))
    vigil.run("wake", "three", "lost")
    (three,), (lost,) = exited(vigil, "three"), exited(vigil, "lost")
    assert (three["detail"]["status"], three["detail"]["exit_code"]) == ("exited 3", 3)
    assert three["detail"]["reason"] == "leader exited 3"
    assert lost["detail"]["status"] == "exited 137 (SIGKILL)", lost
    wait_for(lambda: restart_reasons(vigil, "three"), 30, what="the restart of three")
    assert restart_reasons(vigil, "three") == ["exited 3"]
    assert "status=exited 3" in vigil.run("events", "three").stdout
    for host, line in (("three", "exited 3"), ("lost", "exited 137 (SIGKILL)")):
        st = vigil.json("status", host)[0]
        assert st["last_exit"]["status"] == line and st["last_exit"]["generation"], st
        table = vigil.run("status", host, env={"COLUMNS": "200"}).stdout
        row = next((r for r in table.splitlines() if f" {host} " in r), table)
        assert f"{line} " in row and "restart in " in row, table  # waits out its 30 s floor
    m = wait_for(lambda: (m := scrape(port)) and m, 30, what="a scrape")
    assert value(m, "vigil_app_exits_total", status="exited 3") == 1
    assert value(m, "vigil_app_exits_total", status="exited 137 (SIGKILL)") == 1
    vigil.run("stop", "three", "lost", "--wait")
    vigil.check()


def test_a_killed_instance_then_an_adopted_one(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    first = vigil.status("hello")
    os.kill(first["pid"], signal.SIGKILL)
    (killed,) = exited(vigil, "hello")
    assert killed["generation"] == first["generation"]
    assert killed["detail"]["status"] == "killed by SIGKILL"
    assert killed["detail"]["reason"] == "leader killed by SIGKILL"
    assert killed["detail"]["exit_code"] == -signal.SIGKILL
    wait_for(lambda: vigil.status("hello")["state"] == "awake"
             and vigil.status("hello")["generation"] != first["generation"], 30,
             what="the restart")
    assert vigil.json("status", "hello")[0]["last_exit"]["status"] == "killed by SIGKILL"

    # A new agent adopts the running generation: it is not the leader's parent.
    assert vigil.stop_agent(agent) == 0
    before = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), before)
    adopted = vigil.status("hello")
    os.kill(adopted["pid"], signal.SIGKILL)
    wait_for(lambda: pid_dead(adopted["pid"]), 10, what="the adopted leader dead")
    (_, unknown) = exited(vigil, "hello", 2)
    assert unknown["generation"] == adopted["generation"]
    assert unknown["detail"]["status"] == "exited (status unknown)"
    assert unknown["detail"]["exit_code"] is None
    wait_for(lambda: vigil.json("status", "hello")[0]["last_exit"]["status"]
             == "exited (status unknown)", 30, what="status to say so")
    vigil.quiesce(30)
    vigil.check()
