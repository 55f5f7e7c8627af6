"""What one firing of a scheduled restart writes: an attempt with cause `restart` onto the
build the host runs now (overlap for instances; request_deploy makes it hold for workers).
One short transaction; the agent drives the attempt like any other."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import present
from models.states import Cause, GenState, Mode
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host
from workflows.base.lookups import open_attempt
from workflows.builds.book import held, held_line
from workflows.deploys.request import request_deploy

# A second firing this soon after a restart attempt is a repeat (the agent died after the
# attempt was written and before the job store recorded the run): a cron fires at most
# once a minute.
REPEAT_WINDOW = timedelta(seconds=55)


def request_restart(s: Session, host: str) -> Attempt | None:
    """The restart attempt, or None (with a `restart_skipped` event saying why)."""
    skip = _why_not(s, host)
    if skip is not None:
        emit(s, "restart_skipped", host, reason=skip)
        return None
    gen = s.execute(select(Generation).where(Generation.host == host,
                                             Generation.state == GenState.current)
                    .order_by(Generation.slot).limit(1)).scalar_one()  # instances: slot 0's
    build = present(s.get(Build, gen.build_id), "build is missing")
    return request_deploy(s, host, build, mode=Mode.overlap, canary=False, cause=Cause.restart)


def _why_not(s: Session, host: str) -> str | None:
    if s.get(Host, host) is None:
        return "the host no longer exists"
    running = s.execute(select(Generation.build_id).where(
        Generation.host == host, Generation.state == GenState.current)).first()
    if running is None:
        return "the host is not running"
    hold = held(s, host, running.build_id)
    if hold is not None:  # the failure book
        return held_line(hold)
    busy = open_attempt(s, host)
    if busy is not None:
        return f"attempt #{busy} is in flight"  # a restart would supersede it
    recent = s.execute(select(Attempt.id).where(
        Attempt.host == host, Attempt.cause == Cause.restart,
        Attempt.created_at > utcnow() - REPEAT_WINDOW).limit(1)).scalar()
    if recent is not None:
        return f"restart attempt #{recent} was written moments ago"
    return None
