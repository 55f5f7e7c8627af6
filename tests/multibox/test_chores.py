"""The store-wide chores done by one agent of the fleet (issue 28 item 1): of two boxes on
one store exactly one holds them (the history prune and the scheduled restarts' job store,
which APScheduler must never share between schedulers); SIGKILL its agent and the other box
takes them once their expiry (the store's clock) has passed, within TTL + 5 s; a clean stop
hands them over at once. Each holder is a new epoch, each taking an event."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import select

from models.tables import Chore, Event
from tests.conftest import wait_for
from tests.multibox.conftest import LEASE_TTL

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.postgresql_only("several boxes share one PostgreSQL store")]
RUNS = b"runs the store-wide chores"


def test_one_box_holds_the_chores_and_another_takes_them_when_it_dies(boxes) -> None:  # type: ignore[no-untyped-def]
    a, b = boxes("a"), boxes("b")
    a.start()
    b.start()

    def holder() -> tuple[str | None, int]:
        row = a.store.read(lambda s: s.execute(select(Chore.holder, Chore.epoch)).one())
        return row[0], row[1]

    first, epoch = holder()
    assert first == "a" and epoch == 1, (first, epoch)
    assert RUNS in a.agent_log() and RUNS not in b.agent_log()

    a.agent().send_signal(signal.SIGKILL)
    a.agent().wait(10)
    t0 = time.monotonic()
    wait_for(lambda: holder()[0] == "b", LEASE_TTL + 5, what="box b takes the chores")
    took = time.monotonic() - t0
    wait_for(lambda: RUNS in b.agent_log(), 10, what="box b attaches the job store")
    assert holder()[1] == 2
    print(f"chores taken over {took:.1f} s after the kill (TTL {LEASE_TTL:g} s)")

    # A clean stop lets them go at once: box a, started again, takes them from no one.
    a.start()
    b.agent().send_signal(signal.SIGTERM)
    b.agent().wait(30)
    t1 = time.monotonic()
    wait_for(lambda: holder()[0] == "a", LEASE_TTL, what="box a takes the let-go chores")
    assert time.monotonic() - t1 < LEASE_TTL - 1, "it waited for an expiry, not a let-go"
    kinds = a.store.read(lambda s: s.execute(select(Event.detail).where(
        Event.kind == "chores_taken").order_by(Event.id)).scalars().all())
    assert len(kinds) == 3 and all('"epoch": ' in k for k in kinds), kinds
