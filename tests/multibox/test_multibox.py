"""Several boxes on one PostgreSQL store (issue 6): each test runs real agents, one per
state dir standing for a box, on this machine, with a short lease TTL (conftest)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from datetime import UTC
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from models.states import GenState, HostKind, StopState
from models.store import utcnow
from models.tables import Agent, Build, Event, Generation, Host, Lease, Stop
from runners.backend.files import stage_build
from runners.base.wakeup import notify_boxes
from tests.conftest import HELLO, wait_for
from tests.multibox.conftest import LEASE_TTL, Box, Sampler
from workflows.config.hosts import add_host
from workflows.lifecycle.wake import request_wake

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.postgresql_only("several boxes share one PostgreSQL store")]

RENEW_EVERY = LEASE_TTL / 6
# Rows two agents drain together: enough that both claim at once for many rounds.
DRAINED = 2000 if os.environ.get("VIGIL_LONG") == "1" else 300
GATED = Path(__file__).parent / "gated.py"


def add_hosts(box: Box, names: list[str], placed: str) -> None:
    """The first host through the CLI (`--box` per box), the rest in one transaction."""
    flags = [f for b in placed.split(",") for f in ("--box", b)]
    box.run("host", "add", names[0], "--build", str(HELLO), *flags)
    path, digest = stage_build(str(HELLO), box.state_dir)
    box.store.write(lambda s: [add_host(
        s, n, kind=HostKind.instance, build_path=path, digest=digest, source=str(HELLO),
        args=[], env={}, cwd=None, drain_timeout=2.0, health_timeout=30.0, box=placed)
        for n in names[1:]])


def wake_all(box: Box, names: list[str]) -> None:
    box.store.write(lambda s: [request_wake(s, n) for n in names])
    notify_boxes(box.store)


def leases(box: Box) -> dict[str, str]:
    return dict(box.store.read(lambda s: s.execute(select(Lease.host, Lease.holder)).all()))


def serving(box: Box, names: list[str], on: set[str]) -> bool:
    """Every host has a current generation made by one of `on`, which holds its lease (one
    query: this is polled while agents work)."""
    rows = dict(box.store.read(lambda s: s.execute(
        select(Generation.host, Generation.agent_id).join(Lease, Lease.host == Generation.host)
        .where(Generation.state == GenState.current, Lease.holder == Generation.agent_id)).all()))
    return all(rows.get(n) in on for n in names)


def event_times(box: Box, kind: str) -> list[float]:
    ats = box.store.read(lambda s: s.execute(select(Event.at).where(Event.kind == kind)).scalars().all())
    return sorted(a.replace(tzinfo=UTC).timestamp() for a in ats)


def test_takeover_after_kill9_never_two_live_generations(boxes) -> None:  # type: ignore[no-untyped-def]
    """50 hosts placed on two boxes: each served by exactly one; kill -9 one agent: its
    keeper fences its apps before the lease expires, and the other box takes the hosts over
    only after the TTL. No sampled instant has two live generations of one host."""
    a, b = boxes("a"), boxes("b")
    names = [f"h{i:02d}" for i in range(50)]
    add_hosts(a, names, "a,b")
    a.start()
    b.start()
    wake_all(a, names)
    wait_for(lambda: serving(a, names, {"a", "b"}), 180, interval=0.5, what="50 hosts awake")

    owner = leases(a)
    procs = {x.name: x.app_procs() for x in (a, b)}
    for n in names:  # served by exactly one agent: one process, on the lease holder's box
        assert [x for x in procs if n in procs[x]] == [owner[n]], (n, owner[n], procs)
        assert len(set(procs[owner[n]][n].values())) == 1  # one generation
    counts = Counter(owner.values())
    victim, survivor = (a, b) if counts["a"] >= counts["b"] else (b, a)
    moved = sorted(n for n in names if owner[n] == victim.name)
    print(f"hosts per box: {dict(counts)}; killing {victim.name}")

    with Sampler([a, b]) as sampler:
        killed_at = time.time()
        victim.agent().send_signal(signal.SIGKILL)
        victim.agent().wait(10)
        wait_for(lambda: serving(a, names, {survivor.name}), 120, interval=0.5,
                 what=f"{survivor.name} serving every host")
        print(f"takeover complete {time.time() - killed_at:.1f}s after the kill, "
              f"{sampler.samples} samples")
    assert not sampler.double, sampler.double[:10]

    taken = event_times(a, "taken_over")
    assert len(taken) == len(moved)
    first = taken[0]
    # Only after the TTL: the lease was last renewed at most one renewal before the kill.
    assert first - killed_at >= LEASE_TTL - RENEW_EVERY - 0.5, first - killed_at
    # The victim's apps were fenced by its keeper before anything was taken over.
    assert victim.name in sampler.last_alive or not moved
    assert sampler.last_alive.get(victim.name, 0) < first, (sampler.last_alive, first)
    assert not victim.app_procs()


def test_stopped_agent_loses_its_leases_and_acts_on_nothing(boxes) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP an agent past its TTL, mid-health-check of a wake: its keeper fences its
    apps, the other box takes over; on SIGCONT its write is refused (rowcount 0), it
    finds its leases lost and self-fences, and it spawns and switches nothing."""
    a, b = boxes("a"), boxes("b")
    add_hosts(a, ["steady"], "a,b")
    gate = a.state_dir.parent / "gate"  # slow answers its health check once this exists
    a.run("host", "add", "slow", "--build", str(GATED), "--box", "a", "--box", "b",
          "--env", f"GATE={gate}", "--env", f"THEN={HELLO}", "--health-timeout", "60")
    pa = a.start()
    a.run("wake", "steady", "--wait", "--timeout", "60")
    a.run("wake", "slow")
    # Its pid recorded: the drive is past its last write before the readiness wait, in
    # which it only glances at the store (a freeze inside a write, which PostgreSQL ends
    # after 10 s idle in a transaction, would fail the drive on its own connection).
    wait_for(lambda: a.status("slow")["state"] == "waking" and a.app_procs().get("slow")
             and a.store.read(lambda s: s.execute(select(Generation.pid).where(
                 Generation.host == "slow", Generation.pid.is_not(None))).scalar()), 30,
             what="a health-checking slow, its pid recorded")
    pa.send_signal(signal.SIGSTOP)
    stopped_at = utcnow()
    gate.touch()
    b.start()
    try:
        wait_for(lambda: serving(b, ["steady", "slow"], {"b"}), 60, interval=0.25,
                 what="b serving both hosts")
        assert not a.app_procs(), "a's keeper did not fence its apps"
        before = {n: b.status(n)["pid"] for n in ("steady", "slow")}
        log_at = len(a.agent_log())
    finally:
        pa.send_signal(signal.SIGCONT)
    resumed = utcnow()

    def after() -> str:
        return a.agent_log()[log_at:].decode()

    wait_for(lambda: "self-fenced hosts=slow,steady" in after(), 30, what="a finds its leases lost")
    wait_for(lambda: re.search(r"drive kind=wake .*host=slow result=poked error='LostRace", after()),
             30, what="a's write of the interrupted wake refused")

    def heartbeat() -> float:
        return a.store.read(lambda s: s.get(Agent, "a").heartbeat_at).timestamp()

    beat = heartbeat()
    wait_for(lambda: heartbeat() > beat + 1.5, 30, what="a's safety sweep running twice more")
    assert pa.poll() is None
    spawned = a.store.read(lambda s: s.execute(select(Generation.id).where(
        Generation.agent_id == "a", Generation.created_at >= stopped_at)).all())
    assert not spawned, "a spawned after it was stopped"
    assert not a.app_procs()
    assert {n: b.status(n)["pid"] for n in ("steady", "slow")} == before  # nothing switched
    assert set(leases(a).values()) == {"b"}
    assert a.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "self_fenced", Event.at >= resumed)).scalars().all())


def test_two_agents_drain_obligations_each_exactly_once(boxes) -> None:  # type: ignore[no-untyped-def]
    """DRAINED stop obligations (2,000 with VIGIL_LONG=1) on unplaced hosts, drained by two
    agents together: each row is resolved once, by one agent, and no row is ever driven by
    both (claims)."""
    a, b = boxes("a"), boxes("b")
    a.start()
    b.start()
    n = DRAINED
    path, digest = stage_build(str(HELLO), a.state_dir)
    started = time.monotonic()

    def seed(s):  # type: ignore[no-untyped-def]
        now = utcnow()
        build = s.execute(insert(Build).values(digest=digest, path=path, source=str(HELLO),
                                               created_at=now).returning(Build.id)).scalar_one()
        s.execute(insert(Host), [dict(name=f"d{i:04d}", kind=HostKind.instance, build_id=build,
                                      created_at=now) for i in range(n)])
        s.execute(insert(Stop), [dict(host=f"d{i:04d}", state=StopState.queued, since=now,
                                      next_attempt_at=now, created_at=now) for i in range(n)])

    a.store.write(seed)
    notify_boxes(a.store)

    def open_stops() -> int:
        return len(a.store.read(lambda s: s.execute(select(Stop.id).where(
            Stop.state != StopState.done)).all()))

    wait_for(lambda: open_stops() == 0, 200, interval=0.5, what=f"{n} stops drained")
    print(f"drained {n} in {time.monotonic() - started:.1f}s")
    stopped = Counter(a.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "stopped")).scalars().all()))
    assert len(stopped) == n and set(stopped.values()) == {1}
    drives: dict[str, Counter[str]] = {}

    def logged() -> int:  # an agent logs a drive after its commit: the last lines may lag
        drives.clear()
        for box in (a, b):
            for kind, rid, result in re.findall(r"drive kind=(\w+) id=(\d+) host=\S+ result=(\w+)",
                                                box.agent_log().decode()):
                drives.setdefault(result, Counter())[f"{box.name}:{kind}:{rid}"] += 1
        return len({k.split(":", 1)[1] for k in drives.get("progress", {})})

    wait_for(lambda: logged() >= n, 10, what=f"{n} drives logged")
    progress = Counter(k.split(":", 1)[1] for k in drives.get("progress", {}))
    assert len(progress) == n and set(progress.values()) == {1}  # once each, by one agent
    per_box = Counter(k.split(":")[0] for k in drives.get("progress", {}))
    print(f"resolved per box: {dict(per_box)}; other results: "
          f"{ {r: sum(c.values()) for r, c in drives.items() if r != 'progress'} }")
    assert per_box["a"] > 0 and per_box["b"] > 0
    assert not drives.get("poked"), "a row was driven by both agents"
    assert not a.store.read(lambda s: s.execute(select(Host.name).join(
        Lease, Lease.host == Host.name)).first())
