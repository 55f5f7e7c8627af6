"""Worker wakes started as a group (workflows/lifecycle/wake_group.py): one commit of every
intent, the spawns in turn, one commit of every pid. A real agent dies (VIGIL_CRASH_AT) at
the group's first intent point, between its spawns, and after its shared commit of pids;
at each, every process it spawned belongs to a generation the store already held (intent
before spawn), and a clean agent then brings every host up, exactly one current each, with
nothing left over and `vigil check` passing."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from models.states import GenState
from models.tables import Generation
from runners.base.doorbell import ring
from tests.conftest import FIXTURES, Vigil, schema_template, store_uuids, wait_for
from workflows.lifecycle.wake import request_wake

pytestmark = pytest.mark.timeout(120)

HOSTS = 6  # one group (GROUP is 16): every wake of them is driven together
WORKER = FIXTURES / "worker.py"


@pytest.fixture
def vigil(short_tmp: Path, containment: str) -> Vigil:
    v = Vigil(short_tmp / "state", {"VIGIL_CONTAINMENT": containment}, template=schema_template())
    try:
        yield v  # type: ignore[misc]
    finally:
        v.cleanup()


def names() -> list[str]:
    return [f"grp{os.getpid()}-{i}" for i in range(HOSTS)]


def carrying(v: Vigil) -> dict[int, tuple[str, int, float, str]]:
    """Live processes carrying a generation of this box's hosts (their VIGIL_HOST, and a
    build staged under its state dir): pid -> (uuid, parent pid, start time, cmdline)."""
    hosts, home = set(names()), str(v.state_dir)
    out = {}
    for p in psutil.process_iter(["pid"]):
        try:
            env, cmd = p.environ(), p.cmdline()
            if env.get("VIGIL_HOST") in hosts and p.status() != psutil.STATUS_ZOMBIE \
                    and any(home in a for a in cmd):
                out[p.pid] = (env.get("VIGIL_GENERATION", ""), p.ppid(), p.create_time(),
                              " ".join(cmd)[-120:])
        except (psutil.Error, OSError):
            continue
    return out


def spawned_for(v: Vigil) -> dict[int, str]:
    """The processes vigil spawned for this box's hosts: pid -> generation uuid. A process
    whose parent carries the same generation is that process's fork (an interpreter's
    launcher may fork while it starts: pyenv's bash shim does), not a spawn of its own; two
    spawns of one generation would be two roots, and fail the test."""
    procs = carrying(v)
    roots = {pid: u for pid, (u, ppid, _, _) in procs.items()
             if procs.get(ppid, ("",))[0] != u}
    twice = Counter(roots.values())
    assert all(n == 1 for n in twice.values()), f"a generation spawned twice: {procs}"
    return roots


def wake_all(v: Vigil) -> None:
    """Every host added and woken with the agent down: the first round finds them all due."""
    for name in names():
        v.add_host(name, WORKER, "--kind", "worker", "--drain-timeout", "2")
    v.store.write(lambda s: [request_wake(s, name) for name in names()])


@pytest.mark.parametrize("point", ["wake.intent", "wake.spawned#3", "wake.recorded"])
def test_group_wake_crash_keeps_intent_before_spawn(vigil: Vigil, point: str) -> None:
    wake_all(vigil)
    p = vigil.start_agent(point)
    ring(vigil.state_dir)
    p.wait(60)
    assert b"crash point=" in vigil.agent_log(), vigil.agent_log().decode()[-3000:]
    gens = vigil.store.read(lambda s: s.execute(select(Generation.uuid, Generation.state)).all())
    running = spawned_for(vigil)
    # Intent before spawn: each process ran under a generation row committed before it.
    assert set(running.values()) <= store_uuids(vigil.state_dir, vigil.db_url), (running, gens)
    # The group's intents are one commit: all of them written before the first spawn.
    assert len(gens) == HOSTS, gens
    if point == "wake.intent":
        assert running == {} and all(g.state is GenState.spawning for g in gens), gens
    elif point == "wake.spawned#3":  # with every carrying process, to tell spawns from forks
        assert len(running) == 3, (running, carrying(vigil))
    else:
        assert all(g.state is GenState.current for g in gens), gens
    clean = vigil.start_agent()
    vigil.wait_ready(clean)
    ring(vigil.state_dir)
    vigil.quiesce(60)
    currents = vigil.store.read(lambda s: s.execute(select(Generation.host, Generation.pid).where(
        Generation.state == GenState.current)).all())
    assert sorted(h for h, _ in currents) == sorted(names()), currents
    wait_for(lambda: sorted(spawned_for(vigil)) == sorted(pid for _, pid in currents), 20,
             what="exactly the current generations' processes alive")
    vigil.check()
