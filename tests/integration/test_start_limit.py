"""A crash loop that gives up, and every exit heard (issue 39 items 5 and 6), on real
processes and a real agent: a worker that crashes 0.3 s after each start, with a start limit
of 3 in 60 s, is `failed` at its third quick exit (no restart queued), a `failed`
notification reaches a real command, and `vigil retry` brings it back; each restart delay
lies within ±20 % of the policy's; a single `kill -9` of an app sends `exited` (and, once
it is back, `restarted`); an app killed at its real memory limit shows `oom`; `restart
--wait` returns only once the new generation has settled, and fails when it dies first."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from runners.cli.topview import cells
from tests.conftest import FIXTURES, HELLO, Vigil, pid_dead, wait_for
from tests.integration.test_limits import needs
from tests.integration.test_notifications import receiver

CRASH = FIXTURES / "crash_soon.py"
WORKER = FIXTURES / "worker.py"
HOG = FIXTURES / "hog.py"


def kinds(vigil: Vigil, host: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in vigil.json("events", host) if e["kind"] == kind]


def received(got: Path) -> list[str]:
    """The event kinds the receiver was sent, in order."""
    return [line.split()[1] for line in got.read_text().splitlines()] if got.exists() else []


@pytest.mark.backend("the start limit's window and failed mark are written in the exit's "
                     "transaction, and retry's clear in the wake's")
def test_a_start_limit_fails_the_host_notifies_and_retry_brings_it_back(
        vigil: Vigil, short_tmp: Path) -> None:
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "failed,exited,restarted", "--exec", command)
    vigil.add_host("w", CRASH, "--kind", "worker", "--start-limit", "3/60",
                   "--restart-floor", "0.2", "--restart-cap", "5")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w")
    failed = wait_for(lambda: kinds(vigil, "w", "failed"), 30, what="the start limit's failed")
    assert failed[0]["detail"]["start_limit"] == "3/60" and failed[0]["detail"]["quick_exits"] == 3
    vigil.quiesce(20)
    vigil.check()  # failed, wanted up and not running: no invariant broken, no lease kept
    st = vigil.status("w")
    assert st["state"] == "failed" and st["generation"] is None and st["lease"] is None, st
    assert [o for o in vigil.obligations() if o["kind"] == "wake"] == []  # no restart queued
    # Two restarts before it gave up, each delay within ±20 % of floor * 2**n.
    delays = [e["detail"]["delay"] for e in kinds(vigil, "w", "restart_scheduled")]
    assert len(delays) == 2, delays
    for n, d in enumerate(delays):
        assert 0.2 * 2 ** n * 0.8 - 0.001 <= d <= 0.2 * 2 ** n * 1.2 + 0.001, delays
    wait_for(lambda: "failed" in received(got), 20, what="the failed notification")
    kinds_sent = received(got)
    assert kinds_sent.count("exited") == 3 and kinds_sent.count("restarted") == 2, kinds_sent
    assert "failed" in vigil.run("status").stdout

    out = vigil.run("retry", "w").stdout
    assert "failed cleared, wake #" in out, out
    cleared = wait_for(lambda: kinds(vigil, "w", "failed_cleared"), 10, what="failed_cleared")
    assert cleared[0]["detail"]["by"] == "retry"
    wait_for(lambda: any(e["id"] > cleared[0]["id"] for e in kinds(vigil, "w", "woke")), 20,
             what="the host woken again")
    wait_for(lambda: len(kinds(vigil, "w", "failed")) == 2, 30, what="it gives up again")
    vigil.run("stop", "w", "--wait")
    vigil.stop_agent(agent)


@pytest.mark.parametrize("kind", ["worker", "instance"])
def test_a_single_kill_9_sends_exited_then_restarted(vigil: Vigil, short_tmp: Path,
                                                     kind: str) -> None:
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "exited,restarted,crashloop", "--exec", command)
    vigil.add_host("w", WORKER if kind == "worker" else HELLO, "--kind", kind)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    pid = vigil.status("w")["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: received(got) == ["exited", "restarted"], 20,
             what="exited, then restarted, sent for one kill -9")
    (ex,) = kinds(vigil, "w", "exited")
    assert ex["detail"]["status"] == "killed by SIGKILL", ex
    assert pid_dead(pid)
    vigil.run("stop", "w", "--wait")
    vigil.quiesce(20)
    assert received(got) == ["exited", "restarted"]  # a stop is not an exit heard
    vigil.stop_agent(agent)


@pytest.mark.parametrize("containment", ["auto"])
def test_an_app_killed_at_its_memory_limit_shows_oom(vigil: Vigil) -> None:
    needs("memory")
    vigil.add_host("w", HOG, "--kind", "worker", "--env", "HOG=memory:200", "--memory-max", "64M",
                   "--restart-floor", "5")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w")
    ex = wait_for(lambda: [e for e in kinds(vigil, "w", "exited") if "status" in e["detail"]],
                  30, what="the exited event")
    assert ex[0]["detail"]["status"] == "oom", ex
    assert kinds(vigil, "w", "oom_killed")[0]["generation"] == ex[0]["generation"]
    row = vigil.status("w")
    assert row["last_exit"]["status"] == "oom", row
    shown = vigil.run("status").stdout  # the table's last column while the restart waits
    assert "oom" in shown and "SIGKILL" not in shown, shown
    glance = {**row, "restarts": {}, "obligations": []}  # what `top` and the page draw
    assert cells(glance, False)[1:] and "oom" in cells(glance, False)[-1], cells(glance, False)
    vigil.run("stop", "w", "--wait")
    vigil.stop_agent(agent)


def test_restart_wait_returns_once_the_new_generation_settled(vigil: Vigil, short_tmp: Path) -> None:
    flag = short_tmp / "crash"
    vigil.add_host("w", CRASH, "--kind", "worker", "--env", f"CRASH_FLAG={flag}",
                   "--env", "CRASH_AFTER=0.5", "--restart-floor", "30")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    before = vigil.status("w")["generation"]
    out = vigil.run("restart", "w", "--wait", "--settle", "1").stdout
    assert "settled (current 1s)" in out, out
    after = vigil.status("w")
    assert after["generation"] > before and after["state"] == "awake", after
    flag.touch()  # the next generation exits 0.5 s after its start: the attempt is done first
    bad = vigil.run("restart", "w", "--wait", "--settle", "3", check=False)
    assert bad.returncode != 0, bad.stdout
    assert "generation g" in bad.stderr and "did not settle: exited 3" in bad.stderr, bad.stderr
    assert "attempt #" in bad.stdout and " done " in bad.stdout, bad.stdout  # done, not settled
    flag.unlink()
    vigil.run("stop", "w", "--wait")
    vigil.stop_agent(agent)


def test_a_start_limit_is_set_by_add_set_and_the_hosts_file_and_refused_in_one_line(
        vigil: Vigil, short_tmp: Path) -> None:
    from tests.integration.test_cli_bad_input import dump

    vigil.add_host("w", WORKER, "--kind", "worker", "--start-limit", "5/60")
    assert vigil.json("host", "show", "w")["start_limit"] == "5/60"
    before = dump(vigil)
    for args, says in ((("host", "add", "x", "--build", str(WORKER), "--start-limit", "0/60"),
                        "--start-limit '0/60' is not N/SECONDS"),
                       (("host", "set", "w", "--start-limit", "5"), "is not N/SECONDS")):
        cp = vigil.run(*args, check=False)
        assert cp.returncode == 2 and says in cp.stderr, cp.stderr
        assert len(cp.stderr.strip().splitlines()) == 1 and "5/60" in cp.stderr, cp.stderr
    assert dump(vigil) == before
    vigil.run("host", "set", "w", "--start-limit", "3/30.0")
    assert vigil.json("host", "show", "w")["start_limit"] == "3/30"
    vigil.run("host", "set", "w", "--unset", "start-limit")
    assert vigil.json("host", "show", "w")["start_limit"] is None

    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.jobs]\nbuild = "{WORKER}"\nkind = "worker"\nstart_limit = "4/20"\n')
    vigil.run("apply", str(f))
    assert vigil.json("host", "show", "jobs")["start_limit"] == "4/20"
    f.write_text(f'[hosts.jobs]\nbuild = "{WORKER}"\nkind = "worker"\nstart_limit = 4\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 2 and ":4: hosts.jobs.start_limit" in cp.stderr, cp.stderr
    assert 'start_limit = "5/60"' in cp.stderr


def test_a_deploy_or_a_wake_brings_a_failed_host_back(vigil: Vigil) -> None:
    vigil.add_host("w", CRASH, "--kind", "worker", "--start-limit", "2/60",
                   "--restart-floor", "0.2")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w")
    wait_for(lambda: vigil.status("w")["state"] == "failed", 30, what="failed")
    vigil.run("deploy", "w", str(CRASH))
    cleared = wait_for(lambda: kinds(vigil, "w", "failed_cleared"), 10, what="cleared by the deploy")
    assert cleared[0]["detail"]["by"] == "deploy (release)", cleared
    wait_for(lambda: len(kinds(vigil, "w", "failed")) == 2, 30, what="failed again")
    vigil.run("wake", "w")
    wait_for(lambda: [e for e in kinds(vigil, "w", "failed_cleared") if e["detail"]["by"] == "wake"],
             10, what="cleared by the wake")
    vigil.run("stop", "w", "--wait")
    vigil.stop_agent(agent)
