"""The one place a wake is queued: every cause (an operator's wake, a restart, a deploy of
a host that was down, a takeover, a worker's converge or recycle) writes the same row."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from models.states import OPEN_WAKE, GenState, WakeState
from models.store import utcnow
from models.tables import Generation, Host, Wake


def enqueue_wake(s: Session, host: str, cause: str, *, build_id: int | None = None,
                 delay: float = 0.0, slot: int = 0) -> Wake:
    """A queued wake of `host` (of its instance `slot`), due after `delay` seconds, in the
    caller's transaction. `build_id` pins the build it starts (a worker's restart onto its
    captured build)."""
    now = utcnow()
    w = Wake(host=host, state=WakeState.queued, cause=cause, build_id=build_id, since=now,
             next_attempt_at=now + timedelta(seconds=delay), created_at=now, slot=slot)
    s.add(w)
    return w


_INSTANCES = select(Host.__table__.c.instances).where(Host.__table__.c.name == bindparam("host"))
_BUSY_SLOTS = select(Generation.__table__.c.slot).where(
    Generation.__table__.c.host == bindparam("host"),
    Generation.__table__.c.state == GenState.current).union(
    select(Wake.__table__.c.slot).where(Wake.__table__.c.host == bindparam("host"),
                                        Wake.__table__.c.state.in_(OPEN_WAKE)))


def enqueue_slots(s: Session, host: str, cause: str, instances: int) -> list[Wake]:
    """A host of instances brought up: a queued wake of each slot that has neither a
    current generation nor an open wake (none: every slot is up or on its way)."""
    busy = set(s.execute(_BUSY_SLOTS, {"host": host}).scalars())
    return [enqueue_wake(s, host, cause, slot=n) for n in range(instances) if n not in busy]


def wake_host(s: Session, host: str, cause: str) -> Wake | None:
    """The host brought up, whatever its instances: one wake for a host of one (as
    enqueue_wake), a wake of each slot not up yet for more; returns the first."""
    n = s.execute(_INSTANCES, {"host": host}).scalar() or 1
    if n == 1:
        return enqueue_wake(s, host, cause)
    woken = enqueue_slots(s, host, cause, n)
    return woken[0] if woken else None
