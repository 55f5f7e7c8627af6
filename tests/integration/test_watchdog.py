"""The watchdog (`--watchdog SECONDS`) on real processes: a worker of the test's own pings
WATCHDOG=1 on the NOTIFY_SOCKET the agent binds for it, as sd_notify(3) would; told to hang
(a file naming its pid) it stops pinging and is restarted within the period + 1 s; told to
say WATCHDOG=trigger it is restarted at once; one that keeps pinging is never restarted, also
across a 5 s `kill -9` outage of the agent (its pings are refused while no agent binds the
socket: the restarted agent gives it a full period)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from models.states import GenState
from models.tables import Event, Generation, Watchdog
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

WORKER = """#!{python}
import json, os, signal, socket, sys, time
here = {here!r}
pid = os.getpid()
usec = int(os.environ["WATCHDOG_USEC"])
def put(name, text):  # whole or not at all: the test reads it as soon as it is there
    with open(os.path.join(here, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(here, name + ".tmp"), os.path.join(here, name))
put(f"env-{{pid}}", json.dumps({{k: os.environ.get(k) for k in ("WATCHDOG_USEC", "WATCHDOG_PID", "NOTIFY_SOCKET")}}))
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
def say(line):
    try:
        s.sendto(line.encode(), os.environ["NOTIFY_SOCKET"])
        return True
    except OSError:
        return False  # no agent binds it right now (it was killed): tried again next time
last = None
while True:
    if os.path.exists(os.path.join(here, f"hang-{{pid}}")):
        if os.path.exists(os.path.join(here, "stubborn")):  # deaf to SIGABRT and SIGTERM
            signal.signal(signal.SIGABRT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        put(f"hung-{{pid}}", str(last))
        time.sleep(3600)
    if os.path.exists(os.path.join(here, f"trigger-{{pid}}")):
        say("WATCHDOG=trigger")
        time.sleep(3600)
    if say("WATCHDOG=1"):
        last = time.time()
    time.sleep(min(usec / 1e6 / 4, 0.2))
"""


def worker(tmp: Path) -> Path:
    path = tmp / "pinger.py"
    path.write_text(WORKER.format(python=sys.executable, here=str(tmp)))
    path.chmod(0o755)
    return path


def events(vigil: Vigil, kind: str, host: str) -> list[Any]:
    return vigil.store.read(lambda s: s.execute(
        select(Event).where(Event.kind == kind, Event.host == host).order_by(Event.id))
        .scalars().all())


def running(vigil: Vigil, host: str) -> tuple[int | None, int | None]:
    st = vigil.status(host)
    return st["generation"], st["pid"]


def start(vigil: Vigil, tmp: Path, period: str, *extra: str) -> tuple[Any, int, int]:
    vigil.add_host("pinger", worker(tmp), "--kind", "worker", "--watchdog", period,
                   "--restart-floor", "0.1", *extra)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "pinger", "--wait")
    gen, pid = running(vigil, "pinger")
    assert gen is not None and pid is not None
    return agent, gen, pid


def restarted(vigil: Vigil, gen: int) -> bool:
    now, pid = running(vigil, "pinger")
    return now is not None and now != gen and pid is not None


def test_a_worker_that_stops_pinging_is_restarted_within_its_period(
        vigil: Vigil, short_tmp: Path) -> None:
    agent, gen, pid = start(vigil, short_tmp, "2")
    env = json.loads(wait_for(lambda: (short_tmp / f"env-{pid}").exists()
                              and (short_tmp / f"env-{pid}").read_text()))
    assert env["WATCHDOG_USEC"] == "2000000" and env["WATCHDOG_PID"] == str(pid), env
    assert env["NOTIFY_SOCKET"].endswith(f"/n{gen}.sock")
    wait_for(lambda: vigil.store.read(lambda s: s.get(Watchdog, gen).deadline) is not None,
             what="the watchdog armed")
    (short_tmp / f"hang-{pid}").touch()
    hung = wait_for(lambda: (short_tmp / f"hung-{pid}").exists()
                    and (short_tmp / f"hung-{pid}").read_text(), what="the worker hung")
    last_ping = float(hung)
    wait_for(lambda: restarted(vigil, gen), 10, interval=0.02, what="the restart")
    took = time.time() - last_ping
    assert took <= 2 + 1, f"restarted {took:.2f}s after its last ping (watchdog 2 s)"
    (fired,) = events(vigil, "watchdog", "pinger")
    assert fired.generation_id == gen and json.loads(fired.detail)["reason"] == "no WATCHDOG=1 within 2s"
    exited = [e for e in events(vigil, "exited", "pinger") if e.generation_id == gen]
    assert exited and json.loads(exited[0].detail)["reason"].startswith("watchdog: "), exited
    wait_for(lambda: pid_dead(pid), 10, what="the hung worker gone")
    vigil.quiesce(30)
    vigil.check()
    vigil.stop_agent(agent)


def test_an_app_deaf_to_sigabrt_is_ended_by_the_stop_path(vigil: Vigil, short_tmp: Path) -> None:
    """SIGABRT first; an app that ignores it (and SIGTERM) is drained, SIGKILLed and proven
    gone like any stopped generation, then restarted."""
    (short_tmp / "stubborn").touch()
    agent, gen, pid = start(vigil, short_tmp, "1", "--drain-timeout", "1")
    wait_for(lambda: (short_tmp / f"env-{pid}").exists(), what="the worker up")
    (short_tmp / f"hang-{pid}").touch()
    wait_for(lambda: restarted(vigil, gen), 15, interval=0.05, what="the restart")
    assert pid_dead(pid), "the new generation runs while the old one lives"
    (fired,) = events(vigil, "watchdog", "pinger")
    assert json.loads(fired.detail)["reason"] == "no WATCHDOG=1 within 1s"
    assert vigil.store.read(lambda s: s.get(Generation, gen).state) is GenState.proven
    vigil.quiesce(30)
    vigil.check()
    vigil.stop_agent(agent)


def test_watchdog_trigger_restarts_at_once(vigil: Vigil, short_tmp: Path) -> None:
    agent, gen, pid = start(vigil, short_tmp, "60")
    wait_for(lambda: (short_tmp / f"env-{pid}").exists(), what="the worker up")
    asked = time.time()
    (short_tmp / f"trigger-{pid}").touch()
    wait_for(lambda: restarted(vigil, gen), 10, interval=0.02, what="the restart")
    assert time.time() - asked < 5, "a trigger restarts at once, not at its 60 s deadline"
    (fired,) = events(vigil, "watchdog", "pinger")
    assert json.loads(fired.detail)["reason"] == "the app sent WATCHDOG=trigger"
    wait_for(lambda: pid_dead(pid), 10, what="the triggered worker gone")
    vigil.quiesce(30)
    vigil.check()
    vigil.stop_agent(agent)


def steady(vigil: Vigil, gen: int, pid: int, seconds: float) -> None:
    """For `seconds`: still the same generation and pid, and no watchdog fired."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert running(vigil, "pinger") == (gen, pid), "restarted while it kept pinging"
        assert not events(vigil, "watchdog", "pinger")
        time.sleep(0.1)


def test_a_pinging_worker_is_never_restarted_even_across_an_agent_outage(
        vigil: Vigil, short_tmp: Path) -> None:
    agent, gen, pid = start(vigil, short_tmp, "2")
    steady(vigil, gen, pid, 2 * 2 + 1)  # two full periods and a margin

    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)
    time.sleep(5)  # the outage itself: its length is the scenario, not a wait for a state
    assert not pid_dead(pid)
    before = vigil.ready_count()
    back = time.time()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    steady(vigil, gen, pid, 2 + 1.5)  # a full period from its return, and a margin
    # Its pings reach the new agent: the stored deadline moved past the re-armed one.
    deadline = vigil.store.read(lambda s: s.get(Watchdog, gen).deadline)
    assert deadline is not None
    assert (deadline - deadline.utcfromtimestamp(back)).total_seconds() > 2, deadline
    vigil.stop_agent(agent)


def test_a_stalled_agent_does_not_fire_a_pinging_worker(vigil: Vigil, short_tmp: Path) -> None:
    """The agent frozen (SIGSTOP) past the period while the worker pings on: its pings wait
    in the socket, and count once the agent goes on, before any deadline is judged."""
    agent, gen, pid = start(vigil, short_tmp, "2")
    wait_for(lambda: vigil.store.read(lambda s: s.get(Watchdog, gen).deadline) is not None,
             what="the watchdog armed")
    agent.send_signal(signal.SIGSTOP)
    try:
        time.sleep(4)  # the stall itself: its length is the scenario
    finally:
        agent.send_signal(signal.SIGCONT)
    steady(vigil, gen, pid, 2 + 1)
    vigil.stop_agent(agent)


def test_bad_watchdog_values_are_refused_with_one_line(vigil: Vigil, short_tmp: Path) -> None:
    build = worker(short_tmp)
    for value, line in (("0", "--watchdog must be a positive number of seconds"),
                        ("0.2", "--watchdog 0.2s is shorter than the shortest watchdog"),
                        ("inf", "--watchdog must be a positive number of seconds"),
                        ("soon", "--watchdog must be a positive number of seconds up to 86400 (a day), not soon")):
        cp = vigil.run("host", "add", "w", "--build", str(build), "--kind", "worker",
                       "--watchdog", value, check=False)
        assert cp.returncode != 0 and line in cp.stderr, (value, cp.stderr)
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert vigil.json("host", "list") == []

    vigil.add_host("w", build, "--kind", "worker", "--watchdog", "3")
    shown = vigil.json("host", "show", "w")
    assert shown["watchdog"] == 3.0
    cp = vigil.run("host", "set", "w", "--watchdog", "0.1", check=False)
    assert cp.returncode != 0 and "shorter than the shortest watchdog" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert vigil.json("host", "show", "w")["watchdog"] == 3.0
    vigil.run("host", "set", "w", "--unset", "watchdog")
    assert vigil.json("host", "show", "w")["watchdog"] is None

    hosts = short_tmp / "hosts.toml"
    hosts.write_text(f'[hosts.w]\nbuild = "{build}"\nkind = "worker"\nwatchdog = -1\n')
    cp = vigil.run("apply", str(hosts), check=False)
    assert cp.returncode != 0 and "watchdog" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    hosts.write_text(f'[hosts.w]\nbuild = "{build}"\nkind = "worker"\nwatchdog = 4.5\n')
    vigil.run("apply", str(hosts))
    assert vigil.json("host", "show", "w")["watchdog"] == 4.5


def test_an_instance_slow_to_be_ready_is_watched_once_it_serves(
        vigil: Vigil, short_tmp: Path) -> None:
    """Its row outlives the readiness check (the generation `running`, not yet current), and
    it is armed once the generation serves."""
    vigil.add_host("slow", FIXTURES / "pinger.py", "--listen", f"unix:{short_tmp / 'l.sock'}",
                   "--ready", "exec:sleep 6", "--watchdog", "2")  # past a re-read (5 s)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "slow", "--wait")
    gen, pid = running(vigil, "slow")
    assert gen is not None
    wait_for(lambda: (row := vigil.store.read(lambda s: s.get(Watchdog, gen))) is not None
             and row.deadline is not None, what="its watchdog armed")
    until = time.monotonic() + 2 + 1.5
    while time.monotonic() < until:  # it pings: never fired
        assert running(vigil, "slow") == (gen, pid)
        time.sleep(0.1)
    assert not events(vigil, "watchdog", "slow")
    vigil.stop_agent(agent)
