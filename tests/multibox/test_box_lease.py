"""Ownership per box (issue 28 item 2): one box lease row per agent, renewed by one UPDATE;
host leases written only on acquire, release and takeover; a dead box's hosts taken over in
a few set-based statements, dealt over the live boxes they are placed on; a box that comes
back after its lease expired finds its hosts gone and can write nothing under its old fences.
(PostgreSQL, in-process contexts standing for the boxes: no agent, no app.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, update

from models.errors import LostRace
from models.states import Desired, HostKind
from models.store import utcnow
from models.tables import BoxLease, Event, Host, Lease
from models.transition import Fence, move
from runners.backend.files import stage_build
from runners.wiring import make_context
from tests.conftest import HELLO, Vigil
from workflows.base.context import Poke
from workflows.config.hosts import add_host
from workflows.leases import box
from workflows.leases.lease import acquire, renew_held, renew_in
from workflows.lifecycle.takeover import orphans, take_over

pytestmark = pytest.mark.postgresql_only("several boxes share one PostgreSQL store")

TTL = 30.0


@contextmanager
def statements(v: Vigil) -> Iterator[list[tuple[str, int]]]:
    """Every statement the store's engine sends meanwhile, with the rows it matched."""
    seen: list[tuple[str, int]] = []

    def after(conn: Any, cursor: Any, stmt: str, params: Any, context: Any, many: bool) -> None:
        seen.append((" ".join(stmt.split()), cursor.rowcount))

    event.listen(v.store.engine, "after_cursor_execute", after)
    try:
        yield seen
    finally:
        event.remove(v.store.engine, "after_cursor_execute", after)


def writes(seen: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(q, n) for q, n in seen if q.split()[0] in ("UPDATE", "INSERT", "DELETE")]


def hosts(v: Vigil, n: int, placed: str) -> list[str]:
    names = [f"h{i:02d}" for i in range(n)]
    path, digest = stage_build(str(HELLO), v.state_dir)
    v.store.write(lambda s: [add_host(
        s, name, kind=HostKind.worker, build_path=path, digest=digest, source=str(HELLO),
        args=[], env={}, cwd=None, drain_timeout=2.0, health_timeout=5.0, box=placed)
        for name in names])
    # Wanted up, so a takeover queues a wake and keeps the lease (no agent drives it here).
    v.store.write(lambda s: s.execute(update(Host).values(desired=Desired.up)))
    return names


def ctx(v: Vigil, box: str) -> Any:
    return make_context(v.state_dir, v.store, box, lease_ttl=TTL)


def expire(v: Vigil, box: str) -> None:
    v.store.write(lambda s: s.execute(update(BoxLease).where(BoxLease.box == box).values(
        expires_at=utcnow() - timedelta(seconds=1))))  # not overdue: dealt


def holders(v: Vigil) -> dict[str, tuple[str, int]]:
    return {h: (holder, epoch) for h, holder, epoch in v.store.read(lambda s: s.execute(
        select(Lease.host, Lease.holder, Lease.epoch)).all())}


def test_renewal_is_one_row_per_box_whatever_its_hosts(vigil: Vigil) -> None:
    names = hosts(vigil, 20, "a,b")
    a = ctx(vigil, "a")
    vigil.store.write(lambda s: [acquire(s, a, n) for n in names])
    before = vigil.store.read(lambda s: s.execute(
        select(Lease.host, Lease.fence, Lease.acquired_at, Lease.expires_at)).all())

    with statements(vigil) as seen:
        held = renew_held(a)
    assert held == set(names)
    assert writes(seen) == [(q, 1) for q, _ in writes(seen)] and len(writes(seen)) == 1, seen
    assert writes(seen)[0][0].startswith("UPDATE box_leases"), seen

    with statements(vigil) as seen:  # the sweep's: none until past half its length
        vigil.store.write(lambda s: renew_in(s, a))
    assert [n for q, n in writes(seen)] == [0], seen
    # The host lease rows were not written by either renewal.
    assert vigil.store.read(lambda s: s.execute(
        select(Lease.host, Lease.fence, Lease.acquired_at, Lease.expires_at)).all()) == before


def test_a_dead_box_s_20_hosts_are_dealt_over_two_survivors_set_based(vigil: Vigil) -> None:
    names = hosts(vigil, 20, "a,b,c")
    a, b, c = ctx(vigil, "a"), ctx(vigil, "b"), ctx(vigil, "c")
    vigil.store.write(lambda s: [acquire(s, a, n) for n in names])
    renew_held(b)
    renew_held(c)
    expire(vigil, "a")
    # Each survivor computes the same deal: disjoint shares, both taking some, covering
    # every host; the deal is the same once the other survivor took its share.
    share_b, share_c = orphans(b), orphans(c)
    print(f"dealt: b {len(share_b)}, c {len(share_c)}")
    assert share_b and share_c and not set(share_b) & set(share_c)
    assert set(share_b) | set(share_c) == set(names)

    with statements(vigil) as seen:
        assert take_over(b) == len(share_b)
    lease_cas = [(q, n) for q, n in seen if q.startswith("UPDATE leases SET holder")]
    assert lease_cas == [(lease_cas[0][0], len(share_b))], lease_cas  # one for all of them
    print(f"takeover of {len(share_b)} hosts: {len(seen)} statements, {len(writes(seen))} writes")
    assert len(seen) < 8 * len(share_b), seen  # ~33 a host when taken one by one
    assert orphans(c) == share_c
    assert take_over(c) == len(share_c)
    assert take_over(b) == take_over(c) == 0

    held = holders(vigil)
    epochs = dict(vigil.store.read(lambda s: s.execute(select(BoxLease.box, BoxLease.epoch)).all()))
    assert {h for h, (who, _) in held.items() if who == "b"} == set(share_b)
    assert {h for h, (who, _) in held.items() if who == "c"} == set(share_c)
    assert all(epoch == epochs[who] for who, epoch in held.values())
    taken = vigil.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "taken_over")).scalars().all())
    assert sorted(taken) == sorted(names)  # each once


def test_a_box_back_after_its_lease_expired_is_fenced(vigil: Vigil) -> None:
    names = hosts(vigil, 4, "a,b")
    a, b = ctx(vigil, "a"), ctx(vigil, "b")
    fences = {n: vigil.store.write(lambda s, n=n: acquire(s, a, n)) for n in names}
    renew_held(b)
    expire(vigil, "a")
    assert take_over(b) == len(names)

    # a comes back: its renewal takes its box lease at a new epoch and holds nothing.
    assert renew_held(a) == set()
    (epoch,) = vigil.store.read(lambda s: s.execute(
        select(BoxLease.epoch).where(BoxLease.box == "a")).one())
    assert epoch == 2
    # Its writes under its old fences are refused; it cannot take a host back from b.
    for n in names:
        with pytest.raises(LostRace):
            vigil.store.write(lambda s, n=n: move(
                s, Host, {"name": n}, {"desired": Desired.down}, f"host {n}",
                fence=Fence(n, "a", fences[n]), col="desired", frm=tuple(Desired)))
        with pytest.raises(Poke, match="held by agent b"):
            vigil.store.write(lambda s, n=n: acquire(s, a, n))
    assert {who for who, _ in holders(vigil).values()} == {"b"}


def test_an_idle_box_writes_its_heartbeat_every_few_seconds_not_every_sweep(vigil: Vigil) -> None:
    """Sweeps a second apart: each checks the box lease, the second writes no agents row
    (HEARTBEAT_EVERY), a sweep past it writes one again."""
    from types import SimpleNamespace

    from runners.agent.sweep import HEARTBEAT_EVERY, Heartbeat
    from workflows.leases import box

    a = ctx(vigil, "a")
    vigil.store.write(lambda s: box.hold(s, a))
    agent = Heartbeat(a, SimpleNamespace(tick=lambda: None), None, None)  # type: ignore[arg-type]
    beats = []
    for _ in range(2):
        with statements(vigil) as seen:
            agent.beat()
        beats.append([q.split()[1] for q, _ in writes(seen)])
    assert beats == [["box_leases", "agents"], ["box_leases"]], beats
    agent.heartbeat_at -= HEARTBEAT_EVERY  # as if HEARTBEAT_EVERY had passed
    with statements(vigil) as seen:
        agent.beat()
    assert [q.split()[1] for q, _ in writes(seen)] == ["box_leases", "agents"], seen


def test_a_transaction_reads_its_box_epoch_once(vigil: Vigil) -> None:
    """A group of wakes leases each of its hosts in one commit: the box's live epoch is read
    once in it, again after a hold in it, and afresh in the next transaction (where an
    expired box lease is taken anew and its new epoch is the one the leases carry)."""
    names = hosts(vigil, 5, "a")
    a = ctx(vigil, "a")
    renew_held(a)

    def epoch_reads(seen: list[tuple[str, int]]) -> int:
        return sum(q.startswith("SELECT box_leases.epoch, box_leases.expires_at") for q, _ in seen)

    with statements(vigil) as seen:
        vigil.store.write(lambda s: [acquire(s, a, n) for n in names[:3]])
    assert epoch_reads(seen) == 1, seen

    with statements(vigil) as seen:
        vigil.store.write(lambda s: (acquire(s, a, names[3]), box.hold(s, a), acquire(s, a, names[4])))
    assert epoch_reads(seen) == 2, seen

    expire(vigil, "a")
    old = vigil.store.read(lambda s: s.get(BoxLease, "a").epoch)
    vigil.store.write(lambda s: [acquire(s, a, n) for n in names])  # a new epoch, re-taken
    new = vigil.store.read(lambda s: s.get(BoxLease, "a").epoch)
    assert new > old
    assert {epoch for _, epoch in holders(vigil).values()} == {new}
