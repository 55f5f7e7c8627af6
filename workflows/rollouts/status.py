"""What operators read: one rollout with every target and its attempts, or the list."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.durations import iso
from models.errors import NotFound
from models.states import RolloutState
from models.tables import Attempt, Rollout, RolloutTarget
from workflows.rollouts.rows import get_rollout, load_attempts


def _attempt_row(a: Attempt | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"id": a.id, "step": a.step.value, "outcome": a.outcome.value if a.outcome else None,
            "executed": a.executed, "drain_seconds": a.drain_seconds, "reason": a.reason,
            "mode": a.effective_mode.value}


def rollout_status(s: Session, rollout_id: int | None = None) -> dict[str, Any]:
    """One rollout (the newest without an id): its state, progress, and every target with
    its attempt and revert attempt."""
    if rollout_id is None:
        newest = s.execute(select(func.max(Rollout.id))).scalar()
        if newest is None:
            raise NotFound("no rollout yet", "start one with `vigil rollout start BUILD --hosts GLOB`")
        rollout_id = int(newest)
    r = get_rollout(s, rollout_id)
    targets = list(s.execute(select(RolloutTarget).where(RolloutTarget.rollout_id == r.id)
                             .order_by(RolloutTarget.wave == 0, RolloutTarget.position)).scalars())
    attempts = load_attempts(s, [t.attempt_id for t in targets] + [t.revert_attempt_id for t in targets])
    counts = Counter(t.state.value for t in targets)
    return {
        **_summary_row(r, counts, len(targets)),
        "canary": r.canary, "pause": r.pause, "max_failures": r.max_failures,
        "auto_revert": r.auto_revert, "reason": r.reason,
        "next_wave_at": iso(r.wave_due_at), "ended_at": iso(r.ended_at),
        "last_error": r.last_error if r.state is not RolloutState.ended else None,
        "targets": [{"host": t.host, "wave": t.wave, "state": t.state.value, "reason": t.reason,
                     "tries": t.tries,
                     "attempt": _attempt_row(attempts.get(t.attempt_id)) if t.attempt_id else None,
                     "revert_attempt": _attempt_row(attempts.get(t.revert_attempt_id))
                     if t.revert_attempt_id else None}
                    for t in targets],
    }


def _summary_row(r: Rollout, counts: Counter[str], hosts: int) -> dict[str, Any]:
    return {"id": r.id, "build": r.digest, "mode": r.mode.value, "waves": r.waves,
            "wave": r.wave, "settled": r.settled, "wave_count": r.wave_count,
            "state": r.state.value, "outcome": r.outcome.value if r.outcome else None,
            "hosts": hosts, "moved": counts.get("done", 0), "counts": dict(counts),
            "created_at": iso(r.created_at)}


def rollout_list(s: Session) -> list[dict[str, Any]]:
    rows = s.execute(select(Rollout).order_by(Rollout.id)).scalars().all()
    counts: dict[int, Counter[str]] = {r.id: Counter() for r in rows}
    for rid, state, n in s.execute(select(RolloutTarget.rollout_id, RolloutTarget.state,
                                          func.count()).group_by(RolloutTarget.rollout_id,
                                                                 RolloutTarget.state)):
        counts[rid][state.value] += n
    return [{**_summary_row(r, counts[r.id], sum(counts[r.id].values())), "reason": r.reason}
            for r in rows]
