"""The one place a wake is queued: every cause (an operator's wake, a restart, a deploy of
a host that was down, a takeover, a worker's converge or recycle) writes the same row."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from models.states import WakeState
from models.store import utcnow
from models.tables import Wake


def enqueue_wake(s: Session, host: str, cause: str, *, build_id: int | None = None,
                 delay: float = 0.0) -> Wake:
    """A queued wake of `host`, due after `delay` seconds, in the caller's transaction.
    `build_id` pins the build it starts (a worker's restart onto its captured build)."""
    now = utcnow()
    w = Wake(host=host, state=WakeState.queued, cause=cause, build_id=build_id, since=now,
             next_attempt_at=now + timedelta(seconds=delay), created_at=now)
    s.add(w)
    return w
