"""Start order between hosts (`--after HOST`, `after = [...]`), through the CLI as a user
types it, against a real agent and real processes: a wake waits until the hosts it names
are awake and ready (and goes on waiting across a `kill -9` of the agent), a stop of a
named host is refused while its dependents are up (unless --force), several hosts wake in
order and stop in reverse, and a cycle or an unknown name is refused, nothing written."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Event, Generation, Host, Stop, Wake
from tests.conftest import HELLO, Vigil, wait_for

pytestmark = pytest.mark.timeout(120)


def events(v: Vigil, kind: str, host: str | None = None) -> list[Event]:
    q = select(Event).where(Event.kind == kind).order_by(Event.id)
    if host is not None:
        q = q.where(Event.host == host)
    return list(v.store.read(lambda s: s.execute(q).scalars().all()))


def procs_of(v: Vigil, host: str) -> list[int]:
    """Live processes of `host` (by the VIGIL_HOST every generation's process carries)."""
    import psutil

    out = []
    for pid in v.app_pids():
        try:
            if psutil.Process(pid).environ().get("VIGIL_HOST") == host:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def waiting(v: Vigil, host: str, on: list[str]) -> dict[str, Any]:
    wait_for(lambda: v.status(host)["state"] == "waiting", 20, what=f"{host} waiting")
    st = v.status(host)
    assert st["waiting_on"] == on and st["pid"] is None, st
    return st


def started_after(v: Vigil, host: str, dep: str) -> None:
    """`host` is awake, and its generation was written after `dep` was ready (its `woke`)."""
    wait_for(lambda: v.status(host)["state"] == "awake", 30, what=f"{host} awake")
    (ready,) = events(v, "woke", dep)
    gen = v.store.read(lambda s: s.get(Generation, v.status(host)["generation"]))
    assert gen.created_at >= ready.at, (gen.created_at, ready.at)
    assert events(v, "woke", host)[0].id > ready.id


def test_wake_waits_on_its_after_host_then_starts(vigil: Vigil) -> None:
    vigil.add_host("a")
    vigil.add_host("b", HELLO, "--after", "a")
    shown = vigil.json("host", "show", "b")
    assert shown["after"] == ["a"] and "after:" in vigil.run("host", "show", "b").stdout
    agent = vigil.start_agent()
    vigil.wait_ready(agent)

    assert "wake #" in vigil.run("wake", "b").stdout
    waiting(vigil, "b", ["a"])
    assert procs_of(vigil, "b") == []
    assert "waiting on a" in vigil.run("status", env={"COLUMNS": "200"}).stdout
    (row,) = [o for o in vigil.obligations() if o["host"] == "b"]
    assert (row["kind"], row["last_error"]) == ("wake", "waiting on a"), row
    assert len(events(vigil, "wake_waiting", "b")) == 1  # said once, not at every look

    vigil.run("wake", "a", "--wait")
    started_after(vigil, "b", "a")
    assert procs_of(vigil, "b")
    vigil.quiesce(20)
    vigil.check()
    w = vigil.store.read(lambda s: s.execute(select(Wake).where(Wake.host == "b")).scalar_one())
    assert w.waiting_on is None and w.state.value == "done", (w.waiting_on, w.state)


def test_a_waiting_wake_survives_kill_9_of_the_agent(vigil: Vigil) -> None:
    vigil.add_host("a")
    vigil.add_host("b", HELLO, "--after", "a")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "b")
    waiting(vigil, "b", ["a"])
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)

    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    # The new agent looks again (its drive of the wake says it still waits) and starts nothing.
    offset = len(vigil.agent_log())
    wait_for(lambda: b"host=b result=waiting" in vigil.agent_log()[offset:], 20,
             what="the new agent's look at b's wake")
    waiting(vigil, "b", ["a"])
    assert procs_of(vigil, "b") == []

    vigil.run("wake", "a")
    started_after(vigil, "b", "a")
    vigil.quiesce(20)
    vigil.check()


def test_a_stop_of_a_named_host_is_refused_while_its_dependent_is_up(vigil: Vigil) -> None:
    vigil.add_host("a")
    vigil.add_host("b", HELLO, "--after", "a")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "b", "a", "--wait")  # in the start order: a first
    started_after(vigil, "b", "a")
    a_pid = vigil.status("a")["pid"]

    cp = vigil.run("stop", "a", check=False)
    assert cp.returncode == 4, cp
    line = cp.stderr.strip()
    assert len(line.splitlines()) == 1 and "b starts after it" in line and "--force" in line, line
    st = vigil.status("a")
    assert (st["state"], st["desired"], st["pid"]) == ("awake", "up", a_pid), st
    assert not vigil.store.read(lambda s: s.execute(select(Stop)).scalars().all())

    # Both in one command: b (the dependent) is stopped first, a's stop waits for it.
    vigil.run("stop", "a", "b", "--wait")
    stopped = [e.host for e in events(vigil, "stopped")]
    assert stopped == ["b", "a"], stopped

    vigil.run("wake", "a", "b", "--wait")
    cp = vigil.run("stop", "a", "--force", "--wait")
    assert "host a stopped" in cp.stdout, cp.stdout
    assert vigil.status("a")["state"] == "asleep" and vigil.status("b")["state"] == "awake"
    vigil.quiesce(20)
    vigil.check()


def test_a_cycle_or_an_unknown_name_is_refused_at_add_and_set(vigil: Vigil) -> None:
    vigil.add_host("a")
    vigil.add_host("b", HELLO, "--after", "a")

    def hosts() -> dict[str, str]:
        return dict(vigil.store.read(lambda s: s.execute(select(Host.name, Host.start_after)).all()))

    before = hosts()
    for args, words in [
        (("host", "add", "c", "--build", str(HELLO), "--after", "c"), "cycle: c -> c"),
        (("host", "add", "c", "--build", str(HELLO), "--after", "nope"), "'nope', and no host"),
        (("host", "set", "a", "--after", "b"), "cycle: a -> b -> a"),
        (("host", "set", "b", "--after", "b"), "cycle: b -> b"),
    ]:
        cp = vigil.run(*args, check=False)
        assert cp.returncode == 2 and words in cp.stderr, (args, cp)
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr
        assert hosts() == before, args

    cp = vigil.run("host", "rm", "a", check=False)
    assert cp.returncode == 4 and "b start after it" in cp.stderr, cp
    vigil.run("host", "set", "b", "--unset", "after")
    assert json.loads(hosts()["b"]) == []
    vigil.run("host", "rm", "a")


HOSTS = """
[hosts.a]
build = "{hello}"
{a}
[hosts.b]
build = "{hello}"
after = {after}
{b}
"""


def write(path: Path, after: str = '["a"]', a: str = "", b: str = "", extra: str = "") -> str:
    path.write_text(HOSTS.format(hello=HELLO, after=after, a=a, b=b) + extra)
    return str(path)


def test_hosts_file_after_round_trips_and_apply_wakes_and_stops_in_order(
        vigil: Vigil, tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    out = vigil.run("apply", write(f)).stdout
    assert "+ add a" in out and "+ add b" in out, out
    assert vigil.json("host", "show", "b")["after"] == ["a"]
    assert vigil.run("apply", write(f)).stdout.split() == ["=", "keep", "a", "=", "keep", "b"]

    # A cycle, an unknown name: refused with file:line, nothing written; the dry run lists both.
    bad = write(f, a='after = ["b"]')
    cp = vigil.run("apply", bad, check=False)
    assert cp.returncode == 2 and "cycle: a -> b -> a" in cp.stderr and "hosts.toml:" in cp.stderr, cp
    assert vigil.json("host", "show", "a")["after"] == []
    cp = vigil.run("apply", "--dry-run", write(f, after='["a", "ghost"]', a='after = ["b"]'),
                   check=False)
    assert cp.returncode == 4, cp
    refusals = [ln for ln in cp.stdout.splitlines() if ln.startswith("! refused")]
    assert any("'ghost', and no host" in r for r in refusals), refusals
    assert any("cycle: a -> b -> a" in r for r in refusals), refusals

    # running = true for both, b first in the file: a is woken first, b after it is ready.
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("apply", write(f, a="running = true", b="running = true"))
    started_after(vigil, "b", "a")

    # a stopped while b stays up: refused before anything is written.
    cp = vigil.run("apply", write(f, a="running = false", b="drain_timeout = 3"), check=False)
    assert cp.returncode == 4 and "b starts after it" in cp.stderr, cp
    assert vigil.status("a")["desired"] == "up"
    assert vigil.json("host", "show", "b")["drain_timeout"] == 10.0

    # Both stopped: b first, then a.
    vigil.run("apply", write(f, a="running = false", b="running = false"))
    wait_for(lambda: len(events(vigil, "stopped")) == 2, 30, what="both stopped")
    assert [e.host for e in events(vigil, "stopped")] == ["b", "a"]
    vigil.quiesce(20)
    vigil.check()
