"""A rollout over two boxes sharing PostgreSQL: targets leased on both, each box drives the
attempts of the hosts it holds, either box advances the rollout row; one box is killed -9
mid-wave and the rollout completes after the other takes its hosts over."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import select, update

from models.states import Cause, GenState, Outcome, RolloutOutcome, RolloutState
from models.tables import Attempt, Event, Generation, Host, Lease, Rollout
from tests.conftest import wait_for
from tests.integration.test_rollouts import build_variant
from tests.multibox.conftest import Box
from tests.multibox.test_multibox import add_hosts, leases, serving, wake_all

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.postgresql_only("several boxes share one PostgreSQL store")]

NAMES = [f"r{i}" for i in range(6)]


def place(box: Box, names: list[str], where: str) -> None:
    box.store.write(lambda s: s.execute(update(Host).where(Host.name.in_(names)).values(box=where)))


def rollout_row(box: Box) -> Rollout:
    return box.store.read(lambda s: s.execute(select(Rollout)).scalar_one())


def test_rollout_completes_after_a_box_dies_mid_wave(boxes) -> None:  # type: ignore[no-untyped-def]
    a, b = boxes("a"), boxes("b")
    add_hosts(a, NAMES, "a,b")
    # One staging root for both boxes (README: the staged file at the same path on every
    # box): on one machine, b's builds/ is a's.
    (b.state_dir / "builds").symlink_to(a.state_dir / "builds")
    # Half the hosts on each box: woken while placed there alone, then placed on both (so
    # either may take the other's over).
    place(a, NAMES[:3], "a")
    place(a, NAMES[3:], "b")
    a.start()
    b.start()
    wake_all(a, NAMES)
    wait_for(lambda: serving(a, NAMES, {"a", "b"}), 120, interval=0.5, what="6 hosts awake")
    place(a, NAMES, "a,b")
    owner = leases(a)
    assert {owner[n] for n in NAMES[:3]} == {"a"} and {owner[n] for n in NAMES[3:]} == {"b"}

    new = build_variant(a.state_dir.parent / "hello-next.py")
    # Wave 1 is r0 (on a); wave 2 is every other host, on both boxes. The canary's settle
    # (0.5 s on these boxes) keeps b's attempts in flight when it dies.
    out = a.run("rollout", "start", str(new), "--hosts", "r*", "--waves", "1,100%",
                "--canary").stdout
    rid = int(out.split("#", 1)[1].split(" ", 1)[0])
    wait_for(lambda: rollout_row(a).wave == 2, 90, interval=0.1, what="wave 2 admitted")
    wait_for(lambda: a.store.read(lambda s: s.execute(select(Attempt.id).where(
        Attempt.host.in_(NAMES[3:]), Attempt.cause == Cause.rollout,
        Attempt.outcome.is_(None), Attempt.step != "queued")).first()), 60, interval=0.05,
        what="one of b's attempts under way")
    killed_at = time.time()
    b.agent().send_signal(signal.SIGKILL)
    b.agent().wait(10)

    wait_for(lambda: rollout_row(a).state is RolloutState.ended, 200, interval=0.5,
             what="the rollout to end after the takeover")
    print(f"rollout ended {time.time() - killed_at:.1f}s after the kill")
    r = rollout_row(a)
    assert r.id == rid and r.outcome is RolloutOutcome.done, r.reason
    assert len(a.store.read(lambda s: s.execute(select(Event.id).where(
        Event.kind == "rollout_ended")).all())) == 1
    wait_for(lambda: serving(a, NAMES, {"a"}), 60, interval=0.5, what="a serving every host")
    assert set(leases(a).values()) == {"a"}
    taken = a.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "taken_over")).scalars().all())
    assert sorted(taken) == NAMES[3:]
    # Every host runs the new build, in a generation a made.
    currents = a.store.read(lambda s: s.execute(select(Generation.host, Generation.build_id,
                                                       Generation.agent_id).join(
        Lease, Lease.host == Generation.host).where(Generation.state == GenState.current)).all())
    assert sorted(h for h, build, agent in currents if build == r.build_id and agent == "a") == NAMES
    # b's interrupted attempts were abandoned, never failed, and nothing is held down.
    outcomes = a.store.read(lambda s: s.execute(select(Attempt.host, Attempt.outcome).where(
        Attempt.cause == Cause.rollout)).all())
    for row in a.store.read(lambda s: s.execute(select(
            Attempt.id, Attempt.host, Attempt.outcome, Attempt.executed, Attempt.reason).where(
            Attempt.cause == Cause.rollout).order_by(Attempt.id)).all()):
        print(*row)
    assert not [h for h, o in outcomes if o in (Outcome.failed, Outcome.down)], outcomes
    assert not b.app_procs()
    a.quiesce(60)
    a.check()
