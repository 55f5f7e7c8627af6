"""The failure book, and what an attempt's end tells its rollout.

A build whose attempt ended `failed` or `down` on a host is *held down* there: no restart,
converge, scheduled restart or rollout puts it back on that host until `vigil retry HOST`
lifts it (the retry then runs it again). An operator's explicit `vigil deploy` of it still
runs, and says it was held down; an attempt of it that ends `done` lifts it (the host runs
it now). Only the build's own failure is written here (workflows/base/classify.py decides):
an abandoned or cancelled attempt never is.

Every path that ends an attempt calls `attempt_ended` in the transaction that ends it, so
the book and the rollout waiting for that attempt never miss it.
"""

from __future__ import annotations

import importlib

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.orm import Session

from models.states import IN_FLIGHT, OPEN_ROLLOUT, Cause, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, HeldBuild, Rollout, RolloutTarget
from models.transition import affected

_T = RolloutTarget.__table__.c
_R = Rollout.__table__
# A rollout with a target of this host in flight is due now (its wave may have settled);
# pacing only (no state moves), so any writer may do it.
_NUDGE = update(_R).where(
    _R.c.state.in_(OPEN_ROLLOUT),
    _R.c.id.in_(select(_T.rollout_id).where(_T.host == bindparam("host"), _T.state.in_(IN_FLIGHT))),
).values(next_attempt_at=bindparam("now"), attempts=0)
_HELD = select(HeldBuild).where(HeldBuild.host == bindparam("host"),
                                HeldBuild.build_id == bindparam("build"))


def held(s: Session, host: str, build_id: int) -> HeldBuild | None:
    """The book's entry holding `build_id` down on `host`, if any."""
    return s.execute(_HELD, {"host": host, "build": build_id}).scalar_one_or_none()


def held_line(h: HeldBuild) -> str:
    """One line an operator reads: what is held down, since when, why, and the way out."""
    return (f"build {h.digest[:12]} is held down on {h.host} since attempt #{h.attempt_id} "
            f"failed ({h.reason or 'no reason recorded'}); `vigil retry {h.host}` lifts it")


def hold_down(s: Session, a: Attempt, reason: str) -> None:
    """In the transaction that ends `a` failed or down: its build is held down on its host."""
    values = {"host": a.host, "build_id": a.build_id, "digest": a.digest, "attempt_id": a.id,
              "reason": reason, "since": utcnow()}
    # The dialect's own upsert, imported here: the PostgreSQL dialect costs a SQLite start.
    name = "postgresql" if s.get_bind().dialect.name == "postgresql" else "sqlite"
    dialect = importlib.import_module(f"sqlalchemy.dialects.{name}")
    stmt = dialect.insert(HeldBuild.__table__).values(**values)
    s.execute(stmt.on_conflict_do_update(
        index_elements=["host", "build_id"],
        set_={"attempt_id": a.id, "reason": reason, "since": values["since"]}))
    emit(s, "held_down", a.host, attempt=a.id, build=a.digest[:12], reason=reason)


def lift(s: Session, host: str, build_id: int, why: str) -> bool:
    """The build is no longer held down on the host. True when it was."""
    gone = affected(s.execute(delete(HeldBuild).where(HeldBuild.host == host,
                                                      HeldBuild.build_id == build_id)))
    if gone:
        emit(s, "hold_lifted", host, build_id=build_id, reason=why)
    return bool(gone)


def deploying_held(s: Session, a: Attempt) -> str | None:
    """An operator's deploy of a build held down on its host: it runs all the same; the
    line saying so, also written as an event (None when the build is not held down)."""
    h = held(s, a.host, a.build_id)
    if h is None:
        return None
    emit(s, "deploy_held_down", a.host, attempt=a.id, failed_attempt=h.attempt_id,
         build=a.digest[:12])
    return held_line(h)


def attempt_ended(s: Session, a: Attempt, outcome: Outcome, reason: str | None = None) -> None:
    """In the transaction that ends attempt `a` with `outcome`: the failure book, and the
    rollout that wrote it is due at once (its wave may have settled)."""
    if outcome in (Outcome.failed, Outcome.down):
        hold_down(s, a, reason or outcome.value)
    elif outcome is Outcome.done:
        lift(s, a.host, a.build_id, f"attempt #{a.id} of it is done")
    if a.cause is Cause.rollout:
        nudge(s, a.host)


def nudge(s: Session, host: str) -> None:
    """Rollouts with a target of `host` in flight are due now: for the paths that end
    attempts of a host in bulk (a stop, a takeover)."""
    s.execute(_NUDGE, {"host": host, "now": utcnow()})


def nudge_many(s: Session, hosts: list[str]) -> None:
    """nudge() of several hosts in one statement (a takeover of a whole box)."""
    if hosts:
        s.execute(update(_R).where(_R.c.state.in_(OPEN_ROLLOUT), _R.c.id.in_(
            select(_T.rollout_id).where(_T.host.in_(hosts), _T.state.in_(IN_FLIGHT))))
            .values(next_attempt_at=utcnow(), attempts=0))
