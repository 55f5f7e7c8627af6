"""A host's own stop signal and stop command (issue 39 item 1), on real processes: an app
that ignores SIGTERM and drains on SIGQUIT is stopped within its drain without SIGKILL, by
a stop, by the drain after an overlap deploy, and after the agent died before it sent the
signal; a stop command runs as the app's user with its env and MAINPID; one that hangs or
fails still ends in SIGKILL and the proof at the drain deadline, said in an event; bad
input is one line and changes nothing. nginx with --stop-signal QUIT: test_nginx_quit.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Event
from tests.conftest import FIXTURES, HELLO, Vigil, ignores_sigterm, pid_dead, wait_for
from tests.integration.test_cli_bad_input import refused

QUITTER = FIXTURES / "quit_drains.py"
DRAIN = "30"  # far above what a QUIT takes: a stop that waited for it would show


def events(v: Vigil, kind: str, host: str) -> list[dict[str, Any]]:
    return v.store.read(lambda s: [
        {"generation": e.generation_id, **json.loads(e.detail)}
        for e in s.execute(select(Event).where(Event.host == host, Event.kind == kind)
                           .order_by(Event.id)).scalars()])


def awake_pid(v: Vigil, host: str) -> int:
    st = v.status(host)
    assert st["state"] == "awake" and st["pid"], st
    wait_for(lambda: ignores_sigterm(st["pid"]), 10, what="fixture ignoring SIGTERM")
    return int(st["pid"])


def stopped(v: Vigil, host: str, *pids: int) -> None:
    for pid in pids:
        assert pid_dead(pid), f"pid {pid} still alive after the stop"
    v.quiesce(10)
    assert v.status(host)["state"] == "asleep"
    assert v.app_pids() == []
    v.check()


def test_quit_stops_an_app_that_ignores_term_without_sigkill(vigil: Vigil, short_tmp: Path) -> None:
    mark = short_tmp / "quit.log"
    vigil.add_host("quits", QUITTER, "--stop-signal", "SIGQUIT", "--drain-timeout", DRAIN,
                   "--env", f"QUIT_MARK={mark}")
    assert vigil.json("host", "show", "quits")["stop_signal"] == "QUIT"
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "quits", "--wait")
    pid = awake_pid(vigil, "quits")
    started = time.monotonic()
    vigil.run("stop", "quits", "--wait")
    took = time.monotonic() - started
    assert took < 10, f"the stop took {took:.1f}s: QUIT was not what it was sent"
    assert mark.read_text() == f"quit pid={pid}\n"  # exited by its own handler, not SIGKILL
    stopped(vigil, "quits", pid)

    # The drain of the retiring generation after an overlap deploy asks it the same way.
    vigil.run("wake", "quits", "--wait")
    old = awake_pid(vigil, "quits")
    new_build = short_tmp / "quit2.py"
    new_build.write_bytes(QUITTER.read_bytes() + b"\n# build 2\n")
    new_build.chmod(0o755)
    vigil.run("deploy", "quits", str(new_build), "--wait")
    wait_for(lambda: pid_dead(old), 10, what="the retiring generation gone")
    assert f"quit pid={old}\n" in mark.read_text()
    swapped = events(vigil, "swapped", "quits")[-1]
    assert swapped["drain_seconds"] < 10, swapped
    vigil.run("stop", "quits", "--wait")
    vigil.stop_agent(agent)


def test_the_signal_is_sent_by_the_agent_that_recovers(vigil: Vigil, short_tmp: Path) -> None:
    """The agent dies with the stop's intent written and nothing sent: the next one sends
    the host's signal, not SIGTERM."""
    mark = short_tmp / "quit.log"
    vigil.add_host("quits", QUITTER, "--stop-signal", "QUIT", "--drain-timeout", DRAIN,
                   "--env", f"QUIT_MARK={mark}")
    agent = vigil.start_agent("stop.intent")
    vigil.wait_ready(agent)
    vigil.run("wake", "quits", "--wait")
    pid = awake_pid(vigil, "quits")
    vigil.run("stop", "quits")
    wait_for(lambda: agent.poll() is not None, 20, what="the agent's death at stop.intent")
    assert not pid_dead(pid) and not mark.exists()
    before = vigil.ready_count()
    started = time.monotonic()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    wait_for(lambda: vigil.status("quits")["state"] == "asleep", 20, what="the stop done")
    assert time.monotonic() - started < 15
    assert mark.read_text() == f"quit pid={pid}\n"
    stopped(vigil, "quits", pid)
    vigil.stop_agent(agent)


def test_a_stop_command_runs_as_the_app_with_its_env(vigil: Vigil, short_tmp: Path) -> None:
    out = short_tmp / "stopcmd.out"
    mark = short_tmp / "quit.log"
    command = f'echo "$GREETING $MAINPID $VIGIL_HOST $(id -u)" > {out}; kill -QUIT $MAINPID'
    vigil.add_host("own", QUITTER, "--stop-command", command, "--drain-timeout", DRAIN,
                   "--env", "GREETING=bye", "--env", f"QUIT_MARK={mark}")
    shown = vigil.run("host", "show", "own").stdout
    assert f"stop command:       {command}" in shown and "stop signal:        TERM" in shown, shown
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "own", "--wait")
    pid = awake_pid(vigil, "own")
    started = time.monotonic()
    vigil.run("stop", "own", "--wait")
    assert time.monotonic() - started < 10
    assert out.read_text() == f"bye {pid} own {os.getuid()}\n"
    assert mark.read_text() == f"quit pid={pid}\n"
    said = events(vigil, "stop_command", "own")
    assert [e["outcome"] for e in said] == ["exit 0"], said
    stopped(vigil, "own", pid)
    vigil.stop_agent(agent)


@pytest.mark.parametrize("containment", ["auto", "marker"], indirect=True)
def test_a_stop_command_that_hangs_or_fails_still_ends_in_sigkill(vigil: Vigil) -> None:
    """The command runs in the generation's containment (its cgroup, or its marker), so the
    drain deadline's SIGKILL and the proof reach it too."""
    vigil.add_host("hangs", QUITTER, "--stop-command", "echo waiting; sleep 600",
                   "--drain-timeout", "1.5")
    vigil.add_host("fails", QUITTER, "--stop-command", "echo no such way >&2; exit 3",
                   "--drain-timeout", "1.5")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    for host in ("hangs", "fails"):
        vigil.run("wake", host, "--wait")
        pid = awake_pid(vigil, host)
        started = time.monotonic()
        vigil.run("stop", host, "--wait")
        took = time.monotonic() - started
        assert 1.4 <= took < 15, f"{host}: the stop took {took:.2f}s, not the 1.5 s drain"
        stopped(vigil, host, pid)  # the leader and the command (in its containment) gone
    assert [e["outcome"] for e in events(vigil, "stop_command", "hangs")] == ["still running: waiting"]
    assert [e["outcome"] for e in events(vigil, "stop_command", "fails")] == ["exit 3: no such way"]
    vigil.stop_agent(agent)


def test_bad_stop_settings_are_one_line_and_change_nothing(vigil: Vigil, short_tmp: Path) -> None:
    refused(vigil.run("host", "add", "bad", "--build", str(HELLO), "--stop-signal", "BOGUS",
                      check=False), "--stop-signal 'BOGUS' is not a signal", "kill -l")
    refused(vigil.run("host", "add", "bad", "--build", str(HELLO), "--stop-signal", "STOP",
                      check=False), "SIGSTOP freezes")
    refused(vigil.run("host", "add", "bad", "--build", str(HELLO), "--stop-command", " ",
                      check=False), "--stop-command is blank")
    assert vigil.json("host", "list") == []

    vigil.add_host("web", HELLO, "--stop-signal", "3")  # a number is its name
    assert vigil.json("host", "show", "web")["stop_signal"] == "QUIT"
    refused(vigil.run("host", "set", "web", "--stop-signal", "SIGNOPE", check=False),
            "host set web: --stop-signal", "is not a signal")
    assert vigil.json("host", "show", "web")["stop_signal"] == "QUIT"
    dry = vigil.run("host", "set", "web", "--stop-signal", "int", "--dry-run").stdout
    assert 'stop_signal "QUIT" -> "INT"' in dry and "dry run" in dry, dry
    assert vigil.json("host", "show", "web")["stop_signal"] == "QUIT"
    vigil.run("host", "set", "web", "--stop-command", "kill -TERM $MAINPID")
    assert vigil.json("host", "show", "web")["stop_command"] == "kill -TERM $MAINPID"
    vigil.run("host", "set", "web", "--unset", "stop-signal", "--unset", "stop-command")
    shown = vigil.json("host", "show", "web")
    assert (shown["stop_signal"], shown["stop_command"]) == ("TERM", None)
    assert "nothing to change" in vigil.run("host", "set", "web", "--stop-signal", "TERM",
                                            "--dry-run").stdout

    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.web]\nbuild = "{HELLO}"\nstop_signal = 99\n')
    refused(vigil.run("apply", str(f), check=False), "hosts.toml:3: hosts.web.stop_signal",
            "is not a signal")
    f.write_text(f'[hosts.web]\nbuild = "{HELLO}"\nstop_command = ["nginx", "-s", "quit"]\n')
    refused(vigil.run("apply", str(f), check=False), "hosts.toml:3: hosts.web.stop_command",
            "must be a string")
    assert vigil.json("host", "show", "web")["stop_signal"] == "TERM"
    f.write_text(f'[hosts.web]\nbuild = "{HELLO}"\nstop_signal = "SIGQUIT"\n'
                 'stop_command = "nginx -s quit"\n')
    vigil.run("apply", str(f))
    shown = vigil.json("host", "show", "web")
    assert (shown["stop_signal"], shown["stop_command"]) == ("QUIT", "nginx -s quit")


def test_scale_down_and_shutdown_ask_with_the_stop_signal(vigil: Vigil, short_tmp: Path) -> None:
    """A scale-down's stop of one instance and shutdown's stops send QUIT too: each instance
    exits by its own handler, long before the drain timeout."""
    from tests.listening import free_port

    mark = short_tmp / "quit.log"
    vigil.add_host("pair", QUITTER, "--listen", f"http=tcp:127.0.0.1:{free_port()}",
                   "--ready", "http", "--instances", "2", "--stop-signal", "QUIT",
                   "--drain-timeout", DRAIN, "--env", f"QUIT_MARK={mark}")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "pair", "--wait")
    wait_for(lambda: len(vigil.app_pids()) == 2, 30, what="two instances")
    pids = sorted(vigil.app_pids())
    for pid in pids:
        wait_for(lambda: ignores_sigterm(pid), 10, what="fixture ignoring SIGTERM")  # noqa: B023
    started = time.monotonic()
    vigil.run("scale", "pair", "1", "--wait")
    wait_for(lambda: len(vigil.app_pids()) == 1, 20, what="one instance left")
    assert time.monotonic() - started < 10
    (left,) = vigil.app_pids()
    (gone,) = set(pids) - {left}
    assert mark.read_text() == f"quit pid={gone}\n"
    started = time.monotonic()
    vigil.run("shutdown", "--wait", timeout=120)
    agent.wait(10)
    assert time.monotonic() - started < 15
    assert mark.read_text() == f"quit pid={gone}\nquit pid={left}\n"
    assert vigil.app_pids() == []


def test_a_stop_command_runs_as_the_app_s_user(vigil: Vigil, short_tmp: Path) -> None:
    """With --user, the stop command is that user too (setpriv after the cgroup join, as the
    app's own spawn): its output, in the event, says who it was."""
    if os.geteuid() != 0:
        pytest.skip("running apps as other users needs a root agent")
    from tests.integration.test_run_as import PATH, ensure_user

    ensure_user("vigil-t1")
    os.chmod(short_tmp, 0o755)  # mkdtemp's 0700 would keep the app's user out of its build
    vigil.add_host("theirs", QUITTER, "--user", "vigil-t1", "--env", PATH, "--env", "GREETING=bye",
                   "--stop-command", 'echo "$(id -un) $GREETING $USER"; kill -QUIT "$MAINPID"',
                   "--drain-timeout", DRAIN)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "theirs", "--wait")
    pid = awake_pid(vigil, "theirs")
    started = time.monotonic()
    vigil.run("stop", "theirs", "--wait")
    assert time.monotonic() - started < 10
    said = events(vigil, "stop_command", "theirs")
    assert [e["outcome"] for e in said] == ["exit 0: vigil-t1 bye vigil-t1"], said
    stopped(vigil, "theirs", pid)
    vigil.stop_agent(agent)


@pytest.mark.parametrize("containment", ["auto", "marker"], indirect=True)
def test_a_hanging_stop_command_and_an_agent_killed_after_it_started(vigil: Vigil) -> None:
    """The agent dies at stop.termed, its stop command still running in the containment:
    the next agent runs the command again (the row says how to stop, not whether the last
    ask got through) and, at the deadline counted from the first ask, SIGKILL ends the app
    and both commands; nothing of the generation is left."""
    vigil.add_host("hangs", QUITTER, "--stop-command", "sleep 600", "--drain-timeout", "4")
    agent = vigil.start_agent("stop.termed")
    vigil.wait_ready(agent)
    vigil.run("wake", "hangs", "--wait")
    pid = awake_pid(vigil, "hangs")
    asked = time.monotonic()
    vigil.run("stop", "hangs")
    wait_for(lambda: agent.poll() is not None, 20, what="the agent's death at stop.termed")
    assert not pid_dead(pid) and len(vigil.app_pids()) > 1  # the app and its stop command
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    wait_for(lambda: vigil.status("hangs")["state"] == "asleep", 30, what="the stop done")
    took = time.monotonic() - asked
    assert 3.9 <= took < 20, f"the stop ended {took:.1f}s after it was asked (drain 4 s)"
    said = events(vigil, "stop_command", "hangs")
    assert [e["outcome"] for e in said] == ["still running"], said
    stopped(vigil, "hangs", pid)
    vigil.stop_agent(agent)
