"""The read model of the status page (`vigil ui`) beyond `top`'s rows (glance.py): the
timeline of deploys and rollouts, told by their events, and each host's restarts over
time, counted as `top` counts them (the agent's own wakes after an exit, a recycle or a
converge, and restart attempts)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from models.durations import iso
from models.states import Cause
from models.tables import Attempt, Event, Wake
from workflows.config.glance import RESTART_WAKES

# The events a deploy or a rollout writes as it goes, in the words the page shows.
TIMELINE = {
    "deploy_requested": "deploy requested",
    "switched": "switched",
    "swapped": "swapped",
    "deploy_failed": "deploy failed",
    "held_down": "build held down",
    "deploy_held_down": "deploy held down",
    "deployed_asleep": "deployed, asleep",
    "rollout_requested": "rollout requested",
    "rollout_wave_admitted": "wave admitted",
    "rollout_wave_settled": "wave settled",
    "rollout_halted": "rollout halted",
    "rollout_revert_started": "revert started",
    "rollout_revert_settled": "revert settled",
    "rollout_paused": "rollout paused",
    "rollout_resumed": "rollout resumed",
    "rollout_aborting": "rollout aborting",
    "rollout_ended": "rollout ended",
}
# What of an event's detail the page shows: ids, builds, modes, waves and reasons, never
# anything else an event may carry.
SHOWN = ("attempt", "build", "mode", "rollout", "wave", "of", "reason", "state", "outcome")


def timeline(s: Session, since: datetime, limit: int = 200) -> list[dict[str, Any]]:
    """The deploy and rollout events since `since`, oldest first (the newest `limit`)."""
    rows = s.execute(select(Event).where(Event.kind.in_(list(TIMELINE)), Event.at >= since)
                     .order_by(Event.id.desc()).limit(limit)).scalars().all()
    out = []
    for e in reversed(rows):
        detail = json.loads(e.detail or "{}")
        out.append({"at": iso(e.at), "kind": e.kind, "what": TIMELINE[e.kind],
                    "host": e.host, "generation": e.generation_id,
                    "detail": {k: detail[k] for k in SHOWN if k in detail}})
    return out


def restarts_over_time(s: Session, since: datetime, until: datetime,
                       buckets: int) -> dict[str, list[int]]:
    """Per host with any, its restarts in each of `buckets` equal spans from since to until."""
    span = (until - since) / buckets
    out: dict[str, list[int]] = {}

    def count(host: str, at: datetime) -> None:
        i = min(buckets - 1, int((at - since) / span)) if span > timedelta(0) else 0
        out.setdefault(host, [0] * buckets)[i] += 1

    for host, at in s.execute(select(Wake.host, Wake.created_at).where(
            Wake.cause.in_(list(RESTART_WAKES)), Wake.created_at >= since)):
        count(host, at)
    for host, at in s.execute(select(Attempt.host, Attempt.created_at).where(
            Attempt.cause == Cause.restart, Attempt.created_at >= since)):
        count(host, at)
    return out


def _when(value: Any) -> str | None:
    if isinstance(value, str):  # SQLite hands a view's times back as text
        value = datetime.fromisoformat(value)
    return iso(value)


def open_obligations(s: Session) -> list[dict[str, Any]]:
    """Every row of the pending_obligations view, oldest first: what it is, since when, how
    many tries, when the next, and what it last waited for (its last_error)."""
    rows = s.execute(text("SELECT kind, host, generation, since, attempts, next_attempt_at, "
                          "last_error FROM pending_obligations ORDER BY since"))
    return [{"kind": kind, "host": host, "generation": gen, "since": _when(since),
             "attempts": attempts, "next_attempt_at": _when(due), "waiting_for": why}
            for kind, host, gen, since, attempts, due, why in rows]
