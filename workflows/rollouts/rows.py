"""A rollout's rows and what they read: the rollout and its targets moved by
compare-and-set, the attempts they name, and the facts about a host that decide whether
a rollout still deploys to it (held down, already on the build, superseded)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import NotFound
from models.states import IN_FLIGHT, AttemptStep, Cause, GenState, Outcome, TargetState
from models.store import utcnow
from models.tables import Attempt, Build, Generation, Host, Rollout, RolloutTarget
from models.transition import Unfenced, move, move_many
from workflows.builds.book import held, held_line

# Moves that carry no lease fence, each with the reason it needs none.
BY_ROLLOUT = Unfenced("a rollout belongs to no host: its own state and wave counters (and each "
                      "target's state and attempt) guard it, and any agent may advance it")
NOT_STARTED = Unfenced("an attempt still queued: its own step guards it, nothing of it has run")


def mark(r: Rollout) -> str:
    """How the reason of an attempt this rollout cancelled begins."""
    return f"rollout #{r.id} "


def get_rollout(s: Session, rollout_id: int) -> Rollout:
    r = s.get(Rollout, rollout_id)
    if r is None:
        raise NotFound(f"no rollout #{rollout_id}", "see `vigil rollout list`")
    return r


def attempt_of(t: RolloutTarget) -> int | None:
    return t.revert_attempt_id if t.state is TargetState.reverting else t.attempt_id


def load_attempts(s: Session, ids: list[int | None]) -> dict[int | None, Attempt]:
    wanted = [i for i in ids if i is not None]
    if not wanted:
        return {}
    return {a.id: a for a in s.execute(select(Attempt).where(Attempt.id.in_(wanted))).scalars()}


def superseded(s: Session, r: Rollout, host: str, after: int) -> str | None:
    """What took the host from this rollout after attempt id `after`: a newer deploy, retry
    or rollout's attempt (an older rollout's does not count, nor a scheduled restart)."""
    newer = s.execute(select(Attempt.id, Attempt.cause).where(
        Attempt.host == host, Attempt.id > after, Attempt.cause != Cause.restart)
        .order_by(Attempt.id)).all()
    if not newer:
        return None
    older = set()
    for a_id, rev_id in s.execute(select(RolloutTarget.attempt_id, RolloutTarget.revert_attempt_id)
                                  .where(RolloutTarget.host == host,
                                         RolloutTarget.rollout_id < r.id)):
        older |= {a_id, rev_id}
    for a_id, cause in newer:
        if a_id not in older:
            return f"superseded by attempt #{a_id} (cause {cause.value})"
    return None


def on_build(s: Session, host: str, build_id: int) -> bool:
    """The host is on the build: its live build, and its current generation's if it runs."""
    h = s.get(Host, host)
    return h is not None and h.build_id == build_id and running_build(s, host) == build_id


def running_build(s: Session, host: str) -> int | None:
    running = s.execute(select(Generation.build_id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar()
    if running is not None:
        return int(running)
    h = s.get(Host, host)
    return h.build_id if h is not None else None


def skip_reason(s: Session, host: str, build: Build) -> str | None:
    """Why a rollout of `build` does not deploy to `host` (at its start and at its wave)."""
    h = held(s, host, build.id)
    if h is not None:
        return held_line(h)
    if on_build(s, host, build.id):
        return f"already on build {build.digest[:12]}"
    return None


def move_rollout(s: Session, r: Rollout, values: dict[str, Any], what: str) -> None:
    """The rollout row, only while it is where this step read it (state, wave, settled)."""
    move(s, Rollout, {"id": r.id, "wave": r.wave, "settled": r.settled}, values,
         f"rollout #{r.id} {what}", fence=BY_ROLLOUT, col="state", frm=r.state)


def move_target(s: Session, r: Rollout, t: RolloutTarget, values: dict[str, Any],
                what: str) -> None:
    """A target, only while it is where this step read it (state and its attempt)."""
    col = "revert_attempt_id" if t.state is TargetState.reverting else "attempt_id"
    move(s, RolloutTarget, {"rollout_id": r.id, "host": t.host, col: getattr(t, col)}, values,
         f"target {t.host} of rollout #{r.id} {what}", fence=BY_ROLLOUT, col="state",
         frm=t.state)


def cancel_queued(s: Session, r: Rollout, why: str) -> int:
    """The rollout's attempts in flight that have not started: ended, cancelled, nothing of
    them ran. (One the host's driver admitted meanwhile is left to finish.)"""
    ids = [attempt_of(t) for t in s.execute(select(RolloutTarget).where(
        RolloutTarget.rollout_id == r.id, RolloutTarget.state.in_(IN_FLIGHT))).scalars()]
    ids = [i for i in ids if i is not None]
    if not ids:
        return 0
    return move_many(s, Attempt, [Attempt.id.in_(ids), Attempt.outcome.is_(None)],
                     {"step": AttemptStep.ended, "outcome": Outcome.cancelled, "executed": False,
                      "reason": f"{mark(r)}{why} before this attempt started",
                      "ended_at": utcnow()},
                     f"queued attempts of rollout #{r.id} cancelled", fence=NOT_STARTED,
                     col="step", frm=AttemptStep.queued)
